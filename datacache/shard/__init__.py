"""``datacache shard``: pack a tree of small objects into tar shards, or re-chunk Parquet and Zarr.

Reading millions of small objects one request at a time is what starves
GPUs. `shard_dataset` lists the source once, plans the output (a pure
function of the listing and the options, see `plan_tar`), and packs each
planned unit by streaming: a tar shard is never held in memory, its member
data is fetched by bounded concurrent GETs and its bytes flow into the
output tier's atomic put (a multipart upload on S3). The output is what the
rest of datacache reads without scanning:

- WebDataset-compatible tar shards (``shard-000000.tar``), with fixed header
  fields so the same input always gives the same bytes;
- ``<shard>.idx.json`` beside each shard (`datacache.counting.tarindex`): every
  sample's fields and byte spans;
- ``datacache-manifest.json`` at the output root: each shard's size,
  checksum and sample count, which `datacache.manifest.take_manifest` uses
  as is.

A run writes its plan (``.datacache-shard-plan.json``) and, per finished
unit, a record under ``.datacache-shard-done/``. Rerun after an
interruption, it keeps every unit whose record matches the plan and whose
bytes still verify (size and checksum), and packs the rest: the result is
byte for byte that of an uninterrupted run. The units can be packed in this
process, or as tasks on a Dask or Ray cluster (``engine``).

How a source is planned and packed is its format's `Rechunker`
(`datacache.shard.rechunk`), named by the format (`SampleFormat.rechunker`):
tar shards for ``files``, re-chunked files for ``parquet``, chunks for
``zarr``; a format adds one without editing this package.

The package's modules point one way: `plan` (pure planning) <- `job` (the
values a worker receives) <- `rechunk` (the protocol, found by format name)
<- `tar` and `columnar` (the built-in rechunkers, independent of each other)
<- `ensure` (keep or pack one unit) <- `engines` (where units run) <- this
module (one run, end to end).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from datacache._progress import Progress
from datacache.checksum import checksum_of, new_hasher
from datacache.config import dataset_id_for
from datacache.errors import ConfigError, DatacacheError, ShardNotFoundError
from datacache.formats import detect_format_name, get_format
from datacache.manifest import MANIFEST_NAME, Manifest, Shard, ShardFormat, missing_local_path
from datacache.shard.engines import ENGINES, run_dask, run_local, run_ray
from datacache.shard.ensure import remove_stale_units
from datacache.shard.job import Endpoint, PackIO, ShardJob, ShardReport, UnitResult, check_places, put_bytes
from datacache.shard.plan import (
    DONE_PREFIX,
    PLAN_NAME,
    ShardOptions,
    ShardPlan,
    UnitSpec,
    digest_of,
    plan_tar,
)
from datacache.shard.rechunk import FALLBACK, Rechunker, rechunker_for, source_formats
from datacache.tiers import ObjectInfo, Tier, redact_url
from datacache.tiers.files import PARTIAL_NAME, remove_abandoned_partials

__all__ = [
    "ENGINES",
    "PLAN_NAME",
    "SOURCE_FORMATS",
    "Endpoint",
    "PackIO",
    "Rechunker",
    "ShardJob",
    "ShardOptions",
    "ShardPlan",
    "ShardReport",
    "UnitSpec",
    "detect_source_format",
    "digest_of",
    "list_source",
    "plan_source",
    "plan_tar",
    "put_bytes",
    "rechunker_for",
    "shard_dataset",
    "source_formats",
]

logger = logging.getLogger(__name__)

_OWN_NAMES = (MANIFEST_NAME, PLAN_NAME)


def _inside(child: str, parent: str) -> str | None:
    """The prefix of ``child`` relative to ``parent`` when ``child`` lies under it."""
    child, parent = child.rstrip("/"), parent.rstrip("/")
    if child.startswith(parent + "/"):
        return child[len(parent) + 1 :] + "/"
    return None


async def list_source(source: Tier, *, exclude_prefix: str | None = None) -> list[ObjectInfo]:
    """List the source once, leaving out datacache's own files and temporary writes.

    Raises `ShardNotFoundError` when nothing is there.
    """
    infos: list[ObjectInfo] = []
    async for info in source.list():
        name = info.key.rsplit("/", 1)[-1]
        if info.key in _OWN_NAMES or info.key.startswith(DONE_PREFIX) or PARTIAL_NAME.match(name):
            continue
        if exclude_prefix is not None and info.key.startswith(exclude_prefix):
            continue
        infos.append(info)
    if not infos:
        raise missing_local_path(source.url) or ShardNotFoundError(
            f"nothing to shard at {source.url} (missing bucket, prefix or directory?)"
        )
    return infos


def detect_source_format(infos: list[ObjectInfo]) -> str:
    """What ``datacache shard`` makes of a source: the one detector's format where it can re-chunk it
    (its `SampleFormat.rechunker`), else ``files`` (every object packed into tar shards)."""
    detected = detect_format_name(info.key for info in infos)
    return detected if get_format(detected).rechunker is not None else FALLBACK


def __getattr__(name: str) -> object:
    # The choices are the registered formats that name a rechunker, known once the formats are imported.
    if name == "SOURCE_FORMATS":
        return ("auto", *source_formats())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


async def plan_source(
    source: Endpoint, infos: list[ObjectInfo], options: ShardOptions, source_format: str = "auto"
) -> ShardPlan:
    """Plan the run for ``infos``, listed at ``source``, as ``source_format`` (or detected)."""
    choices = ("auto", *source_formats())
    if source_format not in choices:
        raise ConfigError(f"--format {source_format!r}: choose from {', '.join(choices)}")
    chosen = detect_source_format(infos) if source_format == "auto" else source_format
    shown = redact_url(source.url)
    plan = await rechunker_for(chosen).plan(source, infos, options, shown)
    if not plan.units:
        raise ShardNotFoundError(
            f"nothing to pack at {shown}: none of its {len(infos)} objects has a file extension "
            "(see --group-by)"
        )
    if plan.skipped:
        logger.warning(
            "skipping %d objects without a file extension (first: %s)",
            len(plan.skipped),
            plan.skipped[0],
        )
    return plan


async def _earlier_run(dest: Tier) -> tuple[set[str], bool, bool]:
    """What an earlier run left at ``dest``: its unit records, and whether a plan and a manifest are there."""
    recorded: set[str] = set()
    existing_plan = False
    existing_manifest = False
    async for info in dest.list():
        if info.key.startswith(DONE_PREFIX) and info.key.endswith(".json"):
            recorded.add(info.key[len(DONE_PREFIX) : -len(".json")])
        elif info.key == PLAN_NAME:
            existing_plan = True
        elif info.key == MANIFEST_NAME:
            existing_manifest = True
    return recorded, existing_plan, existing_manifest


async def _same_plan(dest: Tier, plan: ShardPlan) -> bool:
    """Whether the plan an earlier run wrote at ``dest`` is ``plan``."""
    try:
        previous = json.loads(await dest.get(PLAN_NAME)).get("digest")
    except (ValueError, AttributeError, ShardNotFoundError):
        previous = None
    return bool(previous == plan.digest)


async def _prepare_output(dest: Tier, plan: ShardPlan, root_files: Mapping[str, bytes]) -> set[str]:
    """Write the plan (and the rechunker's root files); return the units recorded by an earlier run."""
    recorded, existing_plan, existing_manifest = await _earlier_run(dest)
    same = existing_plan and await _same_plan(dest, plan)
    if same:
        logger.info(
            "resuming: %d of %d units have a record",
            len(recorded & {u.key for u in plan.units}),
            len(plan.units),
        )
    elif existing_plan:
        # Not a warning: the summary says how many units were packed again (often none: a unit whose
        # inputs did not change keeps its digest, and is kept once its bytes verify).
        logger.info(
            "the plan at %s changed (other inputs or options): units whose inputs changed are packed again",
            dest.url,
        )
    if existing_manifest and not same:
        # A manifest of another plan, or written by other means: the one written at the end replaces it.
        await dest.delete(MANIFEST_NAME)
    if dest.has_local_paths:
        # Temporary files of a run that was killed; a live writer's file is locked and kept.
        root = _local_root(dest.url)
        removed = await asyncio.to_thread(remove_abandoned_partials, root, min_age=0.0)
        if removed:
            logger.info("removed %d temporary files left by an interrupted run", len(removed))
    await put_bytes(dest, PLAN_NAME, plan.to_json())
    for key, data in root_files.items():
        await put_bytes(dest, key, data)
    return recorded


def _local_root(url: str) -> Path:
    import fsspec.core

    _, root = fsspec.core.url_to_fs(url)
    return Path(str(root))


def _build_manifest(
    dest: Endpoint, plan: ShardPlan, root_files: Mapping[str, bytes], results: dict[str, UnitResult]
) -> Manifest:
    shards: list[Shard] = []
    for key, data in root_files.items():
        hasher = new_hasher()
        hasher.update(data)
        shards.append(Shard(key, len(data), checksum=checksum_of(hasher), samples=0))
    for unit in plan.units:
        result = results[unit.key]
        shards.append(
            Shard(unit.key, result.size, checksum=result.checksum, samples=result.samples)
        )
    extra: dict[str, Any] = {
        "source": plan.source,
        "options": plan.options.identity(),
        "plan": plan.digest,
        "objects": plan.objects,
        "samples": plan.samples,
    }
    if plan.classes:
        extra["classes"] = list(plan.classes)
    # created is fixed so that the output is a pure function of the inputs (reruns are identical).
    return Manifest(
        dataset=dataset_id_for(dest.url),
        url=dest.url,
        format=ShardFormat(plan.kind),
        shards=tuple(shards),
        created=0.0,
        extra=extra,
    )


async def _list_and_plan(
    source: Endpoint, dest: Endpoint, options: ShardOptions, source_format: str
) -> tuple[ShardPlan, Mapping[str, bytes], str]:
    """List ``source`` once and plan the run: the plan, its root files and the format it reads as."""
    source_tier = source.open(writable=False)
    try:
        infos = await list_source(source_tier, exclude_prefix=_inside(dest.url, source.url))
    finally:
        await source_tier.close()
    chosen = detect_source_format(infos) if source_format == "auto" else source_format
    plan = await plan_source(source, infos, options, chosen)
    logger.info(
        "plan %s: %d objects (%d bytes) -> %d units, %d samples",
        plan.digest[:12],
        plan.objects,
        plan.input_bytes,
        len(plan.units),
        plan.samples,
    )
    return plan, rechunker_for(chosen).root_files(plan), chosen


class _Results:
    """The finished units of a run, and what the progress display is told as they finish."""

    def __init__(self, display: Progress | None, *, live: bool) -> None:
        self.display = display
        self.live = live  # units packed in this process report each object as it is read
        self.results: dict[str, UnitResult] = {}

    def on_object(self, objects: int, nbytes: int) -> None:
        if self.display is not None:
            self.display.moved(nbytes)
            self.display.item_done(nbytes, transferred=nbytes, items=objects)

    def on_result(self, result: UnitResult) -> None:
        self.results[result.key] = result
        display = self.display
        if display is None:
            return
        if not result.written:
            display.item_done(result.input_bytes, transferred=0, items=result.objects)
        elif not self.live:
            display.moved(result.input_bytes)
            display.item_done(
                result.input_bytes, transferred=result.input_bytes, items=result.objects
            )

    async def ticker(self) -> None:
        while self.display is not None:
            await asyncio.sleep(1.0)
            self.display.tick()


async def _run_units(
    units: list[tuple[UnitSpec, bool]], job: ShardJob, results: _Results, *, engine: str, scheduler: str | None
) -> None:
    """Pack ``units`` on ``engine``, ticking the progress display meanwhile."""
    ticking = asyncio.create_task(results.ticker())
    try:
        if engine == "local":
            await run_local(units, job, on_result=results.on_result, on_object=results.on_object)
        else:
            loop = asyncio.get_running_loop()

            def threadsafe(result: UnitResult) -> None:
                loop.call_soon_threadsafe(results.on_result, result)

            runner = run_dask if engine == "dask" else run_ray
            await asyncio.to_thread(runner, units, job, scheduler=scheduler, on_result=threadsafe)
            await asyncio.sleep(0)  # let the last callbacks run
    finally:
        ticking.cancel()
        await asyncio.gather(ticking, return_exceptions=True)
        if results.display is not None:
            results.display.close()


async def _write_manifest(
    dest: Endpoint, plan: ShardPlan, root_files: Mapping[str, bytes], results: dict[str, UnitResult]
) -> None:
    missing = [unit.key for unit in plan.units if unit.key not in results]
    if missing:
        raise DatacacheError(
            f"{len(missing)} of {len(plan.units)} shards were not packed (first: {missing[0]})"
        )
    manifest = _build_manifest(dest, plan, root_files, results)
    dest_tier = dest.open(writable=True)
    try:
        await put_bytes(dest_tier, MANIFEST_NAME, json.dumps(manifest.to_json(), indent=1).encode())
    finally:
        await dest_tier.close()


def _report(
    source: Endpoint, dest: Endpoint, plan: ShardPlan, ordered: tuple[UnitResult, ...], seconds: float, removed: int
) -> ShardReport:
    """What the run did, logged in one line."""
    report = ShardReport(
        source=redact_url(source.url),
        dest=redact_url(dest.url),
        kind=plan.kind,
        units=len(plan.units),
        written=sum(1 for r in ordered if r.written),
        kept=sum(1 for r in ordered if not r.written),
        objects=plan.objects,
        input_bytes=plan.input_bytes,
        output_bytes=sum(r.size for r in ordered),
        samples=plan.samples,
        skipped=len(plan.skipped),
        seconds=seconds,
        plan_digest=plan.digest,
        results=ordered,
        removed=removed,
    )
    logger.info(
        "sharded %s -> %s: %d units (%d written, %d kept; %d rewritten, %d removed) in %.1fs",
        report.source,
        report.dest,
        report.units,
        report.written,
        report.kept,
        report.rewritten,
        report.removed,
        report.seconds,
    )
    return report


async def shard_dataset(
    source: Endpoint,
    dest: Endpoint,
    options: ShardOptions,
    *,
    engine: str = "local",
    scheduler: str | None = None,
    source_format: str = "auto",
    progress: Callable[[ShardPlan], Progress] | None = None,
) -> ShardReport:
    """Shard ``source`` into ``dest``; return what was done.

    Parameters
    ----------
    source, dest
        Any fsspec URLs with their storage options (``s3://``, a directory, ...).
    options
        Sizes, grouping, labels and tuning (`ShardOptions`).
    engine
        ``"local"`` (this process), ``"dask"`` or ``"ray"``.
    scheduler
        The cluster to use with ``dask`` (``tcp://host:8786``) or ``ray``
        (``ray://host:10001``); a local cluster when omitted.
    source_format
        ``auto``, ``files`` (tar shards), ``parquet`` or ``zarr``.
    progress
        Builds the progress display once the plan is known.

    Raises
    ------
    ShardNotFoundError
        Nothing to shard at ``source``.
    InvalidKeyError
        A source key with ``..`` (or other unsafe) segments.
    ConfigError
        Bad options, or a pattern that does not fit the tree.
    """
    if engine not in ENGINES:
        raise ConfigError(f"--engine {engine!r}: choose from {', '.join(ENGINES)}")
    check_places(source, dest)
    started = time.monotonic()
    plan, root_files, chosen = await _list_and_plan(source, dest, options, source_format)
    dest_tier = dest.open(writable=True)
    try:
        recorded = await _prepare_output(dest_tier, plan, root_files)
    finally:
        await dest_tier.close()
    results = _Results(progress(plan) if progress is not None else None, live=engine == "local")
    units = [(unit, unit.key in recorded) for unit in plan.units]
    job = ShardJob(source=source, dest=dest, options=options, source_format=chosen)
    await _run_units(units, job, results, engine=engine, scheduler=scheduler)
    await _write_manifest(dest, plan, root_files, results.results)
    removed = await remove_stale_units(dest, recorded - {unit.key for unit in plan.units})  # after: none listed
    ordered = tuple(results.results[unit.key] for unit in plan.units)
    return _report(source, dest, plan, ordered, time.monotonic() - started, removed)
