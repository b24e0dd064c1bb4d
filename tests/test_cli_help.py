"""What `datacache serve --help` says of a flag and what docs/DAEMON.md says of it are the same words."""

from __future__ import annotations

import re
import subprocess

import pytest
from _helpers import DATACACHE, REPO


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@pytest.mark.parametrize("flag", ["--allow-dataset"])
def test_serve_help_and_the_daemon_doc_say_the_same_of_a_flag(flag: str) -> None:
    shown = subprocess.run([*DATACACHE, "serve", "--help"], capture_output=True, text=True, check=True, cwd=REPO)
    rows = [line for line in (REPO / "docs" / "DAEMON.md").read_text().splitlines() if f"`{flag} " in line]
    assert len(rows) == 1, rows
    documented = _words(rows[0].split("|")[1])
    assert documented in _words(shown.stdout), (documented, shown.stdout)
