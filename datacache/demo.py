"""``make demo``: the whole path on this machine, with no S3 and no configuration.

1. Writes a small WebDataset-style dataset (tar shards of ~100 KB samples with
   labels) into a local origin folder.
2. Warms it through a shared folder to a local folder, as ``datacache warm``
   does on a cluster node, and warms it again (nothing to transfer).
3. Trains a tiny model for a few steps on the CPU through a PyTorch
   DataLoader over `CachedIterableDataset`, and reports samples/s, MB/s and the
   data-stall fraction against a bandwidth target.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import shutil
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

from datacache._logging import configure_logging
from datacache.config import Settings, load_settings, resolve_dataset
from datacache.manifest import MANIFEST_NAME
from datacache.sizes import format_bytes, format_rate
from datacache.staging import Stager, StagingEvent

__all__ = ["main"]

logger = logging.getLogger(__name__)


def write_dataset(origin: Path, *, shards: int, per_shard: int, seed: int = 0) -> int:
    """Write ``shards`` tar shards of ``per_shard`` samples each; return the bytes written."""
    origin.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = 0
    for shard in range(shards):
        path = origin / f"train-{shard:05d}.tar"
        if path.exists():
            total += path.stat().st_size
            continue
        partial = path.with_suffix(".tar.partial")
        with tarfile.open(partial, "w", format=tarfile.USTAR_FORMAT) as tar:
            for index in range(per_shard):
                key = f"{shard:05d}{index:05d}"
                label = int(rng.integers(0, 10))
                # A "sample": noisy bytes whose mean depends on the label, so the model can learn.
                size = int(rng.integers(50_000, 150_000))
                values = rng.normal(100 + 10 * label, 30, size).clip(0, 255).astype(np.uint8)
                for name, data in ((f"{key}.bin", values.tobytes()), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    info.mtime = 0
                    tar.addfile(info, io.BytesIO(data))
        partial.rename(path)
        total += path.stat().st_size
    # The manifest `datacache shard` would write: sizes and sample counts, so that
    # readers need not scan the shards before the first epoch.
    shards_json = [
        {"key": p.name, "size": p.stat().st_size, "samples": per_shard} for p in sorted(origin.glob("*.tar"))
    ]
    manifest = {"format_version": 1, "dataset": "demo", "url": str(origin), "format": "tar", "shards": shards_json}
    (origin / MANIFEST_NAME).write_text(json.dumps(manifest))
    return total


async def warm(settings: Settings, origin: Path) -> None:
    """Warm the demo dataset twice and say what each warm did."""
    dataset = resolve_dataset(str(origin), settings)
    async with Stager(settings) as stager:
        handle = await stager.open(dataset, refresh=True)
        for attempt in ("first", "second"):
            moved = {"origin->shared": 0, "shared->local": 0}

            def listen(event: StagingEvent, moved: dict[str, int] = moved) -> None:
                if event.kind == "bytes":
                    moved["origin->shared" if event.tier == "shared" else "shared->local"] += event.size

            stager.add_listener(listen)
            report = await stager.warm(handle)
            stager.remove_listener(listen)
            if not report.complete:
                raise SystemExit(f"demo: warm incomplete: {report.failures[:3]}")
            rate = report.bytes_requested / report.seconds if report.bytes_transferred else 0.0
            sys.stdout.write(
                f"  {attempt} warm: {report.shards_resident}/{report.shards_requested} shards resident "
                f"({format_bytes(report.bytes_requested)}); moved {format_bytes(moved['origin->shared'])} "
                f"origin->shared and {format_bytes(moved['shared->local'])} shared->local in {report.seconds:.2f}s"
                + (f" ({format_rate(rate)} end to end)" if rate else "")
                + "\n"
            )


def train(settings: Settings, origin: Path, *, epochs: int, batch_size: int, workers: int, target: str) -> None:
    """A tiny classifier trained for a few epochs, fed through a DataLoader over the cache."""
    try:
        import torch
        from torch.utils.data import DataLoader

        from datacache.loaders import CachedIterableDataset
    except ImportError:
        sys.stdout.write("  (torch is not installed: skipping training; pip install 'datacache[torch]')\n")
        return

    torch.manual_seed(0)
    torch.set_num_threads(1)  # on a small node, torch's spinning threads would steal the readers' cores
    features = 256
    model = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = CachedIterableDataset(
        str(origin), config=settings, seed=7, batch_size=batch_size, target_bandwidth=target
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=workers)
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        started = time.perf_counter()
        losses = []
        samples = nbytes = 0
        for batch in dataset.timed(loader):
            payload, offsets = batch["bin"].data, batch["bin"].offsets
            # Features: the mean of each sample's bytes over a fixed number of bins.
            rows = []
            for i in range(len(offsets) - 1):
                values = payload[offsets[i] : offsets[i + 1]].float()
                rows.append(values[: (len(values) // features) * features].view(features, -1).mean(dim=1) / 255)
            inputs = torch.stack(rows)
            labels = torch.tensor([int(x) for x in batch["cls"].tolist()])
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            losses.append(loss.item())
            samples += len(labels)
            nbytes += batch["bin"].nbytes
        seconds = time.perf_counter() - started
        stats = dataset.stats()
        stall = stats.stall_fraction if stats.stall_fraction is not None else 0.0
        sys.stdout.write(
            f"  epoch {epoch}: {len(losses)} steps of {batch_size}, loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
            f"{samples / seconds:.0f} samples/s, {format_rate(nbytes / seconds)} into the model; "
            f"data-stall {stall:.1%}; hits {', '.join(f'{t} {r:.0%}' for t, r in stats.hit_ratio.items())}\n"
        )
    where = f"{workers} worker processes" if workers else "reader threads in this process"
    sys.stdout.write(
        f"  loader: {format_rate(stats.bytes_per_second)} delivered by {where}; target {target} per rank: "
        f"{'held' if stats.meets_target else 'missed'}. (This tiny model eats {samples / seconds:.0f} samples/s on "
        f"the CPU, so the loop still waits {stall:.0%} of its time: a GPU step at the target rate would not.)\n"
    )
    dataset.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m datacache.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="build/demo", help="where the origin, shared and local folders go")
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--per-shard", type=int, default=40)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers (default: reader threads)")
    parser.add_argument("--target", default="100MB/s", help="per-rank bandwidth target for the training run")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    root = Path(args.dir).absolute()
    origin = root / "origin"
    settings = load_settings(
        overrides={"local_dir": str(root / "local"), "shared_dir": str(root / "shared")},
    )
    for tier in ("local", "shared"):  # start cold: the first warm moves every byte
        shutil.rmtree(root / tier, ignore_errors=True)
    sys.stdout.write(f"datacache demo in {root}\n")
    started = time.perf_counter()
    size = write_dataset(origin, shards=args.shards, per_shard=args.per_shard)
    sys.stdout.write(
        f"1. origin: {args.shards} tar shards x {args.per_shard} samples ({format_bytes(size)}) "
        f"in {origin} ({time.perf_counter() - started:.1f}s)\n"
    )
    sys.stdout.write(f"2. warm through the shared tier ({root / 'shared'}) to the local tier ({root / 'local'}):\n")
    asyncio.run(warm(settings, origin))
    sys.stdout.write("3. train a tiny model through a DataLoader over the cache:\n")
    train(settings, origin, epochs=args.epochs, batch_size=32, workers=args.workers, target=args.target)
    sys.stdout.write(f"done. Try: datacache ls --local-dir {root / 'local'} --shared-dir {root / 'shared'}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
