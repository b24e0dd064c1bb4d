"""The node's future reads of one dataset, as arrays of indices into a column of shard keys.

At 1e6 shards the future as tuples of key strings (8 ranks' readers, each key referenced from
every sequence that reads it) and the stager's index of it (a dict of key -> positions per reader)
were ~600 MB in each process that read the dataset. Here a reader's sequence is an integer array
into a key column: the manifest's own `ShardTable` when the loader hands the future over in
process (no key decoded), or a `KeyList` of the keys sent when it crosses the daemon's socket.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["FutureOrder", "KeyColumn", "KeyList"]


class KeyColumn(Protocol):
    """Distinct shard keys by index, and the index of a key (`datacache.manifest.ShardTable` is one)."""

    def __len__(self) -> int: ...

    def keys_at(self, indices: npt.NDArray[np.int64]) -> list[str]: ...

    def position(self, key: str) -> int | None: ...

    def positions(self, keys: Sequence[str]) -> npt.NDArray[np.int64]:
        """The index of each of ``keys``, -1 for one not in the column."""
        ...


class KeyList(Sequence[str]):
    """A key column of plain strings, each once: what a future given as key sequences is indexed by."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = list(keys)
        self._index = {key: at for at, key in enumerate(self._keys)}
        if len(self._index) != len(self._keys):
            raise ValueError("a future order's key column names a key twice")

    @classmethod
    def _indexed(cls, index: dict[str, int]) -> KeyList:
        column = cls.__new__(cls)
        column._keys, column._index = list(index), index
        return column

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, index: Any) -> Any:
        return self._keys[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def keys_at(self, indices: npt.NDArray[np.int64]) -> list[str]:
        keys = self._keys
        return [keys[at] for at in np.asarray(indices).tolist()]

    def position(self, key: str) -> int | None:
        return self._index.get(key)

    def positions(self, keys: Sequence[str]) -> npt.NDArray[np.int64]:
        index = self._index
        return np.fromiter((index.get(key, -1) for key in keys), dtype=np.int64, count=len(keys))


def _frozen(reads: npt.NDArray[Any], size: int, name: str) -> npt.NDArray[np.integer[Any]]:
    """``reads`` as a read-only view (no copy, whatever its integer type), each index below ``size``."""
    array = np.asarray(reads)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        if array.size or array.ndim != 1:
            raise ValueError(f"reader {name!r} of a future order needs a flat array of integer indices")
        array = array.astype(np.int64)  # an empty list's array is of floats
    array = array.view()
    if array.size and (int(array.min()) < 0 or int(array.max()) >= size):
        raise ValueError(f"reader {name!r} of a future order reads an index outside its {size} keys")
    array.flags.writeable = False  # a view: the caller's array stays as writeable as it was
    return array


class FutureOrder:
    """The whole node's future reads of one dataset: each reader's shard keys in its own order.

    Every reader computes the same value from ``(seed, epoch)`` and the job's layout (all ranks,
    all workers), so whoever hands it over last changes nothing. Positions in `ReaderProgress`
    index these sequences. ``FutureOrder(epoch, {reader: keys})`` takes key strings;
    `FutureOrder.of_indices` takes index arrays into a key column as they are, with no key made.
    Immutable: ``reads`` are read-only arrays, shared between readers that read the same sequence.
    """

    __slots__ = ("epoch", "keys", "reads")

    epoch: int
    keys: KeyColumn
    """The column ``reads`` index into."""
    reads: Mapping[str, npt.NDArray[np.integer[Any]]]
    """Reader -> the indices into ``keys`` of the shards it reads, in its order."""

    def __init__(self, epoch: int, readers: Mapping[str, Sequence[str]]) -> None:
        index: dict[str, int] = {}
        made: dict[int, npt.NDArray[np.integer[Any]]] = {}
        reads: dict[str, npt.NDArray[np.integer[Any]]] = {}
        for name, keys in readers.items():
            if id(keys) not in made:
                found = [index.setdefault(key, len(index)) for key in keys]
                made[id(keys)] = np.asarray(found, dtype=np.int64)
            reads[name] = made[id(keys)]
        self._set(epoch, KeyList._indexed(index), reads)

    @classmethod
    def of_indices(cls, epoch: int, keys: KeyColumn, reads: Mapping[str, npt.NDArray[np.integer[Any]]]) -> FutureOrder:
        """The future whose readers read ``keys`` at ``reads``: the arrays are kept as read-only views, not copied.

        Their holder must not write them after (the loader's are made once and never written)."""
        order = cls.__new__(cls)
        order._set(epoch, keys, reads)
        return order

    def _set(self, epoch: int, keys: KeyColumn, reads: Mapping[str, npt.NDArray[Any]]) -> None:
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError("a future order's epoch must be a non-negative integer")
        frozen: dict[int, npt.NDArray[np.integer[Any]]] = {}
        checked: dict[str, npt.NDArray[np.integer[Any]]] = {}
        for name, array in reads.items():
            if id(array) not in frozen:
                frozen[id(array)] = _frozen(array, len(keys), name)
            checked[name] = frozen[id(array)]
        object.__setattr__(self, "epoch", epoch)
        object.__setattr__(self, "keys", keys)
        object.__setattr__(self, "reads", MappingProxyType(checked))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a FutureOrder is immutable: cannot set {name}")

    @property
    def readers(self) -> dict[str, tuple[str, ...]]:
        """Reader -> its keys, as strings: every key decoded, for tests and small futures only."""
        made: dict[int, tuple[str, ...]] = {}
        for array in self.reads.values():
            if id(array) not in made:
                made[id(array)] = tuple(self.keys.keys_at(array.astype(np.int64, copy=False)))
        return {name: made[id(array)] for name, array in self.reads.items()}

    def sequence(self, reader: str, stop: int | None = None) -> list[str]:
        """The keys ``reader`` reads (its first ``stop``), decoded; none for a reader not in the order."""
        array = self.reads.get(reader)
        return [] if array is None else self.keys.keys_at(array[:stop].astype(np.int64, copy=False))

    def begins(self, other: FutureOrder) -> bool:
        """Whether this order is ``other`` or ``other`` with more reads after it, reader by reader."""
        if self.epoch != other.epoch:
            return False
        # Equal columns compare as indices: the daemon parses one per client, each the same list.
        same = self.keys is other.keys or (
            isinstance(self.keys, KeyList) and isinstance(other.keys, KeyList) and self.keys._keys == other.keys._keys
        )
        for name, theirs in other.reads.items():
            mine = self.reads.get(name)
            if mine is None or len(mine) < len(theirs):
                if len(theirs):
                    return False
                continue
            if same:
                if not np.array_equal(mine[: len(theirs)], theirs):
                    return False
            elif self.sequence(name, len(theirs)) != other.sequence(name):
                return False
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FutureOrder):
            return NotImplemented
        return self.reads.keys() == other.reads.keys() and self.begins(other) and other.begins(self)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        # Unpickled through the checks, never by setting the slots (which __setattr__ refuses).
        return (FutureOrder.of_indices, (self.epoch, self.keys, dict(self.reads)))

    def __repr__(self) -> str:
        lengths = {name: len(array) for name, array in self.reads.items()}
        return f"FutureOrder(epoch={self.epoch}, reads={lengths}, keys={len(self.keys)})"

    def used_keys(self) -> list[str]:
        """Every key some reader reads, each once."""
        return self.keys.keys_at(self._used())

    def _used(self) -> npt.NDArray[np.int64]:
        present = [array for array in {id(a): a for a in self.reads.values()}.values() if len(array)]
        return np.unique(np.concatenate(present)).astype(np.int64, copy=False) if present else np.zeros(0, np.int64)

    def to_json(self) -> dict[str, Any]:
        """Each key read once, and each reader's sequence as indices into them."""
        used = self._used()
        reads = {name: np.searchsorted(used, array).tolist() for name, array in self.reads.items()}
        return {"epoch": self.epoch, "keys": self.keys.keys_at(used), "reads": reads}

    @classmethod
    def from_json(cls, data: object) -> FutureOrder:
        """Parse `to_json`'s form (or the earlier one, of key lists); raise ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a future order must be an object")
        epoch = data.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError("a future order's epoch must be a non-negative integer")
        if "reads" not in data:
            return cls(epoch, _key_lists(data.get("readers")))
        keys, reads = data.get("keys"), data.get("reads")
        if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
            raise ValueError("a future order needs a list of shard keys")
        if not isinstance(reads, dict):
            raise ValueError("a future order needs an object of readers")
        column = KeyList(keys)
        arrays: dict[str, npt.NDArray[np.integer[Any]]] = {}
        for name, indices in reads.items():
            if not isinstance(indices, list) or not all(type(i) is int for i in indices):
                raise ValueError(f"reader {name!r} of a future order needs a list of key indices")
            try:
                arrays[str(name)] = np.asarray(indices, dtype=np.int64)
            except OverflowError:
                raise ValueError(f"reader {name!r} of a future order reads an index outside its keys") from None
        return cls.of_indices(epoch, column, arrays)


def _key_lists(readers: object) -> dict[str, tuple[str, ...]]:
    if not isinstance(readers, dict):
        raise ValueError("a future order needs an object of readers")
    found: dict[str, tuple[str, ...]] = {}
    for name, keys in readers.items():
        if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
            raise ValueError(f"reader {name!r} of a future order needs a list of shard keys")
        found[str(name)] = tuple(keys)
    return found
