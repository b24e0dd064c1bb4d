"""Issue 25's client libraries side by side, in one run against one S3 server: what a cold byte costs.

Run alone::

    python -m benchmarks.clients [--objects 8] [--size 64MB] [--small-objects 64] [--small-size 4MB]
                                 [--rounds 3] [--clients ...] [--results benchmarks/RESULTS.md] [--json FILE]

It starts moto's S3 server on 127.0.0.1 (as ``tests/s3server.py`` does, in its
own process: its CPU is not the client's), puts two sets of random objects
there (``--objects`` of ``--size``, and ``--small-objects`` of ``--small-size``),
and reads every set with each client, 8 objects in flight, in two modes:

- ``arrive``: the bytes are in this process's memory, whole, and nothing more;
- ``landed``: they are also hashed (xxh3, `datacache.checksum.new_hasher`) and
  checked against the object's known checksum, written to a file beside the
  others (``<name>.partial``, fsync, rename, fsync of the directory): what
  the stager does with every cold shard.

The clients:

- ``datacache``: the object tier as `Transfer.copy` reads today. ``arrive`` is
  `ObjectTier.read_into` (its GET threads read the body straight into one
  reused buffer per object, conditional on the manifest's ETag) with no hasher;
  ``landed`` is `Transfer.copy` itself from the origin into a `LocalTier`
  (hashed in the GET thread, written from the same memory, fsynced, renamed).
- ``datacache-tier``: ``landed`` only, `ObjectTier.read_into` (as ``arrive``) then
  the same landing as the other clients below (hash on a thread, write, fsync): the
  tier as a client, apart from the stager's write path.
- ``datacache-parts``: `Transfer.copy` with ``part_size`` below the object's
  size, so it takes the chunked path (4 ranged `ObjectTier.get` in flight per
  object, hashed on the loop); ``landed`` only, large objects only.
- ``boto3``: one client, 8 threads, ``GetObject`` and ``Body.readinto`` into a
  reused buffer per thread (botocore's defaults: its response CRC included).
- ``obstore``: Rust's object_store, ``get_async`` + ``bytes_async`` on the
  event loop (a fresh Rust buffer per object: it has no read-into); the
  landing runs on 8 threads.
- ``crt``: the AWS CRT client as s3torchconnector uses it (s3torchconnectorclient's
  ``MountpointS3Client``, ``force_path_style``), 8 threads each iterating a
  ``get_object`` stream, its chunks copied into a reused buffer.

A client whose library is not installed is reported as missing, not failed.
Before the timed rounds each client reads every set once, untimed and checked
byte for byte against the objects' checksums (connections, client builds,
buffers' first page faults). Then each round runs every client on every set,
one after another, so the load of the machine falls on all of them alike.
Figures: MB/s (10^6 bytes) over a set, and client CPU seconds per GB (user +
system of this process, all its threads: ``resource.getrusage``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from datacache.tiers import LocalTier

from datacache.checksum import checksum_of, new_hasher
from datacache.config import DatasetConfig, Settings, load_settings
from datacache.sizes import parse_size
from datacache.staging import DatasetHandle, Stager
from datacache.staging.events import Events
from datacache.staging.transfer import Transfer
from datacache.staging.types import ORIGIN

MARK = "<!-- clients -->"
BUCKET = "clients"
KEY = SECRET = "bench"
REGION = "us-east-1"
IN_FLIGHT = 8
MODES = ("arrive", "landed")
CLIENTS = ("datacache", "datacache-tier", "datacache-parts", "boto3", "obstore", "crt")
LIBRARIES = ("boto3", "botocore", "obstore", "s3torchconnectorclient", "moto", "xxhash")


@dataclass(frozen=True)
class ObjectSet:
    """One set of objects in the bucket: its name (its key prefix), its keys, sizes and checksums."""

    name: str
    size: int
    keys: tuple[str, ...]
    checksums: dict[str, str] = field(repr=False)

    @property
    def total(self) -> int:
        return self.size * len(self.keys)


# -- the objects -------------------------------------------------------------------------------------


def put_objects(endpoint: str, name: str, count: int, size: int) -> ObjectSet:
    """Put ``count`` objects of ``size`` random bytes under ``name/``; return them with their checksums."""
    import boto3

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=KEY, aws_secret_access_key=SECRET
    )
    try:
        client.head_bucket(Bucket=BUCKET)
    except Exception:
        client.create_bucket(Bucket=BUCKET)
    keys, checksums = [], {}
    for index in range(count):
        key = f"{name}/object-{index:04d}.bin"
        data = os.urandom(size)
        hasher = new_hasher()
        hasher.update(data)
        client.put_object(Bucket=BUCKET, Key=key, Body=data)
        keys.append(key)
        checksums[key] = checksum_of(hasher)
    client.close()
    return ObjectSet(name, size, tuple(keys), checksums)


# -- what every client shares: buffers, and the landing -------------------------------------------------


class Buffers:
    """One reused buffer per object in flight (private anonymous maps, every page touched once)."""

    def __init__(self, size: int, count: int = IN_FLIGHT) -> None:
        self._free: list[mmap.mmap] = []
        for _ in range(count):
            buffer = mmap.mmap(-1, max(1, size), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            buffer.write(bytes(max(1, size)))
            self._free.append(buffer)

    @contextmanager
    def one(self) -> Iterator[mmap.mmap]:
        buffer = self._free.pop()
        try:
            yield buffer
        finally:
            self._free.append(buffer)

    def close(self) -> None:
        for buffer in self._free:
            buffer.close()


def land(data: Any, directory: Path, key: str, expected: str) -> None:
    """What the stager does with a cold object's bytes: hash and check them, write, fsync, rename (blocking)."""
    view = memoryview(data)
    hasher = new_hasher()
    hasher.update(view)
    if checksum_of(hasher) != expected:
        raise RuntimeError(f"{key}: the bytes read do not match the object's checksum")
    name = key.replace("/", "_")
    partial = directory / f".{name}.partial"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(partial, directory / name)
    dirfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def check(data: Any, key: str, expected: str) -> None:
    hasher = new_hasher()
    hasher.update(memoryview(data))
    if checksum_of(hasher) != expected:
        raise RuntimeError(f"{key}: the bytes read do not match the object's checksum")


@dataclass
class Read:
    """How one client reads one set: ``run(mode, landing directory or None, checked)`` returns the bytes read."""

    run: Callable[[str, Path | None, bool], Awaitable[int]]
    close: Callable[[], Awaitable[None]]


# -- (a) datacache's object tier, as Transfer.copy reads it --------------------------------------------------


class DatacacheReads:
    """The origin as the stager opens it (its manifest: ETags as versions), read as `Transfer.copy` reads.

    Landed: `Transfer.copy` into a `LocalTier` (``copy``), else `ObjectTier.read_into` and `land`,
    the landing every other client here gets.
    """

    def __init__(
        self, objects: ObjectSet, settings: Settings, stager: Stager, handle: DatasetHandle, copy: bool
    ) -> None:
        self.objects = objects
        self.stager = stager
        self.handle = handle
        self.shards = {f"{objects.name}/{shard.key}": shard for shard in handle.manifest.shards}
        if sorted(self.shards) != sorted(objects.keys):
            raise RuntimeError(f"the manifest lists {sorted(self.shards)[:3]}..., not the objects put")
        self.copy = copy
        self.transfer = Transfer(settings, Events())  # the stager's own: its buffers live as long as it does
        self.buffers = Buffers(objects.size) if not copy or settings.part_size >= objects.size else None
        self.gate = asyncio.Semaphore(settings.concurrency)
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="datacache-land")

    @classmethod
    async def open(
        cls, endpoint: str, objects: ObjectSet, scratch: Path, part_size: int | None, *, copy: bool = True
    ) -> Read:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
        env["HOME"] = str(scratch / "home")
        settings: Settings = load_settings(env, overrides={"local_dir": str(scratch / "stager"), "fsync": True})
        if part_size is not None:
            settings = replace(settings, part_size=part_size)
        config = DatasetConfig(
            name=objects.name,
            url=f"s3://{BUCKET}/{objects.name}",
            storage_options={"endpoint_url": endpoint, "key": KEY, "secret": SECRET},
        )
        stager = Stager(settings)
        await stager.__aenter__()
        try:
            reads = cls(objects, settings, stager, await stager.open(config), copy)
        except BaseException:
            await stager.__aexit__(None, None, None)
            raise
        return Read(reads.run, reads.close)

    async def _read_into(self, name: str, view: memoryview) -> int:
        shard = self.shards[name]
        received = 0
        async for region in self.handle.origin.read_into(shard.key, view, version=shard.version):
            received += len(region)
        return received

    async def _one(self, name: str, landing: Path | None, destination: LocalTier | None, checked: bool) -> int:
        shard = self.shards[name]
        if destination is not None:
            await self.transfer.copy(
                self.handle,
                shard,
                self.handle.origin,
                shard.key,
                destination,
                self.handle.tier_key(shard.key),
                self.objects.checksums[name],
                ORIGIN,
            )
            return shard.size
        assert self.buffers is not None
        expected = self.objects.checksums[name]
        with self.buffers.one() as buffer:
            view = memoryview(buffer)[: shard.size]
            received = await self._read_into(name, view)
            if landing is not None:
                await asyncio.get_running_loop().run_in_executor(self.pool, land, view, landing, name, expected)
            elif checked:
                check(view, name, expected)
            del view
        return received

    async def run(self, mode: str, landing: Path | None, checked: bool) -> int:
        destination = LocalTier(landing, durable=True) if landing is not None and self.copy else None

        async def one(name: str) -> int:
            async with self.gate:
                return await self._one(name, landing, destination, checked)

        return sum(await asyncio.gather(*(one(name) for name in self.objects.keys)))

    async def close(self) -> None:
        self.pool.shutdown()
        if self.buffers is not None:
            self.buffers.close()
        await self.stager.__aexit__(None, None, None)


# -- (b) boto3, 8 threads, readinto ------------------------------------------------------------------------


async def boto3_reader(endpoint: str, objects: ObjectSet, scratch: Path) -> Read:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        config=Config(max_pool_connections=IN_FLIGHT),
    )
    buffers = Buffers(objects.size)
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="boto3-get")

    def one(name: str, landing: Path | None, checked: bool) -> int:
        with buffers.one() as buffer:
            view = memoryview(buffer)[: objects.size]
            body = client.get_object(Bucket=BUCKET, Key=name)["Body"]
            filled = 0
            try:
                while filled < len(view):
                    count = body.readinto(view[filled:])
                    if not count:
                        break
                    filled += count
            finally:
                body.close()
            if filled != objects.size:
                raise RuntimeError(f"{name}: {filled} bytes of {objects.size}")
            if landing is not None:
                land(view, landing, name, objects.checksums[name])
            elif checked:
                check(view, name, objects.checksums[name])
            del view
        return filled

    async def run(mode: str, landing: Path | None, checked: bool) -> int:
        loop = asyncio.get_running_loop()
        done = [loop.run_in_executor(pool, one, name, landing, checked) for name in objects.keys]
        return sum(await asyncio.gather(*done))

    async def close() -> None:
        pool.shutdown()
        buffers.close()
        client.close()

    return Read(run, close)


# -- (c) obstore, async GETs ---------------------------------------------------------------------------------


async def obstore_reader(endpoint: str, objects: ObjectSet, scratch: Path) -> Read:
    import obstore
    from obstore.store import S3Store

    # object_store refuses a plain http endpoint unless allow_http is set; moto answers path-style.
    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        access_key_id=KEY,
        secret_access_key=SECRET,
        region=REGION,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="obstore-land")
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(name: str, landing: Path | None, checked: bool) -> int:
        async with gate:
            result = await obstore.get_async(store, name)
            data = await result.bytes_async()
            size = len(memoryview(data))
            if size != objects.size:
                raise RuntimeError(f"{name}: {size} bytes of {objects.size}")
            loop = asyncio.get_running_loop()
            if landing is not None:
                await loop.run_in_executor(pool, land, data, landing, name, objects.checksums[name])
            elif checked:
                await loop.run_in_executor(pool, check, data, name, objects.checksums[name])
            return size

    async def run(mode: str, landing: Path | None, checked: bool) -> int:
        return sum(await asyncio.gather(*(one(name, landing, checked) for name in objects.keys)))

    async def close() -> None:
        pool.shutdown()

    return Read(run, close)


# -- (d) the CRT client, as s3torchconnector uses it -------------------------------------------------------------


async def crt_reader(endpoint: str, objects: ObjectSet, scratch: Path) -> Read:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

    # What s3torchconnector's S3Client builds (its defaults: 10 Gbps target, 8 MiB parts), with
    # S3ClientConfig(force_path_style=True) as the anchors use it against moto. Credentials come
    # from the environment (AWS_ACCESS_KEY_ID, ...), set by `measure` for this process.
    client = MountpointS3Client(
        REGION,
        "datacache-bench",
        endpoint=endpoint,
        force_path_style=True,
    )
    buffers = Buffers(objects.size)
    pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="crt-get")

    def one(name: str, landing: Path | None, checked: bool) -> int:
        with buffers.one() as buffer:
            view = memoryview(buffer)[: objects.size]
            filled = 0
            for chunk in client.get_object(BUCKET, name):
                end = filled + len(chunk)
                if end > len(view):
                    raise RuntimeError(f"{name}: more than {objects.size} bytes")
                view[filled:end] = chunk
                filled = end
            if filled != objects.size:
                raise RuntimeError(f"{name}: {filled} bytes of {objects.size}")
            if landing is not None:
                land(view, landing, name, objects.checksums[name])
            elif checked:
                check(view, name, objects.checksums[name])
            del view
        return filled

    async def run(mode: str, landing: Path | None, checked: bool) -> int:
        loop = asyncio.get_running_loop()
        done = [loop.run_in_executor(pool, one, name, landing, checked) for name in objects.keys]
        return sum(await asyncio.gather(*done))

    async def close() -> None:
        pool.shutdown()
        buffers.close()

    return Read(run, close)


# -- the run ------------------------------------------------------------------------------------------------


def _missing(client: str) -> str | None:
    """Why ``client`` cannot run here (its library is not installed), or None."""
    module = {"obstore": "obstore", "crt": "s3torchconnectorclient", "boto3": "boto3"}.get(client)
    if module is None:
        return None
    import importlib.util

    return None if importlib.util.find_spec(module) else f"{module} is not installed"


async def open_reader(client: str, endpoint: str, objects: ObjectSet, scratch: Path, big: bool) -> Read | None:
    """``client``'s reader of ``objects``, or None where the client does not apply to them."""
    if client == "datacache":
        return await DatacacheReads.open(endpoint, objects, scratch / client, None)
    if client == "datacache-tier":
        return await DatacacheReads.open(endpoint, objects, scratch / client, None, copy=False)
    if client == "datacache-parts":
        # Parts of a quarter of the object: the chunked path (4 ranged GETs in flight per object).
        if not big:
            return None
        return await DatacacheReads.open(endpoint, objects, scratch / client, max(1 << 20, objects.size // 4))
    if client == "boto3":
        return await boto3_reader(endpoint, objects, scratch)
    if client == "obstore":
        return await obstore_reader(endpoint, objects, scratch)
    if client == "crt":
        return await crt_reader(endpoint, objects, scratch)
    raise ValueError(f"unknown client {client!r}")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Figures:
    """One client's figures on one set in one mode: per round, MB/s and CPU seconds per GB."""

    mb_per_s: list[float] = field(default_factory=list)
    cpu_per_gb: list[float] = field(default_factory=list)


async def _timed(read: Read, mode: str, landing: Path | None, expected: int) -> tuple[float, float]:
    cpu, wall = _cpu(), time.perf_counter()
    moved = await read.run(mode, landing, False)
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    if moved != expected:
        raise RuntimeError(f"read {moved} bytes, expected {expected}")
    return moved / wall / 1e6, cpu / (moved / 1e9)


def _fresh(directory: Path) -> Path:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return directory


def _modes(client: str) -> tuple[str, ...]:
    """datacache-tier arrives as datacache does; datacache-parts arrives in `Transfer.copy` only."""
    return ("landed",) if client in ("datacache-tier", "datacache-parts") else MODES


async def _open_all(
    endpoint: str, sets: list[ObjectSet], clients: list[str], scratch: Path, errors: dict[str, str]
) -> dict[tuple[str, str], Read]:
    """Each client's reader of each set, after one untimed read of it checked byte for byte."""
    big = max(s.size for s in sets)
    readers: dict[tuple[str, str], Read] = {}
    for objects in sets:
        for client in clients:
            read = None
            try:
                read = await open_reader(
                    client, endpoint, objects, scratch / "state" / objects.name, objects.size == big
                )
                if read is None:
                    continue
                # Untimed, checked: connections, clients, first page faults.
                for mode in _modes(client):
                    await read.run(mode, _fresh(scratch / "landing") if mode == "landed" else None, True)
            except Exception as exc:
                errors[f"{client} ({objects.name})"] = f"{type(exc).__name__}: {exc}"
                if read is not None:
                    await read.close()
                continue
            readers[objects.name, client] = read
    return readers


async def _measure(
    endpoint: str, sets: list[ObjectSet], clients: list[str], rounds: int, scratch: Path, errors: dict[str, str]
) -> dict[str, dict[str, dict[str, Figures]]]:
    readers = await _open_all(endpoint, sets, clients, scratch, errors)
    figures: dict[str, dict[str, dict[str, Figures]]] = {s.name: {} for s in sets}
    for name, client in readers:
        figures[name][client] = {mode: Figures() for mode in MODES}
    try:
        for number in range(rounds):
            for objects in sets:
                for client in clients:
                    read = readers.get((objects.name, client))
                    for mode in _modes(client) if read is not None else ():
                        assert read is not None
                        landing = _fresh(scratch / "landing") if mode == "landed" else None
                        rate, cpu = await _timed(read, mode, landing, objects.total)
                        entry = figures[objects.name][client][mode]
                        entry.mb_per_s.append(rate)
                        entry.cpu_per_gb.append(cpu)
                        print(
                            f"round {number + 1}, {objects.name}, {client:15s} {mode:7s}: "
                            f"{rate:8,.0f} MB/s, {cpu:5.2f} CPU s/GB",
                            flush=True,
                        )
    finally:
        for read in readers.values():
            await read.close()
    return figures


def start_server() -> tuple[Any, str]:
    from benchmarks.small_files import start_server as start

    return start()


def measure(
    sets: list[tuple[str, int, int]],
    rounds: int,
    clients: list[str],
    endpoint: str | None = None,
    scratch: Path | None = None,
) -> dict[str, Any]:
    """Put the sets ``(name, count, size)`` on a fresh moto server (or ``endpoint``), read them; the figures.

    The landed files go under ``scratch`` (default: ``benchmarks/work``, on the repository's disk).
    """
    started = time.strftime("%Y-%m-%d %H:%M")
    load_start = _loadavg()
    server = None
    if endpoint is None:
        server, endpoint = start_server()
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    # The CRT client reads its credentials from the environment only.
    os.environ.update({"AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": REGION})
    try:
        objects = [put_objects(endpoint, name, count, size) for name, count, size in sets]
        missing = {c: why for c in clients if (why := _missing(c)) is not None}
        errors: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="datacache-clients-", dir=scratch or _scratch_parent()) as work:
            figures = asyncio.run(
                _measure(endpoint, objects, [c for c in clients if c not in missing], rounds, Path(work), errors)
            )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
    return {
        "date": started,
        "load_start": load_start,
        "load_end": _loadavg(),
        "cpus": os.cpu_count(),
        "rounds": rounds,
        "sets": [{"name": o.name, "objects": len(o.keys), "size": o.size} for o in objects],
        "versions": _versions(),
        "missing": missing,
        "errors": errors,
        "figures": {
            name: {client: {mode: vars(f) for mode, f in modes.items()} for client, modes in by_client.items()}
            for name, by_client in figures.items()
        },
    }


def _scratch_parent() -> str | None:
    """Where the landed files go: beside the repository (a real disk), as a local tier would be."""
    work = Path(__file__).resolve().parent / "work"
    work.mkdir(exist_ok=True)
    return str(work)


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        one, five, fifteen = os.getloadavg()
        return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


# -- the table -------------------------------------------------------------------------------------------------


def _spread(values: list[float], digits: int = 0) -> str:
    if not values:
        return ""
    form = f"{{:,.{digits}f}}"
    return f"{form.format(statistics.median(values))} ({form.format(min(values))}-{form.format(max(values))})"


def _ratios(values: list[float], base: list[float]) -> list[float]:
    return [v / b for v, b in zip(values, base) if b]


BASES = {"datacache": "`Transfer.copy`", "datacache-tier": "the tier + the same landing"}
"""What each client's landed figures are compared with: the stager's path today, and the tier as a client."""


def verdicts(result: dict[str, Any]) -> list[str]:
    """Each client clearly ahead of a base, landed: >= 1.2x its MB/s or <= 0.8x its CPU per GB in every round."""
    found = []
    for name, by_client in result["figures"].items():
        for base_name, shown in BASES.items():
            base = by_client.get(base_name, {}).get("landed")
            if not base:
                continue
            for client, modes in by_client.items():
                if client in BASES:
                    continue
                speed = _ratios(modes["landed"]["mb_per_s"], base["mb_per_s"])
                cpu = _ratios(modes["landed"]["cpu_per_gb"], base["cpu_per_gb"])
                if speed and min(speed) >= 1.2:
                    found.append(f"{client} on {name}: MB/s {_list(speed)} of {shown}'s")
                if cpu and max(cpu) <= 0.8:
                    found.append(f"{client} on {name}: CPU per GB {_list(cpu)} of {shown}'s")
    return found


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}x" for v in values)


def _against(modes: dict[str, Any], base: dict[str, Any] | None, client: str, base_name: str) -> str:
    """Landed MB/s and CPU per GB over ``base``'s, round by round: ``"1.10x, 0.98x / 0.85x, ..."``."""
    if not base or client == base_name:
        return ""
    landed = modes["landed"]
    speed = _list(_ratios(landed["mb_per_s"], base["mb_per_s"]))
    return f"{speed} / {_list(_ratios(landed['cpu_per_gb'], base['cpu_per_gb']))}"


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{result['date']}, {result['cpus']} cores; /proc/loadavg at the start `{result['load_start']}`, "
        f"at the end `{result['load_end']}`; {result['rounds']} rounds, median (range); moto on 127.0.0.1, "
        f"{IN_FLIGHT} objects in flight; CPU = user + system of the client process per GB read. The last two "
        "columns: landed MB/s / landed CPU per GB over the base's, each round.",
        "",
    ]
    for objects in result["sets"]:
        name = objects["name"]
        by_client = result["figures"].get(name, {})
        bases = {base: by_client.get(base, {}).get("landed") for base in BASES}
        lines += [
            f"**{objects['objects']} objects of {objects['size'] / 1e6:,.0f} MB** (`{name}`)",
            "",
            "| client | arrive MB/s | arrive CPU s/GB | landed MB/s | landed CPU s/GB "
            "| over `Transfer.copy` | over tier + same landing |",
            "|---|---|---|---|---|---|---|",
        ]
        for client, modes in by_client.items():
            arrive, landed = modes["arrive"], modes["landed"]
            against = [_against(modes, base, client, base_name) for base_name, base in bases.items()]
            lines.append(
                f"| {client} | {_spread(arrive['mb_per_s'])} | {_spread(arrive['cpu_per_gb'], 2)} "
                f"| {_spread(landed['mb_per_s'])} | {_spread(landed['cpu_per_gb'], 2)} | {' | '.join(against)} |"
            )
        lines.append("")
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items())
    lines.append(f"Versions: {versions}.")
    for client, why in result["missing"].items():
        lines.append(f"Not run: {client} ({why}).")
    for client, why in result["errors"].items():
        lines.append(f"Failed: {client}: {why}")
    found = verdicts(result)
    lines.append(
        "Clearly ahead, landed (>= 1.2x MB/s or <= 0.8x CPU per GB in every round): "
        + ("; ".join(found) if found else "none")
        + "."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.clients", description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=8)
    parser.add_argument("--size", default="64MB", help="bytes per large object (default 64MB)")
    parser.add_argument("--small-objects", type=int, default=64, help="0: no set of small objects")
    parser.add_argument("--small-size", default="4MB", help="bytes per small object (default 4MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", nargs="*", default=list(CLIENTS), choices=CLIENTS)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    parser.add_argument("--json", type=Path, help="also write every round's figures here")
    args = parser.parse_args(argv)
    sets = [("large", args.objects, parse_size(args.size))]
    if args.small_objects:
        sets.append(("small", args.small_objects, parse_size(args.small_size)))
    result = measure(sets, args.rounds, args.clients)
    shown = table(result)
    print(shown)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### Client libraries side by side, cold bytes (`benchmarks/clients.py`, issue 25)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
