"""Storage tiers: one small async protocol and its implementations.

`open_origin` turns a URL into the tier that reads it. Schemes resolve through
a lazy registry (import strings, each with an install hint) and then through
the ``datacache.tiers`` entry-point group, so a third party can add a backend
without touching this table. Anything fsspec itself knows is accepted too.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from datacache.tiers._directory import DirectoryTier
from datacache.tiers._files import device_free, redact_url, split_userinfo
from datacache.tiers._landing import Landing
from datacache.tiers._listing import ListingBounds, ListingTooLargeError
from datacache.tiers._retry import RetryPolicy, translate_error
from datacache.tiers.base import (
    ByteRange,
    Hasher,
    ObjectInfo,
    Tier,
    TierStats,
    TierUsage,
    validate_key,
    validate_url_key,
)
from datacache.tiers.local import LocalTier
from datacache.tiers.memory import MemoryTier
from datacache.tiers.object import CONFINE_REDIRECTS, ObjectTier
from datacache.tiers.shared import SharedTier

from datacache.errors import ConfigError, UnsupportedURLError, close_match

__all__ = [
    "CONFINE_REDIRECTS",
    "ByteRange",
    "DirectoryTier",
    "Hasher",
    "Landing",
    "ListingBounds",
    "ListingTooLargeError",
    "LocalTier",
    "MemoryTier",
    "ObjectInfo",
    "ObjectTier",
    "RetryPolicy",
    "SharedTier",
    "Tier",
    "TierStats",
    "TierUsage",
    "check_scheme",
    "check_scheme_case",
    "device_free",
    "glob_hint",
    "known_schemes",
    "open_origin",
    "redact_url",
    "slash_hint",
    "split_scheme",
    "split_userinfo",
    "translate_error",
    "validate_key",
    "validate_url_key",
]

_OBJECT_TIER = "datacache.tiers.object:ObjectTier"

# scheme -> (tier import string, module the backend needs, install hint)
_REGISTRY: dict[str, tuple[str, str | None, str]] = {
    "s3": (_OBJECT_TIER, "s3fs", "pip install s3fs"),
    "s3a": (_OBJECT_TIER, "s3fs", "pip install s3fs"),
    "gs": (_OBJECT_TIER, "gcsfs", "pip install 'datacache[gcs]'"),
    "gcs": (_OBJECT_TIER, "gcsfs", "pip install 'datacache[gcs]'"),
    "az": (_OBJECT_TIER, "adlfs", "pip install 'datacache[azure]'"),
    "abfs": (_OBJECT_TIER, "adlfs", "pip install 'datacache[azure]'"),
    "abfss": (_OBJECT_TIER, "adlfs", "pip install 'datacache[azure]'"),
    "file": (_OBJECT_TIER, None, ""),
    "local": (_OBJECT_TIER, None, ""),
    "memory": (_OBJECT_TIER, None, ""),
    "http": (_OBJECT_TIER, "aiohttp", "pip install aiohttp"),
    "https": (_OBJECT_TIER, "aiohttp", "pip install aiohttp"),
}


# Object stores whose bucket names cannot contain "@": a "user:secret@" there is a mistake.
_NO_USERINFO = frozenset({"s3", "s3a", "gs", "gcs"})


def split_scheme(url: str) -> tuple[str, str]:
    """Return ``(scheme, rest)``; a plain path has the scheme ``"file"``."""
    if "://" in url:
        scheme, rest = url.split("://", 1)
        return scheme.lower(), rest
    return "file", url


def check_scheme_case(url: str) -> None:
    """Refuse a URL whose scheme is not written in lower case (``S3://``), naming the one to write.

    fsspec looks a protocol up as written ("Protocol not known: S3"), and one dataset must not
    have two identities by the case of its scheme. No I/O: the loader checks this when a dataset is made.
    """
    scheme, _ = split_scheme(url)
    written = url.split("://", 1)[0] if "://" in url else scheme
    if written != scheme:
        raise UnsupportedURLError(
            f"URL {redact_url(url)!r}: write the scheme in lower case ({scheme}://); "
            f"fsspec knows no protocol {written!r}"
        )


def check_scheme(url: str) -> None:
    """Refuse a URL whose scheme is not lower case or that no backend reads (``htp://``), naming a close one.

    No I/O and no import of a backend: a daemon checks its ``--allow-dataset`` prefixes with it at start.
    """
    check_scheme_case(url)
    scheme, _ = split_scheme(url)
    from fsspec.registry import known_implementations

    if scheme in _REGISTRY or scheme in known_implementations or scheme in known_schemes():
        return
    close = close_match(scheme, known_schemes())
    hint = f"did you mean {close}://? " if close else ""
    raise UnsupportedURLError(
        f"unsupported URL scheme {scheme!r} in {redact_url(url)!r} "
        f"({hint}supported: {', '.join(s + '://' for s in known_schemes())}, another protocol fsspec has, "
        "or a local path)"
    )


def slash_hint(spec: str) -> str | None:
    """``a URL needs '://' after its scheme (s3://b/x)`` for ``s3:/b/x`` or ``s3:b/x``; None for anything else."""
    found = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.-]*):/*([^/].*)", spec)
    if found is None:
        return None
    scheme, rest = found.groups()
    return f"a URL needs '://' after its scheme ({scheme}://{'/' if scheme.lower() == 'file' else ''}{rest})"


def glob_hint(url: str) -> str | None:
    """What to write instead of a glob (``*.tar``), which names nothing here; None for other URLs."""
    parent, _, last = url.rstrip("/").rpartition("/")
    if not any(char in last for char in "*?["):
        return None
    return (
        f"{redact_url(url)}: a glob ('*', '?', '[') is not a pattern here; give the directory "
        f"({redact_url(parent)}/) or a brace pattern naming the shards (shard-{{0000..0099}}.tar)"
    )


def known_schemes() -> list[str]:
    """Every scheme `open_origin` accepts without fsspec's generic fallback."""
    schemes = set(_REGISTRY)
    schemes.update(ep.name for ep in entry_points(group="datacache.tiers"))
    return sorted(schemes)


def _load(import_string: str) -> Any:
    module_name, _, attribute = import_string.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def open_origin(
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
    writable: bool = False,
    listing: ListingBounds | None = None,
) -> Tier:
    """Return the tier that reads ``url``: a bucket prefix, a directory, any fsspec URL.

    ``listing`` bounds what one listing of it may hold (`ListingBounds`; default: its defaults).

    Raises `UnsupportedURLError` naming the scheme when no backend handles it,
    with the command that installs one when the backend is known but missing.
    """
    if not url or not isinstance(url, str):
        raise ConfigError(f"expected a dataset URL, got {url!r}")
    scheme, rest = split_scheme(url)
    if not rest.strip("/"):
        raise ConfigError(f"URL {redact_url(url)!r} names no bucket or path")
    check_scheme_case(url)
    if scheme in _NO_USERINFO and split_userinfo(url)[0] is not None:
        raise ConfigError(
            f"{scheme}:// URLs cannot carry credentials ({redact_url(url)!r}): use the backend's usual "
            "variables (AWS_ACCESS_KEY_ID, ...), a profile, or storage options in the config file"
        )
    entry = _REGISTRY.get(scheme)
    if entry is None:
        for ep in entry_points(group="datacache.tiers"):
            if ep.name == scheme:
                tier_class = ep.load()
                tier: Tier = tier_class(url, storage_options=storage_options, retry=retry, writable=writable)
                return tier
        from fsspec.registry import known_implementations

        check_scheme(url)
        entry = (_OBJECT_TIER, None, known_implementations[scheme].get("err", ""))
    import_string, needs, hint = entry
    if needs is not None:
        try:
            importlib.import_module(needs)
        except ImportError:
            raise UnsupportedURLError(f"{scheme}:// needs the {needs} package: {hint}") from None
    tier_class = _load(import_string)
    bounds = {"listing": listing} if listing is not None and import_string == _OBJECT_TIER else {}
    tier = tier_class(url, storage_options=storage_options, retry=retry, writable=writable, **bounds)
    return tier
