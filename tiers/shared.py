"""`SharedTier`: one directory on the cluster's distributed filesystem (Lustre, Ceph, NFS)."""

from __future__ import annotations

from pathlib import Path

from datacache.tiers._directory import DirectoryTier

__all__ = ["SharedTier"]


class SharedTier(DirectoryTier):
    """One copy of each shard for every node of the cluster.

    Many nodes write here at once: writes are atomic renames, the metadata of
    each object (its checksum) travels beside it, and transfers are made
    single-flight across nodes with lease lock files under `lock_dir`.
    """

    kind = "shared"

    @property
    def lock_dir(self) -> Path:
        """Where cross-node lease locks live."""
        return self.root / "locks"

    def lock_path(self, key: str) -> Path:
        """The lease lock file of ``key``; raises `InvalidKeyError` if it would resolve outside `lock_dir`."""
        return self._contained(self.lock_dir, key, ".lock")
