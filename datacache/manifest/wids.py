"""A dataset named by its wids shard index: the shards the index lists, read beside it.

An origin with no listing (an http(s) server without index pages) can still name its
shards: webdataset's wids index (``"__kind__": "wids-shard-index-v1"``, a ``shardlist``
of ``{url, nsamples, filesize}``) lists them, with their sample counts. A dataset URL
that names such a JSON object is the dataset of those shards. Each shard's URL is
relative to the index's folder (``base_path`` too), or a full URL under that folder; a
shard elsewhere is refused, so that every key stays inside the folder the dataset reads.
The index is kept as the manifest's only sidecar, so the counts it gives are used as
every other sample index's are (``datacache.counting.sidecars``).
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import re
from typing import Any

from datacache.config import DatasetConfig
from datacache.errors import ConfigError, InvalidKeyError, ShardNotFoundError
from datacache.manifest.model import Manifest, Shard, ShardFormat
from datacache.tiers import ListingBounds, ObjectInfo, Tier, redact_url, validate_url_key

__all__ = ["WIDS_KIND", "wids_manifest"]

WIDS_KIND = "wids-shard-index-v1"
_MAX_INDEX_BYTES = 256 << 20
"""A wids index of a million shards is ~100 MB; a larger JSON object is not taken for one."""
_STATS_AT_ONCE = 16
_ESCAPED_STEP = re.compile(r"%(2e|2f|5c)", re.IGNORECASE)
"""An escaped '.', '/' or '\\': a server decodes them before it resolves the path."""


async def wids_manifest(
    dataset: DatasetConfig,
    parent: Tier,
    name: str,
    info: ObjectInfo,
    *,
    extra: dict[str, Any],
    bounds: ListingBounds | None = None,
) -> Manifest | None:
    """The manifest of the shards the wids index ``name`` (a key of ``parent``) lists; None if it is not one.

    ``extra`` is the manifest's ``extra`` (the caller's marks: one object named, the index as sidecar).
    An index of more entries than ``bounds`` allows is refused before any is stat'ed.
    """
    if not name.endswith(".json") or info.size > _MAX_INDEX_BYTES:
        return None
    raw = await parent.get(name, version=info.version)
    if b"__kind__" not in raw[:4096]:
        return None
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(document, dict) or document.get("__kind__") != WIDS_KIND:
        return None
    where = redact_url(dataset.url)
    entries = document.get("shardlist")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: a wids index needs a non-empty 'shardlist'")
    bounds = bounds or ListingBounds()
    if len(entries) > bounds.max_entries:
        raise bounds.entries_error(dataset.url)
    folder = posixpath.dirname(name)
    base_path = document.get("base_path")
    if isinstance(base_path, str) and base_path and "://" not in base_path and not base_path.startswith("/"):
        _check_escapes(base_path, "its base_path", where)
        folder = posixpath.normpath(posixpath.join(folder, base_path))
    folder_url = dataset.url.rsplit("/", 1)[0]
    keys = [_key(entry, folder, folder_url, where) for entry in entries]
    _once_each(keys, entries, where)
    infos = await _stat_all(parent, keys, where, folder_url)
    fmt = ShardFormat(dataset.format or "tar")
    shards = tuple(Shard(key, found.size, found.version) for key, found in zip(keys, infos, strict=True))
    return Manifest(dataset=dataset.id, url=dataset.url, format=fmt, shards=shards, extra=dict(extra))


def _key(entry: Any, folder: str, folder_url: str, where: str) -> str:
    """The key (relative to the index's parent) of one shardlist entry's shard."""
    url = entry.get("url") if isinstance(entry, dict) else None
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{where}: every shardlist entry of a wids index needs a string 'url'")
    if "://" in url:
        if not url.startswith(folder_url + "/"):
            raise ConfigError(
                f"{where}: the wids index names {redact_url(url)}, outside its folder {redact_url(folder_url)}/; "
                "a shard must lie beside the index (a relative URL, or a URL under that folder)"
            )
        relative = url[len(folder_url) + 1 :]
        _check_escapes(relative, url, where)
    else:
        _check_escapes(url, url, where)
        relative = posixpath.join(folder, url) if folder else url
    key = posixpath.normpath(relative)
    try:
        return validate_url_key(key)
    except InvalidKeyError as exc:
        reason = str(exc).rpartition(": ")[2]
        raise ConfigError(
            f"{where}: the wids index names {redact_url(url)!r}, "
            f"outside its folder {redact_url(folder_url)}/ ({reason})"
        ) from None


def _check_escapes(part: str, what: str, where: str) -> None:
    """Refuse an escaped '.', '/' or '\\': checked encoded here, it would be fetched decoded (``%2e%2e/``)."""
    if _ESCAPED_STEP.search(part):
        raise ConfigError(
            f"{where}: the wids index names {redact_url(what)}, with an escaped '.', '/' or '\\' "
            "(%2e, %2f, %5c); an index must name its shards plainly, inside its folder"
        )


def _once_each(keys: list[str], entries: list[Any], where: str) -> None:
    """Refuse an index that lists a shard twice: each entry would be read, its samples counted, again."""
    seen: dict[str, int] = {}
    for number, key in enumerate(keys):
        first = seen.setdefault(key, number)
        if first != number:
            raise ConfigError(
                f"{where}: the wids index lists shard {key!r} twice (entries {first} and {number}, "
                f"url {redact_url(str(entries[number]['url']))!r}); each shard must be listed once"
            )


async def _stat_all(parent: Tier, keys: list[str], where: str, folder_url: str) -> list[ObjectInfo]:
    gate = asyncio.Semaphore(_STATS_AT_ONCE)

    async def stat(key: str) -> ObjectInfo:
        async with gate:
            found = await parent.stat(key)
        if found is None:
            raise ShardNotFoundError(f"{where}: the wids index lists {key!r}, which {redact_url(folder_url)}/ lacks")
        return found

    return list(await asyncio.gather(*(stat(key) for key in keys)))
