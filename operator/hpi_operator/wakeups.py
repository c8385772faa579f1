"""Wake-up signals for the per-resource reconcile loops (handlers.py), held in the operator's memo.

Level-based: a signal carries no content, only "look again". Whatever woke a loop (an event of the resource,
of one of its children, or the resync period running out), the loop reads the whole state and converges on
it. A signal is set when first asked for, so a loop's first pass (after a create, or after the operator
restarts) runs at once. Losing every signal (a restart) loses nothing: the resync and the first pass cover it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from .names import GROUP, KIND


class Wakeups:
    """{InferenceDeployment uid: asyncio.Event}; used only from the operator's event loop."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, uid: str) -> asyncio.Event:
        if uid not in self._events:
            self._events[uid] = asyncio.Event()
            self._events[uid].set()
        return self._events[uid]

    def wake(self, uids: Iterable[str]) -> None:
        for uid in uids:
            self._event(uid).set()

    def forget(self, uid: str) -> None:
        self._events.pop(uid, None)

    async def wait(self, uid: str, timeout_s: float, stopped: Any, debounce_s: float = 0.0) -> bool:
        """Until woken, `stopped` or `timeout_s`; returns whether the loop should stop. After a wake-up it waits
        `debounce_s` more, so a burst of events (the loop's own writes coming back) makes one pass."""
        event = self._event(uid)
        waiters = {asyncio.ensure_future(event.wait()), asyncio.ensure_future(stopped.wait())}
        try:
            await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        if event.is_set() and debounce_s and not stopped:
            await asyncio.sleep(debounce_s)
        event.clear()
        return bool(stopped)


def owner_uids(meta: Mapping[str, Any]) -> list[str]:
    """The InferenceDeployments a child's owner references point at."""
    return [
        ref["uid"]
        for ref in meta.get("ownerReferences") or []
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/") and ref.get("uid")
    ]
