"""Write tiny pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) the way their tools store them.

Independent of the runtime's readers on purpose (own quantizer, own bit packing, written from the formats'
descriptions), so a reader that gets a nibble order, a zero offset or a permutation wrong fails the tests.
Each writer returns the checkpoint's tensors plus the dequantized float weight the format defines, which is
what the loaded layer must compute with.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that read the same input share GPTQ's act-order permutation (it sorts the input's channels).
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
            "up_proj": "mlp", "down_proj": "down"}  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble i of a word holds column 8c + AWQ_ORDER[i]


@dataclass(frozen=True)
class Format:
    name: str  # test id
    quantization_config: dict
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    act_order: bool = False


def _to_int32(words: torch.Tensor) -> torch.Tensor:  # int64 holding uint32 values -> int32 bit pattern
    return (((words + 2**31) % 2**32) - 2**31).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:  # [R, C] unsigned -> [R * bits / 32, C]
    per = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0] // per, per, codes.shape[1])
    return _to_int32(sum(c[:, i] << (bits * i) for i in range(per)))


def pack_cols(codes: torch.Tensor, bits: int = 4, order: tuple[int, ...] | None = None) -> torch.Tensor:
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.to(torch.int64).reshape(codes.shape[0], codes.shape[1] // per, per)
    return _to_int32(sum(c[:, :, order[i]] << (bits * i) for i in range(per)))


def _int4_grid(w: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (of the [R, g] groups) integer grid: (q [R, g] in 0..15, scale [R] fp16, zero [R] int in 0..15)
    with w ~ scale * (q - zero)."""
    if symmetric:
        scale = (w.abs().amax(-1) / 7.0).clamp(min=1e-6).half()
        zero = torch.full_like(scale, 8, dtype=torch.int64)
    else:
        lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp(min=1e-6).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int64)
    q = (torch.round(w / scale.float()[:, None]) + zero[:, None]).clamp(0, 15).to(torch.int64)
    return q, scale, zero


def _quantize_int4(weight: torch.Tensor, fmt: Format, perm: torch.Tensor | None):
    """weight [N, K] -> (q [N, K] on the checkpoint's column order, scales [N, G], zeros [N, G], g_idx [K],
    dequantized [N, K])."""
    n, k = weight.shape
    g = fmt.group_size
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // g  # act-order: the i-th channel in `order` falls in group i // g
    grouped = weight[:, order].reshape(n * (k // g), g)
    q, scale, zero = _int4_grid(grouped, fmt.symmetric)
    q_ordered = q.reshape(n, k)
    codes = torch.empty_like(q_ordered)
    codes[:, order] = q_ordered
    scales, zeros = scale.reshape(n, k // g), zero.reshape(n, k // g)
    deq = scales.float()[:, g_idx] * (codes - zeros[:, g_idx]).float()
    return codes, scales, zeros, g_idx, deq


def _gptq(prefix: str, weight: torch.Tensor, fmt: Format, perm: torch.Tensor | None):
    codes, scales, zeros, g_idx, deq = _quantize_int4(weight, fmt, perm)
    offset = 1 if fmt.quantization_config.get("checkpoint_format", "gptq") == "gptq" else 0
    tensors = {
        f"{prefix}.qweight": pack_rows(codes.T.contiguous()),  # [K / 8, N]
        f"{prefix}.qzeros": pack_cols((zeros - offset).T.contiguous()),  # [G, N / 8], v1 stores zero - 1
        f"{prefix}.scales": scales.T.contiguous(),  # [G, N] fp16
        f"{prefix}.g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


def _awq(prefix: str, weight: torch.Tensor, fmt: Format, perm: torch.Tensor | None):
    codes, scales, zeros, _, deq = _quantize_int4(weight, fmt, None)
    tensors = {
        f"{prefix}.qweight": pack_cols(codes.T.contiguous(), order=AWQ_ORDER),  # [K, N / 8]
        f"{prefix}.qzeros": pack_cols(zeros.T.contiguous(), order=AWQ_ORDER),  # [G, N / 8]
        f"{prefix}.scales": scales.T.contiguous(),  # [G, N] fp16
    }
    return tensors, deq


def _compressed_tensors(prefix: str, weight: torch.Tensor, fmt: Format, perm: torch.Tensor | None):
    n, k = weight.shape
    packed = fmt.quantization_config["format"] == "pack-quantized"
    if fmt.bits == 8:
        scale = (weight.abs().amax(-1, keepdim=True) / 127.0).bfloat16()  # [N, 1], channel strategy
        q = torch.round(weight / scale.float()).clamp(-128, 127).to(torch.int64)
        deq = q.float() * scale.float()
        if packed:
            data = {f"{prefix}.weight_packed": pack_cols(q + 128, bits=8)}
        else:
            data = {f"{prefix}.weight": q.to(torch.int8)}
        return {**data, f"{prefix}.weight_scale": scale, **_shape(prefix, n, k, packed)}, deq
    codes, scales, zeros, g_idx, deq = _quantize_int4(weight, fmt, perm)
    signed = codes - 8  # compressed-tensors quantizes to signed int4 and packs it with +8
    tensors = {f"{prefix}.weight_packed": pack_cols(signed + 8), f"{prefix}.weight_scale": scales.bfloat16()}
    deq = scales.bfloat16().float()[:, g_idx] * (codes - zeros[:, g_idx]).float()  # scales as stored (bf16)
    if not fmt.symmetric:
        tensors[f"{prefix}.weight_zero_point"] = pack_rows(zeros)  # signed zp (zeros - 8) packed +8, along N
    if fmt.act_order:
        tensors[f"{prefix}.weight_g_idx"] = g_idx.to(torch.int32)
    return {**tensors, **_shape(prefix, n, k, True)}, deq


def _shape(prefix: str, n: int, k: int, packed: bool) -> dict[str, torch.Tensor]:
    return {f"{prefix}.weight_shape": torch.tensor([n, k])} if packed else {}


WRITERS = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors}


def write_quantized_checkpoint(float_dir: Path, out_dir: Path, fmt: Format, seed: int = 0) -> dict[str, torch.Tensor]:
    """Copy `float_dir` to `out_dir` with every decoder linear quantized in `fmt`; returns the dequantized
    weights by checkpoint name (e.g. "model.layers.0.self_attn.q_proj")."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in float_dir.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out_dir / path.name)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    state = load_file(str(float_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    tensors, reference = {}, {}
    writer = WRITERS[fmt.quantization_config["quant_method"]]
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        linear = prefix.rpartition(".")[2]
        if leaf != "weight" or linear not in LINEARS:
            tensors[name] = tensor
            continue
        perm = None
        if fmt.act_order:
            key = (prefix.rsplit(".", 2)[0], INPUT_OF[linear])
            if key not in perms:
                perms[key] = torch.randperm(tensor.shape[1], generator=generator)
            perm = perms[key]
        written, reference[prefix] = writer(prefix, tensor.float(), fmt, perm)
        tensors.update(written)
    save_file(tensors, str(out_dir / "model.safetensors"))
    return reference


def gptq_config(checkpoint_format: str = "gptq", desc_act: bool = True, sym: bool = True) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": checkpoint_format}  # fmt: skip


def awq_config() -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}


def compressed_tensors_config(bits: int, fmt: str = "pack-quantized", symmetric: bool = True,
                              actorder: str | None = None) -> dict:  # fmt: skip
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "dynamic": False, "actorder": actorder,
               "strategy": "group" if bits == 4 else "channel", "group_size": 128 if bits == 4 else None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None}},  # fmt: skip
        "ignore": ["lm_head"],
    }


FORMATS = [
    Format("gptq-act-order-sym", gptq_config("gptq", desc_act=True, sym=True), act_order=True),
    Format("gptq_v2-asym", gptq_config("gptq_v2", desc_act=False, sym=False), symmetric=False),
    Format("awq-gemm", awq_config(), symmetric=False),
    Format("ct-w4a16-sym-actorder", compressed_tensors_config(4, actorder="group"), act_order=True),
    Format("ct-w4a16-asym", compressed_tensors_config(4, symmetric=False), symmetric=False),
    Format("ct-w8a16-int-quantized", compressed_tensors_config(8, "int-quantized"), bits=8, group_size=0),
    Format("ct-w8a16-pack-quantized", compressed_tensors_config(8, "pack-quantized"), bits=8, group_size=0),
]
