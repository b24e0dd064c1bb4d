"""JPEG decode + resize on remote CPU workers (issue 38): the training process's CPU and the throughput.

Run alone::

    python -m benchmarks.remote_decode [--images 2400] [--epochs 2] [--results benchmarks/RESULTS.md]

One dataset of WebDataset shards of JPEGs (made here with Pillow), one transform (decode, resize
to 128 x 128, to a uint8 tensor) and one batch size, three ways, each job in a fresh process:

- ``local``: ``DataLoader(CachedIterableDataset(..., transform=f), batch_size=None, num_workers=2)``,
  the dataset batching (batch mode): the training process and its two worker processes decode;
  run before any Ray process starts.
- ``remote``: the same dataset with ``remote=RayPool(workers=2)`` on a Ray cluster of a head with
  no CPUs and two worker nodes of one CPU each (``ray.cluster_utils.Cluster``): the training
  process only receives batches.
- ``ray data``: Ray Data's own streaming ingest of the same shards with the same transform,
  ``ray.data.read_webdataset(...).map_batches(f).iter_torch_batches(...)``, on the same cluster.

Each job reads one epoch untimed (the caches and the workers warm up), then ``--epochs`` timed
ones; its consumer sums every batch's pixels (touching every byte). The training process's CPU
is user + system seconds of that process and its children (the DataLoader workers), per GB of
JPEG shards read; the Ray workers are the cluster's processes, not the job's. On a real cluster the
remote workers run on other machines: here they share this machine's two cores with the
training process, which is the figure the throughput row compares on.
The table goes into RESULTS.md between ``<!-- remote-decode -->`` marks.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MARK = "<!-- remote-decode -->"
BATCH = 32
SIDE = 128


def decode_resize(sample: dict[str, Any]) -> dict[str, Any]:
    """The transform: a JPEG's bytes to a 3 x 128 x 128 uint8 tensor, with its label."""
    import torch
    from PIL import Image

    image = Image.open(io.BytesIO(sample["jpg"])).convert("RGB").resize((SIDE, SIDE), Image.BILINEAR)
    array = np.asarray(image, dtype=np.uint8)
    return {"img": torch.from_numpy(array.transpose(2, 0, 1).copy()), "cls": int(sample["cls"])}


def decode_resize_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """The same transform over a Ray Data batch (columns of numpy arrays)."""
    from PIL import Image

    images = []
    for data in batch["jpg"]:
        image = Image.open(io.BytesIO(bytes(data))).convert("RGB").resize((SIDE, SIDE), Image.BILINEAR)
        images.append(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
    labels = [int(bytes(c)) if isinstance(c, bytes | np.bytes_) else int(c) for c in batch["cls"]]
    return {"img": np.stack(images), "cls": np.asarray(labels, dtype=np.int64)}


def make_shards(directory: Path, images: int, per_shard: int) -> int:
    """WebDataset shards of ``images`` JPEGs (256 x 256, smooth plus noise, ~q90); returns their bytes."""
    import webdataset as wds
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(38)
    ramp = np.linspace(0, 200, 256, dtype=np.float32)
    with wds.ShardWriter(str(directory / "train-%04d.tar"), maxcount=per_shard, verbose=0) as writer:
        for index in range(images):
            base = ramp[None, :, None] + ramp[::-1][:, None, None] * (index % 7) / 7
            noisy = np.clip(base + rng.normal(0, 24, (256, 256, 3)), 0, 255).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(noisy).save(out, format="JPEG", quality=90)
            writer.write({"__key__": f"img{index:06d}", "jpg": out.getvalue(), "cls": str(index % 10).encode()})
    return sum(p.stat().st_size for p in directory.glob("*.tar"))


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _consume(batches: Any) -> int:
    count = 0
    for batch in batches:
        images = batch["img"]
        int(images.sum())  # touch every byte, as a copy to the GPU would
        count += int(images.shape[0])
    return count


def _epochs(make: Any, epochs: int) -> dict[str, float]:
    _consume(make(0))  # untimed: warms the caches, the page cache and the workers
    cpu, wall, images = _cpu(), time.perf_counter(), 0
    for epoch in range(1, epochs + 1):
        images += _consume(make(epoch))
    return {"cpu": _cpu() - cpu, "wall": time.perf_counter() - wall, "images": images}


def job(kind: str, origin: str, address: str | None, local_dir: str, epochs: int) -> dict[str, float]:
    """One measurement, in this process: ``kind`` is local, remote or ray data."""
    import torch

    torch.set_num_threads(1)
    from datacache.loaders import CachedIterableDataset, RayPool
    from torch.utils.data import DataLoader

    from datacache.config import load_settings

    settings = load_settings(overrides={"local_dir": local_dir})
    if kind == "ray data":
        import ray

        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        shards = sorted(str(p) for p in Path(origin).glob("*.tar"))

        def make(epoch: int) -> Any:
            data = ray.data.read_webdataset(shards, decoder=None)
            return data.map_batches(decode_resize_batch, batch_size=BATCH, batch_format="numpy").iter_torch_batches(
                batch_size=BATCH
            )

        return _epochs(make, epochs)
    pool = RayPool(workers=2, address=address) if kind == "remote" else None
    dataset = CachedIterableDataset(
        origin, config=settings, batch_size=BATCH, transform=decode_resize, remote=pool, shuffle=True
    )

    def make_loader(epoch: int) -> Any:
        dataset.set_epoch(epoch)
        return DataLoader(dataset, batch_size=None, num_workers=0 if pool else 2)

    return _epochs(make_loader, epochs)


def _run_job(kind: str, origin: Path, address: str | None, scratch: Path, epochs: int) -> dict[str, float]:
    spec = json.dumps({"kind": kind, "origin": str(origin), "address": address, "epochs": epochs,
                       "local_dir": str(scratch / f"driver-{kind.replace(' ', '-')}")})
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.remote_decode", "--job", spec], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"job {kind} failed: {done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _cluster(scratch: Path) -> Any:
    from ray.cluster_utils import Cluster

    small = {"object_store_memory": 200 * 1024 * 1024, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **small})
    for index in range(2):
        env = {"DATACACHE_LOCAL_DIR": str(scratch / f"node{index}"), "DATACACHE_SHARED_DIR": str(scratch / "shared")}
        cluster.add_node(num_cpus=1, env_vars=env, **small)
    cluster.wait_for_nodes()
    return cluster


def measure(images: int, epochs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="datacache-remote-decode-") as name:
        scratch = Path(name)
        origin = scratch / "origin"
        nbytes = make_shards(origin, images, per_shard=200)
        rows = {"local": _run_job("local", origin, None, scratch, epochs)}
        cluster = _cluster(scratch)
        try:
            rows["remote"] = _run_job("remote", origin, cluster.address, scratch, epochs)
            try:
                rows["ray data"] = _run_job("ray data", origin, cluster.address, scratch, epochs)
            except RuntimeError as exc:
                rows["ray data"] = {"error": str(exc).splitlines()[-1][:200]}  # type: ignore[dict-item]
        finally:
            cluster.shutdown()
    return {"images": images, "epochs": epochs, "bytes": nbytes, "rows": rows}


def render(result: dict[str, Any]) -> str:
    gigabytes = result["bytes"] * result["epochs"] / 1e9
    rows, lines = result["rows"], []
    local = rows["local"]
    lines += [
        MARK,
        f"JPEG decode + resize to {SIDE}x{SIDE}, batch {BATCH}: {result['images']} images in "
        f"{result['bytes'] / 1e6:.0f} MB of WebDataset shards, {result['epochs']} timed epoch(s) after one untimed; "
        f"generated by `python -m benchmarks.remote_decode` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| pipeline | images/s | x local | training process CPU s per GB | x local |",
        "|---|---|---|---|---|",
    ]
    names = {
        "local": "local DataLoader workers (num_workers=2, batch mode)",
        "remote": "datacache remote=RayPool(workers=2), 2 Ray worker nodes",
        "ray data": "Ray Data read_webdataset + map_batches + iter_torch_batches, same cluster",
    }
    for kind, row in rows.items():
        if "error" in row:
            lines.append(f"| {names[kind]} | failed: {row['error']} | | | |")
            continue
        rate, cpu = row["images"] / row["wall"], row["cpu"] / gigabytes
        local_rate, local_cpu = local["images"] / local["wall"], local["cpu"] / gigabytes
        lines.append(f"| {names[kind]} | {rate:,.0f} | {rate / local_rate:.2f}x | {cpu:.2f} | {cpu / local_cpu:.2f}x |")
    lines += ["", MARK]
    return "\n".join(lines)


def _write(results: Path, table: str) -> None:
    text = results.read_text() if results.exists() else ""
    if MARK in text:
        before, _, rest = text.partition(MARK)
        _, _, after = rest.partition(MARK)
        text = before + table + after
    else:
        text += "\n## Preprocessing on CPU nodes: JPEG decode on remote workers (`benchmarks/remote_decode.py`)\n\n"
        text += table + "\n"
    results.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--results", type=Path)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        spec = json.loads(args.job)
        result = job(spec["kind"], spec["origin"], spec["address"], spec["local_dir"], spec["epochs"])
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)
    result = measure(args.images, args.epochs)
    table = render(result)
    sys.stdout.write(table + "\n" + json.dumps(result) + "\n")
    if args.results:
        _write(args.results, table)


if __name__ == "__main__":
    main()
