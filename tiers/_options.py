"""Storage options checked against what the backend takes, so that a typo is named, not a bare TypeError.

fsspec hands a filesystem's unknown keyword arguments on: s3fs to
aiobotocore's session, which raises ``TypeError`` on first use (the user saw
``s3://...: TypeError``); most others to fsspec's base class, which ignores
them silently. Both deserve the option's name and the nearest real one.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from datacache.errors import ConfigError

__all__ = ["check_storage_options"]

logger = logging.getLogger(__name__)

_FSSPEC_OPTIONS = frozenset(
    {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths", "asynchronous", "loop"}
)
"""What fsspec's base classes take without naming it in a signature."""

_HANDED_ON: dict[str, tuple[str, str]] = {
    "s3": ("aiobotocore.session", "AioSession"),
    "s3a": ("aiobotocore.session", "AioSession"),
}
"""Backends whose unknown options reach a callee that refuses them: every option is known."""


def _named_parameters(classes: Iterable[type]) -> set[str]:
    names: set[str] = set()
    for cls in classes:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):  # a builtin's __init__ has no signature to read
            continue
        names.update(
            p.name
            for p in parameters
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"
        )
    return names


def check_storage_options(protocol: str, fs_class: type, options: Mapping[str, Any]) -> None:
    """Refuse (or, where the backend would ignore it, log) an option ``fs_class`` does not take.

    Raises `ConfigError` naming the option, and the nearest known one, when
    the backend would fail on it. Option values are never shown.
    """
    known = _named_parameters(fs_class.__mro__) | _FSSPEC_OPTIONS
    handed_on = _HANDED_ON.get(protocol)
    if handed_on is not None:
        module, name = handed_on
        known |= _named_parameters([getattr(importlib.import_module(module), name)])
    for option in sorted(set(options) - known):
        close = difflib.get_close_matches(option, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        message = (
            f"storage option {option!r} is not an option of {protocol}:// "
            f"({fs_class.__module__}.{fs_class.__qualname__}){hint}"
        )
        if handed_on is not None:
            raise ConfigError(message)
        logger.warning("%s (passed on to the filesystem, which may ignore it)", message)
