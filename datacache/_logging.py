"""Log set-up for the programs (CLI, daemon); the library itself adds no handlers."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["FirstFew", "FirstTime", "JsonFormatter", "RateLimit", "configure_logging"]


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and any ``extra`` fields."""

    _STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._STANDARD and not key.startswith("_"):
                document[key] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, default=str)


class RateLimit(logging.Filter):
    """At most ``burst`` lines per message template every ``window`` seconds; then one line says how many were dropped.

    A storm (every accept failing with EMFILE, a client sending garbage in a loop)
    costs a few lines, not the disk.
    """

    def __init__(self, burst: int = 10, window: float = 10.0) -> None:
        super().__init__()
        self.burst, self.window = burst, window
        self._seen: dict[tuple[str, str], tuple[float, int, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        start, passed, dropped = self._seen.get(key, (now, 0, 0))
        if now - start >= self.window:
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this in the last {self.window:g}s were not logged)"
            start, passed, dropped = now, 0, 0
        if passed >= self.burst:
            self._seen[key] = (start, passed, dropped + 1)
            return False
        self._seen[key] = (start, passed + 1, dropped)
        if len(self._seen) > 4096:  # bounded: forget the oldest templates
            self._seen.pop(next(iter(self._seen)))
        return True


class FirstTime:
    """The level of a notice that is news the first time and expected after: WARNING once per key, then DEBUG.

    One per notice, process-wide: every stager of a process (two dataset objects over one
    dataset, a ``.map()`` copy, each epoch's runtime) says it once between them. A forked
    child starts with what its parent had said. Given ``run_dir``, once per run too: the
    processes of one process group (a training process and its DataLoader workers, a new
    set of them every epoch; torchrun starts each rank in a group of its own) share a
    marker file per key there.
    """

    def __init__(self) -> None:
        # No lock: a fork while another thread held one would leave it held in the child;
        # the worst a race does here is say a notice twice.
        self._said: set[str] = set()

    def level(self, key: str, *, run_dir: Path | None = None) -> int:
        if key in self._said:
            return logging.DEBUG
        self._said.add(key)
        if run_dir is not None and not _first_in_run(run_dir, key):
            return logging.DEBUG
        return logging.WARNING


def _first_in_run(directory: Path, key: str) -> bool:
    """Whether this is the first process of its process group to say ``key`` (a marker file records it)."""
    group = os.getpgrp()
    name = f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.{group}.{_started(group)}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        _forget_ended_runs(directory)
        os.close(os.open(directory / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot tell: say it
    return True


def _started(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot): with the pid, names one group leader ever."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19].decode()  # field 22, counted after the name
    except (OSError, IndexError):
        return "0"  # no /proc, or the leader has exited (its group id is not reused while the group lives)


def _forget_ended_runs(directory: Path) -> None:
    """Delete the markers of process groups that no longer exist (one small file per run and notice)."""
    for entry in os.scandir(directory):
        try:
            os.killpg(int(entry.name.split(".")[1]), 0)
        except (IndexError, ValueError, PermissionError):
            continue  # not a marker, or a group that lives (another user's)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


class FirstFew:
    """A notice that may come thousands of times (a skipped sample): the first few at WARNING, then a count.

    The first ``first`` are logged in full; the last of them says that later ones are
    counted (``count_in``, where the user reads the total) and logged at DEBUG, with one
    WARNING line every ``every`` giving the number so far.
    """

    def __init__(self, what: str, count_in: str, *, first: int = 5, every: int = 1000) -> None:
        self.what, self.count_in, self.first, self.every = what, count_in, first, every
        self._seen = itertools.count(1)  # next() is atomic: reader threads may share one

    def log(self, logger: logging.Logger, message: str, *args: object) -> None:
        seen = next(self._seen)
        if seen > self.first:
            logger.debug(message, *args)
            if seen % self.every == 0:
                logger.warning("%s: %d so far in this process (%s)", self.what, seen, self.count_in)
            return
        logger.warning(message, *args)
        if seen == self.first:
            logger.warning(
                "%s: the first %d are logged above; later ones are counted in %s (each logged at DEBUG, "
                "and the number so far every %d)",
                self.what,
                seen,
                self.count_in,
                self.every,
            )


def configure_logging(verbosity: int = 0, *, json_format: bool = False, rate_limited: tuple[str, ...] = ()) -> None:
    """Send datacache's logs to stderr: warnings by default, ``-v`` info, ``-vv`` debug.

    ``rate_limited``: also route these loggers (``asyncio``) through the same handler; with
    any given, every line passes a `RateLimit` (the daemon's choice).
    """
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("datacache")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    if rate_limited:
        handler.addFilter(RateLimit())
    for name in rate_limited:
        other = logging.getLogger(name)
        other.handlers[:] = [handler]
        other.propagate = False
