"""Which adapter sits in which device slot, and which adapters host memory keeps: decided in the engine core.

The scheduler owns this table (one owner: the executor only does what each step says). An adapter is
*active* while a running request uses it; a batch holds at most `num_slots` active adapters, so a waiting
request for another adapter waits (`can_admit`). Admitting a request pins its adapter in a slot: the slot it
already occupies (no copy), else an empty slot, else the least recently used slot with no running request.
Each load travels with the step (`LoRAUpdates`, like the KV tier's block copies): the executor copies the
adapter into the slot from its host-memory copy. Host memory keeps `num_cpu` adapters, least recently used
evicted (the executor drops what `host_evictions` names). An adapter that host memory lacks is first
*prefetched*: the executor reads and checks its directory in a background thread (`prefetches`) and reports
it in a later step's output (`mark_ready`); until then the scheduler admits its requests only into an empty
batch (`ready`), so a read from disk never holds up running requests. A prefetch evicts only host copies
that no request ahead of it in the queue waits for (`keep`), so prefetches for a long queue never undo each
other. Base-model requests (no adapter) take no slot. Nothing here imports torch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from hpi_runtime.lora.request import LoRARequest

BASE_SLOT = -1  # a token of the base model: no LoRA delta


@dataclass(frozen=True)
class LoRASlotLoad:
    slot: int
    lora: LoRARequest


@dataclass(frozen=True)
class LoRAUpdates:
    """One step's adapter moves, applied by the executor before the forward: evictions first, then loads."""

    host_evictions: tuple[int, ...] = ()  # lora_int_ids host memory drops
    prefetches: tuple[LoRARequest, ...] = ()  # adapters to read into host memory in the background
    loads: tuple[LoRASlotLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.host_evictions or self.prefetches or self.loads)


NO_LORA_UPDATES = LoRAUpdates()


class LoRASlotTable:
    def __init__(self, num_slots: int, num_cpu: int) -> None:
        if num_slots < 1 or num_cpu < num_slots:
            raise ValueError(f"need 1 <= max_loras <= max_cpu_loras, got {num_slots} and {num_cpu}")
        self.num_cpu = num_cpu
        self.slot_ids: list[int | None] = [None] * num_slots  # lora_int_id resident in each slot
        self._last_used = [0] * num_slots  # the tick of the slot's last acquire, for LRU
        self._tick = 0
        self.users: Counter[int] = Counter()  # lora_int_id -> running requests
        self._names: dict[int, str] = {}  # of the active adapters, for metrics
        self._host: OrderedDict[int, None] = OrderedDict()  # lora_int_ids in host memory, oldest first
        self._reading: set[int] = set()  # of those, prefetched and not reported read yet
        self._evictions: list[int] = []
        self._prefetches: list[LoRARequest] = []
        self._loads: list[LoRASlotLoad] = []
        self.num_slot_loads = 0  # cumulative: adapters copied into a device slot
        self.num_host_evictions = 0  # cumulative: adapters dropped from host memory

    @property
    def active_ids(self) -> frozenset[int]:
        return frozenset(self.users)

    def active_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._names[i] for i in self.users))

    def can_admit(self, lora: LoRARequest | None) -> bool:
        """Whether a request for `lora` fits this batch's adapter limit."""
        return lora is None or lora.lora_int_id in self.users or len(self.users) < len(self.slot_ids)

    def ready(self, lora: LoRARequest | None) -> bool:
        """Whether admitting a request for `lora` reads nothing from disk: its adapter sits in a slot, or host
        memory holds it read (a slot load is then a copy)."""
        if lora is None or lora.lora_int_id in self.slot_ids:
            return True
        return lora.lora_int_id in self._host and lora.lora_int_id not in self._reading

    def prefetch(self, lora: LoRARequest, keep: set[int]) -> None:
        """Have host memory read `lora` in the background unless it holds it or is reading it already. Room is
        made by evicting the least recently used host copy that `keep` (adapters waited for ahead of this
        one) does not name; with none such the prefetch waits for a later step."""
        lora_id = lora.lora_int_id
        if lora_id in self._host:
            return
        if len(self._host) >= self.num_cpu:
            victim = next((i for i in self._host if i not in keep), None)
            if victim is None:
                return
            self._evict(victim)
        self._host[lora_id] = None
        self._reading.add(lora_id)
        self._prefetches.append(lora)

    def mark_ready(self, lora_ids: tuple[int, ...]) -> None:
        """The executor finished reading these prefetched adapters (ModelRunnerOutput.lora_ready)."""
        self._reading.difference_update(lora_ids)

    def acquire(self, lora: LoRARequest | None) -> int:
        """Pin `lora` for one more running request; its slot (BASE_SLOT for the base model)."""
        if lora is None:
            return BASE_SLOT
        lora_id = lora.lora_int_id
        self._tick += 1
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            free = [s for s, i in enumerate(self.slot_ids) if i is None or i not in self.users]
            assert free, "acquire without can_admit"
            slot = min(free, key=lambda s: (self.slot_ids[s] is not None, self._last_used[s]))
            self.slot_ids[slot] = lora_id
            self._load(slot, lora)
        self._last_used[slot] = self._tick
        self.users[lora_id] += 1
        self._names[lora_id] = lora.lora_name
        return slot

    def release(self, lora: LoRARequest | None) -> None:
        """One running request of `lora` finished or was preempted; its slot stays loaded for reuse."""
        if lora is None:
            return
        lora_id = lora.lora_int_id
        self.users[lora_id] -= 1
        if self.users[lora_id] <= 0:
            del self.users[lora_id]
            del self._names[lora_id]

    def _load(self, slot: int, lora: LoRARequest) -> None:
        lora_id = lora.lora_int_id
        self.num_slot_loads += 1
        self._loads.append(LoRASlotLoad(slot, lora))
        if lora_id in self._host:
            self._host.move_to_end(lora_id)
            return
        self._host[lora_id] = None
        while len(self._host) > self.num_cpu:
            self._evict(next(iter(self._host)))

    def _evict(self, lora_id: int) -> None:
        del self._host[lora_id]
        self._reading.discard(lora_id)
        self.num_host_evictions += 1
        pending = [lora for lora in self._prefetches if lora.lora_int_id != lora_id]
        if len(pending) < len(self._prefetches):  # prefetched this very step: the executor never hears of it
            self._prefetches = pending
        else:
            self._evictions.append(lora_id)

    def forget_loads(self, updates: LoRAUpdates) -> None:
        """A step failed: the slots it was to fill hold nothing known, and host memory may lack those adapters."""
        for load in updates.loads:
            if self.slot_ids[load.slot] == load.lora.lora_int_id:
                self.slot_ids[load.slot] = None
            self._host.pop(load.lora.lora_int_id, None)
        for lora in updates.prefetches:
            self._host.pop(lora.lora_int_id, None)
            self._reading.discard(lora.lora_int_id)

    def take_updates(self) -> LoRAUpdates:
        if not self._loads and not self._evictions and not self._prefetches:
            return NO_LORA_UPDATES
        updates = LoRAUpdates(tuple(self._evictions), tuple(self._prefetches), tuple(self._loads))
        self._evictions, self._prefetches, self._loads = [], [], []
        return updates
