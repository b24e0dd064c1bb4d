"""`datacache top` beside a real training loop: 2 gloo ranks x 2 DataLoader workers, embedded and through the daemon.

The figures top shows (per reader, per rank, per tier) are checked against each rank's own
``ds.stats()`` and the daemon's ``/metrics``; a user's view leaves out another user's clients
(real uids, `tests/_users.py`); the live view takes keys in a pseudo-terminal and survives the
daemon going away.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
import torch.distributed as dist
from _daemon import DaemonProcess, daemon_env, start_daemon, wait_until
from _helpers import DATACACHE, REPO
from _ranks import process_group, spawn_ranks
from _users import User, python_as
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds
from torch.utils.data import DataLoader

from datacache.config import load_settings

users = _users.users
world_dir = _users.world_dir


def _rank_main(rank: int, world: int, init_file: str, origin: str, env: dict[str, str], out: str) -> None:
    with process_group(rank, world, init_file):
        settings = load_settings(env)
        dataset = CachedIterableDataset(origin, config=settings, seed=11, shuffle_buffer=16, target_bandwidth="1GB/s")
        loader = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True)
        steps = sum(1 for _ in loader)
        stats = dataclasses.asdict(dataset.stats())
        partial = Path(out) / f".rank{rank}.json"
        partial.write_text(json.dumps({"steps": steps, "stats": stats}))
        partial.rename(Path(out) / f"rank{rank}.json")
        # The workers (persistent) and their reports stay until the test has looked.
        wait_until((Path(out) / "done").exists, timeout=600, what="the test to finish looking")
        dist.barrier()


def _top(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DATACACHE, "top", *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )


def _frame(env: dict[str, str]) -> dict[str, Any]:
    done = _top(env, "--once", "--json", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, "--once --json prints one object"
    frame = json.loads(lines[0])
    assert isinstance(frame, dict)
    return frame


def _metrics(daemon: DaemonProcess) -> dict[tuple[str, str], float]:
    """(family, client label) -> value of the daemon's per-client metrics."""
    code, text = daemon.request("GET", "/metrics")
    assert code == 200
    found = {}
    for match in re.finditer(r'^(datacache_client_\w+)\{client="([^"]+)"\} (\S+)$', text, re.M):
        found[(match.group(1), match.group(2))] = float(match.group(3))
    return found


def _matches(frame: dict[str, Any], stats: dict[int, dict[str, Any]]) -> bool:
    """Whether top's rank totals are what each rank's ``stats()`` says."""
    ranks = {r["rank"]: r for r in frame["ranks"]}
    if sorted(ranks) != sorted(stats):
        return False
    for rank, mine in stats.items():
        shown = ranks[rank]
        if (shown["samples"], shown["bytes"], shown["readers"]) != (mine["samples"], mine["bytes"], mine["readers"]):
            return False
    return True


def _check_against_stats(frame: dict[str, Any], stats: dict[int, dict[str, Any]], mode: str) -> None:
    ranks = {r["rank"]: r for r in frame["ranks"]}
    for rank, mine in stats.items():
        shown = ranks[rank]
        assert shown["readers"] == mine["readers"] == 2
        assert shown["prefetch_depth"] == mine["prefetch_depth"]
        assert shown["target_bandwidth"] == mine["target_bandwidth"] == 1e9
        assert shown["meets_target"] == mine["meets_target"]
        for tier in ("local", "shared", "origin"):
            assert shown["hit_ratio"][tier] == pytest.approx(mine["hit_ratio"][tier], abs=1e-12), tier
        # Computed from the same row values as stats() computes them.
        assert shown["bytes_per_second"] == pytest.approx(mine["bytes_per_second"], rel=1e-9)
        assert shown["samples_per_second"] == pytest.approx(mine["samples_per_second"], rel=1e-9)
        assert shown["reader_wait_fraction"] == pytest.approx(mine["reader_wait_fraction"], rel=1e-9, abs=1e-12)
        assert mine["mode"] == mode
    readers = {(c["rank"], c["worker"]) for c in frame["clients"]}
    assert readers == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for client in frame["clients"]:
        assert client["mode"] == mode
        assert client["uid"] == os.getuid()
        assert client["target_share_bytes_per_s"] == 5e8  # the rank's 1GB/s, between its 2 workers
        assert 0.0 <= client["stall_fraction"] <= 1.0
        assert sum(client["hit_share"].values()) == pytest.approx(1.0)
    local = next(t for t in frame["tiers"] if t["tier"] == "local")
    assert local["used_bytes"] > 0 and local["shards"] > 0


@pytest.mark.parametrize("through", ["embedded", "daemon"])
def test_top_shows_what_each_rank_and_worker_delivered_as_stats_and_the_daemon_say(
    through: str, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=160, per_shard=10, with_counts=True)
    local = tmp_path / "local"
    opted_in = tmp_path / "metrics-clients.toml"  # each client by name in /metrics: the operator's choice
    opted_in.write_text("[daemon]\nmetrics_clients = true\n")
    daemon = start_daemon(cache_env, local, "--config", str(opted_in)) if through == "daemon" else None
    env = daemon.env if daemon is not None else daemon_env(cache_env, local, local / "daemon.sock")
    out = tmp_path / "out"
    out.mkdir()
    # `top --json` runs beside the training from its start, one frame a second.
    stream = subprocess.Popen(
        [*DATACACHE, "top", "--json", "--interval", "1"], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    frames: list[dict[str, Any]] = []

    def collect() -> None:
        for line in stream.stdout or ():
            frames.append(json.loads(line))

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    context = spawn_ranks(_rank_main, tmp_path / "init", str(origin), env, str(out), join=False)
    assert context is not None
    try:

        def trained() -> bool:
            context.join(0.01)  # raises if a rank failed
            return all((out / f"rank{rank}.json").exists() for rank in (0, 1))

        wait_until(trained, timeout=300, what="both ranks to finish their epoch")
        stats = {rank: json.loads((out / f"rank{rank}.json").read_text())["stats"] for rank in (0, 1)}
        assert stats[0]["samples"] + stats[1]["samples"] == 160

        # The readers' last reports reach top within one refresh of the epoch's end: the first
        # frame of the stream read a full refresh after both ranks had their stats() says so.
        ended = max((out / f"rank{rank}.json").stat().st_mtime for rank in (0, 1))
        later = wait_until(
            lambda: next((f for f in list(frames) if f["time"] >= ended + 1.0), None),
            timeout=60,
            what="a frame of top --json one refresh after the epoch's end",
        )
        assert _matches(later, stats), (later["ranks"], stats)
        _check_against_stats(later, stats, through)
        stream.send_signal(signal.SIGINT)
        assert stream.wait(30) == 0
        collector.join(30)

        # And top --once --json, a fresh process, says the same.
        frame = _frame(env)
        assert _matches(frame, stats), (frame["ranks"], stats)
        assert frame["source"] == through
        assert frame["daemon"]["answers"] is (through == "daemon")
        _check_against_stats(frame, stats, through)

        if daemon is not None:
            metrics = _metrics(daemon)
            for client in frame["clients"]:
                name = client["client"]
                gauge = metrics[("datacache_client_delivered_bytes_per_second", name)]
                assert gauge == pytest.approx(client["delivered_bytes_per_s"], rel=1e-9)
                stall = metrics[("datacache_client_data_stall_fraction", name)]
                assert stall == pytest.approx(client["stall_fraction"], rel=1e-9, abs=1e-12)
            for rank, mine in stats.items():
                names = [c["client"] for c in frame["clients"] if c["rank"] == rank]
                total = sum(metrics[("datacache_client_delivered_bytes_total", name)] for name in names)
                assert total == mine["bytes"], "the counter holds each reader's bytes once"

        text = _top(env, "--once", "--interval", "0.1")
        assert text.returncode == 0, text.stderr
        assert text.stderr == ""
        assert ("through the daemon" if through == "daemon" else "embedded") in text.stdout
        for rank, mine in stats.items():
            row = next(line for line in text.stdout.splitlines() if line.startswith(f"{rank} "))
            assert f" {mine['samples']} " in row
        for label in ("r0/w0", "r0/w1", "r1/w0", "r1/w1"):
            assert label in text.stdout
        assert re.search(r"^local\s", text.stdout, re.M) and re.search(r"^origin\s", text.stdout, re.M)
    finally:
        (out / "done").touch()
        if stream.poll() is None:
            stream.kill()
        stream.wait(30)
        if stream.stdout is not None:
            stream.stdout.close()
        context.join(120)
        if daemon is not None:
            daemon.stop()


_REPORT_AND_LIVE = """
import sys
sys.path.insert(0, {tests!r})
from _daemon import unix_request
code, reply = unix_request({socket!r}, "POST", "/v1/report", {body!r})
assert code == 200, reply
print("reported", flush=True)
sys.stdin.read()  # alive until the test closes stdin: the daemon lists only readers that live
"""


def _reporter(daemon: DaemonProcess, body: dict[str, Any], user: User | None = None) -> subprocess.Popen[str]:
    """A reader process that reports ``body`` to the daemon over its socket and lives until its stdin closes."""
    code = _REPORT_AND_LIVE.format(tests=str(Path(__file__).parent), socket=str(daemon.socket), body=body)
    as_user: dict[str, Any] = {}
    if user is not None:
        as_user = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups), "cwd": user.home}
    process = subprocess.Popen(
        [sys.executable, "-c", code],
        env=_users.user_env(user) if user is not None else daemon.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        **as_user,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "reported"
    return process


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    process.wait(timeout=60)
    process.stdout.close()


def _report_as(user: User, daemon: DaemonProcess, rank: int) -> subprocess.Popen[str]:
    """A client of ``user`` reports to the daemon, over its socket, with the kernel's uid (and stays alive)."""
    body = {"client": f"{user.name}-r{rank}", "delivered_bytes_per_s": 1e6, "stall_fraction": 0.1,
            "rank": rank, "worker": 0, "samples": 10, "delivered_bytes": 1000}  # fmt: skip
    return _reporter(daemon, body, user)


def test_the_daemon_forgets_a_reader_whose_process_ended(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """The last epoch's readers stayed in `top` through the daemon for the reports' 5-minute TTL after they died."""
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        body = {"client": "last-epoch-r0w0", "rank": 0, "worker": 0, "epoch": 3, "samples": 10, "delivered_bytes": 100}
        reader = _reporter(daemon, body)
        assert [c["client"] for c in _frame(daemon.env)["clients"]] == ["last-epoch-r0w0"]
        _end(reader)
        frame = _frame(daemon.env)
        assert frame["clients"] == [] and frame["ranks"] == []
        assert daemon.status()["clients"] == []
    finally:
        daemon.stop()


def _top_as(user: User, env: dict[str, str]) -> dict[str, Any]:
    done = _users.cli_as(user, "top", "--once", "--json", "--interval", "0.1", env=env)
    assert done.returncode == 0, done.stderr
    frame = json.loads(done.stdout)
    assert isinstance(frame, dict)
    return frame


def test_a_user_sees_their_own_clients_and_an_operator_sees_all(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    alice, bob = users["alice"], users["bob"]
    daemon = start_daemon(
        {k: v for k, v in cache_env.items() if not k.startswith("AWS_")},
        world_dir / "cache",
        "--socket-group", str(alice.groups[0]), "--allow-uid", str(alice.uid), "--allow-uid", str(bob.uid),
        socket_path=world_dir / "run" / "daemon.sock",
        log=world_dir / "daemon.log",
    )  # fmt: skip
    readers = []
    try:
        readers = [_report_as(alice, daemon, 0), _report_as(bob, daemon, 1)]
        env_for = {u.name: _users.user_env(u, {"DATACACHE_SOCKET": str(daemon.socket),
                                              "DATACACHE_LOCAL_DIR": str(world_dir / "cache")})
                   for u in (alice, bob)}  # fmt: skip
        for user, other in ((alice, bob), (bob, alice)):
            frame = _top_as(user, env_for[user.name])
            assert frame["source"] == "daemon"
            assert [c["client"] for c in frame["clients"]] == [f"{user.name}-r{0 if user is alice else 1}"]
            assert all(c["uid"] == user.uid for c in frame["clients"])
            assert other.name not in json.dumps(frame)
            assert frame["operator"] is False
        # The same view through /v1/status: a user's own clients only.
        code, status = daemon.request("GET", "/v1/status")  # root: an operator
        assert code == 200 and {c["client"] for c in status["clients"]} == {f"{alice.name}-r0", f"{bob.name}-r1"}
        # The operator (root, the daemon's uid) sees both, with their users.
        operator = _frame(daemon.env)
        assert operator["operator"] is True
        assert {(c["client"], c["user"]) for c in operator["clients"]} == {
            (f"{alice.name}-r0", alice.name),
            (f"{bob.name}-r1", bob.name),
        }
    finally:
        for reader in readers:
            _end(reader)
        daemon.stop()

    # Embedded: each user's local tier is their own (every folder in it 0700, whatever the umask):
    # bob's top shows his readers, alice's tier is closed to him, root reads any.
    tiers = {user.name: world_dir / f"embedded-{user.name}" for user in (alice, bob)}
    for rank, user in enumerate((alice, bob)):
        tiers[user.name].mkdir(mode=0o700)
        os.chown(tiers[user.name], user.uid, user.gid)
        done = python_as(
            user,
            f"""
            import os, socket, time
            from pathlib import Path
            from datacache.activity import write_report_file
            write_report_file(Path({str(tiers[user.name])!r}), "reader", {{
                "version": 1, "host": socket.gethostname(), "pid": os.getppid(), "written": time.time(),
                "client": "{user.name}-embedded", "reader": {{"rank": {rank}, "worker": 0, "samples": 5}},
            }})
            """,
        )
        assert done.returncode == 0, done.stderr
        assert (tiers[user.name] / "clients").stat().st_mode & 0o777 == 0o700

    def local(name: str, base: dict[str, str]) -> dict[str, str]:
        return {**base, "DATACACHE_LOCAL_DIR": str(tiers[name]), "DATACACHE_SOCKET": str(tiers[name] / "none.sock")}

    # Their writers exited: the files name this (live) test process as theirs, so they stay shown.
    frame = _top_as(bob, local(bob.name, _users.user_env(bob)))
    assert frame["source"] == "embedded"
    assert [c["client"] for c in frame["clients"]] == [f"{bob.name}-embedded"]
    snooping = _users.cli_as(
        bob, "top", "--once", "--json", "--interval", "0.1", env=local(alice.name, _users.user_env(bob))
    )
    assert f"{alice.name}-embedded" not in snooping.stdout
    assert [c["client"] for c in _frame(local(alice.name, cache_env))["clients"]] == [f"{alice.name}-embedded"]


def test_a_ranks_readers_of_an_epoch_it_left_are_neither_listed_nor_summed() -> None:
    """A DataLoader starts new workers each epoch; the daemon keeps the old ones' reports a while."""
    from datacache.cli._top import current_epoch

    def reader(client: str, rank: int, epoch: int, uid: int = 1000) -> dict[str, Any]:
        return {"client": client, "uid": uid, "dataset": "d", "rank": rank, "epoch": epoch, "samples": 10}

    clients = [
        reader("r0-old", 0, 0),
        reader("r0-new", 0, 1),
        reader("r1-old", 1, 0),
        reader("r1-other-user", 1, 0, uid=1001),
        {"client": "no-rank"},
    ]
    kept = [c["client"] for c in current_epoch(clients)]
    assert kept == ["r0-new", "r1-old", "r1-other-user", "no-rank"]


# -- the live view in a terminal ---------------------------------------------------------------------


class _Terminal:
    """``datacache top`` on a pseudo-terminal of 400 x 50: what it drew, and keys typed into it."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 400, 0, 0))
        self.process = subprocess.Popen(
            [*DATACACHE, "top", *args],
            stdin=slave, stdout=slave, stderr=slave, env={**env, "TERM": "xterm-256color"},
            cwd=REPO, start_new_session=True,
        )  # fmt: skip
        os.close(slave)
        self.seen = ""

    def read_until(self, text: str, *, timeout: float = 60) -> None:
        def arrived() -> bool:
            import selectors

            # poll, not select(): late in a long suite this process's descriptors pass 1024
            with selectors.DefaultSelector() as waiting:
                waiting.register(self.master, selectors.EVENT_READ)
                while waiting.select(0.05):
                    try:
                        chunk = os.read(self.master, 65536)
                    except OSError:
                        break
                    if not chunk:
                        break
                    self.seen += chunk.decode(errors="replace")
            return text in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.seen)

        wait_until(arrived, timeout=timeout, what=f"{text!r} on the terminal")

    def type(self, keys: str) -> None:
        self.seen = ""
        os.write(self.master, keys.encode())

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        os.close(self.master)


@pytest.fixture
def terminal_env(tmp_path: Path, cache_env: dict[str, str]) -> Iterator[tuple[DaemonProcess, dict[str, str]]]:
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        yield daemon, daemon.env
    finally:
        daemon.kill()


def test_the_live_view_sorts_by_key_survives_the_daemon_going_away_and_quits_on_q(
    terminal_env: tuple[DaemonProcess, dict[str, str]],
) -> None:
    daemon, env = terminal_env
    terminal = _Terminal(env, "--interval", "0.2")
    try:
        terminal.read_until("sorted by client")
        assert "through the daemon" in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", terminal.seen)
        terminal.type("b")
        terminal.read_until("sorted by MB/s")
        terminal.type("s")
        terminal.read_until("sorted by stall")
        daemon.kill()  # SIGKILL: the socket stays, nobody answers
        terminal.read_until("is not answering")
        terminal.read_until("retrying every 0.2s")
        assert terminal.process.poll() is None, "top goes on without its daemon"
        assert "Traceback" not in terminal.seen
        terminal.type("q")
        assert terminal.process.wait(30) == 0
    finally:
        terminal.close()


def test_json_streams_one_object_per_refresh_and_bad_input_is_one_line(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    env = daemon_env(cache_env, tmp_path / "local", tmp_path / "local" / "daemon.sock")
    process = subprocess.Popen(
        [*DATACACHE, "top", "--json", "--interval", "0.1"], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert process.stdout is not None
        frames = [json.loads(process.stdout.readline()) for _ in range(3)]
        assert [f["source"] for f in frames] == ["embedded"] * 3
        assert frames[0]["time"] < frames[1]["time"] < frames[2]["time"]
        socket_path = str(tmp_path / "local" / "daemon.sock")
        assert frames[0]["daemon"] == {"socket": socket_path, "answers": False, "error": None}
    finally:
        process.send_signal(signal.SIGINT)
        status = process.wait(30)
        if process.stdout is not None:
            process.stdout.close()
    assert status == 0, "Ctrl-C ends the stream quietly"
    for args, word in (
        (["--interval", "0"], "--interval"),
        (["--sort", "x"], "--sort"),
        (["--interval", "a"], "--interval"),
    ):
        done = _top(env, *args)
        assert done.returncode == 2, done
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and word in done.stderr, done.stderr


def test_report_files_are_read_safely_and_written_only_into_a_private_folder(tmp_path: Path) -> None:
    from datacache.activity import read_report_files, report_file, write_report_file

    local = tmp_path / "local"
    document = {"version": 1, "host": "elsewhere", "pid": 1, "written": 0.0, "client": "c", "reader": {}}
    write_report_file(local, "mine", {**document, "written": time.time()})
    mine = report_file(local, "mine")
    assert mine.stat().st_mode & 0o777 == 0o600 and mine.parent.stat().st_mode & 0o777 == 0o700
    assert [d["client"] for d in read_report_files(local)] == ["c"]
    # Links and fifos in place of a report are skipped, never followed nor opened for a blocking read.
    (mine.parent / "link.json").symlink_to(mine)
    os.mkfifo(mine.parent / "fifo.json")
    (mine.parent / "garbage.json").write_text("{not json")
    assert [d["client"] for d in read_report_files(local)] == ["c"]
    # A report older than the TTL is left out.
    write_report_file(local, "mine", document)
    assert read_report_files(local) == []
    # A folder someone else made for this uid is refused, not written into.
    if os.geteuid() == 0:
        other = tmp_path / "other"
        folder = report_file(other, "x").parent
        folder.mkdir(parents=True, mode=0o700)
        os.chown(folder, 54321, 54321)
        with pytest.raises(PermissionError):
            write_report_file(other, "x", document)
        assert list(folder.iterdir()) == []


def test_top_removes_the_report_files_of_readers_whose_process_ended(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """They stayed under LOCAL_DIR/clients/<uid>/ after their process ended (only hidden from top)."""
    from datacache.activity import report_file, write_report_file

    local = tmp_path / "local"
    writer = (
        "import os, socket, sys, time\n"
        "from datacache.activity import write_report_file\n"
        "write_report_file(__import__('pathlib').Path(sys.argv[1]), 'ended', {'version': 1, "
        "'host': socket.gethostname(), 'pid': os.getpid(), 'written': time.time(), 'client': 'ended', "
        "'reader': {'rank': 0, 'worker': 0}})\n"
    )
    live = {"version": 1, "host": socket.gethostname(), "pid": os.getpid(), "written": time.time(), "client": "live",
            "reader": {"rank": 1, "worker": 0}}
    write_report_file(local, "live", live)
    elsewhere = {**live, "host": "another-node", "pid": 1, "client": "elsewhere"}  # its age, not its pid, tells
    write_report_file(local, "elsewhere", elsewhere)
    # The last reader to start, which then ended: no later reader's first report pruned its file.
    subprocess.run([sys.executable, "-c", writer, str(local)], check=True, timeout=60, cwd=REPO)
    assert report_file(local, "ended").exists()
    frame = _frame({**cache_env, "DATACACHE_LOCAL_DIR": str(local)})
    assert sorted(c["client"] for c in frame["clients"]) == ["elsewhere", "live"]
    assert not report_file(local, "ended").exists()
    assert report_file(local, "live").exists() and report_file(local, "elsewhere").exists()
