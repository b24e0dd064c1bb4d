"""Sample counts the ecosystem writes beside tar shards, read before anything is scanned.

A dataset of WebDataset tar shards usually comes with its sample counts in
one of these files, which this module reads (pure parsers, plus one function
that fetches them from the origin):

- the **wids** shard index: a JSON document with ``"__kind__":
  "wids-shard-index-v1"`` and a ``shardlist`` of ``{url, nsamples, filesize}``
  (``url`` relative to the index's folder, or to its ``base_path``);
- **open_clip**'s ``sizes.json`` (shard basename -> samples) and its ``__len__``
  (the dataset's total, which then checks the sum);
- **img2dataset**'s ``<shard>_stats.json`` beside ``<shard>.tar`` (``successes``
  is the number of samples written);
- **DALI**'s ``wds2idx`` index, ``<shard>.idx``: a first line ``v1.x <samples>``
  and one line per sample with each field's extension, offset and size;
- datacache's own ``<shard>.idx.json`` (written by ``datacache shard``).

Nothing read here is trusted on its own: an entry whose recorded file size
differs from the shard's is dropped as stale, two sources that disagree on a
shard make its count unknown (it is scanned instead), and every count is
checked again when the shard is read (`datacache.loaders.shardfiles.TarReader`
raises naming the source). A wrong count is reported, never served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import posixpath
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datacache.counting.tarindex import INDEX_SUFFIX, index_from_json
from datacache.errors import DatacacheError, ShardReadError
from datacache.manifest import Manifest, Shard
from datacache.manifest.wids import WIDS_KIND
from datacache.tiers import ObjectInfo, Tier

__all__ = [
    "WIDS_KIND",
    "KnownCount",
    "parse_dali_index",
    "parse_open_clip_sizes",
    "parse_stats_json",
    "parse_wids_index",
    "read_sidecar_counts",
    "wids_index",
]

logger = logging.getLogger(__name__)

MAX_SIDECAR_BYTES = 64 << 20
"""Largest index document read (a wids index of a million shards is ~100 MB; past this, scan)."""
_MAX_JSON_CANDIDATES = 64
"""JSON files at most opened to look for a wids index (each is one GET)."""

# The sources, most exact first: one that records every sample's offsets beats one that records a number.
_RANK = {"datacache index": 0, "DALI index": 1, "wids index": 2, "img2dataset stats": 3, "open_clip sizes.json": 4}


@dataclass(frozen=True, slots=True)
class KnownCount:
    """A shard's sample count and where it was read (named in the error if the shard disagrees)."""

    samples: int
    source: str


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _load_json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ShardReadError(f"{where}: not valid JSON ({exc})") from None


def _relative(url: str, base: str) -> str | None:
    """A shard URL from an index, as a key under the dataset; None if it points elsewhere."""
    if "://" in url:
        scheme_path = url.split("://", 1)[1]
        return None if not scheme_path else _relative_path(scheme_path, base, absolute=True)
    return _relative_path(url, base, absolute=url.startswith("/"))


def _relative_path(path: str, base: str, *, absolute: bool) -> str | None:
    if absolute:
        return None  # resolved by basename below
    joined = posixpath.normpath(posixpath.join(base, path)) if base else posixpath.normpath(path)
    if joined.startswith("../") or joined in ("..", "."):
        return None
    return joined


def parse_wids_index(
    raw: bytes, *, index_key: str, shards: Collection[str], where: str
) -> dict[str, tuple[int, int | None]]:
    """Counts from a wids shard index: shard key -> (nsamples, filesize or None).

    ``index_key`` is the index's own key in the dataset (its folder is where
    relative shard URLs start). A URL with a scheme, or an absolute path, is
    matched to a shard by the part after the dataset's folder, else by basename
    when that is unique. Raises `ShardReadError` if the document is not a wids
    index; skips entries that name no shard of the dataset.
    """
    document = _load_json(raw, where)
    if not isinstance(document, dict) or document.get("__kind__") != WIDS_KIND:
        raise ShardReadError(f"{where}: not a wids shard index (no __kind__ {WIDS_KIND!r})")
    entries = document.get("shardlist")
    if not isinstance(entries, list):
        raise ShardReadError(f"{where}: a wids index needs a 'shardlist' list")
    folder = posixpath.dirname(index_key)
    base_path = document.get("base_path")
    if isinstance(base_path, str) and base_path and "://" not in base_path and not base_path.startswith("/"):
        folder = posixpath.normpath(posixpath.join(folder, base_path)) if folder else base_path
    by_basename: dict[str, list[str]] | None = None  # made at the first URL that is no key as it stands
    counts: dict[str, tuple[int, int | None]] = {}
    named: set[str] = set()
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise ShardReadError(f"{where}: a shardlist entry needs a string 'url'")
        samples = _count(entry.get("nsamples"))
        if samples is None:
            raise ShardReadError(f"{where}: shard {entry['url']!r}: nsamples must be a non-negative integer")
        size = _count(entry.get("filesize"))
        found = _relative(entry["url"], folder)
        if found not in shards:
            if by_basename is None:
                by_basename = {}
                for key in shards:
                    by_basename.setdefault(posixpath.basename(key), []).append(key)
            candidates = by_basename.get(posixpath.basename(entry["url"]), [])
            found = candidates[0] if len(candidates) == 1 else None
        if found is not None:
            if found in named:
                raise ShardReadError(f"{where}: the wids index lists shard {entry['url']!r} twice")
            named.add(found)
            counts[found] = (samples, size)
    return counts


def parse_open_clip_sizes(raw: bytes, *, where: str) -> dict[str, int]:
    """open_clip's ``sizes.json``: shard basename -> samples."""
    document = _load_json(raw, where)
    if not isinstance(document, dict):
        raise ShardReadError(f"{where}: sizes.json must map shard names to sample counts")
    counts: dict[str, int] = {}
    for name, value in document.items():
        samples = _count(value)
        if samples is None:
            raise ShardReadError(f"{where}: shard {name!r}: the count must be a non-negative integer")
        counts[posixpath.basename(str(name))] = samples
    return counts


def parse_stats_json(raw: bytes, *, where: str) -> int:
    """img2dataset's ``<shard>_stats.json``: the samples written to the shard (``successes``)."""
    document = _load_json(raw, where)
    samples = _count(document.get("successes")) if isinstance(document, dict) else None
    if samples is None:
        raise ShardReadError(f"{where}: an img2dataset stats file needs a non-negative integer 'successes'")
    return samples


def parse_dali_index(raw: bytes, *, shard_size: int, where: str) -> int:
    """DALI's ``wds2idx`` index of one shard: its sample count, checked against its own lines.

    The first line is ``v1.<minor> <samples>`` (older indexes: the number
    alone); each further line is one sample, groups of extension, offset,
    size (and, from v1.2, the member name). The line count must match, and
    every field must lie inside the shard.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ShardReadError(f"{where}: a DALI index is text") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise ShardReadError(f"{where}: empty DALI index")
    head = lines[0].split()
    version = head[0] if len(head) == 2 and head[0].startswith("v1.") else None
    try:
        samples = int(head[-1]) if (version is not None or len(head) == 1) else -1
    except ValueError:
        samples = -1
    if samples < 0:
        raise ShardReadError(f"{where}: not a DALI index (first line {lines[0][:40]!r})")
    if len(lines) - 1 != samples:
        raise ShardReadError(f"{where}: says {samples} samples but lists {len(lines) - 1}")
    minor = int(version[3:]) if version is not None and version[3:].isdigit() else 0
    group = 4 if minor >= 2 else 3
    for number, line in enumerate(lines[1:], start=2):
        parts = line.split()
        try:
            fields = [(int(parts[i + 1]), int(parts[i + 2])) for i in range(0, len(parts) - group + 1, group)]
        except (ValueError, IndexError):
            fields = []
        if not fields or len(parts) % group or any(o < 0 or n < 0 or o + n > shard_size for o, n in fields):
            raise ShardReadError(f"{where}: line {number} is not a sample inside the shard")
    return samples


def wids_index(manifest: Manifest, counts: Mapping[str, int], *, name: str) -> bytes:
    """A wids shard index of ``manifest``'s shards (URLs relative to the dataset's folder)."""
    document = {
        "__kind__": WIDS_KIND,
        "wids_version": 1,
        "name": name,
        "shardlist": [
            {"url": shard.key, "nsamples": counts[shard.key], "filesize": shard.size}
            for shard in manifest.shards
            if shard.key in counts
        ],
    }
    return json.dumps(document, indent=1).encode()


def _rank(vote: KnownCount) -> int:
    return next((rank for label, rank in _RANK.items() if vote.source.startswith(label)), len(_RANK))


def _stem(key: str) -> str:
    """``a/b.tar`` -> ``a/b`` (a tar's name without its extension, as img2dataset and DALI name sidecars)."""
    return key[: -len(".tar")] if key.endswith(".tar") else key


def _dali_key(key: str) -> str:
    """The index path ``wds2idx`` picks for a shard: the name up to its first dot (after one character)."""
    folder, name = posixpath.split(key)
    dot = name.find(".", 1)
    stem = name[:dot] if dot > 0 else name
    return posixpath.join(folder, stem + ".idx") if folder else stem + ".idx"


class _Votes:
    """Counts per shard from every source; agreement keeps one, disagreement drops the shard."""

    def __init__(self, positions: Mapping[str, int], sizes: Sequence[int]) -> None:
        # The manifest's key -> position and its size column, no `Shard` a shard (1e5 of them were
        # made three times over before a first sample).
        self._positions = positions
        self._sizes = sizes
        self._votes: dict[str, list[KnownCount]] = {}

    def add(self, key: str, samples: int, source: str, *, filesize: int | None = None) -> None:
        position = self._positions.get(key)
        if position is None:
            return
        size = self._sizes[position]
        if samples == 0 and size > 0:
            # Taken on its word, a 0 would drop the shard from every epoch without a word: an
            # index is any writer's file. An empty shard is cheap to count; so it is counted.
            logger.warning("%s: shard %r of %d bytes is listed with 0 samples; counting it", source, key, size)
            return
        if filesize is not None and filesize != size:
            logger.warning(
                "%s: shard %r is %d bytes, the index recorded %d: the index is stale; ignoring its count",
                source,
                key,
                size,
                filesize,
            )
            return
        self._votes.setdefault(key, []).append(KnownCount(samples, source))

    def result(self, *, warn: bool = True) -> dict[str, KnownCount]:
        chosen: dict[str, KnownCount] = {}
        for key, votes in self._votes.items():
            if len(votes) == 1:
                chosen[key] = votes[0]
                continue
            if len({vote.samples for vote in votes}) > 1:
                if not warn:
                    continue
                said = ", ".join(f"{vote.source} says {vote.samples}" for vote in votes)
                logger.warning("shard %r: its sample indexes disagree (%s); it will be scanned", key, said)
                continue
            chosen[key] = min(votes, key=_rank)
        return chosen


async def read_sidecar_counts(
    origin: Tier, manifest: Manifest, listing: Sequence[ObjectInfo], *, concurrency: int = 16
) -> dict[str, KnownCount]:
    """The sample counts the sidecar files in ``listing`` give for ``manifest``'s tar shards.

    Whole-dataset indexes (wids, ``sizes.json``) are read first; per-shard files
    (img2dataset stats, DALI indexes, ``.idx.json``) only for shards still
    unknown. A sidecar that cannot be read or parsed is logged and skipped: the
    shards it would have counted are scanned instead.
    """
    table = manifest.table
    shards = dict(zip(table.keys(), range(len(table)), strict=True))  # key -> position
    present = {info.key: info for info in listing}
    votes = _Votes(shards, table.sizes.tolist())
    gate = asyncio.Semaphore(concurrency)

    async def fetch(key: str) -> bytes | None:
        info = present.get(key)
        if info is None or info.size > MAX_SIDECAR_BYTES:
            return None
        async with gate:
            try:
                return await origin.get(key)
            except (DatacacheError, OSError) as exc:
                logger.warning("%s/%s: cannot read this sample index (%s); ignoring it", origin.url, key, exc)
                return None

    await _read_whole_dataset_indexes(origin.url, present, shards, votes, fetch)
    known = votes.result(warn=False)
    # Only shards with a per-shard index beside them in the listing: one coroutine per shard of a
    # 1e5-shard dataset without any (the usual case) took seconds before the first sample.
    missing = [key for key in shards if key not in known and any(name in present for name in _per_shard_names(key))]
    await asyncio.gather(*(_read_per_shard(origin.url, table[shards[key]], present, votes, fetch) for key in missing))
    return votes.result()


async def _read_whole_dataset_indexes(
    url: str, present: Mapping[str, ObjectInfo], shards: Mapping[str, int], votes: _Votes, fetch: Any
) -> None:
    json_keys = [
        key
        for key in present
        if key.endswith(".json")
        and not key.endswith(("_stats.json", INDEX_SUFFIX, "datacache-manifest.json"))
        and posixpath.basename(key) != "sizes.json"
    ]
    for key in json_keys[:_MAX_JSON_CANDIDATES]:
        raw = await fetch(key)
        if raw is None or b"__kind__" not in raw[:4096]:
            continue
        try:
            counts = parse_wids_index(raw, index_key=key, shards=shards, where=f"{url}/{key}")
        except ShardReadError as exc:
            logger.debug("%s", exc)
            continue
        for shard_key, (samples, size) in counts.items():
            votes.add(shard_key, samples, f"wids index {url}/{key}", filesize=size)
    by_folder: dict[str, list[str]] = {}
    for key in shards:
        by_folder.setdefault(posixpath.dirname(key), []).append(key)
    for folder, keys in by_folder.items():
        await _read_open_clip(url, folder, keys, present, votes, fetch)


async def _read_open_clip(
    url: str, folder: str, keys: Iterable[str], present: Mapping[str, ObjectInfo], votes: _Votes, fetch: Any
) -> None:
    sizes_key = posixpath.join(folder, "sizes.json") if folder else "sizes.json"
    raw = await fetch(sizes_key)
    if raw is None:
        return
    where = f"{url}/{sizes_key}"
    try:
        sizes = parse_open_clip_sizes(raw, where=where)
    except ShardReadError as exc:
        logger.warning("%s; ignoring it", exc)
        return
    found = {key: sizes[posixpath.basename(key)] for key in keys if posixpath.basename(key) in sizes}
    length_key = posixpath.join(folder, "__len__") if folder else "__len__"
    length_raw = await fetch(length_key)
    if length_raw is not None and len(found) == len(sizes):
        try:
            total = int(length_raw.decode().strip())
        except (UnicodeDecodeError, ValueError):
            total = -1
        if total != sum(sizes.values()):
            logger.warning(
                "%s: its counts add up to %d, %s/%s says %s; ignoring both",
                where,
                sum(sizes.values()),
                url,
                length_key,
                length_raw[:40].decode("utf-8", "replace").strip(),
            )
            return
    for key, samples in found.items():
        votes.add(key, samples, f"open_clip sizes.json {where}")


def _per_shard_names(key: str) -> tuple[str, str, str]:
    """The per-shard sample indexes of shard ``key``: datacache's, DALI's, img2dataset's stats."""
    return key + INDEX_SUFFIX, _dali_key(key), _stem(key) + "_stats.json"


async def _read_per_shard(url: str, shard: Shard, present: Mapping[str, ObjectInfo], votes: _Votes, fetch: Any) -> None:
    key = shard.key
    ours, dali, stats = _per_shard_names(key)
    parsers: list[tuple[str, str, Any]] = [
        (ours, "datacache index", lambda raw, where: len(_datacache_spans(raw, shard, where))),
        (dali, "DALI index", lambda raw, where: parse_dali_index(raw, shard_size=shard.size, where=where)),
        (stats, "img2dataset stats", lambda raw, where: parse_stats_json(raw, where=where)),
    ]
    for sidecar, label, parse in parsers:
        if sidecar not in present:
            continue
        raw = await fetch(sidecar)
        if raw is None:
            continue
        where = f"{url}/{sidecar}"
        try:
            votes.add(key, parse(raw, where), f"{label} {where}")
        except ShardReadError as exc:
            logger.warning("%s; ignoring it", exc)


def _datacache_spans(raw: bytes, shard: Shard, where: str) -> list[Any]:
    size, spans = index_from_json(raw, where=where)
    if size != shard.size:
        raise ShardReadError(f"{where}: indexes a {size}-byte shard, the shard is {shard.size} bytes (stale)")
    return spans
