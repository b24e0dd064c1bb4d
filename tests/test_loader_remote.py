"""``remote=``: batches made by CPU workers elsewhere in a Ray cluster, on a real two-node cluster.

The cluster (`ray.cluster_utils.Cluster`: a head with no CPUs, two worker nodes of one CPU
each, every node its own raylet and processes) lives for the module. Each worker node has its
own local tier (``DATACACHE_LOCAL_DIR``) and the cluster one shared tier, as real nodes would.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _helpers import REPO, run_cli
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings
from datacache.errors import ConfigError

ray = pytest.importorskip("ray")

from datacache.loaders import CachedIterableDataset, RayPool  # noqa: E402
from datacache.loaders.remote._sizing import Measured, Target, workers_needed  # noqa: E402

if TYPE_CHECKING:
    from conftest import S3Bucket, S3Server

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::ResourceWarning")


@dataclass
class RayNodes:
    cluster: Any
    root: Path
    nodes: list[Any]
    envs: list[dict[str, str]]
    options: dict[str, Any]

    def local_dirs(self) -> list[Path]:
        return sorted(self.root.glob("node*/local"))


@pytest.fixture(scope="module")
def ray_nodes(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[RayNodes]:
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("ray-nodes")
    common = {
        **s3_server.env(),
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]),
        "DATACACHE_SHARED_DIR": str(root / "shared"),
        "DATACACHE_CONCURRENCY": "2",
        "HOME": str(root / "home"),
    }
    small = {"object_store_memory": 80 * 1024 * 1024, "include_dashboard": False}
    envs = [{**common, "DATACACHE_LOCAL_DIR": str(root / f"node{index}" / "local")} for index in range(2)]
    for attempt in range(3):
        # Ray gives a starting node 30 s (fixed) to register; a machine busy with other suites can miss it.
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=0, **small)
            nodes = [cluster.add_node(num_cpus=1, env_vars=env, **small) for env in envs]
            cluster.wait_for_nodes()
            break
        except Exception:
            cluster.shutdown()
            if attempt == 2:
                raise
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    try:
        yield RayNodes(cluster, root, nodes, envs, small)
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def pools(ray_nodes: RayNodes) -> Iterator[list[RayPool]]:
    """Pools a test makes, stopped after it (each worker holds one of the cluster's two CPUs)."""
    made: list[RayPool] = []
    yield made
    for pool in made:
        pool.close()


def _pool(pools: list[RayPool], **options: Any) -> RayPool:
    pool = RayPool(**options)
    pools.append(pool)
    return pool


def _label(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform (decode and reshape): what the remote workers run."""
    return {"key": sample["__key__"], "label": int(sample["cls"]), "size": len(sample["bin"])}


def _die_once_at(marker: str, key: str, sample: dict[str, Any]) -> dict[str, Any]:
    """``_label``, but the first process to meet ``key`` is killed (SIGKILL) in the middle of its batch."""
    if sample["__key__"] == key:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        else:
            os.kill(os.getpid(), signal.SIGKILL)
    return _label(sample)


def _held_after(first: frozenset[str], gate: str, sample: dict[str, Any]) -> dict[str, Any]:
    """``_label``, but a sample not among ``first`` waits until ``gate`` exists: runs stay in flight."""
    deadline = time.monotonic() + 120
    while sample["__key__"] not in first and not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)  # sleep-ok: a Ray worker polls for the test's go-ahead (a file), with a deadline
    return _label(sample)


def _batches(items: Any) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    return [(tuple(b["key"]), tuple(b["label"].tolist())) for b in items]


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    write_wds(tmp_path / "origin", samples=60, per_shard=6, with_counts=True)
    return tmp_path / "origin"


def _dataset(origin: Path | str, settings: Settings, **options: Any) -> CachedIterableDataset:
    return CachedIterableDataset(str(origin), config=settings, seed=5, batch_size=4, transform=_label, **options)


def _top_frame(settings: Settings, cache_env: dict[str, str]) -> dict[str, Any]:
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(settings.local_dir)}
    done = run_cli(["top", "--once", "--json", "--interval", "0.1"], env, check=True)
    frame: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return frame


def test_remote_batches_are_the_local_reader_s_whatever_the_pool_size_and_once_across_ranks(
    origin: Path,
    settings: Settings,
    pools: list[RayPool],
    monkeypatch: pytest.MonkeyPatch,
    cache_env: dict[str, str],
) -> None:
    local = _batches(_dataset(origin, settings))
    one = _dataset(origin, settings, remote=_pool(pools, workers=1))
    assert _batches(one) == local
    one.remote.close()  # its worker holds one of the cluster's two CPUs
    two = _dataset(origin, settings, remote=_pool(pools, workers=2))
    assert _batches(two) == local
    stats = two.stats()
    assert stats.remote is not None and stats.remote.workers == 2
    placed = {ray.get(worker.handle.where.remote())[0] for worker in two.remote.open().live.values()}
    assert len(placed) == 2, "one worker on each node"
    assert stats.samples == 60 and stats.remote.lost_workers == 0
    frame = _top_frame(settings, cache_env)
    pools_seen = [c for c in frame["clients"] if c.get("remote_workers") is not None]
    assert [(c["remote_workers"], c["remote_max_workers"]) for c in pools_seen] == [(2, 2)], frame["clients"]
    text = run_cli(["top", "--once"], {**cache_env, "DATACACHE_LOCAL_DIR": str(settings.local_dir)}, check=True)
    assert "r0 pool 2/2 pid" in text.stdout
    seen = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        ranked = _dataset(origin, settings, remote=two.remote)
        seen += [key for keys, _ in _batches(ranked) for key in keys]
    assert sorted(seen) == [f"sample{i:06d}" for i in range(60)]


def test_a_worker_killed_mid_batch_has_its_batches_made_again_nothing_lost_or_repeated(
    origin: Path, settings: Settings, pools: list[RayPool], tmp_path: Path
) -> None:
    local = _batches(_dataset(origin, settings))
    dying = functools.partial(_die_once_at, str(tmp_path / "killed"), "sample000031")
    dataset = CachedIterableDataset(
        str(origin), config=settings, seed=5, batch_size=4, transform=dying, remote=_pool(pools, workers=2)
    )
    assert _batches(dataset) == local
    assert (tmp_path / "killed").exists(), "a worker died in the middle of a batch"
    stats = dataset.stats().remote
    assert stats is not None and stats.lost_workers == 1 and stats.remade_batches >= 1
    assert stats.workers == 2, "the lost worker was replaced"


def test_a_worker_ray_killed_between_batches_is_replaced_and_the_epoch_goes_on(
    origin: Path, settings: Settings, pools: list[RayPool]
) -> None:
    local = _batches(_dataset(origin, settings))
    pool = _pool(pools, workers=2)
    dataset = _dataset(origin, settings, remote=pool)
    batches = iter(dataset)
    taken = _batches(itertools.islice(batches, 3))
    victim = next(iter(pool.open().live.values()))
    ray.kill(victim.handle)
    assert taken + _batches(batches) == local


def test_resume_on_another_world_size_and_pool_size_is_exact(
    origin: Path, settings: Settings, pools: list[RayPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _dataset(origin, settings, remote=_pool(pools, workers=2))
    batches = iter(first)
    taken = [key for keys, _ in _batches(itertools.islice(batches, 5)) for key in keys]
    state = first.state_dict()
    first.remote.close()
    rest, expected = [], []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        resumed = _dataset(origin, settings, remote=_pool(pools, workers=1))
        resumed.load_state_dict(state)
        rest += _batches(resumed)
        in_process = _dataset(origin, settings)
        in_process.load_state_dict(state)
        expected += _batches(in_process)
    assert rest == expected, "the remote workers make the batches an in-process reader would"
    keys = taken + [key for batch, _ in rest for key in batch]
    assert sorted(keys) == [f"sample{i:06d}" for i in range(60)], "each sample once across the checkpoint"


def test_batches_in_flight_stay_within_the_pool_s_bound(
    origin: Path, settings: Settings, pools: list[RayPool]
) -> None:
    dataset = _dataset(origin, settings, remote=_pool(pools, workers=2, in_flight=4, batches_per_task=2))
    batches = iter(dataset)
    next(batches)
    taken = 1
    while dataset.stats().remote.most_in_flight < 4:  # type: ignore[union-attr]
        next(batches)  # the loop is slow: the workers fill the window, and no more
        taken += 1
    assert taken + len(list(batches)) == 15
    assert dataset.stats().remote.most_in_flight == 4  # type: ignore[union-attr]


def test_the_origin_is_read_once_per_cluster(
    s3: S3Bucket, tmp_path: Path, settings: Settings, pools: list[RayPool], ray_nodes: RayNodes
) -> None:
    write_wds(tmp_path / "upload", samples=48, per_shard=6, with_counts=True)
    for path in sorted((tmp_path / "upload").iterdir()):
        s3.put(f"remote/{path.name}", path.read_bytes())
    s3.server.reset_counts()
    pool = _pool(pools, workers=2)
    ray.get([worker.probe for worker in pool.open().live.values()])  # both run before the epoch: both read
    dataset = _dataset(s3.url("remote/"), settings, remote=pool)
    assert sorted(keys_of({"__key__": list(keys)} for keys, _ in _batches(dataset))) == [
        f"sample{i:06d}" for i in range(48)
    ]
    head = f"GET /{s3.name}/remote/"
    gets = {k: v for k, v in s3.server.request_counts().items() if k.startswith(head) and k.endswith(".tar")}
    assert len(gets) == 8 and set(gets.values()) == {1}, f"each shard fetched from the origin once: {gets}"
    assert len(dataset.stats().remote.nodes) == 2  # type: ignore[union-attr]
    cached = [sorted(p.name for p in d.rglob("*.tar")) for d in ray_nodes.local_dirs()]
    assert all(cached), f"each node read through its own local tier: {cached}"
    hits = dataset.stats().hit_ratio  # where the workers' shards came from, as the training process reports
    assert hits["origin"] > 0 and hits["origin"] + hits["shared"] + hits["local"] == pytest.approx(1.0)


def test_the_pool_grows_toward_an_unmet_target_and_shrinks_past_a_met_one(
    origin: Path, settings: Settings, pools: list[RayPool]
) -> None:
    sizes = {"max_workers": 2, "resize_every": 0.0}  # look at the rate at every answer
    growing = _dataset(origin, settings, remote=_pool(pools, workers=1, target_samples=1e9, **sizes))
    shrinking = _dataset(origin, settings, remote=_pool(pools, workers=2, target_samples=1e-3, **sizes))
    for dataset, size in ((growing, 2), (shrinking, 1)):
        pool = dataset.remote
        assert isinstance(pool, RayPool)
        assert len(_batches(dataset)) == 15
        stats = dataset.stats().remote
        assert stats is not None and stats.workers == size and stats.per_worker_rate
        assert stats.target_per_second == pool.target_samples and stats.target_unit == "samples"
        pool.close()  # its workers hold the cluster's CPUs


def test_sizing_moves_toward_the_target_within_bounds() -> None:
    rate = Measured(samples=100, bytes=10_000, busy_seconds=1.0)  # 100 samples/s per worker
    assert workers_needed(2, Target(1000, "samples"), rate, 1, 64) == 4  # grows, at most doubling
    assert workers_needed(4, Target(1000, "samples"), rate, 1, 64) == 8
    assert workers_needed(8, Target(1000, "samples"), rate, 1, 64) == 13  # 1000 x 1.25 / 100
    assert workers_needed(13, Target(1000, "samples"), rate, 1, 8) == 8  # the bound
    assert workers_needed(13, Target(100, "samples"), rate, 1, 64) == 12  # shrinks one at a time
    assert workers_needed(3, Target(20_000, "bytes"), rate, 1, 64) == 3
    assert workers_needed(3, None, rate, 1, 64) == 3
    assert workers_needed(3, Target(1000, "samples"), Measured(0, 0, 0.0), 1, 64) == 3  # nothing measured yet


def test_a_client_s_remote_pool_size_is_a_daemon_metric() -> None:
    from datacache.daemon.metrics import DaemonMetrics

    metrics = DaemonMetrics()
    metrics.client_report("node7:5510:r0w0", bandwidth=1e6, stall_fraction=0.1, delivered=10, remote_workers=6)
    assert 'datacache_client_remote_workers{client="node7:5510:r0w0"} 6.0' in metrics.render().decode()
    metrics.forget_client("node7:5510:r0w0")
    assert "node7:5510:r0w0" not in metrics.render().decode()


def test_remote_is_refused_in_one_line_where_it_cannot_be(origin: Path, settings: Settings) -> None:
    with pytest.raises(ConfigError, match="remote must be 'ray' or a RayPool"):
        CachedIterableDataset(str(origin), config=settings, batch_size=4, remote="dask")
    with pytest.raises(ConfigError, match="give the dataset batch_size="):
        CachedIterableDataset(str(origin), config=settings, remote="ray")
    with pytest.raises(ConfigError, match="max_workers=1 is below min_workers=2"):
        RayPool(min_workers=2, max_workers=1)
    with pytest.raises(ConfigError, match="in_flight=1 is below batches_per_task=2"):
        RayPool(in_flight=1)
    dataset = CachedIterableDataset(str(origin), config=settings, batch_size=4, remote=RayPool(workers=3))
    clone = pickle.loads(pickle.dumps(dataset))  # configuration only: no actor handle travels
    assert isinstance(clone.remote, RayPool) and clone.remote.workers == 3 and clone.remote._workers is None
    with pytest.raises(ConfigError, match=r"use DataLoader\(ds, batch_size=None, num_workers=0\)"):
        next(iter(DataLoader(dataset, batch_size=None, num_workers=1)))


_WITHOUT_RAY = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed: `import ray` raises ImportError
import importlib.util
importlib.util.find_spec = lambda name, *a, _find=importlib.util.find_spec: None if name == "ray" else _find(name, *a)
from datacache.loaders import CachedIterableDataset, RayPool
from datacache.errors import ConfigError
try:
    CachedIterableDataset(sys.argv[1], batch_size=4, remote="ray")
except ConfigError as exc:
    print(exc)
"""


def test_without_ray_the_loaders_import_and_remote_says_what_to_install(origin: Path) -> None:
    plain = [sys.executable, "-c", "import sys, datacache.loaders; print('ray' in sys.modules)"]
    assert subprocess.run(plain, capture_output=True, text=True, check=True).stdout.strip() == "False"
    without = subprocess.run(
        [sys.executable, "-c", _WITHOUT_RAY, str(origin)], capture_output=True, text=True, check=True
    )
    assert without.stdout.strip() == "remote='ray' needs Ray: pip install 'datacache[ray]'"


def test_an_epoch_left_early_gives_its_workers_back_to_the_next(
    origin: Path, settings: Settings, pools: list[RayPool]
) -> None:
    reference = _dataset(origin, settings)
    reference.set_epoch(1)
    expected = _batches(reference)
    dataset = _dataset(origin, settings, remote=_pool(pools, workers=2))
    assert len(_batches(itertools.islice(iter(dataset), 2))) == 2  # the loop breaks out of epoch 0
    dataset.set_epoch(1)
    assert _batches(dataset) == expected


def test_a_worker_node_killed_mid_epoch_has_its_batches_made_on_the_node_that_replaces_it(
    origin: Path, settings: Settings, pools: list[RayPool], ray_nodes: RayNodes, tmp_path: Path
) -> None:
    local = _batches(_dataset(origin, settings))
    # Every batch after the first two waits for the gate: both workers hold runs when the node goes
    # (a quiet machine had made the whole epoch before the kill, and lost no worker).
    gate = tmp_path / "go"
    held = functools.partial(_held_after, frozenset(key for keys, _ in local[:2] for key in keys), str(gate))
    pool = _pool(pools, workers=2)
    dataset = CachedIterableDataset(str(origin), config=settings, seed=5, batch_size=4, transform=held, remote=pool)
    batches = iter(dataset)
    taken = _batches(itertools.islice(batches, 2))
    # The node a worker runs on: on a busy machine both workers were once placed on one node, and
    # the other node's removal lost none (lost_workers 0, a fresh-clone run beside another).
    running = dataset.stats().remote
    assert running is not None and running.nodes, running
    index = next((i for i, node in enumerate(ray_nodes.nodes) if node.node_id in running.nodes), 0)
    victim, env = ray_nodes.nodes.pop(index), ray_nodes.envs.pop(index)
    ray_nodes.cluster.remove_node(victim, allow_graceful=False)  # its raylet and workers are killed
    ray_nodes.nodes.append(ray_nodes.cluster.add_node(num_cpus=1, env_vars=env, **ray_nodes.options))
    ray_nodes.envs.append(env)  # the nodes and their environments stay in step for later tests
    gate.touch()
    assert taken + _batches(batches) == local
    stats = dataset.stats().remote
    assert stats is not None and stats.lost_workers >= 1
