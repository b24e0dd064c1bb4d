"""Small objects of an origin on this machine's own filesystem, read many in one thread job.

What `ObjectTier.get` does for each through fsspec (a stat to compare the version the
manifest names, then a read: two thread round trips and fsspec's bookkeeping), done here
with plain system calls for a whole batch of tiny shards.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from datacache.errors import OriginChangedError, ShardNotFoundError

__all__ = ["Found", "read_files"]


Found = bytes | Exception | None
"""A file's bytes, the error `ObjectTier.get` would give, or None: ask `get`."""


def read_files(files: Sequence[tuple[str, str, str | None]]) -> list[Found]:
    """Each ``(path, where, version)``'s bytes, or the error `ObjectTier.get` would give, or None.

    ``version`` is compared as `ObjectTier` names a file's version (mtime in ns, size), on
    the file the path leads to (as fsspec's ``info`` does). None: something else went wrong
    (a permission, an I/O error): ask `ObjectTier.get`, which retries and names it.
    """
    found: list[bytes | Exception | None] = []
    for path, where, version in files:
        try:
            with open(path, "rb") as handle:
                st = os.fstat(handle.fileno())
                if version is not None and version != f"{int(st.st_mtime * 1e9)}:{st.st_size}":
                    found.append(OriginChangedError.since_manifest(where))
                    continue
                found.append(handle.read())
        except FileNotFoundError:
            found.append(ShardNotFoundError(f"{where}: not found at the origin"))
        except OSError:
            found.append(None)
    return found
