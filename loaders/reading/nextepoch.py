"""The next epoch's shards, staged one after another in the order a reader will read them."""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from datacache.loaders.runtime import Runtime

from datacache.errors import DatacacheError
from datacache.staging import PRIORITY_PREFETCH

__all__ = ["NextEpochStaging"]

logger = logging.getLogger(__name__)


class NextEpochStaging:
    """Stages the next epoch's keys one after another, the soonest first, in one task per reader.

    Started together, a later one could take the room the first needs while it is still
    being written (not evictable), and the first would find none. A key found local is
    not asked for again (each ask is a catalog write); one declined for lack of room is,
    when `stage` is called again as room frees.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()  # never a lock whose holder waits on the runtime's loop
        self._keys: list[str] = []
        self._task: concurrent.futures.Future[None] | None = None
        self._local: set[str] = set()

    def stage(self, keys: list[str]) -> None:
        """Stage ``keys`` in order: the task running takes the newest list when done with its own."""
        with self._lock:
            keys = [key for key in keys if key not in self._local]
            if not keys:
                return
            self._keys = keys
            if self._task is None or self._task.done():
                self._task = self._runtime.loop.submit(self._run())

    async def _run(self) -> None:
        access, handle = self._runtime.access, self._runtime.handle
        while True:
            with self._lock:
                keys, self._keys = self._keys, []
            if not keys:
                return
            for key in keys:
                with self._lock:
                    if key in self._local:  # in an older list too, and found local there
                        continue
                try:
                    location = await access.ensure(handle, key, priority=PRIORITY_PREFETCH)
                except (DatacacheError, OSError) as exc:  # met again, and reported, when the shard is opened
                    logger.debug("dataset %s: prefetching %r failed: %s", handle.id, key, exc)
                    continue
                if location.tier == "local":  # declined ones (no room yet) are asked again as room frees
                    with self._lock:
                        self._local.add(key)
