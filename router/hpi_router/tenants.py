"""Tenants and their API keys: who a request belongs to, what it may use, and how fast.

The router is the tenant boundary when it is given a tenants file (`--tenants-file`, in Kubernetes a Secret
mounted as a volume). The file is YAML (or JSON, a subset):

    tenants:
      - name: chat-frontend
        keys: ["sk-live-..."]           # one or more; any of them identifies the tenant
        priority: -1                    # the engine's request priority (vLLM's: lower is more urgent); default 0
        weight: 2                       # its share against other tenants of the same priority; default 1
        models: ["llama-3.1-8b*"]       # fnmatch patterns of the models it may use; default: every model
        limits:                         # for the whole router fleet (each replica its share); default: none
          requestsPerMinute: 600
          tokensPerMinute: 200000       # prompt + completion, from the backends' usage
          concurrentRequests: 32

Keys are kept only as SHA-256 digests (a memory dump shows no key), and a presented key is looked up by its
digest: no key is ever compared byte by byte, so the lookup's timing says nothing about a stored key. A request's
tenant sets its queue flow (queue.py: priority band and weight) and the `priority` the engine sees (a client's own
is replaced). `TenantsFile` re-reads the file when it changes (a Secret's volume is updated in place by the
kubelet), keeping the last good contents when a new one is bad.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16  # shorter keys are guessable


LIMIT_NAMES = ("requestsPerMinute", "concurrentRequests", "tokensPerMinute")


@dataclass(frozen=True)
class Limits:
    """A tenant's limits for the whole router fleet. Each of R router replicas enforces its share, `share(R)`:
    no shared store sits in the request path, and the Service spreads connections over the replicas (see
    docs/router.md for what that assumes)."""

    requests_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_minute: int | None = None

    def share(self, num_replicas: int) -> Limits:
        """One replica's part of the fleet-wide limits: each divided by the replicas, rounded up (a limit of 1
        stays 1), so the fleet admits at most R - 1 more than the limit and never refuses a tenant under it."""

        def part(limit: int | None) -> int | None:
            return None if limit is None else max(1, math.ceil(limit / num_replicas))

        return Limits(part(self.requests_per_minute), part(self.concurrent_requests), part(self.tokens_per_minute))


@dataclass(frozen=True)
class Tenant:
    name: str
    priority: int = 0
    weight: float = 1.0
    models: tuple[str, ...] = ()  # fnmatch patterns; empty: any model
    limits: Limits = field(default_factory=Limits)

    def may_use(self, model: str | None) -> bool:
        return not self.models or (model is not None and any(fnmatch(model, p) for p in self.models))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """The loaded tenants, by the digest of each of their keys."""

    def __init__(self, by_digest: Mapping[bytes, Tenant]):
        self._by_digest = dict(by_digest)
        self.tenants = tuple(sorted({t.name: t for t in by_digest.values()}.values(), key=lambda t: t.name))

    @property
    def num_keys(self) -> int:
        return len(self._by_digest)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <key>` header; None for a missing, malformed or unknown key.
        The lookup compares SHA-256 digests, never keys: how long it takes depends on the presented key's digest,
        which tells an attacker nothing about any stored key (that would take a preimage)."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        presented = digest(authorization[len("Bearer "):].strip())
        return self._by_digest.get(presented)


def _int(raw: Mapping[str, Any], key: str, where: str, minimum: int) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_tenants(raw: Any) -> KeyRing:
    """The tenants file's parsed YAML -> a KeyRing; ValueError naming the first thing wrong with it."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("tenants"), list):
        raise ValueError("a tenants file is a mapping with a list `tenants`")
    by_digest: dict[bytes, Tenant] = {}
    names: set[str] = set()
    for i, entry in enumerate(raw["tenants"]):
        where = f"tenants[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a mapping")
        name = entry.get("name")
        if not isinstance(name, str) or not name or name in names:
            raise ValueError(f"{where}.name must be a unique non-empty string, got {name!r}")
        names.add(name)
        keys = entry.get("keys")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"{where} ({name}): `keys` must be a non-empty list of strings")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"{where} ({name}): weight must be a number > 0, got {weight!r}")
        priority = entry.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"{where} ({name}): priority must be an integer, got {priority!r}")
        models = entry.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
            raise ValueError(f"{where} ({name}): models must be a list of model names or patterns")
        limits_raw = entry.get("limits") or {}
        if not isinstance(limits_raw, Mapping):
            raise ValueError(f"{where} ({name}): limits must be a mapping")
        unknown = set(limits_raw) - set(LIMIT_NAMES)
        if unknown:
            raise ValueError(f"{where} ({name}): unknown limits {sorted(unknown)} ({', '.join(LIMIT_NAMES)})")
        limits = Limits(*(_int(limits_raw, limit, f"{where}.limits", 1) for limit in LIMIT_NAMES))
        tenant = Tenant(name, priority, float(weight), tuple(models), limits)
        for key in keys:
            if len(key.strip()) < MIN_KEY_CHARS:
                raise ValueError(f"{where} ({name}): a key has fewer than {MIN_KEY_CHARS} characters")
            d = digest(key.strip())
            if d in by_digest:
                raise ValueError(f"{where} ({name}): a key is also {by_digest[d].name}'s")
            by_digest[d] = tenant
    return KeyRing(by_digest)


class TenantsFile:
    """`--tenants-file`, re-read when it changes (checked on use, at most every `check_interval_s`)."""

    def __init__(self, path: Path, check_interval_s: float = 2.0):
        self.path, self.check_interval_s = path, check_interval_s
        self._signature: tuple[float, int, int] | None = None
        self._checked_at = -math.inf
        self.ring = self._read()  # the first read must succeed: a router with a bad file does not start
        self.error: str | None = None  # why the latest change was not taken

    def _stat(self) -> tuple[float, int, int]:
        st = os.stat(self.path)  # follows the Secret volume's ..data symlink
        return st.st_mtime, st.st_ino, st.st_size

    def _read(self) -> KeyRing:
        signature = self._stat()
        try:
            raw = yaml.safe_load(self.path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{self.path}: not YAML: {exc}") from None
        ring = parse_tenants(raw)
        self._signature = signature
        return ring

    def current(self, now_s: float) -> KeyRing:
        if now_s - self._checked_at >= self.check_interval_s:
            self._checked_at = now_s
            try:
                if self._stat() != self._signature:
                    self.ring, self.error = self._read(), None
                    logger.info("tenants file %s reloaded: %d tenants, %d keys", self.path, len(self.ring.tenants),
                                self.ring.num_keys)  # fmt: skip
            except (OSError, ValueError) as exc:
                if self.error != str(exc):
                    logger.error("tenants file %s not reloaded, keeping the last good one: %s", self.path, exc)
                self.error = str(exc)
        return self.ring
