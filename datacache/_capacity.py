"""A capacity the disk cannot hold: said once at ``datacache serve``'s start and by deploy/slurm/install.sh --check."""

from __future__ import annotations

import shutil
from pathlib import Path

from datacache.sizes import format_bytes

__all__ = ["capacity_beyond_disk"]


def capacity_beyond_disk(directory: Path, capacity: int | None) -> str | None:
    """One line if ``capacity`` is more than the filesystem of ``directory`` holds in all; else None.

    The tier would then fill its disk long before its capacity: eviction never starts, and
    staging fails with ENOSPC (a trial's ``local_capacity = "3TB"`` on a 67 GB disk).
    """
    if capacity is None:
        return None
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        total = shutil.disk_usage(probe).total
    except OSError:
        return None
    if capacity <= total:
        return None
    return (
        f"local_capacity {format_bytes(capacity)} is more than the filesystem of {directory} holds "
        f"({format_bytes(total)}): the disk fills before eviction starts; set local_capacity below its size"
    )
