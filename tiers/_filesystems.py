"""Making the fsspec filesystem an `ObjectTier` reads through: what each backend is told.

One rule retries (``_retry.call_with_retry``, with the tier's `RetryPolicy`), so every
backend's own retrying is turned off here: botocore's (one attempt), gcsfs's (its
request without the retry decorator, which retried six times with back-off up to 32 s
and logged a traceback for each failure) and the Azure SDK's (no retries). A request
is bounded by a connect and a read timeout, never by a total one (a large shard takes
what it takes). What the backend judges transient it says so with `RetriableError`,
which the one rule retries.

http(s) tiers a daemon's client opened are confined: a redirect out of the tier's
URL is refused before it is followed (`CONFINE_REDIRECTS`).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from datacache.tiers._backends import AZURE_SCHEMES
from datacache.tiers._files import redact_url

from datacache.errors import OriginPermissionError

__all__ = ["CONFINE_REDIRECTS", "CONNECT_TIMEOUT", "READ_TIMEOUT", "backend_options", "one_try"]

CONNECT_TIMEOUT = 10
"""Seconds to open a connection to the origin before the attempt counts as failed."""
READ_TIMEOUT = 60
"""Seconds without a byte from the origin before the attempt counts as failed."""

CONFINE_REDIRECTS = "datacache_confine_redirects"
"""A storage option only datacache reads (never fsspec): true, and an http(s) tier follows a redirect
only to a URL inside its own (the daemon sets it for datasets its clients open; docs/SECURITY.md)."""



def _inside(target: Any, root: Any) -> bool:
    """Whether yarl URL ``target`` is ``root`` or lies below it: same scheme, host and port, a path under it."""
    if target.user is not None or target.password is not None:
        return False
    if (target.scheme, (target.host or "").lower(), target.port) != (root.scheme, (root.host or "").lower(), root.port):
        return False
    base = root.path.rstrip("/")
    return bool(target.path.rstrip("/") == base or target.path.startswith(base + "/"))


def _confined(url: str) -> Any:
    """An aiohttp trace that refuses a redirect out of ``url`` before it is followed, naming where it led."""
    import aiohttp
    from yarl import URL

    root = URL(url)

    async def on_redirect(session: Any, context: Any, params: Any) -> None:
        response = params.response
        target = response.url.join(URL(response.headers.get("Location", "")))
        if not _inside(target, root):
            raise OriginPermissionError(
                f"{redact_url(str(response.url))}: the origin redirects ({response.status}) to "
                f"{redact_url(str(target))}, outside the dataset's URL; such a redirect is not followed "
                "for a dataset a daemon's client opened (docs/SECURITY.md, 'The daemon')"
            )

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(on_redirect)
    return trace


def backend_options(
    protocol: str, fs_class: Any, url: str, given: Mapping[str, Any], *, confine_redirects: bool
) -> dict[str, Any]:
    """The options to make ``fs_class`` with for ``url``: the user's, and ours where the user gave none."""
    options = dict(given)
    # What the URL itself says (ftp://user@host:21/, hdfs://namenode/ ...), as fsspec's own
    # url_to_fs takes it: a host-based filesystem cannot be made without it. Given options win.
    for name, value in fs_class._get_kwargs_from_urls(url).items():
        options.setdefault(name, value)
    if protocol in ("s3", "s3a"):
        config = dict(options.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", CONNECT_TIMEOUT)
        config.setdefault("read_timeout", READ_TIMEOUT)
        options["config_kwargs"] = config
        # A cached listing would answer stat with an old size and ETag after a write,
        # and a manifest must be a fresh snapshot: never reuse listings.
        options.setdefault("use_listings_cache", False)
    elif protocol in ("gs", "gcs"):
        import aiohttp

        # gcsfs hands this to each aiohttp request; its default is aiohttp's 5-minute total.
        options.setdefault(
            "requests_timeout", aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT, sock_read=READ_TIMEOUT)
        )
    elif protocol in AZURE_SCHEMES:
        options.setdefault("connection_timeout", CONNECT_TIMEOUT)
        options.setdefault("read_timeout", READ_TIMEOUT)
    if confine_redirects and protocol in ("http", "https"):
        # Every hop is checked before it is followed: it must stay inside this tier's URL.
        client_kwargs = dict(options.get("client_kwargs") or {})
        client_kwargs["trace_configs"] = [*client_kwargs.get("trace_configs", ()), _confined(url)]
        options["client_kwargs"] = client_kwargs
    return options


def one_try(fs: Any, protocol: str) -> Any:
    """``fs`` with its backend's own retries off, so that the tier's `RetryPolicy` alone decides.

    For Azure also: adlfs registers, for every filesystem, finalizers that close its
    clients through ``fsspec.asyn.sync`` on the filesystem's loop. The tier's loop is
    gone by then (interpreter exit: "RuntimeError: Loop is not running"; a loop stopped
    but not closed would hang the exit), and the tier closes those clients itself
    (`close_filesystem`), so the finalizers are detached.
    """
    if protocol in ("s3", "s3a"):
        fs.retries = 1
    elif protocol in AZURE_SCHEMES:
        service = getattr(fs, "service_client", None)
        for policy in getattr(getattr(service, "_pipeline", None), "_impl_policies", ()):
            if hasattr(policy, "total_retries"):  # the storage SDK's retry policy, shared by its blob clients
                policy.total_retries = 0
        _detach_finalizers(fs)
    return fs


def _detach_finalizers(obj: Any) -> None:
    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer in list(registry):
        found = finalizer.peek()
        if found is not None and found[0] is obj:
            finalizer.detach()
