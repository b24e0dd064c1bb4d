"""datacache: tiered caching of AI training data, from object storage to the GPU."""

from __future__ import annotations

from datacache.errors import DatacacheError

__all__ = ["DatacacheError", "__version__"]

__version__ = "0.1.0"
