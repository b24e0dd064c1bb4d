"""One loader's run in its own process: epochs timed, every byte touched, samples counted.

Run by `benchmarks.run` as ``python -m benchmarks._job SPEC_JSON``; prints one
``BENCH-RESULT {json}`` line. Two kinds of run:

- ``epochs``: one cold epoch (the runner hands over an empty cache folder)
  then one warm epoch, each timed from ``iter(loader)`` to its end, worker
  start-up included, as a training epoch would pay it;
- ``train``: a rank of a training-like job (the runner starts N of them with
  RANK/WORLD_SIZE set and torch.distributed on gloo over 127.0.0.1) that
  consumes at a fixed rate: after each batch it "computes" (sleeps) until the
  batch's bytes divided by the per-rank target have passed, as a GPU step
  would, and measures how long it waited for data.

Every consumer copies every payload byte it gets into one preallocated buffer
(as ``.cuda()`` from a pinned buffer would), so a zero-copy view is never
counted as a read, and counts the samples of each epoch.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks._common import PAYLOAD, EpochResult, emit, peak_rss
from benchmarks._loaders import FACTORIES, Context


class Toucher:
    """Copies every payload byte of a batch into a reused buffer; returns (samples, bytes)."""

    def __init__(self, size: int = 64 << 20) -> None:
        self._grow(size)

    def _grow(self, size: int) -> None:
        self.buffer = np.empty(size, dtype=np.uint8)
        self.tensor = torch.from_numpy(self.buffer)
        self.view = memoryview(self.buffer)

    def __call__(self, batch: Any) -> tuple[int, int]:
        if isinstance(batch, dict):
            fields = {k: v for k, v in batch.items() if not str(k).startswith("__")}
            main = fields.get(PAYLOAD)
        elif isinstance(batch, list | tuple):
            fields = {PAYLOAD: batch}
            main = batch
        else:
            raise TypeError(f"unexpected batch type {type(batch).__name__}")
        if main is None:
            raise KeyError(f"batch has no {PAYLOAD!r} field (fields: {sorted(fields)})")
        total = 0
        position = 0
        for value in fields.values():
            nbytes = self._nbytes(value)
            if position + nbytes > len(self.buffer):
                self._grow(2 * (position + nbytes))
                position = 0
            self._copy(value, position)
            position += nbytes
            total += nbytes
        return len(main), total

    @staticmethod
    def _nbytes(value: Any) -> int:
        if hasattr(value, "offsets") and hasattr(value, "data"):  # datacache PackedBytes
            return int(value.data.numel())
        if isinstance(value, torch.Tensor):
            return int(value.numel() * value.element_size())
        if isinstance(value, list | tuple):
            return sum(len(v) if isinstance(v, bytes | bytearray | memoryview) else 0 for v in value)
        return 0

    def _copy(self, value: Any, at: int) -> None:
        if hasattr(value, "offsets") and hasattr(value, "data"):
            n = int(value.data.numel())
            self.tensor[at : at + n].copy_(value.data)
        elif isinstance(value, torch.Tensor):
            flat = value.contiguous().reshape(-1).view(torch.uint8)
            self.tensor[at : at + flat.numel()].copy_(flat)
        elif isinstance(value, list | tuple):
            view = self.view
            for item in value:
                if isinstance(item, bytes | bytearray | memoryview):
                    n = len(item)
                    view[at : at + n] = item
                    at += n


def cpu_seconds() -> float:
    """User + system CPU of this process and of every process under it (DataLoader workers, ...).

    Ended children count once reaped (``os.times``' children fields); live ones through
    psutil where it is installed. The difference over an epoch is what the loader spent.
    """
    times = os.times()
    total = times.user + times.system + times.children_user + times.children_system
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with the dev extra
        return total
    for child in psutil.Process().children(recursive=True):
        try:
            used = child.cpu_times()
        except psutil.Error:
            continue
        total += used.user + used.system
    return total


def run_epoch(iterable: Any, toucher: Toucher, phase: str, expected: int) -> EpochResult:
    samples = nbytes = 0
    cpu = cpu_seconds()
    started = time.perf_counter()
    first = 0.0
    for batch in iterable:
        if not first:
            first = time.perf_counter() - started
        count, size = toucher(batch)
        samples += count
        nbytes += size
        del batch
    seconds = time.perf_counter() - started
    cpu = cpu_seconds() - cpu
    extra = {"cpu_seconds": cpu, "cpu_s_per_gb": cpu / (nbytes / 1e9) if nbytes else 0.0}
    return EpochResult(phase, seconds, samples, nbytes, expected, first_batch_seconds=first, extra=extra)


def run_train(loader: Any, toucher: Toucher, epochs: int, target: float) -> dict[str, Any]:
    """Consume at ``target`` bytes/s per rank; the first batch of the run (start-up) is not counted."""
    waited = busy = boundary = 0.0
    samples = nbytes = 0
    counts = []
    per_epoch: list[dict[str, float]] = []
    started_at = None
    for epoch in range(epochs):
        epoch_samples = 0
        epoch_waited = waited
        epoch_boundary = boundary
        epoch_started = time.perf_counter()
        iterator = iter(loader.epoch(epoch))
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            got = time.perf_counter()
            if started_at is None:
                started_at = got  # start-up is not a stall
            else:
                waited += got - asked
                if epoch_samples == 0:
                    boundary += got - asked  # the first batch of a later epoch
            count, size = toucher(batch)
            del batch
            epoch_samples += count
            samples += count
            nbytes += size
            budget = size / target
            spent = time.perf_counter() - got
            if budget > spent:
                time.sleep(budget - spent)
            busy += max(budget, spent)
        counts.append(epoch_samples)
        span = time.perf_counter() - (epoch_started if epoch else (started_at or epoch_started))
        stalled = waited - epoch_waited
        first = boundary - epoch_boundary
        per_epoch.append(
            {
                "waited": stalled,
                "first_batch_waited": first,
                "elapsed": span,
                "stall_fraction": stalled / span if span else 0.0,
                "within_stall_fraction": (stalled - first) / span if span else 0.0,
            }
        )
    elapsed = time.perf_counter() - (started_at or time.perf_counter())
    return {
        "samples": samples,
        "bytes": nbytes,
        "epoch_samples": counts,
        "per_epoch": per_epoch,
        "elapsed": elapsed,
        "waited": waited,
        "stall_fraction": waited / elapsed if elapsed else 0.0,
        "epoch_start_waited": boundary,
        "within_epoch_stall_fraction": (waited - boundary) / elapsed if elapsed else 0.0,
        "delivered_bytes_per_s": nbytes / elapsed if elapsed else 0.0,
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # on 2 cores, intra-op OpenMP threads spin and starve every loader alike
    ctx = Context(
        endpoint=spec["endpoint"],
        cache_dir=Path(spec["cache_dir"]),
        num_workers=int(spec["num_workers"]),
        expected=int(spec["expected"]),
        dataset=spec.get("dataset", Context.dataset),
        rank=int(os.environ.get("RANK", "0")),
        world=int(os.environ.get("WORLD_SIZE", "1")),
    )
    ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    if ctx.world > 1:
        torch.distributed.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world)
    loader = FACTORIES[spec["loader"]](ctx)
    toucher = Toucher()
    result: dict[str, Any] = {"loader": spec["loader"], "num_workers": ctx.num_workers, "rank": ctx.rank}
    try:
        if spec["kind"] == "epochs":
            phases = spec.get("phases", ["cold", "warm"])
            if not loader.has_cache:
                phases = phases[:1]
            epochs = []
            for n, phase in enumerate(phases):
                epoch = run_epoch(loader.epoch(n), toucher, phase, loader.expected)
                epochs.append(epoch.to_json())
                print(
                    f"[job] {spec['loader']} w={ctx.num_workers} {phase}: {epoch.samples} samples, "
                    f"{epoch.nbytes / epoch.seconds / 1e6:.0f} MB/s",
                    file=sys.stderr,
                    flush=True,
                )
            result["epochs"] = epochs
        else:
            if ctx.world > 1:
                torch.distributed.barrier()
            result["train"] = run_train(loader, toucher, int(spec["epochs"]), float(spec["target"]))
            result["train"]["target"] = float(spec["target"])
    finally:
        loader.close()
    result["peak_rss"] = peak_rss()
    emit(result)
    if ctx.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
