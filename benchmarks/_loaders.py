"""Each loader, set up the way its documentation recommends, behind one small interface.

Every loader here reads the same samples (see `benchmarks._data`) through a
``torch.utils.data.DataLoader`` (or the tool's own subclass of it) with the
same batch size and number of workers, shuffles (each tool's own way), and
yields batches that `benchmarks._job.touch` copies byte by byte.

Workarounds the anchors need here, each applied on the benchmark's side only:

- MosaicML Streaming imports ``streaming.vision``, which imports torchvision,
  and PyPI's torchvision does not import beside the CPU torch 2.13.0: a stub
  module stands in for ``streaming.vision`` (nothing here uses it).
- LitData downloads chunks through obstore, whose client refuses a plain
  http endpoint unless ``allow_http`` is in its client options; LitData
  hard-codes those options, so the benchmark adds the flag to them. LitData
  yields ``memoryview`` fields that a DataLoader worker cannot pickle: a
  ``transform`` turns them into ``bytes``.
- webdataset has no ``s3://`` handler: it reads presigned http URLs with
  curl (its documented http route) and caches shards in its ``cache_dir``.
- s3torchconnector 1.5 has no cache and reads one object (one GET) per
  sample: it gets its own, smaller, one-object-per-sample layout.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from benchmarks._common import BATCH_SIZE, BUCKET, REGION, boto_client

SHUFFLE_SEED = 17
WDS_SHUFFLE_BUFFER = 1000


@dataclass
class Context:
    """What a job knows: where the data is, where its cache goes, the DataLoader settings."""

    endpoint: str
    cache_dir: Path
    num_workers: int
    expected: int
    batch_size: int = BATCH_SIZE
    dataset: str = f"s3://{BUCKET}/wds/"
    rank: int = 0
    world: int = 1


@dataclass
class Loader:
    """A loader ready to run epochs: ``epoch(n)`` returns the iterable of batches of epoch ``n``."""

    epoch: Callable[[int], Iterable[Any]]
    expected: int
    has_cache: bool = True
    close: Callable[[], None] = lambda: None


def import_streaming() -> Any:
    """Import MosaicML Streaming without ``streaming.vision`` (it needs torchvision, which cannot load here)."""
    if "streaming.vision" not in sys.modules:
        stub = types.ModuleType("streaming.vision")
        stub.__doc__ = "stand-in: torchvision does not import beside this CPU torch"
        sys.modules["streaming.vision"] = stub
    import streaming

    return streaming


# -- datacache ---------------------------------------------------------------------------------


def datacache_loader(ctx: Context, *, drop_in: bool = False, ours: bool = False) -> Loader:
    """Batch mode (the dataset batches, fields as `PackedBytes`), or with ``drop_in`` the form users
    start with: per-sample dicts that the DataLoader batches with its ``default_collate``; with
    ``ours`` as well, the same script with ``from datacache.loaders import DataLoader``."""
    from datacache.loaders import CachedIterableDataset
    from datacache.loaders import DataLoader as Ours
    from torch.utils.data import DataLoader as Torch

    from datacache.config import load_settings

    settings = load_settings(overrides={"local_dir": str(ctx.cache_dir)})
    batch_size = None if drop_in else ctx.batch_size
    dataset = CachedIterableDataset(
        ctx.dataset, batch_size=batch_size, config=settings, shuffle=True, seed=SHUFFLE_SEED
    )
    DataLoader = Ours if ours else Torch
    loader = DataLoader(dataset, batch_size=ctx.batch_size if drop_in else None, num_workers=ctx.num_workers)
    per_rank = -(-ctx.expected // ctx.world)

    def epoch(n: int) -> Iterable[Any]:
        dataset.set_epoch(n)
        return loader

    return Loader(epoch, per_rank, close=dataset.close)


# -- WebDataset -------------------------------------------------------------------------------


def _presigned_urls(endpoint: str, prefix: str) -> list[str]:
    client = boto_client(endpoint)
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(".tar")]
    return [
        client.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=24 * 3600)
        for k in sorted(keys)
    ]


def webdataset_loader(ctx: Context) -> Loader:
    import webdataset as wds

    urls = _presigned_urls(ctx.endpoint, "wds/")
    dataset = (
        wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            cache_dir=str(ctx.cache_dir),
            nodesplitter=wds.split_by_node,
            seed=SHUFFLE_SEED,
        )
        .shuffle(WDS_SHUFFLE_BUFFER)
        .batched(ctx.batch_size, partial=True)
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=ctx.num_workers)
    return Loader(lambda n: loader, ctx.expected // ctx.world if ctx.world > 1 else ctx.expected)


# -- fsspec's file cache -------------------------------------------------------------------------


def _fsspec_open(src: Iterable[dict[str, Any]], options: dict[str, Any]) -> Iterator[dict[str, Any]]:
    import fsspec

    for item in src:
        url = item["url"]
        with fsspec.open(url, "rb", **options) as stream:
            yield {"url": url, "stream": stream}


def fsspec_loader(ctx: Context) -> Loader:
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    client = boto_client(ctx.endpoint)
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix="wds/")
    names = sorted(o["Key"] for o in listing.get("Contents", []) if o["Key"].endswith(".tar"))
    urls = [f"filecache::s3://{BUCKET}/{key}" for key in names]
    options = {
        "s3": {"endpoint_url": ctx.endpoint, "key": "testing", "secret": "testing"},
        "filecache": {"cache_storage": str(ctx.cache_dir)},
    }
    dataset = wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_node,
        wds.shuffle(len(urls), seed=SHUFFLE_SEED),
        wds.split_by_worker,
        wds.pipelinefilter(_fsspec_open)(options),
        wds.pipelinefilter(tar_file_expander)(),
        wds.pipelinefilter(group_by_keys)(),
        wds.shuffle(WDS_SHUFFLE_BUFFER),
        wds.batched(ctx.batch_size, partial=True),
    )
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=ctx.num_workers)
    return Loader(lambda n: loader, ctx.expected)


# -- MosaicML Streaming ----------------------------------------------------------------------------


def mosaic_loader(ctx: Context) -> Loader:
    streaming = import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(
        remote=f"s3://{BUCKET}/mds",
        local=str(ctx.cache_dir),
        batch_size=ctx.batch_size,
        shuffle=True,
        shuffle_seed=SHUFFLE_SEED,
    )
    loader = streaming.StreamingDataLoader(dataset, batch_size=ctx.batch_size, num_workers=ctx.num_workers)
    per_rank = -(-ctx.expected // ctx.world)
    return Loader(lambda n: loader, per_rank)


# -- LitData -------------------------------------------------------------------------------------------


def to_bytes(sample: Any) -> Any:
    """LitData's ``transform``: memoryviews cannot cross a worker's pipe; bytes can."""
    if isinstance(sample, dict):
        return {k: (bytes(v) if isinstance(v, memoryview) else v) for k, v in sample.items()}
    return sample


def litdata_loader(ctx: Context) -> Loader:
    import litdata
    import litdata.streaming.downloader as downloader

    # obstore refuses http endpoints unless told; LitData hard-codes its client options.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": "true"}  # type: ignore[attr-defined]
    dataset = litdata.StreamingDataset(
        f"s3://{BUCKET}/litdata",
        cache_dir=str(ctx.cache_dir),
        shuffle=True,
        seed=SHUFFLE_SEED,
        storage_options={"endpoint_url": ctx.endpoint},
        transform=to_bytes,
    )
    loader = litdata.StreamingDataLoader(dataset, batch_size=ctx.batch_size, num_workers=ctx.num_workers)
    return Loader(lambda n: loader, ctx.expected // ctx.world if ctx.world > 1 else ctx.expected)


# -- s3torchconnector -----------------------------------------------------------------------------------


def read_object(reader: Any) -> bytes:
    data: bytes = reader.read()
    return data


def s3torch_loader(ctx: Context) -> Loader:
    from s3torchconnector import S3ClientConfig, S3MapDataset
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = S3MapDataset.from_prefix(
        f"s3://{BUCKET}/raw/",
        region=REGION,
        endpoint=ctx.endpoint,
        transform=read_object,
        s3client_config=S3ClientConfig(force_path_style=True),
    )
    sampler = DistributedSampler(dataset, num_replicas=ctx.world, rank=ctx.rank, shuffle=True, seed=SHUFFLE_SEED)
    loader = DataLoader(dataset, batch_size=ctx.batch_size, sampler=sampler, num_workers=ctx.num_workers)

    def epoch(n: int) -> Iterable[Any]:
        sampler.set_epoch(n)
        return loader

    return Loader(epoch, len(sampler), has_cache=False)


# -- the ceiling: a DataLoader that does no I/O ------------------------------------------------------


class PreparedBytes(IterableDataset[list[bytes]]):
    """Yields batches of ready ``bytes`` objects: no reading, no decoding, only the trip through the workers.

    Each worker holds ``batch_size`` distinct objects (sizes drawn like the
    dataset's) and yields them as a new list per batch, so the DataLoader
    pickles every byte through the worker's pipe exactly as it would for a
    loader that had read them.
    """

    def __init__(self, sizes: list[int], batches: int) -> None:
        self.sizes = sizes
        self.batches = batches

    def __iter__(self) -> Iterator[list[bytes]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        pool = [bytes([worker + 1]) * size for size in self.sizes]
        for index in range(worker, self.batches, workers):
            del index
            yield list(pool)


def ceiling_loader(ctx: Context) -> Loader:
    from torch.utils.data import DataLoader

    from benchmarks._common import sample_size

    sizes = [sample_size(7, i, 50_000, 150_000) for i in range(ctx.batch_size)]
    batches = ctx.expected // ctx.batch_size
    loader = DataLoader(PreparedBytes(sizes, batches), batch_size=None, num_workers=ctx.num_workers)
    return Loader(lambda n: loader, batches * ctx.batch_size, has_cache=True)


def datacache_dropin_loader(ctx: Context) -> Loader:
    return datacache_loader(ctx, drop_in=True)


def datacache_dataloader(ctx: Context) -> Loader:
    return datacache_loader(ctx, drop_in=True, ours=True)


FACTORIES: dict[str, Callable[[Context], Loader]] = {
    "dataloader-ceiling": ceiling_loader,
    "datacache": datacache_loader,
    "datacache-dropin": datacache_dropin_loader,
    "datacache-dataloader": datacache_dataloader,
    "webdataset": webdataset_loader,
    "fsspec-filecache": fsspec_loader,
    "mosaicml-streaming": mosaic_loader,
    "litdata": litdata_loader,
    "s3torchconnector": s3torch_loader,
}

ANCHOR_MODULES = {
    "webdataset": "webdataset",
    "fsspec-filecache": "webdataset",
    "mosaicml-streaming": "streaming",
    "litdata": "litdata",
    "s3torchconnector": "s3torchconnector",
}


def available(name: str) -> bool:
    """Whether this interpreter can run loader ``name``."""
    module = ANCHOR_MODULES.get(name)
    if module is None:
        return True
    import importlib.util

    return importlib.util.find_spec(module) is not None
