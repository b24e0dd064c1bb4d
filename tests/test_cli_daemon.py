"""`datacache warm` and `evict` go through the node's daemon when it answers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _daemon import catalog_rows, make_shards, start_daemon

if TYPE_CHECKING:
    from conftest import S3Bucket

from datacache.client import DaemonClient
from datacache.config import load_settings


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datacache.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_warm_and_evict_through_the_daemon(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    shards = make_shards(origin, 5, 300_000)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local)
    try:
        first = run(daemon.env, "warm", str(origin), "--json")
        assert first.returncode == 0, first.stderr
        summary = json.loads(first.stdout.strip().splitlines()[-1])
        assert summary["complete"] and summary["shards_resident"] == 5
        assert summary["shards_transferred"] == 5 and summary["bytes_transferred"] == sum(map(len, shards.values()))
        rows = catalog_rows(local)
        assert len(rows) == 5 and all(row[-1] == "resident" for row in rows)
        log = daemon.log_text()
        assert all(f"/{key} onto local" in log for key in shards), "the daemon staged every shard"

        again = run(daemon.env, "warm", str(origin))
        assert again.returncode == 0, again.stderr
        assert "transferred 0 bytes" in again.stdout

        evicted = run(daemon.env, "evict", str(origin))
        assert evicted.returncode == 0, evicted.stderr
        assert "evicted 5 shards" in evicted.stdout and "(daemon)" in evicted.stdout
        assert catalog_rows(local) == []
    finally:
        daemon.stop()


def test_a_client_that_reaches_another_endpoint_than_the_daemon_is_told_so(
    tmp_path: Path, cache_env: dict[str, str], s3: S3Bucket
) -> None:
    """A new user's warm through the daemon said "24/24 resident" of the daemon's endpoint's dataset."""
    s3.put("ds/shard-0000.tar", b"x" * 1000)
    daemon = start_daemon({**cache_env, **s3.server.env()}, tmp_path / "local")
    try:
        elsewhere = {**daemon.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
        done = run(elsewhere, "warm", s3.url("ds"))
        assert done.returncode == 2, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "reach a different origin" in done.stderr and "AWS_ENDPOINT_URL" in done.stderr, done.stderr
        # What the daemon may have staged before the client hung up is its own dataset's, under its own id.
        assert all(f"dataset {row[0]!r}," in done.stderr for row in catalog_rows(tmp_path / "local"))
        same = run(daemon.env, "warm", s3.url("ds"))
        assert same.returncode == 0, same.stderr
    finally:
        daemon.stop()


def test_the_daemons_own_error_is_shown_not_unreachable(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """A warm the daemon refuses (nothing at the origin) says why, not that the daemon is gone."""
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        done = run(daemon.env, "warm", str(tmp_path / "no-such-origin"))
        assert done.returncode != 0
        assert "unreachable" not in done.stderr, done.stderr
        assert "no-such-origin" in done.stderr, done.stderr
    finally:
        daemon.stop()


def test_a_pattern_naming_no_shard_is_named_through_the_daemon_too(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """Warm names the pattern as the loader does; through the daemon it said `no shard ... in its manifest`."""
    origin = tmp_path / "origin"
    make_shards(origin, 2, 1000)
    pattern = f"{origin}/shard-{{0100..0101}}.tar"
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        done = run(daemon.env, "warm", pattern)
        assert done.returncode != 0
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"datacache: error: {pattern} matches no shard"), done.stderr
    finally:
        daemon.stop()


# -- one warm: the stager's, through the daemon (issue 12 item 8) ----------------------------


def _summary(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    document = json.loads(done.stdout.strip().splitlines()[-1])
    assert isinstance(document, dict) and document["event"] == "done", done.stdout
    return document


def test_warm_bandwidth_is_honoured_through_the_daemon(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    shards = make_shards(origin, 8, 500_000)
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        done = run(daemon.env, "warm", str(origin), "--bandwidth", "1MB/s", "--json")
        assert done.returncode == 0, done.stderr
        summary = _summary(done)
        assert summary["bytes_transferred"] == sum(map(len, shards.values()))
        # An upper bound only (a slow machine is slower still): 4 MB at 1 MB/s, with at most one
        # second's burst, cannot take under 3 s; unpaced, the daemon moves it in a fraction of that.
        assert float(summary["rate_bytes_per_s"]) <= 1.5e6, summary  # type: ignore[arg-type]
    finally:
        daemon.stop()


def test_the_daemons_warm_is_not_complete_when_a_shard_was_evicted_during_it(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    make_shards(origin, 4, 1_000_000)
    # One transfer at a time: each new shard makes room by evicting (LRU) one the warm staged before.
    daemon = start_daemon(cache_env, tmp_path / "local", "--local-capacity", "2500000B", "--concurrency", "1")
    try:
        done = run(daemon.env, "warm", str(origin), "--policy", "lru", "--json")
        summary = _summary(done)
        resident = int(summary["shards_resident"])  # type: ignore[call-overload]
        assert resident <= 2, summary  # 2.5 MB hold two 1 MB shards, whatever the daemon said per shard
        assert summary["complete"] is False and done.returncode == 1, summary
        assert len(summary["failures"]) == 4 - resident, summary  # type: ignore[arg-type]
        embedded = run(daemon.env, "warm", str(origin), "--policy", "lru", "--json", "--no-daemon")
        assert set(_summary(embedded)) == set(summary)  # one wire form, whichever ran the warm
    finally:
        daemon.stop()


# -- status: is a daemon answering, and whose is it ------------------------------------------


def _daemon_status(env: dict[str, str]) -> tuple[dict[str, object], str]:
    as_json = run(env, "status", "--json")
    assert as_json.returncode == 0, as_json.stderr
    text = run(env, "status")
    assert text.returncode == 0, text.stderr
    line = next(line for line in text.stdout.splitlines() if line.startswith("daemon "))
    return json.loads(as_json.stdout)["daemon"], line


def test_status_says_whether_a_daemon_answers_and_whose_it_is(tmp_path: Path, cache_env: dict[str, str]) -> None:
    local = tmp_path / "local"
    sock = local / "daemon.sock"
    alone = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    document, line = _daemon_status(alone)
    assert document["answers"] is False and document["socket"] == str(sock)
    assert f"{sock}: none answers (no socket there)" in line, line

    daemon = start_daemon(cache_env, local)
    try:
        document, line = _daemon_status(daemon.env)
        user = pwd.getpwuid(os.getuid()).pw_name
        assert document["answers"] is True
        assert (document["pid"], document["uid"], document["user"]) == (daemon.process.pid, os.getuid(), user)
        assert f"answers: pid {daemon.process.pid}, uid {os.getuid()} ({user})" in line, line
    finally:
        daemon.kill()  # SIGKILL: the socket file stays behind, and nobody listens on it
    assert sock.exists()
    document, line = _daemon_status(daemon.env)
    assert document["answers"] is False
    assert "none answers" in line and "no socket there" not in line, line


def test_status_does_not_hang_on_a_socket_that_never_answers(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """A listener that accepts nothing and says nothing: status reports it and returns."""
    local = tmp_path / "local"
    local.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(local / "daemon.sock"))
        listener.listen(8)  # connections queue in the kernel; nothing ever reads or replies
        document, line = _daemon_status({**cache_env, "DATACACHE_LOCAL_DIR": str(local)})
    finally:
        listener.close()
    assert document["answers"] is False
    assert "TimeoutError" in str(document["detail"]) or "did not answer" in str(document["detail"]), document
    assert "none answers" in line, line


def test_status_shows_the_daemons_settings_when_one_answers(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """A new user's status said "unbounded" local capacity while the daemon it found ran with 1 GB."""
    daemon = start_daemon(cache_env, tmp_path / "local", "--local-capacity", "1GB")
    try:
        assert "DATACACHE_LOCAL_CAPACITY" not in daemon.env  # this process's own settings: unbounded
        as_json = run(daemon.env, "status", "--json")
        text = run(daemon.env, "status")
    finally:
        daemon.stop()
    assert as_json.returncode == 0 and text.returncode == 0, as_json.stderr + text.stderr
    document = json.loads(as_json.stdout)
    assert document["tiers_from"] == "daemon", document
    [local] = [tier for tier in document["tiers"] if tier["tier"] == "local"]
    assert local["capacity_bytes"] == 1_000_000_000, local
    assert "unbounded" not in text.stdout, text.stdout
    assert f"tiers as the daemon (pid {daemon.process.pid}) runs them:" in text.stdout, text.stdout
    assert "of 1.00 GB" in text.stdout, text.stdout


def test_the_daemons_warm_lines_say_totals_and_progress_in_the_clis_words(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    shards = make_shards(origin, 3, 200_000)
    daemon = start_daemon(cache_env, tmp_path / "local")

    async def warm_lines() -> list[dict[str, object]]:
        client = DaemonClient(load_settings(daemon.env))
        try:
            return [line async for line in client.warm(str(origin))]
        finally:
            await client.close()

    try:
        lines = asyncio.run(warm_lines())
    finally:
        daemon.stop()
    start, *steps, done = lines
    assert start["event"] == "start" and (start["shards_total"], start["bytes_total"]) == (3, 600_000), start
    assert "shards" not in start and "bytes" not in start, "no aliases: nothing has been released"
    assert steps and all(line["event"] == "progress" for line in steps), steps
    words = {"shards_done", "shards_total", "bytes_done", "bytes_total", "bytes_transferred", "rate_bytes_per_s"}
    assert all(words <= set(line) for line in steps), steps
    assert (steps[-1]["shards_done"], steps[-1]["bytes_done"]) == (3, sum(map(len, shards.values())))
    assert done["event"] == "done" and done["complete"] is True


def test_a_dataset_bigger_than_the_daemons_tier_is_said_in_one_line_with_its_capacity(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """Through the daemon the CLI knew no capacity and said "dataset 1.50 MB do not fit in the room left"."""
    origin = tmp_path / "origin"
    make_shards(origin, 5, 300_000)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local, "--local-capacity", "700kB")
    try:
        result = run(daemon.env, "warm", str(origin))
        assert result.returncode == 1, result.stdout + result.stderr
        said = [line for line in result.stderr.splitlines() if "kept" in line]
        line = "datacache: dataset 1.50 MB > local capacity 700.00 kB: 2 of 5 shards kept (-v lists the others)"
        assert said == [line]
    finally:
        daemon.stop()


def test_a_warm_of_some_shards_through_the_daemon_makes_room_among_the_datasets_others(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """The daemon runs the same warm: `--shards` the dataset's other shards crowd out are staged, and said."""
    origin = tmp_path / "origin"
    make_shards(origin, 5, 30_000)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local, "--local-capacity", "90kB")
    try:
        # A warm of all five keeps the first three, the tier's room (not kept: exit 1; which three was once
        # the daemon's transfer workers' race to the catalog, test_a_warm_through_the_daemon_bigger_than_...).
        assert run(daemon.env, "warm", str(origin), "-q").returncode == 1
        result = run(daemon.env, "warm", str(origin), "--shards", "3:5", "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert (summary["shards_resident"], summary["shards_displaced"], summary["bytes_displaced"]) == (2, 2, 60_000)
        rows = {row[1] for row in catalog_rows(local) if row[-1] == "resident"}
        assert len(rows) == 3 and {"shard-0003.tar", "shard-0004.tar"} <= rows, rows
        gone = sorted({f"shard-{i:04d}.tar" for i in range(3)} - rows)[0]
        plain = run(daemon.env, "warm", str(origin), "--shards", gone)
        assert plain.returncode == 0, plain.stderr
        assert "; made room by evicting 1 other shard of the dataset (30.00 kB)" in plain.stdout, plain.stdout
    finally:
        daemon.stop()


def test_a_warm_through_the_daemon_bigger_than_the_tier_keeps_the_shards_asked_for_first(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """5 shards into a tier of 3: the daemon's prefetch gate has them in order, but its transfer workers reached
    the catalog in whatever order the threads ran; as in a warm in one process (`staging.batch.Turn`), each
    shard's room is reserved after the one before it has reserved its own. Several rounds: the race was rare."""
    origin = tmp_path / "origin"
    make_shards(origin, 5, 30_000)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local, "--local-capacity", "90kB")
    first = {f"shard-{i:04d}.tar" for i in range(3)}
    try:
        for round_ in range(8):
            result = run(daemon.env, "warm", str(origin), "--json")
            assert result.returncode == 1, result.stdout + result.stderr  # not all of it kept: said, exit 1
            summary = json.loads(result.stdout.strip().splitlines()[-1])
            assert summary["shards_resident"] == 3, summary
            rows = {row[1] for row in catalog_rows(local) if row[-1] == "resident"}
            assert rows == first, f"round {round_}: kept {sorted(rows)}"
            assert run(daemon.env, "evict", str(origin)).returncode == 0
    finally:
        daemon.stop()


def _shared_in_top(env: dict[str, str]) -> tuple[int, int]:
    shown = run(env, "top", "--once", "--json")
    assert shown.returncode == 0, shown.stderr
    [tier] = [t for t in json.loads(shown.stdout)["tiers"] if t["tier"] == "shared"]
    return tier["used_bytes"], tier["shards"]


def test_warm_tier_shared_asks_the_daemon_which_writes_the_shared_tier(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """The CLI refused `--tier shared` for want of a shared directory of its own, before asking the daemon."""
    origin = tmp_path / "origin"
    make_shards(origin, 3, 50_000)
    shared = tmp_path / "shared"
    daemon = start_daemon(cache_env, tmp_path / "local", "--shared-dir", str(shared))
    try:
        assert "DATACACHE_SHARED_DIR" not in daemon.env  # the user's side names no shared tier
        assert _shared_in_top(daemon.env) == (0, 0)  # the daemon walks its (empty) shared tier here
        result = run(daemon.env, "warm", str(origin), "--tier", "shared", "--json")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["complete"] and summary["tier"] == "shared" and summary["shards_resident"] == 3
        assert len([p for p in shared.rglob("shard-*.tar") if p.is_file()]) == 3
        # Within the minute between walks, top counts what the daemon itself just stored there.
        assert _shared_in_top(daemon.env) == (150_000, 3)
    finally:
        daemon.stop()
    # A daemon without a shared tier says so once, not once per shard.
    bare = start_daemon(cache_env, tmp_path / "bare-local")
    try:
        refused = run(bare.env, "warm", str(origin), "--tier", "shared")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        [line] = refused.stderr.strip().splitlines()
        assert line.startswith("datacache: error: daemon: no shared tier on this node (the operator gives"), line
    finally:
        bare.stop()
    # No daemon and no shared tier: one line saying what to do.
    no_daemon = {**daemon.env, "DATACACHE_SOCKET": str(tmp_path / "none.sock")}
    alone = run(no_daemon, "warm", str(origin), "--tier", "shared")
    assert alone.returncode == 2
    [line] = alone.stderr.strip().splitlines()
    assert "--tier shared needs a shared tier" in line and "datacache serve" in line


def test_a_listing_that_mixes_formats_is_told_to_the_client_through_the_daemon(
    tmp_path: Path, cache_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Tar shards with a Parquet file beside them: the warning reached only the daemon's log."""
    origin = tmp_path / "origin"
    make_shards(origin, 2, 1000)
    (origin / "meta.parquet").write_bytes(b"PAR1" + bytes(8) + b"PAR1")  # listed, never read
    daemon = start_daemon(cache_env, tmp_path / "local")

    async def open_twice() -> None:
        client = DaemonClient(load_settings(daemon.env))
        try:
            await client.open(str(origin))
            await client.open(str(origin))
        finally:
            await client.close()

    try:
        # A run of its own (a process group, as a shell starts a command): this test's process is another.
        done = subprocess.run(
            [sys.executable, "-m", "datacache.cli", "warm", str(origin)],
            env=daemon.env, capture_output=True, text=True, timeout=120, check=False, start_new_session=True,
        )
        with caplog.at_level(logging.WARNING, logger="datacache"):
            asyncio.run(open_twice())
    finally:
        daemon.stop()
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "reading the tar shards only" in line]
    assert len(said) == 1 and "holds 2 .tar and 1 .parquet files" in said[0], done.stderr
    opened = [r.getMessage() for r in caplog.records if "reading the tar shards only" in r.getMessage()]
    assert len(opened) == 1 and 'set format = "parquet"' in opened[0], opened


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--allow-dataset", "htp://host/ok/", "did you mean http://"),
        ("--allow-dataset", "S3://bucket/", "write the scheme in lower case"),
        ("--allow-endpoint", "127.0.0.1:9000", "expected an http:// or https:// endpoint URL"),
    ],
)
def test_serve_refuses_a_mistyped_allow_flag_before_it_listens(
    tmp_path: Path, cache_env: dict[str, str], flag: str, value: str, named: str
) -> None:
    """A trial's ``--allow-dataset htp://x/`` started a daemon that matched nothing and said nothing."""
    socket_path = tmp_path / "d.sock"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "DATACACHE_SOCKET": str(socket_path)}
    result = run(env, "serve", flag, value)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"datacache: error: {flag} ") and named in line, line
    assert not socket_path.exists()
