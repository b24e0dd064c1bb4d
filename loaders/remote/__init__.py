"""Preprocessing on CPU nodes: a dataset's batches made by remote workers on Ray (``remote=``).

``CachedIterableDataset(url, batch_size=256, transform=f, remote="ray")`` (or
``remote=RayPool(...)``) keeps the reading plan, the order and the resume state in the
training process, and has workers elsewhere in a Ray cluster read (through their own node's
cache), decode, transform and collate each batch; the batches come back in the plan's order.
Ray is optional (``pip install 'datacache[ray]'``): nothing here imports it until a pool starts.
"""

from __future__ import annotations

from datacache.loaders.remote._epoch import RemoteEpoch, remote_epoch, with_remote
from datacache.loaders.remote._pool import RayPool, check_remote

__all__ = ["RayPool", "RemoteEpoch", "check_remote", "remote_epoch", "with_remote"]
