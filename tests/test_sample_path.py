"""The modules one sample's path crosses (issue 37), measured by `benchmarks.sample_path` and held.

An indexed epoch of a raw tar dataset, read by the consumer with no workers: what the reader
needs (the dataset, its plan and order, the iterator and its units, prefetch, stats, the
format's reader, the tier's mapping and the checksum) and nothing chosen again per epoch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

NOT_CROSSED = {
    "datacache._logging": "the log of skipped samples is the dataset's (ReadOptions.skips)",
    "datacache.format_registry": "the format is the runtime's (Runtime.kind)",
    "datacache._sync": "the loop is reached through the runtime (Runtime.run, Runtime.submit)",
    "datacache.config": "Settings.trusted_uids is read where the epoch record is, ahead of the epoch",
    "datacache.counting.indexfiles": "the epoch record is read ahead (DatasetPlanner.decide_ahead)",
    "datacache.staging.runtime": "the access mode is told once (Runtime.mode)",
    "datacache.loaders.decode": "a raw dataset decodes nothing",
    "datacache.loaders.reading.rows": "a tar epoch reads no table rows",
}


def test_an_indexed_epoch_crosses_at_most_18_modules_and_none_chosen_again_per_epoch() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "benchmarks.sample_path", "--json"],
        cwd=ROOT,
        env={**os.environ, "DATACACHE_BENCH_BASELINE_PYTHON": ""},  # this checkout's count only
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(ran.stdout[ran.stdout.index("{") :])
    seen = report["indexed epoch, consumer thread"]
    assert seen["samples"] == 60
    crossed = {module: why for module, why in NOT_CROSSED.items() if module in seen["modules"]}
    assert not crossed, crossed
    assert len(seen["modules"]) <= 18, seen["modules"]
