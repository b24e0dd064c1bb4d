"""How ``datacache shard`` re-chunks a format: the `Rechunker` a format names, found by format name.

A format that ``datacache shard`` can re-chunk names its rechunker in its
`SampleFormat.rechunker` class attribute, as an import string
(``"module:OBJECT"``), the way the format registry names formats: the format
module carries a name, never an import of this package, so
`datacache.formats` stays below `datacache.shard`. The object is imported on
first use (importing is cached by Python), in the process that plans and
in each one that packs: a Dask or Ray worker in another process finds a
third-party format through its entry point, not a ``register_format`` call
made in the driver. It plans a run (`Rechunker.plan`), packs one planned unit
(`Rechunker.pack`) and may add metadata files at the output root
(`Rechunker.root_files`).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence

from datacache.errors import ConfigError
from datacache.formats import available_formats, get_format
from datacache.shard.job import Endpoint, PackIO, ShardJob
from datacache.shard.plan import ShardOptions, ShardPlan, UnitSpec
from datacache.tiers import ObjectInfo, Tier

__all__ = ["FALLBACK", "Rechunker", "rechunker_for", "source_formats"]

FALLBACK = "files"
"""What ``datacache shard`` makes of a source whose detected format has no rechunker: every object packed."""

class Rechunker:
    """How ``datacache shard`` reads one source format and writes its units. Subclass it.

    A rechunker is a module-level object (it is imported by name in each
    Dask or Ray worker, so it holds no state of its own).
    """

    async def plan(
        self, source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions, shown: str
    ) -> ShardPlan:
        """Plan the run: a pure function of the listing ``infos`` (at ``shown``) and ``options``."""
        raise NotImplementedError

    async def pack(self, spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
        """Write the unit ``spec`` to ``io.dest``; return its (size, checksum)."""
        raise NotImplementedError

    async def kept(self, spec: UnitSpec, dest: Tier, size: int) -> None:
        """A unit from an earlier run was verified and kept: restore what belongs beside it."""
        return None

    def root_files(self, plan: ShardPlan) -> Mapping[str, bytes]:
        """Files written at the output root before the units, and listed first in the manifest."""
        return {}


def rechunker_for(name: str) -> Rechunker:
    """The rechunker of the format ``name``; `ConfigError` when that format cannot be re-chunked."""
    target = get_format(name).rechunker
    if target is None:
        raise ConfigError(f"--format {name!r}: datacache shard cannot re-chunk it")
    module, _, attribute = target.partition(":")
    try:
        rechunker: Rechunker = getattr(importlib.import_module(module), attribute or "RECHUNKER")
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"format {name!r}: cannot load its rechunker {target} ({exc})") from None
    return rechunker


def source_formats() -> tuple[str, ...]:
    """The formats ``datacache shard --format`` accepts besides ``auto``, sorted by name."""
    return tuple(sorted(fmt.name for fmt in available_formats() if fmt.rechunker is not None))
