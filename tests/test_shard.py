"""`datacache shard`: plans, tar round trips, resume after kill -9, engines, Parquet and Zarr."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import re
import signal
import subprocess
import sys
import tarfile
import time
import warnings
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from _helpers import run_cli
from datacache.tiers import ObjectInfo

from datacache.checksum import checksum_of, new_hasher
from datacache.cli import main
from datacache.counting.tarindex import INDEX_SUFFIX, group_samples, index_from_json, scan_tar
from datacache.errors import ConfigError, InvalidKeyError
from datacache.manifest import MANIFEST_NAME, Manifest
from datacache.shard import (
    DONE_PREFIX,
    PLAN_NAME,
    Endpoint,
    ShardOptions,
    ShardReport,
    plan_tar,
    shard_dataset,
)

T = TypeVar("T")
Samples = dict[str, dict[str, bytes]]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def payload(seed: str, size: int) -> bytes:
    rng = random.Random(seed)
    return rng.randbytes(size)


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for key, data in files.items():
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def image_tree(classes: int = 2, per_class: int = 40) -> dict[str, bytes]:
    """``cls/0000.jpg`` + ``cls/0000.json`` pairs of a few hundred bytes."""
    files: dict[str, bytes] = {}
    for c in range(classes):
        for i in range(per_class):
            key = f"class{c}/{i:04d}"
            files[f"{key}.jpg"] = payload(key, 200 + (i * 37) % 900)
            files[f"{key}.json"] = json.dumps({"class": c, "index": i}).encode()
    return files


def expected_samples(files: dict[str, bytes]) -> Samples:
    samples: Samples = {}
    for key, data in files.items():
        directory, _, name = key.rpartition("/")
        stem, _, extension = name.partition(".")
        sample = f"{directory}/{stem}" if directory else stem
        samples.setdefault(sample, {})[extension.lower()] = data
    return samples


def shard_paths(dst: Path) -> list[Path]:
    return sorted(dst.glob("*.tar"))


def read_webdataset(dst: Path) -> Samples:
    import webdataset as wds

    samples: Samples = {}
    with warnings.catch_warnings():
        # webdataset 1.0.2 leaves its last file to the garbage collector (a ResourceWarning).
        warnings.simplefilter("ignore", ResourceWarning)
        dataset = wds.WebDataset([str(p) for p in shard_paths(dst)], shardshuffle=False)
        for sample in dataset:
            key = sample["__key__"]
            assert key not in samples, f"sample {key} read twice"
            samples[key] = {k: v for k, v in sample.items() if not k.startswith("__")}
        del dataset
        gc.collect()
    return samples


def read_tarindex(dst: Path) -> Samples:
    """Read every sample by scanning each shard, and check that its .idx.json says the same."""
    samples: Samples = {}
    for path in shard_paths(dst):
        data = path.read_bytes()
        scanned = group_samples(scan_tar(data, where=str(path)))
        size, indexed = index_from_json((dst / (path.name + INDEX_SUFFIX)).read_bytes(), where=path.name)
        assert size == len(data)
        assert indexed == scanned
        for span in scanned:
            assert span.key not in samples
            samples[span.key] = {ext: data[offset : offset + n] for ext, offset, n in span.fields}
    return samples


def load_manifest(dst: Path) -> Manifest:
    return Manifest.from_json(json.loads((dst / MANIFEST_NAME).read_bytes()), "test")


def check_manifest(dst: Path) -> Manifest:
    """Every shard the manifest names exists with the recorded size, checksum and sample count."""
    manifest = load_manifest(dst)
    for shard in manifest.shards:
        data = (dst / shard.key).read_bytes()
        hasher = new_hasher()
        hasher.update(data)
        assert len(data) == shard.size
        assert checksum_of(hasher) == shard.checksum
        if shard.key.endswith(".tar"):
            assert shard.samples == len(group_samples(scan_tar(data)))
    return manifest


def output_files(dst: Path) -> dict[str, bytes]:
    """Every file of an output except the manifest (whose url names the output)."""
    return {
        str(p.relative_to(dst)): p.read_bytes()
        for p in sorted(dst.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def shard_local(src: Path, dst: Path, **options: Any) -> ShardReport:
    engine = options.pop("engine", "local")
    return run(shard_dataset(Endpoint(str(src)), Endpoint(str(dst)), ShardOptions(**options), engine=engine))


# -- the plan -----------------------------------------------------------------------------


def test_plan_is_a_pure_function_of_the_listing_and_options() -> None:
    infos = [ObjectInfo(f"d/{i:03d}.{ext}", 100 + i, f"v{i}") for i in range(50) for ext in ("jpg", "txt")]
    shuffled = infos[:]
    random.Random(3).shuffle(shuffled)
    options = ShardOptions(shard_size=4096)
    first, second = plan_tar(infos, options), plan_tar(shuffled, options)
    assert first == second
    assert first.digest == second.digest
    assert len(first.units) > 3
    assert [u.key for u in first.units] == [f"shard-{i:06d}.tar" for i in range(len(first.units))]
    # every shard fits (no sample is larger than a shard here) and each object is in exactly one
    assert all(u.size is not None and u.size <= 4096 for u in first.units)
    assert sum(u.objects for u in first.units) == 100
    assert plan_tar(infos, ShardOptions(shard_size=8192)).digest != first.digest
    changed = [*infos[:-1], ObjectInfo(infos[-1].key, infos[-1].size, "other-version")]
    replanned = plan_tar(changed, options)
    assert [u.digest for u in replanned.units[:-1]] == [u.digest for u in first.units[:-1]]
    assert replanned.units[-1].digest != first.units[-1].digest


def test_plan_rejects_dotdot_keys_and_reports_files_without_extension() -> None:
    with pytest.raises(InvalidKeyError, match=r"\.\."):
        plan_tar([ObjectInfo("a/../b.jpg", 1)], ShardOptions())
    plan = plan_tar([ObjectInfo("a/README", 3), ObjectInfo("a/x.jpg", 3)], ShardOptions())
    assert plan.skipped == ("a/README",)
    assert plan.samples == 1


def test_plan_errors_name_the_problem() -> None:
    with pytest.raises(ConfigError, match="two files for field 'jpg'"):
        plan_tar([ObjectInfo("a/x.jpg", 1), ObjectInfo("a/x.JPG", 1)], ShardOptions())
    with pytest.raises(ConfigError, match="does not match"):
        plan_tar([ObjectInfo("a/x.jpg", 1)], ShardOptions(group_by=r"^zzz(\d+)"))
    with pytest.raises(ConfigError, match="needs a group"):
        ShardOptions(label="^[^/]+/")
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        ShardOptions(group_by="(")


# -- tar round trips ----------------------------------------------------------------------


def test_round_trip_through_webdataset_and_tarindex(tmp_path: Path) -> None:
    files = image_tree()
    write_tree(tmp_path / "src", files)
    report = shard_local(tmp_path / "src", tmp_path / "dst", shard_size=8_000)
    dst = tmp_path / "dst"
    expected = expected_samples(files)
    assert report.units == len(shard_paths(dst)) > 3
    assert report.written == report.units and report.kept == 0
    assert report.objects == len(files) and report.samples == len(expected)
    assert read_webdataset(dst) == expected
    assert read_tarindex(dst) == expected
    manifest = check_manifest(dst)
    assert manifest.format.value == "tar"
    assert manifest.total_samples == len(expected)
    assert [s.key for s in manifest.shards] == [p.name for p in shard_paths(dst)]
    # shards are cut at the target size, never splitting a sample
    assert all(s.size <= 8_000 for s in manifest.shards)
    # fixed tar header fields: no timestamps or owners leak into the shards
    with tarfile.open(shard_paths(dst)[0]) as archive:
        for member in archive.getmembers():
            assert (member.mtime, member.uid, member.gid, member.uname, member.gname, member.mode) == (
                0, 0, 0, "", "", 0o644,
            )


def test_rerun_keeps_verified_shards_and_repacks_a_corrupt_one(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", image_tree(per_class=20))
    first = shard_local(tmp_path / "src", tmp_path / "dst", shard_size=6_000)
    before = output_files(tmp_path / "dst")
    again = shard_local(tmp_path / "src", tmp_path / "dst", shard_size=6_000)
    assert (again.written, again.kept) == (0, first.units)
    victim = tmp_path / "dst" / "shard-000001.tar"
    data = bytearray(victim.read_bytes())
    data[700] ^= 0xFF  # same size, different bytes
    victim.write_bytes(bytes(data))
    repaired = shard_local(tmp_path / "src", tmp_path / "dst", shard_size=6_000)
    assert (repaired.written, repaired.kept) == (1, first.units - 1)
    assert output_files(tmp_path / "dst") == before


def test_a_rerun_over_a_changed_source_removes_only_the_shards_it_no_longer_writes(tmp_path: Path) -> None:
    """The earlier run's extra shards stayed in DST beside the new manifest: a reader listing DST saw them."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = image_tree(per_class=20)
    write_tree(src, files)
    first = shard_local(src, dst, shard_size=6_000)
    (dst / "notes.txt").write_text("the user's own")
    (dst / "shard-000099.tar").write_bytes(b"not written by datacache shard")
    for key in sorted(files)[len(files) // 3 :]:  # two thirds of the source go away
        (src / key).unlink()
    second = shard_local(src, dst, shard_size=6_000)
    assert second.units < first.units
    units = {shard.key for shard in check_manifest(dst).shards}
    assert {p.name for p in dst.glob("*.tar")} == units | {"shard-000099.tar"}
    assert {p.name for p in dst.glob("*" + INDEX_SUFFIX)} == {key + INDEX_SUFFIX for key in units}
    assert {p.name for p in (dst / DONE_PREFIX).iterdir()} == {f"{key}.json" for key in units}
    assert (dst / "notes.txt").read_text() == "the user's own"
    assert second.samples == len(files) // 3 // 2  # the samples (a .jpg and a .json each) left
    assert second.removed == first.units - second.units > 0  # the run said nothing of them
    assert second.to_json()["shards_removed"] == second.removed


def test_a_rerun_says_what_it_changed_of_an_earlier_output_and_that_caches_need_a_refresh(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """A rerun removed or rewrote an earlier run's shards silently (README: readers need `warm --refresh`), and
    said "changed units are packed again" at WARNING beside a summary of "0 written": no unit had changed."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    files = image_tree(per_class=20)
    write_tree(src, files)
    shard = ["shard", str(src), str(dst), "--shard-size", "6kB", "-q"]
    first = run_cli(shard, cache_env, check=True)
    assert "earlier run" not in first.stdout and "--refresh" not in first.stdout
    assert run_cli(["warm", str(dst), "-q"], cache_env).returncode == 0  # a cache holds these shards
    last = load_manifest(dst).shards[-1].key
    with tarfile.open(dst / last) as tar:
        gone = {name.rsplit(".", 1)[0] for name in tar.getnames()}
    for key in files:
        if key.rsplit(".", 1)[0] in gone:  # the last shard's samples: no other shard changes
            (src / key).unlink()
    second = run_cli(shard, cache_env, check=True)
    assert re.search(r"\(0 written, \d+ kept after verifying; of an earlier run's shards, 1 removed\)", second.stdout)
    assert "packed again" not in second.stderr, second.stderr  # nothing was
    hint = f"readers of a cache that holds the earlier shards of {dst}: run `datacache warm --refresh {dst}` first"
    assert second.stdout.splitlines()[1:] == [hint]
    assert run_cli(shard, cache_env, check=True).stdout.count("\n") == 1  # nothing changed: no hint
    third = run_cli([*shard[:-3], "--shard-size", "9kB", "-q"], cache_env, check=True)
    assert re.search(r"; of an earlier run's shards, \d+ rewritten and \d+ removed\)", third.stdout), third.stdout
    assert third.stdout.splitlines()[1:] == [hint]
    # The hint is the fix: the refreshed snapshot reads the new shards, every one resident.
    command = re.search(r"`datacache (.*)`", hint)
    assert command is not None
    refreshed = run_cli(command.group(1).split(), cache_env)
    assert refreshed.returncode == 0, refreshed.stderr
    assert f"{len(load_manifest(dst).shards)}/{len(load_manifest(dst).shards)} shards resident" in refreshed.stdout


def test_output_is_deterministic(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", image_tree(per_class=15))
    shard_local(tmp_path / "src", tmp_path / "a", shard_size=5_000, workers=1)
    shard_local(tmp_path / "src", tmp_path / "b", shard_size=5_000, workers=3, concurrency=2)
    assert output_files(tmp_path / "a") == output_files(tmp_path / "b")
    first, second = load_manifest(tmp_path / "a"), load_manifest(tmp_path / "b")
    assert first.shards == second.shards and first.extra == second.extra


def test_multi_file_samples_with_group_by(tmp_path: Path) -> None:
    files = {
        f"rec/{i:03d}_{field}": payload(f"{i}{field}", 50 + i)
        for i in range(12)
        for field in ("image.png", "meta.json", "audio.flac")
    }
    write_tree(tmp_path / "src", files)
    report = shard_local(tmp_path / "src", tmp_path / "dst", group_by=r"^(.*/\d+)_", shard_size=2_000)
    assert report.samples == 12
    expected = {
        f"rec/{i:03d}": {f: files[f"rec/{i:03d}_{f}"] for f in ("image.png", "meta.json", "audio.flac")}
        for i in range(12)
    }
    assert read_webdataset(tmp_path / "dst") == expected
    assert read_tarindex(tmp_path / "dst") == expected


def test_labels_from_a_path_pattern(tmp_path: Path) -> None:
    files = image_tree(classes=3, per_class=5)
    write_tree(tmp_path / "src", files)
    shard_local(tmp_path / "src", tmp_path / "dst", label=r"^([^/]+)/")
    samples = read_webdataset(tmp_path / "dst")
    assert {key: int(sample["cls"]) for key, sample in samples.items()} == {
        f"class{c}/{i:04d}": c for c in range(3) for i in range(5)
    }
    assert load_manifest(tmp_path / "dst").extra["classes"] == ["class0", "class1", "class2"]
    assert read_tarindex(tmp_path / "dst") == samples


def test_awkward_names_round_trip(tmp_path: Path) -> None:
    long_dir = "d" * 200
    files = {
        "with space/a b c.jpg": b"spaces",
        "ünïcödé/日本語.txt": b"unicode",
        "ünïcödé/日本語.json": b"{}",
        f"{long_dir}/{'k' * 180}.bin": b"long key",
        "v1.2/dotted dir/x.tar.gz": b"two extensions",
        "plain/x.jpg": b"",  # empty file
    }
    write_tree(tmp_path / "src", files)
    report = shard_local(tmp_path / "src", tmp_path / "dst", shard_size=2_048)
    assert report.samples == 5
    expected = expected_samples(files)
    assert read_webdataset(tmp_path / "dst") == expected
    assert read_tarindex(tmp_path / "dst") == expected
    check_manifest(tmp_path / "dst")


def test_dotdot_keys_on_s3_are_rejected(s3: Any, tmp_path: Path) -> None:
    s3.put("raw/ok/1.jpg", b"x")
    s3.put("raw/a/../evil.jpg", b"y")
    with pytest.raises(InvalidKeyError, match="cannot be packed"):
        run(shard_dataset(Endpoint(s3.url("raw"), s3.storage_options), Endpoint(str(tmp_path / "dst")), ShardOptions()))
    assert not (tmp_path / "dst" / MANIFEST_NAME).exists()


def test_sharding_from_s3_to_s3_writes_what_sharding_to_a_directory_writes(s3: Any, tmp_path: Path) -> None:
    files = image_tree(classes=2, per_class=12)
    for key, data in files.items():
        s3.put(f"raw/{key}", data)
    source = Endpoint(s3.url("raw"), s3.storage_options)
    dest = Endpoint(s3.url("shards"), s3.storage_options)
    report = run(shard_dataset(source, dest, ShardOptions(shard_size=6_000, label=r"^([^/]+)/")))
    assert report.objects == len(files)
    local = tmp_path / "copy"
    listed = s3.client.list_objects_v2(Bucket=s3.name, Prefix="shards/")["Contents"]
    for entry in listed:
        target = local / entry["Key"][len("shards/") :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(s3.client.get_object(Bucket=s3.name, Key=entry["Key"])["Body"].read())
    samples = read_webdataset(local)
    assert {k: {f: v for f, v in s.items() if f != "cls"} for k, s in samples.items()} == expected_samples(files)
    assert read_tarindex(local) == samples
    assert check_manifest(local).total_samples == len(samples)
    # the same input sharded to a directory gives the same bytes
    run(shard_dataset(source, Endpoint(str(tmp_path / "dir")), ShardOptions(shard_size=6_000, label=r"^([^/]+)/")))
    assert {k: v for k, v in output_files(tmp_path / "dir").items() if k != PLAN_NAME} == {
        k: v for k, v in output_files(local).items() if k != PLAN_NAME
    }


def test_resume_after_sigkill_is_byte_identical(s3: Any, tmp_path: Path, cache_env: dict[str, str]) -> None:
    """kill -9 the CLI once a shard is recorded, rerun it, and compare with an uninterrupted run."""
    files = {f"img/{i:04d}.bin": payload(str(i), 600) for i in range(240)}
    for key, data in files.items():
        s3.put(f"raw/{key}", data)
    dst = tmp_path / "resumed"
    command = [
        sys.executable, "-m", "datacache.cli", "shard", s3.url("raw"), str(dst),
        "--shard-size", "8KB", "--workers", "1", "--concurrency", "2", "--json", "-v",
    ]
    env = {**cache_env, **s3.server.env()}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    records = dst / ".datacache-shard-done"

    def recorded() -> int:  # finished records, not a record being written (a hidden .partial)
        return len(list(records.glob("*.json"))) if records.is_dir() else 0

    deadline = time.monotonic() + 120
    try:
        while not recorded():
            if process.poll() is not None:
                pytest.fail(f"datacache shard exited early: {process.stderr.read()!r}")  # type: ignore[union-attr]
            if time.monotonic() > deadline:
                pytest.fail("no shard was recorded within 120s")
            time.sleep(0.005)  # sleep-ok: spaces the polls of a condition with a deadline
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
        process.stderr.close()  # type: ignore[union-attr]
    assert process.returncode == -signal.SIGKILL
    assert not (dst / MANIFEST_NAME).exists(), "the run finished before it was killed"
    done_before = recorded()

    rerun = subprocess.run(command, env=env, capture_output=True, timeout=300, check=True)
    summary = json.loads(rerun.stdout.decode().strip().splitlines()[-1])
    assert summary["event"] == "done"
    assert summary["shards_kept"] >= done_before >= 1, rerun.stderr.decode()[-2000:]
    assert summary["shards_written"] >= 1

    reference = tmp_path / "reference"
    run(shard_dataset(Endpoint(s3.url("raw"), s3.storage_options), Endpoint(str(reference)),
                      ShardOptions(shard_size=8_000)))
    assert output_files(dst) == output_files(reference)
    assert load_manifest(dst).shards == load_manifest(reference).shards
    assert read_tarindex(dst) == expected_samples(files)


# -- engines ------------------------------------------------------------------------------


def test_dask_engine_in_local_mode(tmp_path: Path) -> None:
    pytest.importorskip("dask.distributed")
    write_tree(tmp_path / "src", image_tree(per_class=15))
    local = shard_local(tmp_path / "src", tmp_path / "local", shard_size=5_000)
    distributed = shard_local(tmp_path / "src", tmp_path / "dask", shard_size=5_000, engine="dask", workers=2)
    assert distributed.units == local.units and distributed.written == local.units
    assert output_files(tmp_path / "dask") == output_files(tmp_path / "local")
    again = shard_local(tmp_path / "src", tmp_path / "dask", shard_size=5_000, engine="dask", workers=2)
    assert again.kept == local.units


def _worker_callbacks() -> list[str]:
    from distributed import get_worker

    return list(get_worker().periodic_callbacks)


def test_the_local_dask_cluster_runs_no_profiler() -> None:
    """Its sampler (sys._current_frames every 10 ms) hung a fresh clone's suite on CPython 3.11."""
    pytest.importorskip("dask.distributed")
    from datacache.dask_ray import map_dask

    found: list[list[str]] = []
    map_dask(_worker_callbacks, [()], names=["callbacks"], scheduler=None, workers=1, on_result=found.append)
    assert found and "heartbeat" in found[0], found
    assert not [name for name in found[0] if "profile" in name], found[0]


# -- the command --------------------------------------------------------------------------


def test_readme_and_help_agree_on_the_default_engine(cache_env: dict[str, str]) -> None:
    """Issue 12 item 16: the README called dask the default; `shard --help` says local."""
    from _helpers import REPO

    helped = run_cli(["shard", "--help"], cache_env, check=True).stdout
    default = re.search(r"^\s+--engine \{[a-z,]+\}.*?\(default (\w+)\)", helped, re.DOTALL | re.MULTILINE)
    assert default is not None, helped
    readme = (REPO / "README.md").read_text()
    sentences = [" ".join(sentence.split()) for sentence in re.split(r"\.\s", readme)]
    claims = [
        engine
        for sentence in sentences
        if re.search(r"\bdefault\b", sentence)
        for engine in re.findall(r"`--engine (\w+)`", sentence)
    ]
    claims += [name.lower() for name in re.findall(r"\b(\w+) is the default\b", readme)]
    assert claims, "the README says which engine is the default"
    assert set(claims) == {default.group(1)}, claims


def test_cli_shard_json_and_errors(tmp_path: Path, cache_env: dict[str, str],
                                   capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("DATACACHE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", cache_env["HOME"])
    monkeypatch.setenv("XDG_CONFIG_HOME", cache_env["XDG_CONFIG_HOME"])
    write_tree(tmp_path / "src", image_tree(per_class=5))
    code = main(["shard", str(tmp_path / "src"), str(tmp_path / "dst"), "--shard-size", "4kB", "--json"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0
    assert lines[-1]["event"] == "done" and lines[-1]["objects"] == 20 and lines[-1]["samples"] == 10
    assert all("objects_per_s" in line for line in lines[:-1])  # progress lines, none for work this short
    assert main(["shard", str(tmp_path / "src"), str(tmp_path / "x"), "--group-by", "("]) == 2
    assert "not a valid regular expression" in capsys.readouterr().err
    assert main(["shard", str(tmp_path / "nothing"), str(tmp_path / "y")]) == 1
    assert f"{tmp_path / 'nothing'}: no such file or directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["shard", str(tmp_path / "empty"), str(tmp_path / "y")]) == 1
    assert "nothing to shard" in capsys.readouterr().err
    # A new user wrote the shards into their source (`shard raw raw/out`): the next run took them for input.
    monkeypatch.chdir(tmp_path)
    assert main(["shard", "src", "src/out"]) == 2
    assert re.search(r"DST \S*src/out is inside SRC \S*src; write the shards outside it", capsys.readouterr().err)
    assert not (tmp_path / "src" / "out").exists()
    assert main(["shard", "src", f"file://{tmp_path}/src/"]) == 2
    assert "the same place" in capsys.readouterr().err


# -- Parquet and Zarr ---------------------------------------------------------------------


def test_parquet_rechunked_to_target_row_groups(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    tables = []
    for f in range(3):
        table = pa.table({
            "id": pa.array(range(f * 400, (f + 1) * 400), pa.int64()),
            "value": pa.array([float(i) / 7 for i in range(400)], pa.float64()),
        })
        pq.write_table(table, tmp_path / "src" / f"part-{f}.parquet", row_group_size=20)  # tiny row groups
        tables.append(table)
    group_bytes = pq.ParquetFile(tmp_path / "src" / "part-0.parquet").metadata.row_group(0).total_byte_size
    report = shard_local(
        tmp_path / "src", tmp_path / "dst", chunk_size=10 * group_bytes, shard_size=30 * group_bytes
    )
    assert report.kind == "parquet" and report.samples == 1200
    outputs = sorted((tmp_path / "dst").glob("*.parquet"))
    assert len(outputs) == report.units == 2
    sizes = [pq.ParquetFile(p).metadata.row_group(i).num_rows for p in outputs
             for i in range(pq.ParquetFile(p).metadata.num_row_groups)]
    assert sizes == [200] * 6  # 10 input row groups of 20 rows each, 3 row groups a file
    combined = pa.concat_tables([pq.read_table(p) for p in outputs])
    assert combined.equals(pa.concat_tables(tables))
    manifest = check_manifest(tmp_path / "dst")
    assert manifest.format.value == "parquet" and manifest.total_samples == 1200


def test_a_spark_output_is_rechunked_as_parquet_as_it_is_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One detector: the Parquet files of a directory with a _SUCCESS marker are its data, for shard as for reading."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "src").mkdir()
    pq.write_table(pa.table({"id": list(range(30))}), tmp_path / "src" / "part-0.parquet")
    (tmp_path / "src" / "_SUCCESS").write_bytes(b"")
    report = shard_local(tmp_path / "src", tmp_path / "dst")
    assert report.kind == "parquet" and report.samples == 30
    assert "1 others" in caplog.text and "--format files" in caplog.text


def test_zarr_rechunked_along_axis_zero(tmp_path: Path) -> None:
    import numpy as np
    import zarr
    from zarr.storage import LocalStore

    data = np.arange(1000 * 16, dtype="float32").reshape(1000, 16)
    data[400:500] = 0  # a chunk of fill values is still written
    source = zarr.create_array(store=LocalStore(tmp_path / "src"), shape=data.shape, chunks=(10, 16),
                               dtype="float32", fill_value=0, attributes={"units": "m"})
    source[:] = data
    report = shard_local(tmp_path / "src", tmp_path / "dst", chunk_size=250 * 16 * 4)
    assert report.kind == "zarr" and report.units == 4 and report.samples == 1000
    output = zarr.open_array(store=LocalStore(tmp_path / "dst", read_only=True), mode="r")
    assert output.chunks == (250, 16)
    assert dict(output.attrs) == {"units": "m"}
    np.testing.assert_array_equal(output[:], data)
    manifest = check_manifest(tmp_path / "dst")
    assert manifest.format.value == "zarr"
    assert [s.key for s in manifest.shards] == ["zarr.json", "c/0/0", "c/1/0", "c/2/0", "c/3/0"]
    again = shard_local(tmp_path / "src", tmp_path / "dst", chunk_size=250 * 16 * 4)
    assert again.kept == 4


def test_parquet_and_zarr_rechunked_s3_to_s3(s3: Any, tmp_path: Path) -> None:
    """The columnar paths read from and write to the object store, not only local folders."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zarr
    from zarr.storage import LocalStore

    tables = []
    for f in range(2):
        table = pa.table({"id": pa.array(range(f * 300, (f + 1) * 300), pa.int64())})
        sink = io.BytesIO()
        pq.write_table(table, sink, row_group_size=25)
        s3.put(f"pq/part-{f}.parquet", sink.getvalue())
        tables.append(table)
    group_bytes = pq.ParquetFile(io.BytesIO(s3.client.get_object(Bucket=s3.name, Key="pq/part-0.parquet")[
        "Body"].read())).metadata.row_group(0).total_byte_size
    source, dest = Endpoint(s3.url("pq"), s3.storage_options), Endpoint(s3.url("pq-out"), s3.storage_options)
    report = run(shard_dataset(source, dest, ShardOptions(chunk_size=6 * group_bytes, shard_size=100 * group_bytes)))
    assert report.kind == "parquet" and report.samples == 600
    keys = sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.name, Prefix="pq-out/")["Contents"])
    outputs = [k for k in keys if k.endswith(".parquet")]
    assert outputs and any(k.endswith(MANIFEST_NAME) for k in keys)
    read = [pq.read_table(io.BytesIO(s3.client.get_object(Bucket=s3.name, Key=k)["Body"].read())) for k in outputs]
    assert pa.concat_tables(read).equals(pa.concat_tables(tables))
    assert {pq.ParquetFile(io.BytesIO(s3.client.get_object(Bucket=s3.name, Key=k)["Body"].read())).metadata
            .row_group(0).num_rows for k in outputs} == {150}

    data = np.arange(200 * 4, dtype="int32").reshape(200, 4)
    local = zarr.create_array(store=LocalStore(tmp_path / "z"), shape=data.shape, chunks=(5, 4), dtype="int32")
    local[:] = data
    for path in sorted(p for p in (tmp_path / "z").rglob("*") if p.is_file()):
        s3.put(f"zarr/{path.relative_to(tmp_path / 'z').as_posix()}", path.read_bytes())
    zsource, zdest = Endpoint(s3.url("zarr"), s3.storage_options), Endpoint(s3.url("zarr-out"), s3.storage_options)
    zreport = run(shard_dataset(zsource, zdest, ShardOptions(chunk_size=50 * 4 * 4)))
    assert zreport.kind == "zarr" and zreport.samples == 200 and zreport.units == 4
    copy = tmp_path / "z-out"
    for entry in s3.client.list_objects_v2(Bucket=s3.name, Prefix="zarr-out/")["Contents"]:
        target = copy / entry["Key"][len("zarr-out/") :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(s3.client.get_object(Bucket=s3.name, Key=entry["Key"])["Body"].read())
    output = zarr.open_array(store=LocalStore(copy, read_only=True), mode="r")
    assert output.chunks == (50, 4)
    np.testing.assert_array_equal(output[:], data)


def test_ray_engine_in_local_mode(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    write_tree(tmp_path / "src", image_tree(per_class=10))
    local = shard_local(tmp_path / "src", tmp_path / "local", shard_size=5_000)
    distributed = shard_local(tmp_path / "src", tmp_path / "ray", shard_size=5_000, engine="ray", workers=2)
    assert distributed.written == local.units
    assert output_files(tmp_path / "ray") == output_files(tmp_path / "local")


def test_round_trip_through_the_loader(tmp_path: Path, settings: Any) -> None:
    """The loader reads the shards through their manifest: every sample once, identical bytes."""
    from datacache.loaders import CachedIterableDataset

    files = image_tree(classes=2, per_class=20)
    write_tree(tmp_path / "src", files)
    shard_local(tmp_path / "src", tmp_path / "dst", shard_size=6_000)
    dataset = CachedIterableDataset(str(tmp_path / "dst"), config=settings, shuffle=False, decode=lambda s: s)
    seen: Samples = {}
    for sample in dataset:
        key = sample["__key__"]
        assert key not in seen
        seen[key] = {name: bytes(value) for name, value in sample.items() if not name.startswith("__")}
    assert seen == expected_samples(files)


LINES_FORMAT = '''
from datacache.formats.files import FilesFormat


class Lines(FilesFormat):
    name = "lines"
    suffixes = (".lines",)
    priority = 50
    rechunker = "linesfmt.shard:RECHUNKER"

    def detect(self, keys):
        return any(key.endswith(".lines") for key in keys)


FORMAT = Lines()
'''

LINES_RECHUNKER = '''
from datacache.checksum import checksum_of, new_hasher
from datacache.shard import Rechunker, ShardPlan, UnitSpec, digest_of, put_bytes


class LinesRechunker(Rechunker):
    """Concatenates .lines files, in key order, into files of about --shard-size; a line is a sample."""

    async def plan(self, source, infos, options, shown):
        tier = source.open(writable=False)
        try:
            files = [(info, (await tier.get(info.key)).count(b"\\n")) for info in sorted(infos, key=lambda i: i.key)]
        finally:
            await tier.close()
        groups, size = [[]], 0
        for info, lines in files:
            if groups[-1] and size + info.size > options.shard_size:
                groups.append([])
                size = 0
            groups[-1].append((info, lines))
            size += info.size
        units = []
        for number, group in enumerate(groups):
            key = f"{options.prefix}-{number:06d}.lines"
            units.append(UnitSpec(
                key=key, kind="lines", digest=digest_of([key, [[i.key, i.size, i.version] for i, _ in group]]),
                size=sum(i.size for i, _ in group), samples=sum(n for _, n in group), objects=len(group),
                input_bytes=sum(i.size for i, _ in group), payload=tuple(i.key for i, _ in group),
            ))
        return ShardPlan(kind="lines", source=shown, options=options, units=tuple(units),
                         objects=len(files), input_bytes=sum(i.size for i, _ in files))

    async def pack(self, spec, job, io):
        data = b"".join([await io.source.get(key) for key in spec.payload])
        io.on_object(len(spec.payload), len(data))
        await put_bytes(io.dest, spec.key, data)
        hasher = new_hasher()
        hasher.update(data)
        return len(data), checksum_of(hasher)

    def root_files(self, plan):
        return {"lines.json": b'{"version": 1}'}


RECHUNKER = LinesRechunker()
'''


def test_an_installed_format_adds_rechunking_without_editing_datacache(tmp_path: Path) -> None:
    """A package's format names its rechunker; `datacache shard` detects, plans, packs and lists it."""
    package = tmp_path / "site"
    (package / "linesfmt").mkdir(parents=True)
    (package / "linesfmt" / "__init__.py").write_text(LINES_FORMAT)
    (package / "linesfmt" / "shard.py").write_text(LINES_RECHUNKER)
    info = package / "linesfmt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: linesfmt\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[datacache.formats]\nlines = linesfmt:FORMAT\n")
    lines = {f"part-{n}.lines": b"".join(b"%d\n" % i for i in range(10 * n, 10 * n + 10)) for n in range(5)}
    write_tree(tmp_path / "src", lines)
    path = os.pathsep.join([str(package), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "HOME": str(tmp_path)}
    command = [sys.executable, "-m", "datacache.cli"]
    helped = subprocess.run([*command, "shard", "--help"], env=env, capture_output=True, text=True, check=True)
    assert "{auto,files,lines,parquet,zarr}" in helped.stdout
    subprocess.run([*command, "shard", str(tmp_path / "src"), str(tmp_path / "dst"), "--shard-size", "70B", "-q"],
                   env=env, capture_output=True, text=True, check=True)
    manifest = json.loads((tmp_path / "dst" / MANIFEST_NAME).read_text())  # this process has no "lines" format
    assert manifest["format"] == "lines"
    shards = manifest["shards"]
    assert [shard["key"] for shard in shards] == ["lines.json", *(f"shard-00000{n}.lines" for n in range(3))]
    assert [shard["samples"] for shard in shards] == [0, 20, 20, 10]
    packed = b"".join((tmp_path / "dst" / shard["key"]).read_bytes() for shard in shards[1:])
    assert packed == b"".join(b"%d\n" % i for i in range(50))
