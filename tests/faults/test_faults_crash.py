"""SIGKILL of ``datacache warm`` and of ``datacache serve`` at random moments, many times over.

After every kill, what is visible is whole: each file under a shard's name
holds that shard's bytes, and each catalog row marked resident points at such
a file. After every restart, no temporary file and no lease lock is left, and
every resident shard verifies against its checksum.

The long loops (50 kills each) run under ``make test-faults``; a few
iterations of each run in ``make test``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _daemon import DaemonProcess, start_daemon, unix_request
from _faultdata import catalog, check_cache, lease_locks, partials, record, xxh
from _helpers import DATACACHE, REPO, run_cli

from datacache.config import Settings, dataset_id_for, load_settings
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket

SHARDS = 8
SHARD_SIZE = 160_000
BANDWIDTH = "400kB/s"  # (after a burst of 400 kB) a cold warm-up takes about 3 s: kills land all through it


def crash_dataset(s3: S3Bucket, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    files = {f"shard-{i:04d}.tar": rng.randbytes(SHARD_SIZE + rng.randint(0, 40_000)) for i in range(SHARDS)}
    for name, data in files.items():
        s3.put(f"ds/{name}", data)
    return files


def cli_env(base: dict[str, str], s3: S3Bucket, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("AWS_", "DATACACHE_"))}
    env.update(s3.server.env())
    env.update(
        {
            "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
            "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
            "DATACACHE_PART_SIZE": "48kB",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    return env


def settings_of(env: dict[str, str]) -> Settings:
    return load_settings(env)


def make_work(settings: Settings, dataset: str, files: dict[str, bytes], rng: random.Random) -> list[str]:
    """Drop a random part of the dataset from the local tier, and sometimes from the shared tier.

    Runs a `Stager`, so it is also a restart: it reconciles what the last kill left.
    """
    keys = sorted(rng.sample(sorted(files), rng.randint(1, len(files))))
    also_shared = rng.random() < 0.5

    async def main() -> None:
        async with Stager(settings) as stager:
            await stager.reconcile()
            await stager.evict(dataset, keys)
            if also_shared and stager.shared is not None:
                for key in keys:
                    await stager.shared.delete(f"{dataset}/{key}")

    asyncio.run(main())
    return keys


def check_after_restart(settings: Settings, dataset: str, files: dict[str, bytes], *, complete: bool) -> None:
    """No temporary file or lease lock left; every resident shard verifies; with ``complete``, all are."""
    assert settings.shared_dir is not None
    assert partials(settings.local_dir, settings.shared_dir) == []
    assert lease_locks(settings.shared_dir) == []
    rows = catalog(settings.local_dir)
    assert all(state == "resident" for *_, state in rows), rows
    for row_dataset, key, size, _, checksum, _ in rows:
        data = (settings.local_dir / "data" / row_dataset / key).read_bytes()
        assert len(data) == size and checksum == xxh(data) == xxh(files[key])
    check_cache(settings.local_dir, settings.shared_dir, files)
    if complete:
        assert sorted(key for _, key, *_ in rows) == sorted(files)
        for key, data in files.items():
            assert (settings.local_dir / "data" / dataset / key).read_bytes() == data


# -- datacache warm -------------------------------------------------------------------------


def warm_kill_loop(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path, *, iterations: int, seed: int
) -> dict[str, int]:
    files = crash_dataset(s3, seed)
    env = cli_env(cache_env, s3, tmp_path)
    settings = settings_of(env)
    url = s3.url("ds")
    dataset = dataset_id_for(url)
    rng = random.Random(seed)
    outcome = {"iterations": 0, "killed_mid_warm": 0, "visible_checked": 0}
    for _ in range(iterations):
        if (settings.local_dir / "catalog.sqlite").exists():
            make_work(settings, dataset, files, rng)
        process = subprocess.Popen(
            [*DATACACHE, "warm", url, "--bandwidth", BANDWIDTH, "-q"],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(rng.uniform(0.0, 1.2))  # sleep-ok: a random moment to kill at
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        outcome["killed_mid_warm"] += process.returncode == -signal.SIGKILL
        # At any moment, even right after a kill: nothing partial or wrong is visible.
        outcome["visible_checked"] += check_cache(settings.local_dir, settings.shared_dir, files)["visible"]
        # The restart: a warm-up to completion cleans up after the dead process.
        result = run_cli(["warm", url, "--json"], env)
        assert result.returncode == 0, result.stderr
        done = json.loads(result.stdout.strip().splitlines()[-1])
        assert done["complete"] is True, done
        check_after_restart(settings, dataset, files, complete=True)
        outcome["iterations"] += 1
    record("warm_kill", seed=seed, **outcome)
    return outcome


def test_sigkill_of_warm_at_random_moments_a_few_times(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    outcome = warm_kill_loop(s3, cache_env, tmp_path, iterations=3, seed=101)
    assert outcome["iterations"] == 3


@pytest.mark.faults
def test_sigkill_of_warm_at_random_moments_50_times(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    outcome = warm_kill_loop(s3, cache_env, tmp_path, iterations=50, seed=202)
    assert outcome["iterations"] == 50
    assert outcome["killed_mid_warm"] >= 25, outcome  # not a vacuous loop: most kills found it alive
    print(f"warm kill loop: {outcome}")


# -- datacache serve ------------------------------------------------------------------------


class _Warm(threading.Thread):
    """A warm-up request to the daemon, in the background; the daemon may die under it."""

    def __init__(self, daemon: DaemonProcess, url: str) -> None:
        super().__init__(daemon=True)
        self.socket = daemon.socket
        self.url = url
        self.reply: Any = None

    def run(self) -> None:
        try:
            self.reply = unix_request(self.socket, "POST", "/v1/warm", {"dataset": self.url}, timeout=60)
        except (OSError, http.client.HTTPException) as exc:  # the daemon was killed mid-request
            self.reply = exc


def warm_through(daemon: DaemonProcess, url: str) -> dict[str, Any]:
    code, text = unix_request(daemon.socket, "POST", "/v1/warm", {"dataset": url}, timeout=120)
    assert code == 200, text
    lines = [json.loads(line) for line in str(text).splitlines() if line.strip()]
    return lines[-1]


def serve_kill_loop(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path, *, iterations: int, seed: int
) -> dict[str, int]:
    files = crash_dataset(s3, seed)
    env = cli_env(cache_env, s3, tmp_path)
    settings = settings_of(env)
    url = s3.url("ds")
    dataset = dataset_id_for(url)
    rng = random.Random(seed)
    local = settings.local_dir
    arguments = ("--bandwidth", BANDWIDTH, "--concurrency", "3")
    outcome = {"iterations": 0, "killed_mid_warm": 0, "visible_checked": 0}
    daemon = start_daemon(env, local, *arguments)
    try:
        for _ in range(iterations):
            keys = sorted(rng.sample(sorted(files), rng.randint(1, len(files))))
            tier = "all" if rng.random() < 0.5 else "local"
            code, reply = daemon.request("POST", "/v1/evict", {"dataset": url, "keys": keys, "tier": tier})
            assert code == 200, reply
            warm = _Warm(daemon, url)
            warm.start()
            time.sleep(rng.uniform(0.0, 1.4))  # sleep-ok: a random moment to kill at
            daemon.kill()  # SIGKILL
            warm.join(60)
            outcome["killed_mid_warm"] += not isinstance(warm.reply, tuple)
            outcome["visible_checked"] += check_cache(local, settings.shared_dir, files)["visible"]
            daemon = start_daemon(env, local, *arguments)  # ready = reconciled
            # Right after the restart: the killed daemon's temporary files are gone from the local
            # tier, and what the catalog holds verifies.
            assert partials(local) == []
            assert all(state == "resident" for *_, state in catalog(local))
            check_cache(local, settings.shared_dir, files)
            done = warm_through(daemon, url)
            assert done.get("event") == "done" and done["complete"] is True, done
            check_after_restart(settings, dataset, files, complete=True)
            outcome["iterations"] += 1
    finally:
        daemon.kill()
    record("serve_kill", seed=seed, **outcome)
    return outcome


def test_sigkill_of_serve_at_random_moments_a_few_times(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    outcome = serve_kill_loop(s3, cache_env, tmp_path, iterations=3, seed=303)
    assert outcome["iterations"] == 3


@pytest.mark.faults
def test_sigkill_of_serve_at_random_moments_50_times(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    outcome = serve_kill_loop(s3, cache_env, tmp_path, iterations=50, seed=404)
    assert outcome["iterations"] == 50
    assert outcome["killed_mid_warm"] >= 25, outcome  # not a vacuous loop: most kills cut a warm-up short
    print(f"serve kill loop: {outcome}")


def test_no_process_is_left_behind(tmp_path: Path) -> None:
    """The loops above start and kill many processes; none of them may survive its test."""
    mine = os.getpid()
    children = Path(f"/proc/{mine}/task/{mine}/children")
    if not children.exists():
        pytest.skip("/proc does not list children here")
    alive = [pid for pid in children.read_text().split() if Path(f"/proc/{pid}/cmdline").exists()]
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in alive]
    assert not [c for c in commands if b"datacache.cli" in c], commands
