"""A wids index or a listing page cannot lead the daemon out of an allowed prefix (issue 33 item 3).

The attacker (alice, another uid) may open ``http://HOST/ok/`` (``--allow-dataset``); the victim's
``private/`` sits beside it on the same "public" host, an address in a network namespace of its
own. What the attacker controls is inside ``ok/``: a wids index naming ``%2e%2e/private/...``,
``..%2fprivate/...`` or a ``base_path`` of ``%2e%2e/private``, and a page of links to the same.
Each was checked encoded and fetched decoded (the server resolves ``..`` after decoding); every
one must now be refused, and the host must see no request for ``private/``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import unquote

import _users
import pytest
from _daemon import make_shards
from _daemon_users import calls_as, serve_for
from _users import User
from test_daemon_allowlist import public_address

users = _users.users
world_dir = _users.world_dir
__all__ = ["public_address"]  # a fixture, used by name

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# A static site (directory pages as link lists) that logs each request's raw path to a file.
_LOGGING_SITE = r"""
import http.server, sys
address, root, log = sys.argv[1], sys.argv[2], sys.argv[3]

class Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=root, **kwargs)

    def send_head(self):
        with open(log, "a") as out:
            out.write(self.path + "\n")
        return super().send_head()

    def log_message(self, *args):
        return

server = http.server.ThreadingHTTPServer((address, 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _index(path: Path, urls: list[str], **extra: object) -> None:
    entries = [{"url": url, "nsamples": 1} for url in urls]
    path.write_text(json.dumps({"__kind__": "wids-shard-index-v1", "shardlist": entries, **extra}))


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


def test_an_index_cannot_name_what_lies_outside_the_allowed_prefix(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], public_address: tuple[str, object]
) -> None:
    site_root = world_dir / "site"
    make_shards(site_root / "ok" / "good", 1, 10_000, seed=1)
    make_shards(site_root / "private", 1, 10_000, seed=2)  # the victim's
    evil = site_root / "ok" / "evil"
    evil.mkdir()
    _index(evil / "up.json", ["%2e%2e/%2e%2e/private/shard-0000.tar"])
    _index(evil / "slash.json", ["..%2f..%2fprivate/shard-0000.tar"])
    _index(evil / "upper.json", ["%2E%2E/%2E%2E/private/shard-0000.tar"])
    _index(evil / "twice.json", ["%252e%252e/%252e%252e/private/shard-0000.tar"])
    _index(evil / "base.json", ["shard-0000.tar"], base_path="%2e%2e/%2e%2e/private")
    (evil / "links").mkdir()
    (evil / "links" / "index.html").write_text('<a href="%2e%2e/%2e%2e/%2e%2e/private/shard-0000.tar">x</a>')
    log = world_dir / "requests.log"
    log.touch()
    address, start_inside = public_address
    site = start_inside([sys.executable, "-c", _LOGGING_SITE, address, str(site_root), str(log)])  # type: ignore[operator]
    assert site.stdout is not None
    host = f"http://{address}:{int(site.stdout.readline())}"
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"{host}/ok/")
    try:
        names = ["up.json", "slash.json", "upper.json", "twice.json", "base.json", "links/"]
        urls = [f"{host}/ok/evil/{name}" for name in names]
        calls = [("POST", f"/v1/{verb}", {"dataset": url}) for url in urls for verb in ("open", "warm")]
        for (_, _, body), (status, reply) in zip(calls, calls_as(users["alice"], daemon, *calls), strict=True):
            assert status != 200 or "error" in str(reply), (body, status, reply)
            assert any(word in str(reply) for word in ("escaped", "decoded", "outside")), (body, reply)
        fetched = [unquote(unquote(line)) for line in log.read_text().splitlines()]
        assert not [path for path in fetched if "private" in path], fetched
        assert not [p for p in (world_dir / "cache").rglob("shard-*") if p.is_file()]
        ((status, reply),) = calls_as(users["alice"], daemon, ("POST", "/v1/open", {"dataset": f"{host}/ok/good/"}))
        assert status == 200 and reply["shards"] == 1, reply  # the allowed prefix itself is served
    finally:
        daemon.kill()
