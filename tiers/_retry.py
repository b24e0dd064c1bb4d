"""The one place object-store calls are retried and their errors translated.

Errors are classified by type and by the S3 error code or HTTP status, never
by message text, and re-raised as datacache errors with ``raise ... from``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from datacache.errors import (
    DatacacheError,
    OriginChangedError,
    OriginError,
    OriginPermissionError,
    ShardNotFoundError,
    TransientOriginError,
)

__all__ = ["RetriableError", "RetryPolicy", "call_with_retry", "error_code", "translate_error"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "NotFound", "404", "NoSuchVersion"})
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "AllAccessDisabled",
        "AccountProblem",
    }
)
_CHANGED_CODES = frozenset({"PreconditionFailed", "412"})
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "TooManyRequests",
        "429",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
        "502",
        "504",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
    }
)
_TRANSIENT_ERRNOS = frozenset(
    {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT, errno.EHOSTUNREACH}
)


class RetriableError(Exception):
    """A backend adapter's word that a failure (its ``__cause__``) is transient, where no code says so.

    A backend whose own retrying is turned off (``_gcs``) raises it for what it would have
    retried; `translate_error` makes it a `TransientOriginError`, which the one rule retries.
    """


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient origin errors are retried: capped exponential backoff with full jitter."""

    max_attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 5.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        return random.uniform(0, min(self.max_delay, self.base_delay * (2 ** (attempt - 1))))


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def _s3_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    if code:
        return str(code)
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return str(status) if status else None


def _http_status(exc: BaseException) -> str | None:
    """The HTTP status an HTTP client's error carries (Azure's ``status_code``, aiohttp's ``status``)."""
    for name in ("status_code", "status"):
        status = getattr(exc, name, None)
        if isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599:
            return str(status)
    return None


def _bucket_of(where: str) -> str:
    if "://" not in where:
        return "the bucket "
    bucket = where.split("://", 1)[1].split("/", 1)[0]
    return f"the bucket {bucket!r} " if bucket else "the bucket "


def error_code(exc: BaseException) -> str | None:
    """The first S3 error code (or HTTP status) in ``exc``'s chain of causes, if any."""
    for err in _chain(exc):
        code = _s3_code(err)
        if code is not None:
            return code
    return None


def translate_error(exc: BaseException, where: str) -> DatacacheError:
    """Return the datacache error that ``exc`` (raised while accessing ``where``) means."""
    chain = _chain(exc)
    # The error code, wherever it sits in the chain (s3fs wraps a ClientError in an
    # OSError), says more than the wrapper's type does.
    for err in chain:
        if isinstance(err, DatacacheError):
            return err
        if isinstance(err, RetriableError):
            return TransientOriginError(f"{where}: transient origin error ({err})")
        code = _s3_code(err) or _http_status(err)
        if code is not None:
            return _by_code(code, where)
    for err in chain:
        found = _by_type(err, where)
        if found is not None:
            return found
    return OriginError(f"{where}: {type(exc).__name__}")


def _by_code(code: str, where: str) -> DatacacheError:
    """The error an S3 error code (or HTTP status) means."""
    if code == "NoSuchBucket":
        return ShardNotFoundError(f"{where}: {_bucket_of(where)}does not exist (NoSuchBucket)")
    if code in _NOT_FOUND_CODES:
        return ShardNotFoundError(f"{where}: not found at the origin ({code})")
    if code in _PERMISSION_CODES:
        return OriginPermissionError(f"{where}: access denied by the origin ({code})")
    if code in _CHANGED_CODES:
        return OriginChangedError.since_manifest(where)
    if code in _TRANSIENT_CODES:
        return TransientOriginError(f"{where}: transient origin error ({code})")
    return OriginError(f"{where}: origin error ({code})")


def _by_type(err: BaseException, where: str) -> DatacacheError | None:
    """The error an exception without an error code means, by its type; None: nothing known."""
    import http.client

    import botocore.exceptions as boto
    import urllib3.exceptions

    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp comes with s3fs
        aiohttp = None  # type: ignore[assignment]

    failed = f"{where}: connection to the origin failed ({type(err).__name__})"
    if isinstance(err, boto.NoCredentialsError | boto.PartialCredentialsError):
        return OriginPermissionError(
            f"{where}: no credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or storage options in the config file; use anon=true for public buckets)"
        )
    if isinstance(
        err,
        boto.EndpointConnectionError
        | boto.ConnectTimeoutError
        | boto.ReadTimeoutError
        | boto.ConnectionClosedError
        | boto.ResponseStreamingError
        | boto.IncompleteReadError
        | http.client.HTTPException
        | urllib3.exceptions.HTTPError,
    ):
        return TransientOriginError(failed)
    if isinstance(err, boto.FlexibleChecksumError):
        # The body did not match the CRC the server sent: damaged in transit, fetch it again.
        return TransientOriginError(f"{where}: the response failed its checksum in transit")
    if aiohttp is not None and isinstance(err, aiohttp.ClientPayloadError | aiohttp.ClientConnectionError):
        return TransientOriginError(failed)
    if isinstance(err, TimeoutError):
        return TransientOriginError(f"{where}: origin request timed out")
    if isinstance(err, FileNotFoundError):
        return ShardNotFoundError(f"{where}: not found at the origin")
    if isinstance(err, PermissionError):
        return OriginPermissionError(f"{where}: access denied by the origin")
    if isinstance(err, ConnectionError) or (isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS):
        return TransientOriginError(failed)
    return None


async def call_with_retry(
    operation: Callable[[], Awaitable[T]],
    *,
    where: str,
    policy: RetryPolicy,
    on_retry: Callable[[DatacacheError], None] | None = None,
) -> T:
    """Await ``operation()``, retrying transient failures by ``policy``.

    Permanent failures (not found, access denied, changed object) raise at
    once; transient ones are retried with backoff until the attempts run out,
    then raised as `TransientOriginError`.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return await operation()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = translate_error(exc, where)
            if not isinstance(error, TransientOriginError) or attempt >= policy.max_attempts:
                if isinstance(error, TransientOriginError):
                    error = TransientOriginError(f"{error} (gave up after {attempt} attempts)")
                raise error from exc
            if on_retry is not None:
                on_retry(error)
            delay = policy.delay(attempt)
            logger.debug("retrying %s in %.3fs after: %s", where, delay, error)
            await asyncio.sleep(delay)
