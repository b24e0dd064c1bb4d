"""The Slurm deployment as one whole, with real accounts: install.sh, the unit, the config, the prolog, a job.

`deploy/slurm/install.sh` makes the accounts and directories (a system user for the daemon, the
group of the users who train, a job user added to it, so a member by SUPPLEMENTARY membership),
installs the config and the unit; the operator adds one dataset line. Then, as systemd would, the
daemon runs as the unit's User/Group with its UMask and Environment; the prolog warms the dataset
the job names; and a job user trains through the daemon with the environment train.sbatch sets.
Nothing else is configured: the one change from a real node is the metrics port (tests run side by
side, so it is a free one) and the paths, which install.sh's variables move under a temporary
directory (it installs the config and the unit with them).
"""

from __future__ import annotations

import grp
import hashlib
import io
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import REPO, unix_request, wait_until
from _helpers import tar_of
from _users import User, run_as

from datacache.config import dataset_id_for

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir

DEPLOY = REPO / "deploy"
SLURM = DEPLOY / "slurm"


def _unit(path: Path) -> dict[str, list[str]]:
    """The [Service] section of a unit file: each key's values, in order (keys may repeat)."""
    values: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "Service":
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


class Node:
    """One Slurm node as install.sh leaves it, under ``root``."""

    def __init__(self, root: Path, tag: str) -> None:
        self.root = root
        self.user = f"dcd{tag}"
        self.group = f"dcg{tag}"
        self.prefix = root / "opt" / "datacache"
        self.etc = root / "etc" / "datacache"
        self.local = root / "mnt" / "nvme" / "datacache"
        self.shared = root / "mnt" / "shared" / "datacache"
        self.units = root / "etc" / "systemd" / "system"
        self.prolog_dir = root / "etc" / "slurm" / "prolog.d"
        self.run_dir = root / "run" / "datacache"

    def env(self) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "DATACACHE_USER": self.user,
            "DATACACHE_GROUP": self.group,
            "DATACACHE_PREFIX": str(self.prefix),
            "DATACACHE_ETC": str(self.etc),
            "DATACACHE_LOCAL_DIR": str(self.local),
            "DATACACHE_SHARED_DIR": str(self.shared),
            "DATACACHE_UNIT_DIR": str(self.units),
            "DATACACHE_PROLOG_DIR": str(self.prolog_dir),
            "DATACACHE_RUN_DIR": str(self.run_dir),
        }

    def prepare(self) -> None:
        """What the operator has before install.sh: the mounts, and the venv (here: this checkout's)."""
        for mount in (self.local.parent, self.shared.parent):
            mount.mkdir(parents=True)
        (self.prefix / "bin").mkdir(parents=True)
        wrapper = self.prefix / "bin" / "datacache"
        wrapper.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m datacache.cli \"$@\"\n")
        wrapper.chmod(0o755)
        python = self.prefix / "bin" / "python"  # a venv's python is this checkout's interpreter, with its packages
        python.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
        python.chmod(0o755)
        for path in (self.root, *[p for p in self.root.rglob("*") if p.is_dir()]):
            path.chmod(0o755)

    def remove_accounts(self) -> None:
        subprocess.run(["userdel", self.user], capture_output=True, check=False)
        subprocess.run(["groupdel", self.group], capture_output=True, check=False)


def _login_groups(name: str) -> tuple[int, ...]:
    entry = pwd.getpwnam(name)
    return tuple(g for g in os.getgrouplist(name, entry.pw_gid) if g != entry.pw_gid)


@pytest.fixture
def node(users: dict[str, User], world_dir: Path) -> Iterator[Node]:
    """A node's paths under a fresh directory; the accounts install.sh makes are removed afterwards."""
    made = Node(world_dir, uuid.uuid4().hex[:6])
    made.prepare()
    try:
        yield made
    finally:
        made.remove_accounts()


@pytest.fixture
def job_user(node: Node) -> Iterator[User]:
    """A researcher: their own primary group, nothing else until install.sh adds them to the cache's group."""
    name = f"dcj{node.user[3:]}"
    _users._admin(["useradd", "-M", "-d", str(node.root / name), "-s", "/usr/sbin/nologin", "-U", name])
    entry = pwd.getpwnam(name)
    home = node.root / name
    home.mkdir(mode=0o700)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    try:
        yield User(name=name, uid=entry.pw_uid, gid=entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)


class Service:
    """``datacache.service`` started as systemd starts it: User, Group, UMask, Environment, RuntimeDirectory."""

    def __init__(self, node: Node) -> None:
        unit = _unit(node.units / "datacache.service")
        user = pwd.getpwnam(unit["User"][-1])
        group = grp.getgrnam(unit["Group"][-1]).gr_gid
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": user.pw_dir, "USER": user.pw_name,
               "LOGNAME": user.pw_name, "LANG": "C.UTF-8"}
        for item in unit.get("Environment", []):
            for word in shlex.split(item):
                key, _, value = word.partition("=")
                env[key] = value
        # The one departure from the unit: tests run side by side, so the metrics port is a free one.
        env["DATACACHE_METRICS_ADDRESS"] = "127.0.0.1:0"
        self.config = Path(env["DATACACHE_CONFIG"])
        self.socket = Path(tomllib.loads(self.config.read_text())["daemon"]["socket"])
        assert self.socket.parent == node.run_dir, (self.socket, node.run_dir)
        if "RuntimeDirectory" in unit:
            # systemd makes /run/<RuntimeDirectory>, owned by User:Group, RuntimeDirectoryMode.
            assert Path("/run", unit["RuntimeDirectory"][-1]) == node.run_dir, (unit["RuntimeDirectory"], node.run_dir)
            node.run_dir.mkdir(parents=True, exist_ok=True)
            os.chown(node.run_dir, user.pw_uid, group)
            node.run_dir.chmod(int(unit["RuntimeDirectoryMode"][-1], 8))
        else:
            # A socket directory outside /run: install.sh made it, and the unit lets the daemon write it.
            assert str(node.run_dir) in unit["ReadWritePaths"][-1].split(), unit["ReadWritePaths"]
            assert node.run_dir.stat().st_uid == user.pw_uid
        self.log = node.root / "daemon.log"
        self.uid = user.pw_uid
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                shlex.split(unit["ExecStart"][-1]),
                user=user.pw_uid,
                group=group,
                extra_groups=[g for g in os.getgrouplist(user.pw_name, group) if g != group],
                umask=int(unit["UMask"][-1], 8),
                env=env,
                cwd="/",
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the daemon exited {self.process.returncode}:\n{self.log.read_text()}")
        try:
            status, _ = unix_request(self.socket, "GET", "/readyz", timeout=5)
        except OSError:
            return False
        return status == 200

    def kill(self) -> None:
        """SIGKILL, as the kernel's OOM killer or an operator's ``kill -9`` ends it."""
        self.process.kill()
        self.process.wait(timeout=60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_TRAIN = """
import json, os, sys
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset

dataset = sys.argv[1]
ds = CachedIterableDataset(dataset, shuffle=True, seed=3)
loader = DataLoader(ds, batch_size=None, num_workers=2)
keys = [sample["__key__"] for sample in loader]
print(json.dumps({"keys": keys, "classes": sorted({int(sample["cls"]) for sample in ds})}))
"""


_TRAIN_THROUGH_OUTAGES = """
import hashlib, json, sys
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset

def say(word):
    print(word, flush=True)
    sys.stdin.readline()  # the test answers once it has done what the word asks

ds = CachedIterableDataset(sys.argv[1], shuffle=True, seed=3)
loader = DataLoader(ds, batch_size=None, num_workers=2)
epochs = []
for epoch in range(3):
    ds.set_epoch(epoch)
    if epoch == 1:
        say("kill")  # at the epoch's start: the workers are made with no daemon
    seen = []
    for sample in loader:
        seen.append([sample["__key__"], hashlib.sha256(sample["bin"]).hexdigest()])
        if epoch == 0 and len(seen) == 5:
            say("kill")  # mid-epoch
    epochs.append({"seen": seen, "mode": ds.stats().mode})
    if epoch < 2:
        say("restart")
print(json.dumps(epochs))
"""


def _train_through_outages(
    node: Node, service: Service, job: User, env: dict[str, str], dataset: str
) -> tuple[Service, list[Any]]:
    """Train 3 epochs as ``job``; SIGKILL the daemon mid-epoch 0 and before epoch 1, restart it after each."""
    errors = node.root / "outage-trainer.err"
    with errors.open("w") as err:
        trainer = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_TRAIN_THROUGH_OUTAGES), dataset],
            user=job.uid, group=job.gid, extra_groups=list(job.groups), env=env, cwd=str(job.home),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        for word in ("kill", "restart", "kill", "restart"):
            said = trainer.stdout.readline().strip()
            assert said == word, f"the trainer said {said!r}, not {word!r}:\n{errors.read_text()}"
            if word == "kill":
                service.kill()
            else:
                service = Service(node)
                wait_until(service.ready, timeout=90, what="the daemon to come back")
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
        out, _ = trainer.communicate(timeout=300)
    except BaseException:
        trainer.kill()
        trainer.wait()
        service.stop()
        raise
    assert trainer.returncode == 0, errors.read_text()
    stderr = errors.read_text()
    assert "not writable by uid" not in stderr and "Traceback" not in stderr, stderr
    return service, json.loads(out.strip().splitlines()[-1])


def _shards(count: int, samples: int) -> dict[str, bytes]:
    """WebDataset shards: shard ``s`` holds ``samples`` samples of class ``s``."""
    shards = {}
    for s in range(count):
        members: dict[str, bytes] = {}
        for i in range(samples):
            members[f"s{s:02d}_{i:03d}.cls"] = str(s).encode()
            members[f"s{s:02d}_{i:03d}.bin"] = os.urandom(2000)
        shards[f"shard-{s:04d}.tar"] = tar_of(members)
    return shards


@pytest.mark.timeout(600)  # two trainings and three daemon starts, on a machine others load
def test_a_job_user_of_the_group_trains_through_the_daemon_installed_as_shipped(
    node: Node, job_user: User, s3: Any
) -> None:
    payloads: dict[str, str] = {}
    for key, data in _shards(4, 5).items():  # a public dataset: the node's daemon reads it anonymously
        s3.client.put_object(Bucket=s3.name, Key=f"wds/{key}", Body=data, ACL="public-read")
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".bin"):
                    extracted = tar.extractfile(member)
                    assert extracted is not None
                    payloads[member.name[: -len(".bin")]] = hashlib.sha256(extracted.read()).hexdigest()

    # 1. install.sh, as root, names the job user: the accounts, the config, the unit, the prolog.
    installed = subprocess.run(
        ["bash", str(SLURM / "install.sh"), job_user.name],
        env=node.env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "datacache: node ready" in installed.stdout
    daemon_gid = grp.getgrnam(node.group).gr_gid
    job = User(name=job_user.name, uid=job_user.uid, gid=job_user.gid, groups=_login_groups(job_user.name))
    assert daemon_gid in job.groups and job.gid != daemon_gid  # a member by supplementary membership only

    # 2. The operator adds the one dataset line (the node's S3 endpoint; anonymous reads on this one).
    config = node.etc / "config.toml"
    line = (f'imagenet = {{ url = "{s3.url("wds")}/", readers = ["@{node.group}"], '
            f'storage_options = {{ endpoint_url = "{s3.server.endpoint}", anon = true }} }}')
    config.write_text(config.read_text() + line + "\n")

    # 3. The daemon, as systemd runs the unit.
    service = Service(node)
    try:
        wait_until(service.ready, timeout=90, what="the daemon to become ready")

        # 4. The prolog warms the dataset the job names (train.sbatch's --comment), in the order this
        #    node's ranks read it (the comment's seed and ranks per node; the node's place in the job).
        sbatch = (SLURM / "train.sbatch").read_text()
        comment = re.search(r"^#SBATCH --comment=datacache=(\S+)$", sbatch, re.M)
        assert comment is not None
        dataset, _, order = comment.group(1).partition(",")
        assert f"--data {dataset} --seed 17 " in sbatch  # the job reads the dataset the prolog warms, so dealt
        assert order == "seed=17,ranks_per_node=8" and "--nproc-per-node=8" in sbatch
        nodes = re.search(r"^#SBATCH --nodes=(\d+)$", sbatch, re.M)
        assert nodes is not None
        stubs = node.root / "stubs"
        stubs.mkdir()
        job_line = f"Comment=datacache={comment.group(1)} Reservation=(null)"
        hosts = "\n".join(f"gpu{n + 1:02d}" for n in range(int(nodes.group(1))))
        node_list = f"gpu[01-{int(nodes.group(1)):02d}]"
        (stubs / "scontrol").write_text(
            "#!/bin/bash\n"
            f'if [ "$2" = hostnames ]; then [ "$3" = "{node_list}" ] && printf "{hosts}\\n"; exit; fi\n'
            f"echo 'JobId=7 JobName=train'\necho '   ReqNodeList=(null) ExcNodeList=(null)'\n"
            f"echo '   NodeList={node_list}'\necho '   {job_line}'\n"
        )
        prolog_log = node.root / "prolog.log"
        (stubs / "logger").write_text(f'#!/bin/bash\necho "$@" >> {prolog_log}\n')
        for stub in stubs.iterdir():
            stub.chmod(0o755)
        prolog = subprocess.run(
            ["bash", str(node.prolog_dir / "datacache-prolog.sh")],
            env={"PATH": f"{stubs}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "gpu02",
                 "DATACACHE_BIN": str(node.prefix / "bin" / "datacache"), "DATACACHE_CONFIG": str(config),
                 "DATACACHE_USER": node.user},
            capture_output=True, text=True, timeout=300, check=False,
        )
        assert prolog.returncode == 0, prolog.stderr
        logged = prolog_log.read_text()
        assert "warmed" in logged, logged + service.log.read_text()
        world = 8 * int(nodes.group(1))
        assert f"--order-for seed=17,ranks_per_node=8,world_size={world},node_rank=1 " in logged, logged
        s3.server.reset_counts()

        # 5. The job, as a user of the group, with what train.sbatch exports.
        exported = dict(re.findall(r"^export (DATACACHE_\w+)=(\S+)$", sbatch, re.M))
        assert exported == {"DATACACHE_CONFIG": "/etc/datacache/config.toml"}
        env = _users.user_env(job, {"DATACACHE_CONFIG": str(config)})
        trained = run_as(job, [sys.executable, "-c", textwrap.dedent(_TRAIN), dataset], env=env, timeout=300)
        assert trained.returncode == 0, trained.stderr
        result = json.loads(trained.stdout.strip().splitlines()[-1])
        assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(4) for i in range(5))
        assert result["classes"] == [0, 1, 2, 3]
        # (Interpreter-exit noise from aiohttp's session finalizer is issue 24 item 15's, not checked here.)
        for failure in ("PermissionError", "DatacacheError", "refusing", "embedded"):
            assert failure not in trained.stderr, trained.stderr
        # Read through the daemon, from what the prolog warmed: the job fetched nothing from S3.
        assert not [k for k in s3.server.request_counts() if k.startswith("GET ")], s3.server.request_counts()
        # Everything on the node's cache is the daemon's, and nothing is open to others.
        for path in [node.local, *node.local.rglob("*")]:
            info = path.lstat()
            assert info.st_uid == service.uid, (path, info.st_uid)
            assert info.st_mode & 0o007 == 0, (path, oct(info.st_mode))
        assert (node.local / "catalog.sqlite").stat().st_mode & 0o077 == 0

        # 6. kill -9 of the daemon under a job, mid-epoch and at an epoch start, then systemd's restart
        # (Restart=on-failure): the job reads on, exactly once, and back through the daemon (issue 34 item 1).
        tmp = job.home / "tmp"
        tmp.mkdir(mode=0o700)
        os.chown(tmp, job.uid, job.gid)
        service, epochs = _train_through_outages(node, service, job, {**env, "TMPDIR": str(tmp)}, dataset)
        want = sorted([key, digest] for key, digest in payloads.items())
        for epoch, read in enumerate(epochs):
            assert sorted(read["seen"]) == want, f"epoch {epoch}: every sample once, every byte right"
        assert [read["mode"] for read in epochs] == [
            "embedded (daemon unavailable)", "embedded (daemon unavailable)", "daemon"
        ]
        for path in [node.local, *node.local.rglob("*")]:
            assert path.lstat().st_uid == service.uid, (path, path.lstat().st_uid)
    finally:
        service.stop()
    assert service.process.returncode == 0, service.log.read_text()

    # 7. With the daemon stopped, a job says so in one line (it cannot stage into the daemon's cache).
    warm = run_as(job, [sys.executable, "-m", "datacache.cli", "warm", dataset], env=env, timeout=120)
    lines = [line for line in warm.stderr.splitlines() if line.strip()]
    assert warm.returncode != 0 and len(lines) == 1, warm.stderr
    assert "not writable by uid" in lines[0] and "start the node's daemon" in lines[0], lines[0]


def _install(node: Node, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SLURM / "install.sh"), *args],
        env=env or node.env(), capture_output=True, text=True, timeout=120, check=False,
    )


def test_install_check_runs_the_venv_as_the_daemons_account_and_weighs_the_capacity_against_the_disk(
    node: Node,
) -> None:
    """Issue 34 item 5: "node ready", then the daemon failed with Permission denied; 3 TB on 67 GB said nothing."""
    installed = _install(node)
    assert installed.returncode == 0, installed.stdout + installed.stderr
    assert "datacache: node ready" in installed.stdout, installed.stdout

    config = node.etc / "config.toml"
    disk = shutil.disk_usage(node.local).total
    text = re.sub(r'^local_capacity = .*$', f'local_capacity = "{2 * disk}B"', config.read_text(), flags=re.M)
    config.write_text(text)
    checked = _install(node, "--check")
    assert checked.returncode == 0 and "datacache: node ready" in checked.stdout, checked.stdout
    assert "warning: local_capacity" in checked.stdout and "more than the filesystem" in checked.stdout, checked.stdout

    # Root may run the venv; the daemon's account may not (a venv made under a 0700 directory).
    (node.prefix / "bin" / "datacache").chmod(0o700)
    refused = _install(node, "--check")
    assert refused.returncode != 0, refused.stdout
    assert "node ready" not in refused.stdout
    assert f"cannot be run by {node.user}" in refused.stdout, refused.stdout


def test_the_unit_makes_the_socket_directory_the_config_names(node: Node) -> None:
    """Issue 34 item 5: DATACACHE_RUN_DIR went into the config, and the unit kept RuntimeDirectory=datacache."""
    name = f"dcr{node.user[3:]}"
    installed = _install(node, env={**node.env(), "DATACACHE_RUN_DIR": f"/run/{name}"})
    assert installed.returncode == 0, installed.stdout + installed.stderr
    unit = _unit(node.units / "datacache.service")
    socket_path = Path(tomllib.loads((node.etc / "config.toml").read_text())["daemon"]["socket"])
    assert unit["RuntimeDirectory"] == [name]
    assert socket_path.parent == Path("/run", name)
    assert not Path("/run", name).exists(), "systemd makes it at the unit's start, not install.sh"


@pytest.fixture
def second_job_user(node: Node) -> Iterator[User]:
    """Another researcher on the same node: their jobs share the node's daemon and the shared tier."""
    name = f"dck{node.user[3:]}"
    _users._admin(["useradd", "-M", "-d", str(node.root / name), "-s", "/usr/sbin/nologin", "-U", name])
    entry = pwd.getpwnam(name)
    home = node.root / name
    home.mkdir(mode=0o700)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    try:
        yield User(name=name, uid=entry.pw_uid, gid=entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True, check=False)
        subprocess.run(["groupdel", name], capture_output=True, check=False)


def _shard_gets(s3: Any) -> int:
    return sum(n for k, n in s3.server.request_counts().items() if k.startswith("GET ") and "shard-" in k)


def _private_origin(user: User) -> Path:
    """``user``'s own dataset, in a 0700 directory of theirs: the origin answers nobody else."""
    origin = user.home / "private"
    origin.mkdir()
    for key, data in _shards(2, 3).items():
        (origin / key).write_bytes(data)
    for path in (origin, *origin.iterdir()):
        os.chown(path, user.uid, user.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    return origin


def test_two_job_users_share_a_declared_dataset_and_keep_their_private_ones_apart(
    node: Node, job_user: User, second_job_user: User, s3: Any
) -> None:
    """Issue 33: the Slurm shape (one daemon, one shared tier, two job users of the daemon's group)."""
    for key, data in _shards(4, 5).items():
        s3.client.put_object(Bucket=s3.name, Key=f"wds/{key}", Body=data, ACL="public-read")
    installed = subprocess.run(
        ["bash", str(SLURM / "install.sh"), job_user.name, second_job_user.name],
        env=node.env(), capture_output=True, text=True, timeout=120, check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    alice, bob = (User(u.name, u.uid, u.gid, _login_groups(u.name)) for u in (job_user, second_job_user))
    config = node.etc / "config.toml"
    # The operator declares the one dataset the group shares: its copies are the group's.
    line = (f'common = {{ url = "{s3.url("wds")}/", readers = ["@{node.group}"], '
            f'storage_options = {{ endpoint_url = "{s3.server.endpoint}", anon = true }} }}')
    config.write_text(config.read_text() + line + "\n")
    service = Service(node)
    try:
        wait_until(service.ready, timeout=90, what="the daemon to become ready")
        gets = []
        for user in (alice, bob):
            s3.server.reset_counts()
            env = _users.user_env(user, {"DATACACHE_CONFIG": str(config)})
            trained = run_as(user, [sys.executable, "-c", textwrap.dedent(_TRAIN), "common"], env=env, timeout=300)
            assert trained.returncode == 0, trained.stderr
            assert len(json.loads(trained.stdout.strip().splitlines()[-1])["keys"]) == 20
            # The other reader's counts are not believed, but they are not a warning either (a trial's noise).
            assert "ignoring the cluster index file" not in trained.stderr, trained.stderr
            gets.append(_shard_gets(s3))
        # One copy for both: the daemon fetched each shard once, for the first user; the second read it.
        assert gets[0] >= 4 and gets[1] == 0, gets
        # Each user's private dataset, read in its own process (the daemon cannot read it), lands on
        # the shared tier as that user's alone, and the other user's process gets the origin's refusal.
        private = {user.name: _private_origin(user) for user in (alice, bob)}
        for user, other in ((alice, bob), (bob, alice)):
            env = _users.user_env(user, {"DATACACHE_CONFIG": str(config), "DATACACHE_LOCAL_DIR": str(user.home / "c")})
            warm = [sys.executable, "-m", "datacache.cli", "warm", "--no-daemon"]
            warmed = run_as(user, [*warm, str(private[user.name]), "--tier", "shared"], env=env, timeout=300)
            assert warmed.returncode == 0, warmed.stderr
            theirs = run_as(user, [*warm, str(private[other.name])], env=env, timeout=300)
            # The other's home is 0700: the path does not even resolve for this user.
            assert theirs.returncode != 0 and len(theirs.stderr.strip().splitlines()) == 1, theirs.stderr
        for user, other in ((alice, bob), (bob, alice)):
            copies = sorted((node.shared / "data" / dataset_id_for(str(private[user.name]))).iterdir())
            assert len(copies) == 2
            for copy in copies:
                assert copy.stat().st_uid == user.uid and copy.stat().st_mode & 0o077 == 0, copy
                peek = run_as(other, ["dd", f"if={copy}", "of=/dev/null", "bs=16", "count=1"])
                assert peek.returncode != 0, f"{other.name} read {user.name}'s private copy {copy}"
    finally:
        service.stop()
