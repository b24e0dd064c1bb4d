"""What a stager is doing: per-tier counters and the transfers in flight (for ``datacache top``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from datacache.staging.types import LOCAL, ORIGIN, SHARED, StagingEvent

__all__ = ["TierActivity", "TransferInFlight"]


@dataclass
class TransferInFlight:
    """A transfer in flight: which shard, onto which tier, from where, how far along."""

    dataset: str
    key: str
    tier: str
    source: str
    bytes: int
    started: float

    def to_json(self, size: int | None = None) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "key": self.key,
            "tier": self.tier,
            "source": self.source,
            "bytes": self.bytes,
            "size": size,
            "seconds": round(time.monotonic() - self.started, 3),
        }


class TierActivity:
    """Per-tier counters and the transfers in flight, fed by a stager's events (on its loop's thread).

    ``bytes_in[tier]`` are bytes staged onto a tier, ``bytes_out[tier]`` bytes read from it to make
    a copy above; ``declines`` counts copies not made because eviction kept what was resident.
    """

    def __init__(self) -> None:
        self.bytes_in: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.bytes_out: dict[str, int] = {ORIGIN: 0, SHARED: 0}
        self.evictions: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.evicted_bytes: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.declines: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.stored: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.stored_bytes: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self.transfers: dict[tuple[str, str, str], TransferInFlight] = {}

    def __call__(self, event: StagingEvent) -> None:
        kind, tier = event.kind, event.tier or LOCAL
        ident = (event.dataset, event.key, tier)
        if kind == "bytes":
            source = event.source or ORIGIN
            self.bytes_in[tier] = self.bytes_in.get(tier, 0) + event.size
            self.bytes_out[source] = self.bytes_out.get(source, 0) + event.size
            transfer = self.transfers.get(ident)
            if transfer is None:
                self.transfers[ident] = TransferInFlight(
                    event.dataset, event.key, tier, source, event.size, time.monotonic()
                )
            else:
                transfer.bytes += event.size
        elif kind == "started":
            if ident not in self.transfers:
                source = event.source or ORIGIN
                self.transfers[ident] = TransferInFlight(event.dataset, event.key, tier, source, 0, time.monotonic())
        elif kind in ("staged", "failed"):
            self.transfers.pop(ident, None)
            if kind == "staged":
                self.stored[tier] = self.stored.get(tier, 0) + 1
                self.stored_bytes[tier] = self.stored_bytes.get(tier, 0) + event.size
        elif kind == "evicted":
            self.evictions[tier] = self.evictions.get(tier, 0) + 1
            self.evicted_bytes[tier] = self.evicted_bytes.get(tier, 0) + event.size
        elif kind == "bypass":
            self.transfers.pop(ident, None)
            self.declines[tier] = self.declines.get(tier, 0) + 1

    def held_change(self, tier: str) -> tuple[int, int]:
        """Bytes and shards this process added to ``tier``, less what it evicted there, so far."""
        return (
            self.stored_bytes.get(tier, 0) - self.evicted_bytes.get(tier, 0),
            self.stored.get(tier, 0) - self.evictions.get(tier, 0),
        )

    def counters(self) -> dict[str, dict[str, int]]:
        """The cumulative counters, per tier."""
        return {
            "bytes_in": dict(self.bytes_in),
            "bytes_out": dict(self.bytes_out),
            "evictions": dict(self.evictions),
            "evicted_bytes": dict(self.evicted_bytes),
            "declines": dict(self.declines),
        }

    def in_flight(self) -> list[TransferInFlight]:
        return sorted(self.transfers.values(), key=lambda t: t.started)
