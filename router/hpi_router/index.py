"""The pool's pick index: a binary min-heap of backends by rank, with each one's position kept, so that one
backend's rank changes in O(log n) (a request started or finished there, a scrape, a readiness change), the
lowest is read in O(1), and the lowest outside a few excluded ones (a retry's) in O(k log k) for k excluded.

Ranks are tuples that end with the backend's URL, so no two are equal and the order is total. `num_steps`
counts the work done (key comparisons while sifting, entries visited while skipping excluded ones): the
tests hold it to O(log n) per request without timing anything.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable


class RankIndex:
    def __init__(self) -> None:
        self._heap: list[tuple[tuple, str]] = []  # (rank, url), heap-ordered by rank
        self._pos: dict[str, int] = {}  # url -> its place in _heap
        self.num_steps = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, url: str) -> bool:
        return url in self._pos

    def rank(self, url: str) -> tuple:
        return self._heap[self._pos[url]][0]

    def set(self, url: str, rank: tuple) -> None:
        """Insert `url` with `rank`, or move it to its new rank."""
        i = self._pos.get(url)
        if i is None:
            self._heap.append((rank, url))
            self._sift_up(len(self._heap) - 1)
            return
        old = self._heap[i][0]
        self._heap[i] = (rank, url)
        if rank < old:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def remove(self, url: str) -> None:
        i = self._pos.pop(url, None)
        if i is None:
            return
        last = self._heap.pop()
        if i == len(self._heap):
            return
        old = self._heap[i][0]
        self._heap[i] = last
        if last[0] < old:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def rebuild(self, entries: Iterable[tuple[str, tuple]]) -> None:
        """Replace the contents (once per scrape round, when every rank moves): a sorted list is a heap."""
        self._heap = sorted(((rank, url) for url, rank in entries), key=lambda entry: entry[0])
        self._pos = {url: i for i, (_, url) in enumerate(self._heap)}

    def lowest(self, excluding: Collection[str] = ()) -> str | None:
        """The URL of the lowest rank not in `excluding`: a best-first walk down the heap from its root, which
        visits at most 2k + 1 entries for k excluded ones, whatever the size of the heap."""
        heap = self._heap
        if not heap:
            return None
        frontier = [(heap[0][0], 0)]
        while frontier:
            _, i = heapq.heappop(frontier)
            self.num_steps += 1
            url = heap[i][1]
            if url not in excluding:
                return url
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child][0], child))
        return None

    def _sift_up(self, i: int) -> None:
        heap, pos = self._heap, self._pos
        entry = heap[i]
        while i > 0:
            parent = (i - 1) >> 1
            self.num_steps += 1
            if not entry[0] < heap[parent][0]:
                break
            heap[i] = heap[parent]
            pos[heap[i][1]] = i
            i = parent
        heap[i] = entry
        pos[entry[1]] = i

    def _sift_down(self, i: int) -> None:
        heap, pos = self._heap, self._pos
        size = len(heap)
        entry = heap[i]
        while True:
            child = 2 * i + 1
            if child >= size:
                break
            if child + 1 < size:
                self.num_steps += 1
                if heap[child + 1][0] < heap[child][0]:
                    child += 1
            self.num_steps += 1
            if not heap[child][0] < entry[0]:
                break
            heap[i] = heap[child]
            pos[heap[i][1]] = i
            i = child
        heap[i] = entry
        pos[entry[1]] = i
