"""Schemathesis against a live server's GET /openapi.json: every documented operation gets schema-valid
(positive) and schema-violating (negative) requests; any 5xx, and any request left unanswered within the
timeout (a hang), is a failure. Shared by the runtime's and the router's fuzz tests and bench/fuzz_http.py.

A schema-valid request may be long work (many prompts, n=16, up to the context length: minutes on a loaded
2-core machine), so with `progress` (a counter the server advances while it works, e.g. its tokens) a request is
a hang only once neither an answer nor progress came within the timeout."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode

# The default test run spends seconds here; HPI_FUZZ_CASES asks for more (bench/fuzz_http.py runs 1,000+).
DEFAULT_CASES = 50
# With `progress`, the most one request may take while the server keeps working on it (past it: a timeout).
PROGRESSING_LIMIT_S = 600.0


@dataclass
class FuzzReport:
    num_cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)  # "METHOD /path -> status: body" of each 5xx or hang
    slowest_s: float = 0.0  # the longest answer

    def summary(self) -> str:
        statuses = ", ".join(f"{status}: {n}" for status, n in sorted(self.statuses.items(), key=str))
        return (f"schemathesis: {self.num_cases} cases, {len(self.failures)} server errors or hangs ({statuses}); "
                f"slowest answer {self.slowest_s:.2f} s")


def fuzz_cases() -> int:
    return int(os.environ.get("HPI_FUZZ_CASES", DEFAULT_CASES))


def fuzz_openapi(base_url: str, num_cases: int, *, exclude_paths: tuple[str, ...] = (),
                 headers: dict[str, str] | None = None, timeout_s: float = 30.0,
                 derandomize: bool = True, progress: Callable[[], float] | None = None) -> FuzzReport:
    """Spread about `num_cases` requests over the document's operations, half positive and half negative."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    if exclude_paths:
        schema = schema.exclude(path=list(exclude_paths))
    operations = [result.ok() for result in schema.get_all_operations()]
    # An operation without a body or parameters has one case; the others share the rest.
    num_with_input = sum(1 for op in operations if op.body or op.query) or 1
    per_run = max(1, (num_cases - len(operations)) // (2 * num_with_input))
    report = FuzzReport()
    session = requests.Session()
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            settings_ = settings(max_examples=per_run if operation.body or operation.query else 1, deadline=None,
                                 database=None, derandomize=derandomize, phases=[Phase.explicit, Phase.generate],
                                 suppress_health_check=list(HealthCheck))
            call = _caller(report, session, base_url, headers, timeout_s, mode, progress)
            try:
                settings_(hypothesis.given(case=operation.as_strategy(generation_mode=mode))(call))()
            except hypothesis.errors.Unsatisfiable:  # nothing to break: a GET without parameters has no negative case
                pass
    return report


def _caller(report: FuzzReport, session: requests.Session, base_url: str, headers: dict[str, str] | None,
            timeout_s: float, mode: GenerationMode, progress: Callable[[], float] | None):
    def call(case) -> None:
        report.num_cases += 1
        name = f"{case.method} {case.formatted_path} ({mode.value})"
        try:
            response = _answer(lambda timeout: case.call(base_url=base_url, session=session, headers=headers,
                                                         timeout=timeout), timeout_s, progress)
        except requests.Timeout:
            report.statuses["timeout"] += 1
            report.failures.append(f"{name}: no answer and no progress within {timeout_s} s; body {case.body!r:.2000}")
            return
        report.statuses[response.status_code] += 1
        report.slowest_s = max(report.slowest_s, response.elapsed)
        if response.status_code >= 500:
            report.failures.append(f"{name} -> {response.status_code}: {response.text[:300]}; body {case.body!r:.2000}")

    return call


def _answer(send: Callable[[float], requests.Response], timeout_s: float,
            progress: Callable[[], float] | None) -> requests.Response:
    """The response; requests.Timeout once `timeout_s` passed with neither an answer nor a change of `progress`."""
    if progress is None:
        return send(timeout_s)
    future: Future = Future()

    def run() -> None:  # a daemon thread: a real hang must not keep the test process alive
        try:
            future.set_result(send(PROGRESSING_LIMIT_S))
        except BaseException as exc:  # handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="fuzz-call", daemon=True).start()
    last, since = progress(), time.monotonic()
    while True:
        try:
            return future.result(timeout=min(1.0, timeout_s))
        except FutureTimeout:
            now, value = time.monotonic(), progress()
            if value != last:
                last, since = value, now
            elif now - since > timeout_s:
                raise requests.Timeout(f"no answer and no progress for {timeout_s} s") from None
