"""Security properties, each with a test that fails if it breaks.

The socket's permissions, the metrics port's binding (and what it serves),
path containment of every key and member name, symlinks planted in a shared
tier, and redaction of credentials. docs/RELIABILITY.md lists these together
with the tests elsewhere that guard the same properties.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _daemon import REPO, daemon_env, make_shards, start_daemon, wait_until
from _helpers import run_cli
from datacache.tiers import LocalTier, SharedTier, redact_url, validate_key
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datacache.config import Settings, dataset_id_for, load_settings
from datacache.errors import InvalidKeyError
from datacache.locks import lock_name
from datacache.manifest import ManifestStore
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# -- the socket -----------------------------------------------------------------------------


def test_the_socket_is_0660_and_the_cache_0700_even_under_a_permissive_umask(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    local = tmp_path / "cache"
    env = daemon_env(cache_env, local, local / "daemon.sock")
    log = (tmp_path / "daemon.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "datacache.cli", "serve", "--metrics-address", "127.0.0.1:0"],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: os.umask(0),  # noqa: PLW1509 - umask only, before exec
    )
    try:
        wait_until(
            lambda: (local / "daemon.sock").exists() and _answers(local / "daemon.sock"),
            timeout=60,
            what="the daemon's socket",
        )
        assert stat.S_IMODE((local / "daemon.sock").stat().st_mode) == 0o660
        # The shard files and manifests are its group's to read (its clients); its locks its own.
        for directory, mode in ((local, 0o750), (local / "locks", 0o700), (local / "daemon", 0o750)):
            assert stat.S_IMODE(directory.stat().st_mode) == mode, directory
        # Nothing the daemon wrote is writable by others.
        for path in local.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert not path.stat().st_mode & stat.S_IWOTH, path
    finally:
        process.kill()
        process.wait(30)
        log.close()


def _answers(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def test_a_symlink_or_file_at_the_socket_path_is_never_followed(tmp_path: Path, cache_env: dict[str, str]) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    victim.chmod(0o600)
    socket_path = tmp_path / "run" / "daemon.sock"
    socket_path.parent.mkdir()
    socket_path.symlink_to(victim)
    daemon = start_daemon(cache_env, tmp_path / "cache", socket_path=socket_path, wait=False)
    try:
        assert daemon.process.wait(timeout=60) == 1
    finally:
        daemon.kill()
    assert "is not a socket" in daemon.log_text()
    assert victim.read_text() == "keep me" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert socket_path.is_symlink()


# -- the metrics port -----------------------------------------------------------------------


def test_the_metrics_port_defaults_to_loopback_and_serves_no_control_verbs(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    assert load_settings(cache_env).metrics_address.startswith("127.0.0.1:")
    help_text = run_cli(["serve", "--help"], cache_env).stdout
    assert "127.0.0.1:9464" in help_text
    daemon = start_daemon(cache_env, tmp_path / "cache")
    try:
        host, port = daemon.status()["metrics_address"].rsplit(":", 1)
        assert host == "127.0.0.1"
        assert _listening_address(int(port)) == "127.0.0.1", "bound to loopback only, not every interface"
        base = f"http://127.0.0.1:{port}"
        origin = tmp_path / "origin"
        make_shards(origin, 2, 1000)
        for method, path, body in [
            ("POST", "/v1/open", {"dataset": str(origin)}),
            ("POST", "/v1/evict", {"dataset": "x", "tier": "all"}),
            ("GET", "/v1/status", None),
            ("POST", "/v1/pin", {"dataset": "x"}),
        ]:
            data = json.dumps(body).encode() if body is not None else None
            request = urllib.request.Request(base + path, data=data, method=method)
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(request, timeout=10)
            assert caught.value.code in (404, 405), (path, caught.value.code)
            caught.value.close()
        assert daemon.status()["datasets"] == [], "nothing was opened over TCP"
    finally:
        daemon.kill()


def _listening_address(port: int) -> str:
    """The local address a TCP socket listens on at ``port``, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


# -- path containment of every key and member name ------------------------------------------


keys = st.text(max_size=60) | st.lists(
    st.sampled_from(
        ["a", "..", ".", "", "b.tar", "\x00", "/", "\\", "~", ".a.0123456789abcdef0123456789abcdef.partial"]
    ),
    max_size=5,
).map("/".join)


@PROPERTY
@given(key=keys)
def test_every_key_is_contained_or_refused(tmp_path: Path, key: str) -> None:
    tier = LocalTier(tmp_path / "tier")
    root = os.path.realpath(tmp_path / "tier")
    try:
        validate_key(key)
    except InvalidKeyError:
        with pytest.raises(InvalidKeyError):
            tier.path(key)
        return
    for path in (tier.path(key), tmp_path / "locks" / lock_name("ds", key)):
        resolved = os.path.realpath(path)
        base = root if path == tier.path(key) else os.path.realpath(tmp_path / "locks")
        assert resolved.startswith(base + os.sep), (key, resolved)


@PROPERTY
@given(url=st.text(max_size=80) | st.sampled_from(["s3://b/../../etc", "/", "s3://AK:pw@b/p", "..", "a/../../b"]))
def test_dataset_ids_are_one_safe_path_segment(url: str) -> None:
    identifier = dataset_id_for(url)
    validate_key(identifier)
    assert "/" not in identifier and identifier not in (".", "..")


def test_manifest_store_refuses_escaping_dataset_ids(tmp_path: Path) -> None:
    store = ManifestStore(tmp_path / "manifests")
    for bad in ("../x", "/etc/passwd", "a/../../b", ""):
        with pytest.raises(InvalidKeyError):
            asyncio.run(store.load(bad))


def test_member_names_never_become_paths(tmp_path: Path, settings: Settings) -> None:
    """A tar whose members are named to escape is cached and read as bytes; nothing is written by name."""
    import io
    import tarfile

    from datacache.loaders import CachedIterableDataset

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in ("../../escape.bin", "/etc/evil.bin", "ok/../../../x.bin", "s1.bin"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    origin = tmp_path / "origin"
    origin.mkdir()
    (origin / "t.tar").write_bytes(out.getvalue())
    samples = list(CachedIterableDataset(str(origin), config=settings, shuffle=False))
    assert sorted(s["__key__"] for s in samples) == ["../../escape", "/etc/evil", "ok/../../../x", "s1"]
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert not written & {"escape.bin", "evil.bin", "x.bin"}
    assert not (tmp_path.parent / "escape.bin").exists()


# -- symlinks planted in a shared tier ------------------------------------------------------


def _warm(settings: Settings, url: str) -> Any:
    async def main() -> Any:
        async with Stager(settings) as stager:
            handle = await stager.open(url)
            return await stager.warm(handle)

    return asyncio.run(main())


@pytest.mark.parametrize("planted", ["data-file", "meta-dir", "lock-dir", "data-dir"])
def test_symlinks_planted_in_the_shared_tier_are_not_followed(planted: str, tmp_path: Path, settings: Settings) -> None:
    """Whoever can write the shared filesystem plants a symlink: nothing is read through it or written beyond it."""
    assert settings.shared_dir is not None
    origin = tmp_path / "origin"
    shards = make_shards(origin, 3, 5000)
    url = str(origin)
    dataset = dataset_id_for(url)
    outside = tmp_path / "outside"
    outside.mkdir()
    shared = SharedTier(settings.shared_dir)
    if planted == "data-file":
        # A "shard" of the right size that is a link to someone else's file.
        secret = outside / "secret.bin"
        secret.write_bytes(b"s" * 5000)
        target = settings.shared_dir / "data" / dataset / "shard-0001.tar"
        target.parent.mkdir(parents=True)
        target.symlink_to(secret)
    else:
        where = {"meta-dir": "meta", "lock-dir": "locks", "data-dir": "data"}[planted]
        link = settings.shared_dir / where / dataset
        link.parent.mkdir(parents=True)
        link.symlink_to(outside, target_is_directory=True)
    if planted == "lock-dir":
        # A file of someone else's that looks like a lock held by a live process: followed, the
        # link would make the stager wait for it, then delete it as stale.
        (outside / "shard-0000.tar.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    report = _warm(replace(settings, lease_seconds=1.0), url)
    # Every shard is resident on the local tier with the origin's bytes.
    assert report.shards_resident == 3, report
    for key, data in shards.items():
        assert (settings.local_dir / "data" / dataset / key).read_bytes() == data
    # Nothing was written through the link, and the linked file is untouched.
    expected = {"data-file": ["secret.bin"], "lock-dir": ["shard-0000.tar.lock"]}.get(planted, [])
    assert sorted(p.name for p in outside.iterdir()) == expected
    if planted == "data-file":
        assert (outside / "secret.bin").read_bytes() == b"s" * 5000
    assert shared is not None


# -- credentials ----------------------------------------------------------------------------


REDACTION_INPUT = dict(
    scheme=st.sampled_from(["s3", "gs", "https", "az", "s3a"]),
    user=st.text(
        st.characters(blacklist_characters="/@ \t\n\r\x0b\x0c"), min_size=1, max_size=10
    ),
    password=st.text(st.characters(whitelist_categories=("L", "N")), min_size=6, max_size=16),
    before=st.text(max_size=20),
    after=st.text(max_size=20),
)


@PROPERTY
@given(**REDACTION_INPUT)
# Found by `make test-faults`: Unicode whitespace in the userinfo ended the URL before its secret.
@example(scheme="s3", user="\u2000", password="000000", before="", after="")
@example(scheme="gs", user="a\xa0b", password="hunter22", before="x", after="\x85")
def test_redaction_removes_userinfo_from_urls_anywhere_in_a_message(
    scheme: str, user: str, password: str, before: str, after: str
) -> None:
    url = f"{scheme}://{user}:{password}@bucket/prefix"
    assert password not in redact_url(url)
    message = f"{before} {url} {after}"
    if password not in before + after:
        assert password not in redact_url(message)


def test_usage_errors_never_echo_a_credential(cache_env: dict[str, str]) -> None:
    result = run_cli(["ls", "s3://AKIAEXAMPLE:hunter2secret@bucket/prefix"], cache_env)
    assert result.returncode == 2
    assert "hunter2secret" not in result.stderr + result.stdout
    assert result.stderr.count("\n") == 1


def test_an_origin_refusal_never_echoes_the_credentials(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    s3.put("ds/a.tar", b"x" * 100)
    env = {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}
    env.update(
        {
            "AWS_ENDPOINT_URL": s3.server.endpoint,
            "AWS_ACCESS_KEY_ID": "AKIAREDACTME",
            "AWS_SECRET_ACCESS_KEY": "hunter2-very-secret",
            "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
            "DATACACHE_MAX_ATTEMPTS": "1",
        }
    )
    for url in (f"s3://AKIAREDACTME:hunter2-very-secret@{s3.name}/missing", "s3://no-such-bucket-xyz/p"):
        result = run_cli(["warm", url, "-v"], env)
        assert result.returncode != 0
        text = result.stdout + result.stderr
        assert "hunter2-very-secret" not in text and "AKIAREDACTME:" not in text, text
    for path in (tmp_path / "local").rglob("*"):
        if path.is_file():
            assert b"hunter2-very-secret" not in path.read_bytes(), path


# -- the same properties, ten times longer, in `make test-faults` -----------------------------


@pytest.mark.faults
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=keys)
def test_every_key_is_contained_or_refused_long(tmp_path: Path, key: str) -> None:
    test_every_key_is_contained_or_refused.hypothesis.inner_test(tmp_path, key)


@pytest.mark.faults
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(**REDACTION_INPUT)
def test_redaction_long(**kwargs: Any) -> None:
    test_redaction_removes_userinfo_from_urls_anywhere_in_a_message.hypothesis.inner_test(**kwargs)
