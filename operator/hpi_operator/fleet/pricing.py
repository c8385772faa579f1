"""A pool's price per replica-hour from its nodes' price labels, for pools the spec gives no costPerHour.

Kubernetes has no standard price label, so the key is an operator setting (`--node-price-label`, default
names.NODE_PRICE_LABEL) that a platform team's node provisioner writes: a Karpenter NodePool's template labels,
a cloud's instance-type price table applied as labels, a spot-price controller. Its value is the node's price per
node-hour as a plain decimal string ("2.48"): label values allow digits and dots, not currency signs.

One replica pays for the share of a node it takes, the same share placement uses to count how many fit:
GPUs per replica / the node's GPUs on a GPU pool, the replica's memory (weights + KV cache + overhead, what its
pod requests) / the node's allocatable memory on a CPU pool. The pool's price is the **mean** of that over its
priced nodes: the scheduler spreads replicas over the pool's nodes, so the mean is what a replica costs in
expectation, where the cheapest would make a pool with one cheap (say spot) node look cheaper than it is and
draw more replicas than that node holds. Nodes without the label do not count; a label that is not a
non-negative finite decimal is ignored and said why, never a crash. spec.placement.pools[].costPerHour, when
set, overrides all of this (fleet/offers.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..nodes import NodeInfo, Pool
from ..profiles import Profile


@dataclass(frozen=True)
class NodePrices:
    """The operator's price label and its raw value on each node that carries it (read from the node inventory)."""

    label: str
    values: Mapping[str, str]  # node name -> label value


@dataclass(frozen=True)
class LabelPrice:
    cost_per_hour: float | None  # per replica; None when no node of the pool has a usable price
    num_priced_nodes: int
    ignored: tuple[str, ...] = ()  # one reason per node whose label could not be used


def parse_node_price(raw: str) -> float:
    """A price label's value -> price per node-hour; ValueError says why it is not one."""
    try:
        price = float(raw)
    except ValueError:
        raise ValueError(f"{raw!r} is not a decimal price per node-hour") from None
    if not math.isfinite(price) or price < 0:
        raise ValueError(f"{raw!r} is not a non-negative finite price per node-hour")
    return price


def _replica_share(pool: Pool, profile: Profile, index: int) -> float | None:
    """The nodes like node `index` one replica takes (a fraction of one, or a group's pod on each of
    `num_nodes`); None when the node cannot hold a pod of it."""
    if pool.device == "cpu":
        memory = pool.memory_bytes_per_node[index] if index < len(pool.memory_bytes_per_node) else 0
        share = profile.needed_bytes / memory if memory >= profile.needed_bytes > 0 else None
    else:
        gpus = pool.gpus_per_node[index] if index < len(pool.gpus_per_node) else 0
        share = profile.num_gpus / gpus if gpus >= profile.num_gpus > 0 else None
    return None if share is None else share * profile.num_nodes


def label_price(pool: Pool, profile: Profile, prices: NodePrices) -> LabelPrice:
    """One replica's price per hour on `pool` from its nodes' labels."""
    shares, ignored = [], []
    for index, node in enumerate(pool.node_names):
        raw = prices.values.get(node)
        if raw is None:
            continue
        try:
            price = parse_node_price(raw)
        except ValueError as e:
            ignored.append(f"node {node}: label {prices.label}={e}")
            continue
        share = _replica_share(pool, profile, index)
        if share is None:
            ignored.append(f"node {node}: holds no replica of {profile.label()}")
            continue
        shares.append(price * share)
    cost = sum(shares) / len(shares) if shares else None
    return LabelPrice(cost, len(shares), tuple(ignored))


def node_prices(label: str, nodes: Iterable[NodeInfo]) -> NodePrices:
    """The price label's raw values on the nodes that carry it; no label key (the setting emptied): none."""
    return NodePrices(label, {n.name: n.labels[label] for n in nodes if label and label in n.labels})
