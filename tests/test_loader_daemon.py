"""The loader through the node's daemon, and on without it when the daemon dies mid-epoch."""

from __future__ import annotations

import asyncio
import collections
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from _daemon import DaemonProcess, start_daemon
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.client import DaemonClient
from datacache.config import load_settings


def test_loader_uses_the_daemon_and_survives_its_death(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=96, per_shard=8, with_counts=True)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local)
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(origin), config=settings, seed=3, shuffle_buffer=16)
        iterator = iter(dataset)
        head = [next(iterator)["__key__"] for _ in range(30)]
        assert dataset.stats().mode == "daemon"
        staged_by_daemon = daemon.status()
        assert staged_by_daemon, "the daemon answered status"
        daemon.kill()  # SIGKILL mid-epoch
        tail = [sample["__key__"] for sample in iterator]
        assert sorted(head + tail) == sorted(expected), "no sample lost or repeated across the daemon's death"
        assert "daemon unavailable" in dataset.stats().mode
    finally:
        daemon.kill()


def test_worker_processes_report_the_daemon_mode(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=40, per_shard=10, with_counts=True)
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(origin), config=settings, batch_size=5)
        keys = keys_of(DataLoader(dataset, batch_size=None, num_workers=2))
        assert sorted(keys) == sorted(expected)
        assert dataset.stats().mode == "daemon"
    finally:
        daemon.stop()


def _requests(daemon: DaemonProcess) -> collections.Counter[str]:
    """Requests the daemon answered so far, by verb (from its /metrics)."""
    code, text = daemon.request("GET", "/metrics")
    assert code == 200 and isinstance(text, str)
    counts: collections.Counter[str] = collections.Counter()
    for match in re.finditer(r"^datacache_requests_total\{([^}]*)\} ([0-9.e+]+)$", text, re.MULTILINE):
        verb = re.search(r'verb="([^"]*)"', match.group(1))
        if verb is not None:
            counts[verb.group(1)] += int(float(match.group(2)))
    return counts


def test_a_warm_epoch_through_the_daemon_asks_once_per_window_not_per_shard(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=96, per_shard=8, with_counts=True)  # 12 shards
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        dataset = CachedIterableDataset(str(origin), config=load_settings(daemon.env), seed=5, shuffle_buffer=16)
        assert sorted(keys_of(dataset)) == sorted(expected)  # cold: the daemon stages every shard
        before = _requests(daemon)
        dataset.set_epoch(1)
        assert sorted(keys_of(dataset)) == sorted(expected)  # warm: every shard local
        asked = _requests(daemon) - before
        assert dataset.stats().mode == "daemon"
        # Before: a locate and a progress note per shard, each waited for (12 + 14, then 12 + 16
        # once a closed unit's lease was dropped at once). The ensures and prefetches are the
        # next epoch's staging, in the background.
        assert asked["locate"] == 0, asked
        assert 1 <= asked["progress"] <= 9, asked
        dataset.close()
    finally:
        daemon.stop()


def test_the_reader_maps_only_files_the_daemon_hands_out(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """A same-size tar planted where the daemon would put a shard it has not staged is never read.

    With ``verify_on_read`` off nothing but the daemon's word stands between the reader and
    that file: a reader that guessed paths (or trusted a lease after the copy changed hands)
    would serve the planted samples.
    """
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=48, per_shard=8, with_counts=True)  # 6 shards
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        env = {**daemon.env, "DATACACHE_VERIFY_ON_READ": "false"}
        settings = load_settings(env)
        shards = sorted(p.name for p in origin.glob("*.tar"))

        async def stage_first() -> Path:
            client = DaemonClient(settings)
            try:
                handle = await client.open(str(origin))
                location = await client.ensure(handle, shards[0])
            finally:
                await client.close()
            assert location.tier == "local" and location.path is not None
            return location.path

        staged = asyncio.run(stage_first())
        for key in shards[1:]:  # the real shard with every payload replaced, byte for byte
            data = (origin / key).read_bytes()
            for fields in expected.values():
                data = data.replace(fields["bin"], b"X" * len(fields["bin"]))
            staged.with_name(key).write_bytes(data)
        dataset = CachedIterableDataset(str(origin), config=settings, seed=2, shuffle_buffer=8)
        served = {sample["__key__"]: sample["bin"] for sample in dataset}
        assert served == {key: fields["bin"] for key, fields in expected.items()}
        assert dataset.stats().mode == "daemon"
        dataset.close()
    finally:
        daemon.stop()


def test_progress_locates_only_shards_of_a_dataset_the_caller_opened(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=16, per_shard=8, with_counts=True)
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin)})
        assert code == 200, opened
        progress = {"reader": "0.0", "epoch": 0, "position": 0, "holding": ["train-0000.tar"],
                    "owner": f"{socket.gethostname()}:{os.getpid()}"}  # fmt: skip
        body = {"dataset": opened["dataset_id"], "progress": progress, "locate": ["train-0000.tar", "train-0001.tar"]}
        code, reply = daemon.request("POST", "/v1/progress", body)
        assert code == 200 and [loc["tier"] for loc in reply["locations"]] == ["origin", "origin"], reply
        for bad in (["../../etc/passwd"], ["no-such.tar"], "train-0000.tar"):
            code, reply = daemon.request("POST", "/v1/progress", {**body, "locate": bad})
            assert code in (400, 404) and reply["error"]["code"] in ("invalid_key", "not_found", "bad_request"), reply
        code, reply = daemon.request("POST", "/v1/progress", {**body, "dataset": "someone-elses-0123456789abcdef"})
        assert code == 409 and reply["error"]["code"] == "unknown_dataset", reply
    finally:
        daemon.stop()


_EPOCHS_SCRIPT = """
import sys
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset
dataset = CachedIterableDataset(sys.argv[1], seed=2, shuffle_buffer=16)
for epoch in range(3):
    dataset.set_epoch(epoch)
    count = sum(len(batch["__key__"]) for batch in DataLoader(dataset, batch_size=8, num_workers=2))
    print(epoch, count, dataset.stats().mode, flush=True)
"""


def test_workers_leaving_at_an_epochs_end_do_not_report_a_live_daemon_unreachable(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    # Each epoch's workers close their client while their prefetches of the next epoch are in
    # flight: those requests end with the connection, which is not the daemon going away.
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=96, per_shard=8, with_counts=True)
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _EPOCHS_SCRIPT, str(origin)],
            env={**daemon.env, "PYTHONWARNINGS": "ignore::UserWarning"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.split() == [str(x) for e in range(3) for x in (e, len(expected), "daemon")]
        assert "unreachable" not in run.stderr, run.stderr[-2000:]
        assert daemon.process.poll() is None
    finally:
        daemon.stop()
