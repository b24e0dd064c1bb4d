"""What a saved dataset state holds beyond the cursors: its version, identity, and torchdata's per-worker form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from datacache.loaders.iterator import ITERATOR_MARK
from datacache.loaders.mixed import Mix
from datacache.loaders.order import Cursor
from datacache.loaders.runtime import Runtime

__all__ = ["STATE_VERSION", "find_iterator_states", "identity", "state_from_iterators"]

STATE_VERSION = 1


def identity(runtime: Runtime) -> tuple[str, str]:
    """What a saved state was taken from: ``(dataset id, manifest snapshot)``, or a mix's."""
    mix: Mix | None = runtime.mix
    if mix is not None:
        return mix.identity()
    return runtime.handle.manifest.dataset, runtime.handle.manifest.snapshot


def find_iterator_states(state: Any) -> list[Mapping[str, Any]]:
    found: list[Mapping[str, Any]] = []
    if isinstance(state, Mapping):
        if state.get(ITERATOR_MARK) == 1:
            return [state]
        for value in state.values():
            found.extend(find_iterator_states(value))
    elif isinstance(state, list | tuple):
        for value in state:
            found.extend(find_iterator_states(value))
    return found


def state_from_iterators(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Turn the per-worker iterator states a StatefulDataLoader saved into one dataset state."""
    first = states[0]
    layout = first["layout"]
    produced = [0] * int(layout["num_workers"])
    for entry in states:
        produced[int(entry["layout"]["worker"])] = int(entry["produced"])
    cursor = Cursor(
        int(layout["world_size"]),
        int(layout["num_workers"]),
        int(layout["chunk"]),
        tuple(produced),
        cold=first.get("cold") is True,
    )
    return {
        "version": STATE_VERSION,
        "epoch": int(first["epoch"]),
        "seed": first["seed"],
        "cursors": [*first["cursors"], cursor.to_json()],
    }
