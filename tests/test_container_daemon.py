"""The daemon's image run as a container: the node's cache and socket as volumes, a trainer outside it.

`make image` builds ghcr.io/datacache/datacache (deploy/Dockerfile); these tests run it under the
engine it was built with (tests/_containers.py), as the image's own user (uid 10001), the node's
cache and socket directories bind-mounted at the same paths inside as outside (the paths the
daemon names open as they are). A training process of another uid, a member of the daemon's group
as the deployments make it, runs on the host, in the test's network namespace, and reads through
the socket. Each test skips with one line where no engine works or the image is not built.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _users
import pytest
from _containers import (
    DAEMON_UID,
    IMAGE,
    Containers,
    NetNS,
    containers,
    engine,
    engine_popen,
    netns,
    require_image,
    run_flags,
)
from _daemon import unix_request, wait_until
from _users import User
from test_deploy_slurm import _TRAIN, _shards

pytestmark = pytest.mark.containers

users = _users.users
world_dir = _users.world_dir
__all__ = ["containers", "netns"]  # fixtures, by name

BUCKET = "datasets"


@dataclass
class Node:
    """One node's cache, socket and config directories under ``root``, and its network namespace."""

    root: Path
    netns: NetNS

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def config(self) -> Path:
        return self.root / "etc" / "config.toml"

    @property
    def socket(self) -> Path:
        return self.run / "daemon.sock"

    def prepare(self, capacity: str = "1GB") -> None:
        for path in (self.cache, self.run):
            path.mkdir()
            os.chown(path, DAEMON_UID, DAEMON_UID)
            path.chmod(0o750)  # the daemon's group (the trainers') may enter
        self.config.parent.mkdir()
        options = f'{{ endpoint_url = "{self.netns.endpoint}", anon = true }}'
        self.config.write_text(textwrap.dedent(f"""\
            [cache]
            local_dir = "{self.cache}"
            local_capacity = "{capacity}"

            [daemon]
            socket = "{self.socket}"
            daemon_uid = {DAEMON_UID}

            [datasets]
            demo = {{ url = "s3://{BUCKET}/wds/", storage_options = {options} }}
            """))
        self.config.chmod(0o644)

    def daemon_args(self, name: str, *extra: str) -> list[str]:
        """`run` of the image: its user, the volumes at the same paths, the config mounted and named."""
        etc = self.config.parent
        volumes = [f"{self.cache}:{self.cache}", f"{self.run}:{self.run}", f"{etc}:{etc}:ro"]
        return [
            # The host's pid and uts namespaces: the daemon ties a reader's leases to its host:pid (see
            # deploy/README.md, "Containers"); in its own namespaces it refuses the trainer's progress.
            "run", "-d", "--name", name, f"--network=ns:{self.netns.path}", "--pid=host", "--uts=host", *run_flags(),
            *[flag for volume in volumes for flag in ("-v", volume)],
            "-e", f"DATACACHE_CONFIG={self.config}", *extra, IMAGE, "--log-json",
        ]

    def ready(self, containers: Containers, name: str) -> None:
        def answers() -> bool:
            state = containers.inspect(name)["State"]
            if not state["Running"]:
                raise AssertionError(f"the daemon's container exited {state['ExitCode']}:\n{containers.logs(name)}")
            try:
                return unix_request(self.socket, "GET", "/readyz", timeout=5)[0] == 200
            except OSError:
                return False

        wait_until(answers, timeout=120, what="the daemon's container to become ready")

    def trainer(self, user: User, script: str, *args: str) -> subprocess.Popen[str]:
        """A training process of ``user`` (the daemon's group its supplementary one), in the namespace."""
        groups = ",".join(str(g) for g in (*user.groups, DAEMON_UID))
        argv = [*self.netns.prefix(), "setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", f"--groups={groups}",
                "--", sys.executable, "-c", textwrap.dedent(script), *args]
        env = _users.user_env(user, {"DATACACHE_CONFIG": str(self.config)})
        return subprocess.Popen(argv, env=env, cwd=user.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)


def _finish(trainer: subprocess.Popen[str], timeout: float = 300) -> dict[str, Any]:
    out, err = trainer.communicate(timeout=timeout)
    assert trainer.returncode == 0, err
    for failure in ("PermissionError", "DatacacheError", "refusing", "Traceback"):
        assert failure not in err, err
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@pytest.fixture
def node(world_dir: Path, netns: NetNS) -> Node:
    require_image()
    return Node(world_dir, netns)


def test_a_trainer_of_another_uid_reads_each_shard_once_through_the_daemon_container(
    node: Node, containers: Containers, users: dict[str, User], tmp_path: Path
) -> None:
    node.netns.seed(BUCKET, "wds/", _shards(3, 4), tmp_path / "shards")
    node.prepare()
    name = containers.name("daemon")
    engine(node.daemon_args(name))
    node.ready(containers, name)
    assert containers.inspect(name)["Config"]["User"] == f"{DAEMON_UID}:{DAEMON_UID}"

    # The image's HEALTHCHECK (GET /healthz on the metrics port) passes in the running container.
    checked = engine(["healthcheck", "run", name], check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr + containers.logs(name)

    result = _finish(node.trainer(users["alice"], _TRAIN, "demo"))
    assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(3) for i in range(4))
    assert node.netns.gets(BUCKET, "wds/shard-") == {f"/{BUCKET}/wds/shard-{s:04d}.tar": 1 for s in range(3)}
    for path in [node.cache, *node.cache.rglob("*")]:  # written by the container's user, nobody else's
        assert path.lstat().st_uid == DAEMON_UID, path
        assert path.lstat().st_mode & 0o007 == 0, (path, oct(path.lstat().st_mode))


def test_the_healthcheck_fails_when_the_daemon_does_not_answer_it(node: Node, containers: Containers) -> None:
    node.prepare()
    name = containers.name("elsewhere")
    engine(node.daemon_args(name, "-e", "DATACACHE_METRICS_ADDRESS=127.0.0.1:9465"))
    node.ready(containers, name)
    checked = engine(["healthcheck", "run", name], check=False)
    assert checked.returncode != 0, checked.stdout


def test_sigterm_drains_a_running_warm_within_the_grace_period(
    node: Node, containers: Containers, tmp_path: Path
) -> None:
    node.netns.seed(BUCKET, "wds/", _shards(6, 40), tmp_path / "shards")
    node.prepare()
    name = containers.name("drain")
    engine(node.daemon_args(name))
    node.ready(containers, name)
    # A warm through the socket, paced so that it is still running when the stop comes.
    words = ["exec", name, "datacache", "warm", "demo", "--bandwidth", "200KB/s", "--json"]
    warm = engine_popen(words)
    assert warm.stdout is not None
    for line in warm.stdout:  # the warm's own lines: the stop comes once it has staged a first shard
        if '"progress"' in line:
            break
    else:
        raise AssertionError(f"the warm ended before staging a shard: {warm.communicate()[1]}")
    engine(["stop", "-t", "60", name], timeout=120)
    warm.communicate(timeout=120)
    state = containers.inspect(name)["State"]
    assert state["ExitCode"] == 0, containers.logs(name)  # stopped by itself: the engine's SIGKILL gives 137
    stopped = [json.loads(line) for line in containers.logs(name).splitlines() if '"stopped"' in line]
    assert stopped and stopped[-1]["event"] == "stopped", containers.logs(name)
    assert not node.socket.exists()  # released: the next daemon starts clean


_READ_IN_TWO = """
import json, os, sys, time
from pathlib import Path
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset

dataset, began, go = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
ds = CachedIterableDataset(dataset, shuffle=True, seed=5)
keys = []
for sample in DataLoader(ds, batch_size=None, num_workers=2):
    keys.append(sample["__key__"])
    if len(keys) == 8:
        began.write_text("8")
        deadline = time.monotonic() + 240
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # sleep-ok: the test holds the reader mid-epoch while the daemon restarts
print(json.dumps({"keys": keys}))
"""


def test_the_container_killed_mid_epoch_and_restarted_the_reader_carries_on(
    node: Node, containers: Containers, users: dict[str, User], tmp_path: Path
) -> None:
    node.netns.seed(BUCKET, "wds/", _shards(8, 6), tmp_path / "shards")
    node.prepare()
    name = containers.name("restart")
    engine(node.daemon_args(name))
    node.ready(containers, name)
    flags = Path(users["alice"].home)
    began, go = flags / f"began-{name}", flags / f"go-{name}"
    trainer = node.trainer(users["alice"], _READ_IN_TWO, "demo", str(began), str(go))
    try:
        wait_until(lambda: began.exists() or trainer.poll() is not None, timeout=240, what="the reader's 8th sample")
        assert trainer.poll() is None, trainer.communicate()[1]
        engine(["kill", "--signal", "KILL", name])  # mid-epoch: no drain, the socket left behind
        assert containers.inspect(name)["State"]["ExitCode"] == 137
        engine(["start", name])
        node.ready(containers, name)
    finally:
        go.touch()
    result = _finish(trainer)
    assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(8) for i in range(6))
    assert "stale socket" in containers.logs(name)  # the restarted daemon took over the killed one's socket
