"""The origins a stager reads: one client per dataset, storage options and URL, never inside the cache."""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from datacache.config import DatasetConfig, Settings
from datacache.errors import ConfigError
from datacache.tiers import ListingBounds, Tier, open_origin

__all__ = ["Origins", "close_quietly"]


class Origins:
    """The origin tiers a stager opened, kept while its event loop lives.

    One client per dataset, storage options and URL: a second set of options
    (another user's credentials, through the daemon) never rides on the first's.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._tiers: dict[tuple[str, str, str], Tier] = {}
        self.bounds = ListingBounds(max_entries=settings.listing_max_entries, max_bytes=settings.listing_max_bytes)
        """What one listing of an origin may hold (the settings ``listing_max_entries``, ``listing_max_bytes``)."""

    def get(self, dataset: DatasetConfig, url: str | None = None) -> Tier:
        """The tier that reads ``dataset``'s origin at its URL (or at ``url``, its parent)."""
        url = url or dataset.url
        ident = (dataset.id, _options_digest(dataset.storage_options), url)
        origin = self._tiers.get(ident)
        if origin is None:
            self._check_outside_tiers(url)
            origin = open_origin(
                url, storage_options=dataset.storage_options, retry=self._settings.retry, listing=self.bounds
            )
            self._tiers[ident] = origin
        return origin

    def tiers(self) -> list[Tier]:
        return list(self._tiers.values())

    def retries(self) -> int:
        """Requests retried after a transient error, over every origin (safe from any thread)."""
        return sum(origin.stats().retries for origin in self.tiers())

    async def close(self) -> None:
        """Close every client and forget them."""
        tiers, self._tiers = self.tiers(), {}
        await close_quietly(tiers)

    def _check_outside_tiers(self, url: str) -> None:
        if "://" in url and not url.startswith("file://"):
            return
        path = Path(url.removeprefix("file://")).absolute()
        for tier_dir in (self._settings.local_dir, self._settings.shared_dir):
            if tier_dir is not None and (path == tier_dir or tier_dir in path.parents):
                raise ConfigError(f"origin {path} lies inside the cache directory {tier_dir}; use another folder")


def _options_digest(options: Mapping[str, Any]) -> str:
    """A digest of storage options (credentials among them), to key clients without holding secrets in keys."""
    encoded = json.dumps(options, sort_keys=True, default=str).encode()
    return hashlib.sha256(encoded).hexdigest()


async def close_quietly(origins: Iterable[Tier]) -> None:
    """Close clients, also those whose loop is gone: what can be closed from here is; the rest is dropped."""
    for origin in origins:
        with contextlib.suppress(Exception):
            await origin.close()
