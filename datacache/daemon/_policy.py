"""What a client may make the daemon do: the daemon acts with its client's authority, not its own.

The daemon usually holds more than its clients: every file its uid can read, the
node's loopback and link-local network (a metadata service), and cloud
credentials of its own. A client whose uid is not the daemon's (nor root) could
otherwise borrow all of it (a confused deputy). For such a client:

- an origin must be a dataset the operator configured, or lie under a URL prefix
  the operator allowed (``--allow-dataset``); nothing is allowed by default;
- a ``file://`` origin is resolved (symlinks, ``..``) before it is matched, so a
  link inside an allowed root cannot lead out of it; any other origin's path is
  matched after percent-decoding with its dot segments resolved, and a URL whose
  path holds a dot segment (or an escaped ``.``, ``/``, ``\\``) is refused, since
  what a backend fetches for it may differ from what it names;
- an origin or endpoint on a loopback or link-local address is refused unless the
  allowlist entry that admits it names that host;
- the client may not name an endpoint (``--allow-endpoint``) or send credentials
  (``--allow-client-credentials``) unless the operator allowed it, nor any other
  storage option beyond a few harmless ones;
- a dataset's id is its canonical origin (`datacache.config.dataset_id_for`), so a
  name a client chooses cannot point another user's dataset elsewhere.

docs/SECURITY.md ("The daemon") describes the model and the operator's set-up.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from datacache._protocol import CREDENTIAL_OPTIONS
from datacache.config import DatasetConfig, Settings, canonical_origin, check_origin_form
from datacache.daemon._http import Forbidden, NotServed
from datacache.errors import ConfigError
from datacache.tiers import redact_url

__all__ = ["OriginPolicy", "canonical_url", "check_form", "own_endpoints"]

# Storage options a client may always pass: they change how, never where or as whom.
_HARMLESS = frozenset({"anon", "requester_pays", "default_block_size", "default_cache_type", "use_listings_cache"})
_ENDPOINTS = frozenset({"endpoint_url"})
_CREDENTIALS = CREDENTIAL_OPTIONS
_NETWORK_SCHEMES = frozenset({"http", "https"})


def canonical_url(url: str) -> str:
    """``url`` as the allowlist compares it: `canonical_origin` without an endpoint.

    Two spellings of one origin (``//``, ``/./``, ``..``, a symlinked directory, a
    ``user:secret@``) give one string; a prefix with no host (``http://``) stays
    a prefix of every URL of its scheme.
    """
    canonical = canonical_origin(url, {}, env={})
    scheme = canonical.split("://", 1)[0]
    if scheme != "file" and canonical == f"{scheme}:///":
        return f"{scheme}://"
    return canonical


def check_form(url: str) -> None:
    """Raise `Forbidden` for a URL whose canonical form may differ from what would be fetched.

    The allowlist matches the canonical form only (dot segments resolved after
    percent-decoding); a URL spelled so that a backend could fetch something else
    (``http://host/ok/%2e%2e/private/``, ``s3a://bucket/ok/../secret/``) is refused
    for every caller, whatever the allowlist says.
    """
    try:
        check_origin_form(url)
    except ConfigError as exc:
        raise Forbidden(str(exc)) from None


def _under(url: str, prefix: str) -> bool:
    """Whether canonical ``url`` equals canonical ``prefix`` or lies below it (at a path boundary)."""
    if url == prefix:
        return True
    return url.startswith(prefix if prefix.endswith("/") else prefix + "/")


def _private_host(host: str) -> bool:
    """Whether ``host`` is, or resolves to, a loopback, link-local or unspecified address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False  # it cannot be reached either; the origin will say so
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.is_loopback or address.is_link_local or address.is_unspecified:
            return True
    return False


def _host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


@dataclass(frozen=True)
class OriginPolicy:
    """The operator's allowlist for clients that are not the daemon's own user.

    Parameters
    ----------
    prefixes
        Origin URL prefixes such clients may open (``s3://bucket/datasets/``, ``file:///data/``).
    endpoints
        Endpoints such clients may name in ``storage_options.endpoint_url``.
    client_credentials
        Whether such clients may send credentials of their own (the daemon then acts with them).
    own_endpoints
        The daemon's own configured endpoints, which a client may always repeat.
    """

    prefixes: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()
    client_credentials: bool = False
    own_endpoints: tuple[str, ...] = ()

    def admit(
        self, config: DatasetConfig, client_options: Mapping[str, Any], *, configured: bool, operator: bool
    ) -> None:
        """Raise `Forbidden` unless this client may have the daemon open ``config``.

        ``configured``: ``config`` is a dataset the operator configured (by name, same URL).
        ``client_options``: the storage options the client itself sent.
        ``operator``: the client is root or the daemon's own uid (it holds what the daemon holds);
        the allowlist, if the operator set one, still applies to it.
        """
        check_form(config.url)
        url = canonical_url(config.url)
        entry = next((p for p in self.prefixes if _under(url, canonical_url(p))), None)
        if operator:
            if self.prefixes and not configured and entry is None:
                raise Forbidden(f"dataset {redact_url(config.url)} is not in this daemon's allowlist (--allow-dataset)")
            return
        if not configured:
            if entry is None:
                raise NotServed(
                    f"dataset {redact_url(config.url)} is neither configured in this daemon nor under a "
                    "prefix its operator allowed (--allow-dataset)"
                )
            if urlsplit(url).scheme in _NETWORK_SCHEMES:
                self._public(url, named=_host(canonical_url(entry)))
        self._options(client_options)

    def _options(self, options: Mapping[str, Any]) -> None:
        for name, value in options.items():
            if name in _HARMLESS:
                continue
            if name in _ENDPOINTS:
                endpoint = canonical_url(str(value))
                allowed = (*self.endpoints, *self.own_endpoints)
                if not any(endpoint == canonical_url(e) for e in allowed):
                    raise Forbidden(
                        f"storage option {name!r}: a client may not choose the endpoint "
                        "(the operator allows endpoints with --allow-endpoint)"
                    )
                continue
            if name in _CREDENTIALS:
                if not self.client_credentials:
                    raise Forbidden(
                        f"storage option {name!r}: this daemon does not act with a client's credentials "
                        "(the operator allows it with --allow-client-credentials)"
                    )
                continue
            raise Forbidden(f"storage option {name!r} is not one a client may set through the daemon")

    @staticmethod
    def _public(url: str, *, named: str) -> None:
        host = _host(url)
        if host and host != named and _private_host(host):
            raise Forbidden(
                f"origin {redact_url(url)} is on a loopback or link-local address; the operator must "
                "name that host in --allow-dataset"
            )


def own_endpoints(settings: Settings, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The endpoints the operator configured for the daemon: a client may repeat these."""
    environ = os.environ if environ is None else environ
    options = [*settings.storage_options.values(), *(d.storage_options for d in settings.datasets.values())]
    found = [str(o["endpoint_url"]) for o in options if o.get("endpoint_url")]
    found += [environ[name] for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3") if environ.get(name)]
    return tuple(dict.fromkeys(found))
