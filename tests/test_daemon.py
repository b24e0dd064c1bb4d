"""``datacache serve`` as a real subprocess: protocol, sharing, priorities, lifecycle, failover."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import socket
import stat
import subprocess
import sys
import threading
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _daemon import (
    REPO,
    DaemonProcess,
    catalog_rows,
    checksum,
    make_shards,
    raw_exchange,
    start_daemon,
    visible_files,
    wait_until,
)
from datacache.tiers import ByteRange
from prometheus_client.parser import text_string_to_metric_families

from datacache.access import EMBEDDED_FALLBACK, FailoverAccess, open_access
from datacache.client import DaemonClient
from datacache.config import DatasetConfig, Settings, load_settings, resolve_dataset
from datacache.daemon.metrics import METRICS
from datacache.errors import ConfigError, DaemonUnavailableError, InvalidKeyError, ShardNotFoundError


def client_settings(env: dict[str, str], daemon: DaemonProcess) -> Settings:
    return load_settings(env, overrides={"local_dir": str(daemon.local_dir), "socket": str(daemon.socket)})


@pytest.fixture
def origin(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    directory = tmp_path / "origin"
    return directory, make_shards(directory, 6, 200_000)


@pytest.fixture
def daemon(tmp_path: Path, cache_env: dict[str, str]) -> Any:
    process = start_daemon(cache_env, tmp_path / "cache", "--log-json")
    try:
        yield process
    finally:
        process.kill()


# -- the socket, the metrics port, the logs -------------------------------------------------


def test_socket_is_0660_metrics_bind_loopback_and_logs_are_json(
    daemon: DaemonProcess, origin: tuple[Path, dict[str, bytes]]
) -> None:
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    assert stat.S_ISSOCK(daemon.socket.stat().st_mode)
    assert stat.S_IMODE(daemon.local_dir.stat().st_mode) == 0o750  # its group (its clients) opens the shards
    status = daemon.status()
    host, port = status["metrics_address"].rsplit(":", 1)
    assert host == "127.0.0.1"
    base = f"http://127.0.0.1:{port}"
    code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin[0])})
    assert code == 200, opened
    code, _ = daemon.request("POST", "/v1/ensure", {"dataset": opened["dataset_id"], "key": "shard-0000.tar"})
    assert code == 200
    for path in ("/healthz", "/readyz"):
        with urllib.request.urlopen(base + path, timeout=10) as response:
            assert response.status == 200
        assert daemon.request("GET", path)[0] == 200
    with urllib.request.urlopen(base + "/metrics", timeout=10) as response:
        text = response.read().decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    exposed = {sample.name for family in families.values() for sample in family.samples}
    assert "datacache_staged_bytes_total" in exposed
    staged = [s for s in families["datacache_staged_bytes"].samples if s.labels.get("tier") == "local"]
    assert staged[0].value == 200_000
    assert "datacache_staging_seconds_bucket" in exposed
    for name in (
        "datacache_hits_total",
        "datacache_misses_total",
        "datacache_queue_depth",
        "datacache_tier_used_bytes",
        "datacache_prefetch_slots",
        "datacache_ready",
    ):
        assert name in exposed, name
    # One JSON object per line, with the event's fields.
    lines = [json.loads(line) for line in daemon.log_text().splitlines() if line.strip()]
    assert any(line.get("event") == "staged" and line.get("key") == "shard-0000.tar" for line in lines)
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)


def test_metric_registry_matches_the_declared_names(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from datacache.daemon.metrics import DaemonMetrics

    metrics = DaemonMetrics()
    declared = set(METRICS)
    names = set()
    for family in metrics.registry.collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        names.add(family.name + suffix)
    assert names == declared


# -- the protocol ---------------------------------------------------------------------------


def test_protocol_round_trip_through_the_client(
    daemon: DaemonProcess, origin: tuple[Path, dict[str, bytes]], cache_env: dict[str, str]
) -> None:
    directory, shards = origin
    settings = client_settings(cache_env, daemon)

    async def main() -> None:
        client = DaemonClient(settings, client_name="rank0-worker0")
        try:
            assert client.mode == "daemon"
            handle = await client.open(str(directory))
            assert handle.id == resolve_dataset(str(directory), settings).id
            assert sorted(s.key for s in handle.manifest.shards) == sorted(shards)
            location = await client.ensure(handle, "shard-0000.tar")
            assert location.tier == "local" and location.path is not None
            assert location.path.read_bytes() == shards["shard-0000.tar"]
            assert location.checksum == checksum(shards["shard-0000.tar"])
            assert (await client.locate(handle, "shard-0001.tar")).tier == "origin"
            assert await client.read(handle, "shard-0001.tar") == shards["shard-0001.tar"]
            assert await client.read(handle, "shard-0000.tar", ByteRange(10, 20)) == shards["shard-0000.tar"][10:20]
            await client.set_future_order(handle, sorted(shards))
            await client.prefetch(handle, ["shard-0002.tar", "shard-0003.tar"])
            deadline = asyncio.get_running_loop().time() + 30
            for key in ("shard-0002.tar", "shard-0003.tar"):
                while (await client.locate(handle, key)).tier != "local":
                    assert asyncio.get_running_loop().time() < deadline, f"{key} was never prefetched"
                    await asyncio.sleep(0.01)  # sleep-ok: spaces the polls of a condition with a deadline
            # A prefetch-priority ensure goes through the prefetch gate and still answers.
            assert (await client.ensure(handle, "shard-0004.tar", priority=2.0)).tier == "local"
            with pytest.raises(ShardNotFoundError):
                await client.ensure(handle, "no-such-shard.tar")
            with pytest.raises(InvalidKeyError):
                await client.ensure(handle, "../escape.tar")
            # A corrupt copy, reported, is dropped and staged again.
            path = location.path
            path.chmod(0o600)
            path.write_bytes(b"x" * len(shards["shard-0000.tar"]))
            await client.report_corrupt(handle, location)
            again = await client.ensure(handle, "shard-0000.tar")
            assert again.path is not None and again.path.read_bytes() == shards["shard-0000.tar"]
            await client.report(delivered_bytes_per_s=5e8, stall_fraction=0.25, delivered_bytes=10**9)
            await client.pin(handle.id)
            status = await client.status()
            assert status["datasets"][0]["pinned"] is True
            assert status["clients"][0]["client"] == "rank0-worker0"
            assert status["clients"][0]["stall_fraction"] == 0.25
            await client.unpin(handle.id)
            events = [event async for event in client.warm(str(directory))]
            assert events[0]["event"] == "start" and events[-1]["event"] == "done"
            assert events[-1]["complete"] is True and events[-1]["shards_resident"] == len(shards)
            count, size = await client.evict(handle.id, ["shard-0005.tar"])
            assert (count, size) == (1, len(shards["shard-0005.tar"]))
            assert (await client.locate(handle, "shard-0005.tar")).tier == "origin"
        finally:
            await client.close()

    asyncio.run(main())
    assert "credential" not in daemon.log_text()


def test_credentials_never_reach_status_or_errors(daemon: DaemonProcess, tmp_path: Path) -> None:
    config = {
        "name": "secret-ds",
        "url": "s3://AKIASECRET:hunter2@bucket-that-does-not-exist/prefix",
        "storage_options": {"key": "AKIASECRET", "secret": "hunter2", "endpoint_url": "http://127.0.0.1:9"},
    }
    code, reply = daemon.request("POST", "/v1/open", {"dataset": config})
    assert code >= 400
    text = json.dumps(reply) + json.dumps(daemon.status()) + daemon.log_text()
    assert "hunter2" not in text
    assert "AKIASECRET:" not in text


def test_bad_requests_get_clear_errors_and_the_daemon_stays_up(
    daemon: DaemonProcess, origin: tuple[Path, dict[str, bytes]]
) -> None:
    code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin[0])})
    assert code == 200
    dataset = opened["dataset_id"]
    reply = raw_exchange(daemon.socket, b"\x00\xffgarbage that is not HTTP\r\n\r\n")
    assert reply.startswith((b"HTTP/1.0 400", b"HTTP/1.1 400"))
    code, reply = daemon.request("POST", "/v1/ensure", raw=b"{not json")
    assert (code, reply["error"]["code"]) == (400, "bad_request")
    code, reply = daemon.request("POST", "/v1/ensure", raw=b"[1, 2]")
    assert (code, reply["error"]["code"]) == (400, "bad_request")
    code, reply = daemon.request("POST", "/v1/frobnicate", {})
    assert (code, reply["error"]["code"]) == (404, "unknown_request")
    assert "frobnicate" in reply["error"]["message"]
    code, reply = daemon.request("POST", "/v1/ensure", {"dataset": dataset, "key": "../../etc/passwd"})
    assert (code, reply["error"]["code"]) == (400, "invalid_key")
    code, reply = daemon.request("POST", "/v1/prefetch", {"dataset": dataset, "keys": ["a/../../b"]})
    assert (code, reply["error"]["code"]) == (400, "invalid_key")
    code, reply = daemon.request("POST", "/v1/ensure", {"dataset": dataset, "key": 7})
    assert (code, reply["error"]["code"]) == (400, "bad_request")
    code, reply = daemon.request("POST", "/v1/ensure", {"dataset": "never-opened", "key": "a.tar"})
    assert (code, reply["error"]["code"]) == (409, "unknown_dataset")
    code, reply = daemon.request("POST", "/v1/report", {"stall_fraction": 7})
    assert (code, reply["error"]["code"]) == (400, "bad_request")
    huge = raw_exchange(
        daemon.socket,
        b"POST /v1/ensure HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999999\r\n\r\n{",
    )
    assert huge.startswith(b"HTTP/1.1 413"), huge
    assert all(len(line) < 300 for line in [reply["error"]["message"]])
    assert daemon.ready()
    assert daemon.request("POST", "/v1/ensure", {"dataset": dataset, "key": "shard-0000.tar"})[0] == 200


def test_peer_and_dataset_allowlists(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from datacache.daemon import Daemon, DaemonOptions
    from datacache.daemon._http import Peer

    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "cache")})
    daemon = Daemon(settings, DaemonOptions(allow_uids=frozenset({4242}), allow_datasets=("s3://ok-bucket/",)))
    stranger = os.getuid() + 1000 if os.getuid() != 0 else 1000
    with pytest.raises(ConfigError, match="may not use this daemon"):
        daemon.peers.check(Peer(1, stranger, stranger + 1))
    daemon.peers.check(Peer(1, 4242, 4242))
    daemon.peers.check(Peer(1, os.getuid(), os.getgid()))
    admit = daemon.registry.policy.admit
    admit(DatasetConfig(name="a", url="s3://ok-bucket/imagenet"), {}, configured=False, operator=True)
    with pytest.raises(ConfigError, match="allowlist"):
        admit(DatasetConfig(name="b", url="s3://other-bucket/x"), {}, configured=False, operator=True)
    with pytest.raises(ConfigError, match="allowlist"):
        admit(DatasetConfig(name="c", url="s3://ok-bucket-evil/x"), {}, configured=False, operator=True)


# -- one daemon, one node --------------------------------------------------------------------


def test_a_second_daemon_is_refused_and_a_stale_socket_replaced(tmp_path: Path, cache_env: dict[str, str]) -> None:
    first = start_daemon(cache_env, tmp_path / "cache")
    try:
        # The same cache directory: the node lock says no.
        second = start_daemon(cache_env, tmp_path / "cache", socket_path=tmp_path / "other.sock", wait=False)
        assert second.process.wait(timeout=60) == 1
        assert "another datacache daemon" in second.log_text()
        # Another cache directory but the same socket: a live daemon answers there.
        third = start_daemon(cache_env, tmp_path / "cache2", socket_path=first.socket, wait=False)
        assert third.process.wait(timeout=60) == 1
        assert "answers on" in third.log_text()
        assert first.ready()
        first.kill()  # kill -9: the socket file stays behind
        assert first.socket.exists()
        restarted = start_daemon(cache_env, tmp_path / "cache")
        try:
            assert restarted.ready()
            assert restarted.status()["pid"] == restarted.process.pid
        finally:
            restarted.kill()
    finally:
        first.kill()


def test_a_daemon_that_cannot_start_says_only_why(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """It logged "stopping: finishing running transfers" first, of a daemon that never ran."""
    first = start_daemon(cache_env, tmp_path / "cache")
    port = socket.socket()
    try:
        port.bind(("127.0.0.1", 0))
        port.listen(1)
        taken = f"127.0.0.1:{port.getsockname()[1]}"
        refused = {
            "another datacache daemon": start_daemon(
                cache_env, tmp_path / "cache", socket_path=tmp_path / "other.sock", wait=False
            ),
            "answers on": start_daemon(cache_env, tmp_path / "cache2", socket_path=first.socket, wait=False),
            "cannot listen for metrics": start_daemon(
                cache_env, tmp_path / "cache3", "--metrics-address", taken, wait=False
            ),
        }
        for reason, daemon in refused.items():
            assert daemon.process.wait(timeout=60) == 1
            lines = [line for line in daemon.log_text().splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("datacache: error: ") and reason in lines[0], lines
        assert first.ready()
    finally:
        port.close()
        first.kill()


def test_a_shared_tier_its_group_cannot_use_is_said_at_the_daemons_start_before_any_client(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """A new user's trial: `serve --shared-dir` on a 0755 directory said nothing; an in-process warm warned twice."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    daemon = start_daemon(cache_env, tmp_path / "cache", "--shared-dir", str(shared))
    try:
        lines = daemon.log_text().splitlines()
    finally:
        daemon.stop()
    ready = next(i for i, line in enumerate(lines) if "daemon ready" in line)
    said = [line for line in lines[:ready] if f"shared tier {shared}" in line]
    assert any("its group cannot use it" in line and "chmod 2770" in line for line in said), lines
    assert any("not setgid" in line for line in said), lines


def test_open_access_without_a_daemon_is_embedded(tmp_path: Path, cache_env: dict[str, str]) -> None:
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "cache")})
    settings.local_dir.mkdir(parents=True)
    # A stale socket file nobody answers on counts as no daemon.
    import socket as socket_module

    stale = socket_module.socket(socket_module.AF_UNIX)
    stale.bind(str(settings.daemon_socket))
    stale.close()

    async def main() -> str:
        access = await open_access(settings)
        try:
            return access.mode
        finally:
            await access.close()

    assert asyncio.run(main()) == "embedded"


def test_clients_pickle_as_configuration(tmp_path: Path, cache_env: dict[str, str]) -> None:
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "cache")})
    client = DaemonClient(settings, client_name="w0")
    access = FailoverAccess(client, settings, retry_interval=0.5)
    copy = pickle.loads(pickle.dumps(access))
    assert copy.mode == "daemon"
    assert copy.primary.client_name == "w0"
    assert copy.primary.socket_path == settings.daemon_socket
    assert copy.retry_interval == 0.5


# -- sharing ---------------------------------------------------------------------------------

_CLIENT_SCRIPT = r"""
import asyncio, json, random, sys
from datacache.access import open_access
from datacache.config import DatasetConfig, load_settings

async def main():
    spec = json.loads(sys.argv[1])
    settings = load_settings()
    access = await open_access(settings)
    dataset = DatasetConfig(name=spec["name"], url=spec["url"], storage_options=spec["options"])
    handle = await access.open(dataset)
    keys = [shard.key for shard in handle.manifest.shards]
    random.Random(spec["seed"]).shuffle(keys)
    seen = {}
    for key in keys:
        location = await access.ensure(handle, key)
        seen[key] = [location.tier, str(location.path), len(location.path.read_bytes())]
    mode = access.mode
    await access.close()
    print(json.dumps({"mode": mode, "seen": seen}))

asyncio.run(main())
"""


def test_eight_clients_share_one_transfer_per_shard(tmp_path: Path, cache_env: dict[str, str], s3: Any) -> None:
    shards = {f"train/shard-{i:03d}.tar": os.urandom(150_000) for i in range(12)}
    for key, data in shards.items():
        s3.put(key, data)
    env = {**cache_env, **s3.server.env()}
    daemon = start_daemon(env, tmp_path / "cache")
    try:
        spec = {"name": "shared-ds", "url": s3.url("train"), "options": s3.storage_options}
        s3.server.reset_counts()
        clients = [
            subprocess.Popen(
                [sys.executable, "-c", _CLIENT_SCRIPT, json.dumps({**spec, "seed": seed})],
                env=daemon.env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in range(8)
        ]
        results = []
        for process in clients:
            out, err = process.communicate(timeout=240)
            assert process.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
        assert {result["mode"] for result in results} == {"daemon"}
        paths = {tuple(result["seen"][key]) for result in results for key in result["seen"]}
        assert all(tier == "local" for tier, _, _ in paths)
        assert len({path for _, path, _ in paths}) == len(shards)  # one copy of each shard
        counts = s3.server.request_counts()
        gets = {name.split(" ", 1)[1]: n for name, n in counts.items() if name.startswith("GET ")}
        for key in shards:
            assert gets.get(f"/{s3.name}/{key}") == 1, (key, counts)
        assert len(visible_files(daemon.local_dir)) == len(shards)
        assert daemon.status()["stats"]["shards_staged"] == len(shards)
    finally:
        daemon.kill()


# -- priorities ------------------------------------------------------------------------------


def test_an_urgent_ensure_passes_a_prefetch_backlog(tmp_path: Path, cache_env: dict[str, str]) -> None:
    directory = tmp_path / "origin"
    shards = make_shards(directory, 40, 256_000)
    # Prefetching is paced at 1 MB/s: the 10 MB backlog needs ~10 s to drain.
    daemon = start_daemon(
        cache_env, tmp_path / "cache", "--concurrency", "2", "--prefetch-slots", "1", "--prefetch-bandwidth", "1MB/s"
    )
    try:
        settings = client_settings(cache_env, daemon)

        async def main() -> tuple[str, dict[str, Any]]:
            client = DaemonClient(settings)
            try:
                handle = await client.open(str(directory))
                keys = sorted(shards)
                await client.prefetch(handle, keys)
                last = await client.ensure(handle, keys[-1])  # a reader blocked on the last one
                return last.tier, await client.status()
            finally:
                await client.close()

        tier, status = asyncio.run(main())
        assert tier == "local"
        # It was served while most of the backlog still waited for its slot.
        assert status["prefetch"]["pending"] > 0
        assert status["stats"]["shards_staged"] < len(shards)
        assert daemon.stop() == 0
    finally:
        daemon.kill()


def test_prefetch_scheduler_caps_concurrency_and_orders_by_priority(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from datacache.daemon import PrefetchScheduler, default_prefetch_slots

    assert default_prefetch_slots(1) == 1
    assert default_prefetch_slots(2) == 1
    assert default_prefetch_slots(8) == 6

    class FakeStager:
        def __init__(self) -> None:
            self.running = 0
            self.peak = 0
            self.order: list[str] = []
            self.release = asyncio.Event()

        async def locate(self, handle: Any, key: str) -> Any:
            return type("L", (), {"tier": "origin"})()

        async def ensure(self, handle: Any, key: str, *, tier: str, priority: float) -> Any:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.order.append(key)
            await self.release.wait()
            self.running -= 1
            return type("L", (), {"tier": "local", "key": key})()

    class Handle:
        id = "ds"

    async def main() -> None:
        fake = FakeStager()
        scheduler = PrefetchScheduler(fake, slots=2)  # type: ignore[arg-type]
        scheduler.start()
        handle: Any = Handle()
        futures = [scheduler.submit(handle, f"k{i}", priority=10 - i, wait=True) for i in range(6)]
        scheduler.submit(handle, "k5", priority=0.5)  # already pending: one entry, its priority lowered
        while fake.running < 2:
            await asyncio.sleep(0)  # sleep-ok: yields to the scheduler's tasks, no time passes
        assert scheduler.pending == 4 and scheduler.running == 2
        fake.release.set()
        results = await asyncio.gather(*[f for f in futures if f is not None])
        assert [r.key for r in results] == [f"k{i}" for i in range(6)]
        assert fake.peak == 2  # never more than the slots, however long the backlog
        assert fake.order == ["k5", "k4", "k3", "k2", "k1", "k0"]  # lowest priority number first
        fake.release.clear()
        waiting = scheduler.submit(handle, "late", priority=1.0, wait=True)
        blocked = scheduler.submit(handle, "later", priority=2.0, wait=True)
        blocked2 = scheduler.submit(handle, "latest", priority=3.0, wait=True)
        while fake.running < 2:
            await asyncio.sleep(0)  # sleep-ok: yields to the scheduler's tasks, no time passes
        stopping = asyncio.ensure_future(scheduler.stop(5.0))
        await asyncio.sleep(0)  # sleep-ok: yields to the scheduler's tasks, no time passes
        assert blocked2 is not None
        with pytest.raises(DaemonUnavailableError):
            await blocked2
        fake.release.set()
        await stopping
        assert waiting is not None and blocked is not None
        assert (await waiting).key == "late" and (await blocked).key == "later"
        with pytest.raises(DaemonUnavailableError):
            scheduler.submit(handle, "after", priority=1.0)

    asyncio.run(main())


# -- lifecycle -------------------------------------------------------------------------------


def test_sigterm_abandons_a_slow_transfer_cleanly_and_exits_in_bounded_time(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    directory = tmp_path / "origin"
    directory.mkdir()
    (directory / "big.tar").write_bytes(os.urandom(24 << 20))
    daemon = start_daemon(cache_env, tmp_path / "cache", "--bandwidth", "1MB/s", "--drain-timeout", "1")
    try:
        settings = client_settings(cache_env, daemon)
        outcome: dict[str, Any] = {}

        def reader() -> None:
            async def main() -> None:
                client = DaemonClient(settings)
                try:
                    handle = await client.open(str(directory))
                    outcome["location"] = await client.ensure(handle, "big.tar")
                except Exception as exc:
                    outcome["error"] = exc
                finally:
                    await client.close()

            asyncio.run(main())

        thread = threading.Thread(target=reader)
        thread.start()
        wait_until(lambda: daemon.status()["stats"]["in_flight"] >= 1, what="the transfer to start")
        daemon.signal(signal.SIGTERM)
        assert daemon.process.wait(timeout=30) == 0
        thread.join(timeout=30)
        assert isinstance(outcome.get("error"), DaemonUnavailableError), outcome  # a reader fails over
        assert "location" not in outcome
        assert not daemon.socket.exists()
        assert [row for row in catalog_rows(daemon.local_dir) if row[4] != "resident"] == []
        assert visible_files(daemon.local_dir) == []
        assert "abandoned" in daemon.log_text()
    finally:
        daemon.kill()


def test_kill_9_mid_warm_then_restart_recovers_with_nothing_corrupt(tmp_path: Path, cache_env: dict[str, str]) -> None:
    directory = tmp_path / "origin"
    shards = make_shards(directory, 10, 1_000_000, seed=3)
    local = tmp_path / "cache"
    daemon = start_daemon(cache_env, local, "--bandwidth", "2MB/s", "--concurrency", "2")
    try:
        code, opened = daemon.request("POST", "/v1/open", {"dataset": str(directory)})
        assert code == 200
        dataset = opened["dataset_id"]
        code, _ = daemon.request("POST", "/v1/prefetch", {"dataset": dataset, "keys": sorted(shards)})
        assert code == 200
        wait_until(lambda: daemon.status()["stats"]["shards_staged"] >= 2, what="a few shards staged")
        daemon.kill()  # SIGKILL in the middle of the warm-up
    finally:
        daemon.kill()
    resident_before = {row[1] for row in catalog_rows(local) if row[4] == "resident"}
    assert resident_before and daemon.socket.exists()

    restarted = start_daemon(cache_env, local)
    try:
        rows = catalog_rows(local)
        assert all(state == "resident" for *_, state in rows)  # no staging row survives recovery
        for _, key, size, digest, _ in rows:
            data = (local / "data" / dataset / key).read_bytes()
            assert len(data) == size and checksum(data) == digest == checksum(shards[key])
        assert {path.name for path in visible_files(local)} == {row[1] for row in rows}
        settings = load_settings(cache_env, overrides={"local_dir": str(local)})

        async def warm() -> dict[str, Any]:
            client = DaemonClient(settings)
            try:
                return [event async for event in client.warm(str(directory))][-1]
            finally:
                await client.close()

        done = asyncio.run(warm())
        assert done["complete"] is True
        # Shards recovered from the catalog were not fetched again.
        assert restarted.status()["stats"]["shards_staged"] == len(shards) - len(resident_before)
        for key, data in shards.items():
            assert (local / "data" / dataset / key).read_bytes() == data
    finally:
        restarted.kill()


def test_readers_fail_over_to_their_own_stager_and_come_back(tmp_path: Path, cache_env: dict[str, str]) -> None:
    directory = tmp_path / "origin"
    shards = make_shards(directory, 16, 100_000, seed=5)
    keys = sorted(shards)
    local = tmp_path / "cache"
    daemon = start_daemon(cache_env, local)
    settings = load_settings(cache_env, overrides={"local_dir": str(local)})
    modes: list[str] = []

    async def main() -> int:
        access = await open_access(settings)
        assert isinstance(access, FailoverAccess)
        access.retry_interval = 0.1
        nonlocal daemon
        try:
            handle = await access.open(str(directory))
            position = 0

            async def ensure_next() -> None:
                nonlocal position
                key = keys[position % len(keys)]
                position += 1
                location = await access.ensure(handle, key)
                assert location.path is not None and location.path.read_bytes() == shards[key]
                modes.append(access.mode)

            for _ in range(4):
                await ensure_next()
            assert modes == ["daemon"] * 4
            daemon.kill()  # dies in the middle of the epoch
            for _ in range(4):
                await ensure_next()
            assert access.mode == EMBEDDED_FALLBACK
            daemon = await asyncio.to_thread(start_daemon, cache_env, local)
            deadline = asyncio.get_running_loop().time() + 30
            while access.mode != "daemon":
                assert asyncio.get_running_loop().time() < deadline, "the reader never reconnected"
                await ensure_next()
                await asyncio.sleep(0.05)  # sleep-ok: spaces the polls of a condition with a deadline
            for _ in range(4):
                await ensure_next()
            assert access.failovers == 1 and access.reconnects == 1
            return position
        finally:
            await access.close()

    try:
        count = asyncio.run(main())
        assert count >= 12
        assert modes[4:8] == [EMBEDDED_FALLBACK] * 4
        assert modes[-4:] == ["daemon"] * 4
        # The restarted daemon learned the dataset again from the reader (it had forgotten it).
        assert daemon.status()["datasets"][0]["id"] == resolve_dataset(str(directory), settings).id
    finally:
        daemon.kill()


def test_a_daemon_without_torch(tmp_path: Path) -> None:
    code = "import datacache.daemon, datacache.cli, sys; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_datasets_opened_as_config_carry_their_storage_options(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from datacache._protocol import config_from_wire, config_to_wire

    config = DatasetConfig(name="d", url="s3://b/p", storage_options={"endpoint_url": "http://x"}, policy="lru")
    assert config_from_wire(config_to_wire(config)) == replace(config)
    with pytest.raises(ConfigError):
        config_from_wire({"name": "", "url": "s3://b"})
