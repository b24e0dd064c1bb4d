"""Bounds on one listing of an origin, and the http(s) listing that keeps to them while it reads.

A listing is the one request whose size the origin, not the reader, decides: a page of
four million links took a daemon from 58 MB to 1.8 GB and kept it sending a HEAD per link
after its client had left. So a listing stops at `ListingBounds`: so many entries, so many
bytes of listing pages. An http(s) page is read in chunks and dropped at the bound, before it
is parsed (fsspec's own listing reads a whole page, then parses it on the event loop); its
links are parsed in a thread, so that other requests go on meanwhile. The entries of any
other backend are counted when its listing returns, before any of them is stat'ed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from datacache.tiers._files import redact_url
from datacache.tiers._retry import error_code

from datacache.errors import ConfigError

__all__ = ["ListingBounds", "ListingTooLargeError", "find_all", "http_listing"]

_CHUNK = 1 << 16


class ListingTooLargeError(ConfigError):
    """A listing went past a bound of `ListingBounds`; the message names it and the setting that raises it."""


@dataclass(frozen=True)
class ListingBounds:
    """How much one listing may hold: entries (files and folders), and bytes of http(s) listing pages.

    The settings that raise them are ``listing_max_entries`` and ``listing_max_bytes``
    (`datacache.config`); they are named in the error.
    """

    max_entries: int = 1_000_000
    max_bytes: int = 128 << 20

    def entries_error(self, url: str) -> ListingTooLargeError:
        return ListingTooLargeError(
            f"{redact_url(url)}: the listing holds more than {self.max_entries:,} entries, this node's bound "
            "(listing_max_entries; raise it in the config file's [staging] table or with "
            "DATACACHE_LISTING_MAX_ENTRIES, or pack the files into shards with `datacache shard`)"
        )

    def bytes_error(self, url: str) -> ListingTooLargeError:
        return ListingTooLargeError(
            f"{redact_url(url)}: its listing pages hold more than {self.max_bytes:,} bytes, this node's bound "
            "(listing_max_bytes; raise it in the config file's [staging] table or with DATACACHE_LISTING_MAX_BYTES)"
        )


def _links(text: str, simple: bool) -> list[str]:
    """The links of a page, as fsspec's http listing finds them (run in a thread: a page may be large)."""
    from fsspec.implementations.http import ex, ex2

    found: list[Any] = [u[2] for u in ex.findall(text)]
    if simple:
        found = ex2.findall(text) + found
    return [link[1] if isinstance(link, tuple) else link for link in found]


def _under(page: str, links: list[str]) -> list[str]:
    """The links of ``page`` that lie below it, as full URLs (fsspec's rule: same host, below the page)."""
    parts = urlparse(page)
    base = page.rstrip("/")
    out: list[str] = []
    for found in links:
        link = f"{parts.scheme}://{parts.netloc}{found}" if found.startswith("/") and len(found) > 1 else found
        if link.startswith("http"):
            if link.replace("https", "http").startswith(base.replace("https", "http") + "/"):
                out.append(link)
        elif link not in ("..", "../"):
            out.append(f"{base}/{link.lstrip('/')}")
    return out


async def _page(fs: Any, url: str, bounds: ListingBounds, spent: list[int]) -> list[str] | None:
    """The links of one page (None: it is not a page of links), read in chunks within the byte bound."""
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), **fs.kwargs) as response:
        fs._raise_not_found_for_status(response, url)
        mimetype = response.headers.get("Content-Type", "").partition(";")[0] or None
        if mimetype not in ("text/html", None):
            return None
        if response.content_length is not None and spent[0] + response.content_length > bounds.max_bytes:
            raise bounds.bytes_error(url)
        body = bytearray()
        async for chunk in response.content.iter_chunked(_CHUNK):
            spent[0] += len(chunk)
            if spent[0] > bounds.max_bytes:
                raise bounds.bytes_error(url)
            body += chunk
    text = body.decode("utf-8", errors="ignore")
    del body
    return _under(url, await asyncio.to_thread(_links, text, fs.simple_links))


async def http_listing(fs: Any, base: str, bounds: ListingBounds) -> dict[str, dict[str, Any]]:
    """What fsspec's ``_find(base, detail=True)`` gives for an http(s) URL, within ``bounds``.

    Folders (links ending in ``/``) are walked; each page once. A missing page lists nothing.
    """
    found: dict[str, dict[str, Any]] = {}
    spent = [0]
    pages, seen = [base], {base.rstrip("/")}
    while pages:
        page = pages.pop()
        try:
            links = await _page(fs, page, bounds, spent)
            if links == [] and page.endswith("/"):  # as fsspec does: the page without its slash
                links = await _page(fs, page.rstrip("/"), bounds, spent)
        except FileNotFoundError:
            continue
        for link in links or ():
            name = link.rstrip("/")
            if link.endswith("/"):
                if name not in seen:
                    seen.add(name)
                    pages.append(link)
            else:
                found[name] = {"name": name, "size": None, "type": "file"}
            if len(found) + len(seen) > bounds.max_entries:
                raise bounds.entries_error(base)
    return found


async def find_all(fs: Any, protocol: str, base: str, bounds: ListingBounds) -> dict[str, dict[str, Any]]:
    """fsspec's detailed listing under ``base``: empty for a missing prefix, an error for a missing bucket.

    http(s): our own walk of the listing pages, bounded while it reads; a folder that is not
    found lists nothing, an unreachable server is an error (never an empty dataset).
    """
    if protocol in ("http", "https"):
        return await http_listing(fs, base, bounds)
    try:
        found: dict[str, dict[str, Any]] = await fs._find(base, detail=True)
    except FileNotFoundError as exc:
        if error_code(exc) == "NoSuchBucket":
            raise  # a missing bucket is an error; a missing prefix is just empty
        return {}
    if len(found) > bounds.max_entries:
        raise bounds.entries_error(base)  # before a single entry is stat'ed or kept
    return found
