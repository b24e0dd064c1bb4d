"""Shared fixtures: a real S3 server (moto) on 127.0.0.1, isolated cache settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from datacache.config import Settings, load_settings

HERE = Path(__file__).parent


@dataclass
class S3Server:
    """The moto server started for this test session."""

    endpoint: str
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """Environment variables that point boto/s3fs at this server, with dummy credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def request_counts(self) -> dict[str, int]:
        with urllib.request.urlopen(f"{self.endpoint}/_counts", timeout=10) as response:
            counts: dict[str, int] = json.loads(response.read())
        return counts

    def reset_counts(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/_counts", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=10).close()

    def reset(self) -> None:
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=10).close()
        self.reset_counts()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    process = subprocess.Popen(
        [sys.executable, str(HERE / "s3server.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    line = process.stdout.readline().decode().strip()
    if not line.isdigit():
        process.kill()
        raise RuntimeError(f"the S3 server did not start (printed {line!r})")
    server = S3Server(endpoint=f"http://127.0.0.1:{line}", process=process)
    try:
        yield server
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()


@dataclass
class S3Bucket:
    """A fresh bucket on the session's server, with a boto3 client to fill it."""

    server: S3Server
    name: str
    client: Any

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.server.endpoint, "key": "testing", "secret": "testing"}

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.name}/{prefix}".rstrip("/")

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Bucket]:
    """An empty bucket on a freshly reset server; AWS_* variables point at it."""
    import boto3

    s3_server.reset()
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1")
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    s3_server.reset_counts()
    try:
        yield S3Bucket(server=s3_server, name=name, client=client)
    finally:
        client.close()


@pytest.fixture
def cache_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose per-user directories are inside the test's tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
    env["HOME"] = str(tmp_path / "home")
    env["XDG_CACHE_HOME"] = str(tmp_path / "home" / ".cache")
    env["XDG_CONFIG_HOME"] = str(tmp_path / "home" / ".config")
    return env


@pytest.fixture
def settings(tmp_path: Path, cache_env: dict[str, str]) -> Settings:
    """Settings with a local and a shared tier under tmp_path."""
    return load_settings(
        cache_env,
        overrides={"local_dir": str(tmp_path / "local"), "shared_dir": str(tmp_path / "shared")},
    )


# `make test` runs three test processes (pytest-xdist, `--dist loadgroup`). Each module is one group, so
# its module-scoped fixtures start once, as in a serial run. Modules that start a Ray instance share
# one group: two on one machine at once meet in /tmp/ray and each misses Ray's fixed 30 s for a node
# to register. The container modules share one too (one engine's storage, one image).
_ONE_AT_A_TIME = {
    "test_loader_remote": "ray",
    "test_shard": "ray",
    "test_container_daemon": "containers",
    "test_container_pods": "containers",
    "test_container_compose": "containers",
}


# The groups that take longest (`--durations` of a whole run), started first: a process given the
# last big group while the other has nothing left made CI's run a minute longer than its tests.
_LONGEST_FIRST = (
    "ray",
    "test_docs-0",
    "test_docs-1",
    "test_cli",
    "test_top",
    "test_trust_shared_tier_writers",
    "test_outage_multiuser",
    "test_outage_distributed",
    "test_deploy_slurm",
    "test_loader_distributed",
    "containers",
    "test_cli_daemon",
    "test_plan_contract",
    "test_eviction_node",
)


def _group(item: pytest.Item, index: int) -> str:
    module = item.module.__name__.rpartition(".")[2] if item.module else item.nodeid
    if module == "test_docs":
        # Each block runs on its own (a fresh folder, a fresh process): two halves, so one process
        # is not left with every documented recipe. A block that starts Ray is in Ray's group.
        block = getattr(item, "callspec", None) and item.callspec.params.get("block")
        if block is not None and "Ray" in getattr(block, "text", ""):
            return "ray"
        return f"test_docs-{index % 2}"
    return _ONE_AT_A_TIME.get(module, module)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for index, item in enumerate(items):
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(item, index)))
    rank = {group: place for place, group in enumerate(_LONGEST_FIRST)}

    def place(item: pytest.Item) -> int:
        marker = item.get_closest_marker("xdist_group")
        name = marker.args[0] if marker is not None and marker.args else marker.kwargs.get("name") if marker else None
        return rank.get(str(name), len(rank))

    items.sort(key=place)
