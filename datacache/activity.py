"""What a node's readers and stagers are doing now, for ``datacache top``.

Three small parts, shared by the loader, the daemon and the command:

- `READER_FIELDS`: the figures one reader (a rank's DataLoader worker, or its main process)
  reports of itself: what it delivered, how long it waited, where its shards came from.
  Through a daemon they travel in ``/v1/report``; embedded, in a report file.
- `TierActivity`: a `Stager` listener that counts, per tier, bytes staged in and read out,
  evictions and declines, and keeps the transfers in flight with their progress.
- Report files: in embedded mode there is no daemon to ask, so each reading process writes
  its readers' figures, its stager's counters and its transfers to one small JSON file under
  ``LOCAL_DIR/clients/<uid>/`` (mode 0700: a user reads only their own, root reads all),
  replaced atomically at the reporting interval, never per sample.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import socket
import stat
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from datacache.staging.tier_activity import TierActivity, TransferInFlight
from datacache.tiers.local import make_local_dirs

__all__ = [
    "CLIENTS_DIR",
    "READER_FIELDS",
    "REPORT_TTL",
    "TierActivity",
    "TransferInFlight",
    "check_reader_fields",
    "read_report_files",
    "remove_report_file",
    "user_name",
    "write_report_file",
]

logger = logging.getLogger(__name__)

CLIENTS_DIR = "clients"
"""Under the local tier's directory: one folder per uid, one report file per reading process."""

REPORT_TTL = 300.0
"""A reader silent for this long is no longer shown (the daemon's ``client_ttl`` default)."""

READER_FIELDS: dict[str, type] = {
    "rank": int,
    "world_size": int,
    "worker": int,
    "num_workers": int,
    "epoch": int,
    "samples": int,
    "samples_total": int,
    "started": float,  # wall clock when the reader started its epoch
    "updated": float,  # wall clock of its last delivery
    "wait_seconds": float,  # blocked on shards not yet local
    "samples_per_s": float,
    "target_bytes_per_s": float,
    "prefetch_depth": int,
    "units_local": int,
    "units_shared": int,
    "units_origin": int,
    "mode": str,
    "remote_workers": int,  # the rank's remote pool (remote=): workers making its batches now
    "remote_max_workers": int,
    "dataset_name": str,  # the configured name the reader opened the dataset by, when it has one
    "own_bytes_in": int,  # staged by the reader's own process (its fallback), not through the daemon
    "own_transfers": int,  # its own process's transfers in flight now
}
"""Optional fields of a reader's report beside ``delivered_bytes_per_s``, ``stall_fraction``,
``delivered_bytes`` and ``dataset``, with their types (``/v1/report`` checks them)."""


def check_reader_fields(data: Mapping[str, Any]) -> dict[str, Any]:
    """The `READER_FIELDS` present in ``data``, checked; raise ValueError naming a wrong one."""
    found: dict[str, Any] = {}
    for name, kind in READER_FIELDS.items():
        value = data.get(name)
        if value is None:
            continue
        if kind is str:
            if not isinstance(value, str) or len(value) > 64:
                raise ValueError(f"{name!r} must be a string of at most 64 characters")
            found[name] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e18:
            raise ValueError(f"{name!r} must be a number >= 0")
        found[name] = int(value) if kind is int else float(value)
    return found


# -- report files (embedded mode) ------------------------------------------------------------


def _uid_dir(local_dir: Path, uid: int) -> Path:
    return local_dir / CLIENTS_DIR / str(uid)


def report_file(local_dir: Path, name: str) -> Path:
    """Where this process writes its report named ``name`` (a few safe characters)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:120]
    return _uid_dir(local_dir, os.getuid()) / f"{safe}.json"


def write_report_file(local_dir: Path, name: str, document: Mapping[str, Any]) -> None:
    """Replace this process's report file atomically (no fsync: it says what is happening, not what was)."""
    target = report_file(local_dir, name)
    folder = target.parent
    if not folder.is_dir():
        # The local tier is one user's, every folder in it private whatever the umask (an operator,
        # root, reads them all); the per-uid folder below keeps the check that it is this uid's.
        make_local_dirs(folder)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        # Made by someone else (the parent folder is everyone's): nothing of ours goes there.
        raise PermissionError(f"{folder} is not a private folder of uid {os.getuid()}")
    if not target.exists():
        _prune(folder)  # once per new reader: files stay as many as the live processes
    partial = folder / f".{target.name}.{uuid.uuid4().hex}.partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(document, out, separators=(",", ":"))
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def remove_report_file(local_dir: Path, name: str) -> None:
    with contextlib.suppress(OSError):
        report_file(local_dir, name).unlink()


def _alive(pid: Any, host: Any) -> bool:
    if host != socket.gethostname() or not isinstance(pid, int):
        return True  # another host's process (a shared local dir): its file's age tells
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's, alive
    return True


def _prune(folder: Path) -> None:
    """Drop report files of processes of this host that are gone, and writes a kill cut short."""
    for path in folder.glob(".*.partial"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > 60:
                path.unlink()
    for path in folder.glob("*.json"):
        document = _read_json(path)
        if isinstance(document, dict) and not _alive(document.get("pid"), document.get("host")):
            with contextlib.suppress(OSError):
                path.unlink()


_MOST_BYTES = 1 << 20


def _read_json(path: Path) -> Any:
    """A report file's JSON, or None: never through a link, never a fifo or device, never large."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MOST_BYTES:
            return None
        return json.loads(os.read(fd, _MOST_BYTES))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def read_report_files(local_dir: Path, *, now: float | None = None) -> list[dict[str, Any]]:
    """Every report file this user may read (root: all), of live processes, fresher than `REPORT_TTL`.

    Another user's folder is mode 0700: reading it fails, and it is skipped, not an error. The file
    of a process of this host that has ended is removed (`datacache top` reads them all).
    """
    root = local_dir / CLIENTS_DIR
    now = time.time() if now is None else now
    found: list[dict[str, Any]] = []
    try:
        folders = sorted(p for p in root.iterdir() if p.name.isdigit())
    except OSError:
        return found
    for folder in folders:
        try:
            paths = sorted(folder.glob("*.json"))
        except OSError:
            continue
        for path in paths:
            document = _read_json(path)  # None: unreadable (another user's), or replaced under us
            if not isinstance(document, dict) or not isinstance(document.get("written"), int | float):
                continue
            if not _alive(document.get("pid"), document.get("host")):
                # Its process ended (the last epoch's DataLoader workers, a killed run): the file would stay
                # until a new reader of this uid starts. Removed here where the folder is ours (root: any).
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if now - float(document["written"]) > REPORT_TTL:
                continue
            document["uid"] = int(folder.name)
            found.append(document)
    return found


def user_name(uid: int) -> str | None:
    """The account name of ``uid`` on this machine, or None (a container's uid)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None
