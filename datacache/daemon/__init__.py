"""The per-node daemon, ``datacache serve``: one stager and one cache for every process of a node.

Clients (`datacache.client.DaemonClient`, reached through
`datacache.access.open_access`) talk to it over a Unix domain socket with
HTTP/JSON; docs/DAEMON.md describes the protocol. This package imports
neither torch nor `datacache.loaders`, so the sidecar image runs without them.
"""

from __future__ import annotations

from datacache.daemon._scheduler import PrefetchScheduler, default_prefetch_slots
from datacache.daemon._server import Daemon, DaemonOptions, serve
from datacache.daemon._status import dataset_rows

__all__ = ["Daemon", "DaemonOptions", "PrefetchScheduler", "dataset_rows", "default_prefetch_slots", "serve"]
