"""The one hash every shard is checked with, and its string form in manifests and catalogs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

__all__ = ["checksum_of", "copy_problem", "hash_file", "new_hasher"]


def new_hasher() -> Any:
    """The hash every shard is checked with (xxh3, 64 bits: ~15 GB/s per core)."""
    return xxhash.xxh3_64()


def checksum_of(hasher: Any) -> str:
    """The checksum string a manifest records for a finished ``hasher``."""
    return f"xxh3_64:{hasher.hexdigest()}"


def copy_problem(data: Any, size: int, checksum: str | None, *, hashed: bool = True) -> str:
    """What is wrong with a whole shard's bytes ``data`` (a buffer), checked against its manifest entry.

    The one rule every reader of a shard applies (the stager's verified read, the loaders' mapped
    copies): its size, then, where ``hashed`` and the manifest has one, its ``checksum``. Empty when
    nothing is wrong; else a phrase that follows the name of the copy ("... has 5 bytes, the manifest says 9").
    """
    if len(data) != size:
        return f"has {len(data)} bytes, the manifest says {size}"
    if hashed and checksum is not None:
        hasher = new_hasher()
        hasher.update(data)
        if checksum_of(hasher) != checksum:
            return "does not match its checksum"
    return ""


def hash_file(path: Path) -> str:
    """The checksum string of a whole file, read through one reused buffer (blocking)."""
    hasher = new_hasher()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            hasher.update(view[:count])
    return checksum_of(hasher)
