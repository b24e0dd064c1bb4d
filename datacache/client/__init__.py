"""`DaemonClient`: the `ShardAccess` verbs answered by the node's daemon over its Unix socket.

The client (`_daemon_client`) and the HTTP it speaks over the socket (`_http`: a connector that
checks who listens, replies decoded, files read as the daemon names them).
"""

from __future__ import annotations

from datacache.client._daemon_client import DaemonClient

__all__ = ["DaemonClient"]
