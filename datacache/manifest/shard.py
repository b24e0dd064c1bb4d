"""One shard as a manifest records it (the item of a `columns.ShardTable`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from datacache.errors import ConfigError
from datacache.tiers import validate_key

__all__ = ["Shard"]


@dataclass(frozen=True, slots=True)
class Shard:
    """One file of a dataset, as the manifest snapshot recorded it."""

    key: str
    size: int
    version: str | None = None
    checksum: str | None = None
    samples: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"key": self.key, "size": self.size}
        for name in ("version", "checksum", "samples"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> Shard:
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: a shard entry must be an object")
        key = data.get("key")
        size = data.get("size")
        if not isinstance(key, str) or not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ConfigError(f"{where}: a shard entry needs a string key and a non-negative integer size")
        validate_key(key)
        version = data.get("version")
        checksum = data.get("checksum")
        samples = data.get("samples")
        if version is not None and not isinstance(version, str):
            raise ConfigError(f"{where}: shard {key!r}: version must be a string")
        if checksum is not None and not (isinstance(checksum, str) and checksum.startswith("xxh3_64:")):
            raise ConfigError(f"{where}: shard {key!r}: checksum must look like 'xxh3_64:<hex>'")
        if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool) or samples < 0):
            raise ConfigError(f"{where}: shard {key!r}: samples must be a non-negative integer")
        return cls(key=key, size=size, version=version, checksum=checksum, samples=samples)
