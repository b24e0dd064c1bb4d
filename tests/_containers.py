"""Running the daemon's image for the tests: the engine, the image, a network namespace with an S3 server.

The engine is the one `make image` used (deploy/container-engine.sh: docker where its daemon
answers, else podman with runc). Each test that needs it skips with one line saying why where
none works, or where the image was not built (`make image`). podman here is told, through a
containers.conf of the tests' own (CONTAINERS_CONF), to use runc and rlimits no higher than the
host's, so that `podman kube play` and podman-compose, which take no such flags, run too.

The containers and the processes "outside" them share a network namespace the test makes
(`NetNS`): its loopback holds the S3 server (moto's, tests/s3server.py), the daemon's metrics
port (9464, the one the image's HEALTHCHECK asks) and nothing else, so tests run side by side.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGE = f"ghcr.io/datacache/datacache:{VERSION}"
BASE = "localhost/datacache-base:bookworm"
DAEMON_UID = 10001
LIMITS = ("nofile=4096:4096", "nproc=4096:4096")


@functools.cache
def _conf(directory: str) -> str:
    path = Path(directory) / f"datacache-tests-containers-{os.getpid()}.conf"
    quoted = ", ".join(json.dumps(limit) for limit in LIMITS)
    path.write_text(f'[containers]\ndefault_ulimits = [{quoted}]\n\n[engine]\nruntime = "runc"\n')
    return str(path)


@functools.cache
def _engine() -> tuple[tuple[str, ...], str | None]:
    """The engine's command words, or () and why there is none."""
    try:
        found = subprocess.run([str(DEPLOY / "container-engine.sh")], capture_output=True, text=True, timeout=120,
                               check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return (), f"no container engine: {exc}"
    if found.returncode != 0:
        return (), (found.stderr.strip().splitlines() or ["no container engine works here"])[-1]
    return tuple(found.stdout.split()), None


def engine_env() -> dict[str, str]:
    """The environment the engine runs with (podman: the tests' containers.conf)."""
    env = dict(os.environ)
    words, _ = _engine()
    if words and words[0] == "podman":
        env["CONTAINERS_CONF"] = _conf(os.environ.get("TMPDIR", "/tmp"))
    return env


def require_engine() -> tuple[str, ...]:
    """The engine's words; skip the test (one line, the reason) where none works or this is not root."""
    words, why = _engine()
    if why is not None:
        pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("the container tests run as root (a network namespace, users of their own)")
    return words


def require_image(image: str = IMAGE) -> tuple[str, ...]:
    """`require_engine`, and the image built (else skip: `make image` builds it)."""
    words = require_engine()
    if engine(["image", "inspect", image], check=False).returncode != 0:
        pytest.skip(f"{image} is not built here: make image")
    return words


def engine(argv: Sequence[str], *, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the engine with ``argv``; with ``check``, fail the test with its stderr."""
    words, why = _engine()
    if why is not None:
        pytest.skip(why)
    done = subprocess.run([*words, *argv], capture_output=True, text=True, timeout=timeout, check=False,
                          env=engine_env())
    if check and done.returncode != 0:
        raise AssertionError(f"{shlex.join([*words, *argv])} exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done


def engine_popen(argv: Sequence[str]) -> subprocess.Popen[str]:
    """Start the engine with ``argv`` in the background, its stdout and stderr piped (text)."""
    words, why = _engine()
    if why is not None:
        pytest.skip(why)
    return subprocess.Popen([*words, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=engine_env())


def run_flags() -> list[str]:
    """Flags every `run` takes here (rlimits no higher than the host's; harmless with docker)."""
    return [flag for limit in LIMITS for flag in ("--ulimit", limit)]


@dataclass
class NetNS:
    """A network namespace of the test's own, its loopback up; the S3 server inside it."""

    name: str = field(default_factory=lambda: f"dct-{uuid.uuid4().hex[:10]}")
    s3_port: int = 0
    _server: subprocess.Popen[bytes] | None = None

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3_port}"

    def prefix(self) -> list[str]:
        """The argv prefix that runs a command in the namespace (as root; drop to a user after it)."""
        return ["ip", "netns", "exec", self.name]

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True)
        subprocess.run([*self.prefix(), "ip", "link", "set", "lo", "up"], check=True, capture_output=True)
        self._server = subprocess.Popen([*self.prefix(), sys.executable, str(REPO / "tests" / "s3server.py")],
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self._server.stdout is not None
        line = self._server.stdout.readline().decode().strip()
        if not line.isdigit():
            raise AssertionError(f"the S3 server in {self.name} did not start (printed {line!r})")
        self.s3_port = int(line)

    def python(self, code: str, *args: str, timeout: float = 120) -> str:
        """Run ``code`` (as root) in the namespace, its stdout; AWS_* point at the namespace's S3 server."""
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": self.endpoint,
               "PYTHONPATH": str(REPO / "tests")}
        done = subprocess.run([*self.prefix(), sys.executable, "-c", code, *args], capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def seed(self, bucket: str, prefix: str, shards: dict[str, bytes], directory: Path) -> None:
        """A public bucket holding ``shards`` under ``prefix`` (written from files: argv stays small)."""
        directory.mkdir(parents=True, exist_ok=True)
        for key, data in shards.items():
            (directory / key).write_bytes(data)
        self.python(_SEED, bucket, prefix, str(directory))

    def gets(self, bucket: str, prefix: str) -> dict[str, int]:
        """GET requests per object under ``prefix`` since the server started."""
        counts: dict[str, int] = json.loads(self.python(_COUNTS, self.endpoint))
        start = f"GET /{bucket}/{prefix}"
        return {k.removeprefix("GET "): n for k, n in counts.items() if k.startswith(start)}

    def stop(self) -> None:
        if self._server is not None:
            self._server.kill()
            self._server.wait(timeout=30)
            if self._server.stdout is not None:
                self._server.stdout.close()
        subprocess.run(["ip", "netns", "delete", self.name], check=False, capture_output=True)


_SEED = """
import sys, boto3
from pathlib import Path
bucket, prefix, directory = sys.argv[1:]
s3 = boto3.client("s3")
s3.create_bucket(Bucket=bucket)
for path in sorted(Path(directory).iterdir()):
    s3.put_object(Bucket=bucket, Key=prefix + path.name, Body=path.read_bytes(), ACL="public-read")
"""

_COUNTS = """
import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1] + "/_counts", timeout=10).read().decode())
"""


@pytest.fixture
def netns() -> Iterator[NetNS]:
    require_engine()
    space = NetNS()
    space.start()
    try:
        yield space
    finally:
        space.stop()


class Containers:
    """The containers (and pods) a test started, removed at its end whatever happened."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.pods: list[str] = []

    def name(self, what: str) -> str:
        name = f"dct-{what}-{uuid.uuid4().hex[:8]}"
        self.names.append(name)
        return name

    def logs(self, name: str) -> str:
        done = engine(["logs", name], check=False)
        return done.stdout + done.stderr

    def inspect(self, name: str) -> dict[str, Any]:
        found: list[dict[str, Any]] = json.loads(engine(["inspect", name]).stdout)
        return found[0]

    def remove(self) -> None:
        for pod in self.pods:
            engine(["pod", "rm", "-f", pod], check=False)
        for name in self.names:
            engine(["rm", "-f", "-t", "0", name], check=False)


@pytest.fixture
def containers() -> Iterator[Containers]:
    started = Containers()
    try:
        yield started
    finally:
        started.remove()
