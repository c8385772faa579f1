"""Separate hosts on one machine: a network namespace joined to this one by a veth pair, each end with its own
address on a private /24 (iproute2, as root). Processes started under `prefix` (`ip netns exec NS`) have their
own network stack: their own interfaces and routes, and the same hostname as this host, as pods of one
LeaderWorkerSet group may.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class TwoHosts:
    here_addr: str  # this namespace's end of the pair
    there_addr: str  # the namespace's end
    prefix: tuple[str, ...]  # runs a command in the namespace


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """This host and a namespace behind a veth pair; both removed on exit. RuntimeError (with ip's message)
    when the namespace cannot be made."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"hpi-pp-{tag}", f"hpip{tag}a", f"hpip{tag}b"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/24", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _remove(ns, here)
        raise RuntimeError(f"`{' '.join(exc.cmd)}` failed: {exc.stderr.strip()}") from None
    try:
        yield TwoHosts(f"{subnet}.1", f"{subnet}.2", ("ip", "netns", "exec", ns))
    finally:
        _remove(ns, here)


def _remove(ns: str, link: str) -> None:
    subprocess.run(["ip", "link", "del", link], capture_output=True)  # removes both ends
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
