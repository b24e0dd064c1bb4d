"""`DataLoader`: torch's DataLoader, the same class and signature, that reads raw samples in-process.

With worker processes, a DataLoader pickles (or, with `sharedbytes`, copies
through shared memory) every sample from each worker to the training
process, and each worker opens the dataset anew every epoch. For a
`CachedIterableDataset` whose samples are raw bytes (no decoder, no
transform) the workers do nothing a thread could not: reading a cached shard
is a memory copy. This DataLoader then reads in the training process, as the
``num_workers`` workers would each read (`CachedIterableDataset.as_workers`),
groups each one's samples into batches and takes the batches in turn, as
torch's DataLoader does. The batches are exactly torch's: the same samples,
grouping, order and types (``default_collate``'s dicts of lists of ``bytes``),
and the dataset's resume arithmetic (`state_dict(samples_consumed=...)`)
holds unchanged. Anything else (a decoder or transform, which may need the
workers' CPUs; a ``collate_fn``; ``worker_init_fn``; ``batch_size=None``;
``num_workers=0``; a dataset that batches itself or resamples) runs through
torch's DataLoader as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.data
from datacache.loaders.dataset import CachedIterableDataset
from datacache.loaders.precheck import check_keywords
from torch.utils.data import default_collate
from torch.utils.data._utils import pin_memory as _pinning

from datacache._sync import before_thread_pools_stop

__all__ = ["DataLoader"]

_torch_pin: Callable[[Any, str], Any] = _pinning.pin_memory  # typed: torch leaves it untyped


def pin_batch(batch: Any, device: str) -> Any:
    """Pin ``batch`` as torch's DataLoader does with ``pin_memory=True`` (nested dicts, lists, tensors).

    torch publishes no function for a whole batch (``Tensor.pin_memory`` pins one tensor); its
    DataLoader's own is private (``torch.utils.data._utils.pin_memory.pin_memory``). This is the
    one call to it, so that the in-process batches are pinned exactly as torch's workers' are and
    a torch upgrade that moves it breaks here, named (tests/test_private_verbs.py).
    """
    return _torch_pin(batch, device)


class DataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """``torch.utils.data.DataLoader``, the same arguments; raw datacache samples are read in-process."""

    # torch's own, but a mistyped keyword (``shufle=True``) is answered with the one it most likely meant.
    __init__ = check_keywords("DataLoader")(torch.utils.data.DataLoader.__init__)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if in_process_reason(self) is not None:
            return super().__iter__()
        # As many batches ahead as torch's workers keep in flight (prefetch_factor each).
        depth = max(1, (self.prefetch_factor or 2) * self.num_workers)
        return _BuiltAhead(_TakenInTurn(self), depth)


def in_process_reason(loader: torch.utils.data.DataLoader[Any]) -> str | None:
    """Why ``loader`` runs as torch's DataLoader (its worker processes); None: it reads in-process."""
    dataset = loader.dataset
    if not isinstance(dataset, CachedIterableDataset):
        return "not a CachedIterableDataset"
    checks = (
        (loader.num_workers == 0, "num_workers=0 reads in-process already"),
        (loader.batch_size is None, "batch_size=None"),
        (loader.collate_fn is not default_collate, "a collate_fn"),
        (loader.worker_init_fn is not None, "a worker_init_fn"),
        (bool(dataset.batch_size), "the dataset batches"),
        (dataset.resample, "resample=True"),
        (dataset.decode != "auto" or dataset.transform is not None, "a decoder or transform"),
    )
    return next((why for failed, why in checks if failed), None)


class _TakenInTurn(Iterator[Any]):
    """Batches of each emulated worker's samples, one worker after another (skipping finished ones)."""

    def __init__(self, loader: torch.utils.data.DataLoader[Any]) -> None:
        dataset = loader.dataset
        if not isinstance(dataset, CachedIterableDataset) or loader.batch_size is None:  # pragma: no cover
            raise TypeError("in-process reading needs a CachedIterableDataset and a batch_size")
        self._dataset = dataset
        self._streams: list[Iterator[Any] | None] = list(dataset.as_workers(loader.num_workers))
        self._batch_size = loader.batch_size
        self._drop_last = loader.drop_last
        self._next = 0
        pinning = loader.pin_memory and torch.accelerator.is_available()  # as torch's own iterators decide
        accelerator = torch.accelerator.current_accelerator() if pinning else None
        self._pin_device = accelerator.type if accelerator is not None and accelerator.type != "mps" else None

    def __next__(self) -> Any:
        count = len(self._streams)
        for turn in range(count):
            worker = (self._next + turn) % count
            stream = self._streams[worker]
            if stream is None:
                continue
            samples = list(itertools.islice(stream, self._batch_size))
            if not samples or (self._drop_last and len(samples) < self._batch_size):
                self._streams[worker] = None  # this worker is done: torch's skips it from now on
                continue
            self._next = worker + 1
            batch = default_collate(samples)
            return batch if self._pin_device is None else pin_batch(batch, self._pin_device)
        self._dataset.done_as_workers()
        raise StopIteration


_END = object()


class _BuiltAhead(Iterator[Any]):
    """Batches built on a thread of their own, up to ``depth`` ahead of the training loop.

    Built in the training loop's thread, each batch's reading and copying would add to every
    step (torch's workers build theirs while the step runs); this thread builds them while the
    loop computes or waits on the accelerator. The batches, their order and the dataset's
    resume arithmetic are `_TakenInTurn`'s. An iterator dropped before its end stops the
    thread at its next batch.
    """

    def __init__(self, batches: Iterator[Any], depth: int) -> None:
        self._queue: queue.Queue[tuple[object, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_build, args=(batches, self._queue, self._stop), name="datacache-dataloader", daemon=True
        )
        _stop_at_exit(self._thread, self._stop)
        self._thread.start()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind is _END:
            self._done = True
            self._thread.join()
            if isinstance(value, BaseException):
                raise value
            raise StopIteration
        return value

    def __del__(self) -> None:
        self._stop.set()


def _build(batches: Iterator[Any], out: queue.Queue[tuple[object, Any]], stop: threading.Event) -> None:
    """Put each batch of ``batches`` on ``out`` (blocking while it is full), then the end or the error."""
    end: BaseException | None = None
    try:
        for batch in batches:
            if stop.is_set() or not _put(out, ("batch", batch), stop):
                return
    except BaseException as exc:  # raised in the training loop's thread, where torch's would be
        end = exc
    finally:
        with _LIVE_LOCK:
            _LIVE.pop(threading.current_thread(), None)
    _put(out, (_END, end), stop)


_LIVE: dict[threading.Thread, threading.Event] = {}
"""Building threads still running (an iterator dropped mid-epoch leaves one until its next batch)."""
_LIVE_LOCK = threading.Lock()
_EXIT_JOIN = 10.0
"""Seconds the interpreter's exit waits for each building thread to stop."""


def _stop_at_exit(thread: threading.Thread, stop: threading.Event) -> None:
    """Stop and join ``thread`` when the interpreter exits, before the dataset's runtime closes.

    A daemon thread left inside torch or the dataset's readers while the interpreter finalizes
    can abort the process ("terminate called without an active exception", exit 134): a
    training script that leaves an epoch early and exits would be reported failed. The hook
    runs before the thread pools stop and, registered after the dataset's own (each iterator
    registers it again; it does nothing twice), before the dataset's runtime closes.
    """
    with _LIVE_LOCK:
        _LIVE[thread] = stop
    with contextlib.suppress(RuntimeError):  # the interpreter is already exiting
        before_thread_pools_stop(_stop_all)


def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for _, stop in live:
        stop.set()
    for thread, _ in live:
        thread.join(_EXIT_JOIN)


def _put(out: queue.Queue[tuple[object, Any]], item: tuple[object, Any], stop: threading.Event) -> bool:
    """Put ``item`` once there is room; False if the loop dropped the iterator meanwhile."""
    while True:
        try:
            out.put(item, timeout=0.2)
            return True
        except queue.Full:
            if stop.is_set():
                return False
