"""The torchrun-shaped trainer of tests/test_outage_distributed.py: 2 gloo ranks x 2 DataLoader workers.

Run as the job user (``python -c "import _outage_ranks; _outage_ranks.main(SIGNALS)"``). Each rank
reads 3 epochs of the configured dataset ``train``; the ranks and the test talk through files
in ``SIGNALS``: a rank touches ``kill-RANK`` 10 samples into epoch 0 and waits for ``killed``, and
``restart-RANK`` before epoch 2, waiting for ``restarted``. Rank 0 writes every rank's epochs,
gathered over the process group, to ``result.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def _wait_for(signals: Path, name: str) -> None:
    deadline = time.monotonic() + 300
    while not (signals / name).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"the test never wrote {name}")
        time.sleep(0.05)  # sleep-ok: spaces the polls for the test's answer; the file ends the wait


def _rank_main(rank: int, world: int, signals: Path) -> None:
    import torch.distributed as dist
    from datacache.loaders import CachedIterableDataset
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo", init_method=f"file://{signals / 'init'}", rank=rank, world_size=world)
    try:
        dataset = CachedIterableDataset("train", shuffle=True, seed=3)
        loader = DataLoader(dataset, batch_size=None, num_workers=2)
        epochs: list[dict[str, Any]] = []
        for epoch in range(3):
            dataset.set_epoch(epoch)
            if epoch == 2:
                (signals / f"restart-{rank}").touch()
                _wait_for(signals, "restarted")
            seen: list[list[str]] = []
            for sample in loader:
                seen.append([sample["__key__"], hashlib.sha256(sample["bin"]).hexdigest()])
                if epoch == 0 and len(seen) == 10:
                    (signals / f"kill-{rank}").touch()  # mid-epoch, the workers reading through the daemon
                    _wait_for(signals, "killed")
            epochs.append({"seen": seen, "mode": dataset.stats().mode})
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, epochs)
        if rank == 0:
            (signals / "result.json").write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def main(signals: str) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, Path(signals)), nprocs=2, join=True)


if __name__ == "__main__":
    main(sys.argv[1])
