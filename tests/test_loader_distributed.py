"""Real torch.distributed (gloo, 2 processes): ranks come from the process group."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path

from _ranks import gather_json, process_group, spawn_ranks
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings


def _rank_main(rank: int, world: int, init_file: str, origin: str, settings_blob: bytes, out: str) -> None:
    with process_group(rank, world, init_file):
        settings = pickle.loads(settings_blob)
        results: dict[str, list[str]] = {}
        for drop_last, workers in ((True, 3), (False, 2)):
            dataset = CachedIterableDataset(origin, config=settings, seed=21, shuffle_buffer=16, drop_last=drop_last)
            results[f"{drop_last}-{workers}"] = keys_of(DataLoader(dataset, batch_size=4, num_workers=workers))
        batched = CachedIterableDataset(origin, config=settings, seed=21, shuffle_buffer=16, batch_size=5)
        results["False-batch"] = keys_of(DataLoader(batched, batch_size=None, num_workers=2))
        gather_json(results, out)


def test_two_gloo_ranks_with_several_workers_read_each_sample_exactly_once(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=83, per_shard=12)
    out = tmp_path / "result.json"
    spawn_ranks(_rank_main, tmp_path / "init", str(origin), pickle.dumps(settings), str(out))
    per_rank = json.loads(out.read_text())
    for case in per_rank[0]:
        first, second = per_rank[0][case], per_rank[1][case]
        everything = Counter(first + second)
        assert set(everything) <= set(expected), case
        if case.startswith("True"):
            # drop_last: 41 samples each, all distinct; exactly one sample of 83 is left out.
            assert len(first) == len(second) == len(expected) // 2, case
            assert max(everything.values()) == 1, f"{case}: a sample was read twice"
            assert len(everything) == len(expected) - 1, case
        else:
            # Padding: 42 each, every sample read, exactly one read twice to even out the ranks.
            assert len(first) == len(second) == -(-len(expected) // 2), case
            assert set(everything) == set(expected), f"{case}: a sample was never read"
            assert sorted(everything.values(), reverse=True)[:2] == [2, 1], f"{case}: more than the padding repeats"
