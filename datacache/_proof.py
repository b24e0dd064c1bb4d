"""An access proof: a client shows the daemon that the origin answers it, with its own credentials.

A dataset the operator did not declare shared (no ``readers``) is served by the daemon to a uid
only once that uid proved it can read the dataset at the origin itself (docs/SECURITY.md, "Who
may read what"). The daemon names a random range of one of the manifest's objects and a nonce;
the client fetches that range from the origin with its own credentials and answers the SHA-256 of
the nonce and the bytes. Nobody who cannot read the object can answer, and an answer is good for
one challenge only.

The range is a whole shard, or 1 MiB of a bigger one: a short range could fall where a shard's
bytes are known without reading it (the zero blocks that end every tar, its headers' fields), and
a client that asked for challenges until one did answered it (a trial: 3,058 challenges in 3.9 s).
What the proof cannot tell apart is a client that knows the bytes some other way (a copy of a
public dataset, a payload of a few guessable bytes): docs/SECURITY.md says to declare the readers
of such a dataset; the daemon refuses a uid's proofs for a while after a few wrong ones.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from datacache.config import DatasetConfig
from datacache.errors import ConfigError, ProofRequiredError
from datacache.manifest import Manifest, object_url
from datacache.tiers import ByteRange, RetryPolicy, open_origin

__all__ = ["Challenge", "ProofRequiredError", "answer_challenge", "proof_digest"]

CHALLENGE_BYTES = 1 << 20
"""The most bytes a challenge names (a whole shard if it is smaller)."""


@dataclass(frozen=True)
class Challenge:
    """Which bytes of which object of a dataset to fetch from the origin, and the nonce to hash them with."""

    nonce: str
    key: str
    start: int
    end: int
    version: str | None
    single_object: bool

    @classmethod
    def new(cls, manifest: Manifest) -> Challenge:
        """A fresh challenge on a random non-empty shard of ``manifest``."""
        table = manifest.table
        holding = np.flatnonzero(table.sizes > 0)
        if not len(holding):
            raise ConfigError(f"dataset {manifest.dataset} holds no bytes to prove access with")
        shard = table[int(holding[secrets.randbelow(len(holding))])]
        length = min(shard.size, CHALLENGE_BYTES)
        start = secrets.randbelow(shard.size - length + 1)
        end = start + length
        single = bool(manifest.extra.get("object"))
        return cls(secrets.token_hex(16), shard.key, start, end, shard.version, single)

    def to_wire(self) -> dict[str, Any]:
        return {
            "nonce": self.nonce, "key": self.key, "start": self.start, "end": self.end,
            "version": self.version, "single_object": self.single_object,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Challenge:
        try:
            start, end = int(data["start"]), int(data["end"])
            version = data.get("version")
            return cls(
                str(data["nonce"]), str(data["key"]), start, end,
                version if isinstance(version, str) else None, bool(data.get("single_object")),
            )
        except (KeyError, TypeError, ValueError):
            raise ConfigError("daemon: an access challenge without its nonce, key or range") from None


def proof_digest(nonce: str, data: bytes) -> str:
    """What answers a challenge: SHA-256 over the nonce and the bytes it named."""
    return hashlib.sha256(nonce.encode() + b"\0" + data).hexdigest()


async def answer_challenge(config: DatasetConfig, challenge: Challenge, retry: RetryPolicy) -> dict[str, str]:
    """Fetch the challenged range from the origin with this process's own credentials; the proof to send."""
    url = config.url
    if challenge.single_object:
        split = object_url(url)
        url = split[0] if split is not None else url
    origin = open_origin(url, storage_options=config.storage_options, retry=retry)
    try:
        data = await origin.get(challenge.key, ByteRange(challenge.start, challenge.end), version=challenge.version)
    finally:
        await origin.close()
    return {"nonce": challenge.nonce, "digest": proof_digest(challenge.nonce, data)}
