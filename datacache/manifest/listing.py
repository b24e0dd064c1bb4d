"""Taking a manifest: one listing of the origin, the shards picked from it, and the URLs to read."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from datacache.config import DatasetConfig
from datacache.errors import ConfigError, GlobURLError, InvalidKeyError, OriginError, ShardNotFoundError
from datacache.format_registry import available_formats, detect_format_name, get_format
from datacache.manifest.model import MANIFEST_NAME, Manifest, Shard, ShardFormat
from datacache.manifest.wids import wids_manifest
from datacache.tiers import (
    ListingBounds,
    ListingTooLargeError,
    ObjectInfo,
    Tier,
    glob_hint,
    redact_url,
    split_scheme,
    validate_key,
)

if TYPE_CHECKING:
    from datacache.formats._base import SampleFormat

__all__ = [
    "LISTING_NOTICES",
    "OBJECT_KEY",
    "SIDECAR_CANDIDATES",
    "detect_format",
    "listing_notices",
    "missing_local_path",
    "object_url",
    "reading_url",
    "take_manifest",
]

logger = logging.getLogger(__name__)


def detect_format(keys: Iterable[str]) -> ShardFormat:
    """What a listing holds: the first format, by priority, with any file in it (`datacache.formats`).

    Zarr metadata anywhere makes a Zarr store; else tar shards, then Parquet
    files, then any other registered format's files; else plain files.
    """
    return ShardFormat(detect_format_name(keys))


SIDECAR_CANDIDATES = "sidecar_candidates"
"""In a tar manifest's ``extra``: ``[key, size]`` of each listed object that may be a sample index.

`datacache.counting.cluster` reads the sample indexes from these, so that a cold start lists the origin
once (a listing costs about a second per thousand objects on some stores).
"""


LISTING_NOTICES = "listing_notices"
"""In a manifest's ``extra``: what the listing that took it warned of (`listing_notices`)."""

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


async def _single_object(dataset: DatasetConfig, parent: Tier, bounds: ListingBounds) -> Manifest | None:
    """The manifest of a dataset whose URL names one object (a shard, a Parquet file, a wids index), else None."""
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
    # The index itself is the sidecar its counts are read from.
    extra = {OBJECT_KEY: name, SIDECAR_CANDIDATES: [[name, info.size]]}
    listed = await wids_manifest(dataset, parent, name, info, extra=extra, bounds=bounds)
    if listed is not None:
        return listed
    fmt = ShardFormat(dataset.format) if dataset.format else detect_format([name])
    shard = Shard(name, info.size, info.version)
    return Manifest(dataset=dataset.id, url=dataset.url, format=fmt, shards=(shard,), extra={OBJECT_KEY: name})


def _named(dataset: DatasetConfig) -> str:
    """``"dataset NAME: "`` for a dataset the config names; "" for one given by its URL (the message shows it)."""
    return f"dataset {dataset.name}: " if dataset.name != dataset.id else ""


def _what_is_left_out(dataset: DatasetConfig, url: str, fmt: SampleFormat, infos: list[ObjectInfo]) -> list[str]:
    """What to say when a prefix holds the files of other formats too and only the detected one's are read.

    Not refused: img2dataset, for one, writes a ``.parquet`` of metadata beside each ``.tar``.
    """
    keys = [info.key for info in infos]
    return [
        f"{_named(dataset)}{redact_url(url)} holds {len(fmt.shard_keys(infos))} "
        f"{'/'.join(fmt.suffixes) or 'other'} and {len(other.shard_keys(infos))} {'/'.join(other.suffixes)} "
        f'files; reading the {fmt.name} shards only (set format = "{other.name}" for the dataset in the '
        "config file to read the others)"
        for other in available_formats()
        if other is not fmt and other.suffixes and other.detect(keys)
    ]


def listing_notices(manifest: Manifest) -> list[str]:
    """What the listing that took ``manifest`` warned of (files of other formats left out).

    Kept in the manifest, so that a daemon's clients are told too, not only the daemon's log.
    """
    notices = manifest.extra.get(LISTING_NOTICES)
    return [str(notice) for notice in notices] if isinstance(notices, list) else []


def _this_user() -> str:
    """``uid 1003 (datacache, this process's user)``: a daemon's refusal reaches its client, whose uid is another."""
    uid = os.geteuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid} (this process's user)"
    return f"uid {uid} ({name}, this process's user)"


def missing_local_path(url: str) -> ShardNotFoundError | None:
    """The error for a local path (or ``file://`` URL) that does not exist; None for any other URL.

    One wording wherever a dataset or a source is refused for it (``datacache warm``, ``datacache
    shard``, ``CachedIterableDataset``): ``/data/raw: no such file or directory``.
    """
    scheme, rest = split_scheme(url)
    if scheme != "file":
        return None
    path = os.path.expanduser(rest)
    denied = ShardNotFoundError(f"{redact_url(url)}: permission denied to {_this_user()}")
    try:
        found = os.stat(path)
    except PermissionError:  # a trial's daemon said "no such file" of a user's 0700 home it may not enter
        return denied
    except (FileNotFoundError, NotADirectoryError):
        return ShardNotFoundError(f"{redact_url(url)}: no such file or directory")
    except OSError:
        return None
    if stat.S_ISDIR(found.st_mode) and not os.access(path, os.R_OK | os.X_OK):
        return denied  # listed as empty, which said "no objects under"
    return None


def _nothing_listed(dataset: DatasetConfig, origin: Tier) -> ShardNotFoundError:
    """The error for an origin that lists no object, with a hint when the URL is a glob."""
    glob = glob_hint(dataset.url)
    if glob is not None:
        return GlobURLError(f"{_named(dataset)}{glob}")
    missing = missing_local_path(dataset.url)
    if missing is not None:
        return missing
    return ShardNotFoundError(
        f"{_named(dataset)}no objects under {origin.url} (the prefix or directory is empty or does not exist)"
    )


async def _from_written_manifest(dataset: DatasetConfig, origin: Tier, by_key: dict[str, ObjectInfo]) -> Manifest:
    """The manifest ``datacache shard`` wrote at the origin, each shard checked against the listing."""
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
                f"{_named(dataset)}{origin.url}/{MANIFEST_NAME} names {shard.key!r} "
                f"({shard.size} bytes) but the origin {'lacks it' if found is None else f'has {found.size} bytes'}"
            )
        shards.append(Shard(shard.key, shard.size, found.version, shard.checksum, shard.samples))
    return Manifest(
        dataset=dataset.id, url=dataset.url, format=written.format, shards=tuple(shards), extra=written.extra
    )


def _from_listing(
    dataset: DatasetConfig, origin: Tier, infos: list[ObjectInfo], by_key: dict[str, ObjectInfo]
) -> Manifest:
    """The manifest of the listed files of the dataset's format (configured, or else detected)."""
    fmt = ShardFormat(dataset.format) if dataset.format else detect_format(by_key)
    kind = get_format(fmt.value)
    chosen = kind.shard_keys(infos)
    notices = [] if dataset.format else _what_is_left_out(dataset, origin.url, kind, infos)
    for notice in notices:
        logger.warning("%s", notice)
    if not chosen:
        raise ShardNotFoundError(f"{_named(dataset)}no {fmt.value} files at {origin.url}")
    for info in chosen:
        # Object stores allow keys such as "a/../../x" or "a//b"; none may become a path.
        try:
            validate_key(info.key)
        except InvalidKeyError as exc:
            raise InvalidKeyError(f"{_named(dataset)}refusing to cache {origin.url}: object {exc}") from None
    return Manifest(
        dataset=dataset.id,
        url=dataset.url,
        format=fmt,
        shards=tuple(Shard(info.key, info.size, info.version) for info in chosen),
        extra=kind.manifest_extra(infos) | ({LISTING_NOTICES: notices} if notices else {}),
    )


async def take_manifest(
    dataset: DatasetConfig,
    origin: Tier,
    *,
    parent: Tier | None = None,
    bounds: ListingBounds | None = None,
    time_limit: float | None = None,
) -> Manifest:
    """List ``origin`` once and return the dataset's manifest.

    If the origin holds a ``datacache-manifest.json`` (written by ``datacache
    shard``) it is used, after checking that every shard it names exists with
    the recorded size. With ``parent`` (the tier of the URL's parent), a URL
    that names one object is a dataset of that one shard. Raises
    `ShardNotFoundError` for a missing or empty bucket or prefix, and
    `ListingTooLargeError` past ``bounds`` (entries of a wids index too) or ``time_limit`` seconds.
    """
    bounds = bounds or ListingBounds()
    if time_limit is None:
        return await _take_manifest(dataset, origin, parent, bounds)
    try:
        async with asyncio.timeout(time_limit):
            return await _take_manifest(dataset, origin, parent, bounds)
    except TimeoutError:
        raise ListingTooLargeError(
            f"{_named(dataset)}listing {redact_url(dataset.url)} took longer than {time_limit:g}s, this node's "
            "bound (listing_timeout; raise it in the config file's [staging] table or with DATACACHE_LISTING_TIMEOUT)"
        ) from None


async def _take_manifest(dataset: DatasetConfig, origin: Tier, parent: Tier | None, bounds: ListingBounds) -> Manifest:
    started = time.monotonic()
    try:
        infos = [info async for info in origin.list()]
    except (OriginError, ShardNotFoundError):
        glob = glob_hint(dataset.url)
        if glob is None:
            raise
        # A glob names nothing here whatever the origin says: a trial was told "no credentials
        # found" first, and after setting them, that the glob was the mistake.
        raise GlobURLError(f"{_named(dataset)}{glob}") from None
    if parent is not None and _lists_itself(dataset.url, infos):
        # Listing a URL that names an object yields that object under its full path.
        whole = await _single_object(dataset, parent, bounds)
        if whole is not None:
            return whole
    if not infos:
        raise _nothing_listed(dataset, origin)
    by_key = {info.key: info for info in infos}
    if MANIFEST_NAME in by_key:
        manifest = await _from_written_manifest(dataset, origin, by_key)
    else:
        manifest = _from_listing(dataset, origin, infos, by_key)
    logger.info(
        "listed %s: %d shards, %d bytes, format %s, in %.2fs",
        origin.url,
        len(manifest.shards),
        manifest.total_bytes,
        manifest.format.value,
        time.monotonic() - started,
    )
    return manifest
