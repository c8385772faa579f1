"""ServerState's drain wait: it returns False on timeout (on Python 3.10 too, where asyncio.wait_for raises
asyncio.TimeoutError, not the builtin TimeoutError) and True once the last request is done."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hpi_contracts import metrics as names
from hpi_contracts.pool_profile import PoolProfile
from hpi_runtime.server.state import ServerSettings, ServerState


def test_wait_idle_times_out_while_busy_and_returns_once_idle() -> None:
    async def run() -> tuple[bool, bool]:
        state = ServerState(ServerSettings(served_model_name="m"))
        state.request_started()
        timed_out = await state.wait_idle(0.01)
        asyncio.get_running_loop().call_later(0.01, state.request_finished)
        return timed_out, await state.wait_idle(10)

    assert asyncio.run(run()) == (False, True)


def _samples(state: ServerState) -> dict[tuple[str, str | None], float]:
    text = generate_latest(state.metrics.registry).decode()
    return {(s.name, s.labels.get("source")): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_pool_profile_is_exported_as_gauges_in_seconds_with_its_source() -> None:
    profile = PoolProfile(19.4, 2.5, 760.0, 45, "assumed")
    state = ServerState(ServerSettings(served_model_name="m", pool_profile=profile))
    samples = _samples(state)
    assert samples[(names.PROFILE_ITL_ALPHA, "assumed")] == pytest.approx(0.0194)
    assert samples[(names.PROFILE_ITL_BETA, "assumed")] == pytest.approx(0.0025)
    assert samples[(names.PROFILE_PREFILL_RATE, "assumed")] == 760.0
    assert samples[(names.PROFILE_MAX_NUM_SEQS, "assumed")] == 45


def test_without_a_pool_profile_no_profile_gauge_is_exported() -> None:
    samples = _samples(ServerState(ServerSettings(served_model_name="m")))
    assert not [name for name, _ in samples if name in names.PROFILE_GAUGES]


def _write(path, text: str) -> None:
    """Replace the file as the kubelet updates a mounted ConfigMap: a new file renamed over the old path."""
    staged = path.with_suffix(".new")
    staged.write_text(text)
    staged.replace(path)


def _profiles(state: ServerState) -> dict[str, float]:
    """The exported alpha per source, after the check /metrics makes before it answers."""
    state.refresh_pool_profile()
    return {source: value for (name, source), value in _samples(state).items() if name == names.PROFILE_ITL_ALPHA}


def test_a_profile_file_that_appears_later_is_exported_and_a_change_replaces_it(tmp_path) -> None:
    path = tmp_path / "profile.json"
    state = ServerState(ServerSettings(served_model_name="m", pool_profile_path=str(path)))
    assert _profiles(state) == {}  # no file yet: no profile
    path.write_text("")
    assert _profiles(state) == {}  # the operator's ConfigMap before any figures: no profile
    _write(path, '{"itlAlphaMs": 20, "itlBetaMs": 1, "prefillTokensPerSecond": 500, "maxNumSeqs": 8, '
                 '"source": "assumed"}')
    assert _profiles(state) == {"assumed": pytest.approx(0.02)}
    _write(path, '{"itlAlphaMs": 12, "itlBetaMs": 1, "prefillTokensPerSecond": 700, "maxNumSeqs": 9, '
                 '"source": "measured"}')
    assert _profiles(state) == {"measured": pytest.approx(0.012)}  # the assumed series is gone


def test_a_bad_profile_file_keeps_the_last_good_profile_and_warns(tmp_path, caplog) -> None:
    path = tmp_path / "profile.json"
    path.write_text('{"itlAlphaMs": 20, "itlBetaMs": 1, "prefillTokensPerSecond": 500, "maxNumSeqs": 8}')
    state = ServerState(ServerSettings(served_model_name="m", pool_profile_path=str(path)))
    assert _profiles(state) == {"measured": pytest.approx(0.02)}  # read at start
    _write(path, '{"itlAlphaMs": 20')
    with caplog.at_level("WARNING"):
        assert _profiles(state) == {"measured": pytest.approx(0.02)}
    assert "keeping the last good profile" in caplog.text and str(path) in caplog.text
    _write(path, '{"itlAlphaMs": -1, "itlBetaMs": 1, "prefillTokensPerSecond": 500, "maxNumSeqs": 8}')
    assert _profiles(state) == {"measured": pytest.approx(0.02)}
    _write(path, "")
    assert _profiles(state) == {}  # emptied on purpose: no profile any more


def test_metrics_scrapes_pick_up_a_profile_file_written_after_start(tmp_path) -> None:
    """The wiring: GET /metrics re-checks the file (no model needed, as while the server loads)."""
    from aiohttp.test_utils import TestClient, TestServer

    from hpi_runtime.server.app import build_app

    path = tmp_path / "profile.json"
    state = ServerState(ServerSettings(served_model_name="m", pool_profile_path=str(path)))

    async def scrape() -> str:
        async with TestClient(TestServer(build_app(state))) as client:
            response = await client.get("/metrics")
            return await response.text()

    assert names.PROFILE_ITL_ALPHA + "{" not in asyncio.run(scrape())
    _write(path, '{"itlAlphaMs": 8, "itlBetaMs": 1, "prefillTokensPerSecond": 500, "maxNumSeqs": 8}')
    text = asyncio.run(scrape())
    assert f'{names.PROFILE_ITL_ALPHA}{{model_name="m",source="measured"}} 0.008' in text
