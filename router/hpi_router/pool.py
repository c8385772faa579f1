"""The live backend set and its pick index: one `Backend` per upstream URL, fed by sources through `apply`.

Every change that moves a backend's rank goes through a method here, so the index (index.py) always holds
each ready backend's exact rank under the round's `SpeedScale`: `started` / `finished` around each request
(the proxy), `observe` / `eject` / `restore` from the monitor, and `rescale` once per scrape round, which
recomputes the fleet-wide scale (O(n log n)) and re-ranks everyone. A pick (`choose`) is then O(log n): at most
MAX_AFFINITY_PROBES backends read along the ring, and the index's lowest rank outside the excluded ones.

LoRA adapter affinity (as the Gateway API inference extension's): a request whose `model` is an adapter goes to
the best-ranked backend that has the adapter resident in its batch (requests for it there at the last scrape, or
sent since by this router), if that backend is within the same bounded load as prefix affinity; otherwise it is
goes to the best-ranked backend with a free adapter slot (fewer adapters in use than its max_lora, or not known),
where it does not wait for another adapter's requests to leave the batch; and the backend it lands on becomes a
holder. So an adapter's requests gather on few backends, each of which loads it once, instead of every backend
swapping every adapter in and out of its `--max-loras` slots. An index of each adapter's holders and one of the
backends with a free slot keep this O(log n) too. A model name is an adapter when it is not one of the base
model's served names (the model_name label of the backends' metrics).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from itertools import islice

from hpi_router.backends import Backend, BackendView
from hpi_router.config import PolicySettings
from hpi_router.index import RankIndex
from hpi_router.policy import MAX_AFFINITY_PROBES, Pick, SpeedScale, affinity_fits, load_of, rank, speed_scale
from hpi_router.signals import ScrapeSample

logger = logging.getLogger(__name__)


class BackendPool:
    """The backend set. Sources call `apply(urls)` with the full current set; removed backends' requests in
    flight finish on their own (the objects live on in those requests, outside the index)."""

    def __init__(self, settings: PolicySettings = PolicySettings(), on_change: Callable[[], None] | None = None,
                 saturated_waiting: int = 0, on_capacity: Callable[[], None] | None = None,
                 reserved_slots: int = 0):  # fmt: skip
        """`on_change`: the backend set changed; `on_capacity`: a backend may have room again (the queue's turn);
        `saturated_waiting`: a ready backend has no room once this many requests wait in its engine (0: never
        full, room is any ready backend); `reserved_slots`: of a backend's max_num_seqs (its profile), the slots
        only urgent bands (priority < 0) may take."""
        self._backends: dict[str, Backend] = {}
        self._settings = settings
        self._on_change = on_change
        self._on_capacity = on_capacity
        self._saturated_waiting = saturated_waiting
        self._reserved_slots = reserved_slots
        # With saturated_waiting set: the ready backends that have room, by the same rank (a pick goes to one of
        # them, not merely somewhere while one of them exists).
        self._room_index = RankIndex()
        self._bulk_index = RankIndex()  # with reserved_slots: those with room for the default and later bands
        self.index = RankIndex()  # the ready backends, by rank
        self.scale = SpeedScale()  # this round's
        self._loads: dict[str, float] = {}  # load_of each indexed backend, as last ranked
        self._fleet_load = 0.0  # their sum (integral values: exact under + and -)
        self._holders: dict[str, RankIndex] = {}  # LoRA adapter -> the ready backends it is resident on, by rank
        self._held: dict[str, frozenset[str]] = {}  # backend -> the adapters it is indexed under
        self._free_slot_index = RankIndex()  # the ready backends with room for one more adapter in their batch
        self.base_names: frozenset[str] = frozenset()  # the base model's served names, from the scrapes

    def apply(self, urls: Iterable[str]) -> None:
        wanted = {url.rstrip("/") for url in urls}
        added = wanted - self._backends.keys()
        removed = self._backends.keys() - wanted
        for url in removed:
            del self._backends[url]
            self._unindex(url)
        for url in sorted(added):
            self._backends[url] = Backend(url)
        if added or removed:
            logger.info("backends: %d (+%s -%s)", len(self._backends), sorted(added), sorted(removed))
            if self._on_change is not None:
                self._on_change()

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def ready(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.ready]

    def num_ready(self) -> int:
        return len(self.index)

    def has_room(self, priority: int = 0) -> bool:
        """Whether a request of `priority` sent now would find a backend with room: a ready one, and, with
        saturated_waiting set, one whose engine has fewer requests waiting than that (scraped, plus those sent
        since); for priority >= 0 with reserved_slots set, also one not within reserved_slots of full."""
        return len(self._candidates(priority)) > 0

    def _candidates(self, priority: int) -> RankIndex:
        if self._reserved_slots and priority >= 0:
            return self._bulk_index
        return self._room_index if self._saturated_waiting else self.index

    def adapter_of(self, model: object) -> str | None:
        """The LoRA adapter a request's `model` names, or None (the base model, or no scrape has named it yet)."""
        if not isinstance(model, str) or not model or not self.base_names or model in self.base_names:
            return None
        return model

    def holders(self, adapter: str) -> int:
        """How many ready backends have `adapter` resident."""
        index = self._holders.get(adapter)
        return len(index) if index is not None else 0

    def get(self, url: str) -> Backend | None:
        return self._backends.get(url)

    def urls(self) -> list[str]:
        return sorted(self._backends)

    # -- the changes that move a rank ----------------------------------------------------------------------------

    def started(self, backend: Backend, adapter: str | None = None) -> None:
        """A request (for LoRA `adapter`, if not None) was sent to `backend`."""
        backend.in_flight += 1
        backend.num_picks += 1
        if adapter is not None:
            backend.adapters_in_flight[adapter] += 1
        self._rerank(backend)

    def finished(self, backend: Backend, adapter: str | None = None) -> None:
        """A request sent to `backend` (with the same `adapter` as `started`) ended (answered, failed or cancelled)."""
        backend.in_flight -= 1
        if adapter is not None:
            backend.adapters_in_flight[adapter] -= 1
            if backend.adapters_in_flight[adapter] <= 0:
                del backend.adapters_in_flight[adapter]
        self._rerank(backend)

    def observe(self, backend: Backend, sample: ScrapeSample, now_s: float | None = None) -> None:
        """One scrape of `backend` (Backend.observe)."""
        backend.observe(sample, now_s)
        self._rerank(backend)

    def eject(self, backend: Backend, reason: str) -> bool:
        """Take it out of rotation until a /ready probe passes; True if it was taking traffic."""
        was_ready = backend.eject(reason)
        self._rerank(backend)
        return was_ready

    def restore(self, backend: Backend) -> None:
        backend.restore()
        self._rerank(backend)

    def rescale(self) -> None:
        """Once per scrape round: the fleet-wide speed scale from the ready backends, and every rank under it."""
        views = [b.view() for b in self._backends.values() if b.ready]
        self.scale = speed_scale(views)
        self.index.rebuild((v.url, rank(v, self.scale, self._settings)) for v in views)
        self.base_names = frozenset().union(*(b.model_names for b in self._backends.values()))
        self._holders, self._held = {}, {}
        for v in views:
            self._index_adapters(v.url, v.adapters)
        self._free_slot_index.rebuild((v.url, self.index.rank(v.url)) for v in views if _free_slot(v))
        self._loads = {v.url: load_of(v) for v in views}
        self._fleet_load = sum(self._loads.values())
        if self._saturated_waiting or self._reserved_slots:
            self._room_index.rebuild((v.url, self.index.rank(v.url)) for v in views if self._room(v))
            self._bulk_index.rebuild((v.url, self.index.rank(v.url)) for v in views if self._bulk_room(v))
        self._capacity_changed()

    # -- the pick ------------------------------------------------------------------------------------------------

    def choose(self, ring_walk: Iterable[str] | None, exclude: Collection[str] = (), priority: int = 0,
               adapter: str | None = None) -> Pick | None:  # fmt: skip
        """policy.pick's decision over the ready backends, without a scan. `ring_walk`: the backends in ring
        order from the request's affinity key (HashRing.walk), or None; only its first MAX_AFFINITY_PROBES
        are read. `adapter`: the request's LoRA adapter (adapter_of), or None."""
        round_robin = self._settings.strategy == "round-robin"
        # With saturation gating, only backends with room are candidates (any, if none has: the queue lets a
        # request through then only in a race, and a backend that can queue it beats a 503).
        gated = self._candidates(priority)
        index = gated if len(gated) else self.index
        if adapter is not None and not round_robin:
            holders = self._holders.get(adapter)
            url = holders.lowest(exclude) if holders is not None else None
            if url is not None and url in index:
                if affinity_fits(self._backends[url].view(), self.scale, self._fleet_load, self._settings):
                    return Pick(url, "adapter")
            url = self._free_slot_index.lowest(exclude)
            if url is not None and url in index:
                return Pick(url, "adapter_slot")
        if ring_walk is not None and not round_robin:
            for url in islice(ring_walk, MAX_AFFINITY_PROBES):
                if url in index and url not in exclude:
                    view = self._backends[url].view()
                    if affinity_fits(view, self.scale, self._fleet_load, self._settings):
                        return Pick(url, "affinity")
        url = index.lowest(exclude) or (self.index.lowest(exclude) if index is not self.index else None)
        if url is None:
            return None
        return Pick(url, "round_robin" if round_robin else "load")

    def _rerank(self, backend: Backend) -> None:
        if self._backends.get(backend.url) is not backend:
            return  # it left the set; its last requests are finishing
        if not backend.ready:
            self._unindex(backend.url)
            return
        view = backend.view()
        self.index.set(backend.url, rank(view, self.scale, self._settings))
        self._index_adapters(backend.url, view.adapters)
        if _free_slot(view):
            self._free_slot_index.set(backend.url, self.index.rank(backend.url))
        else:
            self._free_slot_index.remove(backend.url)
        load = load_of(view)
        self._fleet_load += load - self._loads.get(backend.url, 0.0)
        self._loads[backend.url] = load
        if self._saturated_waiting or self._reserved_slots:
            for index, has in ((self._room_index, self._room(view)), (self._bulk_index, self._bulk_room(view))):
                if has:
                    index.set(backend.url, self.index.rank(backend.url))
                else:
                    index.remove(backend.url)
        self._capacity_changed()

    def _index_adapters(self, url: str, adapters: frozenset[str]) -> None:
        """Keep `url` in the holder index of exactly `adapters`, at its rank in the main index."""
        old = self._held.get(url, frozenset())
        for adapter in old - adapters:
            self._drop_holder(adapter, url)
        for adapter in adapters:
            self._holders.setdefault(adapter, RankIndex()).set(url, self.index.rank(url))
        if adapters:
            self._held[url] = adapters
        else:
            self._held.pop(url, None)

    def _drop_holder(self, adapter: str, url: str) -> None:
        index = self._holders[adapter]
        index.remove(url)
        if not len(index):
            del self._holders[adapter]

    def _unindex(self, url: str) -> None:
        for adapter in self._held.pop(url, frozenset()):
            self._drop_holder(adapter, url)
        self._free_slot_index.remove(url)
        self.index.remove(url)
        self._fleet_load -= self._loads.pop(url, 0.0)
        self._room_index.remove(url)
        self._bulk_index.remove(url)

    @staticmethod
    def _occupied(view: BackendView) -> float:
        """Requests in the engine: its last scrape's running and waiting, plus what this router sent it since."""
        return view.num_running + view.num_waiting + max(view.in_flight - view.in_flight_at_scrape, 0)

    def _room(self, view: BackendView) -> bool:
        """Fewer than saturated_waiting requests would wait in the engine: where the profile says how many
        sequences it runs, those sent since the scrape fill its free slots first; without one, each counts as
        waiting."""
        if not self._saturated_waiting:
            return True
        if view.profile is not None:
            return self._occupied(view) < view.profile.max_num_seqs + self._saturated_waiting
        return view.num_waiting + max(view.in_flight - view.in_flight_at_scrape, 0) < self._saturated_waiting

    def _bulk_room(self, view: BackendView) -> bool:
        """Room for the default and less urgent bands: `_room`, and, where the profile says how many sequences
        the engine runs, fewer in it than max_num_seqs minus the reserved slots. A backend without a profile
        reserves nothing (it would hold the bands off blindly)."""
        if not self._room(view):
            return False
        if not self._reserved_slots or view.profile is None:
            return True
        return self._occupied(view) < view.profile.max_num_seqs - self._reserved_slots

    def _capacity_changed(self) -> None:
        if self._on_capacity is not None:
            self._on_capacity()


def _free_slot(view: BackendView) -> bool:
    """Room for one more LoRA adapter in its batch: fewer in use than its max_lora, or no limit known."""
    return view.max_loras is None or len(view.adapters) < view.max_loras
