"""A declared dataset's files openable by exactly its readers: a file mode that carries a POSIX ACL.

docs/SECURITY.md, "Who may read what". A group tier's files are 0640 to the tier's group; for a
dataset whose ``readers`` are not exactly that group, the mode alone would let every member read
it. `AclMode` is the file's mode (an ``int``, so every path that passes a mode passes it unchanged)
with the access ACL that narrows it to the readers: applied on the open descriptor, before the file
is published under its name, so no reader outside them ever sees it readable.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Iterable
from pathlib import Path

from datacache.posix_acl import ACL_XATTR, AclUnsupported, encode_access_acl

__all__ = ["AclMode", "ReadersIds", "acl_refused", "apply_mode", "probe_acl", "readers_mode"]

ReadersIds = tuple[frozenset[int], frozenset[int]]
"""A dataset's readers as the tiers see them: (uids, gids)."""


class AclMode(int):
    """A file mode with the access ACL to set after it (``acl``: the xattr's value)."""

    acl: bytes

    def __new__(cls, mode: int, acl: bytes) -> AclMode:
        made = super().__new__(cls, mode)
        made.acl = acl
        return made

    # Two modes are one only with one ACL: a batch of files is written with one mode.
    def __eq__(self, other: object) -> bool:
        return isinstance(other, AclMode) and int(self) == int(other) and self.acl == other.acl

    def __hash__(self) -> int:
        return hash((int(self), self.acl))

    def __reduce__(self) -> tuple[type[AclMode], tuple[int, bytes]]:
        return AclMode, (int(self), self.acl)


def readers_mode(file_mode: int, readers: ReadersIds, root: Path) -> int:
    """The mode of a declared dataset's file on the tier at ``root``, whose files are ``file_mode``.

    Where the tier's files are not its group's at all, or the readers are exactly that group (the
    root's), the mode says it; else an `AclMode` names the readers (the owning group's bits cleared).
    """
    uids, gids = readers
    if not file_mode & 0o040 or (not uids and len(gids) == 1 and gids == {_group_of(root)}):
        return file_mode
    owner = (file_mode >> 6) & 0o7
    return AclMode(file_mode & 0o700, encode_access_acl(owner, uids, gids))


def _group_of(root: Path) -> int | None:
    try:
        return os.stat(root).st_gid
    except FileNotFoundError:
        return None


def apply_mode(fd: int, mode: int) -> None:
    """Give the open file ``fd`` exactly ``mode``, and its ACL where it carries one (`AclUnsupported`)."""
    os.fchmod(fd, mode)
    if isinstance(mode, AclMode):
        _set(fd, mode.acl)


def _set(target: int | str, value: bytes) -> None:
    try:
        os.setxattr(target, ACL_XATTR, value)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise AclUnsupported(error.errno, "the filesystem refuses POSIX ACLs") from error
        raise


def probe_acl(directory: Path, uids: Iterable[int], gids: Iterable[int]) -> None:
    """Raise `AclUnsupported` if files in ``directory`` cannot carry an access ACL."""
    name = directory / f".acl-probe-{uuid.uuid4().hex}"
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        _set(fd, encode_access_acl(0o6, uids, gids))
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def acl_refused(root: Path, file_mode: int | None, readers: dict[str, ReadersIds]) -> list[str]:
    """The datasets of ``readers`` that only an ACL can name, where the filesystem at ``root`` refuses ACLs."""
    if file_mode is None:
        return []
    needing = [dataset for dataset, ids in readers.items() if isinstance(readers_mode(file_mode, ids, root), AclMode)]
    if not needing:
        return []
    where = root
    while not where.exists() and where != where.parent:  # not made yet: its filesystem is its parent's
        where = where.parent
    try:
        probe_acl(where, *readers[needing[0]])
    except AclUnsupported:
        return needing
    except PermissionError:
        pass  # not this user's to write yet: a file written there later refuses, never widens
    return []
