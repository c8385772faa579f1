"""Which adapter sits in which device slot, and which adapters host memory keeps: decided in the engine core.

The scheduler owns this table (one owner: the executor only does what each step says). An adapter is
*active* while a running request uses it; a batch holds at most `num_slots` active adapters, so a waiting
request for another adapter waits (`can_admit`). Admitting a request pins its adapter in a slot: the slot it
already occupies (no copy), else an empty slot, else the least recently used slot with no running request.
Each load travels with the step (`LoRAUpdates`, like the KV tier's block copies): the executor copies the
adapter into the slot from its host-memory copy, reading the directory first when host memory does not hold
it. Host memory keeps `num_cpu` adapters, least recently used evicted (the executor drops what `host_evictions`
names). Base-model requests (no adapter) take no slot. Nothing here imports torch.
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
    loads: tuple[LoRASlotLoad, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.host_evictions or self.loads)


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
        self._evictions: list[int] = []
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
            evicted, _ = self._host.popitem(last=False)
            self._evictions.append(evicted)
            self.num_host_evictions += 1

    def forget_loads(self, updates: LoRAUpdates) -> None:
        """A step failed: the slots it was to fill hold nothing known, and host memory may lack those adapters."""
        for load in updates.loads:
            if self.slot_ids[load.slot] == load.lora.lora_int_id:
                self.slot_ids[load.slot] = None
            self._host.pop(load.lora.lora_int_id, None)

    def take_updates(self) -> LoRAUpdates:
        if not self._loads and not self._evictions:
            return NO_LORA_UPDATES
        updates = LoRAUpdates(tuple(self._evictions), tuple(self._loads))
        self._evictions, self._loads = [], []
        return updates
