"""Settings: defaults per user, one TOML file, DATACACHE_* variables and flags, merged once."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
from _helpers import run_cli

from datacache.config import (
    DatasetConfig,
    Settings,
    dataset_id_for,
    default_cache_dir,
    load_settings,
    resolve_dataset,
)
from datacache.errors import ConfigError
from datacache.sizes import format_bytes, format_rate, parse_bandwidth, parse_size


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_defaults_are_per_user(cache_env: dict[str, str], tmp_path: Path) -> None:
    settings = load_settings(cache_env)
    assert settings.local_dir == Path(cache_env["XDG_CACHE_HOME"]) / "datacache"
    assert settings.shared_dir is None
    assert settings.local_capacity is None
    assert settings.config_path is None
    env = {"HOME": str(tmp_path / "someone")}
    assert default_cache_dir(env) == tmp_path / "someone" / ".cache" / "datacache"
    assert not str(load_settings(env).local_dir).startswith("/tmp/datacache")


def test_the_per_user_config_file_is_read(cache_env: dict[str, str]) -> None:
    path = Path(cache_env["XDG_CONFIG_HOME"]) / "datacache" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("[staging]\nconcurrency = 3\n")
    settings = load_settings(cache_env)
    assert settings.concurrency == 3
    assert settings.config_path == path


def test_full_config_file(cache_env: dict[str, str], tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        f"""
[cache]
local_dir = "{tmp_path / "nvme"}"
local_capacity = "2GB"
shared_dir = "{tmp_path / "lustre"}"
shared_capacity = "1.5TiB"

[staging]
concurrency = 4
part_size = "4MiB"
bandwidth_limit = "100MB/s"
max_attempts = 3
lease_seconds = 12.5
default_policy = "lru"

[storage_options.s3]
endpoint_url = "http://127.0.0.1:9000"

[datasets.imagenet]
url = "s3://bucket/imagenet/"
policy = "nothrash"
pin = true
storage_options = {{ anon = true }}
""",
    )
    settings = load_settings(cache_env, config_path=path)
    assert settings.local_dir == tmp_path / "nvme"
    assert settings.local_capacity == 2 * 10**9
    assert settings.shared_dir == tmp_path / "lustre"
    assert settings.shared_capacity == int(1.5 * 2**40)
    assert settings.concurrency == 4
    assert settings.part_size == 4 * 2**20
    assert settings.bandwidth_limit == 100e6
    assert settings.retry.max_attempts == 3
    assert settings.lease_seconds == 12.5
    assert settings.default_policy == "lru"
    assert settings.storage_options["s3"]["endpoint_url"] == "http://127.0.0.1:9000"
    imagenet = settings.datasets["imagenet"]
    assert imagenet.url == "s3://bucket/imagenet/"
    assert imagenet.policy == "nothrash"
    assert imagenet.pinned is True
    assert imagenet.storage_options == {"endpoint_url": "http://127.0.0.1:9000", "anon": True}  # global, then its own
    assert settings.config_path == path
    assert pickle.loads(pickle.dumps(settings)) == settings


def test_precedence_file_then_environment_then_flags(
    cache_env: dict[str, str], tmp_path: Path
) -> None:
    path = write_config(
        tmp_path, "[staging]\nconcurrency = 4\npart_size = '1MB'\n[cache]\nlocal_capacity = '1GB'\n"
    )
    env = {
        **cache_env,
        "DATACACHE_CONCURRENCY": "6",
        "DATACACHE_PART_SIZE": "2MB",
        "DATACACHE_CONFIG": str(path),
    }
    settings = load_settings(env, overrides={"concurrency": "9"})
    assert settings.concurrency == 9  # flag beats environment
    assert settings.part_size == 2 * 10**6  # environment beats file
    assert settings.local_capacity == 10**9  # file beats default
    assert settings.with_overrides(concurrency=2, local_capacity=None).local_capacity == 10**9


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "[cache]\nlocal_capacty = '1GB'\n",
            "unknown key 'cache.local_capacty' (did you mean 'local_capacity'?)",
        ),
        ("[stagign]\nconcurrency = 2\n", "unknown section [stagign] (did you mean 'staging'?)"),
        ("[staging]\nconcurency = 2\n", "did you mean 'concurrency'?"),
        ("[cache]\nlocal_capacity = '10XB'\n", "unknown unit 'XB'"),
        ("[cache]\nlocal_capacity = 0\n", "must be positive"),
        ("[staging]\nconcurrency = -1\n", "must be positive"),
        ("[staging]\nconcurrency = 'many'\n", "expected a positive integer"),
        ("[staging]\ndefault_policy = 'fifo'\n", "unknown eviction policy 'fifo'"),
        (
            "[datasets.x]\nurl = 's3://b/x'\npolicyy = 'lru'\n",
            "unknown key 'datasets.x.policyy' (did you mean 'policy'?)",
        ),
        ("[datasets.x]\nformat = 'tar'\n", "needs a url"),
        ("[datasets.x]\nurl = 's3://b/x'\nformat = 'csv'\n", "unknown format 'csv'"),
        # Found by the long fuzz run: a dataset's policy and pin errors did not name the file.
        ("[datasets.x]\nurl = 's3://b/x'\npolicy = false\n", "datasets.x.policy: unknown eviction policy False"),
        ("[datasets.x]\nurl = 's3://b/x'\npin = 3\n", "datasets.x.pin: expected true or false"),
        ("[datasets.'../evil']\nurl = 's3://b/x'\n", "dataset name '../evil'"),
        ("[cache\nlocal_dir = 1\n", "config file"),
        ("cache = 3\n", "[cache] must be a table"),
        # A setting written at the top level said "unknown section [local_dir]": it is a key, of [cache].
        ('local_dir = "x"\n', "'local_dir' at the top level: it is a setting of [cache] (write it under [cache])"),
        ("concurrency = 2\n", "'concurrency' at the top level: it is a setting of [staging]"),
        # A bare number would be bytes/s: 10 B/s stalled a new user's warm for minutes, silently.
        ("[staging]\nbandwidth_limit = 10\n", "has no unit; write it as a string with one, e.g. '10MB/s'"),
    ],
)
def test_config_mistakes_are_named(
    cache_env: dict[str, str], tmp_path: Path, text: str, message: str
) -> None:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_settings(cache_env, config_path=path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
    assert str(path) in str(caught.value), "the error names the file"


@pytest.mark.parametrize("where", ["env", "file", "flag"])
def test_a_url_for_a_tier_directory_is_refused(cache_env: dict[str, str], tmp_path: Path, where: str) -> None:
    """Taken as a path, ``s3://b/p`` was a folder ``s3:`` under the working directory."""
    url = "s3://AKIAX:s3cr3t@bucket/cache"
    env, path, overrides = dict(cache_env), None, None
    if where == "env":
        env["DATACACHE_SHARED_DIR"] = url
    elif where == "file":
        path = write_config(tmp_path, f'[cache]\nshared_dir = "{url}"\n')
    else:
        overrides = {"local_dir": url}
    with pytest.raises(ConfigError) as caught:
        load_settings(env, config_path=path, overrides=overrides)
    message = str(caught.value)
    assert "expected a directory, got the URL 's3://bucket/cache'" in message
    assert "s3cr3t" not in message


@pytest.mark.parametrize("where", ["env", "file", "flag"])
@pytest.mark.parametrize("inside", [False, True], ids=["the-file", "below-the-file"])
def test_a_file_for_a_tier_directory_is_refused_naming_the_setting(
    cache_env: dict[str, str], tmp_path: Path, where: str, inside: bool
) -> None:
    """A regular file as DATACACHE_LOCAL_DIR said `error: [Errno 17] File exists: '...'`, naming no setting."""
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "cache" if inside else tmp_path / "a-file"
    env, path, overrides = dict(cache_env), None, None
    if where == "env":
        env["DATACACHE_LOCAL_DIR"] = str(target)
        named = "DATACACHE_LOCAL_DIR"
    elif where == "file":
        path = write_config(tmp_path, f'[cache]\nlocal_dir = "{target}"\n')
        named = "cache.local_dir"
    else:
        overrides = {"local_dir": str(target)}
        named = "--local-dir"
    with pytest.raises(ConfigError) as caught:
        load_settings(env, config_path=path, overrides=overrides)
    message = str(caught.value)
    assert named in message and f"{tmp_path / 'a-file'} is a file, not a directory" in message, message


def test_the_cli_says_which_setting_names_a_file(cache_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    (tmp_path / "origin").mkdir()
    result = run_cli(["warm", str(tmp_path / "origin")], {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "a-file")})
    assert result.returncode != 0
    assert result.stderr.splitlines() == [
        f"datacache: error: DATACACHE_LOCAL_DIR: {tmp_path / 'a-file'} is a file, not a directory"
    ], result.stderr


def test_missing_explicit_config_file(cache_env: dict[str, str], tmp_path: Path) -> None:
    env = {**cache_env, "DATACACHE_CONFIG": str(tmp_path / "nope.toml")}
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(env)


def test_unknown_environment_variable_warns_with_a_suggestion(
    cache_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A variable a cluster's own tooling sets, or a typo: a loud warning, not a dead training job.
    with caplog.at_level(logging.WARNING, logger="datacache.config"):
        settings = load_settings({**cache_env, "DATACACHE_LOCAL_CAPACTY": "1GB", "DATACACHE_JOB_ID": "7"})
    assert settings.local_capacity == load_settings(cache_env).local_capacity
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "DATACACHE_LOCAL_CAPACTY" in m and "did you mean 'DATACACHE_LOCAL_CAPACITY'" in m for m in messages
    ), messages
    assert any("DATACACHE_JOB_ID" in m and "ignored" in m for m in messages), messages
    # The CLI says it on stderr and goes on.
    result = run_cli(["ls"], {**cache_env, "DATACACHE_LOCAL_CAPACTY": "1GB"})
    assert result.returncode == 0, result.stderr
    assert "DATACACHE_LOCAL_CAPACTY" in result.stderr and "DATACACHE_LOCAL_CAPACITY" in result.stderr
    # A typo in the TOML file stays an error.
    path = tmp_path / "c.toml"
    path.write_text("[cache]\nlocal_capacty = '1GB'\n")
    with pytest.raises(ConfigError, match="local_capacty"):
        load_settings({**cache_env, "DATACACHE_CONFIG": str(path)})


def test_bad_environment_value_names_the_variable(cache_env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="DATACACHE_CONCURRENCY"):
        load_settings({**cache_env, "DATACACHE_CONCURRENCY": "zero"})


def test_unknown_override_is_refused(cache_env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'concurency'"):
        load_settings(cache_env, overrides={"concurency": 3})


def test_storage_options_never_in_repr(cache_env: dict[str, str], tmp_path: Path) -> None:
    path = write_config(
        tmp_path,
        "[storage_options.s3]\nsecret = 'hunter2-s3'\n"
        "[datasets.d]\nurl = 's3://AKIAUSER:hunter2-url@bucket/d'\n"
        "storage_options = { secret = 'hunter2-ds' }\n",
    )
    settings = load_settings(cache_env, config_path=path)
    text = repr(settings) + str(settings) + repr(settings.datasets["d"])
    assert "hunter2" not in text
    dataset = resolve_dataset("s3://bucket/other", settings)
    assert dataset.storage_options == {"secret": "hunter2-s3"}
    assert "hunter2" not in repr(dataset)


def test_resolve_dataset(settings: Settings, tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    by_path = resolve_dataset(str(origin), settings)
    assert by_path.url == str(origin)
    assert resolve_dataset(str(origin), settings).id == by_path.id
    by_url = resolve_dataset("s3://bucket/prefix/", settings, policy="lru")
    assert by_url.url == "s3://bucket/prefix/"
    assert by_url.policy == "lru"
    assert by_url.id.startswith("prefix-")
    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'"):
        resolve_dataset("imagenet", settings)
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        resolve_dataset("s3://bucket/x", settings, policy="random")


def test_named_dataset_takes_the_default_policy(cache_env: dict[str, str], tmp_path: Path) -> None:
    path = write_config(tmp_path, "[staging]\ndefault_policy='lru'\n[datasets.a]\nurl='s3://b/a'\n")
    settings = load_settings(cache_env, config_path=path)
    assert resolve_dataset("a", settings).policy == "lru"
    assert isinstance(resolve_dataset("a", settings), DatasetConfig)


@pytest.mark.parametrize(
    "url",
    [
        "s3://AKIAUSER:hunter2@bucket",
        "s3://AKIAUSER:hunter2@bucket/",
        "s3://AKIAUSER:hunter2@bucket/prefix",
    ],
)
def test_dataset_ids_carry_no_credentials(url: str) -> None:
    dataset_id = dataset_id_for(url)
    assert "hunter2" not in dataset_id
    assert "AKIA" not in dataset_id
    assert dataset_id == dataset_id_for(url.replace("AKIAUSER:hunter2@", ""))


def test_dataset_ids_are_stable_and_distinct() -> None:
    assert dataset_id_for("s3://b/x") == dataset_id_for("s3://b/x/")
    assert dataset_id_for("s3://b/x") != dataset_id_for("s3://c/x")
    assert dataset_id_for("s3://b/../..") == dataset_id_for("s3://b/")  # dot segments resolved (RFC 3986)
    assert dataset_id_for("s3://b/...").startswith("dataset-")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MB", 256 * 10**6),
        ("1.5GiB", int(1.5 * 2**30)),
        ("10B", 10),
        ("0", 0),
        (" 4 kib ", 4096),
        (7, 7),
        ("1TB", 10**12),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "1.2.3GB", "-5", "5 parsecs", True, -1, "10", "256"])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


def test_bandwidth_and_formatting() -> None:
    assert parse_bandwidth("1GB/s") == 1e9
    assert parse_bandwidth("200MBps") == 200e6
    assert parse_bandwidth(5) == 5.0
    with pytest.raises(ConfigError):
        parse_bandwidth("fast")
    assert format_bytes(999) == "999 B"
    assert format_bytes(1_500_000) == "1.50 MB"
    assert format_rate(480.1e6) == "480.1 MB/s"


@pytest.mark.parametrize(
    ("source", "value"),
    [("flag", "500"), ("env", "500"), ("file", "500"), ("file", "'500'"), ("flag", "1000000")],
)
def test_a_size_without_a_unit_is_refused_as_a_rate_is(
    source: str, value: str, cache_env: dict[str, str], tmp_path: Path
) -> None:
    """`--local-capacity 500` was 500 bytes while `--bandwidth 500` was refused (issue 24 item 8)."""
    env = dict(cache_env)
    overrides: dict[str, object] = {}
    if source == "flag":
        overrides["local_capacity"] = value
    elif source == "env":
        env["DATACACHE_LOCAL_CAPACITY"] = value
    else:
        config = tmp_path / "config.toml"
        config.write_text(f"[cache]\nlocal_capacity = {value}\n")
        env["DATACACHE_CONFIG"] = str(config)
    with pytest.raises(ConfigError, match=r"has no unit; write it.* with one"):
        load_settings(env, overrides=overrides)
    with pytest.raises(ConfigError, match="has no unit"):
        load_settings(cache_env, overrides={"bandwidth_limit": "500"})
    assert load_settings(cache_env, overrides={"local_capacity": "500B"}).local_capacity == 500
    assert load_settings(cache_env, overrides={"local_capacity": 500}).local_capacity == 500  # Python: an int is bytes


@pytest.mark.parametrize(
    ("value", "suggested"),
    [
        ("12000000", "'12MB' if it counts bytes (12,000,000)"),
        ("12345678", "'12.3MB' if it counts bytes (12,345,678, or exactly '12345678B')"),
        ("1073741824", "'1GiB' if it counts bytes"),
        ("3000000000000", "'3TB' if it counts bytes"),
        ("500", "e.g. '500GB' (or '500B' for bytes)"),
    ],
)
@pytest.mark.parametrize("source", ["env", "file", "flag"])
def test_a_size_without_a_unit_is_suggested_as_the_bytes_it_most_likely_counts(
    source: str, value: str, suggested: str, cache_env: dict[str, str], tmp_path: Path
) -> None:
    """DATACACHE_LOCAL_CAPACITY=12000000 was answered "e.g. '12000000GB'", 12 PB (issue 34 item 8)."""
    env = dict(cache_env)
    if source == "env":
        env["DATACACHE_LOCAL_CAPACITY"] = value
    elif source == "file":
        env["DATACACHE_CONFIG"] = str(write_config(tmp_path, f"[cache]\nlocal_capacity = {value}\n"))
    if source == "flag":  # the CLI as a user runs it: one line, exit status 2
        result = run_cli(["warm", str(tmp_path / "nothing"), "--local-capacity", value], env, timeout=60)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        said = result.stderr.strip()
    else:
        with pytest.raises(ConfigError) as caught:
            load_settings(env)
        said = str(caught.value)
    assert "has no unit; write it" in said and suggested in said, said
    if int(value) >= 10**6:
        assert f"'{value}GB'" not in said, "a count of bytes is never suggested times a unit"
