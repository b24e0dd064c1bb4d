"""The exceptions datacache raises, rooted in builtins so callers can catch either.

Every error carries a one-line message that names what is wrong (a dataset, a
shard, a setting) and never a credential.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "ChecksumMismatchError",
    "ConfigError",
    "DaemonUnavailableError",
    "DatacacheError",
    "DatasetTooLargeError",
    "GlobURLError",
    "InvalidKeyError",
    "NotServedError",
    "OriginChangedError",
    "OriginError",
    "OriginPermissionError",
    "ProofRequiredError",
    "SampleDecodeError",
    "ShardNotFoundError",
    "ShardReadError",
    "StagerClosedError",
    "TierAccessError",
    "TierFullError",
    "TransientOriginError",
    "UnsupportedURLError",
    "close_match",
]


def close_match(word: str, choices: Iterable[str]) -> str | None:
    """The one of ``choices`` a mistyped ``word`` most likely meant (difflib's ratio, at least 0.6), or None.

    The one "did you mean" of the command line, the config file and the Python API: each says it
    in its own words, all with the same guess.
    """
    found = difflib.get_close_matches(word, list(choices), n=1)
    return found[0] if found else None


class DatacacheError(Exception):
    """Base of every error datacache raises on purpose."""


class ConfigError(DatacacheError, ValueError):
    """A setting, config file, flag or argument is invalid."""


class ProofRequiredError(ConfigError):
    """The daemon serves this dataset to this uid only once it proved the origin answers it (`datacache._proof`)."""


class NotServedError(ConfigError):
    """The node's daemon does not serve this dataset to this uid (neither configured nor under an allowed
    prefix): a loader reads it in its own process instead, into a cache of this uid's own."""


class UnsupportedURLError(ConfigError):
    """A URL names a scheme no installed backend handles."""


class InvalidKeyError(DatacacheError, ValueError):
    """A key or member name would escape its directory, or is otherwise unusable."""


class ShardNotFoundError(DatacacheError, FileNotFoundError):
    """A shard, object, bucket or prefix does not exist where it was looked for."""


class GlobURLError(ConfigError, ShardNotFoundError):
    """A dataset URL holds a glob (``*.tar``), which names nothing here.

    A mistake in what was written (a command exits 2 for it), and nothing found, as it was said before.
    """


class OriginError(DatacacheError, OSError):
    """The origin (object storage) failed a request in a way retries do not fix."""


class OriginPermissionError(OriginError, PermissionError):
    """The origin refused access: missing or wrong credentials, or a denied request."""


class TransientOriginError(OriginError):
    """A request failed in a way a retry may fix (throttling, 5xx, reset connection)."""


class OriginChangedError(DatacacheError):
    """An origin object no longer matches the manifest snapshot that asked for it."""

    @classmethod
    def since_manifest(cls, where: str, what: str = "object") -> OriginChangedError:
        """The error for ``where``, saying what fixes it: a new snapshot (``warm --refresh``)."""
        return cls(
            f"{where}: the {what} changed at the origin since the manifest was taken; "
            "take a new snapshot with `datacache warm --refresh` on the dataset's URL"
        )


class ChecksumMismatchError(DatacacheError):
    """Bytes read did not match the size or checksum the manifest records."""


class ShardReadError(DatacacheError):
    """A shard could not be parsed (truncated tar, corrupt Parquet, ...)."""


class StagerClosedError(DatacacheError):
    """The stager was closed while a transfer was asked for or in flight (the process is shutting down)."""


class DatasetTooLargeError(DatacacheError, MemoryError):
    """A dataset declares more samples (or a shard more bytes) than this machine can hold to read it."""


class SampleDecodeError(DatacacheError, ValueError):
    """A decoder failed on a sample; the message names the dataset, shard, key and field."""


class TierAccessError(DatacacheError, PermissionError):
    """This user cannot use a tier (cannot write it, or it is unsafe): it is read around, never fatal to a read."""


class TierFullError(DatacacheError, OSError):
    """A tier cannot take a shard: its capacity is too small or the disk is full."""


class DaemonUnavailableError(DatacacheError, ConnectionError):
    """The per-node daemon is not reachable over its socket."""
