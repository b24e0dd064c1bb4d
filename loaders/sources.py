"""What a dataset reads from: one source or several, as the user wrote them (no I/O, no torch).

`CachedIterableDataset` takes a URL, a configured name, a `DatasetConfig`, a
brace pattern (``s3://bucket/shard-{00000..00099}.tar``, expanded as the
``braceexpand`` package does), a `Source`, or a list of these (with
``weights=[...]``). `resolve_sources` turns that into `SourceSpec` values: one
dataset to open each, and, for shard files named one by one, the keys to read.

Shard files named by a pattern or a list are read through their directory's
dataset (the same dataset id, so the same cached copies, as the directory's
URL), filtered to the named keys: a pattern is never a dataset of its own.
A plain list's shard files are grouped by directory; every other entry of a
list is a source of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import braceexpand
from datacache.tiers import redact_url

from datacache.config import DatasetConfig
from datacache.errors import ConfigError
from datacache.formats import available_formats
from datacache.manifest import object_url

__all__ = ["Source", "SourceSpec", "names_a_shard", "names_shards", "reads_a_mix", "resolve_sources"]

def names_a_shard(url: str) -> bool:
    """Whether a plain list entry is taken as one shard file (a pattern's expansions always are).

    It is when a registered format says its shard files end so (`SampleFormat.names_a_shard`).
    """
    return any(fmt.names_a_shard(url) for fmt in available_formats())


@dataclass(frozen=True)
class Source:
    """One source of a mix: a dataset (URL, name, brace pattern or list of shard URLs) and its share.

    Parameters
    ----------
    dataset
        What `CachedIterableDataset` takes for one source.
    weight
        The source's proportion of each epoch (weights are normalised over the sources).
    repeat
        Samples per epoch as a multiple of the source's size (``2.0``: each sample twice; ``0.5``: half).
    choose
        Samples per epoch, a fixed count.

    At most one of ``weight``, ``repeat`` and ``choose``; with none, the source contributes its
    whole size once (``repeat=1``).
    """

    dataset: str | DatasetConfig | Sequence[str]
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("weight", "repeat", "choose") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ConfigError(f"Source({_label_of(self.dataset)}): give one of weight, repeat or choose, not {given}")
        for name in ("weight", "repeat"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
            ):
                raise ConfigError(
                    f"Source({_label_of(self.dataset)}): {name} must be a finite number >= 0, got {value!r}"
                )
        if self.choose is not None and (
            isinstance(self.choose, bool) or not isinstance(self.choose, int) or self.choose < 0
        ):
            raise ConfigError(f"Source({_label_of(self.dataset)}): choose must be an integer >= 0, got {self.choose!r}")


@dataclass(frozen=True)
class SourceSpec:
    """One source, resolved: the dataset to open, the shard keys to read (None: all), its share."""

    dataset: str | DatasetConfig
    keys: tuple[str, ...] | None
    label: str
    """How the user wrote it (credentials redacted): names the source in errors and `stats`."""
    weight: float | None = None
    repeat: float | None = None
    choose: int | None = None

    @property
    def mode(self) -> tuple[str, float]:
        """``("weight" | "repeat" | "choose", value)``; a source with none repeats once."""
        if self.weight is not None:
            return "weight", float(self.weight)
        if self.choose is not None:
            return "choose", float(self.choose)
        return "repeat", 1.0 if self.repeat is None else float(self.repeat)


Entry: TypeAlias = str | DatasetConfig | Source
Given: TypeAlias = str | DatasetConfig | Source | Sequence[Entry]


def resolve_sources(dataset: Given, weights: Sequence[float] | None = None) -> tuple[SourceSpec, ...]:
    """The sources ``dataset`` (and ``weights``) name, in order; a clear `ConfigError` for bad input."""
    return _check_modes(_resolve(dataset, weights))


def _check_modes(specs: tuple[SourceSpec, ...]) -> tuple[SourceSpec, ...]:
    """Refuse, when the dataset is made (not at its first len() or iter()), shares that cannot mix."""
    kinds = {spec.mode[0] for spec in specs}
    if "weight" in kinds and kinds != {"weight"}:
        raise ConfigError(
            "give every source a weight, or give none (each then uses repeat= or choose=, default repeat=1): "
            "weights and repeat/choose do not mix"
        )
    if "weight" in kinds and sum(spec.mode[1] for spec in specs) <= 0:
        raise ConfigError("every weight is zero: at least one source needs a positive weight")
    return specs


def _resolve(dataset: Given, weights: Sequence[float] | None) -> tuple[SourceSpec, ...]:
    if isinstance(dataset, str | DatasetConfig | Source):
        if weights is not None:
            raise ConfigError("weights= needs a list of sources, one weight each; this is one source")
        if isinstance(dataset, str) and "{" not in dataset and "}" not in dataset:
            return (SourceSpec(dataset, None, redact_url(dataset)),)  # a URL naming one object stays that object
        return _entry(dataset)
    if not isinstance(dataset, Sequence) or isinstance(dataset, bytes):
        raise ConfigError(
            f"expected a dataset: a URL, a configured name, a brace pattern, a Source, or a list of them; "
            f"got {type(dataset).__name__}"
        )
    entries = list(dataset)
    if not entries:
        raise ConfigError("the list of sources is empty")
    if weights is None:
        return _grouped(entries)
    weights = list(weights)
    if len(weights) != len(entries):
        raise ConfigError(f"weights= has {len(weights)} values for {len(entries)} sources; give one per source")
    specs: list[SourceSpec] = []
    for entry, weight in zip(entries, weights, strict=True):
        if isinstance(entry, Source):
            raise ConfigError(f"{_label_of(entry.dataset)} is a Source: give its weight as Source(..., weight=)")
        specs.extend(_entry(Source(entry, weight=weight)))
    return tuple(specs)


def _entry(entry: Entry) -> tuple[SourceSpec, ...]:
    """One entry: a Source is one source; a pattern may span directories (one source each)."""
    if isinstance(entry, Source):
        inner = entry.dataset
        if isinstance(inner, str | DatasetConfig):
            groups = _groups([inner], only_files=False)
        elif isinstance(inner, Sequence) and not isinstance(inner, bytes):
            groups = _groups(list(inner), only_files=True)
        else:
            raise ConfigError(f"Source(dataset=...) takes a URL, a name or a list of shard URLs, got {inner!r}")
        if len(groups) != 1:
            raise ConfigError(
                f"{_label_of(inner)} names shards in {len(groups)} directories: one Source reads one directory; "
                "give each directory a Source of its own"
            )
        spec = groups[0]
        return (SourceSpec(spec.dataset, spec.keys, spec.label, entry.weight, entry.repeat, entry.choose),)
    if not isinstance(entry, str | DatasetConfig):
        raise ConfigError(f"a source is a URL, a configured name, a DatasetConfig or a Source, got {entry!r}")
    return tuple(_groups([entry], only_files=False))


def _grouped(entries: list[Entry]) -> tuple[SourceSpec, ...]:
    """A plain list: shard files grouped by directory, every other entry a source of its own."""
    specs: list[SourceSpec] = []
    for entry in entries:
        if isinstance(entry, Source | DatasetConfig):
            specs.extend(_entry(entry))
        elif isinstance(entry, str):
            specs.extend(_groups([entry], only_files=False))
        else:
            raise ConfigError(f"a source is a URL, a configured name, a DatasetConfig or a Source, got {entry!r}")
    merged: list[SourceSpec] = []
    by_directory: dict[str, int] = {}
    for spec in specs:
        if spec.keys is None or not isinstance(spec.dataset, str):
            merged.append(spec)
            continue
        if spec.dataset not in by_directory:
            by_directory[spec.dataset] = len(merged)
            merged.append(spec)
            continue
        index = by_directory[spec.dataset]
        keys = _no_repeats((*(merged[index].keys or ()), *spec.keys), spec.dataset)
        merged[index] = SourceSpec(spec.dataset, keys, f"{redact_url(spec.dataset)} ({len(keys)} shards)")
    return tuple(merged)


def _groups(items: Sequence[str | DatasetConfig], *, only_files: bool) -> list[SourceSpec]:
    """Expand patterns; group shard files by directory (in order of first appearance)."""
    specs: list[SourceSpec] = []
    by_directory: dict[str, list[str]] = {}
    labels: dict[str, str] = {}
    for item in items:
        if isinstance(item, DatasetConfig):
            specs.append(SourceSpec(item, None, item.name))
            continue
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"expected a URL, a local path or a configured name, got {item!r}")
        pattern = "{" in item or "}" in item
        for url in expand(item):
            split = object_url(url)
            if split is None or not (pattern or only_files or names_a_shard(url)):
                if only_files:
                    raise ConfigError(f"{redact_url(url)} is not the URL of one shard file")
                specs.append(SourceSpec(url, None, redact_url(url)))
                continue
            directory = split[0] + "/"
            if directory not in by_directory:
                by_directory[directory] = []
                labels[directory] = redact_url(item)
                specs.append(SourceSpec(directory, (), labels[directory]))
            by_directory[directory].append(split[1])
    return [
        SourceSpec(s.dataset, _no_repeats(tuple(by_directory[s.dataset]), s.dataset), s.label)
        if s.keys is not None and isinstance(s.dataset, str)
        else s
        for s in specs
    ]


def expand(text: str) -> list[str]:
    """``text``'s brace expansion (``{a,b}``, ``{000..123}``), or ``[text]`` without braces."""
    if "{" not in text and "}" not in text:
        return [text]
    try:
        urls = list(braceexpand.braceexpand(text))
    except ValueError as exc:  # braceexpand's UnbalancedBracesError
        raise ConfigError(f"pattern {redact_url(text)!r}: {exc}") from None
    left = [url for url in urls if "{" in url or "}" in url]
    if left:
        raise ConfigError(
            f"pattern {redact_url(text)!r} leaves braces unexpanded in {redact_url(left[0])!r}: a pattern is "
            "{a,b,c} or {000..099} (a single {a} is not expanded)"
        )
    return urls


def _no_repeats(keys: tuple[str, ...], directory: str) -> tuple[str, ...]:
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ConfigError(f"shard {key!r} of {redact_url(directory)} is named twice")
        seen.add(key)
    return keys


def _label_of(dataset: object) -> str:
    if isinstance(dataset, DatasetConfig):
        return dataset.name
    if isinstance(dataset, str):
        return repr(redact_url(dataset))
    return repr(dataset)


def reads_a_mix(sources: tuple[SourceSpec, ...], drawn: bool) -> bool:
    """Whether the epochs are a mix's (`mix`): several sources, a drawn epoch, or a source repeated or chosen."""
    return len(sources) > 1 or drawn or any(spec.mode != ("repeat", 1.0) for spec in sources)


def names_shards(spec: SourceSpec) -> bool:
    """Whether ``spec`` names shards that may not exist: keys of a pattern or list, or a glob's last segment."""
    if spec.keys is not None:
        return True
    return isinstance(spec.dataset, str) and any(char in spec.dataset.rstrip("/").rsplit("/", 1)[-1] for char in "*?[")
