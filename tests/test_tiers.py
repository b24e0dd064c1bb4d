"""The contract suite run against every tier, and a Hypothesis state machine against a dict model.

`datacache.tiers.testing.TierTests` states what every `Tier` promises (it ships
with the package, for third-party tiers); each subclass here only says how to
make its tier and how to look for temporary files it may have left behind.
The S3 variant runs over real HTTP against the session's moto server.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest
from datacache.tiers import (
    ByteRange,
    LocalTier,
    MemoryTier,
    ObjectTier,
    SharedTier,
    Tier,
    open_origin,
    redact_url,
    validate_key,
)
from datacache.tiers._retry import RetryPolicy, call_with_retry
from datacache.tiers.files import PARTIAL_NAME
from datacache.tiers.testing import (
    BAD_KEYS,
    Boom,
    KeepsMetadataTests,
    TierTests,
    chunks_of,
    failing_chunks,
    keys_of,
    put,
)
from datacache.tiers.testing_land import LandingTests
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from datacache.errors import (
    ConfigError,
    DatacacheError,
    InvalidKeyError,
    ShardNotFoundError,
    TransientOriginError,
    UnsupportedURLError,
)

if TYPE_CHECKING:
    from conftest import S3Bucket

T = TypeVar("T")


class TestMemoryTier(KeepsMetadataTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        return MemoryTier(capacity=10_000)


class DirectoryTierTests(KeepsMetadataTests):
    def temp_files(self, tier: Tier) -> list[str]:
        root = Path(tier.url)
        return sorted(
            str(path.relative_to(root))
            for path in root.rglob("*")
            if path.is_file() and (PARTIAL_NAME.match(path.name) or path.name.endswith(".partial"))
        )

    def test_objects_are_plain_files(self, tier: Tier) -> None:
        self.run(tier, lambda: put(tier, "ds/f.tar", b"plain"))
        assert tier.has_local_paths
        assert tier.path("ds/f.tar").read_bytes() == b"plain"

    def test_symlink_is_never_served(self, tier: Tier, tmp_path: Path) -> None:
        secret = tmp_path / "secret.txt"
        secret.write_bytes(b"outside the tier")
        self.run(tier, lambda: put(tier, "ds/real", b"r"))
        link = tier.path("ds/link")
        link.symlink_to(secret)

        async def body() -> None:
            assert await tier.stat("ds/link") is None
            with pytest.raises(ShardNotFoundError):
                await tier.get("ds/link")
            assert await keys_of(tier) == ["ds/real"]

        self.run(tier, body)

    def test_symlinked_directory_cannot_escape(self, tier: Tier, tmp_path: Path) -> None:
        outside = tmp_path / "outside"
        outside.mkdir()
        (outside / "f").write_bytes(b"outside the tier")
        self.run(tier, lambda: put(tier, "ds/real", b"r"))
        tier.path("ds/real").parent.joinpath("escape").symlink_to(outside, target_is_directory=True)

        async def body() -> None:
            with pytest.raises(InvalidKeyError):
                await tier.get("ds/escape/f")
            with pytest.raises(InvalidKeyError):
                await tier.put("ds/escape/g", chunks_of(b"no"))

        self.run(tier, body)
        assert not (outside / "g").exists()

    def test_abandoned_partials_are_removed_but_live_ones_kept(self, tier: Tier) -> None:
        assert isinstance(tier, LocalTier | SharedTier)
        directory = tier.path("ds/x").parent
        directory.mkdir(parents=True)
        dead = directory / f".x.{uuid.uuid4().hex}.partial"
        dead.write_bytes(b"left by a killed writer")
        gate = asyncio.Event

        async def body() -> int:
            started, never = gate(), gate()

            async def stalled() -> AsyncIterator[bytes]:
                yield b"live"
                started.set()
                await never.wait()

            writer = asyncio.create_task(tier.put("ds/live", stalled()))
            await started.wait()
            removed = await tier.remove_abandoned_partials(min_age=0)
            assert len(self.temp_files(tier)) == 1, "a live writer's partial file was removed"
            writer.cancel()
            with pytest.raises(asyncio.CancelledError):
                await writer
            return removed

        assert self.run(tier, body) == 1
        assert not dead.exists()
        assert self.temp_files(tier) == []


class TestLocalTier(LandingTests, DirectoryTierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        return LocalTier(tmp_path / "local", capacity=1 << 30)


class TestSharedTier(DirectoryTierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        return SharedTier(tmp_path / "shared")


class TestFileObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        (tmp_path / "origin").mkdir()
        return ObjectTier(f"file://{tmp_path / 'origin'}", writable=True)

    def temp_files(self, tier: Tier) -> list[str]:
        assert isinstance(tier, ObjectTier)
        root = Path(tier.url.removeprefix("file://"))
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
        return [name for name in names if "partial" in name]

    def test_read_only_tier_refuses_writes(self, tmp_path: Path) -> None:
        (tmp_path / "ro").mkdir()
        (tmp_path / "ro" / "a").write_bytes(b"a")
        tier = ObjectTier(f"file://{tmp_path / 'ro'}")

        async def body() -> None:
            with pytest.raises(PermissionError):
                await tier.put("b", chunks_of(b"b"))
            with pytest.raises(PermissionError):
                await tier.delete("a")
            assert await tier.get("a") == b"a"

        self.run(tier, body)
        assert (tmp_path / "ro" / "a").exists()


class TestMemoryObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        root = f"memory://datacache-tests/{uuid.uuid4().hex}"
        request.addfinalizer(lambda: self._clear(root))
        return ObjectTier(root, writable=True)

    @staticmethod
    def _clear(root: str) -> None:
        import fsspec

        fs = fsspec.filesystem("memory")
        if fs.exists(root):
            fs.rm(root, recursive=True)

    def temp_files(self, tier: Tier) -> list[str]:
        import fsspec

        fs = fsspec.filesystem("memory")
        base = tier.url.removeprefix("memory://")
        found = fs.find(base) if fs.exists(base) else []
        return [path for path in found if "partial" in path or "datacache-upload" in path]


class TestS3ObjectTier(TierTests):
    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        bucket: S3Bucket = request.getfixturevalue("s3")
        self.bucket = bucket
        return ObjectTier(
            bucket.url("prefix/data"),
            storage_options=bucket.storage_options,
            writable=True,
            part_size=5 << 20,
        )

    def temp_files(self, tier: Tier) -> list[str]:
        uploads = self.bucket.client.list_multipart_uploads(Bucket=self.bucket.name).get("Uploads", [])
        return [upload["Key"] for upload in uploads]

    def test_failed_multipart_put_is_aborted(self, tier: Tier) -> None:
        """A put larger than one part that fails after sending a part leaves no upload behind."""
        data = os.urandom(6 << 20)

        async def body() -> None:
            with pytest.raises(Boom):
                await tier.put("big", failing_chunks(data, size=1 << 20))
            assert await tier.stat("big") is None

        self.run(tier, body)
        assert self.temp_files(tier) == []
        counts = self.bucket.server.request_counts()
        assert any(name.startswith("DELETE") for name in counts), counts  # the abort

    def test_multipart_put_round_trip(self, tier: Tier) -> None:
        data = os.urandom(11 << 20)

        async def body() -> None:
            info = await tier.put("big", chunks_of(data, size=1 << 20))
            assert info.size == len(data)
            assert await tier.get("big", ByteRange(5 << 20, (5 << 20) + 10)) == data[5 << 20 : (5 << 20) + 10]
            assert await tier.get("big") == data

        self.run(tier, body)
        assert self.temp_files(tier) == []

    def test_an_abandoned_stream_frees_its_get_thread(self, s3: S3Bucket) -> None:
        """GETs run in a pool thread: a consumer that stops early must not leave it blocked."""
        data = os.urandom(12 << 20)
        s3.put("prefix/one-thread/big", data)
        tier = ObjectTier(s3.url("prefix/one-thread"), storage_options=s3.storage_options, threads=1)

        async def body() -> None:
            stream = tier.stream("big", chunk_size=1 << 20)
            first = await anext(stream)
            assert first == data[: len(first)]
            await stream.aclose()
            # The pool has one thread: this GET only runs if the abandoned one let it go.
            # (The timeout turns a regression into a failure instead of a hung suite.)
            assert await asyncio.wait_for(tier.get("big", ByteRange(0, 10)), 60) == data[:10]
            assert b"".join([chunk async for chunk in tier.stream("big")]) == data

        self.run(tier, body)

    def test_missing_bucket_is_named(self, s3: S3Bucket) -> None:
        tier = ObjectTier(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/x", storage_options=s3.storage_options)
        with pytest.raises(ShardNotFoundError, match=r"bucket .* does not exist"):
            self.run(tier, lambda: keys_of(tier))

    def test_keys_outside_the_prefix_are_not_listed(self, tier: Tier) -> None:
        self.bucket.put("prefix/data-other/x", b"not ours")
        self.bucket.put("prefix/datax", b"not ours")
        self.run(tier, lambda: put(tier, "mine", b"ours"))
        assert self.run(tier, lambda: keys_of(tier)) == ["mine"]


# -- outside the contract: keys, URLs, retries --------------------------------


@pytest.mark.parametrize("key", [*BAD_KEYS, "a" * 2000, "a/" + "b" * 300])
def test_validate_key_rejects(key: str) -> None:
    with pytest.raises(InvalidKeyError, match="invalid key"):
        validate_key(key)


@pytest.mark.parametrize("key", ["a", "a/b/c.tar", "..a", "a..", ".hidden", "a b/ü.tar"])
def test_validate_key_accepts(key: str) -> None:
    assert validate_key(key) == key


def test_open_origin_rejects_unknown_scheme() -> None:
    with pytest.raises(UnsupportedURLError, match="unsupported URL scheme 'nosuch'"):
        open_origin("nosuch://bucket/x")


@pytest.mark.parametrize("url", ["S3://bucket/x/", "HTTP://127.0.0.1:1/shard.tar", "File:///tmp/x"])
def test_an_uppercase_scheme_is_refused_naming_the_lower_case_one(url: str) -> None:
    scheme = url.split("://", 1)[0]
    with pytest.raises(UnsupportedURLError, match=rf"write the scheme in lower case \({scheme.lower()}://\)"):
        open_origin(url)


@pytest.mark.parametrize("url", ["", "s3://", "s3:///"])
def test_open_origin_rejects_empty_urls(url: str) -> None:
    with pytest.raises(ConfigError):
        open_origin(url)


def test_a_storage_option_typo_is_refused_where_the_backend_would_fail(tmp_path: Path) -> None:
    # s3fs hands unknown options to aiobotocore, which raises a bare TypeError on first use.
    with pytest.raises(ConfigError, match=r"storage option 'endpoint'.*did you mean 'endpoint_url'\?"):
        open_origin("s3://bucket/prefix/", storage_options={"endpoint": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match=r"storage option 'nonsense' is not an option of s3://"):
        open_origin("s3://bucket/prefix/", storage_options={"nonsense": 1})
    # Every option s3fs or its session takes is accepted.
    open_origin("s3://bucket/prefix/", storage_options={"endpoint_url": "x", "profile": "p", "anon": True})


def test_a_storage_option_typo_is_named_where_the_backend_would_ignore_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # fsspec's local filesystem ignores unknown options: the typo is logged, not fatal.
    with caplog.at_level("WARNING", logger="datacache.tiers"):
        open_origin(str(tmp_path), storage_options={"auto_mkdirs": True})
    assert "storage option 'auto_mkdirs'" in caplog.text
    assert "did you mean 'auto_mkdir'?" in caplog.text


def test_urls_never_show_credentials() -> None:
    tier = ObjectTier("s3://AKIAEXAMPLE:hunter2@bucket/prefix/", storage_options={"secret": "hunter2"})
    assert "hunter2" not in tier.url
    assert "hunter2" not in repr(tier)
    assert "AKIA" not in tier.url
    assert redact_url("https://user:pw@host/x") == "https://host/x"


def test_retry_policy_retries_transient_errors_then_gives_up() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionResetError("reset by peer")
        return "ok"

    policy = RetryPolicy(max_attempts=5, base_delay=0.001, max_delay=0.002)
    assert asyncio.run(call_with_retry(flaky, where="x", policy=policy)) == "ok"
    assert calls == 3

    async def always() -> str:
        raise ConnectionResetError("reset by peer")

    with pytest.raises(TransientOriginError, match="gave up after 2 attempts"):
        asyncio.run(call_with_retry(always, where="x", policy=RetryPolicy(max_attempts=2, base_delay=0.001)))

    permanent = 0

    async def missing() -> str:
        nonlocal permanent
        permanent += 1
        raise FileNotFoundError("gone")

    with pytest.raises(ShardNotFoundError):
        asyncio.run(call_with_retry(missing, where="x", policy=policy))
    assert permanent == 1


def test_retry_delays_are_capped_with_jitter() -> None:
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0)
    for attempt in range(1, 20):
        delay = policy.delay(attempt)
        assert 0 <= delay <= min(1.0, 0.1 * 2 ** (attempt - 1))


# -- a state machine against a dict model (zarr testing/stateful.py) ----------

KEYS = st.sampled_from(["k0", "k1", "k2", "d/k0", "d/k1", "d/e/k2", "e/k3"])
PREFIXES = st.sampled_from(["", "k", "d/", "d/e/", "e", "x"])


class TierModelMachine(RuleBasedStateMachine):
    """Random puts, deletes, reads and listings; the tier must always agree with a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, bytes] = {}
        self.loop = asyncio.new_event_loop()
        self.tier = self.make_tier()

    def make_tier(self) -> Tier:
        raise NotImplementedError

    def run(self, coroutine: Awaitable[T]) -> T:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        self.run(self.tier.close())
        self.loop.close()

    written = Bundle("written")

    @rule(target=written, key=KEYS, data=st.binary(max_size=300))
    def put(self, key: str, data: bytes) -> str:
        self.run(self.tier.put(key, chunks_of(data, 13)))
        self.model[key] = data
        return key

    @rule(key=KEYS, data=st.binary(min_size=1, max_size=100))
    def failed_put(self, key: str, data: bytes) -> None:
        with pytest.raises(Boom):
            self.run(self.tier.put(key, failing_chunks(data, 13)))

    @rule(key=st.one_of(written, KEYS))
    def delete(self, key: str) -> None:
        existed = self.run(self.tier.delete(key))
        assert existed == (key in self.model)
        self.model.pop(key, None)

    @rule(
        key=st.one_of(written, KEYS),
        start=st.integers(0, 400),
        length=st.none() | st.integers(0, 400),
    )
    def get(self, key: str, start: int, length: int | None) -> None:
        span = ByteRange(start, None if length is None else start + length)
        if key not in self.model:
            with pytest.raises(ShardNotFoundError):
                self.run(self.tier.get(key, span))
            return
        expected = self.model[key][span.start : span.end]
        assert self.run(self.tier.get(key, span)) == expected

    @rule(key=st.one_of(written, KEYS))
    def stat(self, key: str) -> None:
        info = self.run(self.tier.stat(key))
        if key in self.model:
            assert info is not None and info.size == len(self.model[key])
        else:
            assert info is None

    @rule(prefix=PREFIXES)
    def list(self, prefix: str) -> None:
        async def collect() -> list[tuple[str, int]]:
            return [(info.key, info.size) async for info in self.tier.list(prefix)]

        expected = sorted((k, len(v)) for k, v in self.model.items() if k.startswith(prefix))
        assert self.run(collect()) == expected

    @precondition(lambda self: bool(self.model))
    @rule()
    def pickle_round_trip(self) -> None:
        clone = pickle.loads(pickle.dumps(self.tier))
        if not isinstance(clone, MemoryTier):
            self.run(clone.close())
        assert clone.url == self.tier.url

    @invariant()
    def usage_matches(self) -> None:
        usage = self.run(self.tier.usage())
        assert usage.used_bytes == sum(len(v) for v in self.model.values())
        assert usage.object_count == len(self.model)


class MemoryTierMachine(TierModelMachine):
    def make_tier(self) -> Tier:
        return MemoryTier()


class LocalTierMachine(TierModelMachine):
    def make_tier(self) -> Tier:
        self.directory = tempfile.mkdtemp(prefix="datacache-stateful-")
        return LocalTier(self.directory, durable=False)

    def teardown(self) -> None:
        super().teardown()
        leftovers = [p for p in Path(self.directory).rglob("*") if p.name.endswith(".partial")]
        shutil.rmtree(self.directory)
        assert leftovers == []


class FileObjectTierMachine(TierModelMachine):
    def make_tier(self) -> Tier:
        self.directory = tempfile.mkdtemp(prefix="datacache-stateful-")
        return ObjectTier(f"file://{self.directory}", writable=True)

    def teardown(self) -> None:
        super().teardown()
        shutil.rmtree(self.directory)


_MACHINE_SETTINGS = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestMemoryTierMachine = _MACHINE_SETTINGS(MemoryTierMachine).TestCase
TestLocalTierMachine = _MACHINE_SETTINGS(LocalTierMachine).TestCase
TestFileObjectTierMachine = _MACHINE_SETTINGS(FileObjectTierMachine).TestCase


def test_datacache_error_roots() -> None:
    assert issubclass(ShardNotFoundError, FileNotFoundError)
    assert issubclass(InvalidKeyError, ValueError)
    assert issubclass(ShardNotFoundError, DatacacheError)


def test_unreachable_endpoint_is_retried_then_reported() -> None:
    """A refused connection is transient: retried by the policy, then named."""
    tier = ObjectTier(
        "s3://bucket/x",
        storage_options={"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"},
        retry=RetryPolicy(max_attempts=3, base_delay=0.001, max_delay=0.002),
    )

    async def body() -> None:
        try:
            await tier.get("a.tar")
        finally:
            await tier.close()

    with pytest.raises(TransientOriginError, match="gave up after 3 attempts"):
        asyncio.run(body())
    assert tier.stats().retries == 2


def test_the_contract_suite_ships_with_the_package_and_datacache_tiers_does_not_import_pytest() -> None:
    import subprocess
    import sys

    code = (
        "import sys, datacache.tiers; assert 'pytest' not in sys.modules, 'datacache.tiers imported pytest'; "
        "from datacache.tiers.testing import TierTests, KeepsMetadataTests; print(TierTests.__module__)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "datacache.tiers.testing"
    assert TierTests.__module__ == "datacache.tiers.testing"


def test_a_host_based_fsspec_url_reaches_the_host_it_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ftp://host:port/...``: fsspec takes host and port from the URL (a new user's ftp:// was a TypeError)."""
    import socket

    from datacache.cli import main

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once this is closed
    monkeypatch.setenv("DATACACHE_LOCAL_DIR", str(tmp_path / "local"))
    assert main(["warm", f"ftp://127.0.0.1:{port}/data/", "--no-daemon"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Connection refused" in err[0], err


_USED_AFTER_CLOSE = """
import asyncio, os, sys
from datacache.tiers import ObjectTier

async def main():
    tier = ObjectTier(sys.argv[1])
    await tier.stat("shard-0000.tar")
    await tier.close()  # the process ends its client (a DataLoader worker's runtime, at exit)...
    try:
        await tier.stat("shard-0000.tar")  # ...while a prefetch still in flight asks the origin
    except Exception as exc:
        print(type(exc).__name__, exc)

asyncio.run(main())
print("the user's last line")
"""


def test_an_object_tier_used_after_close_opens_no_session_nothing_would_close(
    s3: S3Bucket, tmp_path: Path
) -> None:
    """The drop-in through the daemon printed "Unclosed client session" at exit now and then: the client's
    own origin tier (it reads shards not cached) made a new session for a read still in flight after the
    runtime closed it, and nothing closed that one."""
    import subprocess
    import sys

    s3.put("ds/shard-0000.tar", b"x" * 100)
    run = subprocess.run(
        [sys.executable, "-c", _USED_AFTER_CLOSE, s3.url("ds")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONWARNINGS": "default"},
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "the user's last line"
    assert "is closed" in run.stdout
    assert "Unclosed" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
