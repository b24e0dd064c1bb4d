"""`SharedTier`: one directory on the cluster's distributed filesystem (Lustre, Ceph, NFS)."""

from __future__ import annotations

from pathlib import Path

from datacache.tiers._directory import DirectoryTier
from datacache.tiers._dirfd import Place

__all__ = ["SharedTier"]


class SharedTier(DirectoryTier):
    """One copy of each shard for every node of the cluster.

    Many nodes write here at once: writes are atomic renames, the metadata of
    each object (its checksum) travels beside it, and transfers are made
    single-flight across nodes with lease lock files under `lock_dir`.

    It is a group resource (docs/SECURITY.md, "The shared tier"): directories
    are setgid and group-writable (2770), so whatever a member creates belongs
    to the tier's group; files are readable by the group (0640).
    """

    kind = "shared"
    dir_mode = 0o2770
    file_mode = 0o640

    @property
    def lock_dir(self) -> Path:
        """Where cross-node lease locks live."""
        return self.root / "locks"

    def lock_path(self, key: str) -> Path:
        """The lease lock file of ``key``; raises `InvalidKeyError` if it would resolve outside `lock_dir`."""
        return self._contained(self.lock_dir, key, ".lock")

    def lock_place(self, key: str) -> Place:
        """The lease lock file of ``key``, to be reached without following links (see `LeaseLock`)."""
        return self._place("locks", key, ".lock")
