"""The order a queued job's ranks on one node will read a dataset in: what to stage first.

A job names its dataset, seed, world size and node rank before it starts (a Slurm
prolog, a Kubernetes init container). Epoch 0's order is a pure function of those
and of the dataset's sample counts (`plans.positions.node_epoch_sequences` when every count is
known, `order.cold.node_cold_sequences` when the first epoch is read cold), so the
shards this node's ranks open first can be staged first and the first batch is local
when the job starts. The rest of the dataset follows in manifest order.

The planning here is the loader's own and imports no torch: the daemon's image runs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from itertools import zip_longest

from datacache.loaders.order.cold import node_cold_sequences
from datacache.loaders.order.layout import Layout, reader_name
from datacache.loaders.plans.counts import complete, load_or_build_plan
from datacache.loaders.plans.positions import auto_window, node_epoch_sequences
from datacache.tiers.files import UnsafeFileError

from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.counting.indexfiles import IndexFiles
from datacache.errors import ConfigError, close_match
from datacache.formats._base import UnitPlan
from datacache.staging import DatasetHandle

__all__ = ["JobLayout", "node_first_units", "prestage_keys", "shard_order"]

_FORM = "seed=N,world_size=N,node_rank=N,ranks_per_node=N[,shuffle=true|false,shuffle_buffer=N,drop_last=true|false]"


@dataclass(frozen=True, slots=True)
class JobLayout:
    """What a queued job says of itself: the dataset's dealing and this node's place in the job."""

    seed: int
    world_size: int
    node_rank: int
    ranks_per_node: int
    shuffle: bool = True
    shuffle_buffer: int | None = None
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1 or self.node_rank < 0:
            raise ConfigError(f"--order-for: world_size and ranks_per_node must be positive ({_FORM})")
        if self.node_rank * self.ranks_per_node >= self.world_size:
            raise ConfigError(
                f"--order-for: node_rank {self.node_rank} with {self.ranks_per_node} ranks per node "
                f"holds no rank of world size {self.world_size}"
            )

    @property
    def ranks(self) -> range:
        """The global ranks this node runs (torchrun's: node_rank * nproc_per_node + local rank)."""
        first = self.node_rank * self.ranks_per_node
        return range(first, min(first + self.ranks_per_node, self.world_size))

    @classmethod
    def parse(cls, text: str) -> JobLayout:
        """``seed=17,world_size=16,node_rank=1,ranks_per_node=8`` (as `--order-for` takes it)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, object] = {}
        for part in (p.strip() for p in text.split(",")):
            name, sep, raw = part.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in known:
                guess = close_match(name, known) if sep else None
                hint = f"; did you mean {guess!r}?" if guess else f" ({_FORM})"
                raise ConfigError(f"--order-for {text!r}: {part!r} is not one of its fields{hint}")
            values[name] = _value(name, raw.strip(), text)
        missing = [name for name in ("seed", "world_size", "node_rank", "ranks_per_node") if name not in values]
        if missing:
            raise ConfigError(f"--order-for {text!r}: missing {', '.join(missing)} ({_FORM})")
        return cls(**values)  # type: ignore[arg-type]


def _value(name: str, raw: str, text: str) -> object:
    if name in ("shuffle", "drop_last"):
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ConfigError(f"--order-for {text!r}: {name} must be true or false, got {raw!r}")
        return raw.lower() in ("true", "1")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"--order-for {text!r}: {name} must be an integer, got {raw!r}") from None


def node_first_units(counts: list[int], job: JobLayout, *, cold: bool) -> list[int]:
    """The units this node's ranks read in epoch 0, in the order they first need them.

    The ranks start together, so their streams are interleaved: every rank's first unit,
    then every rank's second, and so on; a unit two ranks share comes once.
    """
    layout = Layout(world_size=job.world_size)
    if cold:
        streams = node_cold_sequences(len(counts), seed=job.seed, epoch=0, shuffle=job.shuffle, layout=layout)
    else:
        window = job.shuffle_buffer or auto_window(sum(counts), len(counts))
        streams = node_epoch_sequences(
            counts, seed=job.seed, epoch=0, shuffle=job.shuffle, window=window, layout=layout,
            drop_last=job.drop_last,
        )
    mine = [streams.get(reader_name(rank, 0), ()) for rank in job.ranks]
    ordered: dict[int, None] = {}
    for step in zip_longest(*mine):
        ordered.update((unit, None) for unit in step if unit is not None)
    return list(ordered)


def shard_order(plan: UnitPlan, job: JobLayout, *, cold: bool) -> list[str]:
    """Every shard of ``plan``: this node's epoch-0 shards first, in reading order, then the rest."""
    first = node_first_units([unit.count for unit in plan.units], job, cold=cold)
    keys: dict[str, None] = {}
    for index in first:
        keys.update((key, None) for key in plan.units[index].keys)
    for unit in plan.units:
        keys.update((key, None) for key in unit.keys)
    return list(keys)


def _recorded_cold(settings: Settings, handle: DatasetHandle, seed: int) -> bool | None:
    """What the cluster recorded for epoch 0 of ``seed`` (`counting.decide_cold`), read only: None if nothing."""
    try:
        raw = IndexFiles(settings, handle.manifest).read(f"epoch-{seed}-0.json")
        return None if raw is None else bool(json.loads(raw).get("cold") is True)
    except (ValueError, AttributeError, UnsafeFileError, OSError):
        return None


async def prestage_keys(access: ShardAccess, handle: DatasetHandle, settings: Settings, job: JobLayout) -> list[str]:
    """The dataset's shard keys in the order ``job``'s ranks on this node will need them.

    The counts are the loader's (`plans.counts.load_or_build_plan` without waiting: a dataset not yet
    counted is read cold in its first epoch, whole shards dealt, so only the shard count
    matters); a decision the cluster already recorded for this seed's epoch 0 is kept.
    """
    plan = await load_or_build_plan(access, handle, settings, wait=False)
    cold = not complete(plan) or _recorded_cold(settings, handle, job.seed) is True
    return shard_order(plan, job, cold=cold)
