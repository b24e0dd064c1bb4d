"""``python -m datacache.cli``: the same command as the ``datacache`` console script."""

from __future__ import annotations

import sys

from datacache.cli import main

sys.exit(main())
