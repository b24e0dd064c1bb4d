"""Datasets for the fault tests: WebDataset tar shards with known bytes, and checks on what was served."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sqlite3
import tarfile
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import xxhash

Samples = dict[str, dict[str, bytes]]


def tar_shard(samples: Iterable[tuple[str, Mapping[str, bytes]]]) -> bytes:
    """A WebDataset-style tar: one member per field, named ``<key>.<field>``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, fields in samples:
            for name, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                info.mtime = 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def make_dataset(
    shards: int, per_shard: int, *, seed: int = 0, size: tuple[int, int] = (500, 3000), version: str = "v1"
) -> tuple[dict[str, bytes], Samples]:
    """``shards`` tar shards of ``per_shard`` samples; returns (shard name -> bytes, sample key -> fields).

    Each sample's ``bin`` field is random and its ``ver`` field names ``version``,
    so a test can tell which version of a shard a sample came from.
    """
    rng = random.Random(seed)
    files: dict[str, bytes] = {}
    expected: Samples = {}
    for s in range(shards):
        members = []
        for i in range(per_shard):
            key = f"s{s:03d}_{i:04d}"
            fields = {"bin": rng.randbytes(rng.randint(*size)), "ver": version.encode()}
            members.append((key, fields))
            expected[key] = fields
        files[f"shard-{s:04d}.tar"] = tar_shard(members)
    return files, expected


def upload(client: Any, bucket: str, prefix: str, files: Mapping[str, bytes], *, per_shard: int | None = None) -> None:
    """Put ``files`` under ``prefix``; with ``per_shard``, also open_clip's ``sizes.json`` of their sample counts.

    Tests of the staging path give their shards counts, so that no shard is read for its
    count (a cold first epoch streams each un-indexed shard once more, to count it).
    """
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)
    if per_shard is not None:
        sizes = json.dumps(dict.fromkeys(files, per_shard)).encode()
        client.put_object(Bucket=bucket, Key=f"{prefix}/sizes.json", Body=sizes)


def proxied_options(endpoint: str, *, read_timeout: float = 1.0) -> dict[str, Any]:
    """s3fs storage options through ``endpoint``, with short timeouts so that a stall is cut quickly."""
    return {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "config_kwargs": {"read_timeout": read_timeout, "connect_timeout": 2},
    }


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_exactly_once(seen: Iterable[tuple[str, bytes]], expected: Samples) -> tuple[int, int]:
    """Compare what a loader delivered with ``expected``; return (samples lost, corrupt samples served).

    Raises AssertionError naming the first duplicate.
    """
    keys: Counter[str] = Counter()
    corrupt = 0
    for key, data in seen:
        keys[key] += 1
        if key not in expected or expected[key]["bin"] != data:
            corrupt += 1
    repeated = [key for key, count in keys.items() if count > 1]
    assert not repeated, f"delivered more than once: {repeated[:5]}"
    lost = len(set(expected) - set(keys))
    return lost, corrupt


def sample_pairs(items: Iterable[Mapping[str, Any]]) -> list[tuple[str, bytes]]:
    """(key, bin) of each sample a DataLoader yielded (``batch_size=None``)."""
    return [(str(item["__key__"]), bytes(item["bin"])) for item in items]


def xxh(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"


def partials(*roots: Path) -> list[Path]:
    found: list[Path] = []
    for root in roots:
        if root.exists():
            found.extend(p for p in root.rglob("*") if p.name.endswith(".partial"))
    return sorted(found)


def lease_locks(shared: Path) -> list[Path]:
    locks = shared / "locks"
    return sorted(locks.rglob("*.lock")) if locks.exists() else []


def catalog(local: Path) -> list[tuple[str, str, int, str | None, str | None, str]]:
    """(dataset, key, size, version, checksum, state) of every catalog row."""
    path = local / "catalog.sqlite"
    if not path.exists():
        return []
    connection = sqlite3.connect(path, timeout=30)
    try:
        return list(connection.execute("SELECT dataset, key, size, version, checksum, state FROM shards ORDER BY key"))
    finally:
        connection.close()


def check_cache(local: Path, shared: Path | None, files: Mapping[str, bytes]) -> dict[str, int]:
    """Check the invariants that hold at every moment, even right after a SIGKILL.

    Every file visible under a shard's name (on either tier) holds that shard's
    bytes, whole; every catalog row marked resident points at such a file with
    the size and checksum it records. Returns counts of what was checked.
    """
    checked = {"visible": 0, "resident_rows": 0}
    for root in (local / "data", *((shared / "data",) if shared is not None else ())):
        if not root.exists():
            continue
        for path in root.rglob("*"):
            if not path.is_file() or path.name.startswith("."):
                continue
            assert not path.is_symlink(), path
            data = path.read_bytes()
            assert data == files[path.name], f"{path} is visible with wrong or partial bytes"
            checked["visible"] += 1
    for dataset, key, size, _, checksum, state in catalog(local):
        if state != "resident":
            continue
        path = local / "data" / dataset / key
        assert path.is_file(), f"the catalog says {dataset}/{key} is resident, but there is no file"
        data = path.read_bytes()
        assert len(data) == size and checksum == xxh(data) == xxh(files[key]), f"{path} does not match its row"
        checked["resident_rows"] += 1
    return checked


def peak_rss_kib(pid: int) -> int | None:
    """The peak resident set size (VmHWM) of a live process, in KiB."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def environment_without_aws(base: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in base.items() if not k.startswith(("AWS_", "FSSPEC_", "DATACACHE_"))} | {
        "AWS_EC2_METADATA_DISABLED": "true",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), base.get("PYTHONPATH", "")]).strip(
            os.pathsep
        ),
    }


def record(test: str, **fields: Any) -> None:
    """Append one line of results to the file ``$RELIABILITY_LEDGER`` names (docs/RELIABILITY.md is filled from it)."""
    import json

    path = os.environ.get("RELIABILITY_LEDGER")
    if path:
        with open(path, "a") as ledger:
            ledger.write(json.dumps({"test": test, **fields}, sort_keys=True) + "\n")
