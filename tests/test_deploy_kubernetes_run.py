"""The Kubernetes DaemonSet shape run as far as it runs here: its uids, its mounted config, its env.

No container engine runs on these machines; what the manifests decide still runs for real. The
DaemonSet's init container's command prepares the hostPaths (as root); the daemon runs as the pod's
``runAsUser``/``runAsGroup`` with ``fsGroup`` as a supplementary group, with the container's args
and env and the ConfigMap mounted at its path; a training pod of another uid, with the same
``fsGroup`` (so the daemon's gid as a supplementary group) and the same ConfigMap, trains through
it. Host paths are moved under a temporary directory; the operator adds one dataset line to the
ConfigMap; the metrics port is a free one (tests run side by side).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
import yaml
from _daemon import unix_request, wait_until
from _users import User, run_as
from test_deploy_slurm import _TRAIN, _shards

from datacache import cli

users = _users.users
world_dir = _users.world_dir

DAEMONSET = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "daemonset.yaml"


def _documents() -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(DAEMONSET.read_text()) if doc]


class Pod:
    """The DaemonSet's pod on one node, its host paths under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        documents = _documents()
        self.config_text = next(d for d in documents if d["kind"] == "ConfigMap")["data"]["config.toml"]
        daemonset = next(d for d in documents if d["kind"] == "DaemonSet")
        self.spec = daemonset["spec"]["template"]["spec"]
        self.context = self.spec["securityContext"]
        self.moved = {
            "/mnt/nvme/datacache": str(root / "nvme" / "datacache"),
            "/mnt/shared/datacache": str(root / "shared" / "datacache"),
            "/run/datacache": str(root / "run" / "datacache"),
            "/etc/datacache": str(root / "etc" / "datacache"),
            "/tmp": str(root / "tmp"),
        }

    def move(self, text: str) -> str:
        """``text`` with each container path on a volume moved to where the volume is here (one pass)."""
        pattern = "|".join(re.escape(inside) for inside in sorted(self.moved, key=len, reverse=True))
        return re.sub(rf"(?<![\w/])({pattern})(?=[/\s\"']|$)", lambda m: self.moved[m.group(1)], text, flags=re.M)

    def prepare(self, dataset_line: str) -> None:
        """The node's hostPaths (root-owned, as the kubelet makes them), the PVC, the ConfigMap."""
        for path in (self.moved["/mnt/nvme/datacache"], self.moved["/run/datacache"], self.moved["/etc/datacache"]):
            Path(path).mkdir(parents=True)
        for directory in (self.root, *[p for p in self.root.rglob("*") if p.is_dir()]):
            directory.chmod(0o755)
        tmp = Path(self.moved["/tmp"])
        tmp.mkdir()
        tmp.chmod(0o1777)
        shared = Path(self.moved["/mnt/shared/datacache"])  # the PVC, given to fsGroup by the kubelet
        shared.mkdir(parents=True)
        os.chown(shared, 0, self.context["fsGroup"])
        shared.chmod(0o2770)
        shared.parent.chmod(0o755)
        config = Path(self.moved["/etc/datacache"]) / "config.toml"
        config.write_text(self.move(self.config_text) + dataset_line + "\n")
        config.chmod(0o644)
        init = next(c for c in self.spec["initContainers"] if c["name"] == "prepare-directories")
        done = subprocess.run([self.move(word) for word in init["command"]], capture_output=True, text=True,
                              check=False)
        assert done.returncode == 0, done.stderr

    def start_daemon(self) -> subprocess.Popen[bytes]:
        container = self.spec["containers"][0]
        args = [self.move(a) for a in container["args"]]
        env = {"PATH": os.environ["PATH"], "HOME": self.moved["/tmp"], "LANG": "C.UTF-8"}
        env.update({e["name"]: self.move(e["value"]) for e in container.get("env", [])})
        env["DATACACHE_METRICS_ADDRESS"] = "127.0.0.1:0"  # the one departure: tests run side by side
        self.log = self.root / "daemon.log"
        with self.log.open("wb") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "datacache.cli", "serve", *args],
                user=self.context["runAsUser"], group=self.context["runAsGroup"],
                extra_groups=[self.context["fsGroup"]], env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT,
            )

    @property
    def socket(self) -> Path:
        """Where the daemon listens: its settings as `datacache serve` resolves them (args, env, the mounted config)."""
        container = self.spec["containers"][0]
        parsed = cli.parse_args(["serve", *[self.move(a) for a in container["args"]]])
        env = {e["name"]: self.move(e["value"]) for e in container.get("env", [])} | {"HOME": "/nonexistent"}
        return cli.serve_settings(parsed, env).daemon_socket


@pytest.fixture
def pod(world_dir: Path, users: dict[str, User]) -> Iterator[Pod]:
    yield Pod(world_dir)


def test_a_training_pod_of_another_uid_trains_through_the_daemonset(pod: Pod, users: dict[str, User], s3: Any) -> None:
    for key, data in _shards(3, 4).items():
        s3.client.put_object(Bucket=s3.name, Key=f"wds/{key}", Body=data, ACL="public-read")
    # Declared shared with the pods' group (their fsGroup, the daemon's gid): they map its copies.
    line = (f'imagenet = {{ url = "{s3.url("wds")}/", readers = ["@{pod.context["fsGroup"]}"], '
            f'storage_options = {{ endpoint_url = "{s3.server.endpoint}", anon = true }} }}')
    pod.prepare(line)
    daemon = pod.start_daemon()
    socket = pod.socket
    try:
        def ready() -> bool:
            if daemon.poll() is not None:
                raise AssertionError(f"the daemon exited {daemon.returncode}:\n{pod.log.read_text()}")
            try:
                return unix_request(socket, "GET", "/readyz", timeout=5)[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout=90, what="the daemon to become ready")
        # A training pod: its own uid, the pod's fsGroup (the daemon's gid) as a supplementary group,
        # the ConfigMap mounted and named by DATACACHE_CONFIG, the hostPaths at the daemon's paths.
        alice = users["alice"]
        trainer = User(name=alice.name, uid=alice.uid, gid=alice.gid, groups=(pod.context["fsGroup"],))
        env = _users.user_env(trainer, {"DATACACHE_CONFIG": str(Path(pod.moved["/etc/datacache"]) / "config.toml")})
        trained = run_as(trainer, [sys.executable, "-c", textwrap.dedent(_TRAIN), "imagenet"], env=env, timeout=300)
        assert trained.returncode == 0, trained.stderr + pod.log.read_text()
        result = json.loads(trained.stdout.strip().splitlines()[-1])
        assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(3) for i in range(4))
        for failure in ("PermissionError", "DatacacheError", "refusing", "embedded"):
            assert failure not in trained.stderr, trained.stderr
        local = Path(pod.moved["/mnt/nvme/datacache"])
        for path in [local, *local.rglob("*")]:
            assert path.lstat().st_uid == pod.context["runAsUser"], path
            assert path.lstat().st_mode & 0o007 == 0, (path, oct(path.lstat().st_mode))
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)


def test_the_sidecar_and_its_trainer_share_one_uid_and_the_pods_emptydirs(world_dir: Path, s3: Any) -> None:
    """deploy/kubernetes/sidecar.yaml: the daemon and the trainer as the pod's one uid, each with its env."""
    for key, data in _shards(2, 4).items():
        s3.put(f"wds/{key}", data)
    documents = yaml.safe_load_all((DAEMONSET.parent / "sidecar.yaml").read_text())
    job = next(d for d in documents if d and d["kind"] == "Job")
    spec = job["spec"]["template"]["spec"]
    context = spec["securityContext"]
    volumes = {"/cache": world_dir / "cache", "/run/datacache": world_dir / "socket", "/tmp": world_dir / "tmp"}
    for path in volumes.values():  # emptyDirs: the kubelet makes them writable by the pod (fsGroup)
        path.mkdir()
        os.chown(path, 0, context["fsGroup"])
        path.chmod(0o2777)

    def env_of(container: dict[str, Any]) -> dict[str, str]:
        env = {"PATH": os.environ["PATH"], "HOME": str(volumes["/tmp"]), "LANG": "C.UTF-8", **s3.server.env()}
        for item in container.get("env", []):
            value = item["value"]
            for inside, outside in volumes.items():
                if value == inside or value.startswith(inside + "/"):
                    value = str(outside) + value[len(inside) :]
                    break
            env[item["name"]] = value
        return env

    sidecar = next(c for c in spec["initContainers"] if c.get("restartPolicy") == "Always")
    trainer = spec["containers"][0]
    daemon_env = env_of(sidecar) | {"DATACACHE_METRICS_ADDRESS": "127.0.0.1:0"}  # tests run side by side
    ids = {"user": context["runAsUser"], "group": context["runAsGroup"], "extra_groups": [context["fsGroup"]]}
    log = world_dir / "daemon.log"
    with log.open("wb") as out:
        daemon = subprocess.Popen([sys.executable, "-m", "datacache.cli", "serve", *sidecar["args"]], **ids,
                                  env=daemon_env, cwd="/", stdout=out, stderr=subprocess.STDOUT)
    socket = Path(daemon_env["DATACACHE_SOCKET"])
    try:
        def ready() -> bool:
            if daemon.poll() is not None:
                raise AssertionError(f"the daemon exited {daemon.returncode}:\n{log.read_text()}")
            try:
                return unix_request(socket, "GET", "/readyz", timeout=5)[0] == 200
            except OSError:
                return False

        wait_until(ready, timeout=90, what="the sidecar daemon to become ready")
        data = next(a for a in trainer["command"] if a.startswith("--data="))
        assert data.startswith("--data=s3://")  # the trainer names its dataset by URL; here, this bucket's
        s3.server.reset_counts()
        trained = subprocess.run([sys.executable, "-c", textwrap.dedent(_TRAIN), f"{s3.url('wds')}/"], **ids,
                                 env=env_of(trainer), cwd="/", capture_output=True, text=True, timeout=300, check=False)
        assert trained.returncode == 0, trained.stderr + log.read_text()
        result = json.loads(trained.stdout.strip().splitlines()[-1])
        assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(2) for i in range(4))
        for failure in ("PermissionError", "DatacacheError", "refusing", "embedded"):
            assert failure not in trained.stderr, trained.stderr
        cached = sorted(str(p.relative_to(volumes["/cache"])) for p in volumes["/cache"].rglob("*"))
        assert "catalog.sqlite" in cached, cached
        assert (volumes["/cache"] / "catalog.sqlite").stat().st_uid == context["runAsUser"]
        gets = [k for k, n in s3.server.request_counts().items() if k.startswith("GET ") and "/wds/shard-" in k]
        assert len(gets) == 2, gets  # each shard fetched once, by the daemon, for both workers
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(timeout=60)
