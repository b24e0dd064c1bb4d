"""What each tier keeps: the datasets' future read orders and the eviction choice they drive."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from datacache.eviction import Candidate, choose_victims
from datacache.staging.types import DatasetHandle

__all__ = ["Chooser", "Residency"]

Chooser = Callable[[Candidate, list[Candidate], int], "list[Candidate] | None"]
"""Given the incoming shard, the residents and the bytes needed: the victims, or None to decline."""


class Residency:
    """The future read order per dataset (for Belady), and the victim chooser per dataset."""

    def __init__(self) -> None:
        self._future_order: dict[str, dict[str, int]] = {}

    def set_future_order(self, dataset_id: str, keys: Iterable[str]) -> None:
        """Record the order in which ``dataset_id``'s shards will be read next."""
        order: dict[str, int] = {}
        for position, key in enumerate(keys):
            order.setdefault(key, position)
        self._future_order[dataset_id] = order

    def chooser(self, handle: DatasetHandle) -> Chooser:
        """The eviction choice for a shard of ``handle`` coming in, by the dataset's policy."""
        policy = handle.config.policy
        next_use = self._future_order.get(handle.id)

        def choose(incoming: Candidate, residents: list[Candidate], need: int) -> list[Candidate] | None:
            if handle.config.pinned:
                incoming = Candidate(incoming.dataset, incoming.key, incoming.size, incoming.last_access, True)
            return choose_victims(incoming, residents, need, policy=policy, next_use=next_use)

        return choose
