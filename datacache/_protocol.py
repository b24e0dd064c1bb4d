"""The daemon's wire format, shared by `datacache.client` and `datacache.daemon`.

HTTP/1.1 with JSON bodies over a Unix domain socket; docs/DAEMON.md describes
every request. This module holds what both ends must agree on: the paths, the
error codes and the exceptions they stand for, and the JSON form of a dataset
configuration and of a `Location`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from datacache.config import DatasetConfig
from datacache.errors import (
    ChecksumMismatchError,
    ConfigError,
    DaemonUnavailableError,
    DatacacheError,
    InvalidKeyError,
    OriginChangedError,
    OriginError,
    OriginPermissionError,
    ProofRequiredError,
    ShardNotFoundError,
    ShardReadError,
    TierFullError,
    TransientOriginError,
    UnsupportedURLError,
)
from datacache.staging import Location, WarmProgress, WarmReport
from datacache.tiers import redact_url

__all__ = [
    "API",
    "CREDENTIAL_OPTIONS",
    "MAX_BODY_BYTES",
    "PROTOCOL_VERSION",
    "UnknownDatasetError",
    "client_label",
    "config_from_wire",
    "config_to_wire",
    "error_for",
    "exception_from_wire",
    "location_to_wire",
    "warm_progress_to_wire",
    "warm_report_from_wire",
    "warm_report_to_wire",
]

PROTOCOL_VERSION = 1
API = f"/v{PROTOCOL_VERSION}"
"""Every verb lives under this path; ``/healthz`` and ``/readyz`` do not."""
MAX_BODY_BYTES = 64 << 20
"""The largest request body the daemon reads (a future order of ~1M keys fits)."""

CREDENTIAL_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "profile",
        "account_key",
        "sas_token",
        "connection_string",
        "credential",
        "client_secret",
    }
)
"""Storage options that are, or name, credentials: never sent to a daemon of another user."""

_CLIENT_LABEL = re.compile(r"[^A-Za-z0-9_.:@/-]+")


class UnknownDatasetError(DatacacheError):
    """The daemon does not hold this dataset snapshot (it restarted): open it again."""


# (exception class, code, HTTP status), most specific first.
_ERRORS: tuple[tuple[type[BaseException], str, int], ...] = (
    (InvalidKeyError, "invalid_key", 400),
    (UnsupportedURLError, "unsupported_url", 400),
    (ProofRequiredError, "proof_required", 403),
    (ConfigError, "invalid_request", 400),
    (UnknownDatasetError, "unknown_dataset", 409),
    (ShardNotFoundError, "not_found", 404),
    (OriginPermissionError, "origin_permission", 502),
    (TransientOriginError, "origin_unavailable", 502),
    (OriginError, "origin_error", 502),
    (OriginChangedError, "origin_changed", 409),
    (ChecksumMismatchError, "checksum_mismatch", 502),
    (TierFullError, "tier_full", 507),
    (ShardReadError, "shard_read", 500),
    (DaemonUnavailableError, "shutting_down", 503),
    (DatacacheError, "error", 500),
)
_BY_CODE: dict[str, type[BaseException]] = {code: cls for cls, code, _ in _ERRORS}
# Protocol-level codes that have no exception of their own on the daemon's side.
_BY_CODE.update(
    {
        "bad_request": ConfigError,
        "unknown_request": ConfigError,
        "forbidden": ConfigError,
        "too_large": ConfigError,
        "internal": DatacacheError,
    }
)


def error_for(exc: BaseException) -> tuple[str, int]:
    """The code and HTTP status that stand for ``exc`` on the wire."""
    for cls, code, status in _ERRORS:
        if isinstance(exc, cls):
            return code, status
    return "internal", 500


def exception_from_wire(code: str, message: str) -> DatacacheError:
    """The exception a client raises for an error reply (its message is one line)."""
    cls = _BY_CODE.get(code, DatacacheError)
    line = (
        redact_url(message.strip().splitlines()[0]) if message.strip() else f"daemon error {code}"
    )
    error = cls(f"daemon: {line}")
    if not isinstance(
        error, DatacacheError
    ):  # pragma: no cover - the table holds only DatacacheErrors
        return DatacacheError(f"daemon: {line}")
    return error


def config_to_wire(config: DatasetConfig, *, credentials: bool = True) -> dict[str, Any]:
    """A dataset configuration as the ``open`` request carries it (without credentials if told)."""
    options = {
        name: value
        for name, value in config.storage_options.items()
        if credentials or name not in CREDENTIAL_OPTIONS
    }
    return {
        "name": config.name,
        "url": config.url,
        "policy": config.policy,
        "pinned": config.pinned,
        "format": config.format,
        "storage_options": options,
    }


def config_from_wire(data: Any) -> DatasetConfig:
    """Parse the ``dataset`` object of an ``open`` request; raise `ConfigError` if it is wrong."""
    if not isinstance(data, Mapping):
        raise ConfigError("'dataset' must be an object with a name and a url, or a string")
    name, url = data.get("name"), data.get("url")
    if not isinstance(name, str) or not isinstance(url, str) or not name or not url:
        raise ConfigError("'dataset' needs a non-empty 'name' and 'url'")
    options = data.get("storage_options") or {}
    if not isinstance(options, Mapping):
        raise ConfigError("'dataset.storage_options' must be an object")
    policy = data.get("policy") or "auto"
    fmt = data.get("format")
    pinned = data.get("pinned", False)
    if (
        not isinstance(policy, str)
        or not isinstance(pinned, bool)
        or not (fmt is None or isinstance(fmt, str))
    ):
        raise ConfigError(
            "'dataset.policy' and 'dataset.format' must be strings and 'dataset.pinned' a boolean"
        )
    return DatasetConfig(
        name=name, url=url, storage_options=dict(options), policy=policy, pinned=pinned, format=fmt
    )


def location_to_wire(location: Location) -> dict[str, Any]:
    """A `Location` as the ``ensure`` and ``locate`` replies carry it."""
    return {
        "tier": location.tier,
        "path": str(location.path) if location.path is not None else None,
        "checksum": location.checksum,
        "key": location.shard.key,
        "size": location.shard.size,
    }


def client_label(value: Any, fallback: str) -> str:
    """A short, safe label for a client in metrics and status (at most 64 characters)."""
    if not isinstance(value, str) or not value.strip():
        return fallback
    return _CLIENT_LABEL.sub("_", value.strip())[:64]


def warm_report_to_wire(report: WarmReport, url: str) -> dict[str, Any]:
    """The one form of a `WarmReport`: the daemon's last warm line and ``warm --json``'s summary."""
    return {
        "event": "done",
        "dataset": report.dataset,
        "url": redact_url(url),
        "tier": report.tier,
        "complete": report.complete,
        "shards_requested": report.shards_requested,
        "shards_resident": report.shards_resident,
        "shards_transferred": report.shards_transferred,
        "shards_verified": report.shards_verified,
        "bytes_requested": report.bytes_requested,
        "bytes_resident": report.bytes_resident,
        "bytes_transferred": report.bytes_transferred,
        "shards_displaced": report.shards_displaced,
        "bytes_displaced": report.bytes_displaced,
        "seconds": round(report.seconds, 3),
        "rate_bytes_per_s": round(report.rate, 1),
        "failures": [{"shard": key, "error": redact_url(error)} for key, error in report.failures],
    }


def warm_report_from_wire(document: Mapping[str, Any]) -> WarmReport:
    """Parse `warm_report_to_wire`'s form; raise `DatacacheError` if a field is missing or wrong."""
    try:
        failures = tuple((str(f["shard"]), str(f["error"])) for f in document["failures"])
        return WarmReport(
            dataset=str(document["dataset"]),
            tier=str(document["tier"]),
            shards_requested=int(document["shards_requested"]),
            shards_resident=int(document["shards_resident"]),
            bytes_requested=int(document["bytes_requested"]),
            bytes_transferred=int(document["bytes_transferred"]),
            shards_transferred=int(document["shards_transferred"]),
            shards_verified=int(document["shards_verified"]),
            seconds=float(document["seconds"]),
            failures=failures,
            bytes_resident=int(document["bytes_resident"]),
            shards_displaced=int(document.get("shards_displaced", 0)),
            bytes_displaced=int(document.get("bytes_displaced", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise DatacacheError(f"daemon: a malformed warm summary ({type(exc).__name__}: {exc})") from None


def warm_progress_to_wire(progress: WarmProgress) -> dict[str, Any]:
    """A warm's progress line (docs/DAEMON.md)."""
    return {
        "event": "progress",
        "shards_done": progress.shards_done,
        "shards_total": progress.shards_total,
        "bytes_done": progress.bytes_done,
        "bytes_total": progress.bytes_total,
        "bytes_transferred": progress.bytes_transferred,
        "rate_bytes_per_s": round(progress.rate, 1),
        "shards_not_kept": progress.shards_not_kept,
    }
