"""`LocalTier`: a node's local NVMe directory with a byte capacity."""

from __future__ import annotations

from datacache.tiers._directory import DirectoryTier

__all__ = ["LocalTier"]


class LocalTier(DirectoryTier):
    """The fastest tier: one directory on the node's local disk, bounded by ``capacity`` bytes.

    The stager keeps it under capacity by eviction and records what it holds
    in the catalog; readers open its files directly. It is one user's (or the
    daemon's): directories 0700, files 0600, whatever the umask.
    """

    kind = "local"
    dir_mode = 0o700
    file_mode = 0o600
