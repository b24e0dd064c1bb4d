"""Sizing the tiers for a job on paper, before any hardware exists."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from datacache.bench._verdict import gbps
from datacache.errors import ConfigError
from datacache.sizes import format_bytes

_HEADROOM = 1.10  # staging in flight, eviction lag, filesystem overhead


@dataclass(frozen=True)
class TierNeed:
    """What one tier needs for a job."""

    tier: str
    capacity: int
    capacity_scope: str  # "per node", "cluster", "read once"
    bandwidth: float
    bandwidth_scope: str
    note: str


@dataclass(frozen=True)
class TierSizing:
    """The answer of `plan_tiers`."""

    gpus: int
    per_gpu: float
    dataset_bytes: int
    epochs: int
    nodes: int
    node_need: float
    cluster_need: float
    epoch_seconds: float
    local_fraction: float
    tiers: tuple[TierNeed, ...]
    warm_seconds: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus_per_node": self.gpus,
            "gpus": self.gpus * self.nodes,
            "per_gpu_bytes_per_s": self.per_gpu,
            "dataset_bytes": self.dataset_bytes,
            "epochs": self.epochs,
            "nodes": self.nodes,
            "node_need_bytes_per_s": self.node_need,
            "cluster_need_bytes_per_s": self.cluster_need,
            "epoch_seconds": self.epoch_seconds,
            "local_fraction": self.local_fraction,
            "warm_seconds": self.warm_seconds,
            "tiers": [asdict(t) for t in self.tiers],
        }


def plan_tiers(
    *,
    gpus: int,
    per_gpu: float,
    dataset_bytes: int,
    epochs: int = 1,
    nodes: int = 1,
    local_capacity: int | None = None,
    origin_bandwidth: float | None = None,
) -> TierSizing:
    """Size each tier for ``nodes`` x ``gpus`` reading ``dataset_bytes`` at ``per_gpu`` each.

    Every node reads a different part of each epoch and, over the epochs,
    all of the dataset (the order is reshuffled across ranks each epoch), so a
    node's local tier needs the whole dataset to serve every epoch after the
    first from NVMe. Given a smaller ``local_capacity``, the no-thrash policy
    keeps that share resident and the rest of each epoch comes from the
    shared tier. The shared tier holds one copy for the cluster, filled from
    the origin once.
    """
    if gpus <= 0 or per_gpu <= 0 or dataset_bytes <= 0 or epochs <= 0 or nodes <= 0:
        raise ConfigError("--gpus, --per-gpu, --dataset, --epochs and --nodes must be positive")
    node_need = gpus * per_gpu
    cluster_need = node_need * nodes
    epoch_seconds = dataset_bytes / cluster_need
    local, fraction = _local_tier(dataset_bytes, node_need, local_capacity)
    shared = _shared_tier(dataset_bytes, cluster_need, fraction, nodes)
    warm_seconds = dataset_bytes / origin_bandwidth if origin_bandwidth else None
    origin = _origin_tier(dataset_bytes, cluster_need, origin_bandwidth, warm_seconds)
    return TierSizing(
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=dataset_bytes,
        epochs=epochs,
        nodes=nodes,
        node_need=node_need,
        cluster_need=cluster_need,
        epoch_seconds=epoch_seconds,
        local_fraction=fraction,
        tiers=(origin, shared, local),
        warm_seconds=warm_seconds,
    )


def _local_tier(dataset_bytes: int, node_need: float, local_capacity: int | None) -> tuple[TierNeed, float]:
    """Each node's NVMe, and the share of the dataset it holds: all of it with headroom, or less."""
    wanted_local = int(dataset_bytes * _HEADROOM)
    fraction = 1.0 if local_capacity is None else min(1.0, local_capacity / wanted_local)
    tier = TierNeed(
        "local",
        wanted_local if local_capacity is None else local_capacity,
        "per node",
        node_need * fraction if fraction < 1 else node_need,
        "per node, sustained reads",
        (
            "the whole dataset plus 10% headroom: every epoch after the first reads NVMe only"
            if fraction >= 1
            else f"holds {fraction:.0%} of the dataset (no-thrash policy); the rest of each epoch "
            "comes from the shared tier"
        ),
    )
    return tier, fraction


def _shared_tier(dataset_bytes: int, cluster_need: float, fraction: float, nodes: int) -> TierNeed:
    """One copy for the cluster: it feeds the first epoch, and what the local tiers cannot hold."""
    warm_epochs_from_shared = cluster_need * (1.0 - fraction)
    return TierNeed(
        "shared",
        int(dataset_bytes * 1.05),
        "cluster",
        max(cluster_need if fraction >= 1 else warm_epochs_from_shared, 0.0),
        "cluster, aggregate reads",
        (
            f"one copy for all {nodes} nodes; {gbps(cluster_need)} while the first epoch "
            "fills the local tiers (or warm them before training), "
            + (
                "nothing afterwards"
                if fraction >= 1
                else f"{gbps(warm_epochs_from_shared)} every epoch after"
            )
        ),
    )


def _origin_tier(
    dataset_bytes: int, cluster_need: float, origin_bandwidth: float | None, warm_seconds: float | None
) -> TierNeed:
    """The origin, read once for the whole cluster."""
    return TierNeed(
        "origin",
        dataset_bytes,
        "read once",
        cluster_need,
        "to feed a cold first epoch directly",
        (
            "each shard is read once for the whole cluster (through the shared tier); "
            + (
                f"at {gbps(origin_bandwidth)} warming takes {_duration(warm_seconds)}"
                if warm_seconds is not None
                else "give --origin-bandwidth to see how long warming takes"
            )
        ),
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: TierSizing) -> str:
    """The plan as a short table."""
    lines = [
        f"job: {plan.nodes} node{'s' if plan.nodes != 1 else ''} x {plan.gpus} GPUs per node = "
        f"{plan.gpus * plan.nodes} GPUs x {gbps(plan.per_gpu)} = "
        f"{gbps(plan.node_need)} per node, {gbps(plan.cluster_need)} for the cluster",
        f"dataset {format_bytes(plan.dataset_bytes)}: one epoch takes "
        f"{_duration(plan.epoch_seconds)} at that rate; {plan.epochs} epoch(s) read "
        f"{format_bytes(plan.dataset_bytes * plan.epochs)} in all",
        f"{'TIER':<8} {'CAPACITY':>12} {'':<10} {'BANDWIDTH':>12}  NOTE",
    ]
    for tier in plan.tiers:
        lines.append(
            f"{tier.tier:<8} {format_bytes(tier.capacity):>12} {tier.capacity_scope:<10} "
            f"{gbps(tier.bandwidth):>12}  {tier.note}"
        )
    return "\n".join(lines) + "\n"
