"""The daemon among several real users: who may call it, and what a caller may make it do.

The daemon runs as root (a real subprocess); its clients run as throwaway users
(`tests/_users.py`): ``alice`` and ``bob`` share the group the socket belongs to,
``mallory`` does not. Each test attacks as docs/SECURITY.md ("The daemon")
describes and checks the attack fails, with a control that the same request
succeeds where it is allowed.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import make_shards, start_daemon
from _daemon_users import calls_as, error_code, serve_for
from _users import User, run_as

from datacache.config import dataset_id_for, load_settings

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

class _Listener(http.server.ThreadingHTTPServer):
    """A local HTTP service (think: the cloud metadata service) that records what reaches it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        listener = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                listener.seen.append((self.path, self.headers.get("Authorization", "")))
                body = b'{"AccessKeyId": "ASIA-LEAKED"}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_HEAD = do_GET

            def do_PUT(self) -> None:
                self.do_GET()

            def log_message(self, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def listener() -> Iterator[_Listener]:
    server = _Listener()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def base_env(tmp_path: Path, cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


# -- who may call: every verb, end to end (issue 11 item 11) ---------------------------------


def _every_route(tmp_path: Path) -> list[tuple[str, str]]:
    from datacache.daemon import Daemon

    app = Daemon(load_settings({}, overrides={"local_dir": str(tmp_path / "probe")}))._app()
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource and r.method != "HEAD"}
    return sorted(routes)


def test_a_disallowed_uid_gets_forbidden_for_every_verb_over_the_socket(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], tmp_path: Path
) -> None:
    routes = _every_route(tmp_path)
    assert ("POST", "/v1/evict") in routes and ("GET", "/v1/status") in routes
    daemon = serve_for(users, world_dir, base_env)
    try:
        calls = [(method, path, {} if method == "POST" else None) for method, path in routes]
        refused = calls_as(users["bob"], daemon, *calls)  # bob reaches the socket (group) but is not allowed
        for (method, path), (status, reply) in zip(routes, refused, strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (method, path, status, reply)
            assert str(users["bob"].uid) in reply["error"]["message"]
        allowed = calls_as(users["alice"], daemon, *calls)
        for (method, path), (status, reply) in zip(routes, allowed, strict=True):
            assert status != 403, (method, path, reply)
        # mallory is not in the socket's group: the kernel refuses her before the daemon sees her.
        ((status, reply),) = calls_as(users["mallory"], daemon, ("GET", "/v1/status", None))
        assert status == 0 and "Permission denied" in reply["os_error"]
    finally:
        daemon.kill()


def test_a_member_of_the_allowed_group_by_supplementary_membership_is_admitted(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """On a cluster the allowed group is a supplementary one (issue 24 item 2, issue 23 item 11)."""
    bob = users["bob"]
    team = bob.groups[0]
    assert bob.gid != team  # bob's primary group is his own; team is supplementary
    daemon = start_daemon(
        base_env, world_dir / "cache", "--socket-group", str(team), "--allow-gid", str(team),
        socket_path=world_dir / "run" / "daemon.sock", log=world_dir / "daemon.log",
    )
    try:
        ((status, reply),) = calls_as(bob, daemon, ("GET", "/v1/status", None))
        assert status == 200, reply
        # Without the group among his supplementary ones, the same uid is refused.
        alone = User(name=bob.name, uid=bob.uid, gid=bob.gid, groups=())
        (world_dir / "run").chmod(0o755)
        daemon.socket.chmod(0o666)
        ((status, reply),) = calls_as(alone, daemon, ("GET", "/v1/status", None))
        assert (status, error_code(reply)) == (403, "forbidden"), reply
    finally:
        daemon.kill()


# -- the daemon acts with its client's authority, not its own (issue 11 item 4) ------------------


def _private_dataset(owner: User) -> Path:
    """A dataset in ``owner``'s 0700 home: nobody else may read it, but the root daemon could."""
    private = owner.home / "private"
    make_shards(private, 2, 10_000)
    for path in (private, *private.iterdir()):
        os.chown(path, owner.uid, owner.gid)
    private.chmod(0o700)
    return private


def test_a_client_cannot_make_the_daemon_read_files_it_cannot_read(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    private = _private_dataset(users["bob"])
    data = world_dir / "data"
    make_shards(data / "public", 2, 10_000)
    (data / "escape").symlink_to(private)
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"file://{data}/")
    try:
        attacks = [
            ("POST", "/v1/open", {"dataset": f"file://{private}/"}),
            ("POST", "/v1/open", {"dataset": str(private)}),
            ("POST", "/v1/open", {"dataset": "file:///proc/self/"}),
            ("POST", "/v1/open", {"dataset": f"file://{data}/../../{private}/"}),
            ("POST", "/v1/open", {"dataset": f"file://{data}/escape/"}),  # a link out of the allowed root
            ("POST", "/v1/warm", {"dataset": f"file://{private}/"}),
        ]
        for (_, _, body), (status, reply) in zip(attacks, calls_as(users["alice"], daemon, *attacks), strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (body, status, reply)
        ((status, reply),) = calls_as(
            users["alice"], daemon, ("POST", "/v1/open", {"dataset": f"file://{data}/public/"})
        )
        assert status == 200 and reply["shards"] == 2, reply  # the allowed root is served
        assert not list((world_dir / "cache").glob("data/*private*"))
    finally:
        daemon.kill()


def test_no_ssrf_to_loopback_and_no_endpoint_override_with_the_daemons_credentials(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], listener: _Listener, s3: Any
) -> None:
    s3.put("wds/shard-0.tar", b"x" * 1000)
    env = {
        **base_env,
        **s3.server.env(),
        "AWS_ACCESS_KEY_ID": "AKIADAEMONOWNKEY",
        "AWS_SECRET_ACCESS_KEY": "daemon-secret",
    }
    daemon = serve_for(users, world_dir, env, "--allow-dataset", "http://", "--allow-dataset", f"{s3.url('wds')}/")
    wds = s3.url("wds")

    def wire(**options: Any) -> dict[str, Any]:
        return {"dataset": {"name": dataset_id_for(wds), "url": wds, "storage_options": options}}

    try:
        attacks = [
            ("POST", "/v1/open", {"dataset": f"{listener.url}/latest/meta-data/iam/security-credentials/"}),
            ("POST", "/v1/open", {"dataset": "http://localhost:1/x/"}),
            (
                "POST",
                "/v1/open",
                {
                    "dataset": {
                        "name": dataset_id_for(wds),
                        "url": wds,
                        "storage_options": {"endpoint_url": listener.url},
                    }
                },
            ),
            (
                "POST",
                "/v1/warm",
                {
                    "dataset": {
                        "name": dataset_id_for(wds),
                        "url": wds,
                        "storage_options": {"endpoint_url": listener.url},
                    }
                },
            ),
            (
                "POST",
                "/v1/open",
                {
                    "dataset": {
                        "name": dataset_id_for(wds),
                        "url": wds,
                        "storage_options": {"client_kwargs": {"endpoint_url": listener.url}},
                    }
                },
            ),
            (
                "POST",
                "/v1/open",
                {
                    "dataset": {
                        "name": dataset_id_for(wds),
                        "url": wds,
                        "storage_options": {"key": "AKIAOTHER", "secret": "s"},
                    }
                },
            ),
        ]
        for (_, _, body), (status, reply) in zip(attacks, calls_as(users["alice"], daemon, *attacks), strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (body, status, reply)
        assert listener.seen == []  # nothing reached the local service, with or without the daemon's key
        # The operator's own dataset, with the daemon's own endpoint and credentials, is served.
        ((status, reply),) = calls_as(users["alice"], daemon, ("POST", "/v1/open", {"dataset": wds}))
        assert status == 200 and reply["shards"] == 1, reply
        assert "daemon-secret" not in daemon.log_text() and "AKIADAEMONOWNKEY" not in daemon.log_text()
    finally:
        daemon.kill()


def test_a_name_cannot_rebind_another_users_dataset_to_another_origin(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    data = world_dir / "data"
    real = make_shards(data / "wds", 2, 10_000, seed=1)
    make_shards(data / "evil", 2, 10_000, seed=2)
    daemon = serve_for(
        users, world_dir, base_env, "--allow-dataset", f"file://{data}/", "--allow-uid", str(users["bob"].uid)
    )
    owner_url = f"file://{data}/wds"
    dataset = dataset_id_for(owner_url)
    try:
        ((status, opened),) = calls_as(users["alice"], daemon, ("POST", "/v1/open", {"dataset": owner_url}))
        assert status == 200 and opened["dataset_id"] == dataset, opened
        hijack = {"dataset": {"name": dataset, "url": f"file://{data}/evil/"}}
        for status, reply in calls_as(users["bob"], daemon, ("POST", "/v1/open", hijack), ("POST", "/v1/warm", hijack)):
            # The name is only an alias: bob gets the evil origin under its own id, never alice's.
            assert status == 200, reply
            assert dataset not in json.dumps(reply), reply
        ((status, location),) = calls_as(
            users["alice"], daemon, ("POST", "/v1/ensure", {"dataset": dataset, "key": "shard-0000.tar"})
        )
        assert status == 200, location
        assert Path(location["path"]).read_bytes() == real["shard-0000.tar"]
    finally:
        daemon.kill()


# -- the verbs that change a dataset are scoped to who opened it (issue 11 item 10) -------------


def test_evict_pin_and_report_corrupt_only_for_datasets_the_caller_opened(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    data = world_dir / "data"
    make_shards(data / "wds", 2, 10_000)
    daemon = serve_for(
        users, world_dir, base_env, "--allow-dataset", f"file://{data}/", "--allow-uid", str(users["bob"].uid)
    )
    url = f"file://{data}/wds"
    dataset = dataset_id_for(url)
    shard = {"dataset": dataset, "key": "shard-0000.tar"}
    try:
        (status, _), (status2, _) = calls_as(
            users["alice"], daemon, ("POST", "/v1/open", {"dataset": url}), ("POST", "/v1/ensure", shard)
        )
        assert status == status2 == 200
        attacks = [
            ("POST", "/v1/evict", {"dataset": dataset}),
            ("POST", "/v1/evict", {"dataset": dataset, "tier": "all"}),
            ("POST", "/v1/pin", {"dataset": dataset}),
            ("POST", "/v1/unpin", {"dataset": dataset}),
        ]
        for (_, _, body), (status, reply) in zip(attacks, calls_as(users["bob"], daemon, *attacks), strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (body, status, reply)
        for verb in ("report_corrupt", "future_order", "locate", "progress"):  # progress locates too
            body = {**shard, "keys": [], "locate": [shard["key"]]}
            ((status, reply),) = calls_as(users["bob"], daemon, ("POST", f"/v1/{verb}", body))
            assert (status, error_code(reply)) == (409, "unknown_dataset"), (verb, reply)
        ((status, location),) = calls_as(users["alice"], daemon, ("POST", "/v1/locate", shard))
        assert location["tier"] == "local"  # still resident
        # The owner may, but only on its node's local tier: the shared tier is every node's.
        owner = calls_as(
            users["alice"],
            daemon,
            ("POST", "/v1/evict", {"dataset": dataset, "tier": "all"}),
            ("POST", "/v1/evict", {"dataset": dataset}),
        )
        assert (owner[0][0], error_code(owner[0][1])) == (403, "forbidden")
        assert owner[1][0] == 200 and owner[1][1]["shards"] == 1, owner
    finally:
        daemon.kill()


def test_the_cli_evicts_a_dataset_its_user_opened_before_the_daemon_restarted(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A daemon forgets who opened what when it restarts: `datacache evict URL` by alice then said she
    may evict only datasets she opened in this daemon. The CLI opens it first: the daemon's read rules
    judge her again (a uid they refuse stays refused: tests/test_access_rule.py)."""
    data = world_dir / "data"
    make_shards(data / "wds", 2, 10_000)
    url = f"file://{data}/wds"
    shard = {"dataset": dataset_id_for(url), "key": "shard-0000.tar"}
    args = ("--allow-dataset", f"file://{data}/")
    daemon = serve_for(users, world_dir, base_env, *args, team_gid=True)
    try:
        opened = ("POST", "/v1/open", {"dataset": url})
        replies = calls_as(users["alice"], daemon, opened, ("POST", "/v1/ensure", shard))
        assert [status for status, _ in replies] == [200, 200], replies
    finally:
        daemon.kill()
    daemon = serve_for(users, world_dir, base_env, *args, team_gid=True)
    try:
        env = _users.user_env(users["alice"], {"DATACACHE_SOCKET": str(daemon.socket)})
        done = _users.cli_as(users["alice"], "evict", url, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("evicted 1 shards"), done.stdout
        # `--tier all`: the local copies go, the shared tier is the operator's; both are said.
        assert [status for status, _ in calls_as(users["alice"], daemon, opened, ("POST", "/v1/ensure", shard))] == [
            200,
            200,
        ]
        both = _users.cli_as(users["alice"], "evict", url, "--tier", "all", env=env)
        assert both.returncode != 0
        assert both.stdout.startswith("evicted 1 shards") and "from local (daemon); not from shared:" in both.stdout
        assert "only root or the daemon's uid may evict from the shared tier" in both.stderr, both.stderr
    finally:
        daemon.kill()


def test_a_daemon_whose_files_are_not_its_clients_group_says_so_and_so_do_they(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A trial ran the daemon as its own account with that account's group: its clients reached the
    socket but could not read the manifests it wrote, and were told to mount the cache directory
    "as in the daemon's container" (there was none). The daemon warns at start; the client names the fix."""
    data = world_dir / "data"
    make_shards(data / "wds", 2, 10_000)
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"file://{data}/")  # root's group
    try:
        log = daemon.log.read_text()
        assert "the daemon's clients cannot read the manifests and shards it writes" in log, log
        env = _users.user_env(users["alice"], {"DATACACHE_SOCKET": str(daemon.socket)})
        done = _users.cli_as(users["alice"], "evict", f"file://{data}/wds", env=env)
        assert done.returncode != 0
        assert f"permission denied to uid {users['alice'].uid}, not in its group root" in done.stderr, done.stderr
        assert "primary group" in done.stderr and "container" not in done.stderr, done.stderr
    finally:
        daemon.kill()
    shutil.rmtree(world_dir / "cache")  # what the warning says to do, with the team's group this time
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"file://{data}/", team_gid=True)
    daemon.kill()
    assert "cannot read the manifests" not in daemon.log.read_text()


def test_opening_a_dataset_grants_no_authority_over_another_users_pin(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """Issue 23 item 6: bob opens the dataset alice pinned; he still may not unpin, re-pin or evict it."""
    data = world_dir / "data"
    make_shards(data / "wds", 2, 10_000)
    daemon = serve_for(
        users, world_dir, base_env, "--allow-dataset", f"file://{data}/", "--allow-uid", str(users["bob"].uid)
    )
    url = f"file://{data}/wds"
    dataset = dataset_id_for(url)
    shard = {"dataset": dataset, "key": "shard-0000.tar"}
    try:
        replies = calls_as(
            users["alice"],
            daemon,
            ("POST", "/v1/open", {"dataset": url}),
            ("POST", "/v1/ensure", shard),
            ("POST", "/v1/pin", {"dataset": dataset}),
        )
        assert [status for status, _ in replies] == [200, 200, 200], replies
        attacks = [
            ("POST", "/v1/open", {"dataset": url}),
            ("POST", "/v1/unpin", {"dataset": dataset}),
            ("POST", "/v1/evict", {"dataset": dataset}),
            ("POST", "/v1/evict", {"dataset": dataset, "keys": ["shard-0000.tar"]}),
            ("POST", "/v1/pin", {"dataset": dataset}),
        ]
        opened, *refused = calls_as(users["bob"], daemon, *attacks)
        assert opened[0] == 200, opened  # bob may read it...
        for (_, _, body), (status, reply) in zip(attacks[1:], refused, strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (body, status, reply)  # ...not take it
        ((status, location),) = calls_as(users["alice"], daemon, ("POST", "/v1/locate", shard))
        assert status == 200 and location["tier"] == "local", location
        # The pinner, and an operator (root: the test itself), may.
        ((status, reply),) = calls_as(users["alice"], daemon, ("POST", "/v1/unpin", {"dataset": dataset}))
        assert status == 200 and reply["pinned"] is False, reply
    finally:
        daemon.kill()


# -- the client trusts only root or the daemon's uid, and keeps its secrets (issue 11 item 6) ---

_FAKE_DAEMON = r"""
import json, os, socket, sys
path, record = sys.argv[1], sys.argv[2]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
os.chmod(path, 0o777)
server.listen(16)
print("listening", flush=True)
while True:
    conn, _ = server.accept()
    conn.settimeout(5)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.lower().split(b"\r\n")
        length = next((int(l.split(b":")[1]) for l in lines if l.startswith(b"content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
    except OSError:
        pass
    if not data:
        conn.close()
        continue
    if data:
        with open(record, "ab") as out:
            out.write(head + b"\r\n\r\n" + body + b"\n")
    if b"/healthz" in head:
        reply, status = b'{"status": "ok", "pid": 1, "version": "fake"}', b"200 OK"
    else:
        reply, status = b'{"error": {"code": "forbidden", "message": "fake"}}', b"403 Forbidden"
    conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(reply)).encode() + b"\r\nConnection: close\r\n\r\n" + reply)
    conn.close()
"""

_VICTIM = r"""
import asyncio, sys
from datacache.client import DaemonClient
from datacache.config import DatasetConfig, load_settings
from datacache.errors import DatacacheError

async def main():
    client = DaemonClient(load_settings(overrides={"local_dir": sys.argv[2], "socket": sys.argv[1]}))
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "AKIAVICTIM", "secret": "victim-secret"}
    dataset = DatasetConfig(name="wds", url="s3://bucket/wds", storage_options=options)
    try:
        await client.open(dataset)
    except DatacacheError as exc:
        print(type(exc).__name__, exc)
    await client.close()

asyncio.run(main())
"""


def _fake_daemon(user: User | None, directory: Path, *, gid: int | None = None) -> tuple[Any, Path, Path]:
    import subprocess

    directory.mkdir()
    record = directory / "received"
    record.touch()
    if user is not None:
        for path in (directory, record):
            os.chown(path, user.uid, user.gid)
    sock = directory / "daemon.sock"
    group = user.gid if gid is None and user is not None else gid
    kwargs: dict[str, Any] = {} if user is None else {"user": user.uid, "group": group, "extra_groups": []}
    process = subprocess.Popen(
        [sys.executable, "-c", _FAKE_DAEMON, str(sock), str(record)], stdout=subprocess.PIPE, **kwargs
    )
    assert process.stdout is not None and process.stdout.readline().startswith(b"listening")
    return process, sock, record


def test_the_client_talks_only_to_root_or_the_daemon_uid_and_sends_no_secrets_to_another_user(
    users: dict[str, User], world_dir: Path
) -> None:
    alice = users["alice"]
    impostor, fake_socket, received = _fake_daemon(users["mallory"], world_dir / "fake")
    try:
        victim = run_as(alice, [sys.executable, "-c", _VICTIM, str(fake_socket), str(alice.home / "c")])
        assert victim.returncode == 0, victim.stderr
        assert "DaemonUnavailableError" in victim.stdout and f"uid {users['mallory'].uid}" in victim.stdout
        assert received.read_bytes() == b""  # not one byte went to the impostor
    finally:
        impostor.kill()
        impostor.wait()
    genuine, root_socket, received = _fake_daemon(None, world_dir / "root")  # root: a daemon clients trust
    try:
        victim = run_as(alice, [sys.executable, "-c", _VICTIM, str(root_socket), str(alice.home / "c")])
        assert victim.returncode == 0, victim.stderr
        sent = received.read_bytes()
        assert b"/v1/open" in sent and b"s3://bucket/wds" in sent and b"127.0.0.1:9" in sent
        assert b"victim-secret" not in sent and b"AKIAVICTIM" not in sent  # root's daemon is not alice
    finally:
        genuine.kill()
        genuine.wait()


def test_the_client_judges_the_listener_by_its_uid_not_its_group(users: dict[str, User], world_dir: Path) -> None:
    """Issue 23 item 16: mallory's listener runs with a gid numbered as alice's uid (gid 0 could not exec python)."""
    alice, mallory = users["alice"], users["mallory"]
    for number, gid in enumerate((alice.uid,)):
        impostor, fake_socket, received = _fake_daemon(mallory, world_dir / f"fake-{number}", gid=gid)
        try:
            victim = run_as(alice, [sys.executable, "-c", _VICTIM, str(fake_socket), str(alice.home / "c")])
            assert victim.returncode == 0, victim.stderr
            assert received.read_bytes() == b"", gid  # not one byte went to mallory's process
            assert "DaemonUnavailableError" in victim.stdout, victim.stdout
        finally:
            impostor.kill()
            impostor.wait()


def test_a_link_out_of_an_allowed_root_is_not_listed(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """Issue 23 item 9: a link to a file only the daemon can read gives neither its bytes nor its size."""
    secret = world_dir / "secret"
    secret.mkdir(mode=0o700)
    (secret / "key.tar").write_bytes(b"s" * 12_345)  # root's: alice cannot read it
    data = world_dir / "data"
    make_shards(data / "wds", 1, 10_000)
    (data / "wds" / "peek.tar").symlink_to(secret / "key.tar")
    (data / "wds" / "inside.tar").symlink_to(data / "wds" / "shard-0000.tar")  # a link inside the root is data
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"file://{data}/")
    try:
        ((status, reply),) = calls_as(users["alice"], daemon, ("POST", "/v1/open", {"dataset": f"file://{data}/wds/"}))
        assert status == 200, reply
        assert (reply["shards"], reply["total_bytes"]) == (2, 20_000), reply
        manifest = json.loads(Path(reply["manifest_path"]).read_text())
        assert "peek.tar" not in json.dumps(manifest)
        # Its size is in no field of any shard (a version string is an mtime, which may hold the digits).
        assert 12_345 not in [shard["size"] for shard in manifest["shards"]], manifest
    finally:
        daemon.kill()
