"""What the origin refuses, the cache never serves: one access rule, on every tier and through the daemon.

docs/SECURITY.md, "Who may read what" (issue 33). Real uids (`tests/_users.py`): alice and bob
share the group ``team``, mallory does not. Each test is an attack of the issue, run as it was
run against the daemon and the tiers, with a control that what is declared shared still is.
"""

from __future__ import annotations

import base64
import grp
import http.server
import json
import os
import stat
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _daemon import DaemonProcess, make_shards, start_daemon
from _daemon_users import calls_as
from _users import User, cli_as, python_as, run_as, user_env, users, world_dir
from test_loader import write_wds

from datacache.config import dataset_id_for

__all__ = ["users", "world_dir"]  # fixtures, imported to be found

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _origin(parent: Path, name: str, owner: User | None = None, *, count: int = 3) -> tuple[Path, dict[str, bytes]]:
    """A ``file://`` dataset: ``owner``'s alone (0700) if given, else everyone's (0755/0644)."""
    origin = parent / name
    shards = make_shards(origin, count, 5000, seed=len(name))
    for path in [origin, *origin.iterdir()]:
        if owner is not None:
            os.chown(path, owner.uid, owner.gid)
            path.chmod(0o700 if path.is_dir() else 0o600)
        else:
            path.chmod(0o755 if path.is_dir() else 0o644)
    return origin, shards


def _group_tier(world_dir: Path, users: dict[str, User]) -> Path:
    """The shared tier as docs/SECURITY.md sets it up: ``install -d -m 2770 -g team``."""
    shared = world_dir / "shared"
    shared.mkdir()
    os.chown(shared, 0, users["alice"].groups[0])
    shared.chmod(0o2770)
    return shared


def _config(world_dir: Path, body: str) -> Path:
    """A config file root wrote (0644): what every user of the node reads."""
    path = world_dir / "datacache.toml"
    path.write_text(textwrap.dedent(body))
    path.chmod(0o644)
    return path


def _can_read_as(user: User, path: Path) -> bool:
    return run_as(user, ["dd", f"if={path}", "of=/dev/null", "bs=16", "count=1"]).returncode == 0


# -- item 1: a private origin read in-process never lands group-readable on the shared tier -------


def test_a_private_origin_read_in_process_never_lands_group_readable_on_the_shared_tier(
    users: dict[str, User], world_dir: Path
) -> None:
    alice, bob = users["alice"], users["bob"]
    shared = _group_tier(world_dir, users)
    private, _ = _origin(world_dir, "bob-private", bob)
    common, _ = _origin(world_dir, "common")
    team = grp.getgrgid(alice.groups[0]).gr_name
    config = _config(world_dir, f"""
        [datasets.common]
        url = "file://{common}/"
        readers = ["@{team}"]
    """)
    env = user_env(bob, {"DATACACHE_SHARED_DIR": str(shared)})
    done = cli_as(bob, "warm", str(private), "--tier", "shared", env=env)
    assert done.returncode == 0, done.stderr
    copies = sorted((shared / "data" / dataset_id_for(f"file://{private}/")).iterdir())
    assert len(copies) == 3
    for copy in copies:
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600 and copy.stat().st_uid == bob.uid, copy
        assert not _can_read_as(alice, copy), f"alice, whom the origin refuses, read {copy}"
    # Nor its metadata: a new user's trial read bob's manifest (his URL, every shard's name) and counts.
    tars = world_dir / "bob-tars"
    write_wds(tars, 8, 4)
    for path in [tars, *tars.iterdir()]:
        os.chown(path, bob.uid, bob.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    read = python_as(bob, f"""
        from datacache.loaders import CachedIterableDataset
        print(sum(1 for _ in CachedIterableDataset({str(tars)!r})))
    """, env=env)
    assert read.returncode == 0 and read.stdout.split()[-1] == "8", read.stderr
    private_ids = {dataset_id_for(f"file://{origin}/") for origin in (private, tars)}
    about = [p for p in shared.rglob("*") if p.is_file() and any(i in str(p) for i in private_ids)]
    assert {"manifests", "indexes"} <= {p.relative_to(shared).parts[0] for p in about}, about
    for path in about:
        assert not _can_read_as(alice, path), f"alice read {path}"
    # What the operator declared shared with the team is still one copy the team reads.
    done = cli_as(bob, "warm", "common", "--tier", "shared", env={**env, "DATACACHE_CONFIG": str(config)})
    assert done.returncode == 0, done.stderr
    declared = sorted((shared / "data" / dataset_id_for(f"file://{common}/")).iterdir())
    assert len(declared) == 3
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o640 and _can_read_as(alice, p) for p in declared)


# -- item 2: the daemon serves a dataset to its readers, or to a uid the origin answers ------------

_READ = r"""
import asyncio, json, sys
from datacache.access import open_access
from datacache.config import load_settings

async def main(name):
    access = await open_access(load_settings())
    try:
        handle = await access.open(name)
        return {key: (await access.read(handle, key)).hex() for key in sorted(s.key for s in handle.manifest.shards)}
    finally:
        await access.close()

try:
    print(json.dumps({"shards": asyncio.run(main(sys.argv[1]))}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def read_through_daemon(user: User, name: str, env: dict[str, str]) -> dict[str, Any]:
    """``name``'s shards as ``user`` reads them through the node's daemon (or the error it gets)."""
    done = run_as(user, [sys.executable, "-c", _READ, name], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _serve(users: dict[str, User], world_dir: Path, env: dict[str, str], *args: str) -> DaemonProcess:
    """A root daemon whose group is the team's (as deploy/slurm's is its users'): its clients are the team."""
    team = users["alice"].groups[0]
    return start_daemon(
        env, world_dir / "cache", "--socket-group", str(team), *args,
        socket_path=world_dir / "run" / "daemon.sock", log=world_dir / "daemon.log",
        preexec_fn=lambda: os.setgid(team),
    )


def _serve_private(
    users: dict[str, User], world_dir: Path, env: dict[str, str], name: str, origin: Path
) -> tuple[Path, DaemonProcess]:
    """The config naming ``origin`` as dataset ``name`` without readers (its owner's alone), and a daemon serving it."""
    config = _config(world_dir, f"""
        [datasets.{name}]
        url = "file://{origin}/"
    """)
    return config, _serve(users, world_dir, env, "--config", str(config))


def _client_env(user: User, world_dir: Path, config: Path | None = None) -> dict[str, str]:
    extra = {"DATACACHE_SOCKET": str(world_dir / "run" / "daemon.sock")}
    if config is not None:
        extra["DATACACHE_CONFIG"] = str(config)
    return user_env(user, extra)


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


def test_the_daemon_serves_a_dataset_only_to_its_readers_or_a_uid_the_origin_answers(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    alice, bob = users["alice"], users["bob"]
    bobs, bob_bytes = _origin(world_dir, "b-wds", bob)  # only bob (and the root daemon) can read it
    alices, alice_bytes = _origin(world_dir, "a-wds")
    config = _config(world_dir, f"""
        [datasets.b-wds]
        url = "file://{bobs}/"

        [datasets.a-wds]
        url = "file://{alices}/"
        readers = ["{alice.name}"]
    """)
    daemon = _serve(users, world_dir, base_env, "--config", str(config))
    try:
        env_a, env_b = _client_env(alice, world_dir, config), _client_env(bob, world_dir, config)
        # bob has the daemon stage his dataset (warm proves that the origin answers him) ...
        warmed = cli_as(bob, "warm", "b-wds", env=env_b)
        assert warmed.returncode == 0, warmed.stderr
        # ... and alice, whom the origin refuses, asks the daemon for it (before: all of it, from its cache).
        refused = read_through_daemon(alice, "b-wds", env_a)
        assert "shards" not in refused, "alice read bob's dataset through the daemon's authority"
        assert "Permission" in refused["error"], refused
        owner = read_through_daemon(bob, "b-wds", env_b)
        assert owner.get("shards") == {key: data.hex() for key, data in bob_bytes.items()}, owner
        refused_warm = cli_as(alice, "warm", "b-wds", env=env_a)
        assert refused_warm.returncode != 0 and "Traceback" not in refused_warm.stderr, refused_warm.stderr
        copies = sorted((world_dir / "cache" / "data" / dataset_id_for(f"file://{bobs}/")).iterdir())
        assert copies and all(not _can_read_as(alice, copy) for copy in copies)
        # A declared dataset: its readers only.
        not_a_reader = read_through_daemon(bob, "a-wds", env_b)
        assert "not among its readers" in not_a_reader.get("error", ""), not_a_reader
        reader = read_through_daemon(alice, "a-wds", env_a)
        assert reader.get("shards") == {key: data.hex() for key, data in alice_bytes.items()}, reader
        # `datacache ls` names a declared dataset, its URL and residency to its readers only (a trial's
        # non-reader saw it listed).
        ((_, seen_by_bob),) = calls_as(bob, daemon, ("GET", "/v1/datasets", None))
        ((_, seen_by_alice),) = calls_as(alice, daemon, ("GET", "/v1/datasets", None))
        assert "a-wds" not in {name for row in seen_by_bob["datasets"] for name in row["names"]}, seen_by_bob
        assert "a-wds" in {name for row in seen_by_alice["datasets"] for name in row["names"]}, seen_by_alice
    finally:
        daemon.kill()


_PROVE = r"""
import json, sys
from pathlib import Path
from _daemon import unix_request
from datacache._proof import proof_digest
from datacache._protocol import API, config_to_wire
from datacache.config import load_settings, resolve_dataset

socket, name, how, tries = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
wire = config_to_wire(resolve_dataset(name, load_settings()), credentials=False)
origin = Path(wire["url"].removeprefix("file://"))

def answer(challenge):
    if how == "zeros":  # a forger: the bytes any tar ends with, read from nowhere
        data = bytes(challenge["end"] - challenge["start"])
    else:  # the origin's own bytes, read with this user's rights
        data = (origin / challenge["key"]).read_bytes()[challenge["start"] : challenge["end"]]
    return {"nonce": challenge["nonce"], "digest": proof_digest(challenge["nonce"], data)}

out = []
if how == "zeros":
    for _ in range(tries):
        status, challenge = unix_request(socket, "POST", f"{API}/challenge", {"dataset": wire}, timeout=60)
        if status != 200:
            out.append([status, challenge])
            break
        status, reply = unix_request(
            socket, "POST", f"{API}/open", {"dataset": wire, "proof": answer(challenge)}, timeout=60
        )
        out.append([status, "granted" if status == 200 else reply])
        if status == 200:
            break
else:  # several workers of one job: each asks, then the first answers first
    asked = [unix_request(socket, "POST", f"{API}/challenge", {"dataset": wire}, timeout=60) for _ in range(tries)]
    for status, challenge in asked:
        status, reply = unix_request(
            socket, "POST", f"{API}/open", {"dataset": wire, "proof": answer(challenge)}, timeout=60
        )
        out.append([status, "granted" if status == 200 else reply])
print(json.dumps(out))
"""


def _prove_as(user: User, daemon: DaemonProcess, env: dict[str, str], name: str, how: str, tries: int) -> list[Any]:
    done = run_as(user, [sys.executable, "-c", _PROVE, str(daemon.socket), name, how, str(tries)], env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found: list[Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_an_access_proof_cannot_be_answered_from_bytes_every_tar_holds_nor_guessed_for_long(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A trial's forger asked for challenges until one fell in a tar's closing zero blocks (3,058 in 3.9 s)."""
    alice, bob = users["alice"], users["bob"]
    bobs = world_dir / "b-wds"  # real tars of 10,240 bytes: three quarters of each is zero blocks
    write_wds(bobs, samples=6, per_shard=2)
    for path in [bobs, *bobs.iterdir()]:
        os.chown(path, bob.uid, bob.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    config, daemon = _serve_private(users, world_dir, base_env, "b-wds", bobs)
    try:
        tries = _prove_as(alice, daemon, _client_env(alice, world_dir, config), "b-wds", "zeros", 12)
        assert "granted" not in [reply for _, reply in tries], tries
        assert [status for status, _ in tries[:5]] == [403] * 5, tries
        status, refused = tries[5]
        assert status == 403 and "5 wrong access proofs" in refused["error"]["message"], tries
        # bob, whom the origin answers, is not slowed by alice's guesses.
        assert _prove_as(bob, daemon, _client_env(bob, world_dir, config), "b-wds", "origin", 1) == [[200, "granted"]]
    finally:
        daemon.kill()


def test_several_workers_of_one_job_prove_access_at_once(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A fresh daemon kept one challenge per uid and dataset: a job's workers overwrote each other's."""
    bob = users["bob"]
    bobs, _ = _origin(world_dir, "b-wds", bob)
    config, daemon = _serve_private(users, world_dir, base_env, "b-wds", bobs)
    try:
        proofs = _prove_as(bob, daemon, _client_env(bob, world_dir, config), "b-wds", "origin", 3)
        assert proofs == [[200, "granted"]] * 3, proofs
    finally:
        daemon.kill()


def test_readers_declared_or_taken_away_after_copies_were_made_get_copies_of_the_new_mode(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A trial: copies staged private cut the readers declared later off (PermissionError in every
    loader), and copies staged shared stayed readable by the group after the readers were taken away."""
    alice, bob = users["alice"], users["bob"]
    origin, shards = _origin(world_dir, "a-wds", alice)  # alice's alone: she proves access
    expected = {key: data.hex() for key, data in shards.items()}

    def serve_with(readers: str) -> DaemonProcess:
        config = _config(world_dir, f"""
            [datasets.a-wds]
            url = "file://{origin}/"
            {readers}
        """)
        return _serve(users, world_dir, base_env, "--config", str(config))

    team = grp.getgrgid(alice.groups[0]).gr_name
    daemon = serve_with(f'readers = ["@{team}"]')  # the team's: alice and bob
    try:
        env_a = _client_env(alice, world_dir, world_dir / "datacache.toml")
        warmed = cli_as(alice, "warm", "a-wds", env=env_a)
        assert warmed.returncode == 0, warmed.stderr
        (copies,) = (world_dir / "cache" / "data").iterdir()  # the one dataset's copies
        assert all(_can_read_as(bob, copy) for copy in copies.iterdir())  # staged shared: the group's (0640)
    finally:
        daemon.kill()
    daemon = serve_with("")  # the readers taken away: alice's alone again
    try:
        warmed = cli_as(alice, "warm", "a-wds", env=env_a)  # her copies now: the daemon's own (0600)
        assert warmed.returncode == 0, warmed.stderr
        readable = [copy.name for copy in copies.iterdir() if _can_read_as(bob, copy)]
        assert not readable, f"bob still reads {readable} of a dataset no longer shared with him"
        assert read_through_daemon(alice, "a-wds", env_a).get("shards") == expected
    finally:
        daemon.kill()
    daemon = serve_with(f'readers = ["{alice.name}", "{bob.name}"]')  # and declared again: bob reads
    try:
        env_b = _client_env(bob, world_dir, world_dir / "datacache.toml")
        warmed = cli_as(bob, "warm", "a-wds", env=env_b)
        assert warmed.returncode == 0, warmed.stderr
        assert read_through_daemon(bob, "a-wds", env_b).get("shards") == expected
    finally:
        daemon.kill()


def test_a_private_datasets_owner_refreshes_it_after_its_objects_changed(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """A trial: the proof's challenge named an object of the old snapshot, which the origin no longer
    had, so the owner's `warm --refresh` failed every time with "take a new snapshot with --refresh"."""
    alice = users["alice"]
    origin, _ = _origin(world_dir, "a-wds", alice)
    config, daemon = _serve_private(users, world_dir, base_env, "a-wds", origin)
    try:
        env = _client_env(alice, world_dir, config)
        first = cli_as(alice, "warm", "a-wds", env=env)
        assert first.returncode == 0, first.stderr
        daemon.kill()  # a new daemon: alice must prove access again, on the snapshot it knows
        daemon = _serve(users, world_dir, base_env, "--config", str(config))
        for shard in sorted(origin.iterdir()):  # every object rewritten: no old one to answer with
            data = shard.read_bytes()
            shard.write_bytes(data[::-1])
            os.utime(shard, (1e9, 1e9))
        refreshed = cli_as(alice, "warm", "a-wds", "--refresh", env=env)
        assert refreshed.returncode == 0, refreshed.stderr
        assert "3/3 shards resident" in refreshed.stdout, refreshed.stdout
    finally:
        daemon.kill()


# -- items 4 and 5: credentials and the query are part of what an http origin returns --------------


class _Origin(http.server.ThreadingHTTPServer):
    """An http origin: ``/d/`` only for alice's password; ``/ok/`` for all; a query echoes what it is given."""

    def __init__(self, shards: dict[str, bytes], password: str) -> None:
        self.gets: list[str] = []
        origin = self
        token = "Basic " + base64.b64encode(f"alice:{password}".encode()).decode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _send(self, status: int, body: bytes, kind: str = "application/octet-stream") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self) -> None:
                origin.gets.append(self.path)
                path, _, query = self.path.partition("?")
                if path.startswith("/d/") and self.headers.get("Authorization") != token:
                    return self._send(401, b"unauthorized", "text/plain")
                if query:  # a reflecting endpoint: whatever follows "x=" (the attacker's words)
                    evil = b"EVIL" * 1250
                    if query.endswith(".tar"):
                        return self._send(200, evil)
                    links = "".join(f'<a href="{key}">{key}</a>' for key in shards)
                    return self._send(200, f"<html>{links}</html>".encode(), "text/html")
                name = path.rsplit("/", 1)[-1]
                if name in shards:
                    return self._send(200, shards[name])
                links = "".join(f'<a href="{key}">{key}</a>' for key in shards)
                return self._send(200, f"<html>{links}</html>".encode(), "text/html")

            do_HEAD = do_GET

            def log_message(self, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def http_origin() -> Iterator[tuple[_Origin, dict[str, bytes]]]:
    shards = {f"shard-{i:04d}.tar": bytes([i + 1]) * 5000 for i in range(2)}
    server = _Origin(shards, "alices-secret")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, shards
    finally:
        server.shutdown()
        server.server_close()


def test_http_credentials_and_the_query_are_part_of_what_the_daemon_serves(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], http_origin: tuple[_Origin, dict[str, bytes]]
) -> None:
    origin, shards = http_origin
    alice, bob = users["alice"], users["bob"]
    daemon = _serve(users, world_dir, base_env, "--allow-dataset", f"{origin.url}/")
    try:
        env_a, env_b = _client_env(alice, world_dir), _client_env(bob, world_dir)
        host = origin.url.split("://", 1)[1]
        owner = read_through_daemon(alice, f"http://alice:alices-secret@{host}/d/", env_a)
        assert owner.get("shards") == {key: data.hex() for key, data in shards.items()}, owner
        warmed = cli_as(alice, "warm", f"http://alice:alices-secret@{host}/d/", env=env_a)
        assert warmed.returncode == 0, warmed.stderr
        # Item 4: bob, whom the origin answers 401, is not handed alice's staged copy.
        other = read_through_daemon(bob, f"{origin.url}/d/", env_b)
        assert "shards" not in other, "bob was served what the origin refuses him"
        # Item 5: bob's query never reaches a key ("ok/?x=.../shard.tar") nor alice's "ok/".
        attack = read_through_daemon(bob, f"{origin.url}/ok/?x=1", env_b)
        assert "shards" not in attack, attack
        assert not any("?" in got and got.endswith(".tar") for got in origin.gets), origin.gets
        victim = read_through_daemon(alice, f"{origin.url}/ok/", env_a)
        assert victim.get("shards") == {key: data.hex() for key, data in shards.items()}, victim
    finally:
        daemon.kill()
    assert dataset_id_for(f"{origin.url}/ok/?x=1") != dataset_id_for(f"{origin.url}/ok/")
    assert dataset_id_for(f"http://alice:pw@{host}/d/") != dataset_id_for(f"{origin.url}/d/")


# -- items 7 and 10: what steers the cache is never another user's (owner and mode checks) ---------


def test_a_config_file_another_uid_can_write_is_refused_in_one_line(users: dict[str, User], world_dir: Path) -> None:
    alice, mallory = users["alice"], users["mallory"]
    planted = world_dir / "mallory.toml"
    # Mallory's config would point alice's clients at a socket of hers, served by "the daemon" she names.
    planted.write_text(f'[daemon]\ndaemon_uid = "{mallory.name}"\nsocket = "{world_dir}/fake.sock"\n')
    os.chown(planted, mallory.uid, mallory.gid)
    writable = _config(world_dir, "[staging]\nconcurrency = 4\n")
    for path, why in ((planted, mallory.name), (writable, "anyone can write it")):
        if path == writable:
            path.chmod(0o666)
        done = cli_as(alice, "status", env=user_env(alice, {"DATACACHE_CONFIG": str(path)}))
        assert done.returncode != 0, done.stdout
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and str(path) in lines[0] and why in lines[0], done.stderr
        assert "Traceback" not in done.stderr
    writable.chmod(0o644)  # root's, 0644: what every node's config is
    done = cli_as(alice, "status", env=user_env(alice, {"DATACACHE_CONFIG": str(writable)}))
    assert done.returncode == 0, done.stderr


def test_a_node_cache_another_uid_planted_on_a_world_writable_scratch_is_refused(
    users: dict[str, User], world_dir: Path
) -> None:
    alice, mallory = users["alice"], users["mallory"]
    scratch = world_dir / "scratch"
    scratch.mkdir()
    scratch.chmod(0o1777)
    origin, _ = _origin(world_dir, "public")
    planted = scratch / "datacache"
    # Mallory makes the cache directory first, world-writable, with a catalog of her own in it.
    made = run_as(mallory, ["sh", "-c", f"mkdir -m 777 {planted} && : > {planted}/catalog.sqlite"])
    assert made.returncode == 0, made.stderr
    done = cli_as(alice, "warm", str(origin), env=user_env(alice, {"DATACACHE_LOCAL_DIR": str(planted)}))
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(planted) in lines[0] and mallory.name in lines[0], done.stderr
    assert sorted(p.name for p in planted.iterdir()) == ["catalog.sqlite"], "nothing written into it"
    # A cache alice made herself there is hers: it works.
    own = scratch / "alice-cache"
    done = cli_as(alice, "warm", str(origin), env=user_env(alice, {"DATACACHE_LOCAL_DIR": str(own)}))
    assert done.returncode == 0, done.stderr
    # Her catalog replaced by one another uid owns (her directory made writable by a careless chmod).
    own.chmod(0o777)
    swapped = run_as(mallory, ["sh", "-c", f"rm -f {own}/catalog.sqlite && : > {own}/catalog.sqlite"])
    assert swapped.returncode == 0, swapped.stderr
    done = cli_as(alice, "warm", str(origin), env=user_env(alice, {"DATACACHE_LOCAL_DIR": str(own)}))
    assert done.returncode != 0 and "catalog" in done.stderr and mallory.name in done.stderr, done.stderr


# -- item 8: a report of corruption is checked before a copy is dropped ---------------------------

def test_a_false_corruption_report_does_not_drop_another_users_pinned_copy(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    alice, bob = users["alice"], users["bob"]
    origin, shards = _origin(world_dir, "common")
    url = f"file://{origin}/"
    daemon = _serve(users, world_dir, base_env, "--allow-dataset", url)  # shared with every allowed client
    try:
        ((status, opened),) = calls_as(alice, daemon, ("POST", "/v1/open", {"dataset": url}))
        assert status == 200, opened
        dataset = opened["dataset_id"]
        ensures = [("POST", "/v1/ensure", {"dataset": dataset, "key": key}) for key in shards]
        replies = calls_as(alice, daemon, *ensures, ("POST", "/v1/pin", {"dataset": dataset}))
        assert all(status == 200 for status, _ in replies), replies
        copy = world_dir / "cache" / "data" / dataset / "shard-0000.tar"
        assert copy.read_bytes() == shards["shard-0000.tar"]
        report = {"dataset": dataset, "key": "shard-0000.tar", "tier": "local"}
        (_, _), (status, reply) = calls_as(
            bob, daemon, ("POST", "/v1/open", {"dataset": url}), ("POST", "/v1/report_corrupt", report)
        )
        assert status == 200 and reply == {"dropped": False}, reply
        assert copy.read_bytes() == shards["shard-0000.tar"], "bob's false report dropped alice's pinned copy"
        # A copy that really is wrong is still dropped on report.
        copy.write_bytes(b"\0" * len(shards["shard-0000.tar"]))
        ((status, reply),) = calls_as(bob, daemon, ("POST", "/v1/report_corrupt", report))
        assert status == 200 and reply == {"dropped": True}, reply
        assert not copy.exists()
    finally:
        daemon.kill()


# -- item 9: another member's files never make a user evict its own copies -----------------------


def test_junk_another_member_cannot_be_made_to_remove_never_evicts_a_users_copies(
    users: dict[str, User], world_dir: Path
) -> None:
    alice, bob = users["alice"], users["bob"]
    shared = _group_tier(world_dir, users)
    first, _ = _origin(world_dir, "first")
    second, _ = _origin(world_dir, "second")
    env = user_env(alice, {"DATACACHE_SHARED_DIR": str(shared), "DATACACHE_SHARED_CAPACITY": "40KB"})
    done = cli_as(alice, "warm", str(first), "--tier", "shared", env=env)
    assert done.returncode == 0, done.stderr
    # bob fills the tier with a directory of his that alice cannot empty (0755 in the 2770 data/).
    junk = shared / "data" / "junk-0000000000000000"
    planted = run_as(bob, ["sh", "-c", f"mkdir -m 755 {junk} && truncate -s 10M {junk}/filler.tar"])
    assert planted.returncode == 0, planted.stderr
    done = cli_as(alice, "warm", str(second), "--tier", "shared", env=env)
    assert done.returncode == 0, done.stderr
    for origin in (first, second):
        kept = sorted(p.name for p in (shared / "data" / dataset_id_for(str(origin))).iterdir())
        assert kept == ["shard-0000.tar", "shard-0001.tar", "shard-0002.tar"], (origin, kept)


def test_a_local_origin_its_reader_may_not_enter_is_said_as_such_not_as_missing(
    users: dict[str, User], world_dir: Path
) -> None:
    """A new user's trial: a 0700 directory the reading uid may not enter was "no such file or directory"."""
    private, _ = _origin(world_dir, "bob-home", users["bob"])
    refused = cli_as(users["alice"], "warm", str(private), env=user_env(users["alice"]))
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr
    assert "permission denied" in lines[0] and "no such file" not in lines[0], lines[0]
