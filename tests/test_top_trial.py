"""`datacache top` as issue 34's trial used it (item 6): real readers and a real daemon, `top` as a command.

- the DATASET column names a configured dataset by its name, not its id;
- with the one-import DataLoader each emulated worker shows its own hits and figures (w1 showed none);
- readers that stopped reporting (torch's DataLoader restarting its workers at an epoch's start) stay on
  the screen for a grace period, marked between epochs, until the next epoch's readers replace them;
- a reader blocked on a slow origin still reports, so the transfers it waits for are in flight on screen.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from _daemon import daemon_env, start_daemon, wait_until
from _helpers import DATACACHE, REPO
from test_loader import write_wds
from test_top import _end, _frame, _reporter, _top

from datacache.identity import dataset_id_for

_READER = """
import json, sys
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset, DataLoader as OneImport
from torch.utils.data import DataLoader as TorchLoader
spec = json.loads(sys.argv[1])
dataset = CachedIterableDataset(spec["dataset"], config=load_settings(), seed=3)
if spec["workers"]:
    kind = OneImport if spec["loader"] == "one-import" else TorchLoader
    loader = kind(dataset, batch_size=4, num_workers=spec["workers"], persistent_workers=True)
else:
    loader = dataset
print("started", flush=True)
samples = sum(len(item["__key__"]) if spec["workers"] else 1 for item in loader)
print(json.dumps({"samples": samples}), flush=True)
sys.stdin.read()  # the readers (and, with persistent workers, their processes) stay until the test has looked
"""


def _reader(env: dict[str, str], **spec: Any) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", _READER, json.dumps(spec)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "started"
    return process


def _opened(client: dict[str, Any]) -> int:
    return int(client["units_local"] + client["units_shared"] + client["units_origin"])


def test_top_names_the_configured_dataset_and_shows_every_workers_own_hits(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """DATASET showed the id; with the one-import DataLoader w1's rows showed 0% and no hits.

    torch's workers each open every unit of their share once; the one-import DataLoader's emulated
    workers share what they opened, and each must count its share as a worker process would.
    """
    origin = tmp_path / "origin"
    write_wds(origin, samples=120, per_shard=10, with_counts=True)
    config = tmp_path / "config.toml"
    config.write_text(f'[datasets.a-wds]\nurl = "{origin}"\n')
    local = tmp_path / "local"
    env = {**daemon_env(cache_env, local, local / "daemon.sock"), "DATACACHE_CONFIG": str(config)}
    opened: dict[str, dict[int, int]] = {}
    for loader, dataset in (("torch", "a-wds"), ("one-import", str(origin))):  # by name, then by URL
        reader = _reader(env, dataset=dataset, loader=loader, workers=2)
        try:
            assert reader.stdout is not None and json.loads(reader.stdout.readline())["samples"] == 120
            frame = _frame(env)
            clients = {c["worker"]: c for c in frame["clients"]}
            assert sorted(clients) == [0, 1], frame["clients"]
            for client in clients.values():
                assert client["dataset"] == dataset_id_for(str(origin))
                assert client["dataset_name"] == "a-wds", client
                assert sum(client["hit_share"].values()) == pytest.approx(1.0), client
            opened[loader] = {worker: _opened(client) for worker, client in clients.items()}
            assert frame["ranks"][0]["dataset_name"] == "a-wds"
            text = _top(env, "--once", "--interval", "0.1")
            assert text.returncode == 0, text.stderr
            rows = [line for line in text.stdout.splitlines() if line.startswith(("r0/w", "0 "))]
            assert len(rows) == 3 and all(" a-wds " in row for row in rows), text.stdout
        finally:
            _end(reader)
    assert opened["one-import"] == opened["torch"], opened


def test_readers_between_epochs_stay_on_screen_until_the_next_epochs_replace_them(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """While torch's DataLoader restarts its workers the screen said "(no client is reading on this node)"."""
    daemon = start_daemon(cache_env, tmp_path / "local")
    stream = subprocess.Popen(
        [*DATACACHE, "top", "--json", "--interval", "0.2"], env=daemon.env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    frames: list[dict[str, Any]] = []

    def collect() -> None:
        for line in stream.stdout or ():
            frames.append(json.loads(line))

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    body = {"rank": 0, "worker": 0, "samples": 10, "delivered_bytes": 1000, "delivered_bytes_per_s": 1e6}
    try:
        first = _reporter(daemon, {**body, "client": "epoch0-r0w0", "epoch": 0})
        wait_until(lambda: any(_names(f) == ["epoch0-r0w0"] for f in frames), timeout=60, what="epoch 0's reader")
        _end(first)  # its process ends, as the epoch's last worker does
        seen = len(frames)
        kept = wait_until(
            lambda: next((f for f in frames[seen:] if f["clients"] and f["clients"][0].get("between_epochs")), None),
            timeout=60,
            what="a frame with epoch 0's reader shown between epochs",
        )
        assert _names(kept) == ["epoch0-r0w0"] and kept["ranks"][0]["between_epochs"] is True
        second = _reporter(daemon, {**body, "client": "epoch1-r0w0", "epoch": 1})
        try:
            wait_until(lambda: _names(frames[-1]) == ["epoch1-r0w0"], timeout=60, what="epoch 1's reader alone")
        finally:
            _end(second)
        assert all(f["clients"] for f in frames[seen:]), "a frame between the epochs showed no client"
    finally:
        stream.send_signal(signal.SIGINT)
        stream.wait(30)
        collector.join(30)
        if stream.stdout is not None:
            stream.stdout.close()
        daemon.stop()


def _names(frame: dict[str, Any]) -> list[str]:
    return sorted(str(c["client"]) for c in frame["clients"])


def test_transfers_a_reader_waits_for_are_in_flight_on_screen_while_it_has_delivered_nothing(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """With the origin capped, top said "TRANSFERS IN FLIGHT: 0" while the readers waited 98% on it."""
    origin = tmp_path / "origin"
    write_wds(origin, samples=200, per_shard=100, with_counts=True)  # two shards of ~250 kB
    local = tmp_path / "local"
    env = {**daemon_env(cache_env, local, local / "daemon.sock"), "DATACACHE_BANDWIDTH_LIMIT": "20kB/s"}
    reader = _reader(env, dataset=str(origin), loader="none", workers=0)
    try:

        def waiting_with_transfers() -> dict[str, Any] | None:
            frame = _frame(env)
            blocked = [c for c in frame["clients"] if c.get("samples") == 0]
            return frame if blocked and frame["transfers"] else None

        frame = wait_until(waiting_with_transfers, timeout=60, what="a frame of the blocked reader's transfers")
        assert {t["dataset"] for t in frame["transfers"]} == {dataset_id_for(str(origin))}
        shown = wait_until(
            lambda: (out := _top(env, "--once", "--interval", "0.1").stdout) and "TRANSFERS IN FLIGHT: 0" not in out,
            timeout=60,
            what="the text view's transfers",
        )
        assert shown
    finally:
        reader.kill()  # a reader of the capped origin: its epoch would take a minute
        reader.wait(30)
        for pipe in (reader.stdin, reader.stdout):
            if pipe is not None:
                pipe.close()
