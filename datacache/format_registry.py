"""The format registry: each format's name and where its `SampleFormat` is, imported on first use.

A leaf (it imports no format, no settings, no manifest), so that the settings and the manifest can
name formats while the formats are written with both (`datacache.formats` re-exports all of it).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from datacache.errors import ConfigError

if TYPE_CHECKING:
    from datacache.formats._base import SampleFormat

__all__ = [
    "ENTRY_POINT_GROUP",
    "available_formats",
    "detect_format_name",
    "format_names",
    "get_format",
    "register_format",
]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "datacache.formats"
"""The entry point group a package names its formats in: ``name = "module:OBJECT"``."""

_BUILTIN: dict[str, str] = {
    "tar": "datacache.formats.tar:FORMAT",
    "parquet": "datacache.formats.parquet:FORMAT",
    "zarr": "datacache.formats.zarr:FORMAT",
    "files": "datacache.formats.files:FORMAT",
    "arrow": "datacache.formats.arrow:FORMAT",
}
"""The registry's list: format name -> where its `SampleFormat` is (imported when first asked for)."""

_registry: dict[str, str | SampleFormat] = dict(_BUILTIN)
_loaded: dict[str, SampleFormat] = {}
_lock = threading.Lock()
_entry_points_read = False


def _read_entry_points() -> None:
    """Add the installed packages' formats, once; a built-in name is never replaced by one."""
    global _entry_points_read  # noqa: PLW0603 - the registry is this module's state, read once
    with _lock:
        if _entry_points_read:
            return
        _entry_points_read = True
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if point.name in _BUILTIN:
                logger.warning("ignoring entry point %s = %s: a built-in format has that name", point.name, point.value)
                continue
            _registry.setdefault(point.name, point.value)


def register_format(name: str, fmt: str | SampleFormat, *, clobber: bool = False) -> None:
    """Add a format under ``name``: a `SampleFormat` or its import string (``"module:OBJECT"``).

    Raises `ConfigError` when ``name`` is taken, unless ``clobber``.
    """
    if not name or not name.replace("_", "").replace("-", "").isalnum() or name != name.lower():
        raise ConfigError(f"format name {name!r}: lower-case letters, digits, '-' or '_'")
    _read_entry_points()
    with _lock:
        if name in _registry and not clobber:
            raise ConfigError(f"format {name!r} is already registered (pass clobber=True to replace it)")
        _registry[name] = fmt
        _loaded.pop(name, None)


def format_names() -> tuple[str, ...]:
    """Every format's name, built-ins first, without importing any format module."""
    _read_entry_points()
    with _lock:
        return tuple(_registry)


def get_format(name: str) -> SampleFormat:
    """The format called ``name``, imported on first use; `ConfigError` naming the choices if unknown."""
    found = _loaded.get(name)
    if found is not None:
        return found
    _read_entry_points()
    with _lock:
        entry = _registry.get(name)
    if entry is None:
        raise ConfigError(f"unknown format {name!r} (choose from {', '.join(format_names())})")
    fmt = _import(name, entry) if isinstance(entry, str) else entry
    if fmt.name != name:
        raise ConfigError(f"format {name!r}: its object is named {fmt.name!r}")
    with _lock:
        _loaded[name] = fmt
    return fmt


def _import(name: str, target: str) -> SampleFormat:
    module, _, attribute = target.partition(":")
    try:
        found = importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"format {name!r}: cannot import {module} ({exc})") from None
    try:
        fmt: SampleFormat = getattr(found, attribute or "FORMAT")
    except AttributeError:
        raise ConfigError(f"format {name!r}: {module} has no {attribute or 'FORMAT'}") from None
    return fmt


def available_formats() -> list[SampleFormat]:
    """Every registered format, in detection order (`SampleFormat.priority`, then name).

    A third-party format that cannot be imported is left out with a warning: one broken
    package must not stop every dataset from being read. A built-in one is an error.
    """
    found = []
    for name in format_names():
        try:
            found.append(get_format(name))
        except ConfigError as exc:
            if name in _BUILTIN:
                raise
            logger.warning("leaving out format %s: %s", name, exc)
    return sorted(found, key=lambda fmt: (fmt.priority, fmt.name))


def detect_format_name(keys: Iterable[str]) -> str:
    """The one rule for what a listing holds: the first format, by priority, that claims any of its keys.

    Zarr metadata anywhere makes a Zarr store; else tar shards, then Parquet
    files, then a registered format's files; else plain files. Objects of
    another format beside the chosen one are left out (the lister says so).
    """
    keys = list(keys)
    for fmt in available_formats():
        if fmt.detect(keys):
            return fmt.name
    return "files"
