"""A manifest saved as one columnar file that every process of the node maps (`columns`), and read back.

Only this node's own manifest directory holds one, and a process maps it only when it is a regular
file (reached without following a link), owned by a trusted uid, writable by no one else, of at
most `MAX_MANIFEST_BYTES`, whose digest matches its bytes; anything else is refused and the
manifest is taken from the JSON beside it or listed again.
"""

from __future__ import annotations

import errno
import logging
import os
import stat as stat_module
from collections.abc import AsyncIterator
from typing import Any

from datacache.errors import ConfigError, InvalidKeyError
from datacache.manifest.columns import encode, map_table
from datacache.manifest.model import Manifest, ShardFormat
from datacache.tiers import redact_url
from datacache.tiers.files import Place

__all__ = ["COLUMNS_SUFFIX", "columns_body", "map_manifest"]

logger = logging.getLogger(__name__)

COLUMNS_SUFFIX = ".columns"
"""A dataset's columnar manifest is ``<dataset id>.columns`` beside its ``.json``."""
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def columns_body(manifest: Manifest) -> AsyncIterator[bytes]:
    """The bytes of ``manifest``'s columnar file, for `atomic_write`."""
    header = {
        "dataset": manifest.dataset,
        "url": redact_url(manifest.url),  # a file on disk: no credentials in it
        "format": manifest.format.value,
        "created": manifest.created,
        "snapshot": manifest.snapshot,
        "extra": dict(manifest.extra),
    }
    pieces = encode(header, manifest.table)

    async def body() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    return body()


class _Untrusted(ConfigError):
    """The file's owner is not one this reader takes a manifest from."""


def map_manifest(
    place: Place, trusted: frozenset[int], limit: int, *, others_expected: bool = False
) -> Manifest | None:
    """The manifest of the columnar file at ``place``, mapped read-only; None if absent or refused (logged).

    ``others_expected``: a file of an untrusted owner is the usual case (another user's or the daemon's
    listing on the shared tier), passed over at debug level, not warned of.
    """
    try:
        parent = place.open_parent()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, InvalidKeyError) as exc:
        logger.warning("ignoring manifest %s: %s", place.path, exc)
        return None
    try:
        fd = os.open(place.name, _READ_FLAGS, dir_fd=parent)
    except (FileNotFoundError, PermissionError):  # none, or another user's own (0600): not this reader's
        return None
    except OSError as exc:
        reason = "a symlink; not followed" if exc.errno == errno.ELOOP else str(exc)
        logger.warning("ignoring manifest %s: %s", place.path, reason)
        return None
    finally:
        os.close(parent)
    try:
        return _mapped(fd, place, trusted, limit)
    except _Untrusted as exc:
        logger.log(logging.DEBUG if others_expected else logging.WARNING, "ignoring manifest %s: %s", place.path, exc)
        return None
    except ConfigError as exc:
        logger.warning("ignoring manifest %s: %s", place.path, exc)
        return None
    finally:
        os.close(fd)


def _mapped(fd: int, place: Place, trusted: frozenset[int], limit: int) -> Manifest:
    st = os.fstat(fd)
    if not stat_module.S_ISREG(st.st_mode):
        raise ConfigError("not a regular file")
    if st.st_uid not in trusted:
        whose = "this user, root or the daemon" if len(trusted) > 1 else "this user (only its own listing is taken)"
        raise _Untrusted(f"not a file of {whose}")
    if st.st_mode & (stat_module.S_IWGRP | stat_module.S_IWOTH):
        raise ConfigError(f"writable by others (mode {stat_module.S_IMODE(st.st_mode):o})")
    if st.st_size > limit:
        raise ConfigError(f"{st.st_size} bytes, more than the {limit} expected")
    header, table = map_table(fd, st.st_size, str(place.path))
    try:
        manifest = _manifest_of(header, table)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"an unreadable header ({exc})") from None
    # The snapshot was computed from these columns before they were written, and the digest
    # says they are unchanged: walking 1e6 shards again to compute it would cost seconds.
    manifest.__dict__["snapshot"] = str(header["snapshot"])
    return manifest


def _manifest_of(header: dict[str, Any], table: Any) -> Manifest:
    extra = header["extra"]
    if not isinstance(extra, dict):
        raise TypeError("'extra' must be an object")
    return Manifest(
        dataset=str(header["dataset"]),
        url=str(header["url"]),
        format=ShardFormat(str(header["format"])),
        shards=table,
        created=float(header["created"]),
        extra=extra,
    )
