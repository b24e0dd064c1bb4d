"""The compose walk-through of deploy/docker-compose.yaml, end to end, with podman-compose.

The walk-through: the S3 server, the seed of 16 shards, the daemon, `warm` through its socket
from another container mounting the same volumes, and the daemon's metrics saying what it staged.
What the test changes, in a copy of the file and never in it: moto's image comes from no
registry here, so a local one is built from the Debian base and moto's wheels and tagged with
the file's name for it; the host ports are free ones (tests run side by side); the steps are run
one by one, each waiting for the last (podman-compose 1.0 starts services in order but does not
wait for `condition: service_healthy`); the image is the one `make image` built (no --build).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from _containers import BASE, DEPLOY, IMAGE, REPO, engine, engine_env, require_image
from _daemon import wait_until

pytestmark = pytest.mark.containers

COMPOSE = DEPLOY / "docker-compose.yaml"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _moto_image(name: str) -> None:
    """moto's server image, built here from the Debian base and wheels of moto (as the registry's runs it)."""
    if engine(["image", "inspect", name], check=False).returncode == 0:
        return
    wheels = REPO / "build" / "moto-wheels"
    made = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "-c", str(REPO / "constraints.txt"), "--wheel-dir",
         str(wheels), "moto[server]", "boto3"], capture_output=True, text=True, timeout=900, check=False)
    assert made.returncode == 0, made.stderr
    (wheels / "Containerfile").write_text(
        f"FROM {BASE}\n"
        "RUN --mount=type=bind,target=/wheels python3 -m venv /opt/moto"
        " && /opt/moto/bin/pip install --no-index --find-links /wheels 'moto[server]' boto3\n"
        "ENV PATH=/opt/moto/bin:/usr/bin:/bin\nEXPOSE 5000\n"
        'ENTRYPOINT ["moto_server", "-H", "0.0.0.0"]\n'
    )
    engine(["build", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "-f", str(wheels / "Containerfile"),
            "-t", name, str(wheels)], timeout=900)


def _adapted(tmp_path: Path) -> tuple[Path, int, int, str]:
    document: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    services = document["services"]
    assert services["datacache"]["image"] == services["warm"]["image"] == IMAGE
    s3_port, metrics_port = _free_port(), _free_port()
    services["s3"]["ports"] = [f"127.0.0.1:{s3_port}:5000"]
    services["datacache"]["ports"] = [f"127.0.0.1:{metrics_port}:9464"]
    del services["datacache"]["build"]  # the image `make image` built
    path = tmp_path / "docker-compose.yaml"
    path.write_text(yaml.safe_dump(document))
    return path, s3_port, metrics_port, services["s3"]["image"]


@pytest.mark.timeout(900)  # the first run builds moto's image (a few minutes, once)
def test_the_compose_walkthrough_seeds_serves_warms_and_counts(tmp_path: Path) -> None:
    words = require_image()
    if words[0] != "podman" or shutil.which("podman-compose") is None:
        pytest.skip("the compose walk-through runs with podman-compose (apt-get install podman-compose)")
    path, s3_port, metrics_port, moto = _adapted(tmp_path)
    _moto_image(moto if "." in moto.split("/")[0] else f"docker.io/{moto}")  # the name podman resolves it to
    project = f"dct{uuid.uuid4().hex[:8]}"

    def compose(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman-compose", "-p", project, "-f", str(path), *argv], capture_output=True,
                              text=True, timeout=timeout, check=False, env=engine_env(), cwd=tmp_path)

    def answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    try:
        started = compose("up", "-d", "s3")
        assert started.returncode == 0, started.stdout + started.stderr
        wait_until(lambda: answers(f"http://127.0.0.1:{s3_port}/moto-api/"), timeout=120, what="the S3 server")
        seeded = compose("run", "--rm", "seed")
        assert seeded.returncode == 0 and "seeded s3://datasets/demo-wds/ with 16 shards" in seeded.stdout, (
            seeded.stdout + seeded.stderr)
        served = compose("up", "-d", "datacache")
        assert served.returncode == 0, served.stdout + served.stderr
        wait_until(lambda: answers(f"http://127.0.0.1:{metrics_port}/readyz"), timeout=120, what="the daemon")
        warmed = compose("run", "--rm", "warm")
        assert warmed.returncode == 0, warmed.stdout + warmed.stderr
        done = json.loads([line for line in warmed.stdout.splitlines() if line.startswith("{")][-1])
        assert (done["complete"], done["shards_resident"]) == (True, 16), done
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        staged = [line for line in metrics.splitlines() if line.startswith("datacache_staged")]
        assert staged and any(float(line.rsplit(" ", 1)[1]) > 0 for line in staged), metrics
    finally:
        compose("down", "-v", "-t", "10", timeout=300)
