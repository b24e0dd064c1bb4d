"""Units shared by the readers of one process (`OpenUnits`): a unit is closed only when no reader holds it."""

from __future__ import annotations

import mmap
from pathlib import Path

from datacache.loaders.runtime import OpenUnits
from datacache.loaders.shardfiles import TarReader, Unit, UnitReader
from test_loader import write_wds


def _opener(path: Path, opened: list[UnitReader]) -> TarReader:
    """A real reader of the shard at ``path``, mapped as the loader maps a cached copy."""
    with open(path, "rb") as handle:
        buffer = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    reader = TarReader(Unit((path.name,), 10, path.name), str(path), buffer)
    opened.append(reader)
    return reader


def test_a_unit_a_second_reader_holds_is_not_handed_back_for_closing(tmp_path: Path) -> None:
    """Issue 24 item 17: one reader releasing a unit another still reads must not get it back to close.

    With nothing kept (``keep`` 0, one reader per process), a released unit is closed at once,
    but only once the last of its readers is done: closing it earlier unmaps the bytes the
    other reader is reading.
    """
    write_wds(tmp_path, samples=10, per_shard=10)
    path = next(tmp_path.glob("*.tar"))
    units = OpenUnits()
    opened: list[UnitReader] = []
    first = units.acquire(0, lambda: _opener(path, opened))
    second = units.acquire(0, lambda: _opener(path, opened))
    assert second is first and len(opened) == 1, "the second reader takes the unit already open"
    assert units.release(0, first) == [], "a second reader still holds it"
    fields = dict(second.fields(9))  # the other reader reads on
    assert bytes(fields["__key__"]) == b"sample000009"
    del fields  # views into the mapping: closing needs them gone
    assert units.release(0, second) == [first], "the last reader's release closes it"
    assert units.close_idle() == []
    first.close()


def test_a_kept_unit_goes_back_to_the_next_reader_and_closes_after_it(tmp_path: Path) -> None:
    """With ``keep``, a released unit stays open for the next reader, who takes the same one."""
    write_wds(tmp_path, samples=10, per_shard=10)
    path = next(tmp_path.glob("*.tar"))
    units = OpenUnits()
    units.keep = 1
    opened: list[UnitReader] = []
    first = units.acquire(0, lambda: _opener(path, opened))
    held = units.acquire(0, lambda: _opener(path, opened))
    assert units.release(0, first) == []
    assert units.release(0, held) == [], "kept open: keep is 1"
    again = units.acquire(0, lambda: _opener(path, opened))
    assert again is first and len(opened) == 1
    assert units.release(0, again) == []
    assert units.close_idle() == [first]
    first.close()
