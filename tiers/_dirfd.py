"""Race-free file operations under a directory that other users can write.

A shared tier is a directory every user of a cluster may write, so a path in it
can change between two uses: a directory swapped for a symlink to someone's
home (``renameat2(RENAME_EXCHANGE)``) turns a check by path, then an ``open``
by path, into a write through the link. Nothing here follows a path twice.
Each operation opens the tier's root once, walks down one component at a time
with ``O_NOFOLLOW | O_DIRECTORY`` (a symlink anywhere below the root, the
root's own ``data``, ``meta`` and ``locks`` included, is refused), and acts on
the last component with ``dir_fd=``. Once a directory is open, swapping its
path changes nothing for the holder: the descriptor names the directory, not
the path.

The root itself is the operator's configured path and is followed once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
import stat as stat_module
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from datacache.errors import InvalidKeyError, ShardNotFoundError

if TYPE_CHECKING:
    from datacache.tiers.base import Hasher

__all__ = [
    "DirHandle",
    "Place",
    "UnsafeFileError",
    "fill_region",
    "map_open_file",
    "map_regular",
    "open_dir_async",
    "read_bounded",
    "read_bounded_at",
    "read_bounded_stat",
    "read_bounded_stat_at",
    "server_now",
    "size_in",
    "sizes_by_folder",
]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted where a file is expected returns at once instead of
# waiting for a writer; the fstat that follows then refuses it.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafeFileError(InvalidKeyError):
    """A file in a tier is a symlink, a FIFO, a device or too large: it is never read or followed."""


def _not_a_directory(parent: int, name: str, where: Path) -> OSError | UnsafeFileError:
    """The error for a component that is not a directory: a refusal for a link, "not a directory" otherwise."""
    try:
        is_link = stat_module.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        is_link = False
    if is_link:
        return UnsafeFileError(f"{where / name}: a symlink; refusing to follow it")
    return NotADirectoryError(errno.ENOTDIR, "not a directory", str(where / name))


def _open_child_dir(parent: int, name: str, *, create: bool, mode: int | None, where: Path) -> int:
    created = False
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o700 if mode is not None else 0o777, dir_fd=parent)
            created = True
        except FileExistsError:
            pass
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise _not_a_directory(parent, name, where) from None
            raise
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP):
            raise _not_a_directory(parent, name, where) from None
        raise
    if created and mode is not None:
        # Created 0700, widened to the tier's mode only once it is ours and open: never a
        # moment where the umask, or a swap, decides what others may do with it.
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
    elif create and mode is not None and mode & 0o070 == 0o070:
        fd = _group_usable(parent, name, fd, mode, where)
    return fd


def _group_usable(parent: int, name: str, fd: int, mode: int, where: Path) -> int:
    """A group tier's directory as the group can use it: ours repaired, another's with the wrong mode set aside.

    A member who made ``data/<id>/`` 0755 (by umask, or to lock the others out) would make every
    other member's writes there fail. This user's own directory is given the tier's mode; another
    user's is renamed aside (``.unusable-<name>-<hex>``, named once in a warning; a rename inside a
    group-writable directory needs no right on the directory itself) and a new one is made.
    """
    st = os.fstat(fd)
    if stat_module.S_IMODE(st.st_mode) & 0o070 == 0o070:
        return fd
    if st.st_uid == os.geteuid():
        try:
            os.fchmod(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd
    os.close(fd)
    aside = f".unusable-{name}-{os.urandom(8).hex()}"
    os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)  # PermissionError (sticky bit): read around
    logger.warning(
        "%s: made by uid %d with mode %04o, which the tier's group cannot use; moved aside to %s",
        where / name,
        st.st_uid,
        stat_module.S_IMODE(st.st_mode),
        aside,
    )
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:  # made again meanwhile: not chased in a loop, read around
        raise PermissionError(errno.EACCES, "made again while moved aside", str(where / name)) from None
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_root(root: Path, *, create: bool, mode: int | None) -> int:
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        if not create:
            raise
    # The operator's configured path; made here when missing (tests, a first run).
    os.makedirs(root.parent, exist_ok=True)
    parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _open_child_dir(parent, root.name, create=True, mode=mode, where=root.parent)
    finally:
        os.close(parent)


@dataclass(frozen=True, slots=True)
class Place:
    """A file's place: a trusted ``root``, the directories below it, and the file's name.

    ``dir_mode`` is the exact mode given to directories this place creates
    (``None``: the process's umask decides).
    """

    root: Path
    parts: tuple[str, ...]
    name: str
    dir_mode: int | None = None

    @classmethod
    def of(cls, path: str | os.PathLike[str], *, dir_mode: int | None = None) -> Place:
        """A place whose whole parent directory is trusted (a private cache, a file the user named)."""
        full = Path(path)
        return cls(full.parent, (), full.name, dir_mode)

    @property
    def path(self) -> Path:
        """The path, for messages and for readers of private tiers; never used to write."""
        return self.root.joinpath(*self.parts, self.name)

    def open_parent(self, *, create: bool = False) -> int:
        """Open the directory holding this place, walking down without following any link; return its fd."""
        fd = _open_root(self.root, create=create, mode=self.dir_mode)
        where = self.root
        try:
            for part in self.parts:
                child = _open_child_dir(fd, part, create=create, mode=self.dir_mode, where=where)
                os.close(fd)
                fd = child
                where = where / part
        except BaseException:
            os.close(fd)
            raise
        return fd

    def sibling(self, name: str) -> Place:
        return Place(self.root, self.parts, name, self.dir_mode)


class DirHandle:
    """An open directory shared by the thread jobs that use it; closed after the last one.

    A job cancelled on the event loop may still be running in its thread: the
    descriptor stays open until it returns, so a number reused by a later
    ``open`` can never be acted on by mistake.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._refs = 1
        self._closed = False
        self._lock = threading.Lock()

    def do(self, fn: Callable[[int], T]) -> T:
        """Run ``fn(fd)`` (in a thread), keeping the directory open meanwhile."""
        with self._lock:
            if self._refs == 0:
                raise OSError(errno.EBADF, "the directory was closed before this job ran")
            self._refs += 1
        try:
            return fn(self._fd)
        finally:
            self._drop()

    async def run(self, fn: Callable[[int], T]) -> T:
        return await asyncio.to_thread(self.do, fn)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._drop()

    def _drop(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            os.close(self._fd)


async def open_dir_async(place: Place, *, create: bool = False) -> DirHandle:
    """Open ``place``'s directory in a thread; a caller cancelled meanwhile leaves no descriptor open."""
    future = asyncio.get_running_loop().run_in_executor(None, lambda: place.open_parent(create=create))
    try:
        return DirHandle(await asyncio.shield(future))
    except asyncio.CancelledError:
        future.add_done_callback(lambda done: None if done.cancelled() or done.exception() else os.close(done.result()))
        raise


def server_now(dir_fd: int) -> float:
    """The file server's clock, now: the mtime of a file created in ``dir_fd`` and removed again.

    Ages of files on a shared filesystem are measured against this, never against
    this node's clock, which may be skewed from the server's by any amount. Where
    the directory cannot be written, this node's clock is the only one there is.
    """
    name = f".datacache-clock.{uuid.uuid4().hex}.partial"  # a partial's name: no listing ever shows it
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except PermissionError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)


def read_bounded_at(dir_fd: int, name: str, limit: int) -> bytes:
    """Read the regular file ``name`` in ``dir_fd``: no link followed, no FIFO or device, at most ``limit`` bytes."""
    return read_bounded_stat_at(dir_fd, name, limit)[1]


def read_bounded_stat_at(dir_fd: int, name: str, limit: int) -> tuple[os.stat_result, bytes]:
    """`read_bounded_at`, also returning the file's status (from the same open file)."""
    fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat_module.S_ISREG(st.st_mode):
            raise UnsafeFileError(f"{name}: not a regular file; not read")
        if st.st_size > limit:
            raise UnsafeFileError(f"{name}: {st.st_size} bytes, more than the {limit} expected; not read")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise UnsafeFileError(f"{name}: grew past the {limit} bytes expected; not read")
        return st, b"".join(chunks)
    finally:
        os.close(fd)


def read_bounded(place: Place, limit: int) -> bytes:
    """`read_bounded_at` for a place: walked to without following links. Raises FileNotFoundError if absent."""
    return read_bounded_stat(place, limit)[1]


def read_bounded_stat(place: Place, limit: int) -> tuple[os.stat_result, bytes]:
    """`read_bounded`, also returning the file's status (its owner, for one)."""
    fd = place.open_parent()
    try:
        try:
            return read_bounded_stat_at(fd, place.name, limit)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(f"{place.path}: a symlink; not followed") from None
            raise
    finally:
        os.close(fd)


def map_open_file(fd: int) -> mmap.mmap | bytes:
    """Map the open regular file ``fd`` read-only (shared with the page cache: no copy); b"" if empty,
    its bytes if at most `SMALL_READ`.

    The mapping holds the file by itself: ``fd`` may be closed once this returns.
    """
    size = os.fstat(fd).st_size
    if size == 0:
        return b""
    if size <= SMALL_READ:
        # Read: a tiny shard's mapping (mmap, madvise, munmap, a page fault) costs more than its copy.
        return _read_whole(fd, size)
    # No MAP_POPULATE: CPython holds the GIL across mmap(), and populating 64 MB takes ~10 ms,
    # a stall for every other thread. A checksum pass that follows faults the pages in with the
    # GIL released; WILLNEED starts the readahead meanwhile.
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with contextlib.suppress(AttributeError, OSError):
        mapping.madvise(mmap.MADV_WILLNEED)
    return mapping


SMALL_READ = 64 * 1024
"""A file this small is read into memory by `map_open_file`, not mapped."""


def _read_whole(fd: int, size: int) -> bytes:
    """The first ``size`` bytes of ``fd`` (fewer if it was cut short meanwhile: the caller checks the size)."""
    parts, done = [], 0
    while done < size:
        part = os.pread(fd, size - done, done)
        if not part:
            break
        parts.append(part)
        done += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def map_regular(path: str | os.PathLike[str]) -> mmap.mmap | bytes:
    """Map the file at ``path`` read-only, if it is a regular file: its last component is not followed.

    Opened non-blocking (a FIFO put in a copy's place cannot hang the reader) and checked with
    ``fstat`` on the open file; a link, FIFO, device or directory raises `UnsafeFileError`.
    The directories above are followed: for a path `Tier.path` checked, or one the daemon gave.
    """
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path}: a symlink; not followed") from None
        raise
    try:
        if not stat_module.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFileError(f"{path}: not a regular file; not read")
        return map_open_file(fd)
    finally:
        os.close(fd)


def fill_region(fd: int, region: memoryview, offset: int, hasher: Hasher | None) -> None:
    """Read ``region`` from ``fd`` at ``offset`` whole, then hash it (blocking: run it in a thread)."""
    filled = 0
    while filled < len(region):
        count = os.preadv(fd, [region[filled:]], offset + filled)
        if not count:
            raise ShardNotFoundError("the file shrank while being read")
        filled += count
    if hasher is not None:
        hasher.update(region)


def size_in(parent: int | None, name: str) -> int:
    """The size of the regular file ``name`` in the open directory ``parent``; -1 if none is there."""
    if parent is None:
        return -1
    try:
        info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return -1
    return info.st_size if stat_module.S_ISREG(info.st_mode) else -1


def sizes_by_folder(
    keys: Sequence[str], place_of: Callable[[str], Place], root: Path, *, paths: bool
) -> tuple[list[int], list[Path]]:
    """Each key's file size, -1 if no regular file is there (and its path, if ``paths``), blocking.

    The keys are taken folder by folder: each directory on the way is walked once for its keys,
    without following a link (`Place.open_parent`), and each file is looked at from it (a path and
    an ``lstat`` a key were ~0.1 ms each). One folder is open at a time: a dataset laid out a folder
    a shard held them all open, past the open-file limit.
    """
    sizes, where = [-1] * len(keys), [root] * len(keys) if paths else []
    folder: str | None = None
    parent: int | None = None
    base = root
    try:
        for index in sorted(range(len(keys)), key=lambda index: keys[index].rpartition("/")[0]):
            here, _, name = keys[index].rpartition("/")
            if here != folder:
                if parent is not None:
                    os.close(parent)
                folder, parent, place = here, None, place_of(keys[index])
                base = place.path.parent if paths else base  # `Place.path` once a directory, not per key
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    parent = place.open_parent()
            sizes[index] = size_in(parent, name)
            if paths:
                where[index] = base / name
    finally:
        if parent is not None:
            os.close(parent)
    return sizes, where
