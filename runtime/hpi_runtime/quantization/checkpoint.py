"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors): what config.json says, and each format's tensors.

`read_checkpoint_quantization(model_dir)` parses `quantization_config` into a `CheckpointQuantization` (None for
a float checkpoint; ValueError for anything the engine cannot run: other bit widths, activation
quantization, per-channel int4, unknown methods). `read_linear` turns one checkpoint linear's tensors into a
`RepackedLinear` in our terms: integer codes [N, K] (int4: uint8 0..15 with w = (q - 8) * scale + zero;
int8: symmetric per channel), float scales/zeros, and, for GPTQ act-order, the input permutation that makes
its groups contiguous. Only integer tensors and per-group scales are touched; no float weight is made.

The formats, as their writers store them (checked against AutoGPTQ/GPTQModel, AutoAWQ and
compressed-tensors):
- GPTQ: `qweight` int32 [K / 8, N], eight 4-bit codes per word along K (code 8j + i in bits 4i..4i+3);
  `qzeros` int32 [G, N / 8], packed the same way along N, stored minus 1 in the original format
  (`checkpoint_format` "gptq"; "gptq_v2" stores them as they are); `scales` fp16 [G, N]; `g_idx` int32 [K],
  input channel -> group (with act-order, `desc_act`, not k // group_size). w[n, k] = s[g, n] * (q - z[g, n]).
- AWQ (GEMM): `qweight` int32 [K, N / 8] packed along N in the interleaved order 0, 2, 4, 6, 1, 3, 5, 7;
  `qzeros` int32 [G, N / 8] likewise; `scales` fp16 [G, N]; w = s * (q - z).
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K * bits / 32] along K, codes stored
  unsigned (signed + 2^(bits-1)); `weight_scale` [N, G] (group) or [N, 1] (channel); asymmetric zero points
  `weight_zero_point` int32 packed along N [N * bits / 32, G] (older writers: unpacked [N, G]);
  `weight_shape` [2]; optional `weight_g_idx` [K]. `int-quantized`: `weight` int8 [N, K] + `weight_scale`.
  w = s * (q_signed - zp).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
INT4_GROUP_SIZES = (32, 64, 128)  # what our int4 layout and both kernels take (quantization.INT4_GROUP_SIZES)
_AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ packs column 8j + this[i] into nibble i
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's weight quantization, as far as the engine needs it."""

    method: str  # "gptq" | "awq" | "compressed-tensors"
    bits: int  # 4 | 8
    group_size: int | None  # None: one scale per output channel (int8 only)
    symmetric: bool
    act_order: bool = False  # GPTQ desc_act / compressed-tensors actorder "group": g_idx is a permutation
    format: str = ""  # gptq: "gptq" | "gptq_v2"; awq: "gemm"; compressed-tensors: its "format"

    @property
    def runtime_method(self) -> str:
        return "int4" if self.bits == 4 else "int8"

    @property
    def scheme(self) -> str:
        """The name the metric and the start-up log give it, e.g. "gptq-int4-g128-act-order"."""
        group = f"-g{self.group_size}" if self.group_size else "-per-channel"
        return f"{self.method}-{self.runtime_method}{group}{'-act-order' if self.act_order else ''}"


@dataclass(frozen=True)
class RepackedLinear:
    """One checkpoint linear in our layout (before packing): what QuantizedWeight is made of."""

    codes: torch.Tensor  # int4: [N, K] uint8 in 0..15, groups contiguous along K; int8: [N, K] int8
    scales: torch.Tensor  # int4: [N, K // g] fp32; int8: [N] fp32
    zeros: torch.Tensor | None  # int4: [N, K // g] fp32, w = (q - 8) * scale + zero
    perm: torch.Tensor | None = None  # [K] int64: the layer computes x[:, perm] @ W.T; None = identity


def _config_error(method: str, what: str) -> ValueError:
    return ValueError(f"unsupported {method} checkpoint: {what}")


def _int4_group(method: str, group_size: object) -> int:
    if group_size not in INT4_GROUP_SIZES:
        raise _config_error(method, f"group_size {group_size!r}; int4 checkpoints need a group size in "
                                    f"{INT4_GROUP_SIZES} (per-channel int4 is not supported)")  # fmt: skip
    return int(group_size)  # type: ignore[arg-type]


def _parse_gptq(qc: dict) -> CheckpointQuantization:
    bits = qc.get("bits")
    if bits != 4:
        raise _config_error("gptq", f"bits {bits!r}; only 4-bit GPTQ is supported")
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise _config_error("gptq", f"checkpoint_format {checkpoint_format!r} (supported: gptq, gptq_v2)")
    group = _int4_group("gptq", qc.get("group_size"))
    return CheckpointQuantization("gptq", 4, group, bool(qc.get("sym", True)), bool(qc.get("desc_act", False)),
                                  checkpoint_format)  # fmt: skip


def _parse_awq(qc: dict) -> CheckpointQuantization:
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _config_error("awq", f"bits {bits!r}; only 4-bit AWQ is supported")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _config_error("awq", f"version {version!r}; only the GEMM packing is supported")
    if not qc.get("zero_point", True):
        raise _config_error("awq", "zero_point false; AWQ GEMM checkpoints carry zero points")
    group = _int4_group("awq", qc.get("group_size", qc.get("q_group_size")))
    return CheckpointQuantization("awq", 4, group, symmetric=False, format="gemm")


def _parse_compressed_tensors(qc: dict) -> CheckpointQuantization:
    fmt = qc.get("format")
    if fmt not in _CT_FORMATS:
        raise _config_error("compressed-tensors", f"format {fmt!r} (supported: {', '.join(_CT_FORMATS)})")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _config_error("compressed-tensors", f"quantization_status {status!r}; only compressed weights")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _config_error("compressed-tensors", "no config_groups")
    schemes = set()
    for group in groups:
        if group.get("input_activations") or group.get("output_activations"):
            raise _config_error("compressed-tensors", "activation quantization (only weight-only W4A16/W8A16)")
        weights = group.get("weights") or {}
        schemes.add(json.dumps(weights, sort_keys=True))
        if "Linear" not in group.get("targets", []):
            raise _config_error("compressed-tensors", f"targets {group.get('targets')!r}; expected 'Linear'")
    if len(schemes) != 1:
        raise _config_error("compressed-tensors", "several weight schemes in one model (mixed precision)")
    weights = groups[0]["weights"]
    bits, kind, strategy = weights.get("num_bits"), weights.get("type", "int"), weights.get("strategy")
    symmetric, actorder = bool(weights.get("symmetric", True)), weights.get("actorder")
    if kind != "int" or weights.get("dynamic"):
        raise _config_error("compressed-tensors", f"weights of type {kind!r} (dynamic={weights.get('dynamic')})")
    if bits == 4:
        if strategy != "group":
            raise _config_error("compressed-tensors", f"int4 with strategy {strategy!r}; int4 needs 'group'")
        group = _int4_group("compressed-tensors", weights.get("group_size"))
        return CheckpointQuantization("compressed-tensors", 4, group, symmetric, actorder == "group", fmt)
    if bits == 8:
        if strategy != "channel" or not symmetric:
            raise _config_error("compressed-tensors", f"int8 with strategy {strategy!r}, symmetric={symmetric}; "
                                                      "int8 needs symmetric 'channel' scales")  # fmt: skip
        return CheckpointQuantization("compressed-tensors", 8, None, True, False, fmt)
    raise _config_error("compressed-tensors", f"num_bits {bits!r}; only 4 and 8")


_PARSERS: dict[str, Callable[[dict], CheckpointQuantization]] = {
    "gptq": _parse_gptq,
    "awq": _parse_awq,
    "compressed-tensors": _parse_compressed_tensors,
}


def parse_quantization_config(qc: dict) -> CheckpointQuantization:
    method = str(qc.get("quant_method", "")).lower()
    if method not in _PARSERS:
        raise ValueError(f"unsupported quantization_config quant_method {qc.get('quant_method')!r}; "
                         f"pre-quantized checkpoints must be one of {', '.join(CHECKPOINT_METHODS)}")  # fmt: skip
    return _PARSERS[method](qc)


def read_checkpoint_quantization(model_dir: Path) -> CheckpointQuantization | None:
    """The checkpoint's quantization from config.json's `quantization_config`; None for a float checkpoint."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return None
    qc = json.loads(config_path.read_text()).get("quantization_config")
    return None if qc is None else parse_quantization_config(qc)


# ---- per-format tensors -> RepackedLinear --------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> codes (uint8), 32 / bits per word along `dim`, code i of a word in bits [bits*i, bits*(i+1))."""
    per_word, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32)
    if dim == 0:
        codes = (words[:, None, :] >> shifts[None, :, None]) & mask  # [R, per_word, C]
        return codes.reshape(words.shape[0] * per_word, words.shape[1]).to(torch.uint8)
    codes = (words[:, :, None] >> shifts) & mask  # [R, C, per_word]
    return codes.reshape(words.shape[0], words.shape[1] * per_word).to(torch.uint8)


def _group_perm(g_idx: torch.Tensor | None, k: int, group_size: int, name: str) -> torch.Tensor | None:
    """The column order that makes g_idx's groups contiguous; None when they already are."""
    if k % group_size:
        raise ValueError(f"{name}: group size {group_size} does not divide K = {k}")
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64).flatten()
    if g_idx.numel() != k:
        raise ValueError(f"{name}: g_idx has {g_idx.numel()} entries, the layer has K = {k}")
    if torch.equal(g_idx, torch.arange(k) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=k // group_size)
    if counts.numel() != k // group_size or not (counts == group_size).all():
        raise ValueError(f"{name}: g_idx does not give every group exactly {group_size} input channels")
    return torch.argsort(g_idx, stable=True)


def _int4_linear(
    codes: torch.Tensor,  # [N, K] uint8 0..15 in checkpoint column order
    scales: torch.Tensor,  # [N, G]
    zero_codes: torch.Tensor,  # [N, G] the integer zero point on the 0..15 scale: w = s * (q - z)
    perm: torch.Tensor | None,
) -> RepackedLinear:
    scales = scales.float()
    if perm is not None:
        codes = codes[:, perm]
    # w = s (q - z) = (q - 8) s + (8 - z) s: our layout's float zero is (8 - z) * s, exact in fp32.
    return RepackedLinear(codes.contiguous(), scales, (8.0 - zero_codes.float()) * scales, perm)


def read_gptq(get: Callable[[str], torch.Tensor | None], prefix: str, q: CheckpointQuantization) -> RepackedLinear:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    if qweight is None or qzeros is None or scales is None:
        raise ValueError(f"{prefix}: GPTQ checkpoint lacks qweight/qzeros/scales")
    codes = unpack_int32(qweight, 4, dim=0).T  # [N, K]
    n, k = codes.shape
    assert q.group_size is not None
    if scales.shape != (k // q.group_size, n):
        raise ValueError(f"{prefix}.scales: shape {tuple(scales.shape)}, expected {(k // q.group_size, n)}")
    zero_codes = unpack_int32(qzeros, 4, dim=1)[:, :n].to(torch.int16)  # [G, N]
    if q.format == "gptq":
        zero_codes = zero_codes + 1  # the original GPTQ format stores zero - 1
    perm = _group_perm(get(f"{prefix}.g_idx"), k, q.group_size, prefix)
    return _int4_linear(codes, scales.T, zero_codes.T, perm)


def _awq_columns(n: int) -> torch.Tensor:  # position of column c among the unpacked nibbles
    nibble_of_column = torch.tensor(_AWQ_COLUMN_OF_NIBBLE).argsort()
    c = torch.arange(n)
    return (c // 8) * 8 + nibble_of_column[c % 8]


def read_awq(get: Callable[[str], torch.Tensor | None], prefix: str, q: CheckpointQuantization) -> RepackedLinear:
    qweight, qzeros, scales = get(f"{prefix}.qweight"), get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    if qweight is None or qzeros is None or scales is None:
        raise ValueError(f"{prefix}: AWQ checkpoint lacks qweight/qzeros/scales")
    n = scales.shape[1]
    columns = _awq_columns(n)
    codes = unpack_int32(qweight, 4, dim=1)[:, columns].T  # [N, K]
    zero_codes = unpack_int32(qzeros, 4, dim=1)[:, columns]  # [G, N]
    assert q.group_size is not None
    k = codes.shape[1]
    if scales.shape != (k // q.group_size, n) or zero_codes.shape != scales.shape:
        raise ValueError(f"{prefix}: AWQ scales {tuple(scales.shape)} / qzeros do not fit K = {k}, N = {n}")
    _group_perm(None, k, q.group_size, prefix)
    return _int4_linear(codes, scales.T, zero_codes.T, None)


def read_compressed_tensors(
    get: Callable[[str], torch.Tensor | None], prefix: str, q: CheckpointQuantization
) -> RepackedLinear:
    scale = get(f"{prefix}.weight_scale")
    if scale is None:
        raise ValueError(f"{prefix}: compressed-tensors checkpoint lacks weight_scale")
    packed, offset = get(f"{prefix}.weight_packed"), 1 << (q.bits - 1)
    if packed is not None:
        shape = get(f"{prefix}.weight_shape")
        if shape is None:
            raise ValueError(f"{prefix}: compressed-tensors checkpoint has weight_packed but no weight_shape")
        n, k = (int(v) for v in shape.tolist())
        unsigned = unpack_int32(packed, q.bits, dim=1)[:, :k]  # [N, K], signed + offset
    else:
        weight = get(f"{prefix}.weight")
        if weight is None or weight.dtype != torch.int8:
            raise ValueError(f"{prefix}: compressed-tensors checkpoint lacks weight_packed or an int8 weight")
        n, k = weight.shape
        unsigned = (weight.to(torch.int16) + offset).to(torch.uint8)
    if unsigned.shape != (n, k):
        raise ValueError(f"{prefix}: packed weight unpacks to {tuple(unsigned.shape)}, weight_shape says {(n, k)}")
    zero_point = get(f"{prefix}.weight_zero_point")
    if q.bits == 8:
        if scale.numel() != n:
            raise ValueError(f"{prefix}.weight_scale: {tuple(scale.shape)}, expected one scale per output channel")
        if zero_point is not None and zero_point.any():
            raise ValueError(f"{prefix}: int8 weights with non-zero zero points are not supported")
        codes = (unsigned.to(torch.int16) - offset).to(torch.int8)
        return RepackedLinear(codes, scale.reshape(n).float(), None)
    assert q.group_size is not None
    groups = k // q.group_size
    if scale.shape != (n, groups):
        raise ValueError(f"{prefix}.weight_scale: shape {tuple(scale.shape)}, expected {(n, groups)}")
    if zero_point is None:
        zp = torch.zeros(n, groups, dtype=torch.int16)
    elif zero_point.dtype == torch.int32 and zero_point.shape[0] != n:  # packed along N
        zp = unpack_int32(zero_point, q.bits, dim=0)[:n].to(torch.int16) - offset
    else:
        zp = zero_point.reshape(n, groups).to(torch.int16)
    perm = _group_perm(get(f"{prefix}.weight_g_idx"), k, q.group_size, prefix)
    # w = s (q_signed - zp) with q_signed = u - 8: on the 0..15 scale of u the zero point is zp + 8.
    return _int4_linear(unsigned, scale, zp + offset, perm)


READERS: dict[str, Callable[[Callable[[str], torch.Tensor | None], str, CheckpointQuantization], RepackedLinear]] = {
    "gptq": read_gptq,
    "awq": read_awq,
    "compressed-tensors": read_compressed_tensors,
}
# A checkpoint linear is quantized when one of these tensors exists under its prefix; else it is float.
QUANTIZED_MARKERS = {
    "gptq": ("qweight",),
    "awq": ("qweight",),
    "compressed-tensors": ("weight_packed", "weight_scale"),
}
