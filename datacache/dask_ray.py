"""Running one function over many inputs on Dask or Ray: what `datacache shard` and `datacache index` share.

A task is a picklable top-level function and its arguments; each result is
handed to ``on_result`` as it finishes, in completion order. Blocking: call
these from a thread. Without a scheduler address a local cluster is started
for the run (Dask: threads in this process; Ray: a local instance) and shut
down after it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from datacache.errors import ConfigError

__all__ = ["map_dask", "map_ray"]


def map_dask(
    function: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    *,
    names: Sequence[str],
    scheduler: str | None,
    workers: int,
    on_result: Callable[[Any], None],
) -> None:
    """``function(*call)`` for every call as Dask tasks named ``names`` (their keys on the cluster)."""
    try:
        distributed: Any = importlib.import_module("dask.distributed")
    except ImportError:
        raise ConfigError("--engine dask needs dask.distributed: pip install 'datacache[dask]'") from None
    cluster: Any = None
    if scheduler:
        client = distributed.Client(scheduler)
    else:
        # No statistical profiler on the local cluster: nobody sees its dashboard, it samples every
        # thread's frame each 10 ms, and on CPython 3.11 sys._current_frames holding the thread-list
        # lock through a Python gc callback deadlocked a packing thread starting its pool (a hung suite).
        # Its HTTP server (metrics) on a free port: the default 8787 taken by another run made this one fail.
        with importlib.import_module("dask").config.set({"distributed.worker.profile.enabled": False}):
            cluster = distributed.LocalCluster(
                processes=False, n_workers=1, threads_per_worker=workers, dashboard_address=":0"
            )
        client = distributed.Client(cluster)
    try:
        futures = [client.submit(function, *call, key=name, pure=False) for call, name in zip(calls, names)]
        for future in distributed.as_completed(futures):
            on_result(future.result())
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def map_ray(
    function: Callable[..., Any],
    calls: Sequence[tuple[Any, ...]],
    *,
    scheduler: str | None,
    workers: int,
    on_result: Callable[[Any], None],
) -> None:
    """``function(*call)`` for every call as Ray tasks (``scheduler``: ``ray://host:10001`` or ``auto``)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--engine ray needs ray: pip install 'datacache[ray]'") from None
    started = False
    if not ray.is_initialized():
        if scheduler:
            ray.init(address=scheduler, log_to_driver=False)
        else:
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        started = True
    try:
        task = ray.remote(function)
        pending = [task.remote(*call) for call in calls]
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                on_result(ray.get(ref))
    finally:
        if started:
            ray.shutdown()
