"""Dataset manifests: the snapshot of a dataset's shards that every epoch reads from.

A manifest lists each shard's key (relative to the dataset URL), size, origin
version (ETag or mtime) and, where known, checksum and sample count. It is
taken by listing the origin once and persisted, so later runs, ranks and
workers reuse it without listing the bucket again. A dataset written by
``datacache shard`` carries its own manifest (``datacache-manifest.json``) with
checksums and sample counts, which is used as is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any

from datacache.config import DatasetConfig
from datacache.errors import ConfigError, DatacacheError, InvalidKeyError, ShardNotFoundError
from datacache.tiers import LocalTier, ObjectInfo, SharedTier, Tier, redact_url, validate_key
from datacache.tiers._dirfd import Place, read_bounded_stat
from datacache.tiers._files import atomic_write

__all__ = [
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "OBJECT_KEY",
    "SIDECAR_CANDIDATES",
    "Manifest",
    "ManifestStore",
    "Shard",
    "ShardFormat",
    "default_trusted_uids",
    "detect_format",
    "max_samples",
    "object_url",
    "reading_url",
    "take_manifest",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "datacache-manifest.json"
"""The file ``datacache shard`` writes at the root of its output."""

_FORMAT_VERSION = 1


class ShardFormat(StrEnum):
    """How the samples of a dataset are laid out in its files."""

    TAR = "tar"
    PARQUET = "parquet"
    ZARR = "zarr"
    FILES = "files"


@dataclass(frozen=True, slots=True)
class Shard:
    """One file of a dataset, as the manifest snapshot recorded it."""

    key: str
    size: int
    version: str | None = None
    checksum: str | None = None
    samples: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"key": self.key, "size": self.size}
        for name in ("version", "checksum", "samples"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> Shard:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a shard entry must be an object")
        key = data.get("key")
        size = data.get("size")
        if not isinstance(key, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"{where}: a shard entry needs a string key and a non-negative integer size")
        validate_key(key)
        version = data.get("version")
        checksum = data.get("checksum")
        samples = data.get("samples")
        if version is not None and not isinstance(version, str):
            raise ConfigError(f"{where}: shard {key!r}: version must be a string")
        if checksum is not None and not (isinstance(checksum, str) and checksum.startswith("xxh3_64:")):
            raise ConfigError(f"{where}: shard {key!r}: checksum must look like 'xxh3_64:<hex>'")
        if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool) or samples < 0):
            raise ConfigError(f"{where}: shard {key!r}: samples must be a non-negative integer")
        return cls(key=key, size=size, version=version, checksum=checksum, samples=samples)


TAR_BLOCK = 512
"""A tar member takes one header block at least: a tar of N bytes holds at most N // 512 samples."""
PARQUET_MAX_ROWS_PER_BYTE = 1024
"""Parquet encodes a constant column in almost nothing (5M rows in 22 KB); more than this is a lie."""


def max_samples(fmt: ShardFormat, size: int) -> int | None:
    """The most samples ``size`` bytes of ``fmt`` can hold (None: no bound from the bytes alone).

    A declared count above it is not backed by bytes: trusting it would let a
    small file make every reader allocate for billions of samples.
    """
    if fmt is ShardFormat.TAR:
        return size // TAR_BLOCK
    if fmt is ShardFormat.PARQUET:
        return max(size, 1) * PARQUET_MAX_ROWS_PER_BYTE
    if fmt is ShardFormat.FILES:
        return 1
    return None


def _backed_counts(fmt: ShardFormat, shards: tuple[Shard, ...], where: str) -> tuple[Shard, ...]:
    """``shards`` with every count their bytes cannot back dropped (counted from the shard itself later)."""
    checked = []
    for shard in shards:
        bound = max_samples(fmt, shard.size)
        if shard.samples is not None and bound is not None and shard.samples > bound:
            logger.warning(
                "%s: shard %r claims %d samples in %d bytes (at most %d); counting them instead",
                where,
                shard.key,
                shard.samples,
                shard.size,
                bound,
            )
            checked.append(Shard(shard.key, shard.size, shard.version, shard.checksum, None))
        else:
            checked.append(shard)
    return tuple(checked)


@dataclass(frozen=True)
class Manifest:
    """A dataset's shards at one moment; an epoch reads one manifest, never two."""

    dataset: str
    url: str
    format: ShardFormat
    shards: tuple[Shard, ...]
    created: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @cached_property
    def snapshot(self) -> str:
        """A digest of every shard's key, size and version: equal snapshots, equal data."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.key}\0{shard.size}\0{shard.version}\n".encode())
        return digest.hexdigest()[:16]

    @cached_property
    def _by_key(self) -> dict[str, Shard]:
        return {shard.key: shard for shard in self.shards}

    def shard(self, key: str) -> Shard:
        """Return the shard ``key``; raise `ShardNotFoundError` naming the dataset if absent."""
        try:
            return self._by_key[key]
        except KeyError:
            raise ShardNotFoundError(f"dataset {self.dataset}: no shard {key!r} in its manifest") from None

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    @property
    def total_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    @property
    def total_samples(self) -> int | None:
        """Sum of the sample counts, or ``None`` if any shard's count is unknown."""
        counts = [shard.samples for shard in self.shards]
        if any(count is None for count in counts):
            return None
        return sum(count for count in counts if count is not None)

    def select(self, spec: str | None) -> list[Shard]:
        """Return the shards a ``--shards`` spec names: ``"0:10"`` (indexes), ``"a.tar,b.tar"`` (keys) or all."""
        if not spec:
            return list(self.shards)
        if ":" in spec and all(part.strip().lstrip("-").isdigit() or not part.strip() for part in spec.split(":")):
            parts = [int(p) if p.strip() else None for p in spec.split(":")]
            if len(parts) > 3:
                raise ConfigError(f"--shards {spec!r}: expected START:STOP[:STEP]")
            return list(self.shards[slice(*parts)])
        selected = []
        for key in (k.strip() for k in spec.split(",")):
            if key:
                selected.append(self._shard_or_index(key, spec))
        return selected

    def _shard_or_index(self, key: str, spec: str) -> Shard:
        """The shard named ``key``; a bare number that names no shard is an index (``--shards 3``)."""
        if key in self._by_key or not key.lstrip("-").isdigit():
            return self.shard(key)
        index = int(key)
        if not -len(self.shards) <= index < len(self.shards):
            raise ConfigError(
                f"--shards {spec}: index {index} is out of range (the dataset has {len(self.shards)} shards)"
            )
        return self.shards[index]

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": _FORMAT_VERSION,
            "dataset": self.dataset,
            "url": redact_url(self.url),
            "format": self.format.value,
            "created": self.created,
            "snapshot": self.snapshot,
            "extra": dict(self.extra),
            "shards": [shard.to_json() for shard in self.shards],
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Manifest:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a manifest must be a JSON object")
        if data.get("format_version") != _FORMAT_VERSION:
            raise ConfigError(f"{where}: unsupported manifest format_version {data.get('format_version')!r}")
        try:
            fmt = ShardFormat(str(data.get("format")))
        except ValueError:
            raise ConfigError(f"{where}: unknown format {data.get('format')!r}") from None
        shards = data.get("shards")
        if not isinstance(shards, list):
            raise ConfigError(f"{where}: 'shards' must be a list")
        extra = data.get("extra", {})
        if not isinstance(extra, dict):
            raise ConfigError(f"{where}: 'extra' must be an object")
        parsed = _backed_counts(fmt, tuple(Shard.from_json(entry, where) for entry in shards), where)
        if len({s.key for s in parsed}) != len(parsed):
            raise ConfigError(f"{where}: duplicate shard keys")
        created = data.get("created", 0.0)
        if not isinstance(created, int | float) or isinstance(created, bool) or not -1e12 < created < 1e12:
            created = 0.0  # not a timestamp (a huge integer, NaN, infinity): informational only
        return cls(
            dataset=str(data.get("dataset", "")),
            url=str(data.get("url", "")),
            format=fmt,
            shards=parsed,
            created=float(created),
            extra=extra,
        )


_ZARR_METADATA = ("zarr.json", ".zarray", ".zgroup", ".zattrs", ".zmetadata")


def detect_format(keys: Iterable[str]) -> ShardFormat:
    """Guess a dataset's format from its keys: tar shards, Parquet, a Zarr store, or plain files."""
    keys = list(keys)
    names = {key.rsplit("/", 1)[-1] for key in keys}
    if names & {"zarr.json", ".zarray"}:
        return ShardFormat.ZARR
    if any(key.endswith(".tar") for key in keys):
        return ShardFormat.TAR
    if any(key.endswith(".parquet") for key in keys):
        return ShardFormat.PARQUET
    return ShardFormat.FILES


def _shard_keys_for(fmt: ShardFormat, infos: list[ObjectInfo]) -> list[ObjectInfo]:
    if fmt is ShardFormat.TAR:
        return [info for info in infos if info.key.endswith(".tar")]
    if fmt is ShardFormat.PARQUET:
        return [info for info in infos if info.key.endswith(".parquet")]
    return infos


SIDECAR_CANDIDATES = "sidecar_candidates"
"""In a tar manifest's ``extra``: ``[key, size]`` of each listed object that may be a sample index.

`datacache.indexing` reads the sample indexes from these, so that a cold start lists the origin
once (a listing costs about a second per thousand objects on some stores).
"""


def _sidecar_candidates(fmt: ShardFormat, infos: list[ObjectInfo]) -> dict[str, Any]:
    if fmt is not ShardFormat.TAR:
        return {}
    found = [[info.key, info.size] for info in infos if info.key.endswith((".json", ".idx"))]
    return {SIDECAR_CANDIDATES: found}


OBJECT_KEY = "object"
"""In a manifest's ``extra``: the dataset's URL names this one object, read as a key of the URL's parent."""


def object_url(url: str) -> tuple[str, str] | None:
    """``(parent URL, name)`` when ``url`` could name one object (no trailing slash, not a bare bucket)."""
    if url.endswith("/"):
        return None
    rest = url.split("://", 1)[-1]
    if "/" not in rest.strip("/"):
        return None
    parent, _, name = url.rpartition("/")
    return (parent, name) if name not in ("", ".", "..") else None


def reading_url(url: str, manifest: Manifest) -> str:
    """The URL a dataset's shards are read under: its own, or its parent's when it names one object."""
    if not manifest.extra.get(OBJECT_KEY):
        return url
    split = object_url(url)
    if split is None:
        raise ConfigError(f"dataset {manifest.dataset}: its manifest names one object, its URL a prefix")
    return split[0]


def _lists_itself(url: str, infos: list[ObjectInfo]) -> bool:
    """Whether listing ``url`` found only the object ``url`` names (not a key under it)."""
    split = object_url(url)
    if split is None or len(infos) != 1:
        return False
    key = infos[0].key.lstrip("/")
    return key != split[1] and url.endswith("/" + key)


async def _single_object(dataset: DatasetConfig, parent: Tier) -> Manifest | None:
    """The manifest of a dataset whose URL names one object (a shard, a Parquet file), else None."""
    split = object_url(dataset.url)
    if split is None:
        return None
    name = split[1]
    try:
        info = await parent.stat(name)
    except InvalidKeyError:
        return None
    if info is None:
        return None
    fmt = ShardFormat(dataset.format) if dataset.format else detect_format([name])
    shard = Shard(name, info.size, info.version)
    return Manifest(dataset=dataset.id, url=dataset.url, format=fmt, shards=(shard,), extra={OBJECT_KEY: name})


def _say_what_is_left_out(dataset: DatasetConfig, url: str, fmt: ShardFormat, infos: list[ObjectInfo]) -> None:
    """Warn when a prefix holds shards of both formats and only one is read.

    Not refused: img2dataset, for one, writes a ``.parquet`` of metadata beside each ``.tar``.
    """
    tars = sum(1 for info in infos if info.key.endswith(".tar"))
    parquets = sum(1 for info in infos if info.key.endswith(".parquet"))
    if fmt is ShardFormat.TAR and parquets:
        logger.warning(
            "dataset %s: %s holds %d .tar and %d .parquet files; reading the .tar shards only "
            '(set format = "parquet" for the dataset in the config file to read the others)',
            dataset.name,
            redact_url(url),
            tars,
            parquets,
        )


async def take_manifest(dataset: DatasetConfig, origin: Tier, *, parent: Tier | None = None) -> Manifest:
    """List ``origin`` once and return the dataset's manifest.

    If the origin holds a ``datacache-manifest.json`` (written by ``datacache
    shard``) it is used, after checking that every shard it names exists with
    the recorded size. With ``parent`` (the tier of the URL's parent), a URL
    that names one object is a dataset of that one shard. Raises
    `ShardNotFoundError` for a missing or empty bucket or prefix.
    """
    started = time.monotonic()
    infos = [info async for info in origin.list()]
    if parent is not None and _lists_itself(dataset.url, infos):
        # Listing a URL that names an object yields that object under its full path.
        whole = await _single_object(dataset, parent)
        if whole is not None:
            return whole
    if not infos:
        raise ShardNotFoundError(
            f"dataset {dataset.name}: no objects under {origin.url} "
            "(the prefix or directory is empty or does not exist)"
        )
    by_key = {info.key: info for info in infos}
    if MANIFEST_NAME in by_key:
        raw = await origin.get(MANIFEST_NAME)
        try:
            document = json.loads(raw)
        except ValueError as exc:
            raise ConfigError(f"{origin.url}/{MANIFEST_NAME}: not valid JSON ({exc})") from None
        written = Manifest.from_json(document, f"{origin.url}/{MANIFEST_NAME}")
        shards = []
        for shard in written.shards:
            found = by_key.get(shard.key)
            if found is None or found.size != shard.size:
                raise ShardNotFoundError(
                    f"dataset {dataset.name}: {MANIFEST_NAME} names {shard.key!r} "
                    f"({shard.size} bytes) but the origin {'lacks it' if found is None else f'has {found.size} bytes'}"
                )
            shards.append(Shard(shard.key, shard.size, found.version, shard.checksum, shard.samples))
        manifest = Manifest(
            dataset=dataset.id, url=dataset.url, format=written.format, shards=tuple(shards), extra=written.extra
        )
    else:
        fmt = ShardFormat(dataset.format) if dataset.format else detect_format(by_key)
        chosen = _shard_keys_for(fmt, infos)
        if not dataset.format:
            _say_what_is_left_out(dataset, origin.url, fmt, infos)
        if not chosen:
            raise ShardNotFoundError(f"dataset {dataset.name}: no {fmt.value} files at {origin.url}")
        for info in chosen:
            # Object stores allow keys such as "a/../../x" or "a//b"; none may become a path.
            try:
                validate_key(info.key)
            except InvalidKeyError as exc:
                raise InvalidKeyError(f"dataset {dataset.name}: refusing to cache {origin.url}: object {exc}") from None
        manifest = Manifest(
            dataset=dataset.id,
            url=dataset.url,
            format=fmt,
            shards=tuple(Shard(info.key, info.size, info.version) for info in chosen),
            extra=_sidecar_candidates(fmt, infos),
        )
    logger.info(
        "listed %s: %d shards, %d bytes, format %s, in %.2fs",
        origin.url,
        len(manifest.shards),
        manifest.total_bytes,
        manifest.format.value,
        time.monotonic() - started,
    )
    return manifest


MAX_MANIFEST_BYTES = 1 << 30
"""A persisted manifest larger than this is not read (about ten million shards)."""


def default_trusted_uids() -> frozenset[int]:
    """Whose files a process trusts without checking them against the origin: itself and root."""
    return frozenset({os.geteuid(), 0})


class ManifestStore:
    """Persisted manifests, one JSON file per dataset in each given directory.

    The first directory is this node's own (the local tier, private: 0700/0600):
    only it is read back, and only a regular file owned by a trusted uid, of at
    most `MAX_MANIFEST_BYTES`, reached from the tier's root without following a
    link (a FIFO or a link to ``/dev/zero`` must not hang or exhaust a reader).
    The others (on the shared tier, the group's: 2770/0640) are written for
    tools and other nodes to inspect, never taken as a snapshot: whoever can
    write there could name any shards and versions, so each reader takes its
    own listing of the origin (docs/SECURITY.md).
    """

    def __init__(self, *directories: Path, trusted_uids: frozenset[int] | None = None) -> None:
        if not directories:
            raise ValueError("ManifestStore needs at least one directory")
        self._directories = directories
        self._trusted = default_trusted_uids() if trusted_uids is None else trusted_uids

    def _place(self, position: int, dataset_id: str) -> Place:
        validate_key(dataset_id)
        directory = self._directories[position]
        dir_mode = LocalTier.dir_mode if position == 0 else SharedTier.dir_mode
        return Place(directory.parent, (directory.name,), f"{dataset_id}.json", dir_mode)

    def _file_mode(self, position: int) -> int | None:
        return LocalTier.file_mode if position == 0 else SharedTier.file_mode

    def _read_trusted(self, place: Place) -> bytes | None:
        """The bytes of ``place`` if it is a regular file of a trusted owner, not too large; else None."""
        try:
            st, raw = read_bounded_stat(place, MAX_MANIFEST_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, InvalidKeyError) as exc:
            logger.warning("ignoring manifest %s: %s", place.path, exc)
            return None
        if st.st_uid not in self._trusted:
            logger.warning("ignoring manifest %s: not a file of this user, root or the daemon", place.path)
            return None
        return raw

    def _load_sync(self, dataset_id: str) -> Manifest | None:
        place = self._place(0, dataset_id)
        raw = self._read_trusted(place)
        if raw is None:
            return None
        try:
            manifest = Manifest.from_json(json.loads(raw), str(place.path))
        except (ValueError, DatacacheError) as exc:
            logger.warning("ignoring unreadable manifest %s: %s", place.path, exc)
            return None
        if manifest.dataset != dataset_id:
            logger.warning("ignoring manifest %s: it describes dataset %r", place.path, manifest.dataset)
            return None
        return manifest

    async def load(self, dataset_id: str) -> Manifest | None:
        """Return the manifest of ``dataset_id`` this node persisted, or ``None``."""
        return await asyncio.to_thread(self._load_sync, dataset_id)

    async def save(self, manifest: Manifest) -> None:
        """Persist ``manifest`` atomically in every directory."""
        encoded = json.dumps(manifest.to_json(), separators=(",", ":")).encode()

        async def body() -> AsyncIterator[bytes]:
            yield encoded

        for position, directory in enumerate(self._directories):
            place = self._place(position, manifest.dataset)
            try:
                await atomic_write(place, body(), durable=False, file_mode=self._file_mode(position))
            except (OSError, InvalidKeyError) as exc:
                logger.warning("could not persist the manifest of %s in %s: %s", manifest.dataset, directory, exc)

    async def delete(self, dataset_id: str) -> None:
        def unlink(place: Place) -> None:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, InvalidKeyError):
                fd = place.open_parent()
                try:
                    os.unlink(place.name, dir_fd=fd)
                finally:
                    os.close(fd)

        for position in range(len(self._directories)):
            await asyncio.to_thread(unlink, self._place(position, dataset_id))
