"""Whom the daemon serves each dataset to (docs/SECURITY.md, "Who may read what").

- A dataset the operator declared shared (``readers = [...]`` in ``[datasets.NAME]``) is served
  to those uids and members of those groups, and to nobody else; its copies are the group's.
- A dataset under an ``--allow-dataset`` prefix is declared shared with every allowed client
  (the flag's meaning: "name only what all of them may read").
- Any other dataset (configured without ``readers``) is served to a uid only once that uid
  proved, with its own credentials, that the origin answers it (`datacache._proof`); its copies
  stay the daemon's own (0600), and such a client reads the bytes of uncached and cached shards
  alike from the origin itself.

Root and the daemon's own uid are operators: they hold what the daemon holds.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from datacache._proof import Challenge, proof_digest
from datacache.config import DatasetConfig
from datacache.daemon._http import Forbidden, Peer
from datacache.errors import ProofRequiredError
from datacache.ownership import Readers
from datacache.staging import DatasetHandle
from datacache.tiers import split_userinfo

__all__ = ["Grants"]

CHALLENGE_SECONDS = 120.0
MAX_CHALLENGES = 4096


class Grants:
    """Declared readers by dataset id, and the uids that proved access to each snapshot."""

    def __init__(self, declared: Mapping[str, Readers]) -> None:
        self.declared = dict(declared)
        self.shared: set[str] = {dataset for dataset, readers in declared.items() if readers}
        """Datasets whose copies may be the group's (declared readers, or an allowed prefix)."""
        self._proven: set[tuple[int, str, str]] = set()
        self._challenges: dict[tuple[int, str], tuple[Challenge, float]] = {}

    def readers(self, config: DatasetConfig) -> Readers:
        return config.readers or self.declared.get(config.id, Readers())

    def needs_proof(self, config: DatasetConfig, peer: Peer, *, configured: bool) -> bool:
        """Raise `Forbidden` for a uid that is not among declared readers; whether it must prove access."""
        if peer.is_operator:
            return False
        readers = self.readers(config)
        if readers:
            if readers.admits(peer.uid, (peer.gid, *peer.groups)):
                return False
            raise Forbidden(
                f"dataset {config.name} is shared with {readers.describe()} only; uid {peer.uid} is not "
                "among its readers (the operator adds readers in [datasets.NAME])"
            )
        if not configured and split_userinfo(config.url)[0] is None:
            self.shared.add(config.id)  # under an --allow-dataset prefix: every allowed client's
            return False
        # Configured without readers, or a URL that carries its client's credentials: that client's.
        return config.id not in self.shared

    def proven(self, peer: Peer, handle: DatasetHandle) -> bool:
        return (peer.uid, handle.id, handle.manifest.snapshot) in self._proven

    def challenge(self, peer: Peer, handle: DatasetHandle) -> Challenge:
        """A new challenge for ``peer`` on ``handle``'s snapshot (the previous one is forgotten)."""
        now = time.monotonic()
        if len(self._challenges) >= MAX_CHALLENGES:
            self._challenges = {k: v for k, v in self._challenges.items() if v[1] > now}
        made = Challenge.new(handle.manifest)
        self._challenges[(peer.uid, handle.id)] = (made, now + CHALLENGE_SECONDS)
        return made

    async def verify(
        self,
        peer: Peer,
        handle: DatasetHandle,
        proof: Any,
        read: Callable[[str, int, int], Awaitable[bytes]],
    ) -> None:
        """Record ``peer``'s proof for ``handle`` or raise `ProofRequiredError` (one try per challenge)."""
        pending = self._challenges.pop((peer.uid, handle.id), None)
        what = f"dataset {handle.config.name} is not declared shared; uid {peer.uid}"
        if pending is None or pending[1] < time.monotonic():
            raise ProofRequiredError(f"{what} must show the origin answers it (ask for a challenge first)")
        challenge = pending[0]
        if not isinstance(proof, Mapping) or proof.get("nonce") != challenge.nonce:
            raise ProofRequiredError(f"{what}: the proof answers another challenge")
        expected = proof_digest(challenge.nonce, await read(challenge.key, challenge.start, challenge.end))
        if proof.get("digest") != expected:
            raise Forbidden(f"{what}: the origin does not give it the dataset's bytes (its proof is wrong)")
        self._proven.add((peer.uid, handle.id, handle.manifest.snapshot))
