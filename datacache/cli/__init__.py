"""The ``datacache`` command: warm, ls, status, evict, and the programs built on them.

Every failure ends with one line on stderr naming what is wrong, and a
non-zero exit status: 1 for a failed operation, 2 for bad usage, 130 when
interrupted. One module per group of verbs (`_warm`, `_cache`, `_build`,
`_node`), each adding its own subparsers; `_main` assembles them.
"""

from __future__ import annotations

from datacache.cli._main import main, parse_args
from datacache.cli._node import serve_settings

__all__ = ["main", "parse_args", "serve_settings"]
