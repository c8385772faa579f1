"""Mixed-precision policies for int4: which linears keep int8, by kind and layer position.

llama.cpp's Q4_K_M keeps attn_v and ffn_down at 6 bits in the edge layers and every third layer between;
ours was chosen the same way, by measurement (docs/quantization.md, "Mixed precision"): on the embedded
model at int4 group 64 (group 32 re-finds that checkpoint's own Q4_1 grid, so only group 64 shows real int4
loss), bf16, each linear kind and each layer quantized alone, ranked by the KL divergence it adds to the
unquantized model's next-token distributions over the fixed text; then candidate policies ranked by KL
saved per extra weight byte. The merged q/k/v projection is the most sensitive kind (alone 0.078 of int4's
0.198 nats; down 0.057, gate/up 0.042, o 0.009), no layer position stands out consistently, and keeping
q/k/v at int8 in every layer saved the most per byte: KL 0.198 -> 0.109 for 9% more linear-weight bytes
(q/k/v + down at the edges and every third layer, llama.cpp's pattern: 0.135 for 13%). Our q, k and v are
one merged matrix (one method for all three), so the unit is the merged layer.
"""

from __future__ import annotations

import re

# Policy name -> {linear kind: rule}; a rule says which layers keep int8: "all"; "edges" (the first and last
# EDGE_FRACTION of the layers); "more_bits" (llama.cpp's: the edges and every third layer between). Kinds a
# policy leaves out stay int4.
INT4_POLICIES: dict[str, dict[str, str]] = {
    "uniform": {},
    "mixed": {"qkv_proj": "all"},
}
DEFAULT_INT4_POLICY = "mixed"
EDGE_FRACTION = 1 / 8  # of the layers at each end (llama.cpp's use_more_bits: n / 8)
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)$")


def _is_edge(layer: int, num_layers: int) -> bool:
    edge = max(1, round(num_layers * EDGE_FRACTION))
    return layer < edge or layer >= num_layers - edge


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the edge layers and every third layer between them."""
    edge = max(1, round(num_layers * EDGE_FRACTION))
    return _is_edge(layer, num_layers) or (layer - edge) % 3 == 2


_RULES = {"all": lambda layer, num_layers: True, "edges": _is_edge, "more_bits": _more_bits}


def layer_method(method: str, policy: str, module_name: str, num_layers: int) -> str:
    """The method linear `module_name` (e.g. "model.layers.3.mlp.down_proj") gets under `policy` when the
    model is quantized with `method`; only int4 has policies."""
    if method != "int4":
        return method
    match = _LAYER_NAME.search(module_name)
    if match is None:
        return method
    layer, kind = int(match.group(1)), match.group(2)
    rule = INT4_POLICIES[policy].get(kind)
    return "int8" if rule is not None and _RULES[rule](layer, num_layers) else method


def describe_policy(policy: str, num_layers: int) -> str:
    """Human-readable: which linears the policy keeps at int8 on a model of `num_layers` layers."""
    rules = INT4_POLICIES[policy]
    if not rules:
        return "all linears int4"
    parts = []
    for kind, rule in rules.items():
        layers = [i for i in range(num_layers) if _RULES[rule](i, num_layers)]
        parts.append(f"{kind} of layers {_ranges(layers)}")
    return "int8: " + "; ".join(parts)


def _ranges(values: list[int]) -> str:
    spans: list[list[int]] = []
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)
