"""`datacache warm` and `evict` go through the node's daemon when it answers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _daemon import catalog_rows, make_shards, start_daemon


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
