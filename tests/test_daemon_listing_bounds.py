"""One open cannot take the daemon from everyone (issue 33 item 6).

A listing page of four million links took the daemon from 58 MB to 1.8 GB RSS and stalled
other uids for a minute; with a million it kept sending a HEAD per link after its client had
left. A listing now stops at its bounds (entries, bytes of pages; each error names the setting
that raises it), a uid opens a few datasets at once at most, and a client that leaves takes its
listing with it. The origin is a real HTTP server that counts what reaches it; every wait is on
an event the server sets, none on time.
"""

from __future__ import annotations

import http.server
import json
import select
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon_users import CALLS_SCRIPT, calls_as, serve_for
from _users import User, user_env

users = _users.users
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

_WAIT = 120.0
"""How long a test waits for an event the server sets before it fails (never a measured duration)."""


class _Handler(http.server.BaseHTTPRequestHandler):
    """What `Origin` answers (its server is the `Origin`)."""

    protocol_version = "HTTP/1.1"
    server: Origin

    def do_GET(self) -> None:
        origin = self.server
        folder, _, name = self.path.strip("/").partition("/")
        if self.command == "HEAD" and name:  # a shard's HEAD (not a page's)
            with origin.lock:
                origin.heads[folder] += 1
                number = origin.heads[folder]
            if folder == "slow" and number == 3:
                self._hold()
                return
        if not name:
            self._page(folder)
        elif folder in ("small", "slow"):
            self._send(b"x" * 1000, "application/x-tar")
        else:
            self._send(b"", "text/plain", status=404)

    do_HEAD = do_GET

    def _hold(self) -> None:
        """Answer nothing until the client (the daemon) closes the connection: then say it did."""
        self.server.held.set()
        readable, _, _ = select.select([self.connection], [], [], _WAIT)
        if readable and self.connection.recv(1, socket.MSG_PEEK) == b"":
            self.server.abandoned.set()  # the daemon dropped this request: its listing stopped
        self.close_connection = True

    def _page(self, folder: str) -> None:
        if folder == "huge":
            self.server.asked.set()
            self.server.release.wait(_WAIT)
            links = [f"s-{i:07d}.tar" for i in range(5_000)]
        elif folder == "big":
            links = ["s-0.tar", "x" * (2 << 20)]
        elif folder == "slow":
            links = [f"s-{i:04d}.tar" for i in range(50)]
        else:
            links = ["one.tar"]
        page = "".join(f'<a href="{link}">{link}</a>\n' for link in links)
        self._send(page.encode(), "text/html")

    def _send(self, body: bytes, kind: str, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        return


class Origin(http.server.ThreadingHTTPServer):
    """Listing pages under /huge/ (5,000 links), /big/ (2 MB), /small/ (one shard), /slow/ (50 links).

    /huge/ is answered only once ``release`` is set (``asked`` is set when it is asked for);
    the third HEAD of /slow/ is held until its client (the daemon) closes the connection,
    which sets ``abandoned``; ``heads`` counts the HEADs of each folder's shards.
    """

    def __init__(self) -> None:
        self.asked, self.release = threading.Event(), threading.Event()
        self.held, self.abandoned = threading.Event(), threading.Event()
        self.heads: Counter[str] = Counter()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        self.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def origin() -> Iterator[Origin]:
    server = Origin()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


def _bounded(world_dir: Path) -> tuple[str, str]:
    """The daemon's ``--config`` flag: listings of at most 1,000 entries and 1 MB of pages."""
    config = world_dir / "datacache.toml"
    config.write_text('[staging]\nlisting_max_entries = 1000\nlisting_max_bytes = "1MB"\n')
    return "--config", str(config)


def _open(url: str) -> tuple[str, str, dict[str, str]]:
    return ("POST", "/v1/open", {"dataset": url})


def test_a_huge_listing_is_refused_by_its_bound_while_other_uids_are_served(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], origin: Origin
) -> None:
    allow = ("--allow-dataset", f"{origin.url}/", "--opens-per-client", "1")
    daemon = serve_for(users, world_dir, base_env, *allow, *_bounded(world_dir))
    try:
        replies: list[tuple[int, Any]] = []
        attacker = threading.Thread(
            target=lambda: replies.extend(calls_as(users["alice"], daemon, _open(f"{origin.url}/huge/")))
        )
        attacker.start()
        assert origin.asked.wait(_WAIT), "the daemon never asked for the huge page"
        # While alice's listing is in flight: another uid is served; alice's next open is refused at once.
        status, reply = daemon.request("POST", "/v1/open", {"dataset": f"{origin.url}/small/"})
        assert status == 200 and reply["shards"] == 1, reply
        ((status, second),) = calls_as(users["alice"], daemon, _open(f"{origin.url}/small/"))
        assert status == 400 and "--opens-per-client" in second["error"]["message"], second
        origin.release.set()
        attacker.join(_WAIT)
        [(status, huge)] = replies
        message = huge["error"]["message"]
        assert status == 400 and "more than 1,000 entries" in message and "listing_max_entries" in message, huge
        assert origin.heads["huge"] == 0  # refused from the page alone: not one HEAD for its links
        ((status, big),) = calls_as(users["alice"], daemon, _open(f"{origin.url}/big/"))
        assert status == 400 and "listing_max_bytes" in big["error"]["message"], big
        ((status, small),) = calls_as(users["alice"], daemon, _open(f"{origin.url}/small/"))
        assert status == 200 and small["shards"] == 1, small  # her slot is free again
    finally:
        daemon.kill()


def test_a_client_that_leaves_stops_its_listing(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], origin: Origin
) -> None:
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"{origin.url}/", *_bounded(world_dir))
    alice = users["alice"]
    calls = json.dumps([_open(f"{origin.url}/slow/")])
    client = subprocess.Popen(
        [sys.executable, "-c", CALLS_SCRIPT, str(daemon.socket), calls],
        user=alice.uid,
        group=alice.gid,
        extra_groups=list(alice.groups),
        env=user_env(alice),
        cwd=alice.home,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert origin.held.wait(_WAIT), "the listing never reached its third HEAD"
        client.kill()
        client.wait()
        assert origin.abandoned.wait(_WAIT), "the daemon kept the listing going after its client left"
        # A later request that reaches the same origin: the left listing's next HEAD would come first.
        status, reply = daemon.request("POST", "/v1/open", {"dataset": f"{origin.url}/small/"})
        assert status == 200, reply
        assert origin.heads["slow"] == 3, origin.heads
    finally:
        client.kill()
        client.wait()
        daemon.kill()


def test_a_listing_that_stalls_ends_at_listing_timeout_naming_it(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], origin: Origin
) -> None:
    """A listing whose origin stops answering (the third HEAD of /slow/ is never answered) ends at its bound."""
    config = world_dir / "datacache.toml"
    config.write_text("[staging]\nlisting_timeout = 2\n")  # a bound, not a measured duration
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"{origin.url}/", "--config", str(config))
    try:
        status, reply = daemon.request("POST", "/v1/open", {"dataset": f"{origin.url}/slow/"}, timeout=_WAIT)
        message = reply["error"]["message"]
        assert status >= 400 and "took longer than 2s" in message and "listing_timeout" in message, reply
        assert origin.abandoned.wait(_WAIT), "the stalled request was left open after the listing ended"
        status, reply = daemon.request("POST", "/v1/open", {"dataset": f"{origin.url}/small/"})
        assert status == 200 and reply["shards"] == 1, reply  # the daemon serves on
    finally:
        daemon.kill()
