"""Many readers on one node's catalog: no reader ever meets a lock timeout (issue 24 item 12).

`sqlite3.OperationalError: database is locked` reached a DataLoader worker from the catalog on
a busy machine: every shard read wrote to the catalog (its last access, and each process's
dataset row), and every reader of the node shares SQLite's one write lock. Here several ranks,
each with DataLoader workers, read one cached dataset for several epochs on one catalog; each
process reports (at DEBUG, when its catalog closes) its write transactions, the longest one
(its wait for the lock included) and the shard reads it recorded.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

from _helpers import REPO
from test_loader import write_wds

RANKS = 4
WORKERS = 2
EPOCHS = 3

RANK = textwrap.dedent(
    """\
    import logging, sys
    from torch.utils.data import DataLoader
    from datacache.loaders import CachedIterableDataset

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(process)d %(name)s %(message)s")
    logging.getLogger("datacache.catalog").setLevel(logging.DEBUG)
    dataset = CachedIterableDataset(sys.argv[1], seed=3)
    samples = 0
    for epoch in range(int(sys.argv[2])):
        dataset.set_epoch(epoch)
        for _ in DataLoader(dataset, batch_size=None, num_workers=int(sys.argv[3])):
            samples += 1
    print(samples)
    """
)

CLOSED = re.compile(r"catalog .*: (\d+) write transactions, the longest ([\d.]+) s; (\d+) reads recorded")


def test_ranks_and_workers_on_one_catalog_never_meet_a_lock_timeout(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=320, per_shard=10)  # 32 shards
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "PYTHONPATH": str(REPO)}
    # Epoch 0 of every rank stages the dataset; the later ones read it from the local tier.
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(origin), str(EPOCHS), str(WORKERS)],
            env={**env, "RANK": str(rank), "WORLD_SIZE": str(RANKS)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(RANKS)
    ]
    outputs = [rank.communicate(timeout=240) for rank in ranks]
    errors = [stderr for _, stderr in outputs if "database is locked" in stderr or "Traceback" in stderr]
    assert not errors, errors[0]
    assert all(rank.returncode == 0 for rank in ranks), [stderr for _, stderr in outputs]
    assert sum(int(stdout) for stdout, _ in outputs) == 320 * EPOCHS, "every sample once per epoch"
    closed = [CLOSED.search(line) for _, stderr in outputs for line in stderr.splitlines()]
    found = [(int(m[1]), float(m[2]), int(m[3])) for m in closed if m is not None]
    writes = sum(w for w, _, _ in found)
    reads = sum(r for _, _, r in found)
    longest = max(t for _, t, _ in found)
    print(f"{len(found)} processes: {writes} catalog writes for {reads} shard reads, the longest {longest:.3f} s")
    assert reads > 0
    # Batched: a few writes per epoch per process, not one (or more) per shard read.
    assert writes / reads < 0.5, (writes, reads)
