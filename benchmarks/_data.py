"""Write the synthetic dataset in each tool's own format, with that tool's own writer, and upload it.

Layout in the bucket:

- ``wds/shard-NNNNN.tar``: WebDataset tar shards (``webdataset.ShardWriter``),
  plus ``wds/datacache-manifest.json`` (sizes, checksums and sample counts) so
  datacache reads them without a scanning pass: datacache's own format is
  WebDataset tars plus that manifest;
- ``mds/``: MosaicML Streaming MDS shards (``streaming.MDSWriter``);
- ``litdata/``: LitData chunks (``litdata.optimize``);
- ``raw/NNNNNN.bin``: the first samples, one object each (s3torchconnector);
- the small-files variant is uploaded by ``benchmarks/small_files.py``.

Local copies live under ``benchmarks/work/data/<mode>`` and are reused while
the sizes do not change; the S3 server is new every run, so uploads are not.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import shutil
import tarfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._common import BUCKET, LABEL, PAYLOAD, WORK, Sizes, boto_client, sample

DATACACHE_MANIFEST = "datacache-manifest.json"


def _log(message: str) -> None:
    print(f"[data] {message}", flush=True)


def data_dir(sizes: Sizes) -> Path:
    return WORK / "data" / f"n{sizes.samples}-s{sizes.shard_bytes}-seed{sizes.seed}"


def _stamp_ok(path: Path, sizes: Sizes) -> bool:
    stamp = path / ".complete"
    return stamp.is_file() and json.loads(stamp.read_text()) == asdict(sizes)


def write_webdataset(sizes: Sizes, out: Path) -> None:
    import webdataset as wds

    out.mkdir(parents=True)
    with wds.ShardWriter(str(out / "shard-%05d.tar"), maxsize=sizes.shard_bytes, maxcount=10**9, verbose=0) as sink:
        for index in range(sizes.samples):
            payload, label = sample(sizes.seed, index, sizes.min_bytes, sizes.max_bytes)
            sink.write({"__key__": f"{index:08d}", PAYLOAD: payload, LABEL: label})


def write_datacache_manifest(folder: Path) -> None:
    """``datacache-manifest.json`` for WebDataset tars: size, xxh3 checksum and sample count per shard."""
    from datacache.checksum import checksum_of, new_hasher
    from datacache.manifest import Manifest, Shard, ShardFormat

    shards = []
    for path in sorted(folder.glob("*.tar")):
        keys = set()
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile():
                    keys.add(member.name.split(".", 1)[0])
        hasher = new_hasher()
        with path.open("rb") as handle:
            while chunk := handle.read(8 << 20):
                hasher.update(chunk)
        shards.append(Shard(path.name, path.stat().st_size, None, checksum_of(hasher), len(keys)))
    manifest = Manifest(dataset="bench-wds", url=str(folder), format=ShardFormat.TAR, shards=tuple(shards))
    (folder / DATACACHE_MANIFEST).write_text(json.dumps(manifest.to_json(), indent=1))


def write_mds(sizes: Sizes, out: Path) -> None:
    from benchmarks._loaders import import_streaming

    streaming = import_streaming()
    columns = {PAYLOAD: "bytes", LABEL: "int"}
    with streaming.MDSWriter(out=str(out), columns=columns, size_limit=sizes.shard_bytes, progress_bar=False) as sink:
        for index in range(sizes.samples):
            payload, label = sample(sizes.seed, index, sizes.min_bytes, sizes.max_bytes)
            sink.write({PAYLOAD: payload, LABEL: label})


def litdata_sample(index: int, seed: int, low: int, high: int) -> dict[str, Any]:
    payload, label = sample(seed, index, low, high)
    return {PAYLOAD: payload, LABEL: label}


def write_litdata(sizes: Sizes, out: Path) -> None:
    import litdata

    fn = functools.partial(litdata_sample, seed=sizes.seed, low=sizes.min_bytes, high=sizes.max_bytes)
    litdata.optimize(
        fn=fn,
        inputs=list(range(sizes.samples)),
        output_dir=str(out),
        chunk_bytes=sizes.shard_bytes,
        num_workers=1,
        keep_data_ordered=True,
        verbose=False,
        start_method="fork",  # spawn would re-import the caller's __main__
    )
    chunks = list(out.glob("*.bin"))
    if not (out / "index.json").is_file() or not chunks:
        raise RuntimeError(f"litdata.optimize wrote no chunks to {out}")


def prepare_local(sizes: Sizes, with_anchors: bool) -> Path:
    """Write every format's files locally (once per sizes); return the folder."""
    root = data_dir(sizes)
    writers: list[tuple[str, Callable[[Sizes, Path], None]]] = [("wds", write_webdataset)]
    if with_anchors:
        writers += [("mds", write_mds), ("litdata", write_litdata)]
    for name, writer in writers:
        target = root / name
        if _stamp_ok(target, sizes):
            continue
        shutil.rmtree(target, ignore_errors=True)
        started = time.perf_counter()
        writer(sizes, target)
        if name == "wds":
            write_datacache_manifest(target)
        (target / ".complete").write_text(json.dumps(asdict(sizes)))
        _log(f"wrote {name} in {time.perf_counter() - started:.1f}s")
    return root


def _put_many(endpoint: str, items: Iterable[tuple[str, Callable[[], bytes]]], threads: int = 8) -> tuple[int, int]:
    client = boto_client(endpoint, max_pool=threads + 2)

    def put(item: tuple[str, Callable[[], bytes]]) -> int:
        key, body = item
        data = body()
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
        return len(data)

    count = total = 0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for size in pool.map(put, items):
            count += 1
            total += size
    return count, total


def upload_tree(endpoint: str, folder: Path, prefix: str) -> tuple[int, int]:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".complete"]
    return _put_many(endpoint, ((f"{prefix}/{p.relative_to(folder)}", p.read_bytes) for p in files), threads=4)


def upload_all(endpoint: str, sizes: Sizes, root: Path, with_anchors: bool) -> dict[str, Any]:
    """Create the bucket and upload every layout; return counts and seconds per layout."""
    client = boto_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    done: dict[str, Any] = {}
    layouts = ["wds", *(["mds", "litdata"] if with_anchors else [])]
    for name in layouts:
        started = time.perf_counter()
        count, total = upload_tree(endpoint, root / name, name)
        done[name] = {"objects": count, "bytes": total, "seconds": time.perf_counter() - started}
        _log(f"uploaded {name}: {count} objects, {total / 1e6:.0f} MB in {done[name]['seconds']:.1f}s")

    def raw_body(index: int) -> bytes:
        return sample(sizes.seed, index, sizes.min_bytes, sizes.max_bytes)[0]

    if with_anchors:
        started = time.perf_counter()
        count, total = _put_many(
            endpoint, ((f"raw/{i:06d}.bin", functools.partial(raw_body, i)) for i in range(sizes.raw_samples))
        )
        done["raw"] = {"objects": count, "bytes": total, "seconds": time.perf_counter() - started}
        _log(f"uploaded raw: {count} objects, {total / 1e6:.0f} MB in {done['raw']['seconds']:.1f}s")

    return done


def wds_shards(root: Path) -> list[Path]:
    return sorted((root / "wds").glob("*.tar"))


def payload_bytes(sizes: Sizes, count: int | None = None) -> int:
    """Bytes of payload in the first ``count`` samples (all by default)."""
    from benchmarks._common import sample_size

    n = sizes.samples if count is None else count
    return sum(sample_size(sizes.seed, i, sizes.min_bytes, sizes.max_bytes) for i in range(n))
