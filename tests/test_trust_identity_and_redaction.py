"""The cache never grants what the origin would not: dataset identity and secrets in URLs.

A dataset's identity is its canonical origin (names are aliases), no credential
or signed query reaches an id, a directory, a log line or a sample, and the
"no credentials in the URL" guard sees secrets however they are spelled.
docs/SECURITY.md, "Trust in cached data", states the rules these tests hold.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from _daemon import make_shards
from _helpers import run_cli, tar_of
from datacache.tiers import open_origin, redact_url
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from datacache.config import DatasetConfig, Settings, dataset_id_for, load_settings, resolve_dataset
from datacache.errors import ConfigError
from datacache.staging import Stager


def write_tars(directory: Path, shards: int, samples: int, text: str) -> dict[str, bytes]:
    """``shards`` WebDataset tars of ``samples`` samples each; every payload reads ``text``."""
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    for shard in range(shards):
        name = f"shard-{shard:04d}.tar"
        written[name] = tar_of({f"s{shard:03d}{i:04d}.txt": f"{text} {shard}.{i}".encode() for i in range(samples)})
        (directory / name).write_bytes(written[name])
    return written


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- secrets in URLs ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "secret", "expected"),
    [
        ("s3://AKIAEXAMPLE:wJalr/XUtnFEMI/K7MDENG@bucket/p", "K7MDENG", "s3://bucket/p"),
        ("https://user:p@ss@host/x", "p@ss", "https://host/x"),
        ("https://host/x.tar?sig=SIGSECRET&se=2030", "SIGSECRET", "https://host/x.tar?sig=REDACTED&se=REDACTED"),
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA%2F1&X-Amz-Signature=abc123def",
            "abc123def",
            "https://b.s3.amazonaws.com/k?X-Amz-Credential=REDACTED&X-Amz-Signature=REDACTED",
        ),
        ("error reading 's3://AK:se/cr@et@b/k' (denied)", "se/cr", "error reading 's3://b/k' (denied)"),
    ],
)
def test_redaction_of_secrets_with_slashes_at_signs_and_query_tokens(url: str, secret: str, expected: str) -> None:
    assert secret not in redact_url(url)
    assert redact_url(url) == expected


def test_redaction_keeps_what_is_not_a_credential() -> None:
    for url in ("https://host:8080/a@b/c", "s3://bucket/img@2x.png", "/data/a:b@c", "file:///x/y", "s3://b/p"):
        assert redact_url(url) == url


secrets_with_slashes = st.text(st.sampled_from("abcXYZ0189+=/@:~!$*()"), min_size=8, max_size=40).filter(
    lambda s: not s.startswith(("/", "@"))
)
users = st.text(st.sampled_from("AKIAXYZ0123456789"), min_size=1, max_size=20)


@PROPERTY
@given(scheme=st.sampled_from(["s3", "s3a", "gs", "az"]), user=users, secret=secrets_with_slashes)
def test_object_store_secrets_never_survive_redaction_the_id_or_the_guard(scheme: str, user: str, secret: str) -> None:
    url = f"{scheme}://{user}:{secret}@bucket/prefix"
    assert redact_url(url) == f"{scheme}://bucket/prefix"
    identity = dataset_id_for(url)
    assert secret not in identity and identity == dataset_id_for(f"{scheme}://bucket/prefix")
    if scheme in ("s3", "s3a", "gs"):
        with pytest.raises(ConfigError, match="cannot carry credentials") as caught:
            open_origin(url)
        assert secret not in str(caught.value)


@PROPERTY
@given(
    user=st.text(st.sampled_from("abcdef-_.0123"), min_size=1, max_size=10),
    password=st.text(st.sampled_from("abcXYZ0189+=@:~!$*"), min_size=8, max_size=30).filter(
        lambda s: not s.startswith("@")
    ),
    tokens=st.dictionaries(
        st.sampled_from(["sig", "X-Amz-Signature", "X-Amz-Security-Token", "token", "sv", "se"]),
        st.text(st.sampled_from("abcdefXYZ0123456789%-_."), min_size=12, max_size=30),
        max_size=4,
    ),
    before=st.text(max_size=10).map(lambda s: s + " "),
)
def test_https_userinfo_and_query_tokens_never_survive_redaction(
    user: str, password: str, tokens: dict[str, str], before: str
) -> None:
    assume(all(secret not in before for secret in (password, *tokens.values())))
    query = "&".join(f"{name}={value}" for name, value in tokens.items())
    url = f"https://{user}:{password}@host.example/data/x.tar" + (f"?{query}" if query else "")
    redacted = redact_url(f"{before}{url} failed")
    assert password not in redacted
    for value in tokens.values():
        assert value not in redacted
    assert "host.example/data/x.tar" in redacted
    # Both may change what the origin returns (issue 33, items 4 and 5): each is its own dataset,
    # and the id shows neither.
    dataset_id = dataset_id_for(url)
    assert dataset_id != dataset_id_for("https://host.example/data/x.tar")
    assert password not in dataset_id and not any(value in dataset_id for value in tokens.values())


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("https://h/cb#access_token=ya29.SECRET-TOKEN&token_type=bearer", "SECRET-TOKEN"),
        ("https://h/cb#state=1&id_token=SECRET.JWT", "SECRET.JWT"),
        ("https://h/data/x.tar;jsessionid=SECRET0123?a=1", "SECRET0123"),
        ("http://h/a;token=SECRET;v=2/b.tar", "SECRET"),
    ],
)
def test_redaction_covers_fragments_and_path_parameters(url: str, secret: str) -> None:
    """Issue 23 item 10: OAuth tokens in a fragment, session ids in a ";" parameter."""
    redacted = redact_url(f"reading {url} failed")
    assert secret not in redacted and "REDACTED" in redacted, redacted
    assert secret not in dataset_id_for(url)


def test_a_password_with_at_signs_is_cut_at_the_last_one() -> None:
    """Issue 23 item 17: userinfo ends at the last "@" of the authority, not the first."""
    assert redact_url("https://user:p@ss@host/x") == "https://host/x"
    assert redact_url("http://u:a@b@c@host:8080/x?q=1") == "http://host:8080/x?q=REDACTED"
    # The whole userinfo is who asks (part of the identity, issue 33 item 4); the host is the same.
    with_at = dataset_id_for("https://user:p@ss@host/x")
    assert with_at.startswith("x-") and with_at != dataset_id_for("https://host/x")
    assert with_at != dataset_id_for("https://user:p@other@host/x")


@PROPERTY
@given(
    user=st.text(st.sampled_from("abcXYZ019._-"), min_size=1, max_size=12),
    password=st.text(st.sampled_from("abcXYZ0189+=!$*()~@"), min_size=1, max_size=30).filter(lambda p: "@" in p),
)
def test_https_passwords_with_at_signs_never_survive_redaction(user: str, password: str) -> None:
    url = f"https://{user}:{password}@host.example/data/x.tar"
    assert redact_url(url) == "https://host.example/data/x.tar"


# -- a dataset's identity is its origin -----------------------------------------------------


def test_identity_is_the_canonical_origin_not_the_spelling() -> None:
    same = ["s3://bucket/wds", "s3://bucket/wds/", "s3a://bucket//wds/./", "s3://AK:se/cret@bucket/wds?x=1"]
    assert len({dataset_id_for(url) for url in same}) == 1
    assert dataset_id_for("/data/../data/wds") == dataset_id_for("file:///data/wds")
    other_endpoint = {"endpoint_url": "http://127.0.0.1:9000"}
    assert dataset_id_for("s3://bucket/wds", other_endpoint) != dataset_id_for("s3://bucket/wds")
    assert dataset_id_for("s3://bucket/wds", {"client_kwargs": other_endpoint}) == dataset_id_for(
        "s3://bucket/wds", other_endpoint
    )
    assert dataset_id_for("s3://bucket/wds", env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}) == dataset_id_for(
        "s3://bucket/wds", other_endpoint
    )
    assert dataset_id_for("s3://bucket/wds") != dataset_id_for("gs://bucket/wds")


def test_a_name_is_an_alias_never_a_directory(tmp_path: Path, settings: Settings) -> None:
    """A name with '/' (or another dataset's id) cannot nest in, or alias, another dataset's directory."""
    origin = tmp_path / "origin"
    make_shards(origin, 2, 1000)
    victim = tmp_path / "victim"
    make_shards(victim, 2, 1000)
    for name in (f"{dataset_id_for(str(victim))}/x", dataset_id_for(str(victim)), "../escape"):
        config = DatasetConfig(name=name, url=str(origin))
        assert config.id == dataset_id_for(str(origin))

        async def warm(config: DatasetConfig = config) -> Any:
            async with Stager(settings) as stager:
                return await stager.warm(await stager.open(config))

        assert asyncio.run(warm()).shards_resident == 2
    data = settings.local_dir / "data"
    assert sorted(p.name for p in data.iterdir()) == [dataset_id_for(str(origin))]


def _config(tmp_path: Path, env: dict[str, str], url: str) -> dict[str, str]:
    path = tmp_path / "config.toml"
    path.write_text(f'[datasets.train]\nurl = "{url}"\n')
    return {**env, "DATACACHE_CONFIG": str(path)}


def test_changing_a_configured_url_stops_serving_the_old_data(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from datacache.loaders import CachedIterableDataset

    old, new = tmp_path / "old", tmp_path / "new"
    write_tars(old, 2, 3, "OLD")
    write_tars(new, 2, 3, "NEW")  # the same keys and sizes: only the bytes differ
    env = _config(tmp_path, cache_env, str(old))
    assert run_cli(["warm", "train"], env).returncode == 0
    env = _config(tmp_path, cache_env, str(new))
    samples = list(CachedIterableDataset("train", config=load_settings(env), shuffle=False))
    assert len(samples) == 6
    assert {bytes(s["txt"])[:3] for s in samples} == {b"NEW"}


def test_warm_name_and_warm_url_share_one_copy(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    make_shards(origin, 3, 2000)
    env = _config(tmp_path, cache_env, str(origin))
    first = run_cli(["warm", "train", "--json"], env)
    assert first.returncode == 0, first.stderr
    second = run_cli(["warm", str(origin), "--json"], env)
    assert second.returncode == 0, second.stderr
    assert json.loads(first.stdout.splitlines()[-1])["bytes_transferred"] == 6000
    assert json.loads(second.stdout.splitlines()[-1])["bytes_transferred"] == 0, "the URL found the copy the name made"
    settings = load_settings(env)
    assert resolve_dataset("train", settings).id == resolve_dataset(str(origin), settings).id
    assert [p.name for p in (settings.local_dir / "data").iterdir()] == [dataset_id_for(str(origin))]


def test_a_samples_url_carries_no_credential(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """``__url__`` names the shard a sample came from, without the URL's userinfo."""
    import fsspec
    from datacache.loaders import CachedIterableDataset

    tars = write_tars(tmp_path / "tars", 1, 2, "x")
    fs = fsspec.filesystem("memory")
    base = f"memory://user:pa55w0rd@{tmp_path.name}/ds"  # fsspec's memory store takes any path
    fs.pipe(f"{base}/shard-0000.tar", tars["shard-0000.tar"])
    try:
        settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})
        samples = list(CachedIterableDataset(base + "/", config=settings, shuffle=False))
    finally:
        fs.rm(base, recursive=True)
    assert [s["__url__"] for s in samples] == [f"memory://{tmp_path.name}/ds/shard-0000.tar"] * 2


def test_the_daemon_uid_setting_names_a_user_or_is_a_clear_error(cache_env: dict[str, str]) -> None:
    import os

    settings = load_settings({**cache_env, "DATACACHE_DAEMON_UID": "root"})
    assert settings.daemon_uid == 0 and settings.trusted_uids == {os.geteuid(), 0}
    assert load_settings({**cache_env, "DATACACHE_DAEMON_UID": "4242"}).trusted_uids >= {4242}
    with pytest.raises(ConfigError, match="DATACACHE_DAEMON_UID: no user named 'no-such-user-x'"):
        load_settings({**cache_env, "DATACACHE_DAEMON_UID": "no-such-user-x"})
