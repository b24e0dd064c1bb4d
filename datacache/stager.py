"""The stager's public names, where they have always been imported from.

The implementation lives in `datacache.staging` (the `Stager` facade and its
parts) and `datacache.checksum` (the shard hash); new code imports from there.
This module re-exports `datacache.staging`'s names (its ``__all__``, one list)
and the two checksum helpers.
"""

from __future__ import annotations

from datacache import staging
from datacache.checksum import checksum_of, new_hasher
from datacache.staging import *  # noqa: F403 - staging's __all__ is the one list of these names

__all__ = ["checksum_of", "new_hasher"]
__all__ += staging.__all__
