"""What a saved dataset state holds beyond the cursors: its version and torchdata's per-worker form."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from datacache.loaders.order.layout import Cursor
from datacache.loaders.plans.interface import Plan, Planner
from datacache.loaders.reading.iterator import ITERATOR_MARK

from datacache.errors import ConfigError

__all__ = [
    "STATE_VERSION",
    "check_same",
    "describe",
    "find_iterator_states",
    "loader_batch",
    "read_state",
    "state_from_iterators",
]

STATE_VERSION = 1


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


def read_state(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], int, tuple[Cursor, ...]]:
    """A saved state (a torchdata loader's per-worker ones made one), its epoch and its cursors."""
    iterator_states = find_iterator_states(state)
    if "cursors" not in state and iterator_states:
        state = state_from_iterators(iterator_states)
    try:
        version = state["version"]
        cursors = tuple(Cursor.from_json(c) for c in state["cursors"])
        epoch = int(state["epoch"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"not a CachedIterableDataset state: {exc}") from None
    if version != STATE_VERSION:
        raise ConfigError(f"unsupported state version {version!r}")
    return state, epoch, cursors


def check_same(state: Mapping[str, Any], ours: Mapping[str, object], identity: Callable[[], tuple[str, str]]) -> None:
    """Refuse a state saved with other options (``ours``) or from another dataset or snapshot (``identity``)."""
    for name, value in ours.items():
        if name in state and state[name] != value:
            raise ConfigError(f"the saved state used {name}={state[name]!r}, this dataset has {value!r}")
    if "snapshot" in state:
        dataset, snapshot = identity()
        if state.get("dataset", dataset) != dataset:
            raise ConfigError(f"the saved state is for dataset {state['dataset']}, this one reads {dataset}")
        if state["snapshot"] != snapshot:
            raise ConfigError(
                f"dataset {dataset}: the saved state is for manifest snapshot {state['snapshot']}, "
                f"the cache now holds {snapshot}; resume needs the same snapshot"
            )


def loader_batch(dataset_batch: int | None, batch_size: int | None, workers: int) -> int:
    """Samples in each batch the DataLoader takes from one worker (``dataset_batch``: the dataset's own)."""
    if batch_size is not None and batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    if dataset_batch:
        if batch_size is not None and batch_size != dataset_batch:
            raise ConfigError(
                f"state_dict(batch_size={batch_size}) but the dataset yields batches of {dataset_batch} "
                "(with DataLoader(batch_size=None)); leave batch_size out"
            )
        return dataset_batch
    if batch_size is not None:
        return batch_size
    if workers > 1:
        raise ConfigError(
            f"with {workers} DataLoader worker processes, pass the DataLoader's batch size too: "
            "state_dict(samples_consumed=steps * batch_size, batch_size=batch_size)"
        )
    return 1


def describe(planner: Planner, window: int | None, epoch: int, plan: Plan) -> dict[str, Any]:
    """What a reader of epoch ``epoch`` knows of a state's fields (`statehead`); ``window``: its shuffle window."""
    dataset, snapshot = planner.identity()
    return {
        "epoch": epoch,
        "cold": plan.cold,
        "dataset": dataset,
        "snapshot": snapshot,
        "fields": planner.state_fields(),
        "window": window,
    }
