"""Where the units of a ``datacache shard`` run are packed: this process, Dask, or Ray.

Every engine runs the same function on each unit (`run_unit_sync` on a
cluster, `ensure_unit` in-process) and reports each finished unit through a
callback, so planning, resuming and the manifest do not depend on the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from datacache.dask_ray import map_dask, map_ray
from datacache.shard.ensure import ensure_unit, run_unit_sync
from datacache.shard.job import ObjectCallback, ShardJob, UnitResult
from datacache.shard.plan import UnitSpec

__all__ = ["ENGINES", "run_dask", "run_local", "run_ray"]

logger = logging.getLogger("datacache.shard")

ENGINES = ("local", "dask", "ray")

ResultCallback = Callable[[UnitResult], None]


async def run_local(
    units: Sequence[tuple[UnitSpec, bool]],
    job: ShardJob,
    *,
    on_result: ResultCallback,
    on_object: ObjectCallback,
) -> None:
    """Pack ``units`` in this process: ``workers`` at once, each with its own bounded GETs."""
    source = job.source.open(writable=False)
    dest = job.dest.open(writable=True)
    queue: asyncio.Queue[tuple[UnitSpec, bool]] = asyncio.Queue()
    for item in units:
        queue.put_nowait(item)

    async def worker() -> None:
        limiter = asyncio.Semaphore(job.options.concurrency)
        while True:
            try:
                spec, has_record = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            result = await ensure_unit(
                spec, job, source, dest, has_record=has_record, limiter=limiter, on_object=on_object
            )
            on_result(result)

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(min(job.options.workers, max(1, len(units)))):
                group.create_task(worker())
    except BaseExceptionGroup as grouped:
        # One line for the CLI: the first failure, whatever the others were.
        first: BaseException = grouped
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    finally:
        await source.close()
        await dest.close()


def run_dask(
    units: Sequence[tuple[UnitSpec, bool]],
    job: ShardJob,
    *,
    scheduler: str | None,
    on_result: ResultCallback,
) -> None:
    """Pack ``units`` as Dask tasks, one per unit; blocking (call it from a thread).

    With ``scheduler`` (``tcp://host:8786``) the tasks go to that cluster,
    whose workers need datacache installed and access to both URLs; without
    it a `LocalCluster` of threads in this process (``workers`` of them) runs them.
    """
    calls = [(spec, has_record, job) for spec, has_record in units]
    names = [f"datacache-shard-{spec.digest}" for spec, _ in units]
    map_dask(
        run_unit_sync, calls, names=names, scheduler=scheduler, workers=job.options.workers, on_result=on_result
    )


def run_ray(
    units: Sequence[tuple[UnitSpec, bool]],
    job: ShardJob,
    *,
    scheduler: str | None,
    on_result: ResultCallback,
) -> None:
    """Pack ``units`` as Ray tasks, one per unit; blocking (call it from a thread).

    With ``scheduler`` (``ray://host:10001`` or ``auto``) the tasks go to that
    cluster; without it a local Ray instance with ``workers`` CPUs is started
    for this run and shut down after it.
    """
    calls = [(spec, has_record, job) for spec, has_record in units]
    map_ray(run_unit_sync, calls, scheduler=scheduler, workers=job.options.workers, on_result=on_result)
