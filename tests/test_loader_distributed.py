"""Real torch.distributed (gloo, 2 processes): ranks come from the process group."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings


def _rank_main(rank: int, world: int, init_file: str, origin: str, settings_blob: bytes, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        settings = pickle.loads(settings_blob)
        dataset = CachedIterableDataset(origin, config=settings, seed=21, shuffle_buffer=16, drop_last=True)
        keys = keys_of(DataLoader(dataset, batch_size=4, num_workers=1))
        gathered: list[list[str] | None] = [None] * world
        dist.all_gather_object(gathered, keys)
        if rank == 0:
            Path(out).write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_split_the_epoch_exactly_once(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=83, per_shard=12)
    out = tmp_path / "result.json"
    mp.spawn(
        _rank_main,
        args=(2, str(tmp_path / "init"), str(origin), pickle.dumps(settings), str(out)),
        nprocs=2,
        join=True,
    )
    per_rank = json.loads(out.read_text())
    assert len(per_rank[0]) == len(per_rank[1]) == len(expected) // 2
    everything = per_rank[0] + per_rank[1]
    assert len(set(everything)) == len(everything)
    assert set(everything) <= set(expected)
