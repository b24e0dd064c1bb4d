"""`ShardAccessTests` run against every `ShardAccess`: the stager, the daemon's client, and failover.

Issue 12 item 24: the three implementations behaved differently (a corrupt
cached copy: the stager dropped and re-read it, the daemon client raised).
One suite, the same answers from each.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _daemon import DaemonProcess, start_daemon

from datacache._outage import OutageAccess
from datacache.access import FailoverAccess, ShardAccess
from datacache.client import DaemonClient
from datacache.config import Settings, load_settings
from datacache.staging import Stager
from datacache.testing import ShardAccessTests


def _environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), XDG_CONFIG_HOME=str(home / ".config"))
    return env


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the module's tests: each test reads a dataset of its own."""
    root = tmp_path_factory.mktemp("daemon-node")
    process = start_daemon(_environment(root / "home"), root / "local")
    try:
        yield process
    finally:
        process.stop()


def _node_of(daemon: DaemonProcess) -> Settings:
    return load_settings(
        daemon.env, overrides={"local_dir": str(daemon.local_dir), "socket": str(daemon.socket)}
    )


class TestStager(ShardAccessTests):
    @pytest.fixture
    def node(self, tmp_path: Path) -> Settings:
        return load_settings(_environment(tmp_path / "home"), overrides={"local_dir": str(tmp_path / "local")})

    def make_access(self, settings: Settings) -> ShardAccess:
        return Stager(settings)


class TestDaemonClient(ShardAccessTests):
    @pytest.fixture
    def node(self, daemon: DaemonProcess) -> Settings:
        return _node_of(daemon)

    def make_access(self, settings: Settings) -> ShardAccess:
        return DaemonClient(settings)


class TestFailoverToTheDaemon(ShardAccessTests):
    @pytest.fixture
    def node(self, daemon: DaemonProcess) -> Settings:
        return _node_of(daemon)

    def make_access(self, settings: Settings) -> ShardAccess:
        return FailoverAccess(DaemonClient(settings), settings)


class TestFailoverWithoutADaemon(ShardAccessTests):
    """The daemon's socket answers nobody: every verb is the fallback stager's."""

    @pytest.fixture
    def node(self, tmp_path: Path) -> Settings:
        return load_settings(
            _environment(tmp_path / "home"),
            overrides={"local_dir": str(tmp_path / "local"), "socket": str(tmp_path / "nobody.sock")},
        )

    def make_access(self, settings: Settings) -> ShardAccess:
        return FailoverAccess(DaemonClient(settings, connect_timeout=1.0), settings)


class TestOutageAccess(ShardAccessTests):
    """A reader who may not write the daemon's cache, while the daemon is away (issue 34 item 1)."""

    @pytest.fixture
    def node(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
        # Its own copies go under TMPDIR: this test's, not the machine's /tmp.
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
        (tmp_path / "tmp").mkdir()
        return load_settings(_environment(tmp_path / "home"), overrides={"local_dir": str(tmp_path / "daemons")})

    def make_access(self, settings: Settings) -> ShardAccess:
        return OutageAccess(settings)
