"""Prometheus metrics of one daemon, in a private registry.

`DaemonMetrics` owns a `prometheus_client.CollectorRegistry` of its own (never
the global one, so that two daemons in one test process do not collide). It
is fed three ways: staging events from the `Stager` (`DaemonMetrics.on_event`),
the stager's counters read at scrape time (hits, misses, queue depth), and
values the daemon sets (tier usage, prefetch backlog, what clients report).

`METRICS` lists every metric family by its exposed base name, so the Grafana
dashboard in deploy/ can be checked against it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from datacache import __version__
from datacache.staging import StagerStats, StagingEvent

__all__ = ["CONTENT_TYPE", "METRICS", "DaemonMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)

METRICS: dict[str, str] = {
    # from staging events
    "datacache_read_bytes_total": "counter",
    "datacache_staged_bytes_total": "counter",
    "datacache_staged_shards_total": "counter",
    "datacache_evictions_total": "counter",
    "datacache_evicted_bytes_total": "counter",
    "datacache_staging_failures_total": "counter",
    "datacache_bypassed_total": "counter",
    "datacache_staging_seconds": "histogram",
    # from the stager's counters, at scrape time
    "datacache_hits_total": "counter",
    "datacache_misses_total": "counter",
    "datacache_checksum_failures_total": "counter",
    "datacache_origin_retries_total": "counter",
    "datacache_queue_depth": "gauge",
    "datacache_transfers_in_flight": "gauge",
    # set by the daemon
    "datacache_prefetch_pending": "gauge",
    "datacache_prefetch_slots": "gauge",
    "datacache_tier_used_bytes": "gauge",
    "datacache_tier_capacity_bytes": "gauge",
    "datacache_tier_device_free_bytes": "gauge",
    "datacache_tier_shards": "gauge",
    "datacache_requests_total": "counter",
    "datacache_request_seconds": "histogram",
    "datacache_client_delivered_bytes_per_second": "gauge",
    "datacache_client_data_stall_fraction": "gauge",
    "datacache_client_delivered_bytes_total": "counter",
    "datacache_client_remote_workers": "gauge",
    "datacache_clients": "gauge",
    "datacache_ready": "gauge",
    "datacache_start_time_seconds": "gauge",
    "datacache_build_info": "info",
}
"""Every metric family the daemon exposes, by exposed name, with its type."""


class _StagerCollector(Collector):
    """Reads the stager's own counters when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], StagerStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats() or StagerStats()
        hits = CounterMetricFamily(
            "datacache_hits", "Shards found resident on a tier when asked for", labels=["tier"]
        )
        for tier, count in sorted({"local": 0, "shared": 0, **stats.hits}.items()):
            hits.add_metric([tier], count)
        yield hits
        yield CounterMetricFamily(
            "datacache_misses",
            "Shards asked for that were not resident on the local tier",
            value=stats.misses,
        )
        yield CounterMetricFamily(
            "datacache_checksum_failures",
            "Copies whose bytes did not match their checksum",
            value=stats.checksum_failures,
        )
        yield CounterMetricFamily(
            "datacache_origin_retries",
            "Origin requests retried after a transient error",
            value=stats.retries,
        )
        yield GaugeMetricFamily(
            "datacache_queue_depth",
            "Staging jobs queued in the stager, not yet started",
            value=stats.queue_depth,
        )
        yield GaugeMetricFamily(
            "datacache_transfers_in_flight", "Staging jobs running now", value=stats.in_flight
        )

    def describe(self) -> Iterator[Any]:
        return iter(list(self.collect()))


class DaemonMetrics:
    """The metrics of one daemon; expose them with `render`.

    Parameters
    ----------
    stats
        Returns the stager's current counters (or ``None`` before it exists).
    """

    def __init__(self, stats: Callable[[], StagerStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # Registered in this order, which is the order /metrics lists them in.
        self._add_staging(r)
        self._add_tiers(r)
        self._add_serving(r)
        self._add_process(r)
        self.info.info({"version": __version__})
        self.start_time.set(time.time())
        for tier in ("origin", "shared"):
            self.read_bytes.labels(tier)
        for tier in ("local", "shared"):
            self.staged_bytes.labels(tier)
            self.evictions.labels(tier)
        r.register(_StagerCollector(stats))

    def _add_staging(self, r: CollectorRegistry) -> None:
        """What staging moved, evicted, failed or bypassed, and how long a shard took."""
        self.read_bytes = Counter(
            "datacache_read_bytes", "Bytes read from a tier to stage shards", ["tier"], registry=r
        )
        self.staged_bytes = Counter(
            "datacache_staged_bytes", "Bytes written to a tier by staging", ["tier"], registry=r
        )
        self.staged_shards = Counter(
            "datacache_staged_shards",
            "Shards staged onto a tier, by source tier",
            ["tier", "source"],
            registry=r,
        )
        self.evictions = Counter(
            "datacache_evictions", "Shards evicted from a tier", ["tier"], registry=r
        )
        self.evicted_bytes = Counter(
            "datacache_evicted_bytes", "Bytes evicted from a tier", ["tier"], registry=r
        )
        self.failures = Counter(
            "datacache_staging_failures", "Staging transfers that failed", ["tier"], registry=r
        )
        self.bypassed = Counter(
            "datacache_bypassed",
            "Shards read from the next tier because eviction kept what was resident",
            registry=r,
        )
        self.staging_seconds = Histogram(
            "datacache_staging_seconds",
            "Time to stage one shard onto a tier",
            ["tier", "source"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _add_tiers(self, r: CollectorRegistry) -> None:
        """Prefetch slots and backlog, and each tier's bytes, capacity, free space and shards."""
        self.prefetch_pending = Gauge(
            "datacache_prefetch_pending",
            "Prefetch and warm requests waiting for a prefetch slot",
            registry=r,
        )
        self.prefetch_slots = Gauge(
            "datacache_prefetch_slots",
            "Transfers prefetching may run at once (the rest serve readers)",
            registry=r,
        )
        self.tier_used = Gauge(
            "datacache_tier_used_bytes", "Bytes held on a tier", ["tier"], registry=r
        )
        self.tier_capacity = Gauge(
            "datacache_tier_capacity_bytes",
            "Configured capacity of a tier (absent when unbounded)",
            ["tier"],
            registry=r,
        )
        self.tier_free = Gauge(
            "datacache_tier_device_free_bytes",
            "Free bytes on the device holding a tier",
            ["tier"],
            registry=r,
        )
        self.tier_shards = Gauge(
            "datacache_tier_shards", "Shards held on a tier", ["tier"], registry=r
        )

    def _add_serving(self, r: CollectorRegistry) -> None:
        """The socket's requests and what clients report delivering."""
        self.requests = Counter(
            "datacache_requests",
            "Requests answered on the daemon's socket",
            ["verb", "code"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "datacache_request_seconds",
            "Time to answer a request on the socket",
            ["verb"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.client_bandwidth = Gauge(
            "datacache_client_delivered_bytes_per_second",
            "Bandwidth a client reports delivering to training",
            ["client"],
            registry=r,
        )
        self.client_stall = Gauge(
            "datacache_client_data_stall_fraction",
            "Fraction of wall time a client reports training waited for data",
            ["client"],
            registry=r,
        )
        self.client_bytes = Counter(
            "datacache_client_delivered_bytes",
            "Bytes clients report having delivered",
            ["client"],
            registry=r,
        )
        self.client_remote_workers = Gauge(
            "datacache_client_remote_workers",
            "Remote workers making a client's batches (a dataset with remote=)",
            ["client"],
            registry=r,
        )
        self.clients = Gauge(
            "datacache_clients", "Clients that reported in the last few minutes", registry=r
        )

    def _add_process(self, r: CollectorRegistry) -> None:
        """Whether the daemon serves, since when, and its version."""
        self.ready = Gauge(
            "datacache_ready",
            "1 when the daemon serves requests, 0 while starting or draining",
            registry=r,
        )
        self.start_time = Gauge(
            "datacache_start_time_seconds", "When the daemon started (Unix time)", registry=r
        )
        self.info = Info("datacache_build", "The datacache version", registry=r)

    def on_event(self, event: StagingEvent) -> None:
        """Count one `StagingEvent` (a `Stager` listener; runs on the event loop)."""
        kind = event.kind
        if kind == "bytes":
            self.read_bytes.labels(event.source or "origin").inc(event.size)
        elif kind == "staged":
            self.staged_bytes.labels(event.tier).inc(event.size)
            self.staged_shards.labels(event.tier, event.source).inc()
            self.staging_seconds.labels(event.tier, event.source).observe(event.seconds)
        elif kind == "evicted":
            self.evictions.labels(event.tier).inc()
            self.evicted_bytes.labels(event.tier).inc(event.size)
        elif kind == "failed":
            self.failures.labels(event.tier or "local").inc()
        elif kind == "bypass":
            self.bypassed.inc()

    def client_report(
        self, client: str, *, bandwidth: float, stall_fraction: float, delivered: int, remote_workers: int | None = None
    ) -> None:
        """Record what one client reports of its own delivery (and of its remote pool, if it has one)."""
        self.client_bandwidth.labels(client).set(bandwidth)
        self.client_stall.labels(client).set(stall_fraction)
        if remote_workers is not None:
            self.client_remote_workers.labels(client).set(remote_workers)
        if delivered > 0:
            self.client_bytes.labels(client).inc(delivered)

    def forget_client(self, client: str) -> None:
        """Drop a client that stopped reporting (bounds the label set)."""
        for metric in (self.client_bandwidth, self.client_stall, self.client_bytes, self.client_remote_workers):
            with contextlib.suppress(KeyError):
                metric.remove(client)

    def render(self) -> bytes:
        """The text exposition of every metric."""
        data: bytes = generate_latest(self.registry)
        return data
