"""Batched LoRA in the model runner: device slots of adapter weights per projection, a delta per token by slot.

Every adapted projection of the model (each layer's qkv_proj, o_proj, gate_up_proj and down_proj, whatever
module computes it: float, int8/int4, packed for the CPU) gets a forward hook that adds the LoRA delta of
each token's adapter: out[t] += B[s] @ (A[s] @ x[t]) with s = the token's slot (BASE_SLOT: nothing). Slot
weights are kept as A [num_slots, parts * max_rank, in] and B stored as [num_slots, parts * max_rank, out]
(seen as [out, num_slots, parts * max_rank]) in the slots' dtype (`--lora-dtype`: the activation dtype, or bf16
under an fp32 model on the CPU, half the bytes a decode step reads), zero-padded to max_rank with the scaling
folded into B. A fused projection (qkv: parts q, k, v; gate_up: gate, up) stacks one rank block per part, and
part p's output rows read only block p of B.

The delta is grouped by slot (the punica / S-LoRA idea), in one of three forms (LoRABatch.mode): on CPU the
C++ kernel torch.ops.hpi_kernels.lora_add_ (in place; tokens grouped by slot inside, one call per projection;
its inputs have the same shapes whatever the mix of adapters, so the compiled model step runs it: one graph for
every mix); on CUDA the Triton kernel of hpi_kernels.lora (punica's BGMV); on a CPU where the C++ kernels do not
build, torch ops per adapter present (or one-hot masked matmuls over all slots), eagerly. Each is set up once per
step on the host from the per-token slots (`LoRABatch.set_step`), so no layer synchronises with the device.

Tensor parallelism: a column-parallel projection keeps the whole A and the rows of B its output holds; a
row-parallel one (o_proj, down_proj) keeps the columns of A its input holds and the whole B: its delta is a
partial sum that the layer's all-reduce completes, like the base product. Hooks are used instead of wrapping
modules so that parameter names stay as loaded (sleep mode's wake copies weights by name).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from hpi_runtime.lora.layout_cache import LayoutCache, directory_key
from hpi_runtime.lora.peft_dir import ADAPTER_KEY, WEIGHTS_FILE, AdapterSpec, part_shapes, read_adapter
from hpi_runtime.lora.request import LoRARequest
from hpi_runtime.lora.slot_table import BASE_SLOT, LoRAUpdates
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.parallel import Span, TensorParallel, mlp_span, split_heads

# checkpoint module -> (projection attribute path in the decoder layer)
PROJECTION_OF = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
                 "self_attn.v_proj": "self_attn.qkv_proj", "self_attn.qkv_proj": "self_attn.qkv_proj",
                 "self_attn.o_proj": "self_attn.o_proj", "mlp.gate_proj": "mlp.gate_up_proj",
                 "mlp.up_proj": "mlp.gate_up_proj", "mlp.gate_up_proj": "mlp.gate_up_proj",
                 "mlp.down_proj": "mlp.down_proj"}  # fmt: skip


@dataclass(frozen=True)
class PartSlice:
    """One part of a projection on this rank: its rows of the layer's output and of the full part's output."""

    name: str  # q, k, v, o, gate, up, down
    out_offset: int  # first row in this rank's (fused) output
    rows: Span  # rows of the unsharded part's output this rank holds


class LoRABatch:
    """The current step's tokens by adapter slot; set by the runner before each forward.

    How the deltas are added (`mode`, chosen by the model's device and what builds there):
    - "cpu": the C++ kernel torch.ops.hpi_kernels.lora_add_, one call per projection with every token's slot
      (`token_slots`, on the host, [num_tokens] even when no token has an adapter), its tokens grouped by slot
      inside. The only form whose shapes do not depend on the mix of adapters, so the compiled step uses it:
      one graph for every mix (compiled_model.py marks `token_slots` unbacked like the step's other inputs).
    - "triton" (CUDA): hpi_kernels.lora_delta, punica's BGMV, two launches; `token_slots` on the device.
    - "torch" (CPU without a C++ compiler; eager): `groups`, one gather + two small matmuls + one scatter-add
      per adapter present, cheapest for few adapters; or `one_hot` [num_tokens, num_slots], two matmuls over
      every slot's rank block with each token's other blocks zeroed, whose cost does not grow with the number
      of adapters present (measured on CPU, docs/lora.md)."""

    def __init__(self, num_slots: int, like: torch.Tensor, mode: str) -> None:
        self.num_slots, self.like, self.mode = num_slots, like, mode
        self.groups: tuple[tuple[int, torch.Tensor | None], ...] = ()  # (slot, token rows or None: all tokens)
        self.one_hot: torch.Tensor | None = None  # [num_tokens, num_slots] in the activation dtype
        self.token_slots: torch.Tensor | None = None  # [num_tokens] int64: the kernels' input

    def set_step(self, token_slots: np.ndarray | None, device: torch.device, num_tokens: int) -> None:
        """token_slots: [num_tokens] int64, BASE_SLOT for base-model tokens; None: every token is the base's."""
        self.groups, self.one_hot, self.token_slots = (), None, None
        if self.mode == "cpu":
            slots = np.full(num_tokens, BASE_SLOT, dtype=np.int64) if token_slots is None else token_slots
            self.token_slots = torch.from_numpy(slots)
            return
        if token_slots is None:
            return
        if self.mode == "triton":
            self.token_slots = torch.from_numpy(token_slots).to(device)
            return
        slots = np.unique(token_slots)
        slots = slots[slots != BASE_SLOT]
        if 2 * len(slots) > self.num_slots:
            one_hot = np.zeros((len(token_slots), self.num_slots), dtype=np.float32)
            adapted = np.flatnonzero(token_slots != BASE_SLOT)
            one_hot[adapted, token_slots[adapted]] = 1.0
            self.one_hot = torch.from_numpy(one_hot).to(device=device, dtype=self.like.dtype)
        elif len(slots) == 1 and (token_slots == slots[0]).all():
            self.groups = ((int(slots[0]), None),)
        else:
            self.groups = tuple((int(s), torch.from_numpy(np.flatnonzero(token_slots == s)).to(device)) for s in slots)


def slot_dtype(lora_dtype: str, activation: torch.dtype, device: torch.device) -> torch.dtype:
    """The slots' dtype for `--lora-dtype`: "auto" is the activation dtype. Another dtype runs in the delta's own
    fp32 sums on CUDA (Triton) and on the CPU as bf16 slots under fp32 activations (lora_delta.cpp); ValueError
    for a combination the CPU does not run."""
    if lora_dtype == "auto":
        return activation
    dtype = getattr(torch, lora_dtype)  # bfloat16 or float16: LoRAConfig's choices
    if device.type == "cpu" and dtype != activation and (dtype, activation) != (torch.bfloat16, torch.float32):
        model = str(activation).removeprefix("torch.")
        raise ValueError(f"--lora-dtype {lora_dtype} under a {model} model on the CPU: the CPU runs adapters in "
                         "the model's dtype (auto) or bfloat16 under float32")  # fmt: skip
    return dtype


def delta_mode(device: torch.device) -> str:
    """LoRABatch.mode for a model on `device`: the C++ kernel on CPU where it builds, Triton on CUDA."""
    if device.type == "cuda":
        return "triton"
    from hpi_kernels.cpu import cpu_kernels_available

    return "cpu" if cpu_kernels_available() else "torch"


@dataclass(frozen=True)
class ProjectionShape:
    """One adaptable projection on this rank: its parts, and the columns of the full input it reads."""

    parts: tuple[PartSlice, ...]
    in_span: Span | None  # row-parallel: this rank's columns of the full input; None: the whole input
    in_features: int
    out_features: int


def _zero(tensor: torch.Tensor) -> None:
    """Zero a contiguous tensor; on the CPU through numpy, on the calling thread alone. A slot of the larger
    projections is above torch's grain size for a parallel fill, and an OpenMP region measured 4-11 ms for a
    110 KB copy (against 4 us on one thread) on this 2-core machine while other processes kept its cores busy;
    a slot load runs about 240 such fills and copies."""
    if tensor.device.type == "cpu":
        tensor.view(torch.uint8).numpy().fill(0)
    else:
        tensor.zero_()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for contiguous tensors of one dtype (src on the CPU); on the calling thread alone (_zero)."""
    if dst.device.type == "cpu":
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src, non_blocking=False)


class LoRAProjection:
    """The slots of one projection and the hook that adds their delta."""

    def __init__(self, shape: ProjectionShape, num_slots: int, max_rank: int, batch: LoRABatch,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        """dtype: the slots' (slot_dtype); None: the activation dtype."""
        self.parts, self.in_span, self.max_rank, self.batch = shape.parts, shape.in_span, max_rank, batch
        self.width = len(shape.parts) * max_rank  # W: one rank block per part
        dtype = dtype or batch.like.dtype
        like = batch.like.new_zeros(0, dtype=dtype)  # on the model's device
        self.a = like.new_zeros(num_slots, self.width, shape.in_features)  # [S, W, in]
        # B stored transposed, [S, W, out] (the C++ kernel's AXPYs run over contiguous outputs), and seen
        # as [out, S, W] by the other forms: B of slot s is b[:, s].
        self.bt = like.new_zeros(num_slots, self.width, shape.out_features)
        self.b = self.bt.permute(2, 0, 1)
        # The C++ kernel reads only each part's block of Bt: part p's rank rows, its columns of the output.
        self.part_cols = [p.out_offset for p in shape.parts] + [shape.out_features]
        # Its AMX tiles' panels of each slot, packed as the slot loads ([S, 0] where the CPU's bf16 linears do not
        # run AMX tiles): a prefill chunk's runs of one adapter take them (lora_delta.cpp).
        self.amx = None
        if batch.mode == "cpu" and dtype == batch.like.dtype:  # (bf16 slots under fp32 x run the vector tiles)
            from hpi_kernels.cpu.lora_delta import lora_pack_amx

            self.amx = lora_pack_amx(self.a, self.bt, self.part_cols)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        x = args[0]  # [num_tokens, in]
        if batch.mode == "cpu":  # in place: the projection's output is a fresh tensor only this hook holds
            torch.ops.hpi_kernels.lora_add_(output, x, self.a, self.bt, batch.token_slots, self.part_cols, self.amx)
            return output
        if batch.token_slots is not None:
            from hpi_kernels import lora_delta

            return lora_delta(x, self.a, self.b, batch.token_slots, output)
        # Torch ops (a CPU without the C++ kernels): slots of another dtype (--lora-dtype) widened per call
        a, b = (self.a, self.b) if self.a.dtype == x.dtype else (self.a.to(x.dtype), self.b.to(x.dtype))
        if batch.one_hot is not None:
            num_slots = a.shape[0]
            shrunk = F.linear(x, a.view(num_slots * self.width, -1)).view(-1, num_slots, self.width)
            shrunk = (shrunk * batch.one_hot.unsqueeze(-1)).view(-1, num_slots * self.width)
            return output + F.linear(shrunk, b.reshape(b.shape[0], -1))
        for slot, rows in batch.groups:
            if rows is None:
                output = output + F.linear(F.linear(x, a[slot]), b[:, slot])
            else:
                shrunk = F.linear(x.index_select(0, rows), a[slot])
                output = output.index_add(0, rows, F.linear(shrunk, b[:, slot]))
        return output

    def clear(self, slot: int) -> None:
        _zero(self.a[slot])
        _zero(self.bt[slot])
        if self.amx is not None and self.amx.shape[1]:
            _zero(self.amx[slot])

    def copy_in(self, slot: int, a: torch.Tensor, bt: torch.Tensor) -> None:
        """One slot's A and B transposed from host memory (as host_zeros lays them out), and its AMX panels."""
        _copy(self.a[slot], a)
        _copy(self.bt[slot], bt)
        if self.amx is not None and self.amx.shape[1]:  # ~30 us a projection (bench/results/lora.md, run 17)
            torch.ops.hpi_kernels.lora_pack_amx_slot_(self.amx, self.a, self.bt, slot, self.part_cols)

    def host_zeros(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's A [W, in] and B transposed [W, out], zero, in host memory (laid out by lay_out_part)."""
        a, bt = torch.empty(self.a.shape[1:], dtype=self.a.dtype), torch.empty(self.bt.shape[1:], dtype=self.a.dtype)
        _zero(a)
        _zero(bt)
        return a, bt

    def lay_out_part(self, a_slot: torch.Tensor, bt_slot: torch.Tensor, part: str, a: torch.Tensor, b: torch.Tensor,
                     scaling: float) -> None:  # fmt: skip
        """a: [r, in] (unsharded), b: [part_out, r] (unsharded, this part's rows) -> one slot's A and B
        transposed (host_zeros), the scaling folded into B."""
        index = next(i for i, p in enumerate(self.parts) if p.name == part)
        spec = self.parts[index]
        rank = a.shape[0]
        cols = slice(index * self.max_rank, index * self.max_rank + rank)
        if self.in_span is not None:
            a = a.narrow(1, self.in_span.start, self.in_span.size)
        b = b.narrow(0, spec.rows.start, spec.rows.size) * scaling
        a_slot[cols] = a.to(a_slot.dtype)
        bt_slot[cols, spec.out_offset : spec.out_offset + spec.rows.size] = b.t().to(bt_slot.dtype)


def _projection_shapes(config: ModelConfig, layer: int, tp: TensorParallel) -> dict[str, ProjectionShape]:
    """projection path -> its shape on this rank, for `layer`."""
    d = config.head_dim
    heads = split_heads(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
    q_rows, kv_rows = Span(heads.q.start * d, heads.q.size * d), Span(heads.kv.start * d, heads.kv.size * d)
    qkv = (PartSlice("q", 0, q_rows), PartSlice("k", q_rows.size, kv_rows),
           PartSlice("v", q_rows.size + kv_rows.size, kv_rows))  # fmt: skip
    hidden = config.hidden_size
    found = {
        "self_attn.qkv_proj": ProjectionShape(qkv, None, hidden, q_rows.size + 2 * kv_rows.size),
        "self_attn.o_proj": ProjectionShape((PartSlice("o", 0, Span(0, hidden)),), q_rows, q_rows.size, hidden),
    }
    if "gate" in part_shapes(config, layer):
        span = mlp_span(config.intermediate_size, tp.size, tp.rank)
        gate_up = (PartSlice("gate", 0, span), PartSlice("up", span.size, span))
        found["mlp.gate_up_proj"] = ProjectionShape(gate_up, None, hidden, 2 * span.size)
        found["mlp.down_proj"] = ProjectionShape((PartSlice("down", 0, Span(0, hidden)),), span, span.size, hidden)
    return found


def read_adapter_tensors(spec: AdapterSpec) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, checkpoint module) -> (A [r, in], B [out, r]) on the CPU, as stored."""
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(Path(spec.path) / WEIGHTS_FILE), device="cpu").items():
        match = ADAPTER_KEY.match(key)
        if match is not None:
            pairs.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    return {
        (t.layer, t.module): (pairs[(t.layer, t.module)]["A"], pairs[(t.layer, t.module)]["B"]) for t in spec.targets
    }


@dataclass(frozen=True)
class HostAdapter:
    """An adapter read into host memory, laid out as the slots want it: per projection it adapts, A [W, in] and
    B transposed [W, out] in the slots' dtype, scaled and zero-padded to max_rank (a slot load is a copy)."""

    projections: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    source: tuple | None = None  # its directory's layout_cache.directory_key, when it could be taken


class LoRAModel:
    """The adapters of one model on this rank: its projections' slots, the host-memory copies, the step's groups.

    Host memory holds each adapter as a future of its HostAdapter: a prefetch (LoRAUpdates.prefetches) reads,
    checks and lays it out in a background thread while the steps go on; `take_ready` names those finished,
    for the scheduler (ModelRunnerOutput.lora_ready). A slot load of an adapter host memory lacks reads it on
    the step's thread, which the scheduler allows only into an otherwise empty batch. An adapter host memory drops
    is written to local disk as laid out (layout_cache.py), so reading it again is one file read."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, tp: TensorParallel,
                 lora_dtype: str = "auto") -> None:  # fmt: skip
        config: ModelConfig = model.config
        self.config, self.max_rank = config, max_rank
        # The activation dtype on the model's device (quantized weights are integers: the norms say it).
        like = model.model.norm.weight.new_zeros(0)
        self.batch = LoRABatch(num_slots, like, delta_mode(like.device))
        self.dtype = slot_dtype(lora_dtype, like.dtype, like.device)  # ValueError before any slot is allocated
        self.projections: dict[tuple[int, str], LoRAProjection] = {}
        self.by_module: dict[nn.Module, LoRAProjection] = {}  # the adapted linear -> its slots (cpu_decode.py)
        self.host: dict[int, Future[HostAdapter]] = {}  # lora_int_id -> its host-memory copy
        self._unreported: set[int] = set()  # prefetched ids not yet named by take_ready
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-prefetch")
        self._layouts = LayoutCache()  # adapters host memory dropped, as laid out: a re-read is one file read
        self._writes: dict[tuple, Future[None]] = {}  # directory key -> its layout's write, queued on the reader
        for index, layer in enumerate(model.model.layers):
            for path, shape in _projection_shapes(config, index, tp).items():
                projection = LoRAProjection(shape, num_slots, max_rank, self.batch, self.dtype)
                module = layer.get_submodule(path)
                module.register_forward_hook(projection)
                self.projections[(index, path)] = projection
                self.by_module[module] = projection

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for p in self.projections.values()
                   for t in (p.a, p.b, p.amx) if t is not None)  # fmt: skip

    def apply(self, updates: LoRAUpdates) -> None:
        """The step's adapter moves (slot_table.py): drop host copies, start the background reads, then fill
        slots. ValueError for an adapter that no longer fits (a failed read fails the step that loads it)."""
        for lora_id in updates.host_evictions:
            evicted = self.host.pop(lora_id, None)
            self._unreported.discard(lora_id)
            if evicted is not None and evicted.done() and evicted.exception() is None:
                adapter = evicted.result()
                if adapter.source is not None:  # its layout to local disk, in the background: a re-read is a copy
                    write = self._reader.submit(self._layouts.put, adapter.source, adapter.projections)
                    self._writes[adapter.source] = write
        for lora in updates.prefetches:
            self.host[lora.lora_int_id] = self._reader.submit(self.read, lora)
            self._unreported.add(lora.lora_int_id)
        for load in updates.loads:
            lora_id = load.lora.lora_int_id
            if lora_id not in self.host:
                future: Future[HostAdapter] = Future()
                future.set_result(self.read(load.lora))
                self.host[lora_id] = future
            try:
                adapter = self.host[lora_id].result()
            except BaseException:
                del self.host[lora_id]  # a directory fixed since is read again next time
                self._unreported.discard(lora_id)
                raise
            self._fill(load.slot, adapter)

    def take_ready(self) -> tuple[int, ...]:
        """The prefetched adapters whose read finished (or failed: their load will say why) since the last call."""
        done = tuple(i for i in self._unreported if self.host[i].done())
        self._unreported.difference_update(done)
        return done

    def read(self, lora: LoRARequest) -> HostAdapter:
        """Read and check `lora`'s directory and lay its tensors out as the slots hold them; an unchanged directory
        evicted from host memory before comes back from the layout cache (layout_cache.py)."""
        source = directory_key(lora.lora_path)
        if source is not None and (write := self._writes.pop(source, None)) is not None:
            write.exception()  # a read on the step's thread waits for it (the reader's own ran it already: FIFO)
        if source is not None and (cached := self._layouts.get(source)) is not None:
            return HostAdapter(cached, source)
        spec = read_adapter(lora.lora_path, self.config, self.max_rank)
        laid_out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        tensors = read_adapter_tensors(spec)
        for target in spec.targets:
            a, b = tensors[(target.layer, target.module)]
            key = (target.layer, PROJECTION_OF[target.module])
            projection = self.projections[key]
            if key not in laid_out:
                laid_out[key] = projection.host_zeros()
            sizes = [part_shapes(self.config, target.layer)[p][0] for p in target.parts]
            for part, b_part in zip(target.parts, b.split(sizes), strict=True):
                projection.lay_out_part(*laid_out[key], part, a, b_part, spec.scaling)
        return HostAdapter(laid_out, source)

    def _fill(self, slot: int, adapter: HostAdapter) -> None:
        for key, projection in self.projections.items():
            laid_out = adapter.projections.get(key)
            if laid_out is None:
                projection.clear(slot)
            else:
                projection.copy_in(slot, *laid_out)

    def shutdown(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._layouts.close()
