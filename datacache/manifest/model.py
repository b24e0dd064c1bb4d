"""A manifest and its shards: the snapshot of a dataset every epoch reads from, and its JSON form."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from datacache.errors import ConfigError, ShardNotFoundError
from datacache.format_registry import format_names, get_format
from datacache.manifest.columns import ShardTable
from datacache.manifest.shard import Shard
from datacache.tiers import redact_url

__all__ = [
    "MANIFEST_NAME",
    "PARQUET_MAX_ROWS_PER_BYTE",
    "TAR_BLOCK",
    "Manifest",
    "Shard",
    "ShardFormat",
    "max_samples",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "datacache-manifest.json"
"""The file ``datacache shard`` writes at the root of its output."""

_FORMAT_VERSION = 1

_SHARDS_FORMS = (
    "expected START:STOP[:STEP] with integer indexes (e.g. 0:100, 100:, ::8), "
    "N (one index), or shard keys (a.tar,b.tar)"
)
"""What a ``--shards`` spec may be, said when one is none of them."""


class FormatName(StrEnum):
    """A format's name in the registry (`datacache.formats`): every registered name is a member.

    The built-in and installed formats are members from the start; one added later with
    `datacache.formats.register_format` becomes one when first named.
    """

    @classmethod
    def _missing_(cls, value: object) -> FormatName | None:
        if not isinstance(value, str) or value not in format_names():
            return None
        # Enum has no public way to add a member; this is what its own metaclass does per member.
        member = str.__new__(cls, value)
        member._name_ = value.upper()
        member._value_ = value
        cls._value2member_map_.setdefault(value, member)
        return cast("FormatName", cls._value2member_map_[value])


if TYPE_CHECKING:
    ShardFormat = FormatName  # which names exist is known only when the registry is read
else:
    ShardFormat = FormatName("ShardFormat", [(name.upper(), name) for name in format_names()])
    ShardFormat.__doc__ = "How the samples of a dataset are laid out in its files: a format of `datacache.formats`."


TAR_BLOCK = 512
"""A tar member takes one header block at least: a tar of N bytes holds at most N // 512 samples."""
PARQUET_MAX_ROWS_PER_BYTE = 1024
"""Parquet encodes a constant column in almost nothing (5M rows in 22 KB); more than this is a lie."""


def max_samples(fmt: ShardFormat, size: int) -> int | None:
    """The most samples ``size`` bytes of ``fmt`` can hold (None: no bound from the bytes alone).

    A declared count above it is not backed by bytes: trusting it would let a
    small file make every reader allocate for billions of samples. Each format says (`SampleFormat.max_samples`).
    """
    return get_format(fmt.value).max_samples(size)


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
    """A dataset's shards at one moment; an epoch reads one manifest, never two.

    ``shards`` may be given as any sequence of `Shard`; it is held as a `ShardTable` (columns,
    each `Shard` made on access), so that 1e6 shards cost their bytes, not 1e6 objects.
    """

    dataset: str
    url: str
    format: ShardFormat
    shards: Sequence[Shard]
    created: float = field(default_factory=time.time)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_shards(self.shards))

    @property
    def table(self) -> ShardTable:
        """The shards as columns (`ShardTable.sizes`, `ShardTable.samples`, lookups by key)."""
        return cast(ShardTable, self.shards)

    @cached_property
    def snapshot(self) -> str:
        """A digest of every shard's key, size and version: equal snapshots, equal data."""
        digest = hashlib.sha256()
        for shard in self.shards:
            digest.update(f"{shard.key}\0{shard.size}\0{shard.version}\n".encode())
        # The sample indexes listed beside the shards (`datacache index` writes one): a refresh that
        # finds a new or changed one is a new snapshot, whose counts come from it. None listed: the
        # digest of the shards alone, as before.
        candidates = self.extra.get("sidecar_candidates")
        if isinstance(candidates, list):
            for entry in candidates:
                digest.update(f"sidecar\0{json.dumps(entry, sort_keys=True)}\n".encode())
        return digest.hexdigest()[:16]

    def shard(self, key: str) -> Shard:
        """Return the shard ``key``; raise `ShardNotFoundError` naming the dataset if absent."""
        position = self.table.position(key)
        if position is None:
            raise ShardNotFoundError(f"dataset {self.dataset}: no shard {key!r} in its manifest")
        return self.table[position]

    def named(self, keys: Sequence[str], *, label: str, url: str) -> tuple[Shard, ...]:
        """The shards ``keys`` (in that order) that ``label``, a pattern or list the user gave, names.

        A missing one is an error naming ``label``, as the user wrote it, not the first
        expanded name: the loader and ``datacache warm`` say the same.
        """
        missing = [key for key in keys if key not in self]
        where = f"{redact_url(url)} (dataset {self.dataset})"
        if keys and len(missing) == len(keys):
            raise ShardNotFoundError(f"{label} matches no shard of {where}; the names it gives start with {keys[0]!r}")
        if missing:
            raise ShardNotFoundError(
                f"{label}: {len(missing)} of its {len(keys)} shards are not in {where}, the first {missing[0]!r}"
            )
        return tuple(self.shard(key) for key in keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.table.position(key) is not None

    @property
    def total_bytes(self) -> int:
        return int(self.table.sizes.sum())

    @property
    def total_samples(self) -> int | None:
        """Sum of the sample counts, or ``None`` if any shard's count is unknown."""
        counts = self.table.samples
        if len(counts) and int(counts.min()) < 0:
            return None
        return int(counts.sum())

    def select(self, spec: str | None) -> list[Shard]:
        """Return the shards a ``--shards`` spec names: ``"0:10"`` (indexes), ``"a.tar,b.tar"`` (keys) or all."""
        if not spec:
            return list(self.shards)
        if ":" in spec and all(part.strip().lstrip("-").isdigit() or not part.strip() for part in spec.split(":")):
            parts = [int(p) if p.strip() else None for p in spec.split(":")]
            if len(parts) > 3:
                raise ConfigError(f"--shards {spec!r}: {_SHARDS_FORMS}")
            return list(self.shards[slice(*parts)])
        selected = []
        for key in (k.strip() for k in spec.split(",")):
            if key:
                selected.append(self._shard_or_index(key, spec))
        return selected

    def _shard_or_index(self, key: str, spec: str) -> Shard:
        """The shard named ``key``; a bare number that names no shard is an index (``--shards 3``)."""
        if ":" in key and key not in self:
            # Not a key of the dataset: most likely a range with a typo (`2:x`), so say what a range is.
            raise ConfigError(f"--shards {spec!r}: {key!r} is no shard key of the dataset; {_SHARDS_FORMS}")
        if key in self or not key.lstrip("-").isdigit():
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
