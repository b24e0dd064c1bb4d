"""What an origin URL names, written one way, and the dataset id every tier keys its copies by.

Two spellings of one origin (``s3a://`` and ``s3://``, ``..`` segments, another endpoint
variable) are one dataset; two origins never are, nor two http queries or userinfos, which may
change what the origin returns. The daemon's allowlist matches
this form only (docs/SECURITY.md), so a URL whose form may differ from what is fetched is refused.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from datacache.errors import ConfigError
from datacache.tiers import redact_url, split_scheme, split_userinfo

__all__ = ["canonical_origin", "check_origin_form", "dataset_id_for", "remove_dot_segments"]


# Schemes that name the same stores: one identity for each store.
_SCHEME_ALIASES = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az", "local": "file"}
_S3_SCHEMES = frozenset({"s3", "s3a"})


def _endpoint(scheme: str, options: Mapping[str, Any], env: Mapping[str, str]) -> str:
    """The service the origin's client will talk to: part of what a URL names."""
    client_kwargs = options.get("client_kwargs")
    nested = client_kwargs.get("endpoint_url") if isinstance(client_kwargs, Mapping) else None
    endpoint = options.get("endpoint_url") or nested or env.get(f"FSSPEC_{scheme.upper()}_ENDPOINT_URL")
    if not endpoint and scheme in _S3_SCHEMES:
        # botocore's own variables, read by the client the same way.
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if scheme == "az":
        endpoint = endpoint or options.get("account_name") or env.get("AZURE_STORAGE_ACCOUNT_NAME")
    return redact_url(str(endpoint or "")).strip().rstrip("/").lower()


def canonical_origin(
    url: str, storage_options: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None
) -> str:
    """What ``url`` names, written one way: scheme, endpoint, bucket or host, normalised path.

    Credentials (``user:secret@``) and query strings are not part of it (the
    allowlist matches this form); `dataset_id_for` adds them to a dataset's
    identity, since they may change what the origin returns. Local paths are resolved (``~``, ``..``,
    symlinks), so every spelling of one directory is one dataset.
    """
    scheme, _ = split_scheme(url)
    _, url = split_userinfo(url)
    scheme = _SCHEME_ALIASES.get(scheme, scheme)
    rest = url.split("://", 1)[1] if "://" in url else url
    if scheme == "file":
        try:
            return "file://" + os.path.realpath(os.path.expanduser(rest))
        except ValueError:  # a NUL in the path: no such file, but still one identity
            return "file://" + os.path.normpath(os.path.abspath(rest))
    rest = re.split(r"[?#]", rest, maxsplit=1)[0]
    host, _, path = rest.partition("/")
    # RFC 3986 5.2.4 after percent-decoding: "/ok/%2e%2e/private/" names "/private/", as the
    # HTTP client that fetches it resolves it. (`check_origin_form` refuses such spellings.)
    resolved = remove_dot_segments("/" + unquote(path))
    segments = [segment for segment in resolved.split("/") if segment]
    endpoint = _endpoint(scheme, storage_options or {}, os.environ if env is None else env)
    where = f"{endpoint}|" if endpoint else ""
    return f"{scheme}://{where}{host.lower()}/{'/'.join(segments)}"


def remove_dot_segments(path: str) -> str:
    """RFC 3986 section 5.2.4: ``path`` with its ``.`` and ``..`` segments resolved (never above ``/``)."""
    output: list[str] = []
    segments = path.split("/")
    for index, segment in enumerate(segments):
        last = index == len(segments) - 1
        if segment == ".":
            if last:
                output.append("")
            continue
        if segment == "..":
            if len(output) > 1:
                output.pop()
            if last:
                output.append("")
            continue
        output.append(segment)
    return "/".join(output)


# A segment that percent-decodes to "." or "..", or an escaped "/" or "\\": spelled so that one
# client reads it as a name and another as a step up the tree.
_ESCAPED_STEP = re.compile(r"(^|/)(%2e|\.){1,2}(?=/|$)|%2f|%5c", re.IGNORECASE)


def check_origin_form(url: str) -> None:
    """Refuse ``url`` where its canonical form (`canonical_origin`) may differ from what is fetched.

    `canonical_origin` resolves dot segments after percent-decoding (RFC 3986
    5.2.4), for every scheme. What a backend fetches is not always that: an HTTP
    client resolves ``..`` (and ``%2e%2e``) itself, an object store takes
    ``ok/../secret/`` as a literal key, a local path is taken literally by the
    kernel (``%2e%2e`` is a name). So a URL whose path holds a dot segment (an
    escaped one, for every scheme; a literal one, for every scheme but ``file``,
    whose literal ``..`` the kernel and `os.path.realpath` resolve alike) or an
    escaped ``/`` or ``\\`` is refused: its identity and its allowlist match are
    decided on the same string that is fetched.
    """
    scheme, _ = split_scheme(url)
    _, bare = split_userinfo(url)
    rest = bare.split("://", 1)[1] if "://" in bare else bare
    if scheme != "file":
        rest = re.split(r"[?#]", rest, maxsplit=1)[0].partition("/")[2]
    steps = [m.group(0) for m in _ESCAPED_STEP.finditer(rest)]
    if scheme == "file":
        steps = [step for step in steps if "%" in step]
    if steps:
        raise ConfigError(
            f"origin {redact_url(url)}: its path holds {steps[0].strip('/')!r}; write the URL with its "
            "dot segments resolved and no escaped '.', '/' or '\\' (what is fetched must be what it names)"
        )


def dataset_id_for(
    url: str, storage_options: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None
) -> str:
    """A dataset's identity as one safe path segment: ``<last-part>-<hash16>`` of its canonical origin.

    Every tier keys its copies by this id, never by a user-chosen name: two
    spellings of one origin share one copy, and two origins never share one.
    """
    canonical = canonical_origin(url, storage_options, env=env)
    last = redact_url(canonical).rstrip("/").rsplit("/", 1)[-1]  # a ";jsessionid=" is hashed, never shown
    tail = re.sub(r"[^A-Za-z0-9._-]+", "-", last).strip(".-") or "dataset"
    # 64 bits: no forged collisions
    digest = hashlib.sha256(_what_is_returned(url, canonical).encode()).hexdigest()[:16]
    return f"{tail[:60]}-{digest}"


def _what_is_returned(url: str, canonical: str) -> str:
    """``canonical``, and what else changes what the origin returns: the query, and who asks (http userinfo).

    Two users' ``https://alice:pw@host/d/`` and ``https://bob:pw@host/d/`` may be answered with
    different bytes (or one with 401), as ``?x=1`` and ``?x=2`` may: each is its own dataset. The
    userinfo enters only as a slow, salted digest (a dataset id is visible to every user of a tier).
    """
    if not canonical.startswith(("http://", "https://")):
        return canonical  # object stores refuse a userinfo (ConfigError); their keys hold no query
    userinfo, bare = split_userinfo(url)
    query = urlsplit(bare).query
    extra = f"?{query}" if query else ""
    if userinfo:
        extra += "|as=" + _credential_digest(userinfo, canonical)
    return canonical + extra


@functools.lru_cache(maxsize=256)
def _credential_digest(userinfo: str, salt: str) -> str:
    return hashlib.pbkdf2_hmac("sha256", userinfo.encode(), salt.encode(), 20_000).hex()
