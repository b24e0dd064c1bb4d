"""POSIX access ACLs written as the ``system.posix_acl_access`` xattr (no dependency on libacl).

docs/SECURITY.md, "Who may read what": a declared dataset's files are openable by exactly its
readers (plus the daemon's account and root). When ``readers`` is more than one group, a mode
cannot say that; an access ACL can: ``user:UID:r--`` and ``group:GID:r--`` entries, mask ``r--``,
the owning group's bits 0. The kernel's binary format is a 4-byte version (2) header, then 8-byte
entries ``tag(u16) perm(u16) id(u32)``, little-endian, sorted by tag then id.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterable

__all__ = ["ACL_XATTR", "AclUnsupported", "decode_access_acl", "encode_access_acl", "set_readers_acl"]

ACL_XATTR = "system.posix_acl_access"
_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_UNDEFINED_ID = 0xFFFFFFFF
_READ, _WRITE, _EXECUTE = 4, 2, 1


class AclUnsupported(OSError):
    """The filesystem refuses ACLs (EOPNOTSUPP): mount it with acl, or name one group as readers."""


def encode_access_acl(
    owner_perm: int, uids: Iterable[int], gids: Iterable[int], *, perm: int = _READ, other: int = 0
) -> bytes:
    """The xattr value: the owner ``owner_perm``, each uid and gid ``perm``, mask ``perm``, group 0."""
    entries = [(_USER_OBJ, owner_perm, _UNDEFINED_ID)]
    entries += [(_USER, perm, uid) for uid in sorted(set(uids))]
    entries.append((_GROUP_OBJ, 0, _UNDEFINED_ID))
    entries += [(_GROUP, perm, gid) for gid in sorted(set(gids))]
    entries += [(_MASK, perm, _UNDEFINED_ID), (_OTHER, other, _UNDEFINED_ID)]
    return struct.pack("<I", _VERSION) + b"".join(struct.pack("<HHI", *entry) for entry in entries)


def decode_access_acl(value: bytes) -> list[tuple[int, int, int]]:
    """The (tag, perm, id) entries of an xattr value; ValueError for anything but version 2."""
    if len(value) < 4 or (len(value) - 4) % 8 or struct.unpack_from("<I", value)[0] != _VERSION:
        raise ValueError(f"not a version {_VERSION} POSIX ACL ({len(value)} bytes)")
    return [struct.unpack_from("<HHI", value, offset) for offset in range(4, len(value), 8)]


def set_readers_acl(path: str, uids: Iterable[int], gids: Iterable[int], *, directory: bool = False) -> None:
    """Make ``path`` readable by its owner and exactly ``uids``/``gids`` (directories: r-x, traversal).

    Raises `AclUnsupported` where the filesystem refuses ACLs: never a silent 0640.
    """
    perm = _READ | _EXECUTE if directory else _READ
    owner = _READ | _WRITE | _EXECUTE if directory else _READ | _WRITE
    value = encode_access_acl(owner, uids, gids, perm=perm)
    try:
        os.setxattr(path, ACL_XATTR, value, follow_symlinks=False)
    except OSError as error:
        if error.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            raise AclUnsupported(error.errno, f"{path}: the filesystem refuses POSIX ACLs") from error
        raise
