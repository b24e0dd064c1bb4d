"""What a dataset can be refused for when it is made, at no cost: no listing, no connection.

A keyword its constructor (or the DataLoader's) does not take is refused with the one it most
likely meant (`check_keywords`), as the command line does for a mistyped flag.

A bucket prefix is listed at the first ``len()`` or ``iter()`` (listing a big prefix when a dataset
is made would cost every construction); shards named one by one are listed when it is made
(`CachedIterableDataset`). What needs no listing is checked here, so that it fails in one line
where the dataset is made, not inside a DataLoader worker at the first sample: a scheme not
written in lower case (the rule `open_origin` and so the CLI apply: `check_scheme_case`), a local
path that does not exist, a bare name that is neither a path nor a configured dataset
(`resolve_dataset`'s rule).
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

from datacache.loaders.sources import SourceSpec
from datacache.tiers import check_scheme_case

from datacache.config import DatasetConfig, Settings, load_settings, resolve_dataset
from datacache.errors import ConfigError, close_match
from datacache.manifest import missing_local_path
from datacache.sizes import parse_bandwidth

__all__ = ["check_keywords", "check_options", "check_sources", "target_rate"]

P = ParamSpec("P")
R = TypeVar("R")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def check_keywords(name: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A constructor's decorator: refuse a keyword it does not take, with the one it most likely meant.

    ``CachedIterableDataset(url, shufle=True)`` raises ``TypeError: CachedIterableDataset() got an
    unexpected keyword argument 'shufle'; did you mean 'shuffle'?`` (Python's words, and the guess the
    command line makes for a mistyped flag: `close_match`). The signature is kept, for type checkers too.
    """

    def decorate(init: Callable[P, R]) -> Callable[P, R]:
        parameters = inspect.signature(init).parameters.values()
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
            return init  # takes any keyword: nothing to refuse
        known = [p.name for p in parameters if p.kind in _NAMED and p.name != "self"]

        @functools.wraps(init)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            for keyword in kwargs:
                if keyword not in known:
                    close = close_match(keyword, known)
                    hint = f"; did you mean {close!r}?" if close else ""
                    raise TypeError(f"{name}() got an unexpected keyword argument {keyword!r}{hint}")
            return init(*args, **kwargs)

        return checked

    return decorate


def check_sources(specs: Iterable[SourceSpec], config: Settings | None) -> None:
    """Refuse a source whose scheme is not lower case or whose local path does not exist.

    ``specs``: sources naming a whole dataset (not shards one by one). Settings are loaded
    only for a bare name that is no path here (to know whether the config names it).
    """
    for spec in specs:
        dataset = spec.dataset
        if isinstance(dataset, str) and "://" not in dataset and not _is_path(dataset):
            if os.path.exists(dataset):
                continue
            dataset = resolve_dataset(dataset, config if config is not None else load_settings())
        url = dataset.url if isinstance(dataset, DatasetConfig) else dataset
        check_scheme_case(url)
        missing = missing_local_path(url)  # the words `datacache warm` says it in
        if missing is not None:
            raise missing


def target_rate(target_bandwidth: str | float | None) -> float | None:
    """``target_bandwidth`` in bytes/s; a size without ``/s`` (``"1GB"``) or a word (``"fast"``) is refused."""
    return None if target_bandwidth is None else parse_bandwidth(target_bandwidth, what="target_bandwidth")


def _is_path(text: str) -> bool:
    return text.startswith(("/", ".", "~"))


def check_options(
    *, epoch_size: int | None, on_error: str, shuffle_buffer: int | None, batch_size: int | None, prefetch: int | None
) -> None:
    """Refuse, in one line naming it, an option out of its range."""
    if epoch_size is not None and (isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 1):
        raise ConfigError(f"epoch_size must be a positive integer, got {epoch_size!r}")
    if on_error not in ("raise", "skip"):
        raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    for name, value, least in (("shuffle_buffer", shuffle_buffer, 1), ("batch_size", batch_size, 1),
                               ("prefetch", prefetch, 0)):
        # A string ("256", from argv) compared with an int raised a TypeError naming neither.
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least):
            kind = "a positive integer" if least else "an integer >= 0"
            raise ConfigError(f"{name} must be {kind}, got {value!r}")
