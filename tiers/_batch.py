"""Many small files written atomically at once: what `DirectoryTier.put_many` does.

Each file is still written as `atomic_write` writes one (a new file nobody can see yet, made
durable, then given its name atomically, and that made durable), but the steps are taken for the
whole batch together: the temporary files are written in one thread job, made durable by one
``syncfs(2)`` of their filesystem (0.02 ms a file here, against 0.08 ms for fsyncs by 8 threads
at once and 0.15 ms one at a time; and one thread job, where the fsyncs took 8 of the default
executor's 6 workers, so every other thread job of the stager waited behind them), renamed
with their metadata written in one more job, and the renames and the metadata made durable by
one more ``syncfs``. The new file is unnamed (``O_TMPFILE``, linked into place: one change of
its directory, not a ``.partial``'s create and rename) where the filesystem allows, which took a
batch of 256 tiny files from 48 to 37 ms here. A tiny shard's cost becomes a few system calls and
a share of two syncs.

``syncfs`` also writes whatever else is dirty on that filesystem: on a device busy with other
writers a batch waits for their bytes too. Where it is missing or fails (not Linux; a write
error, which it reports for the filesystem, not the file), each file and directory is fsynced
as before, so that an error is found on the file it belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from datacache.tiers._acl import apply_mode
from datacache.tiers._dirfd import Place, UnsafeFileError
from datacache.tiers._files import create_temporary, partial_name

__all__ = ["BatchItem", "write_batch"]

FSYNC_THREADS = 8
"""Threads fsyncing a batch's files at once (where ``syncfs`` cannot be used)."""


def _find_syncfs() -> ctypes._NamedFuncPointer | None:
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux (or a C library without it)
        return None


_SYNCFS = _find_syncfs()

# Linux's unnamed new files, linked into place through /proc (see `_create`); 0 where either is missing.
_UNNAMED = getattr(os, "O_TMPFILE", 0) if os.path.isdir("/proc/self/fd") else 0


def _syncfs(fds: Sequence[int]) -> bool:
    """Make everything written to the filesystems of ``fds`` durable; False where that could not be said."""
    if _SYNCFS is None:
        return False
    devices = {os.fstat(fd).st_dev: fd for fd in fds}
    return all(_SYNCFS(fd) == 0 for fd in devices.values())


@dataclass(frozen=True)
class BatchItem:
    """One file of a batch: where its data and its metadata go, and what they hold."""

    data: Place
    meta: Place
    body: bytes | memoryview
    metadata: Mapping[str, str]


@dataclass
class _Open:
    """A batch in flight: directories opened once, each file's temporary name and descriptor."""

    dirs: dict[tuple[str, ...], int] = field(default_factory=dict)
    files: dict[int, tuple[int, str | None, int]] = field(default_factory=dict)
    """By item: (directory fd, temporary name or None for an unnamed file, file fd)."""
    cancelled: bool = False
    """The writer was cancelled: rename nothing more into place."""

    def directory(self, place: Place) -> int:
        parts = (str(place.root), *place.parts)
        if parts not in self.dirs:
            self.dirs[parts] = place.open_parent(create=True)
        return self.dirs[parts]

    def discard(self) -> None:
        """Remove every temporary file still here and close everything (an error or a cancellation)."""
        for dir_fd, temporary, fd in self.files.values():
            os.close(fd)  # an unnamed file goes with it
            if temporary is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temporary, dir_fd=dir_fd)
        self.files.clear()
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()


async def write_batch(
    items: Sequence[BatchItem], *, durable: bool, file_mode: int | None
) -> list[Exception | None]:
    """Write each item's file (and then its metadata) atomically; return each one's error, or None.

    When this returns, every file without an error is in place, and with ``durable``
    its bytes and its name are on the disk. A caller cancelled meanwhile leaves no
    temporary file behind (files already renamed stay: they are whole).
    """
    batch = _Open()
    errors: list[Exception | None] = [None] * len(items)
    steps = asyncio.ensure_future(_steps(batch, items, errors, durable, file_mode))
    try:
        await asyncio.shield(steps)
    except asyncio.CancelledError:
        # The thread jobs run on: let them end before their files are removed under them.
        batch.cancelled = True
        await asyncio.wait([steps])
        raise
    finally:
        if steps.done():
            batch.discard()
    return errors


async def _steps(
    batch: _Open, items: Sequence[BatchItem], errors: list[Exception | None], durable: bool, file_mode: int | None
) -> None:
    await asyncio.to_thread(_write_temporaries, batch, items, errors, file_mode)
    # Durable before renamed: a name in place always names whole bytes, a crash or a power cut after.
    if durable and batch.files and not await asyncio.to_thread(_syncfs, list(batch.dirs.values())):
        fds = [fd for _, _, fd in batch.files.values()]
        slices = [fds[start::FSYNC_THREADS] for start in range(FSYNC_THREADS)]
        await asyncio.gather(*(asyncio.to_thread(_fsync_all, part) for part in slices if part))
    await asyncio.to_thread(_publish, batch, items, errors, durable, file_mode)


def _write_temporaries(
    batch: _Open, items: Sequence[BatchItem], errors: list[Exception | None], file_mode: int | None
) -> None:
    for index, item in enumerate(items):
        try:
            dir_fd = batch.directory(item.data)
            temporary, fd = _create(dir_fd, item.data.name, file_mode)
            batch.files[index] = (dir_fd, temporary, fd)
            view = memoryview(item.body)
            while view:
                view = view[os.write(fd, view) :]
        except (OSError, UnsafeFileError) as exc:
            errors[index] = exc


def _fsync_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.fsync(fd)


def _publish(
    batch: _Open, items: Sequence[BatchItem], errors: list[Exception | None], durable: bool, file_mode: int | None
) -> None:
    """Rename each written file into place, then write its metadata; make the renames durable at once.

    Durable when this returns (with ``durable``): what the caller records next (the catalog's row
    of each file) never names a rename a power cut could undo.
    """
    touched: set[int] = set()
    for index, (dir_fd, temporary, fd) in list(batch.files.items()):
        if batch.cancelled:
            break
        try:
            _put_in_place(dir_fd, temporary, fd, items[index].data.name)
        except OSError as exc:
            errors[index] = exc
            continue
        finally:
            if errors[index] is None:
                del batch.files[index]
                os.close(fd)
        touched.add(dir_fd)
        # After the data, as `DirectoryTier.put`: a crash between the two leaves data without
        # (or with older) metadata, which fails verification and is re-staged.
        try:
            _write_meta(batch, items[index], file_mode)
        except (OSError, UnsafeFileError) as exc:
            errors[index] = exc  # its data stays, without metadata: recovery removes it
    if durable and touched and not _syncfs(list(batch.dirs.values())):
        for dir_fd in touched:
            os.fsync(dir_fd)


def _write_meta(batch: _Open, item: BatchItem, file_mode: int | None) -> None:
    dir_fd = batch.directory(item.meta)
    temporary, fd = _create(dir_fd, item.meta.name, file_mode)
    try:
        os.write(fd, json.dumps(dict(item.metadata), sort_keys=True).encode())
        _put_in_place(dir_fd, temporary, fd, item.meta.name)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)


def _create(dir_fd: int, name: str, file_mode: int | None) -> tuple[str | None, int]:
    """A new file for ``name``'s bytes in ``dir_fd``: its temporary name (None: it has none) and descriptor.

    Unnamed where the filesystem can (``O_TMPFILE``): one directory change a file instead of two
    (its name appears once, by `_put_in_place`), none of a ``.partial``'s lock and checks, and a
    crash leaves nothing to clean. Else a locked ``.partial`` (`create_temporary`).
    """
    if _UNNAMED:
        try:
            fd = os.open(".", _UNNAMED | os.O_WRONLY | os.O_CLOEXEC, 0o600 if file_mode is not None else 0o644,
                         dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            if file_mode is not None:
                try:  # exactly the tier's mode (and its readers' ACL), whatever the umask (as `create_temporary`)
                    apply_mode(fd, file_mode)
                except BaseException:
                    os.close(fd)
                    raise
            return None, fd
    return create_temporary(dir_fd, name, file_mode)


def _put_in_place(dir_fd: int, temporary: str | None, fd: int, name: str) -> None:
    """Give the file written through ``fd`` the name ``name`` in ``dir_fd``, atomically, over any file there."""
    if temporary is not None:
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return
    own = f"/proc/self/fd/{fd}"  # linkat of an unnamed file, without the privilege AT_EMPTY_PATH asks for
    try:
        os.link(own, name, dst_dir_fd=dir_fd, follow_symlinks=True)
    except FileExistsError:
        # A link never replaces: a file already there (an older copy) is replaced through a temporary name.
        temporary = partial_name(name)
        os.link(own, temporary, dst_dir_fd=dir_fd, follow_symlinks=True)
        try:
            os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
