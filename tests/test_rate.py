"""Bandwidth caps (issue 12 item 13): a unit is required, and a cap is never exceeded on average.

The token bucket runs on a virtual clock here (its own clock and sleep, passed in), so the
test checks the arithmetic of pacing exactly, with no timing assertion on a busy machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from _helpers import fill_dir, make_shards, run_cli

from datacache._rate import TokenBucket
from datacache.config import Settings
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


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("fast", "target_bandwidth: expected a rate such as '1GB/s' or '200MB/s', got 'fast'"),
        ("1GB", "target_bandwidth: '1GB' is a size, not a rate; write it per second: '1GB/s'"),
        ("-1GB/s", "target_bandwidth: must not be negative, got '-1GB/s'"),
    ],
)
def test_a_target_bandwidth_that_is_no_rate_is_refused_in_one_line_naming_it(
    tmp_path: Path, settings: Settings, given: str, said: str
) -> None:
    """`target_bandwidth="fast"` was answered as a size ("bandwidth: expected a size such as '256MB'"), and "1GB",
    a size, was taken as 1 GB/s without a word."""
    from datacache.loaders import CachedIterableDataset

    origin = fill_dir(tmp_path / "origin", make_shards(1, 100))
    with pytest.raises(ConfigError) as caught:
        CachedIterableDataset(str(origin), config=settings, target_bandwidth=given)
    assert str(caught.value) == said
    assert CachedIterableDataset(str(origin), config=settings, target_bandwidth="1GB/s").target_bandwidth == 1e9
    assert not settings.local_dir.exists() or not any(settings.local_dir.rglob("*.tar"))


def test_warm_with_a_size_for_a_bandwidth_says_to_add_per_second(cache_env: dict[str, str], tmp_path: Path) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(1, 100))
    result = run_cli(["warm", str(origin), "--bandwidth", "200MB"], cache_env, timeout=60)
    assert (result.returncode, result.stderr.splitlines()) == (
        2, ["datacache: error: --bandwidth: '200MB' is a size, not a rate; write it per second: '200MB/s'"]
    )
