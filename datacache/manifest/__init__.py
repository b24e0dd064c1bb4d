"""Dataset manifests: the snapshot of a dataset's shards that every epoch reads from.

A manifest lists each shard's key (relative to the dataset URL), size, origin
version (ETag or mtime) and, where known, checksum and sample count. It is
taken by listing the origin once and persisted, so later runs, ranks and
workers reuse it without listing the bucket again. A dataset written by
``datacache shard`` carries its own manifest (``datacache-manifest.json``) with
checksums and sample counts, which is used as is.
"""

from __future__ import annotations

from datacache.manifest.listing import (
    LISTING_NOTICES,
    OBJECT_KEY,
    SIDECAR_CANDIDATES,
    detect_format,
    listing_notices,
    missing_local_path,
    object_url,
    reading_url,
    take_manifest,
)
from datacache.manifest.model import (
    MANIFEST_NAME,
    PARQUET_MAX_ROWS_PER_BYTE,
    TAR_BLOCK,
    Manifest,
    Shard,
    ShardFormat,
    max_samples,
)
from datacache.manifest.store import (
    MAX_MANIFEST_BYTES,
    ManifestStore,
    default_trusted_uids,
)

__all__ = [
    "LISTING_NOTICES",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "OBJECT_KEY",
    "PARQUET_MAX_ROWS_PER_BYTE",
    "SIDECAR_CANDIDATES",
    "TAR_BLOCK",
    "Manifest",
    "ManifestStore",
    "Shard",
    "ShardFormat",
    "default_trusted_uids",
    "detect_format",
    "listing_notices",
    "max_samples",
    "missing_local_path",
    "object_url",
    "reading_url",
    "take_manifest",
]
