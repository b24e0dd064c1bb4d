"""Fuzzing config files, ``DATACACHE_*`` variables and command-line arguments.

Any input gives settings that work, or a `ConfigError` (the CLI: a clean exit
with a one-line message); never another exception, never a credential echoed,
never a file written outside the cache directory.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import shutil
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datacache.cli import main
from datacache.config import Settings, load_settings
from datacache.errors import ConfigError

SECRET = "S3CRET-fuzz-Zq8"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- a small TOML writer (values of the types TOML has) ------------------------------------------


def toml_key(key: str) -> str:
    if key and all(c in string.ascii_letters + string.digits + "_-" for c in key):
        return key
    return json.dumps(key)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (but for a few escapes)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(value)


def toml_document(sections: dict[str, Any]) -> str:
    lines = []
    for name, table in sections.items():
        if isinstance(table, dict):
            lines.append(f"[{toml_key(name)}]")
            lines.extend(f"{toml_key(k)} = {toml_value(v)}" for k, v in table.items())
        else:
            lines.insert(0, f"{toml_key(name)} = {toml_value(table)}")
    return "\n".join(lines) + "\n"


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
sizes = st.sampled_from(["256MB", "1.5GiB", "0", "-1", "10 TB", "1e400", "9" * 400, "12 parsecs", "", "0.5kB"])
toml_scalars = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | text
    | sizes
    | st.sampled_from(["/tmp/x", "relative/dir", "~", "a\x00b", "127.0.0.1:9464", "host:99999", ":0", "s3://b/p"])
)
toml_values = st.recursive(
    toml_scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=6
)
known_keys = {
    "cache": ["local_dir", "local_capacity", "shared_dir", "shared_capacity"],
    "staging": [
        "concurrency",
        "part_size",
        "memory_budget",
        "bandwidth_limit",
        "max_attempts",
        "lease_seconds",
        "verify_on_read",
        "default_policy",
        "fsync",
    ],
    "daemon": ["socket", "metrics_address"],
}


@st.composite
def config_documents(draw: st.DrawFn, root: str) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    for section, names in known_keys.items():
        if draw(st.booleans()):
            table = {}
            for name in draw(st.lists(st.sampled_from(names) | text, max_size=4, unique=True)):
                value = draw(toml_values)
                if name.endswith(("_dir", "socket")) and isinstance(value, str) and draw(st.booleans()):
                    value = f"{root}/{value}"  # mostly inside the test's directory
                table[name] = value
            sections[section] = table
    if draw(st.booleans()):
        sections["storage_options"] = {
            "s3": {"key": "AKIAFUZZ", "secret": SECRET, "endpoint_url": draw(toml_scalars)},
            **draw(st.dictionaries(text, toml_values, max_size=2)),
        }
    if draw(st.booleans()):
        datasets: dict[str, Any] = {}
        for name in draw(st.lists(st.sampled_from(["imagenet", "bad name", "x" * 120, "ok-1"]) | text, max_size=3)):
            datasets[name] = draw(
                st.fixed_dictionaries(
                    {},
                    optional={
                        "url": st.sampled_from(["s3://bucket/prefix", "", "/data"]) | toml_scalars,
                        "policy": st.sampled_from(["lru", "nothrash", "fifo"]) | toml_scalars,
                        "pin": toml_scalars,
                        "format": st.sampled_from(["tar", "csv"]) | toml_scalars,
                        "storage_options": st.just({"secret": SECRET}) | toml_values,
                    },
                )
                | toml_values
            )
        sections["datasets"] = datasets
    if draw(st.booleans()):
        sections[draw(st.sampled_from(["cahce", "stagin"]) | text)] = draw(toml_values)
    return sections


@pytest.fixture(scope="module")
def fuzz_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-config")


def base_env(root: Path) -> dict[str, str]:
    return {
        "HOME": str(root / "home"),
        "XDG_CACHE_HOME": str(root / "home" / ".cache"),
        "XDG_CONFIG_HOME": str(root / "home" / ".config"),
    }


def check_settings(loaded: Settings) -> None:
    """Loaded settings are usable: sane numbers, absolute paths, no secret in their repr."""
    assert loaded.local_dir.is_absolute() and "\x00" not in str(loaded.local_dir)
    assert loaded.concurrency > 0 and loaded.part_size > 0 and loaded.memory_budget > 0
    for capacity in (loaded.local_capacity, loaded.shared_capacity):
        assert capacity is None or capacity > 0
    # (A bandwidth limit of 0 means none.)
    assert loaded.bandwidth_limit is None or (loaded.bandwidth_limit >= 0 and math.isfinite(loaded.bandwidth_limit))
    assert loaded.lease_seconds > 0 and math.isfinite(loaded.lease_seconds)
    port = loaded.metrics_address.rpartition(":")[2]
    assert 0 <= int(port) <= 65535
    assert SECRET not in repr(loaded)


@FUZZ
@given(data=st.data())
@example(data=None)
def test_config_files_load_or_fail_with_a_config_error(fuzz_root: Path, data: Any) -> None:
    if data is None:  # the explicit examples of bugs found, one document each
        documents = [
            {"cache": {"local_capacity": float("inf")}},
            {"cache": {"local_capacity": float("nan")}},
            {"cache": {"local_capacity": "9" * 400}},
            {"cache": {"local_dir": "a\x00b"}},
            {"daemon": {"metrics_address": "127.0.0.1:99999"}},
            {"staging": {"lease_seconds": float("nan")}},
            {"staging": {"bandwidth_limit": float("inf")}},
            {"staging": {"bandwidth_limit": []}},
            {"cache": {"local_capacity": []}},
        ]
    else:
        documents = [data.draw(config_documents(str(fuzz_root)))]
    for document in documents:
        path = fuzz_root / "config.toml"
        try:
            path.write_text(toml_document(document))
        except (TypeError, UnicodeEncodeError):
            continue
        try:
            loaded = load_settings(base_env(fuzz_root), config_path=path)
        except ConfigError as exc:
            assert SECRET not in str(exc)
            assert "\n" not in str(exc).strip() or "config file" in str(exc)
            assert str(path) in str(exc), "the error names the file"
            names = [n for section, body in document.items() for n in (section, *_keys(body))]
            # A value the TOML writer here cannot encode is a syntax error: that one names its line.
            # A name with control characters is named as Python spells it ('\x1f').
            named = any(name in str(exc) or repr(name) in str(exc) for name in names) or "(at line " in str(exc)
            assert named, f"the error names no field of {document}: {exc}"
            continue
        check_settings(loaded)


def _keys(body: Any) -> list[str]:
    """The keys of a TOML table and of the tables inside it."""
    if not isinstance(body, dict):
        return []
    return [n for key, value in body.items() for n in (str(key), *_keys(value))]


RANDOM_CONFIG_INPUT = {"raw": st.binary(max_size=300) | st.text(max_size=300).map(str.encode)}


@FUZZ
@given(**RANDOM_CONFIG_INPUT)
def test_config_files_of_random_bytes(fuzz_root: Path, raw: bytes) -> None:
    path = fuzz_root / "random.toml"
    path.write_bytes(raw)
    try:
        loaded = load_settings(base_env(fuzz_root), config_path=path)
    except ConfigError as exc:
        assert str(path) in str(exc), f"the error does not name the file: {exc}"
        return
    check_settings(loaded)


env_names = st.sampled_from(
    [
        "DATACACHE_LOCAL_DIR",
        "DATACACHE_LOCAL_CAPACITY",
        "DATACACHE_CONCURRENCY",
        "DATACACHE_PART_SIZE",
        "DATACACHE_BANDWIDTH_LIMIT",
        "DATACACHE_LEASE_SECONDS",
        "DATACACHE_VERIFY_ON_READ",
        "DATACACHE_SOCKET",
        "DATACACHE_METRICS_ADDRESS",
        "DATACACHE_MAX_ATTEMPTS",
        "DATACACHE_LOCAL_DIRR",
        "DATACACHE_",
    ]
) | text.map(lambda t: "DATACACHE_" + t)
env_values = (
    st.sampled_from(["1", "0", "-3", "inf", "nan", "1e309", "true", "maybe", "", "10GB", "1:2", "x:70000"]) | text
)


@FUZZ
@given(variables=st.dictionaries(env_names, env_values, max_size=4))
@example(variables={"DATACACHE_LOCAL_DIR": "~0"})  # a user that does not exist
@example(variables={"DATACACHE_CONFIG": "~nosuchuser/x.toml"})
def test_environment_variables_load_or_fail_with_a_config_error(fuzz_root: Path, variables: dict[str, str]) -> None:
    env = {**base_env(fuzz_root), **variables}
    try:
        loaded = load_settings(env)
    except ConfigError as exc:
        assert any(name in str(exc) for name in variables), f"the error names no variable of {variables}: {exc}"
        return
    check_settings(loaded)


# -- the command line ------------------------------------------------------------------------


@contextlib.contextmanager
def cli_sandbox(root: Path) -> Iterator[Path]:
    """Run the CLI in-process with its environment, home and working directory inside ``root``."""
    saved_env = dict(os.environ)
    saved_cwd = Path.cwd()
    logger = logging.getLogger("datacache")  # the CLI configures it: put it back afterwards
    saved_logging = (list(logger.handlers), logger.level, logger.propagate)
    work = root / "work"
    work.mkdir(exist_ok=True)
    os.environ.clear()
    os.environ.update(
        {
            **{k: v for k, v in saved_env.items() if k in ("PATH", "LANG", "PYTHONPATH")},
            **base_env(root),
            "DATACACHE_LOCAL_DIR": str(root / "cache"),
            "DATACACHE_MAX_ATTEMPTS": "1",
            "AWS_ACCESS_KEY_ID": "AKIAFUZZ",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # refused at once
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    os.chdir(work)
    try:
        yield work
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        logger.handlers[:], logger.level, logger.propagate = saved_logging


flags = {
    "warm": [
        "--tier",
        "--shards",
        "--concurrency",
        "--bandwidth",
        "--verify",
        "--refresh",
        "--policy",
        "--json",
        "-q",
        "--no-daemon",
        "--local-capacity",
        "--shared-capacity",
        "--config",
        "--local-dir",
    ],
    "ls": ["--json", "-v", "--log-json"],
    "status": ["--json", "--local-capacity"],
    "evict": ["--tier", "--shards", "--forget"],
    "plan": [
        "--gpus",
        "--per-gpu",
        "--dataset",
        "--epochs",
        "--nodes",
        "--local-capacity",
        "--origin-bandwidth",
        "--json",
    ],
}
values = st.sampled_from(
    [
        "0",
        "-1",
        "8",
        "1e400",
        "nan",
        "1GB/s",
        "10TB",
        "0:3",
        "a.tar,b.tar",
        "local",
        "shared",
        "all",
        "lru",
        "",
        "s3://AKIAFUZZ:" + SECRET + "@bucket/p",
        "--",
        "-",
        "\x7f",
        "../..",
        "/nonexistent/dir/x",
    ]
) | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)


def safe_dataset(token: str, work: Path) -> bool:
    """A dataset argument that cannot make the fuzzer read a real tree (``.``, ``/``) or the network."""
    if "://" in token and not token.startswith(("s3://", "gs://", "az://", "bogus://")):
        return False
    expanded = os.path.expanduser(token)
    return not (os.path.exists(expanded) or os.path.exists(work / expanded)) and not token.startswith(("~", "/", "."))


def asked_cache_dir(argv: list[str], work: Path) -> Path | None:
    """The local tier a command line names with ``--local-dir`` (the last one, as argparse takes it)."""
    values = [argv[i + 1] for i, token in enumerate(argv[:-1]) if token == "--local-dir"]
    if not values or not values[-1] or "\x00" in values[-1] or values[-1].startswith("-"):
        return None
    if "://" in values[-1]:
        return None  # a URL is no directory: refused, nothing written
    return Path(os.path.normpath(work / os.path.expanduser(values[-1])))


@st.composite
def argvs(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from([*flags, "bogus", ""]))
    argv = [command] if command else []
    if command in ("warm", "evict"):
        argv.append(draw(st.sampled_from(["s3://bucket/prefix", "imagenet", "bogus://x/y", "missing-dir/"]) | values))
    for _ in range(draw(st.integers(0, 4))):
        argv.append(draw(st.sampled_from(flags.get(command, ["--help-me"])) | values))
        if draw(st.booleans()):
            argv.append(draw(values))
    return argv


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(argv=argvs())
@example(argv=["plan", "--gpus", "8", "--per-gpu", "nan", "--dataset", "1TB"])
@example(argv=["warm", "s3://AKIAFUZZ:" + SECRET + "@bucket/p", "-q"])
@example(argv=["status", "--local-capacity", "1e400"])
# Found by test_cli_arguments_long: a URL for a directory became a relative path, "s3:/..." under the
# working directory; a relative --local-dir, though, is where the user asked the cache to be.
@example(argv=["warm", "s3://bucket/prefix", "--local-dir", "s3://AKIAFUZZ:" + SECRET + "@bucket/p"])
@example(argv=["warm", "s3://bucket/prefix", "--local-dir", "8"])
def test_cli_arguments_exit_cleanly_with_one_line(fuzz_root: Path, argv: list[str]) -> None:
    with cli_sandbox(fuzz_root) as work:
        if len(argv) > 1 and argv[0] in ("warm", "evict") and not safe_dataset(argv[1], work):
            return
        cache = asked_cache_dir(argv, work)
        if cache is not None and not cache.is_relative_to(work):
            return  # a cache the fuzzer put outside its sandbox (--local-dir ../..): written where asked
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(argv)
            except SystemExit as exc:  # argparse: a usage error (2) or --help (0)
                status = exc.code if isinstance(exc.code, int) else 2
        # What the asked cache holds, and the folders on the way to it, are where the user asked.
        leftovers = sorted(
            p.name for p in work.iterdir() if cache is None or not (p.is_relative_to(cache) or cache.is_relative_to(p))
        )
    caches = [fuzz_root / "cache"] if cache is None else [fuzz_root / "cache", cache]
    outside = [p for p in fuzz_root.rglob("*") if p.is_file() and not any(p.is_relative_to(c) for c in caches)]
    if cache is not None:  # the next example starts from an empty working directory
        shutil.rmtree(work)
    stdout, stderr = out.getvalue(), err.getvalue()
    assert status in (0, 1, 2), (argv, status, stderr)
    assert "Traceback" not in stderr, stderr
    assert SECRET not in stdout + stderr, (argv, stdout, stderr)
    if status != 0 and argv:  # (no command at all prints the help)
        errors = [line for line in stderr.splitlines() if "error:" in line]
        assert len(errors) == 1, (argv, stderr)
        assert errors[0].startswith(("datacache: error:", "usage:")) or ": error: " in errors[0], stderr
    assert leftovers == [], f"files written outside the cache directory: {leftovers}"
    assert not [p for p in outside if p.name not in ("config.toml", "random.toml")], outside


# -- the same properties, ten times longer, in `make test-faults` -----------------------------

LONG = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.faults
@LONG
@given(data=st.data())
def test_config_files_long(fuzz_root: Path, data: Any) -> None:
    test_config_files_load_or_fail_with_a_config_error.hypothesis.inner_test(fuzz_root, data)


@pytest.mark.faults
@LONG
@given(**RANDOM_CONFIG_INPUT)
def test_config_files_of_random_bytes_long(fuzz_root: Path, raw: bytes) -> None:
    test_config_files_of_random_bytes.hypothesis.inner_test(fuzz_root, raw)


@pytest.mark.faults
@LONG
@given(variables=st.dictionaries(env_names, env_values, max_size=4))
def test_environment_variables_long(fuzz_root: Path, variables: dict[str, str]) -> None:
    test_environment_variables_load_or_fail_with_a_config_error.hypothesis.inner_test(fuzz_root, variables)


@pytest.mark.faults
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(argv=argvs())
def test_cli_arguments_long(fuzz_root: Path, argv: list[str]) -> None:
    test_cli_arguments_exit_cleanly_with_one_line.hypothesis.inner_test(fuzz_root, argv)
