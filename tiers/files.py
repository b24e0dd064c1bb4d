"""Files under a directory other users can write, for the layers above the tiers.

The metadata beside a shared tier's shards (manifests, indexes, locks, counts) is read and
written the way the tiers read and write shards: walked to one directory at a time without
following a link (`Place`), read only when a regular file of a bounded size (`read_bounded`),
written whole or not at all (`atomic_write`), and a crash's leftovers removed by their name
(`PARTIAL_NAME`, `remove_abandoned_partials`). A copy whose path is all a reader has is mapped
without following its last link, non-blocking, if regular (`map_regular`). An unsafe file (a
link, a FIFO, a device, too large) raises `UnsafeFileError`. This is the public face of the tiers' private file modules.
"""

from __future__ import annotations

from datacache.tiers._acl import ReadersIds, apply_mode, readers_mode
from datacache.tiers._dirfd import (
    Place,
    UnsafeFileError,
    map_regular,
    open_dir_async,
    read_bounded,
    read_bounded_at,
    read_bounded_stat,
    server_now,
)
from datacache.tiers._files import PARTIAL_NAME, atomic_write, remove_abandoned_partials

__all__ = [
    "PARTIAL_NAME",
    "Place",
    "ReadersIds",
    "UnsafeFileError",
    "apply_mode",
    "atomic_write",
    "map_regular",
    "open_dir_async",
    "read_bounded",
    "read_bounded_at",
    "read_bounded_stat",
    "readers_mode",
    "remove_abandoned_partials",
    "server_now",
]
