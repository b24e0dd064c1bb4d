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
PENDING_PER_READER = 16
"""Challenges a uid may have open on one dataset at once: a job's workers each ask for their own."""
WRONG_PROOFS = 5
WRONG_SECONDS = 600.0
"""After `WRONG_PROOFS` wrong proofs within `WRONG_SECONDS`, a uid's proofs of a dataset are refused
until the oldest of them is that old: guessing a shard's few unknown bytes is slowed to a crawl."""


class Grants:
    """Declared readers by dataset id, and the uids that proved access to each snapshot."""

    def __init__(self, declared: Mapping[str, Readers]) -> None:
        self.declared = dict(declared)
        self.shared: set[str] = {dataset for dataset, readers in declared.items() if readers}
        """Datasets whose copies may be the group's (declared readers, or an allowed prefix)."""
        self._proven: set[tuple[int, str, str]] = set()
        self._challenges: dict[tuple[int, str], dict[str, tuple[Challenge, float]]] = {}
        """(uid, dataset) -> nonce -> the open challenge and when it lapses, oldest first."""
        self._wrong: dict[tuple[int, str], list[float]] = {}

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
        """A new challenge for ``peer`` on ``handle``'s snapshot, beside its others (the oldest past
        `PENDING_PER_READER` is forgotten): several workers of one job prove at once."""
        now = time.monotonic()
        self._refuse_after_wrong(peer, handle, now)
        if len(self._challenges) >= MAX_CHALLENGES:
            self._challenges = {
                k: kept for k, v in self._challenges.items() if (kept := {n: c for n, c in v.items() if c[1] > now})
            }
        made = Challenge.new(handle.manifest)
        pending = self._challenges.setdefault((peer.uid, handle.id), {})
        pending[made.nonce] = (made, now + CHALLENGE_SECONDS)
        while len(pending) > PENDING_PER_READER:
            del pending[next(iter(pending))]
        return made

    def count_refresh(self, peer: Peer, dataset_id: str) -> None:
        """Count a challenge asked with a refresh as a wrong proof: each lists the origin for a uid that
        proved nothing yet, so a uid gets `WRONG_PROOFS` of them (or wrong proofs) in `WRONG_SECONDS`."""
        now = time.monotonic()
        wrong = [at for at in self._wrong.get((peer.uid, dataset_id), ()) if at > now - WRONG_SECONDS]
        if len(wrong) >= WRONG_PROOFS:
            raise Forbidden(
                f"uid {peer.uid} asked {len(wrong)} refreshed challenges or gave wrong proofs of this dataset in "
                f"{WRONG_SECONDS / 60:.0f} minutes; ask again later"
            )
        self._wrong[(peer.uid, dataset_id)] = [*wrong, now]

    def _refuse_after_wrong(self, peer: Peer, handle: DatasetHandle, now: float) -> None:
        wrong = [at for at in self._wrong.get((peer.uid, handle.id), ()) if at > now - WRONG_SECONDS]
        self._wrong[(peer.uid, handle.id)] = wrong
        if len(wrong) >= WRONG_PROOFS:
            wait = wrong[-WRONG_PROOFS] + WRONG_SECONDS - now
            raise Forbidden(
                f"dataset {handle.config.name}: uid {peer.uid} gave {len(wrong)} wrong access proofs in "
                f"{WRONG_SECONDS / 60:.0f} minutes; its proofs are refused for {wait:.0f} s more"
            )

    async def verify(
        self,
        peer: Peer,
        handle: DatasetHandle,
        proof: Any,
        read: Callable[[str, int, int], Awaitable[bytes]],
    ) -> None:
        """Record ``peer``'s proof for ``handle`` or raise `ProofRequiredError` (one try per challenge)."""
        now = time.monotonic()
        self._refuse_after_wrong(peer, handle, now)
        what = f"dataset {handle.config.name} is not declared shared; uid {peer.uid}"
        nonce = proof.get("nonce") if isinstance(proof, Mapping) else None
        pending = self._challenges.get((peer.uid, handle.id), {}).pop(nonce, None) if isinstance(nonce, str) else None
        if pending is None or pending[1] < now:
            raise ProofRequiredError(f"{what} must show the origin answers it (ask for a challenge first)")
        challenge = pending[0]
        expected = proof_digest(challenge.nonce, await read(challenge.key, challenge.start, challenge.end))
        if proof.get("digest") != expected:
            self._wrong.setdefault((peer.uid, handle.id), []).append(now)
            raise Forbidden(f"{what}: the origin does not give it the dataset's bytes (its proof is wrong)")
        self._proven.add((peer.uid, handle.id, handle.manifest.snapshot))
