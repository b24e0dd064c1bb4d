"""What `datacache warm` prints (issue 12 item 12): honest totals, no stale or guessed progress."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

from _helpers import fill_dir, make_shards, run_cli

from datacache._progress import Progress
from datacache._protocol import warm_progress_to_wire
from datacache.staging import WarmProgress

PROGRESS_WORDS = {"shards_done", "shards_total", "bytes_done", "bytes_total", "bytes_transferred", "rate_bytes_per_s"}
"""What a warm's progress line says, in `warm --json` and in the daemon's /v1/warm alike (docs/DAEMON.md)."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(mode: str, clock: Clock) -> tuple[Progress, io.StringIO]:
    stream = io.StringIO()
    shown = Progress(
        what="warm ds", total_items=4, total_bytes=4000, mode=mode, stream=stream, interval=2.0, clock=clock
    )
    return shown, stream


def test_work_done_within_the_first_interval_prints_no_progress_line() -> None:
    """A warm with nothing to do printed a stale `1/8 shards ... 0.0 MB/s` line."""
    clock = Clock()
    for mode in ("lines", "json"):
        shown, stream = progress(mode, clock)
        for _ in range(4):
            clock.now += 0.01
            shown.item_done(1000, transferred=0)
        shown.close()
        assert stream.getvalue() == "", mode


def test_the_plain_line_counts_the_shards_a_warm_reports_per_second() -> None:
    """A warm reports its totals (advance_to): the line said '0 shards/s' while ~5/s arrived (issue 24 item 9)."""
    clock = Clock()
    shown, stream = progress("lines", clock)
    for done in range(1, 5):
        clock.now += 0.5
        shown.advance_to(done_items=done, done_bytes=done * 1000, moved_bytes=done * 1000)
    line = stream.getvalue().splitlines()[0]
    measured = re.search(r", (\d+) shards/s$", line)
    assert measured is not None and 2 <= int(measured.group(1)) <= 3, line  # 4 shards in 1.5-2 s


def test_the_first_line_waits_for_a_measured_rate_and_the_last_one_is_final() -> None:
    """The first line's rate and ETA were guesses from 0.1 s of transfer."""
    clock = Clock()
    shown, stream = progress("json", clock)
    clock.now += 0.1
    shown.moved(500)
    assert stream.getvalue() == "", "no line after 0.1 s"
    clock.now += 2.4
    shown.moved(500)
    shown.item_done(1000, transferred=1000)
    first = json.loads(stream.getvalue().splitlines()[0])
    assert first["rate_bytes_per_s"] == round(1000 / 2.4, 1), "measured over the 2.4 s it took"
    assert first["eta_s"] is not None and first["eta_s"] > 0
    clock.now += 0.5
    shown.moved(3000)
    shown.item_done(3000, transferred=3000, items=3)
    shown.close()
    last = json.loads(stream.getvalue().splitlines()[-1])
    final = (last["shards_done"], last["bytes_done"], last["eta_s"])
    assert final == (4, 4000, 0.0), "a line was shown: the last is final"


def test_the_progress_says_how_many_shards_done_were_not_kept() -> None:
    """A warm larger than the tier showed a bar at 100%; only the summary said 4/20 resident."""
    clock = Clock()
    for mode in ("lines", "json"):
        shown, stream = progress(mode, clock)
        clock.now += 2.5
        shown.advance_to(done_items=4, done_bytes=4000, moved_bytes=4000, not_kept=3)
        shown.close()
        line = stream.getvalue().splitlines()[-1]
        if mode == "lines":
            assert "4/4 shards (3 not kept), " in line, line
        else:
            assert json.loads(line)["shards_not_kept"] == 3
    assert warm_progress_to_wire(WarmProgress(4, 4, 4000, 4000, 4000, 2.5, 3))["shards_not_kept"] == 3


def test_the_summary_says_what_is_resident_and_why_not_the_rest(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(5, 100_000))
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}
    result = run_cli(["warm", str(origin), "--local-capacity", "250kB", "-v"], env)  # -v: each shard's reason
    assert result.returncode == 1
    # Not the whole dataset's size as if resident: what is, out of what was asked.
    assert "2/5 shards resident (200.00 kB of 500.00 kB)" in result.stdout, result.stdout
    reasons = [line for line in result.stderr.splitlines() if line.startswith("datacache: shard ")]
    full = "the local tier is full (200.00 kB of its 250.00 kB)"
    assert len(reasons) == 3 and all(full in r for r in reasons), reasons


def test_one_shard_is_one_shard(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(1, 10_000))
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}
    result = run_cli(["warm", str(origin)], env, check=True)
    assert re.search(r"transferred 10\.00 kB in 1 shard, ", result.stdout), result.stdout
    again = run_cli(["warm", str(origin)], env, check=True)
    assert again.stderr == "", "nothing to do: no progress line at all"


def test_warm_progress_speaks_the_daemons_words() -> None:
    """`warm --json` said shards/bytes where the daemon's /v1/warm says shards_done/bytes_done."""
    clock = Clock()
    shown, stream = progress("json", clock)
    clock.now += 2.5
    shown.moved(1000)
    shown.item_done(1000, transferred=1000)
    shown.close()
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert set(line) >= PROGRESS_WORDS, sorted(PROGRESS_WORDS - set(line))
    assert (line["shards_done"], line["shards_total"], line["bytes_done"], line["bytes_total"]) == (1, 4, 1000, 4000)
    assert "shards" not in line and "bytes" not in line, "one vocabulary, no aliases"
    wire = warm_progress_to_wire(WarmProgress(1, 4, 1000, 4000, 1000, 2.5))
    assert set(wire) >= PROGRESS_WORDS, sorted(PROGRESS_WORDS - set(wire))
    assert {k: wire[k] for k in PROGRESS_WORDS} == {k: line[k] for k in PROGRESS_WORDS} | {"rate_bytes_per_s": 400.0}
