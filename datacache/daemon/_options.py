"""`DaemonOptions`: how the daemon serves, beyond the cache `Settings` (who may connect, pacing, limits)."""

from __future__ import annotations

from dataclasses import dataclass

from datacache.errors import ConfigError
from datacache.identity import check_origin_form
from datacache.tiers import check_scheme, redact_url, split_scheme

__all__ = ["DaemonOptions"]


@dataclass(frozen=True)
class DaemonOptions:
    """How the daemon serves, beyond the cache `Settings`.

    Parameters
    ----------
    prefetch_slots
        Prefetch transfers run at once; default: three quarters of
        ``settings.concurrency``, so that readers always find a free worker.
    prefetch_bandwidth
        Optional cap on prefetch and warm traffic, bytes per second.
    drain_timeout
        On SIGTERM, how long running transfers may take to finish before
        they are abandoned (cleanly: nothing half-written stays visible).
    allow_uids, allow_gids
        Peers (by ``SO_PEERCRED``) allowed besides root, the daemon's own
        uid and its primary gid.
    allow_datasets
        Origin URL prefixes that clients other than the daemon's own user (and
        root) may open besides configured datasets; if set, the daemon's own
        user is limited to them too.
    allow_endpoints
        Endpoints such clients may name in ``storage_options.endpoint_url``.
    allow_client_credentials
        Whether such clients may send credentials (the daemon then uses theirs).
    socket_group
        The group that owns the socket (mode 0660), so that its members can connect.
    request_timeout
        Seconds a connection may take to send its headers, and again its body.
    body_memory
        Bytes of request bodies held at once, across all connections.
    connections_per_client
        Connections one uid may hold at once (default: a quarter of the daemon's budget,
        which follows its open-file limit).
    client_ttl
        A client that stopped reporting for this long leaves the metrics.
    opens_per_client
        Datasets one uid may be opening at once (each open may list an origin); more are refused.
    """

    prefetch_slots: int | None = None
    prefetch_bandwidth: float | None = None
    drain_timeout: float = 10.0
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    allow_datasets: tuple[str, ...] = ()
    allow_endpoints: tuple[str, ...] = ()
    allow_client_credentials: bool = False
    socket_group: int | None = None
    request_timeout: float = 10.0
    body_memory: int = 256 << 20
    connections_per_client: int | None = None
    client_ttl: float = 300.0
    opens_per_client: int = 16

    def __post_init__(self) -> None:
        # A mistyped prefix (htp://) matched no URL and said nothing: the daemon ran refusing what it meant to allow.
        for prefix in self.allow_datasets:
            try:
                if not isinstance(prefix, str) or not prefix.strip():
                    raise ConfigError("expected an origin URL prefix (s3://bucket/datasets/, file:///data/)")
                check_scheme(prefix)
                check_origin_form(prefix)
            except ConfigError as exc:
                raise ConfigError(f"--allow-dataset {redact_url(str(prefix))!r}: {exc}") from None
        for endpoint in self.allow_endpoints:
            if split_scheme(endpoint)[0] not in ("http", "https") or "://" not in endpoint:
                raise ConfigError(
                    f"--allow-endpoint {redact_url(endpoint)!r}: expected an http:// or https:// endpoint URL"
                )
