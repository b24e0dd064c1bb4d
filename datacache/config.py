"""Settings: defaults, one TOML file, ``DATACACHE_*`` variables and flags, merged once.

The result is a frozen `Settings`. The environment mapping is a parameter so
tests pass their own. Storage options (endpoints, credentials) are kept out of
every ``repr`` and message.
"""

from __future__ import annotations

import grp
import logging
import math
import os
import pwd
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from datacache.errors import ConfigError, GlobURLError, close_match
from datacache.eviction import POLICIES
from datacache.format_registry import format_names
from datacache.identity import canonical_origin, check_origin_form, dataset_id_for
from datacache.ownership import Readers, check_not_writable_by_others, parse_readers
from datacache.sizes import parse_bandwidth, parse_size, unit_hint
from datacache.tiers import RetryPolicy, glob_hint, redact_url, slash_hint, split_scheme

__all__ = [
    "POLICIES",
    "DatasetConfig",
    "Settings",
    "canonical_origin",
    "check_origin_form",
    "dataset_id_for",
    "default_cache_dir",
    "default_config_path",
    "load_settings",
    "resolve_dataset",
]

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def default_cache_dir(env: Mapping[str, str]) -> Path:
    """The per-user cache directory: ``$XDG_CACHE_HOME/datacache`` or ``~/.cache/datacache``."""
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(os.path.expanduser(base)) / "datacache"  # (pathlib's raises for "~nosuchuser")


def default_config_path(env: Mapping[str, str]) -> Path:
    """The per-user config file: ``$XDG_CONFIG_HOME/datacache/config.toml``."""
    base = env.get("XDG_CONFIG_HOME") or str(Path(env.get("HOME") or Path.home()) / ".config")
    return Path(os.path.expanduser(base)) / "datacache" / "config.toml"


@dataclass(frozen=True)
class DatasetConfig:
    """One dataset: where it lives, how to reach it, how to keep it cached."""

    name: str
    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    policy: str = "auto"
    pinned: bool = False
    format: str | None = None
    readers: Readers = field(default_factory=Readers)
    """Whom the operator shares it with (``readers = [...]``); empty: each reader's copies are its own."""

    @cached_property
    def id(self) -> str:
        """The dataset's identity, its directory name in every tier: from its origin, never its name."""
        return dataset_id_for(self.url, self.storage_options)

    def __repr__(self) -> str:
        return f"DatasetConfig(name={self.name!r}, url={redact_url(self.url)!r}, policy={self.policy!r})"


@dataclass(frozen=True)
class Settings:
    """Everything configurable, resolved. Build it with `load_settings`."""

    local_dir: Path
    local_capacity: int | None = None
    shared_dir: Path | None = None
    shared_group: int | None = None
    """The group the shared tier's root gets when datacache creates it (else the parent's setgid group)."""
    shared_capacity: int | None = None
    concurrency: int = 8
    part_size: int = 64 << 20
    memory_budget: int = 512 << 20
    bandwidth_limit: float | None = None
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    lease_seconds: float = 30.0
    verify_on_read: bool = True
    fsync: bool = True
    default_policy: str = "auto"
    socket_path: Path | None = None
    metrics_address: str = "127.0.0.1:9464"
    daemon_uid: int | None = None
    listing_max_entries: int = 1_000_000
    """Entries one listing of an origin may hold (`datacache.tiers.ListingBounds`)."""
    listing_max_bytes: int = 128 << 20
    """Bytes of http(s) listing pages one listing may read."""
    listing_timeout: float = 600.0
    """Seconds one manifest may take to list (a listing page, an index, the HEADs of its shards)."""
    shared_manifest_age: float = 3600.0  # this uid's listing from another node is taken so long (0: never)
    metrics_clients: bool = False
    """The daemon's metrics name each client (host, pid, rank) rather than one total: an operator's opt-in."""
    storage_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, repr=False)
    datasets: Mapping[str, DatasetConfig] = field(default_factory=dict)
    config_path: Path | None = None

    @property
    def daemon_socket(self) -> Path:
        """The daemon's Unix socket: configured, else ``<local_dir>/daemon.sock``."""
        return self.socket_path or self.local_dir / "daemon.sock"

    @property
    def trusted_uids(self) -> frozenset[int]:
        """Whose files on a shared tier are believed without re-checking: this user, root, the daemon."""
        trusted = {os.geteuid(), 0}
        if self.daemon_uid is not None:
            trusted.add(self.daemon_uid)
        return frozenset(trusted)

    def with_overrides(self, **changes: Any) -> Settings:
        """Return a copy with ``changes`` applied (flags given on the command line)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# key -> (section in the TOML file, parser)
def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise ConfigError(f"{what}: expected a positive integer, got {value!r}") from None
    if number <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return number


def _positive_size(value: Any, what: str) -> int:
    size = parse_size(value, what=what)
    if size <= 0:
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return size


def _path(value: Any, what: str) -> Path:
    if not isinstance(value, str) or not value or "\x00" in value:
        raise ConfigError(f"{what}: expected a path, got {value!r}")
    if _URL.match(value):
        # Taken as a path, "s3://b/p" would be a folder "s3:" under the working directory.
        raise ConfigError(f"{what}: expected a directory, got the URL {redact_url(value)!r} (tiers are directories)")
    return Path(os.path.expanduser(value)).absolute()


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def _directory(value: Any, what: str) -> Path:
    """A tier's directory: it may not exist yet, but it must be able to (no file where it or a parent is)."""
    path = _path(value, what)
    existing = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    if existing is not None and not existing.is_dir():
        made = "" if existing == path else f"{path} cannot be made: "
        raise ConfigError(f"{what}: {made}{existing} is a file, not a directory")
    return path


def _boolean(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{what}: expected true or false, got {value!r}")


def _policy(value: Any, what: str) -> str:
    if value not in POLICIES:
        raise ConfigError(f"{what}: unknown eviction policy {value!r} (choose from {', '.join(POLICIES)})")
    return str(value)


def _seconds(value: Any, what: str, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{what}: expected a number of seconds, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{what}: expected a number of seconds, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{what}: expected a number of seconds, got {value!r}")
    if number < 0 or (number == 0 and not zero):
        raise ConfigError(f"{what}: must be positive, got {value!r}")
    return number


def _rate_setting(value: Any, what: str) -> float:
    return parse_bandwidth(value, what=what)


# Rates written in the config file need their unit, as on the command line: a bare number
# (``bandwidth_limit = 10``) would be 10 bytes/s, almost never what was meant.
_RATES = {"bandwidth_limit"}


_SIZES = {"local_capacity", "shared_capacity", "part_size", "memory_budget", "listing_max_bytes"}


def _unitless_rate(key: str, value: Any) -> bool:
    """A rate or a size written in the TOML file as a bare number (0 aside): refused, one rule for both."""
    return key in _RATES | _SIZES and isinstance(value, int | float) and not isinstance(value, bool) and value != 0


def _address(value: Any, what: str) -> str:
    if not isinstance(value, str) or not re.match(r"^[^:\s]*:\d{1,5}$", value) or int(value.rsplit(":", 1)[1]) > 65535:
        raise ConfigError(f"{what}: expected HOST:PORT such as 127.0.0.1:9464, got {value!r}")
    return value


def _account(value: Any, what: str, kind: str, lookup: Callable[[str], int]) -> int:
    """A uid or gid given as a number or a name (``kind``: "user" or "group")."""
    short = kind[0] + "id"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if isinstance(value, str) and value:
        try:
            return lookup(value)
        except KeyError:
            raise ConfigError(f"{what}: no {kind} named {value!r} on this machine") from None
    raise ConfigError(f"{what}: expected a {short} or a {kind} name, got {value!r}")


def _gid(value: Any, what: str) -> int:
    return _account(value, what, "group", lambda name: grp.getgrnam(name).gr_gid)


def _uid(value: Any, what: str) -> int:
    return _account(value, what, "user", lambda name: pwd.getpwnam(name).pw_uid)


_SETTINGS: dict[str, tuple[str, Any]] = {
    "local_dir": ("cache", _directory),
    "local_capacity": ("cache", _positive_size),
    "shared_dir": ("cache", _directory),
    "shared_group": ("cache", _gid),
    "shared_capacity": ("cache", _positive_size),
    "concurrency": ("staging", _positive_int),
    "part_size": ("staging", _positive_size),
    "memory_budget": ("staging", _positive_size),
    "bandwidth_limit": ("staging", _rate_setting),
    "max_attempts": ("staging", _positive_int),
    "lease_seconds": ("staging", _seconds),
    "verify_on_read": ("staging", _boolean),
    "fsync": ("staging", _boolean),
    "default_policy": ("staging", _policy),
    "listing_max_entries": ("staging", _positive_int),
    "listing_max_bytes": ("staging", _positive_size),
    "listing_timeout": ("staging", _seconds),
    "shared_manifest_age": ("staging", lambda value, what: _seconds(value, what, zero=True)),
    "socket": ("daemon", _path),
    "metrics_address": ("daemon", _address),
    "daemon_uid": ("daemon", _uid),
    "metrics_clients": ("daemon", _boolean),
}
_SECTIONS = {"cache", "staging", "daemon", "storage_options", "datasets"}
_DATASET_KEYS = {"url", "storage_options", "policy", "pin", "format", "readers"}


def _suggest(word: str, choices: list[str] | set[str]) -> str:
    close = close_match(word, sorted(choices))
    return f" (did you mean {close!r}?)" if close else ""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path}: not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"config file {path}: cannot read it ({exc.strerror})") from None


def _dataset_from_table(name: str, table: Any, where: str) -> DatasetConfig:
    if not _NAME.match(name):
        raise ConfigError(f"{where}: dataset name {name!r} must be letters, digits, '.', '_' or '-'")
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [datasets.{name}] must be a table")
    for key in table:
        if key not in _DATASET_KEYS:
            raise ConfigError(f"{where}: unknown key 'datasets.{name}.{key}'{_suggest(key, _DATASET_KEYS)}")
    url = table.get("url")
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{where}: [datasets.{name}] needs a url")
    options = table.get("storage_options", {})
    if not isinstance(options, dict):
        raise ConfigError(f"{where}: datasets.{name}.storage_options must be a table")
    fmt = table.get("format")
    if fmt is not None and fmt not in format_names():
        choices = ", ".join(format_names())
        raise ConfigError(f"{where}: datasets.{name}.format: unknown format {fmt!r} (choose from {choices})")
    return DatasetConfig(
        name=name,
        url=url,
        storage_options=options,
        policy=_policy(table.get("policy", "auto"), f"{where}: datasets.{name}.policy"),
        pinned=_boolean(table.get("pin", False), f"{where}: datasets.{name}.pin"),
        format=fmt,
        readers=parse_readers(table["readers"], f"{where}: datasets.{name}.readers")
        if "readers" in table
        else Readers(),
    )


def load_settings(
    env: Mapping[str, str] | None = None,
    *,
    config_path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults, the config file, ``DATACACHE_*`` variables and ``overrides``, in that order.

    Parameters
    ----------
    env
        The environment to read; ``os.environ`` when omitted.
    config_path
        The TOML file; else ``DATACACHE_CONFIG``; else the per-user config file if it exists.
    overrides
        Values from command-line flags, by setting name (``local_dir``, ``concurrency``, ...).
    """
    env = os.environ if env is None else env
    loaded_from = _config_file(config_path, env)
    file = _read_config_file(loaded_from) if loaded_from is not None else _ConfigFile()
    values = {**file.values, **_env_values(env), **_override_values(overrides)}
    datasets = _with_scheme_defaults(file.datasets, file.storage_options)
    retry = RetryPolicy(max_attempts=values.pop("max_attempts", RetryPolicy().max_attempts))
    socket = values.pop("socket", None)
    local_dir = values.pop("local_dir", None) or default_cache_dir(env).absolute()
    return Settings(
        local_dir=local_dir,
        retry=retry,
        socket_path=socket,
        storage_options=file.storage_options,
        datasets=datasets,
        config_path=loaded_from,
        **values,
    )


def _config_file(config_path: str | os.PathLike[str] | None, env: Mapping[str, str]) -> Path | None:
    """The config file to read: the one named (which must exist), else the per-user one if it exists."""
    explicit = config_path or env.get("DATACACHE_CONFIG")
    path = Path(os.path.expanduser(explicit)) if explicit else default_config_path(env)
    if explicit and not path.is_file():
        source = "--config" if config_path else "DATACACHE_CONFIG"
        raise ConfigError(f"config file {path} does not exist (from {source})")
    if not path.is_file():
        return None
    # It names the daemon this process trusts and where its cache lives: never another user's word.
    check_not_writable_by_others(path, "config file", trusted={os.geteuid()})
    return path


@dataclass
class _ConfigFile:
    """What a config file sets: settings by name, datasets by name, storage options by scheme."""

    values: dict[str, Any] = field(default_factory=dict)
    datasets: dict[str, DatasetConfig] = field(default_factory=dict)
    storage_options: dict[str, dict[str, Any]] = field(default_factory=dict)


def _read_config_file(path: Path) -> _ConfigFile:
    found = _ConfigFile()
    for section, table in _read_toml(path).items():
        if section in _SETTINGS and not isinstance(table, dict):
            home = _SETTINGS[section][0]
            raise ConfigError(
                f"config file {path}: {section!r} at the top level: it is a setting of [{home}] "
                f"(write it under [{home}])"
            )
        if section not in _SECTIONS:
            raise ConfigError(f"config file {path}: unknown section [{section}]{_suggest(section, _SECTIONS)}")
        if not isinstance(table, dict):
            raise ConfigError(f"config file {path}: [{section}] must be a table")
        if section == "datasets":
            for name, entry in table.items():
                found.datasets[name] = _dataset_from_table(name, entry, f"config file {path}")
        elif section == "storage_options":
            for scheme, options in table.items():
                if not isinstance(options, dict):
                    raise ConfigError(f"config file {path}: [storage_options.{scheme}] must be a table")
                found.storage_options[scheme] = options
        else:
            found.values.update(_settings_section(path, section, table))
    return found


def _settings_section(path: Path, section: str, table: dict[str, Any]) -> dict[str, Any]:
    """The settings of one section of the config file (``[cache]``, ``[daemon]``, ...), checked."""
    allowed = {key for key, (sec, _) in _SETTINGS.items() if sec == section}
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in allowed:
            raise ConfigError(f"config file {path}: unknown key '{section}.{key}'{_suggest(key, allowed)}")
        if _unitless_rate(key, value):
            hint = unit_hint(f"{value:.15g}" if isinstance(value, float) else str(value), "/s" if key in _RATES else "")
            raise ConfigError(f"{path}: {section}.{key}: {value!r} has no unit; write it as a string with one{hint}")
        values[key] = _SETTINGS[key][1](value, f"{path}: {section}.{key}")
    return values


def _env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The settings ``DATACACHE_*`` variables give."""
    known_env = {f"DATACACHE_{key.upper()}": key for key in _SETTINGS}
    known_env.update({"DATACACHE_CONFIG": "", "DATACACHE_LOG": "", "DATACACHE_LOG_FORMAT": ""})
    values: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("DATACACHE_"):
            continue
        key = known_env.get(name)
        if key is None:
            # Warned, not refused: a cluster's own tooling may set DATACACHE_* variables, and a
            # training job should not die of one. The TOML file, which only we write, stays strict.
            logger.warning("unknown environment variable %s ignored%s", name, _suggest(name, set(known_env)))
            continue
        if key:
            values[key] = _SETTINGS[key][1](value, name)
    return values


def _override_values(overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings command-line flags give (``None``: the flag was not given)."""
    values: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _SETTINGS:
            raise ConfigError(f"unknown setting {key!r}{_suggest(key, set(_SETTINGS))}")
        values[key] = _SETTINGS[key][1](value, f"--{key.replace('_', '-')}")
    return values


def _with_scheme_defaults(
    datasets: dict[str, DatasetConfig], storage_options: dict[str, dict[str, Any]]
) -> dict[str, DatasetConfig]:
    """A configured dataset takes the global [storage_options.<scheme>] as a URL does, its own over them."""
    out = dict(datasets)
    for name, dataset in datasets.items():
        defaults = storage_options.get(split_scheme(dataset.url)[0], {})
        if defaults:
            out[name] = replace(dataset, storage_options={**defaults, **dataset.storage_options})
    return out


def resolve_dataset(spec: str, settings: Settings, *, policy: str | None = None) -> DatasetConfig:
    """Return the dataset ``spec`` names: a configured name, or a URL or local path."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError("expected a dataset: a URL (s3://bucket/prefix), a local path, or a configured name")
    if spec in settings.datasets:
        dataset = settings.datasets[spec]
        if dataset.policy == "auto" and settings.default_policy != "auto":
            dataset = replace(dataset, policy=settings.default_policy)
    else:
        scheme, _ = split_scheme(spec)
        looks_like_path = "://" in spec or spec.startswith(("/", ".", "~")) or os.path.exists(spec)
        if not looks_like_path:
            if glob_hint(spec):  # a trial's relative 'dir/*.tar' was told "unknown dataset", not what to write
                raise GlobURLError(glob_hint(spec))
            known = ", ".join(sorted(settings.datasets)) or "none configured"
            if slash_hint(spec):  # a trial's 's3:/shards/wds/' got no word of the missing slash
                raise ConfigError(f"unknown dataset {spec!r}: {slash_hint(spec)}")
            what = f"not a URL, not an existing path, and not a name in the config (known: {known})"
            raise ConfigError(f"unknown dataset {spec!r}: {what}")
        url = spec
        check_origin_form(url)
        if scheme == "file" and "://" not in spec:
            url = str(Path(os.path.expanduser(spec)).absolute())
        options = dict(settings.storage_options.get(scheme, {}))
        dataset = DatasetConfig(
            name=dataset_id_for(url, options), url=url, storage_options=options, policy=settings.default_policy
        )
    if policy is not None:
        dataset = replace(dataset, policy=_policy(policy, "--policy"))
    return dataset
