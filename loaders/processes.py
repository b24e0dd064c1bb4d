"""What each process that iterates a dataset opens for itself, and how it leaves.

A `CachedIterableDataset` holds configuration only (STYLE 6). The main process and every
DataLoader worker, forked or spawned, open their own loop, shard access, runtime and planner
here, on first use, and register here what closes them when the process exits.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os

from datacache.loaders.epochs.dataset import DatasetPlanner, open_dataset
from datacache.loaders.epochs.mix import MixPlanner
from datacache.loaders.plans.interface import Planner
from datacache.loaders.plans.mixsources import open_handle, open_mix
from datacache.loaders.runtime import Runtime, rank_and_world
from datacache.loaders.sources import SourceSpec
from torch.utils.data import get_worker_info

from datacache._sync import LoopThread, before_thread_pools_stop
from datacache.access import ShardAccess, open_access
from datacache.config import Settings, load_settings

__all__ = ["keep_until_exit", "open_runtime", "rank_and_world"]


def open_runtime(
    config: Settings | None,
    sources: tuple[SourceSpec, ...],
    *,
    mixed: bool,
    epoch_size: int | None,
    replacement: bool,
    shuffle_buffer: int | None,
) -> tuple[Runtime, Planner]:
    """This process's runtime over ``sources`` and the planner of its epochs (a mix's when ``mixed``)."""
    settings = config if config is not None else load_settings()
    loop = LoopThread(name="datacache-loader")
    in_worker = get_worker_info() is not None
    access: ShardAccess | None = None
    try:
        # A worker's notice of a daemon outage is its training process's: said once, not every epoch.
        owner = os.getppid() if in_worker else None
        access = loop.run(open_access(settings, reconcile=not in_worker, notice_owner=owner))
        if mixed:
            runtime = open_mix(
                loop,
                access,
                settings,
                sources,
                epoch_size=epoch_size,
                replacement=replacement,
                shuffle_buffer=shuffle_buffer,
            )
            return runtime, MixPlanner(runtime)
        handle = loop.run(open_handle(access, sources[0]))
        runtime = open_dataset(loop, access, settings, handle, shuffle_buffer=shuffle_buffer)
        return runtime, DatasetPlanner(runtime, shuffle_buffer)
    except BaseException:
        if access is not None:
            # Stop its transfers cleanly (no temporary file left open) and close its sessions.
            with contextlib.suppress(Exception):
                loop.run(access.close(), timeout=30)
        loop.close()
        raise


def keep_until_exit(runtime: Runtime) -> None:
    """Close ``runtime`` when this process exits, and end a DataLoader worker whose parent is gone."""
    # Runs at exit in the main process and in DataLoader workers alike (they
    # leave through multiprocessing, which skips plain atexit handlers).
    multiprocessing.util.Finalize(runtime, runtime.close, exitpriority=100)
    if get_worker_info() is not None:
        # Before anything that could wait on the dead parent (that close, and multiprocessing
        # joining the worker's queue thread, -5); what it leaves, reconcile repairs.
        multiprocessing.util.Finalize(None, _leave_if_orphaned, args=(os.getppid(),), exitpriority=101)
    # In the main process, atexit handlers run after the thread pools stopped taking work:
    # the copies still being made durable (fsync, rename) could then only be cancelled, and
    # read from the origin again next time. The interpreter's hook that runs before the pools
    # stop lets `close` finish them (bounded, `JobQueue.close`); `close` runs once either way.
    before_thread_pools_stop(runtime.close)


def _leave_if_orphaned(parent: int) -> None:
    """End a DataLoader worker whose training process is gone, now.

    torch's worker leaves its loop when its parent dies, but then multiprocessing waits,
    at exit, for its queue's thread to finish sending a batch into a pipe nobody reads:
    with batches larger than the pipe holds, it waited forever (holding the parent's
    stdout and its leases; a killed training run left two such workers each time).
    """
    if os.getppid() != parent:
        os._exit(0)
