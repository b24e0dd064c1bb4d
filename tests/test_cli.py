"""The ``datacache`` command, run as real processes against the moto server and real files.

Covers the promises made to people and orchestrators: single-flight across
processes, kill -9 safety, integrity, origin changes, one-line errors,
redaction, endpoints, and the output of warm/ls/status/evict.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _helpers import (
    DATACACHE,
    REPO,
    checksum,
    fill_bucket,
    fill_dir,
    make_shards,
    partial_files,
    run_cli,
    tar_of,
    wait_for,
)
from datacache.loaders import CachedIterableDataset

from datacache.config import Settings, dataset_id_for
from datacache.errors import ShardNotFoundError

if TYPE_CHECKING:
    from conftest import S3Bucket

SECRET = "s3cr3t-Zq8Xv"
KEY_ID = "AKIAZQ8XVKEYID"


@pytest.fixture
def env(cache_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """A CLI environment: private cache dirs, no AWS settings from the machine."""
    clean = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    clean.update(
        {
            "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
            "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
            "PYTHONWARNINGS": "error::ResourceWarning",
        }
    )
    return clean


@pytest.fixture
def s3_env(env: dict[str, str], s3: S3Bucket) -> dict[str, str]:
    return {**env, **s3.server.env()}


def local_data(tmp_path: Path) -> Path:
    return tmp_path / "local" / "data"


def resident_files(root: Path) -> dict[str, bytes]:
    if not root.exists():
        return {}
    return {
        p.name: p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and not p.name.endswith(".partial")
    }


def catalog_states(tmp_path: Path) -> list[str]:
    path = tmp_path / "local" / "catalog.sqlite"
    if not path.exists():
        return []
    with sqlite3.connect(path) as connection:
        return [row[0] for row in connection.execute("SELECT state FROM shards")]


def object_gets(s3: S3Bucket, prefix: str) -> dict[str, int]:
    head = f"GET /{s3.name}/{prefix}/"
    return {
        k.removeprefix(head): v for k, v in s3.server.request_counts().items() if k.startswith(head)
    }


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The failure's stderr: exactly one line, starting 'datacache: error:'."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("datacache: error: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


# -- single-flight ------------------------------------------------------------------------------


def test_eight_concurrent_warms_fetch_each_part_once(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(4, 300_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    environment = {**s3_env, "DATACACHE_PART_SIZE": "100kB"}
    s3.server.reset_counts()
    processes = [
        subprocess.Popen(
            [*DATACACHE, "warm", s3.url("ds"), "--json"],
            env=environment,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    outputs = [process.communicate(timeout=180) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
        done = json.loads(stdout.strip().splitlines()[-1])
        assert done["event"] == "done" and done["complete"] is True
    # 300 kB in 100 kB parts: exactly 3 ranged GETs per object, across all 8 processes.
    assert object_gets(s3, "ds") == dict.fromkeys(shards, 3)
    assert s3.server.request_counts()[f"GET /{s3.name}"] == 1, "one listing for the node"
    transferred = sum(
        json.loads(out.strip().splitlines()[-1])["bytes_transferred"] for out, _ in outputs
    )
    assert transferred == 1_200_000, "the bytes were moved once in all"
    dataset = dataset_id_for(s3.url("ds"))
    assert resident_files(local_data(tmp_path) / dataset) == shards
    assert resident_files(tmp_path / "shared" / "data" / dataset) == shards


def test_nodes_sharing_a_shared_tier_fetch_each_part_once(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    """Four "nodes" (own local tier each, one shared tier): the shared tier's lease locks
    make one of them fetch each object; the others copy it from the shared tier."""
    shards = make_shards(4, 200_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    s3.server.reset_counts()
    processes = [
        subprocess.Popen(
            [*DATACACHE, "warm", s3.url("ds"), "-q"],
            env={
                **s3_env,
                "DATACACHE_PART_SIZE": "100kB",
                "DATACACHE_LOCAL_DIR": str(tmp_path / f"node-{node}"),
            },
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in range(4)
    ]
    outputs = [process.communicate(timeout=180) for process in processes]
    for process, (_, stderr) in zip(processes, outputs):
        assert process.returncode == 0, stderr
    assert object_gets(s3, "ds") == dict.fromkeys(shards, 2)
    dataset = dataset_id_for(s3.url("ds"))
    for node in range(4):
        assert resident_files(tmp_path / f"node-{node}" / "data" / dataset) == shards
    assert not list((tmp_path / "shared" / "locks").rglob("*.lock"))


# -- kill -9 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["local", "local+shared"])
def test_sigkill_mid_transfer_then_restart(
    tiers: str, s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(3, 1_000_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    environment = {**s3_env, "DATACACHE_PART_SIZE": "100kB"}
    if tiers == "local":
        del environment["DATACACHE_SHARED_DIR"]
    roots = (tmp_path / "local", tmp_path / "shared")
    data_roots = (tmp_path / "local" / "data", tmp_path / "shared" / "data")
    # A bandwidth cap makes the transfer last seconds, so that the kill lands in the middle of it.
    slow = subprocess.Popen(
        [*DATACACHE, "warm", s3.url("ds"), "--bandwidth", "400kB/s", "-q"],
        env=environment,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(
            lambda: any(p.stat().st_size > 0 for p in partial_files(*data_roots) if p.exists()),
            timeout=60,
            what="a partial shard file with bytes in it",
        )
    finally:
        slow.send_signal(signal.SIGKILL)
        slow.wait(timeout=30)
    assert slow.returncode == -signal.SIGKILL
    dataset = dataset_id_for(s3.url("ds"))
    # Whatever is visible under a shard's name is whole: only partial files hold partial bytes.
    for root in (local_data(tmp_path) / dataset, tmp_path / "shared" / "data" / dataset):
        for name, data in resident_files(root).items():
            assert data == shards[name]
    assert partial_files(*roots), "the kill left its temporary files (the restart must clean them)"

    result = run_cli(["warm", s3.url("ds")], environment)
    assert result.returncode == 0, result.stderr
    for name, data in resident_files(local_data(tmp_path) / dataset).items():
        assert checksum(data) == checksum(shards[name])
    assert resident_files(local_data(tmp_path) / dataset) == shards
    if tiers == "local+shared":
        assert resident_files(tmp_path / "shared" / "data" / dataset) == shards
    assert partial_files(*roots) == []
    assert catalog_states(tmp_path) == ["resident"] * 3, "no STAGING row survives the dead process"
    assert not list((tmp_path / "shared" / "locks").rglob("*.lock")), "no lock file left behind"


# -- integrity ----------------------------------------------------------------


def test_warm_verify_restages_a_corrupt_local_shard(tmp_path: Path, env: dict[str, str]) -> None:
    shards = make_shards(3, 20_000)
    origin = fill_dir(tmp_path / "origin", shards)
    run_cli(["warm", str(origin)], env, check=True)
    dataset = dataset_id_for(str(origin))
    victim = local_data(tmp_path) / dataset / "shard-0001.tar"
    data = bytearray(victim.read_bytes())
    data[1234] ^= 0x01
    victim.write_bytes(bytes(data))
    plain = run_cli(["warm", str(origin)], env, check=True)
    assert "transferred 0 bytes" in plain.stdout, "without --verify the (same-size) copy is trusted"
    result = run_cli(["warm", str(origin), "--verify", "--json"], env, check=True)
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done["complete"] is True
    assert done["shards_verified"] == 2
    assert done["shards_transferred"] == 1
    assert victim.read_bytes() == shards["shard-0001.tar"]


def test_warm_takes_the_loaders_brace_pattern(tmp_path: Path, env: dict[str, str]) -> None:
    """A new user warmed 'dir/shard-{0000..0001}.tar' as the README's loader reads it: "no objects"."""
    origin = fill_dir(tmp_path / "origin", make_shards(3, 20_000))
    result = run_cli(["warm", f"{origin}/shard-{{0000..0001}}.tar", "--json"], env, check=True)
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert (done["complete"], done["shards_requested"], done["dataset"]) == (True, 2, dataset_id_for(str(origin)))
    assert sorted(p.name for p in (local_data(tmp_path) / dataset_id_for(str(origin))).iterdir()) == [
        "shard-0000.tar",
        "shard-0001.tar",
    ]
    bad = run_cli(["warm", f"{origin}/shard-{{0000..}}.tar"], env)
    assert bad.returncode != 0 and "a pattern is" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_warm_names_a_pattern_that_matches_no_shard_as_the_loader_does(
    tmp_path: Path, env: dict[str, str], settings: Settings
) -> None:
    """It said `no shard 'shard-0100.tar' in its manifest`; the README says the error names the pattern."""
    origin = fill_dir(tmp_path / "origin", make_shards(3, 20_000))
    for pattern in (f"{origin}/shard-{{0100..0101}}.tar", f"{origin}/shard-{{0001..0004}}.tar"):
        result = run_cli(["warm", pattern], env)
        assert result.returncode != 0
        with pytest.raises(ShardNotFoundError) as caught:
            CachedIterableDataset(pattern, config=settings)  # refused when made, not at iter()
        assert result.stderr.splitlines() == [f"datacache: error: {caught.value}"], result.stderr
        assert pattern in result.stderr


def test_truncated_local_shard_is_noticed_without_verify(
    tmp_path: Path, env: dict[str, str]
) -> None:
    shards = make_shards(2, 20_000)
    origin = fill_dir(tmp_path / "origin", shards)
    run_cli(["warm", str(origin)], env, check=True)
    victim = local_data(tmp_path) / dataset_id_for(str(origin)) / "shard-0000.tar"
    victim.write_bytes(victim.read_bytes()[:-10])
    result = run_cli(["warm", str(origin)], env, check=True)
    assert "transferred 20.00 kB in 1 shard," in result.stdout
    assert victim.read_bytes() == shards["shard-0000.tar"]


# -- origin changes -----------------------------------------------------------


def test_changed_origin_object_fails_then_refresh_restages(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(2, 50_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    run_cli(["warm", s3.url("ds"), "--shards", "0:1"], s3_env, check=True)  # takes the manifest
    new = os.urandom(50_000)
    s3.put("ds/shard-0001.tar", new)
    result = run_cli(["warm", s3.url("ds")], s3_env)
    assert result.returncode == 1
    assert "changed at the origin" in result.stderr
    # What to do about it, in the same line: the user's fix was a new snapshot.
    changed = next(line for line in result.stderr.splitlines() if "changed at the origin" in line)
    assert "datacache warm --refresh" in changed, changed
    assert "warm incomplete: 1 of 2 shards" in result.stderr
    dataset = dataset_id_for(s3.url("ds"))
    assert "shard-0001.tar" not in resident_files(local_data(tmp_path) / dataset)
    assert "shard-0001.tar" not in resident_files(tmp_path / "shared" / "data" / dataset)
    refreshed = run_cli(["warm", s3.url("ds"), "--refresh"], s3_env, check=True)
    assert "2/2 shards resident" in refreshed.stdout
    assert resident_files(local_data(tmp_path) / dataset)["shard-0001.tar"] == new


# -- bad input ----------------------------------------------------------------


def assert_nothing_written(tmp_path: Path) -> None:
    assert resident_files(local_data(tmp_path)) == {}
    assert resident_files(tmp_path / "shared" / "data") == {}
    assert partial_files(tmp_path / "local", tmp_path / "shared") == []


def test_unknown_url_scheme(env: dict[str, str], tmp_path: Path) -> None:
    result = run_cli(["warm", "nosuch://bucket/x"], env)
    assert result.returncode == 2
    assert "unsupported URL scheme 'nosuch'" in one_error_line(result)
    assert_nothing_written(tmp_path)


def test_nonexistent_bucket(s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path) -> None:
    result = run_cli(["warm", "s3://no-such-bucket-9f3/ds"], s3_env)
    assert result.returncode == 1
    assert "bucket 'no-such-bucket-9f3' does not exist" in one_error_line(result)
    assert_nothing_written(tmp_path)


def test_nonexistent_prefix(s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path) -> None:
    s3.put("ds/a.tar", b"x")
    result = run_cli(["warm", s3.url("nope")], s3_env)
    assert result.returncode == 1
    line = one_error_line(result)
    assert f"no objects under {s3.url('nope')}" in line
    assert "bucket" not in line
    assert_nothing_written(tmp_path)


def test_nonexistent_local_directory(env: dict[str, str], tmp_path: Path) -> None:
    result = run_cli(["warm", str(tmp_path / "nowhere") + "/"], env)
    assert result.returncode != 0
    assert "nowhere" in one_error_line(result)
    assert_nothing_written(tmp_path)


def test_a_missing_local_path_is_said_in_the_same_words_by_the_cli_and_python(
    env: dict[str, str], tmp_path: Path, settings: Settings
) -> None:
    """`datacache warm` said "dataset nowhere-...: no objects under PATH (the prefix or directory is empty or does not
    exist)", `datacache shard` "nothing to shard at PATH (missing ...?)", CachedIterableDataset "PATH: no such file
    or directory": three wordings of one mistake."""
    missing = tmp_path / "nowhere"
    for given in (str(missing), f"file://{missing}"):
        with pytest.raises(ShardNotFoundError) as caught:
            CachedIterableDataset(given, config=settings)
        assert str(caught.value) == f"{given}: no such file or directory"
        for args in (["warm", given], ["shard", given, str(tmp_path / "out")]):
            result = run_cli(args, env)
            assert (result.returncode, result.stderr.splitlines()) == (1, [f"datacache: error: {caught.value}"])
    assert not (tmp_path / "out").exists()
    assert_nothing_written(tmp_path)


def test_missing_credentials(s3: S3Bucket, env: dict[str, str], tmp_path: Path) -> None:
    s3.put("ds/a.tar", b"x")
    no_credentials = {**env, "AWS_ENDPOINT_URL": s3.server.endpoint}
    result = run_cli(["warm", s3.url("ds")], no_credentials, timeout=120)
    assert result.returncode == 1
    assert "no credentials found" in one_error_line(result)
    # A glob is said as the mistake it is before the credentials are (they would not make it work).
    result = run_cli(["warm", s3.url("ds/*.tar")], no_credentials, timeout=120)
    assert result.returncode == 2  # a mistake in the command line, as the README's exit statuses say
    assert "a glob ('*', '?', '[') is not a pattern here" in one_error_line(result)
    assert_nothing_written(tmp_path)


def test_partial_credentials_never_echo_the_secret(
    s3: S3Bucket, env: dict[str, str], tmp_path: Path
) -> None:
    s3.put("ds/a.tar", b"x")
    partial = {**env, "AWS_ENDPOINT_URL": s3.server.endpoint, "AWS_SECRET_ACCESS_KEY": SECRET}
    result = run_cli(["warm", "-vv", s3.url("ds")], partial, timeout=120)
    assert result.returncode == 1
    assert SECRET not in result.stdout + result.stderr
    assert "credentials" in result.stderr


def test_object_key_escaping_the_cache(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    s3.put("ds/good.tar", b"fine")
    s3.put("ds/../../../escape.tar", b"evil")
    result = run_cli(["warm", s3.url("ds")], s3_env)
    assert result.returncode == 1
    line = one_error_line(result)
    assert "../../escape.tar" in line and "escape" in line
    assert_nothing_written(tmp_path)
    assert not list(tmp_path.rglob("escape.tar"))


def test_a_configured_dataset_name_takes_the_global_storage_options(
    s3: S3Bucket, env: dict[str, str], tmp_path: Path
) -> None:
    """The MinIO / on-prem set-up: the endpoint only in [storage_options.s3] (issue 24 item 4)."""
    fill_bucket(s3.client, s3.name, "wds", make_shards(2, 3_000))
    config = tmp_path / "config.toml"
    config.write_text(
        "[staging]\nmax_attempts = 1\n\n"
        f'[storage_options.s3]\nendpoint_url = "{s3.server.endpoint}"\nkey = "testing"\nsecret = "testing"\n\n'
        f'[datasets.x]\nurl = "{s3.url("wds")}/"\n'
    )
    with_config = {**env, "DATACACHE_CONFIG": str(config)}  # no AWS_* variables at all
    by_url = run_cli(["warm", f"{s3.url('wds')}/", "--quiet"], with_config)
    assert by_url.returncode == 0, by_url.stderr
    by_name = run_cli(["warm", "x", "--quiet", "--json"], with_config)
    assert by_name.returncode == 0, by_name.stderr
    assert json.loads(by_name.stdout.splitlines()[-1])["shards_resident"] == 2
    assert "testing" not in by_name.stdout + by_name.stderr


def test_warm_takes_the_dataset_id_ls_prints_as_evict_does(env: dict[str, str], tmp_path: Path) -> None:
    """`ls` prints ids and `evict <id>` takes one: so does `warm <id>` (issue 24 item 6)."""
    origin = fill_dir(tmp_path / "origin", make_shards(3, 2_000))
    run_cli(["warm", str(origin), "--quiet"], env, check=True)
    dataset_id = dataset_id_for(str(origin))
    assert dataset_id in run_cli(["ls"], env, check=True).stdout
    run_cli(["evict", dataset_id, "--tier", "local"], env, check=True)
    again = run_cli(["warm", dataset_id, "--json"], env)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.splitlines()[-1])["shards_resident"] == 3
    unknown = run_cli(["warm", "nothing-0123456789abcdef"], env)
    assert unknown.returncode == 2 and "unknown dataset" in one_error_line(unknown)


def test_a_glob_is_named_as_such_with_what_to_write_instead(env: dict[str, str], tmp_path: Path) -> None:
    """`s3://b/p/*.tar` said the prefix was empty (issue 24 item 7)."""
    origin = fill_dir(tmp_path / "origin", make_shards(2, 1_000))
    result = run_cli(["warm", f"{origin}/*.tar"], env)
    assert result.returncode != 0
    line = one_error_line(result)
    assert "a glob" in line and f"{origin}/)" in line and "{0000..0099}" in line, line
    assert "is empty" not in line
    # A new user's trial: "dataset tar-a873c5b6d9ab2d86: ..." named a dataset the user never named.
    assert line.startswith(f"datacache: error: {origin}/*.tar: "), line
    assert result.returncode == 2
    # A relative path (quoted, so the shell leaves the glob alone) was "unknown dataset", with no hint.
    relative = run_cli(["warm", "no-such-dir/*.tar"], env)
    assert relative.returncode == 2
    assert one_error_line(relative).startswith("datacache: error: no-such-dir/*.tar: a glob"), relative.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("spec", "meant"),
    [("s3:/shards/wds/", "s3://shards/wds/"), ("s3:shards/wds/", "s3://shards/wds/"), ("file:/data/wds", "file:///data/wds")],
)
def test_a_url_missing_a_slash_is_told_what_to_write(
    env: dict[str, str], tmp_path: Path, spec: str, meant: str
) -> None:
    """A trial's ``s3:/shards/wds/`` was "not a URL, not an existing path", with no word of the slash."""
    result = run_cli(["warm", spec], env)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert line.endswith(f"a URL needs '://' after its scheme ({meant})"), line
    assert_nothing_written(tmp_path)


def test_index_then_warm_refresh_is_the_snapshot_a_later_run_loads(env: dict[str, str], tmp_path: Path) -> None:
    """The index `datacache index` writes beside the shards makes a refresh a new snapshot (issue 24 item 11)."""
    shards = {f"shard-{s}.tar": tar_of({f"s{s}_{i}.cls": b"%d" % s for i in range(4)}) for s in range(3)}
    origin = fill_dir(tmp_path / "origin", shards)
    manifest = tmp_path / "local" / "manifests" / f"{dataset_id_for(str(origin))}.json"

    def snapshot() -> str:
        return str(json.loads(manifest.read_text())["snapshot"])

    run_cli(["warm", str(origin), "--quiet"], env, check=True)
    before = snapshot()
    run_cli(["index", str(origin)], env, check=True)
    assert (origin / "wids-index.json").exists()
    run_cli(["warm", str(origin), "--refresh", "--quiet"], env, check=True)
    after = snapshot()
    assert after != before
    later = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom datacache.loaders import CachedIterableDataset\n"
         "print(len(list(CachedIterableDataset(sys.argv[1]))))", str(origin)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )
    assert later.returncode == 0, later.stderr
    assert later.stdout.split()[0] == "12"
    plans = sorted(p.name for p in (tmp_path / "local" / "indexes").glob("*.json"))
    assert any(after in name for name in plans) and not any(before in name for name in plans), plans


def test_config_file_typo(env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[cache]\nlocal_capacty = '1GB'\n")
    result = run_cli(["warm", str(tmp_path)], {**env, "DATACACHE_CONFIG": str(config)})
    assert result.returncode == 2
    assert "unknown key 'cache.local_capacty' (did you mean 'local_capacity'?)" in one_error_line(
        result
    )
    assert_nothing_written(tmp_path)


def test_capacity_smaller_than_one_shard(tmp_path: Path, env: dict[str, str]) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(3, 50_000))
    result = run_cli(["warm", str(origin), "--local-capacity", "20kB"], env)
    assert result.returncode == 1
    line = one_error_line(result)
    assert "capacity (20.00 kB) is smaller than 3 of the requested shards" in line
    assert_nothing_written(tmp_path)


def test_unknown_datacache_variable(tmp_path: Path, env: dict[str, str]) -> None:
    result = run_cli(["status"], {**env, "DATACACHE_SHARD_DIR": "/x"})
    assert result.returncode == 0, result.stderr
    assert (
        "unknown environment variable DATACACHE_SHARD_DIR ignored (did you mean 'DATACACHE_SHARED_DIR'?)"
        in result.stderr
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["warm", "imagenet"], "unknown dataset 'imagenet'"),
        (["warm", "s3://AKIAXX:" + SECRET + "@bucket/ds"], "cannot carry credentials"),
        (["warm", "/x", "--local-capacity", "lots"], "--local-capacity"),
        (["warm", "/x", "--concurrency", "0"], "must be positive"),
        (["warm", "/x", "--local-capacity", "-5GB"], "--local-capacity: must not be negative, got '-5GB'"),
        (["plan", "--gpus", "2", "--per-gpu", "1GB/s", "--dataset", "-1TB"], "--dataset: must not be negative"),
        (["warm", "S3://bucket/ds/"], "write the scheme in lower case (s3://)"),
        (["warm"], "the following arguments are required: dataset"),
        (["warm", "/x", "--tier", "gpu"], "invalid choice: 'gpu'"),
    ],
)
def test_usage_errors(env: dict[str, str], tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli(args, env)
    assert result.returncode == 2
    assert message in one_error_line(result)
    assert SECRET not in result.stderr
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("spec", ["2:x", "1:2:3:4x", "a:b"])
def test_a_shards_spec_that_is_no_range_explains_the_start_stop_form(
    env: dict[str, str], tmp_path: Path, spec: str
) -> None:
    """`--shards 2:x` said only "no shard '2:x' in its manifest"."""
    origin = fill_dir(tmp_path / "origin", make_shards(3, 10))
    result = run_cli(["warm", str(origin), "--shards", spec], env)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert f"--shards {spec!r}" in line and "START:STOP[:STEP]" in line and "e.g. 0:100" in line, line
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [
        (["warm", "/x", "--local-capacty", "1GB"], "; did you mean --local-capacity?"),
        (["wram", "/x"], "; did you mean warm?"),
        (["status", "--jsn"], "; did you mean --json?"),
        (["serve", "--socet=/x"], "; did you mean --socket?"),
        (["top", "--once", "--intervl", "2"], "; did you mean --interval?"),
        (["warm", "/x", "--tier", "locl"], "; did you mean local?"),
        (["ls", "--jsn", "--local-dri", "/x"], "; did you mean --json or --local-dir?"),
    ],
)
def test_a_mistyped_option_or_verb_gets_a_suggestion(
    env: dict[str, str], tmp_path: Path, args: list[str], suggestion: str
) -> None:
    result = run_cli(args, env)
    assert result.returncode == 2
    assert one_error_line(result).endswith(f"{suggestion} (see 'datacache --help')"), result.stderr
    assert_nothing_written(tmp_path)


def test_an_unknown_option_like_no_other_gets_no_suggestion(env: dict[str, str]) -> None:
    line = one_error_line(run_cli(["status", "--zzzzzz"], env))
    assert line == "datacache: error: unrecognized option --zzzzzz (see 'datacache --help')", line


def test_a_mistyped_option_is_said_alone_not_with_its_value_and_what_follows(
    env: dict[str, str], tmp_path: Path
) -> None:
    """`warm URL --local-capasity 1GB x` said "unrecognized arguments: --local-capasity 1GB x; did you mean
    --local-capacity?": the guess, after a list of words two of which were no mistake of their own."""
    result = run_cli(["warm", str(tmp_path), "--local-capasity", "1GB", "x"], env)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "datacache: error: unrecognized option --local-capasity; did you mean --local-capacity? "
        "(see 'datacache --help')"
    ]
    extra = run_cli(["warm", str(tmp_path), "x"], env)  # no option mistyped: the words left over
    assert (extra.returncode, one_error_line(extra)) == (
        2, "datacache: error: unrecognized argument: x (see 'datacache --help')"
    )
    assert "unrecognized option -z " in one_error_line(run_cli(["status", "-z", "-5"], env))
    assert_nothing_written(tmp_path)


def test_shared_tier_required_for_tier_shared(env: dict[str, str], tmp_path: Path) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(1, 10))
    no_shared = {k: v for k, v in env.items() if k != "DATACACHE_SHARED_DIR"}
    result = run_cli(["warm", str(origin), "--tier", "shared"], no_shared)
    assert result.returncode == 2
    assert "--tier shared needs a shared tier" in one_error_line(result)


def test_origin_inside_the_cache_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    inside = fill_dir(tmp_path / "local" / "origin", make_shards(1, 10))
    result = run_cli(["warm", str(inside)], env)
    assert result.returncode == 2
    assert "lies inside the cache directory" in one_error_line(result)


# -- credentials never shown --------------------------------------------------


def test_secrets_never_appear_in_output_logs_or_cache_files(
    s3: S3Bucket, env: dict[str, str], tmp_path: Path
) -> None:
    fill_bucket(s3.client, s3.name, "ds", make_shards(2, 1000))
    config = tmp_path / "config.toml"
    config.write_text(
        f"""
[storage_options.s3]
endpoint_url = "{s3.server.endpoint}"
key = "{KEY_ID}"
secret = "{SECRET}"

[datasets.named]
url = "{s3.url("ds")}"
storage_options = {{ endpoint_url = "{s3.server.endpoint}", key = "{KEY_ID}", secret = "{SECRET}" }}
"""
    )
    environment = {**env, "DATACACHE_CONFIG": str(config)}
    runs = [
        run_cli(["warm", "-vv", s3.url("ds")], environment),
        run_cli(["warm", "-vv", "named", "--json"], environment),
        run_cli(["warm", "-vv", "--log-json", "named", "--verify"], environment),
        run_cli(["ls", "-vv"], environment),
        run_cli(["ls", "--json"], environment),
        run_cli(["status", "-vv"], environment),
        run_cli(["status", "--json"], environment),
        run_cli(["warm", "-vv", "s3://no-such-bucket-x/ds"], environment),
        run_cli(["warm", "-vv", f"s3://{KEY_ID}:{SECRET}@{s3.name}/ds"], environment),
        run_cli(["evict", "-vv", "named", "--tier", "all"], environment),
    ]
    assert [r.returncode for r in runs] == [0, 0, 0, 0, 0, 0, 0, 1, 2, 0], [r.stderr for r in runs]
    assert any("DEBUG" in r.stderr for r in runs), "-vv logs at debug level"
    for result in runs:
        for text in (result.stdout, result.stderr):
            assert SECRET not in text
            assert KEY_ID not in text
    for path in (tmp_path / "local").rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            assert SECRET.encode() not in content, path
            assert KEY_ID.encode() not in content, path


# -- output -------------------------------------------------------------------


def test_second_warm_transfers_nothing_and_says_so(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(3, 40_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    first = run_cli(["warm", s3.url("ds")], s3_env, check=True)
    assert re.search(
        r"3/3 shards resident \(120\.00 kB\); transferred 120\.00 kB in 3 shards", first.stdout
    )
    # Not a terminal: plain progress lines (none at all for work this short), no carriage
    # returns or escape codes.
    progress = [line for line in first.stderr.splitlines() if line]
    assert all(re.match(r"^warm \S+: \d+/3 shards, ", line) for line in progress), first.stderr
    assert "\r" not in first.stderr and "\x1b" not in first.stderr
    s3.server.reset_counts()
    second = run_cli(["warm", s3.url("ds")], s3_env, check=True)
    assert "3/3 shards resident" in second.stdout
    assert "transferred 0 bytes: everything was already resident" in second.stdout
    assert object_gets(s3, "ds") == {}, "no request to the origin at all"
    assert s3.server.request_counts() == {}


def test_warm_json_prints_progress_then_one_done_line_and_a_second_warm_moves_nothing(
    tmp_path: Path, env: dict[str, str]
) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(3, 30_000))
    result = run_cli(["warm", str(origin), "--json"], env, check=True)
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[-1]["event"] == "done"
    assert all(line["event"] == "progress" for line in lines[:-1])
    done = lines[-1]
    assert done["complete"] is True
    assert done["shards_requested"] == done["shards_resident"] == done["shards_transferred"] == 3
    assert done["bytes_transferred"] == done["bytes_requested"] == 90_000
    assert done["failures"] == []
    again = json.loads(
        run_cli(["warm", str(origin), "--json"], env, check=True).stdout.splitlines()[-1]
    )
    assert again["bytes_transferred"] == 0 and again["complete"] is True


def test_ls_status_evict(tmp_path: Path, env: dict[str, str]) -> None:
    shards = make_shards(4, 25_000)
    origin = fill_dir(tmp_path / "origin", shards)
    dataset = dataset_id_for(str(origin))
    empty = run_cli(["ls"], env, check=True)
    assert "no datasets yet" in empty.stdout
    run_cli(["warm", str(origin), "--shards", "0:2"], env, check=True)

    table = run_cli(["ls"], env, check=True).stdout
    assert dataset in table and "2/4 50%" in table
    rows = json.loads(run_cli(["ls", "--json"], env, check=True).stdout)
    assert rows == [
        {
            "dataset": dataset,
            "names": [],
            "url": str(origin),
            "format": "tar",
            "policy": "auto",
            "pinned": False,
            "shards": 4,
            "bytes": 100_000,
            "local_shards": 2,
            "local_bytes": 50_000,
            "shared_shards": 2,
            "shared_bytes": 50_000,
        }
    ]
    status = json.loads(run_cli(["status", "--json"], env, check=True).stdout)
    local, shared = status["tiers"]
    assert (local["tier"], local["used_bytes"], local["shards"]) == ("local", 50_000, 2)
    assert (shared["tier"], shared["used_bytes"], shared["shards"]) == ("shared", 50_000, 2)
    assert "local " in run_cli(["status"], env, check=True).stdout

    evicted = run_cli(["evict", dataset], env, check=True)
    assert "evicted 2 shards" in evicted.stdout
    assert resident_files(local_data(tmp_path) / dataset) == {}
    assert len(resident_files(tmp_path / "shared" / "data" / dataset)) == 2, "the shared copy stays"
    assert json.loads(run_cli(["ls", "--json"], env, check=True).stdout)[0]["local_shards"] == 0
    # Warming again copies from the shared tier, not the origin.
    rewarm = json.loads(
        run_cli(["warm", str(origin), "--json"], env, check=True).stdout.splitlines()[-1]
    )
    assert rewarm["bytes_transferred"] == 100_000 and rewarm["complete"]
    run_cli(["evict", str(origin), "--tier", "all", "--forget"], env, check=True)
    assert resident_files(local_data(tmp_path)) == {}
    assert resident_files(tmp_path / "shared" / "data") == {}
    assert "no datasets yet" in run_cli(["ls"], env, check=True).stdout
    missing = run_cli(["evict", str(origin)], env)
    assert missing.returncode == 2
    assert "has nothing cached" in one_error_line(missing)


def test_ls_shows_configured_names_beside_dataset_ids(tmp_path: Path, env: dict[str, str]) -> None:
    """A user warms `imagenet` and looks for `imagenet` in `ls`, not only for its id."""
    named = fill_dir(tmp_path / "origin", make_shards(2, 10_000))
    unnamed = fill_dir(tmp_path / "unnamed", make_shards(1, 5_000))
    config = tmp_path / "config.toml"
    config.write_text(f'[datasets.imagenet]\nurl = "{named}"\n')
    environment = {**env, "DATACACHE_CONFIG": str(config)}
    run_cli(["warm", "imagenet"], environment, check=True)
    run_cli(["warm", str(unnamed)], environment, check=True)
    named_id, unnamed_id = dataset_id_for(str(named)), dataset_id_for(str(unnamed))

    rows = {row["dataset"]: row for row in json.loads(run_cli(["ls", "--json"], environment, check=True).stdout)}
    assert rows[named_id]["names"] == ["imagenet"]
    assert rows[unnamed_id]["names"] == []
    table = run_cli(["ls"], environment, check=True).stdout.splitlines()
    assert table[0].split()[:2] == ["NAME", "DATASET"]
    assert next(line for line in table if named_id in line).split()[:2] == ["imagenet", named_id]
    assert next(line for line in table if unnamed_id in line).split()[:2] == ["-", unnamed_id]


def test_evict_all_without_a_shared_tier_evicts_local_and_succeeds(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """The README's `evict NAME --tier all` on a node with no shared tier (issue 12 item 6)."""
    local_only = {k: v for k, v in env.items() if k != "DATACACHE_SHARED_DIR"}
    origin = fill_dir(tmp_path / "origin", make_shards(2, 10_000))
    dataset = dataset_id_for(str(origin))
    run_cli(["warm", str(origin)], local_only, check=True)
    # --tier shared names a tier that is not there: refused before anything is evicted.
    shared = run_cli(["evict", str(origin), "--tier", "shared"], local_only)
    assert shared.returncode == 2
    assert "no shared tier is configured" in one_error_line(shared)
    assert len(resident_files(local_data(tmp_path) / dataset)) == 2
    # --tier all means every tier this node has: here, the local one.
    evicted = run_cli(["evict", str(origin), "--tier", "all"], local_only)
    assert evicted.returncode == 0, evicted.stderr
    assert "evicted 2 shards (20.00 kB)" in evicted.stdout
    assert resident_files(local_data(tmp_path) / dataset) == {}


# -- endpoints ----------------------------------------------------------------


@pytest.fixture
def endpoint_dataset(s3: S3Bucket) -> Iterator[dict[str, bytes]]:
    shards = make_shards(2, 5000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    s3.server.reset_counts()
    yield shards


@pytest.mark.parametrize(
    "how", ["AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL", "config storage_options", "dataset"]
)
def test_endpoint_configuration(
    how: str, s3: S3Bucket, endpoint_dataset: dict[str, bytes], env: dict[str, str], tmp_path: Path
) -> None:
    environment = {**env, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    target = s3.url("ds")
    if how in ("AWS_ENDPOINT_URL", "FSSPEC_S3_ENDPOINT_URL"):
        environment[how] = s3.server.endpoint
    else:
        config = tmp_path / "config.toml"
        if how == "config storage_options":
            config.write_text(f'[storage_options.s3]\nendpoint_url = "{s3.server.endpoint}"\n')
        else:
            config.write_text(
                f'[datasets.mine]\nurl = "{target}"\n'
                f'storage_options = {{ endpoint_url = "{s3.server.endpoint}" }}\n'
            )
            target = "mine"
        environment["DATACACHE_CONFIG"] = str(config)
    result = run_cli(["warm", target], environment)
    assert result.returncode == 0, result.stderr
    assert object_gets(s3, "ds") == dict.fromkeys(endpoint_dataset, 1), (
        "the bytes came from the moto server"
    )
    # However the endpoint is named, it is part of the identity, and one identity.
    dataset = dataset_id_for(s3.url("ds"), {"endpoint_url": s3.server.endpoint}, env={})
    assert resident_files(local_data(tmp_path) / dataset) == endpoint_dataset


@pytest.mark.parametrize("where", ["dataset", "config storage_options"])
def test_a_storage_option_typo_names_the_option_and_the_right_one(
    where: str, s3: S3Bucket, env: dict[str, str], tmp_path: Path
) -> None:
    """`endpoint` for `endpoint_url` (issue 12 item 10): one line naming both, exit 2, nothing staged."""
    config = tmp_path / "config.toml"
    if where == "dataset":
        config.write_text(
            f'[datasets.mine]\nurl = "{s3.url("ds")}"\n'
            f'storage_options = {{ endpoint = "{s3.server.endpoint}", secret = "{SECRET}" }}\n'
        )
        target = "mine"
    else:
        config.write_text(f'[storage_options.s3]\nendpoint = "{s3.server.endpoint}"\nsecret = "{SECRET}"\n')
        target = s3.url("ds")
    result = run_cli(["warm", target], {**env, "DATACACHE_CONFIG": str(config)})
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert "storage option 'endpoint'" in line and "did you mean 'endpoint_url'?" in line, line
    assert SECRET not in result.stderr + result.stdout
    assert resident_files(local_data(tmp_path)) == {}


# -- interrupts and terminals --------------------------------------------------------------------


def test_ctrl_c_mid_transfer_leaves_no_partial_file(
    s3: S3Bucket, s3_env: dict[str, str], tmp_path: Path
) -> None:
    shards = make_shards(3, 1_000_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    environment = {**s3_env, "DATACACHE_PART_SIZE": "100kB"}
    del environment["DATACACHE_SHARED_DIR"]
    roots = (tmp_path / "local",)
    data_roots = (tmp_path / "local" / "data",)
    process = subprocess.Popen(
        [*DATACACHE, "warm", s3.url("ds"), "--bandwidth", "400kB/s", "-q"],
        env=environment,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            lambda: any(p.stat().st_size > 0 for p in partial_files(*data_roots) if p.exists()),
            timeout=60,
            what="a partial shard file with bytes in it",
        )
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    # One line, and nothing from asyncio ("Future exception was never retrieved", issue 12 item 14).
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "datacache: interrupted; no partial file was left visible"
    ], stderr
    assert partial_files(*roots) == [], "cleaned up by the interrupted process itself"
    assert "staging" not in catalog_states(tmp_path)
    dataset = dataset_id_for(s3.url("ds"))
    for name, data in resident_files(local_data(tmp_path) / dataset).items():
        assert data == shards[name]


def test_output_into_a_closed_pipe_ends_silently(tmp_path: Path, env: dict[str, str]) -> None:
    """`datacache ls | head -3` printed `[Errno 32] Broken pipe` (issue 12 item 14)."""
    origin = fill_dir(tmp_path / "origin", make_shards(2, 1_000))
    run_cli(["warm", str(origin)], env, check=True)
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before the first line: every write meets EPIPE
    try:
        result = subprocess.run(
            [*DATACACHE, "ls"], env=env, cwd=REPO, stdout=writer, stderr=subprocess.PIPE, text=True,
            timeout=120, check=False,
        )
    finally:
        os.close(writer)
    assert result.stderr == "", result.stderr
    assert result.returncode == 141, "128 + SIGPIPE, as a process killed by the signal reports"


def test_progress_bar_on_a_terminal(tmp_path: Path, env: dict[str, str]) -> None:
    import pty

    origin = fill_dir(tmp_path / "origin", make_shards(3, 100_000))
    controller, terminal = pty.openpty()
    try:
        process = subprocess.Popen(
            [*DATACACHE, "warm", str(origin)],
            env={**env, "COLUMNS": "120"},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=terminal,
            text=True,
        )
        os.close(terminal)
        terminal = -1
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        stdout, _ = process.communicate(timeout=60)
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    shown = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 0, shown
    assert "3/3 shards resident" in stdout
    assert "\r" in shown, "a live bar redraws its line"
    assert "300k" in shown or "300.0k" in shown, shown
