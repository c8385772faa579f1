"""`hpi serve --pool-profile @PATH`: the pool's profile read from a file that may change while the server runs.

The operator mounts a per-pool ConfigMap holding the profile JSON; its figures move from assumed to measured
after the pods exist, and restarting a GPU pod to pass a new flag costs minutes, so the server re-reads the file
instead. The kubelet replaces a mounted ConfigMap's files in place (a new file behind the same path), so a change
of the file's identity (inode, mtime, size) is the signal; the check runs when /metrics is scraped, the only
time anyone reads the figures. A missing or empty file means no profile yet; a bad file keeps the last good
profile and logs why, once per bad version: the figures are a hint for the router, never a reason to stop.
"""

from __future__ import annotations

import logging
import os

from hpi_contracts.pool_profile import PoolProfile, parse_pool_profile

logger = logging.getLogger(__name__)


class PoolProfileFile:
    """The profile behind one path, re-read when the file changes (owned by one ServerState)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.profile: PoolProfile | None = None
        self._version: tuple[int, int, int] | None = None  # (inode, mtime ns, size) of the version last read

    def check(self) -> bool:
        """Re-read the file if it changed since the last check; True when `profile` changed."""
        try:
            stat = os.stat(self.path)
            version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if version == self._version:
                return False
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            version, text = None, ""
        except OSError as exc:
            logger.warning("--pool-profile %s: cannot read it (%s); keeping the last good profile", self.path, exc)
            return False
        self._version = version
        if not text.strip():  # the operator has no figures for this pool yet
            return self._set(None)
        try:
            profile = parse_pool_profile(text)
        except ValueError as exc:
            logger.warning("--pool-profile %s: %s; keeping the last good profile", self.path, exc)
            return False
        return self._set(profile)

    def _set(self, profile: PoolProfile | None) -> bool:
        changed = profile != self.profile
        self.profile = profile
        return changed
