"""How loader processes end: workers of a killed training process, a loop left early."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

_KILLED_PARENT = """
import os, sys
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset
dataset = CachedIterableDataset(sys.argv[1], batch_size=16, decode="basic")  # batches pickled whole
iterator = iter(DataLoader(dataset, batch_size=None, num_workers=2))
for _ in range(4):  # both workers are running (a parent dead before a worker's loop starts is torch's race)
    next(iterator)
print(" ".join(str(worker.pid) for worker in iterator._workers), flush=True)
os._exit(9)  # the training process dies; its workers' batches are still in flight
"""


def _big_samples(directory: Path, shards: int = 4, per_shard: int = 64, size: int = 120_000) -> None:
    """Shards of samples large enough that a few batches overfill a pipe."""
    directory.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(directory / f"shard-{s:04d}.tar", "w") as tar:
            for i in range(per_shard):
                data = os.urandom(size)
                info = tarfile.TarInfo(f"s{s:04d}-{i:04d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited child not yet reaped, a zombie, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_workers_of_a_killed_training_process_exit(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    _big_samples(origin)
    run = subprocess.run(
        [sys.executable, "-c", _KILLED_PARENT, str(origin)],
        env=cache_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 9, run.stderr[-2000:]
    pids = [int(pid) for pid in run.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in pids):
        # Before: each stayed forever, its queue's thread sending a batch into a pipe nobody read.
        assert time.monotonic() < deadline, f"workers {[p for p in pids if _alive(p)]} outlived their parent"
        time.sleep(0.1)  # sleep-ok: polling other processes' exit, with a deadline
