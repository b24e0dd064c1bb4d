"""The one bridge from synchronous code to the async core: an event loop on a thread.

The CLI simply uses ``asyncio.run``. Code that stays synchronous for a long
time (a DataLoader worker iterating samples) owns a `LoopThread` and runs
coroutines on it, so the loop and the clients bound to it (S3 sessions) live
as long as the iterator. A `LoopThread` belongs to the process that created it;
after a fork the child makes its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "before_thread_pools_stop"]

T = TypeVar("T")


def before_thread_pools_stop(hook: Callable[[], object]) -> bool:
    """Run ``hook`` at interpreter exit, before ``concurrent.futures`` stops taking work; False if unsupported.

    ``atexit`` runs too late for code that finishes work on a thread pool (a copy being made
    durable: fsync, rename): by then every executor refuses new work and the copy could only be
    cancelled. CPython runs the hooks of ``threading._register_atexit`` first; it is private, and
    this is its one use in datacache, so an interpreter without it degrades here, to atexit's
    order, in one place (tests/test_private_verbs.py checks the order). Raises RuntimeError once
    the interpreter is already exiting.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    register(hook)
    return True


class LoopThread:
    """An asyncio event loop running in a daemon thread of this process."""

    def __init__(self, name: str = "datacache-loop") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"_name": self._name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_name"])  # type: ignore[misc]

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, started on first use (and again in a forked child)."""
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                started = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(started.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name=self._name, daemon=True)
                thread.start()
                started.wait()
                self._loop, self._thread, self._pid = loop, thread, os.getpid()
            return self._loop

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and return its result (raising its exception)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"timed out after {timeout}s") from None

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on the loop and return a future for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Stop the loop and join its thread (only in the process that started it)."""
        with self._lock:
            loop, thread = self._loop, self._thread
            if loop is None or thread is None or self._pid != os.getpid():
                self._loop = self._thread = None
                return
            self._loop = self._thread = None

        async def drain() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await loop.shutdown_asyncgens()

        asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()
