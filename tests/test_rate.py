"""Bandwidth caps (issue 12 item 13): a unit is required, and a cap is never exceeded on average.

The token bucket runs on a virtual clock here (its own clock and sleep, passed in), so the
test checks the arithmetic of pacing exactly, with no timing assertion on a busy machine.
"""

from __future__ import annotations

import asyncio

import pytest
from _helpers import run_cli

from datacache._rate import TokenBucket
from datacache.errors import ConfigError
from datacache.sizes import parse_bandwidth


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


@pytest.mark.parametrize("chunk", [64_000, 1_000_000, 7_000_000])
def test_a_capped_stream_never_runs_ahead_of_the_cap(chunk: int) -> None:
    """5 MB/s asked, 6.7 measured: the bucket started full, a free second of bytes."""
    clock = VirtualClock()
    bucket = TokenBucket(5e6, clock=clock, sleep=clock.sleep)
    total = 30_000_000

    async def stream() -> None:
        sent = 0
        while sent < total:
            await bucket.take(chunk)
            sent += chunk

    asyncio.run(stream())
    sent = -(-total // chunk) * chunk
    # The last chunk may go as soon as it is paid for: the bytes before it took their time.
    assert clock.now >= (sent - chunk) / 5e6
    assert sent / max(clock.now, 1e-9) <= 5e6 * sent / (sent - chunk)


def test_idle_time_does_not_buy_a_burst_beyond_a_fraction_of_a_second() -> None:
    clock = VirtualClock()
    bucket = TokenBucket(1e6, clock=clock, sleep=clock.sleep)

    async def after_a_pause() -> float:
        clock.now += 60.0  # idle for a minute
        start = clock.now
        for _ in range(10):
            await bucket.take(100_000)
        return clock.now - start

    # 1 MB at 1 MB/s: at most a quarter of a second of it may pass unpaced.
    assert asyncio.run(after_a_pause()) >= 0.75


@pytest.mark.parametrize("text", ["10", "2.5", " 300 "])
def test_a_bandwidth_without_a_unit_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match=r"no unit.*e\.g\. '.*MB/s'"):
        parse_bandwidth(text, what="--bandwidth")


def test_a_bandwidth_of_zero_or_with_a_unit_is_read() -> None:
    assert parse_bandwidth("0") == 0.0
    assert parse_bandwidth("10MB/s") == 10e6
    assert parse_bandwidth("10B/s") == 10.0
    assert parse_bandwidth(10) == 10.0  # a number from code or TOML is bytes per second


def test_warm_with_a_bare_bandwidth_says_what_unit_to_add(cache_env: dict[str, str], tmp_path: str) -> None:
    result = run_cli(["warm", str(tmp_path / "nothing"), "--bandwidth", "10"], cache_env, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("datacache: error: --bandwidth: '10' has no unit"), lines
