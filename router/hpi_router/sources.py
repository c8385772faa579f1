"""Where backends come from. A source publishes the full current set of backend URLs, every time it changes,
through one callback (`BackendPool.apply`): a static list once, the EndpointSlice watcher on every change.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

Publish = Callable[[Iterable[str]], None]


class BackendSource(Protocol):
    async def run(self, publish: Publish) -> None:
        """Publish the backend set now and on every change; return only when cancelled (or done for good)."""


class StaticSource:
    """`--backend URL` flags: one fixed set."""

    def __init__(self, urls: Iterable[str]):
        self.urls = tuple(urls)

    async def run(self, publish: Publish) -> None:
        publish(self.urls)


async def run_sources(sources: Iterable[BackendSource], publish: Publish) -> None:
    """Run several sources into one pool: the published set is the union of each source's latest set."""
    latest: list[frozenset[str]] = []

    def publisher(index: int) -> Publish:
        def publish_one(urls: Iterable[str]) -> None:
            latest[index] = frozenset(urls)
            publish(frozenset().union(*latest))
        return publish_one

    tasks = []
    for index, source in enumerate(sources):
        latest.append(frozenset())
        tasks.append(source.run(publisher(index)))
    await asyncio.gather(*tasks)
