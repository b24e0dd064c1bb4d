"""What a wids shard index names is taken only when it is a count and a key (issue 33 items 3, 13).

An index is a file anyone who can write the origin's folder wrote: a count of 0 is not taken on
its word (it would silently drop a shard), an entry listed twice is refused (it would make a
shard's samples count many times), and a key is checked after percent-decoding, as an http origin
fetches it (``%2e%2e/``, ``..%2f``, a ``base_path`` of ``%2e%2e/private``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _helpers import run_cli, tar_of

from datacache.config import load_settings
from datacache.errors import ConfigError


def _shards(folder: Path, count: int, samples: int) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for i in range(count):
        name = f"shard-{i:04d}.tar"
        written[name] = tar_of({f"s{i}-{j}.bin": bytes([i, j]) * 40 for j in range(samples)})
        (folder / name).write_bytes(written[name])
    return written


def _index(folder: Path, entries: list[dict[str, object]], name: str = "train.json", **extra: object) -> str:
    document = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": entries, **extra}
    (folder / name).write_text(json.dumps(document))
    return f"file://{folder / name}"


@pytest.fixture
def env(cache_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    clean["DATACACHE_LOCAL_DIR"] = str(tmp_path / "local")
    return clean


# -- item 13: a count of 0, an entry listed twice ----------------------------------------------


def test_a_wids_count_of_zero_does_not_drop_the_shard_it_is_counted(tmp_path: Path, env: dict[str, str]) -> None:
    from datacache.loaders import CachedIterableDataset

    data = tmp_path / "data"
    _shards(data, 3, 3)
    url = _index(data, [{"url": f"shard-{i:04d}.tar", "nsamples": 0 if i == 1 else 3} for i in range(3)])
    dataset = CachedIterableDataset(url, config=load_settings(env), shuffle=False)
    try:
        keys = sorted(sample["__key__"] for sample in dataset)
        assert keys == sorted(f"s{i}-{j}" for i in range(3) for j in range(3))  # shard 1 too
        assert len(dataset) == 9
    finally:
        dataset.close()


def test_an_entry_listed_twice_is_refused_naming_it(tmp_path: Path, env: dict[str, str]) -> None:
    from datacache.loaders import CachedIterableDataset

    data = tmp_path / "data"
    _shards(data, 2, 3)
    entries: list[dict[str, object]] = [{"url": "shard-0001.tar", "nsamples": 3}]
    entries += [{"url": "shard-0000.tar", "nsamples": 3}] * 5_000
    url = _index(data, entries)
    refused = run_cli(["warm", url], env)
    assert refused.returncode != 0
    [line] = refused.stderr.strip().splitlines()
    assert "shard-0000.tar" in line and "twice" in line, line
    assert not list((tmp_path / "local").rglob("shard-*.tar"))
    dataset = CachedIterableDataset(url, config=load_settings(env), shuffle=False)
    try:
        with pytest.raises(ConfigError, match=r"shard-0000\.tar.*twice"):
            len(dataset)
    finally:
        dataset.close()
    # The same shard spelled two ways is the same entry.
    url = _index(data, [{"url": "shard-0000.tar", "nsamples": 3}, {"url": "./shard-0000.tar", "nsamples": 3}])
    again = run_cli(["warm", url], env)
    assert again.returncode != 0 and "twice" in again.stderr, again.stderr
