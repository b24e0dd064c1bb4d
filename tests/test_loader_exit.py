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


_ONE_EPOCH = """
import sys
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset
dataset = CachedIterableDataset(sys.argv[1], seed=1)
count = sum(1 for _ in DataLoader(dataset, batch_size=None, num_workers=int(sys.argv[2])))
print("the user's last line", count)
"""

_NOT_THE_USERS = ("Exception ignored", "Traceback", "Loop is not running", "Unclosed client session")


def test_a_run_through_the_daemon_ends_with_the_users_last_line(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """Issue 24 item 15: interpreter exit printed 'Exception ignored in ClientSession.__del__'.

    The next epoch's prefetch, still asking the daemon when the runtime closed at exit, opened
    a new session to it that nothing closed. Runs right after the daemon started are the ones
    that met it (the shards are not all local yet when the epoch ends).
    """
    from _daemon import start_daemon
    from test_loader import write_wds

    origin = tmp_path / "origin"
    write_wds(origin, samples=40, per_shard=10)
    for attempt in range(3):
        daemon = start_daemon(cache_env, tmp_path / f"cache-{attempt}")
        try:
            for workers in (0, 2):
                run = subprocess.run(
                    [sys.executable, "-c", _ONE_EPOCH, str(origin), str(workers)],
                    env=daemon.env,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=False,
                )
                assert run.returncode == 0, run.stderr[-3000:]
                assert run.stdout.splitlines()[-1] == "the user's last line 40"
                said = [line for line in run.stderr.splitlines() if line.startswith(_NOT_THE_USERS)]
                assert not said, run.stderr[-3000:]
        finally:
            daemon.kill()
