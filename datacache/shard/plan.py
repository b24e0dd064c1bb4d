"""The plan of ``datacache shard``: which inputs go into which output unit.

A plan is a pure function of the input listing (keys, sizes, versions) and the
options: the same listing and options give the same units, in the same order,
with the same digests, whichever engine runs them and however often the run
is interrupted. For tar shards every offset is known in advance (tar headers
are fixed: mtime 0, uid/gid 0, no user or group names, mode 0o644), so the
plan also holds each shard's exact size and its sample index.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from datacache.counting.tarindex import SampleSpan
from datacache.errors import ConfigError, InvalidKeyError
from datacache.tiers import ObjectInfo, validate_key

__all__ = [
    "DONE_PREFIX",
    "PLAN_NAME",
    "ParquetPayload",
    "RowGroupRef",
    "ShardOptions",
    "ShardPlan",
    "TarMemberPlan",
    "TarPayload",
    "UnitSpec",
    "ZarrPayload",
    "digest_of",
    "plan_tar",
    "tar_header",
]

PLAN_NAME = ".datacache-shard-plan.json"
"""The plan document ``datacache shard`` writes at the root of its output."""
DONE_PREFIX = ".datacache-shard-done/"
"""Where a record per finished unit (size, checksum) lives, under the output root."""

_BLOCK = 512
_END_OF_ARCHIVE = 2 * _BLOCK
_PLAN_VERSION = 1
_LABEL_FIELD = "cls"


@dataclass(frozen=True, slots=True)
class ShardOptions:
    """What shapes the output; every field is part of the plan's digest except the tuning ones.

    Parameters
    ----------
    shard_size
        Target size of a tar shard or Parquet file, in bytes. A shard is cut
        before the sample that would make it larger; a sample is never split.
    group_by
        A regular expression whose first group is a file's sample key;
        ``None`` uses the webdataset rule (the path up to the first dot of
        the file name).
    label
        A regular expression whose first group, searched in a sample's
        path, is its class; classes become indexes (sorted names) in a
        ``cls`` field.
    chunk_size
        Target uncompressed bytes of a Parquet row group or a Zarr chunk.
    prefix
        Name of the output shards: ``<prefix>-000000.tar``.
    workers
        Units packed at once (tuning; not part of the plan).
    concurrency
        GETs in flight per unit (tuning; not part of the plan).
    memory
        Bytes of input one unit may hold prefetched (tuning; not part of the plan).
    """

    shard_size: int = 256_000_000
    group_by: str | None = None
    label: str | None = None
    chunk_size: int = 32_000_000
    prefix: str = "shard"
    workers: int = 4
    concurrency: int = 16
    memory: int = 64 << 20

    def __post_init__(self) -> None:
        if self.shard_size <= 0 or self.chunk_size <= 0:
            raise ConfigError("--shard-size and --chunk-size must be positive")
        if self.workers <= 0 or self.concurrency <= 0 or self.memory <= 0:
            raise ConfigError("--workers and --concurrency must be positive")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", self.prefix):
            raise ConfigError(
                f"--prefix {self.prefix!r}: use letters, digits, '_' or '-' (no dots or slashes)"
            )
        for flag, pattern in (("--group-by", self.group_by), ("--label", self.label)):
            if pattern is None:
                continue
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ConfigError(
                    f"{flag} {pattern!r}: not a valid regular expression ({exc})"
                ) from None
            if compiled.groups < 1:
                raise ConfigError(f"{flag} {pattern!r}: needs a group, e.g. '^([^/]+)/'")

    def identity(self) -> dict[str, Any]:
        """The options that decide the output bytes (recorded in the plan and the manifest)."""
        return {
            "shard_size": self.shard_size,
            "group_by": self.group_by,
            "label": self.label,
            "chunk_size": self.chunk_size,
            "prefix": self.prefix,
        }


@dataclass(frozen=True, slots=True)
class TarMemberPlan:
    """One member of a planned tar shard: an input object, or inline bytes (a label)."""

    name: str
    size: int
    source: str | None = None
    version: str | None = None
    inline: bytes | None = None

    def describe(self) -> list[Any]:
        content = (
            self.inline.decode("utf-8", "surrogateescape") if self.inline is not None else None
        )
        return [self.name, self.size, self.source, self.version, content]


@dataclass(frozen=True, slots=True)
class TarPayload:
    """What a tar unit holds: its members in order and the sample index they form."""

    members: tuple[TarMemberPlan, ...]
    spans: tuple[SampleSpan, ...]


@dataclass(frozen=True, slots=True)
class RowGroupRef:
    """One row group of an input Parquet file."""

    key: str
    version: str | None
    index: int
    rows: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ParquetPayload:
    """An output Parquet file: its output row groups, each a run of input row groups."""

    row_groups: tuple[tuple[RowGroupRef, ...], ...]


@dataclass(frozen=True, slots=True)
class ZarrPayload:
    """One output Zarr chunk: rows ``[start, stop)`` along axis 0 of the source array."""

    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One independent piece of output work: a tar shard, a Parquet file, a Zarr chunk, ...

    ``payload`` is what the format's rechunker planned for it (`TarPayload`,
    `ParquetPayload`, `ZarrPayload`, or a new format's own value); only that
    rechunker reads it.

    ``size`` is exact for tar shards and ``None`` where only the writer knows
    it. ``digest`` changes whenever anything that decides the unit's bytes
    changes, so a finished unit whose record carries another digest is redone.
    """

    key: str
    kind: str
    digest: str
    size: int | None
    samples: int
    objects: int
    input_bytes: int
    payload: Any = field(repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "digest": self.digest,
            "size": self.size,
            "samples": self.samples,
            "objects": self.objects,
            "input_bytes": self.input_bytes,
        }


@dataclass(frozen=True)
class ShardPlan:
    """Every unit of one ``datacache shard`` run, and what decided them."""

    kind: str
    source: str
    options: ShardOptions
    units: tuple[UnitSpec, ...]
    objects: int
    input_bytes: int
    skipped: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """Digest of the whole plan: equal digests, equal output."""
        return digest_of(
            [self.kind, self.options.identity(), [unit.digest for unit in self.units], self.extra]
        )

    @property
    def samples(self) -> int:
        return sum(unit.samples for unit in self.units)

    def to_json(self) -> bytes:
        """The plan document written to the output (``.datacache-shard-plan.json``)."""
        document = {
            "format_version": _PLAN_VERSION,
            "kind": self.kind,
            "source": self.source,
            "options": self.options.identity(),
            "digest": self.digest,
            "objects": self.objects,
            "input_bytes": self.input_bytes,
            "samples": self.samples,
            "skipped_count": len(self.skipped),
            "skipped": list(self.skipped[:100]),
            "classes": list(self.classes),
            "extra": self.extra,
            "units": [unit.summary() for unit in self.units],
        }
        return json.dumps(document, indent=1, ensure_ascii=False).encode()


def digest_of(value: Any) -> str:
    """A stable digest of a JSON-able value."""
    encoded = json.dumps(value, separators=(",", ":"), ensure_ascii=False, sort_keys=True)
    return hashlib.sha256(encoded.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def tar_header(name: str, size: int) -> bytes:
    """The header blocks of a regular member: fixed fields, so equal inputs give equal bytes.

    Names over 100 bytes or outside ASCII get a pax ``path`` record, which
    GNU tar, Python's tarfile (hence webdataset) and `datacache.counting.tarindex` read.
    """
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _padded(size: int) -> int:
    return (size + _BLOCK - 1) // _BLOCK * _BLOCK


@dataclass(slots=True)
class _Sample:
    key: str
    files: list[tuple[str, str, ObjectInfo]]  # (field, extension as written, object)


def _checked_key(info: ObjectInfo) -> str:
    try:
        validate_key(info.key)
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"source object cannot be packed: {exc}") from None
    return info.key


def _split(path: str, group_by: re.Pattern[str] | None) -> tuple[str, str] | None:
    """Return (sample key, extension as written) for ``path``; ``None`` if it has no extension."""
    if group_by is None:
        match = re.match(r"^((?:.*/|)[^.]+)[.]([^/]*)$", path)
        if match is None:
            return None
        return match.group(1), match.group(2)
    found = group_by.search(path)
    if found is None or not found.group(1):
        raise ConfigError(
            f"--group-by {group_by.pattern!r} does not match {path!r} "
            "(its first group is the sample key)"
        )
    key = found.group(1).rstrip("/")
    extension = path[found.end(1) :].lstrip("._-/").replace("/", ".")
    if not key or not extension:
        raise ConfigError(
            f"--group-by {group_by.pattern!r}: {path!r} leaves no field name after the key {key!r}"
        )
    if "." in key.rsplit("/", 1)[-1]:
        raise ConfigError(
            f"--group-by {group_by.pattern!r}: key {key!r} of {path!r} has a dot in its last "
            "segment, "
            "which webdataset readers would split differently"
        )
    validate_key(key)
    return key, extension


def _group_samples(
    infos: Iterable[ObjectInfo], group_by: re.Pattern[str] | None
) -> tuple[dict[str, _Sample], list[str]]:
    """The samples the objects form, by key, and the objects without an extension (skipped)."""
    samples: dict[str, _Sample] = {}
    skipped: list[str] = []
    for info in sorted(infos, key=lambda i: i.key):
        path = _checked_key(info)
        split = _split(path, group_by)
        if split is None:
            skipped.append(path)
            continue
        key, extension = split
        sample = samples.setdefault(key, _Sample(key, []))
        field_name = extension.lower()
        if any(existing == field_name for existing, _, _ in sample.files):
            raise ConfigError(
                f"sample {key!r} has two files for field {field_name!r} (one is {path!r})"
            )
        sample.files.append((field_name, extension, info))
    return samples, skipped


def _labels(samples: dict[str, _Sample], label: str | None) -> dict[str, str]:
    """Each sample's class name, found by ``--label`` in the path of its first file."""
    if label is None:
        return {}
    pattern = re.compile(label)
    labels: dict[str, str] = {}
    for key, sample in samples.items():
        if any(name == _LABEL_FIELD for name, _, _ in sample.files):
            raise ConfigError(f"--label: sample {key!r} already has a {_LABEL_FIELD!r} field")
        first = sample.files[0][2].key
        found = pattern.search(first)
        if found is None or found.group(1) is None:
            raise ConfigError(f"--label {label!r} does not match {first!r}")
        labels[key] = found.group(1)
    return labels


class _TarUnits:
    """Tar shards filled sample by sample, each cut before the sample that would pass ``shard_size``."""

    def __init__(self, options: ShardOptions) -> None:
        self.options = options
        self.units: list[UnitSpec] = []
        self._start()

    def _start(self) -> None:
        self.members: list[TarMemberPlan] = []
        self.spans: list[SampleSpan] = []
        self.offset = 0
        self.objects = 0
        self.input_bytes = 0

    def add(self, key: str, planned: list[TarMemberPlan]) -> None:
        """Append one sample's members, cutting the shard first if they would not fit."""
        sample_bytes = sum(len(tar_header(m.name, m.size)) + _padded(m.size) for m in planned)
        if self.members and self.offset + sample_bytes + _END_OF_ARCHIVE > self.options.shard_size:
            self.cut()
        fields: list[tuple[str, int, int]] = []
        for member in planned:
            self.offset += len(tar_header(member.name, member.size))
            fields.append((member.name[len(key) + 1 :].lower(), self.offset, member.size))
            self.offset += _padded(member.size)
            if member.source is not None:
                self.objects += 1
                self.input_bytes += member.size
        self.members.extend(planned)
        self.spans.append(SampleSpan(key, tuple(fields)))

    def cut(self) -> None:
        """Close the shard being filled (if it holds anything) as the next unit."""
        if not self.members:
            return
        key = f"{self.options.prefix}-{len(self.units):06d}.tar"
        self.units.append(
            UnitSpec(
                key=key,
                kind="tar",
                digest=digest_of(["tar", key, [member.describe() for member in self.members]]),
                size=self.offset + _END_OF_ARCHIVE,
                samples=len(self.spans),
                objects=self.objects,
                input_bytes=self.input_bytes,
                payload=TarPayload(tuple(self.members), tuple(self.spans)),
            )
        )
        self._start()


def _members(sample: _Sample, label: bytes | None) -> list[TarMemberPlan]:
    """A sample's tar members: its files by field name, then its class index (``cls``) if labelled."""
    planned = [
        TarMemberPlan(f"{sample.key}.{extension}", info.size, info.key, info.version)
        for _, extension, info in sorted(sample.files, key=lambda f: (f[0], f[1]))
    ]
    if label is not None:
        planned.append(TarMemberPlan(f"{sample.key}.{_LABEL_FIELD}", len(label), inline=label))
    return planned


def plan_tar(infos: Iterable[ObjectInfo], options: ShardOptions, *, source: str = "") -> ShardPlan:
    """Group input objects into samples and samples into tar shards of about ``shard_size``.

    Pure: the result depends only on the listing (keys, sizes, versions) and
    ``options``, not on the listing's order. Objects without an extension
    (by the webdataset rule) are skipped and reported in ``skipped``.

    Raises
    ------
    InvalidKeyError
        A key with ``..``, ``.`` or empty segments, or otherwise unsafe.
    ConfigError
        ``--group-by`` or ``--label`` that does not match a path, or a field
        that occurs twice in one sample.
    """
    samples, skipped = _group_samples(infos, re.compile(options.group_by) if options.group_by else None)
    labels = _labels(samples, options.label)
    classes = tuple(sorted(set(labels.values())))
    class_index = {name: str(index).encode() for index, name in enumerate(classes)}
    shards = _TarUnits(options)
    for key in sorted(samples):
        label = class_index[labels[key]] if key in labels else None
        shards.add(key, _members(samples[key], label))
    shards.cut()
    units = shards.units
    return ShardPlan(
        kind="tar",
        source=source,
        options=options,
        units=tuple(units),
        objects=sum(unit.objects for unit in units),
        input_bytes=sum(unit.input_bytes for unit in units),
        skipped=tuple(skipped),
        classes=classes,
    )
