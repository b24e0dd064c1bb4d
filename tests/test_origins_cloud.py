"""gs:// and az:// origins against real emulators: the tier contract, warm, the loader, version pinning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _emulators import AzureContainer, GcsBucket, azure, azurite_server, gcs, gcs_server
from datacache.tiers import ObjectTier, Tier
from datacache.tiers.testing import TierTests

__all__ = ["azure", "azurite_server", "gcs", "gcs_server"]  # fixtures, imported to be found


class TestGcsObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        bucket: GcsBucket = request.getfixturevalue("gcs")
        return ObjectTier(bucket.url("prefix/data"), storage_options=bucket.storage_options, writable=True)


class TestAzureObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        container: AzureContainer = request.getfixturevalue("azure")
        return ObjectTier(container.url("prefix/data"), storage_options=container.storage_options, writable=True)


# -- datacache warm, as a user runs it --------------------------------------------------------------


import json  # noqa: E402
import os  # noqa: E402

from _helpers import make_shards, run_cli  # noqa: E402

from datacache.config import dataset_id_for  # noqa: E402

Origin = GcsBucket | AzureContainer


@pytest.fixture(params=["gcs", "azure"])
def origin(request: pytest.FixtureRequest) -> Origin:
    bucket: Origin = request.getfixturevalue(request.param)
    return bucket


@pytest.fixture
def origin_env(cache_env: dict[str, str], tmp_path: Path, origin: Origin) -> dict[str, str]:
    """A CLI environment that reaches the emulator the way a user's would: the backend's own variables."""
    env = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_", "AZURE_", "STORAGE_EMULATOR"))}
    env.update(origin.server.env())
    if isinstance(origin, GcsBucket):
        env["FSSPEC_GS_TOKEN"] = "anon"  # fsspec's per-protocol defaults: no Google credentials for an emulator
    env.update({
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
        "PYTHONWARNINGS": "error::ResourceWarning",
    })
    return env


def data_reads(origin: Origin, key: str) -> int:
    """Reads of an object's bytes (not of its metadata) through the emulator's proxy."""
    if isinstance(origin, GcsBucket):
        return origin.server.proxy.reads(f"/download/storage/v1/b/{origin.name}/o/{key}")
    return origin.server.proxy.reads(f"/{origin.name}/{key}")


def test_warm_reads_each_shard_once_and_prints_no_credential(origin: Origin, origin_env: dict[str, str]) -> None:
    shards = make_shards(4, 50_000)
    for key, data in shards.items():
        origin.put(f"ds/{key}", data)
    origin.server.proxy.reset()
    result = run_cli(["warm", origin.url("ds"), "--json"], origin_env, check=True)
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done["complete"] is True and done["bytes_transferred"] == 200_000
    assert {key: data_reads(origin, f"ds/{key}") for key in shards} == dict.fromkeys(shards, 1)
    again = run_cli(["warm", origin.url("ds"), "--json"], origin_env, check=True)
    assert json.loads(again.stdout.strip().splitlines()[-1])["bytes_transferred"] == 0
    assert {key: data_reads(origin, f"ds/{key}") for key in shards} == dict.fromkeys(shards, 1)
    output = result.stdout + result.stderr + again.stdout + again.stderr
    secret = origin_env.get("AZURE_STORAGE_CONNECTION_STRING", "")
    assert "AccountKey" not in output and (not secret or secret.split("AccountKey=")[1][:20] not in output)


def test_an_object_rewritten_after_the_manifest_is_refused(origin: Origin, origin_env: dict[str, str]) -> None:
    shards = make_shards(2, 30_000)
    for key, data in shards.items():
        origin.put(f"ds/{key}", data)
    run_cli(["warm", origin.url("ds"), "--shards", "0:1"], origin_env, check=True)  # takes the manifest
    origin.put("ds/shard-0001.tar", os.urandom(30_000))  # same size, new generation / ETag
    result = run_cli(["warm", origin.url("ds")], origin_env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "changed at the origin" in result.stderr
    refreshed = run_cli(["warm", origin.url("ds"), "--refresh"], origin_env, check=True)
    assert "2/2 shards resident" in refreshed.stdout


def test_a_corrupted_cached_copy_is_read_again_from_the_origin(
    origin: Origin, origin_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(3, 20_000)
    for key, data in shards.items():
        origin.put(f"ds/{key}", data)
    run_cli(["warm", origin.url("ds")], origin_env, check=True)
    victim = next((tmp_path / "local").rglob("shard-0001.tar"))
    damaged = bytearray(victim.read_bytes())
    damaged[1234] ^= 0x01
    victim.write_bytes(bytes(damaged))
    for shared in (tmp_path / "shared").rglob("shard-0001.tar"):
        shared.write_bytes(bytes(damaged))  # the shared copy too: only the origin has good bytes
    origin.server.proxy.reset()
    result = run_cli(["warm", origin.url("ds"), "--verify", "--json"], origin_env, check=True)
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done["complete"] is True
    assert victim.read_bytes() == shards["shard-0001.tar"]
    assert {key: data_reads(origin, f"ds/{key}") for key in shards} == {
        "shard-0000.tar": 0, "shard-0001.tar": 1, "shard-0002.tar": 0
    }
    assert dataset_id_for(origin.url("ds"))  # the id is derived from the origin, as for S3


@pytest.mark.parametrize("size", [1000, 6 << 20], ids=["single-part", "multipart"])
def test_s3_put_reads_metadata_once_the_chunks_are_consumed(request: pytest.FixtureRequest, size: int) -> None:
    """`Tier.put` contract: metadata is read when the chunks are exhausted (a checksum learned at the end)."""
    import asyncio

    bucket = request.getfixturevalue("s3")
    tier = ObjectTier(bucket.url("p"), storage_options=bucket.storage_options, writable=True, part_size=5 << 20)
    metadata: dict[str, str] = {}

    async def produce() -> Any:
        data = os.urandom(size)
        for start in range(0, size, 1 << 20):
            yield data[start : start + (1 << 20)]
        metadata["checksum"] = "learned-at-the-end"

    async def body() -> None:
        try:
            await tier.put("late", produce(), metadata=metadata)
        finally:
            await tier.close()

    asyncio.run(body())
    head = bucket.client.head_object(Bucket=bucket.name, Key="p/late")
    assert head["Metadata"] == {"checksum": "learned-at-the-end"}
    assert head["ContentLength"] == size
