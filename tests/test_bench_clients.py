"""`benchmarks.clients` runs end to end on a few small objects (the optional clients only where installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from benchmarks.clients import measure, table

if TYPE_CHECKING:
    from conftest import S3Bucket

SETS = [("large", 2, 2 << 20), ("small", 3, 256 << 10)]


def test_the_clients_benchmark_measures_datacache_and_boto3(s3: S3Bucket, tmp_path: Path) -> None:
    result = measure(
        SETS,
        1,
        ["datacache", "datacache-tier", "datacache-parts", "boto3"],
        endpoint=s3.server.endpoint,
        scratch=tmp_path,
    )
    assert result["errors"] == {}
    large, small = result["figures"]["large"], result["figures"]["small"]
    assert set(large) == {"datacache", "datacache-tier", "datacache-parts", "boto3"}
    assert set(small) == {"datacache", "datacache-tier", "boto3"}  # the parts path needs objects larger than a part
    for modes in (*large.values(), *small.values()):
        assert len(modes["landed"]["mb_per_s"]) == 1
        assert modes["landed"]["mb_per_s"][0] > 0
    assert large["datacache"]["arrive"]["cpu_per_gb"][0] > 0
    assert "| datacache |" in table(result)


@pytest.mark.parametrize(("client", "module"), [("obstore", "obstore"), ("crt", "s3torchconnectorclient")])
def test_an_optional_client_runs_where_installed(s3: S3Bucket, tmp_path: Path, client: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (the bench extra)")
    result = measure(SETS[:1], 1, [client], endpoint=s3.server.endpoint, scratch=tmp_path)
    assert result["errors"] == {}
    assert result["figures"]["large"][client]["landed"]["mb_per_s"][0] > 0
