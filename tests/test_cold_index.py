"""Cold start: sample counts from the sidecar indexes beside the shards, or counted once per cluster."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _helpers import DATACACHE, REPO, run_cli, with_stager
from datacache.loaders import CachedIterableDataset
from faults._faultproxy import FaultProxy
from test_loader import write_wds

from datacache.config import Settings, load_settings
from datacache.counting.cluster import WIDS_INDEX_NAME, ClusterIndex, IndexReport
from datacache.counting.sidecars import KnownCount
from datacache.counting.tarindex import group_samples, index_to_json, scan_tar
from datacache.errors import ShardReadError
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket


def counts_on_disk(origin: Path) -> dict[str, int]:
    return {p.name: len(group_samples(scan_tar(p.read_bytes()))) for p in sorted(origin.glob("*.tar"))}


def write_wids(
    origin: Path, counts: dict[str, int], *, name: str = "train.json", sizes: dict[str, int] | None = None
) -> None:
    """A wids shard index, as its documented format (wids is not installed: it does not ship in webdataset 1.0)."""
    document = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": "train",
        "shardlist": [
            {"url": key, "nsamples": n, "filesize": (sizes or {}).get(key, (origin / key).stat().st_size)}
            for key, n in counts.items()
        ],
    }
    (origin / name).write_text(json.dumps(document))


def write_dali(origin: Path, key: str) -> None:
    """An index as DALI's tools/wds2idx.py writes it: 'v1.2 N', then per sample 'ext offset size name'."""
    raw = (origin / key).read_bytes()
    lines = []
    for sample in group_samples(scan_tar(raw)):
        parts = [f"{ext} {offset - 512} {size} {sample.key}.{ext}" for ext, offset, size in sample.fields]
        lines.append(" ".join(parts))
    (origin / (key[: key.index(".")] + ".idx")).write_text(f"v1.2 {len(lines)}\n" + "\n".join(lines) + "\n")


def write_sidecars(kind: str, origin: Path, counts: dict[str, int]) -> None:
    if kind == "wids":
        write_wids(origin, counts)
    elif kind == "open_clip":
        (origin / "sizes.json").write_text(json.dumps(counts))
        (origin / "__len__").write_text(str(sum(counts.values())))
    elif kind == "img2dataset":
        for key, n in counts.items():
            stats = {"count": n + 3, "successes": n, "failed_to_download": 3, "failed_to_resize": 0}
            (origin / key.replace(".tar", "_stats.json")).write_text(json.dumps(stats))
    elif kind == "dali":
        for key in counts:
            write_dali(origin, key)
    elif kind == "datacache":
        for key in counts:
            raw = (origin / key).read_bytes()
            (origin / (key + ".idx.json")).write_bytes(index_to_json(group_samples(scan_tar(raw)), shard_size=len(raw)))


def build_counts(settings: Settings, url: str) -> tuple[dict[str, KnownCount], IndexReport]:
    async def body(stager: Stager) -> tuple[dict[str, KnownCount], IndexReport]:
        handle = await stager.open(url)
        return await ClusterIndex(handle.origin, handle.manifest, settings).build()

    return with_stager(settings, body)


@pytest.mark.parametrize("kind", ["wids", "open_clip", "img2dataset", "dali", "datacache"])
def test_sidecar_counts_are_read_and_nothing_is_scanned(kind: str, tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=57, per_shard=10)
    truth = counts_on_disk(origin)
    write_sidecars(kind, origin, truth)
    found, report = build_counts(settings, str(origin))
    assert report.scanned == 0, f"the {kind} index was not used"
    assert {key: count.samples for key, count in found.items()} == truth
    assert all(kind.split("_", maxsplit=1)[0] in count.source.lower() for count in found.values())


def test_a_wrong_wids_count_is_caught_when_the_shard_is_read(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=57, per_shard=10)
    truth = counts_on_disk(origin)
    wrong = dict(truth)
    wrong["train-0002.tar"] += 1
    write_wids(origin, wrong)
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    assert len(dataset) == sum(wrong.values()), "the wids counts were used, without scanning"
    with pytest.raises(ShardReadError, match=r"train-0002\.tar.*holds 10 samples.*wids index .*train\.json.* says 11"):
        list(dataset)


def test_a_stale_or_disagreeing_index_is_not_trusted(tmp_path: Path, settings: Settings) -> None:
    """A wids entry whose file size is not the shard's, or two indexes that disagree: that shard is scanned."""
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=57, per_shard=10)
    truth = counts_on_disk(origin)
    wrong = dict(truth)
    wrong["train-0001.tar"] += 5
    wrong["train-0003.tar"] -= 1
    write_wids(origin, wrong, sizes={"train-0001.tar": 1})
    (origin / "sizes.json").write_text(json.dumps(truth))
    found, report = build_counts(settings, str(origin))
    assert report.scanned == 1, "only the shard whose two indexes disagree"
    assert found["train-0003.tar"].source == "scanned"
    assert found["train-0001.tar"].source.startswith("open_clip"), "the stale wids entry was dropped"
    assert {key: count.samples for key, count in found.items()} == truth
    dataset = CachedIterableDataset(
        str(origin),
        config=load_settings(
            {}, overrides={"local_dir": str(tmp_path / "node2"), "shared_dir": str(tmp_path / "shared")}
        ),
        shuffle=False,
    )
    assert sorted(s["__key__"] for s in dataset) == sorted(expected)


def node_env(s3: S3Bucket, tmp_path: Path, node: int, cache_env: dict[str, str]) -> dict[str, str]:
    return {
        **cache_env,
        **s3.server.env(),
        "DATACACHE_LOCAL_DIR": str(tmp_path / f"node-{node}"),
        "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
        "DATACACHE_CONCURRENCY": "2",
    }


def upload(s3: S3Bucket, tmp_path: Path, *, samples: int, per_shard: int) -> dict[str, int]:
    source = tmp_path / "upload"
    write_wds(source, samples=samples, per_shard=per_shard)
    for path in sorted(source.glob("*.tar")):
        s3.put(f"ds/{path.name}", path.read_bytes())
    return counts_on_disk(source)


def shard_gets(s3: S3Bucket) -> dict[str, int]:
    head = f"GET /{s3.name}/ds/"
    return {
        k.removeprefix(head): v
        for k, v in s3.server.request_counts().items()
        if k.startswith(head) and k.endswith(".tar")
    }


def test_two_nodes_index_at_once_and_the_origin_serves_each_shard_once(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    truth = upload(s3, tmp_path, samples=600, per_shard=20)
    s3.server.reset_counts()
    # Both nodes reach S3 through one proxy, each with an access key of its own, and the proxy
    # holds a node's shard reads until the other node has asked for a shard too. Without it, a
    # node that started a few seconds late on a busy machine found every batch counted already,
    # and took no share. (The lease of a batch a held read is in is renewed meanwhile.)
    arrived = {"node-0": threading.Event(), "node-1": threading.Event()}

    def hold(_: str, key: str) -> None:
        arrived[key].set()
        other = "node-1" if key == "node-0" else "node-0"
        if not arrived[other].wait(timeout=150):
            raise AssertionError(f"{other} never asked for a shard")

    with FaultProxy(s3.server.endpoint) as proxy:
        proxy.add_client_hook(rf"^GET /{s3.name}/ds/[^/]+\.tar$", hold)
        processes = [
            subprocess.Popen(
                [*DATACACHE, "index", s3.url("ds"), "--json", "--no-write"],
                env={
                    **node_env(s3, tmp_path, node, cache_env),
                    "AWS_ENDPOINT_URL": proxy.endpoint,
                    "AWS_ACCESS_KEY_ID": f"node-{node}",
                },
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in range(2)
        ]
        outputs = [process.communicate(timeout=180) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    reports = [json.loads(stdout) for stdout, _ in outputs]
    assert all(r["samples"] == sum(truth.values()) for r in reports)
    assert shard_gets(s3) == dict.fromkeys(truth, 1), "each shard read once in the whole cluster"
    assert sum(r["scanned"] for r in reports) == len(truth)
    assert all(r["scanned"] > 0 for r in reports), "both nodes took a share of the work"
    for node in range(2):  # streamed: nothing staged on either node's local tier
        data = tmp_path / f"node-{node}" / "data"
        assert not data.exists() or not [p for p in data.rglob("*.tar")]


def test_index_writes_a_wids_index_that_a_new_cluster_reads_instead_of_scanning(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    truth = upload(s3, tmp_path, samples=90, per_shard=20)
    result = run_cli(["index", s3.url("ds")], node_env(s3, tmp_path, 0, cache_env), check=True)
    assert f"wrote s3://{s3.name}/ds/{WIDS_INDEX_NAME}" in result.stdout
    written = json.loads(s3.client.get_object(Bucket=s3.name, Key=f"ds/{WIDS_INDEX_NAME}")["Body"].read())
    assert written["__kind__"] == "wids-shard-index-v1"
    assert {e["url"]: e["nsamples"] for e in written["shardlist"]} == truth
    s3.server.reset_counts()
    fresh = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "other-cluster")})
    found, report = asyncio.run(_counts_with_storage(fresh, s3))
    assert report.scanned == 0
    assert {k: c.samples for k, c in found.items()} == truth
    assert shard_gets(s3) == {}, "no shard was read to count it"


async def _counts_with_storage(settings: Settings, s3: S3Bucket) -> Any:
    async with Stager(settings) as stager:
        handle = await stager.open(s3.url("ds"))
        return await ClusterIndex(handle.origin, handle.manifest, settings).build()


def test_index_without_writing_beside_the_origin_keeps_the_counts_on_the_shared_tier(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    env = {
        **cache_env,
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
    }
    result = run_cli(["index", str(origin), "--no-write"], env, check=True)
    assert "3 shards, 30 samples; 3 scanned here" in result.stdout
    assert list((tmp_path / "shared" / "indexes").rglob("batch-*.json"))
    assert not (origin / WIDS_INDEX_NAME).exists()
    again = run_cli(
        ["index", str(origin), "--no-write"], {**env, "DATACACHE_LOCAL_DIR": str(tmp_path / "l2")}, check=True
    )
    assert "0 scanned here" in again.stdout, "a second node reuses the cluster's counts"


def test_index_of_a_parquet_dataset_says_it_needs_none(tmp_path: Path, cache_env: dict[str, str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "pq"
    origin.mkdir()
    pq.write_table(pa.table({"x": [1, 2, 3]}), origin / "a.parquet")
    result = run_cli(["index", str(origin)], {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")})
    assert result.returncode == 2
    assert "tar shards only" in result.stderr


def test_rescan_replaces_a_wrong_count_the_cluster_had_kept(
    tmp_path: Path, settings: Settings, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=57, per_shard=10)
    wrong = counts_on_disk(origin)
    wrong["train-0004.tar"] -= 2
    write_wids(origin, wrong)
    with pytest.raises(ShardReadError, match=r"--rescan"):
        list(CachedIterableDataset(str(origin), config=settings, shuffle=False))
    (origin / "train.json").unlink()  # the bad index is gone, but the cluster kept what it said
    env = {
        **cache_env,
        "DATACACHE_LOCAL_DIR": str(settings.local_dir),
        "DATACACHE_SHARED_DIR": str(settings.shared_dir),
    }
    result = run_cli(["index", str(origin), "--rescan", "--no-write"], env, check=True)
    assert "6 scanned here" in result.stdout
    again = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    assert sorted(s["__key__"] for s in again) == sorted(expected)


def test_index_on_a_dask_cluster_reads_each_shard_once(s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]) -> None:
    truth = upload(s3, tmp_path, samples=200, per_shard=20)
    s3.server.reset_counts()
    result = run_cli(
        ["index", s3.url("ds"), "--engine", "dask", "--json", "--no-write"],
        node_env(s3, tmp_path, 0, cache_env),
        check=True,
        timeout=300,
    )
    report = json.loads(result.stdout)
    assert report["samples"] == sum(truth.values()) and report["scanned"] == len(truth)
    assert shard_gets(s3) == dict.fromkeys(truth, 1)
    again = run_cli(["index", s3.url("ds"), "--json", "--no-write"], node_env(s3, tmp_path, 1, cache_env), check=True)
    assert json.loads(again.stdout)["scanned"] == 0, "the engine's counts are the cluster's"


def test_a_wids_index_is_found_without_listing_the_origin_a_second_time(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    source = tmp_path / "upload"
    write_wds(source, samples=120, per_shard=10)
    truth = counts_on_disk(source)
    write_wids(source, truth)
    for path in sorted(source.iterdir()):
        s3.put(f"ds/{path.name}", path.read_bytes())
    s3.server.reset_counts()
    settings = load_settings(
        cache_env, overrides={"local_dir": str(tmp_path / "local"), "shared_dir": str(tmp_path / "shared")}
    )
    dataset = CachedIterableDataset(s3.url("ds"), config=settings, seed=2, batch_size=8)
    next(iter(dataset))
    requests = s3.server.request_counts()
    assert requests.get(f"GET /{s3.name}/ds/train.json") == 1, "the wids index was read"
    assert not any(key.endswith(".tar") and n > 1 for key, n in requests.items())
    # The manifest's one listing also found the index: a listing per dataset costs ~1 s per 1,000 objects.
    assert requests.get(f"GET /{s3.name}") == 1, requests


def test_a_shard_that_failed_to_count_once_is_counted_again_not_kept_uncountable(
    tmp_path: Path, settings: Settings
) -> None:
    """A count that failed (the object read back wrong once) leaves its shard out of its batch's
    file: the next reader counts it again rather than take the batch as done. A new user's 2-rank
    run kept a valid shard 'uncountable' for the cluster after one failed count, and the next
    epoch failed on it."""
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    victim = origin / "train-0001.tar"
    good, stat = victim.read_bytes(), victim.stat()

    async def build() -> tuple[dict[str, KnownCount], IndexReport]:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            return await ClusterIndex(handle.origin, handle.manifest, settings).build()

    # The same bytes' length and mtime (the manifest's version holds), other bytes: a bad read.
    victim.write_bytes(b"\xff" * len(good))
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    found, report = asyncio.run(build())
    assert "train-0001.tar" in report.unreadable and "train-0001.tar" not in found
    victim.write_bytes(good)
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    found, report = asyncio.run(build())
    assert found["train-0001.tar"].samples == 10, "counted again, and right"
    assert report.unreadable == {}


def test_a_shard_evicted_between_its_location_and_its_count_is_counted_from_the_origin(
    tmp_path: Path, settings: Settings
) -> None:
    """On a small local tier another reader may evict a shard between the answer that it is local
    and the count's read of it: that is no fault of its bytes. It was recorded as uncountable for
    the cluster (a new user's 2-rank run at a third of the dataset lost a sample, then failed)."""
    from datacache.loaders.plans.cold import CountBook
    from datacache.loaders.plans.counts import load_or_build_plan

    from datacache._sync import LoopThread

    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)

    class EvictedUnderfoot:
        """The node's stager, with another process's eviction landing right after each answer."""

        def __init__(self, stager: Stager) -> None:
            self._stager = stager

        async def ensure(self, handle: Any, key: str, **kwargs: Any) -> Any:
            location = await self._stager.ensure(handle, key, **kwargs)
            if location.path is not None:
                os.unlink(location.path)
            return location

    async def count() -> int:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            await stager.ensure(handle, "train-0001.tar")  # resident: the next answer is its path
            plan = await load_or_build_plan(stager, handle, settings, wait=False)
            book = CountBook(plan, handle, settings, LoopThread(), EvictedUnderfoot(stager))  # type: ignore[arg-type]
            return await book._count_staged(handle.manifest.shard("train-0001.tar"), "here")

    assert asyncio.run(count()) == 10


def test_the_cluster_indexs_counts_are_matched_to_the_manifest_in_one_pass_not_a_search_a_key(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second node takes every count from the cluster index: 2e4 binary searches there were 2 s of its start."""
    from datacache.manifest.columns import ShardTable

    origin = tmp_path / "origin"
    write_wds(origin, samples=300, per_shard=1)
    truth = counts_on_disk(origin)
    write_wids(origin, truth)
    build_counts(settings, str(origin))  # the first node: the wids index's counts kept in the cluster index
    (origin / "train.json").unlink()  # so the second can only take them from there

    searches = 0
    search = ShardTable.position

    def counted(self: ShardTable, key: str) -> int | None:
        nonlocal searches
        searches += 1
        return search(self, key)

    monkeypatch.setattr(ShardTable, "position", counted)
    found, report = build_counts(settings, str(origin))
    assert report.scanned == 0
    assert {key: count.samples for key, count in found.items()} == truth
    assert searches < len(truth) // 4, f"{searches} binary searches for {len(truth)} counts"


def test_positions_of_many_keys_or_few_agree_with_one_search_each() -> None:
    from datacache.manifest import Shard
    from datacache.manifest.columns import ShardTable

    table = ShardTable.from_shards(Shard(f"k/{i:04d}.tar", i + 1) for i in range(0, 2000, 2))
    for keys in (["k/0004.tar", "nope", "k/0001.tar", "k/1998.tar"], [f"k/{i:04d}.tar" for i in range(2001)]):
        expected = [-1 if (at := table.position(key)) is None else at for key in keys]
        assert table.positions(keys).tolist() == expected
