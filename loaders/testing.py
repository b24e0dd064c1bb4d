"""`PlanTests`: the contract every kind of epoch plan (`plans.interface.Plan`) keeps, as a pytest suite.

As `datacache.tiers.testing` does for tiers, this suite ships with the package,
so a new kind of epoch (a new first-epoch dealing, say) proves itself with the
same tests as the indexed, first-epoch and mixed plans: every sample once
across ranks and workers, equal rank lengths, units opened before and closed
after their reads, and resume on another layout reading exactly the rest. It
needs pytest and Hypothesis, imported here only.

Example
-------
::

    from datacache.loaders.testing import PlanTests

    class TestMyPlan(PlanTests):
        def make_plan(self, counts, layout, dealing, *, epoch, cursors):
            return my_plan(counts, layout, dealing, epoch=epoch, cursors=cursors)

`MemoryCounts` and `grown` give a first-epoch plan its counts from plain
values: the counts arrive as the plan asks for those of the units it reads next, and the rest
when it asks for them all (or at once, with ``background=True``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.order.windows import exclusive_sum
from datacache.loaders.plans.interface import Dealing, Plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

__all__ = ["MemoryCounts", "PlanTests", "grown", "read_ids"]

IntArray = npt.NDArray[np.int64]

_counts = st.lists(st.integers(0, 30), min_size=1, max_size=10).map(lambda c: np.asarray(c, dtype=np.int64))
_EACH_KIND = [HealthCheck.differing_executors]
"""Each subclass runs the same tests on its own kind: deterministic, so sharing the examples is safe."""
_layouts = st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4))
"""(world size, workers, chunk): workers 1 stands for DataLoader's 0 and 1 alike."""


class MemoryCounts:
    """A `plans.cold.Counts` over known values: unknown until counted (or all at once, ``background``)."""

    def __init__(self, counts: IntArray, *, background: bool = False) -> None:
        self._all = np.asarray(counts, dtype=np.int64)
        self.counts = np.full(len(self._all), -1, dtype=np.int64)
        self._background = background
        self.unreadable: dict[int, str] = {}

    @property
    def complete(self) -> bool:
        return bool((self.counts >= 0).all())

    def start(self) -> None:
        if self._background:
            self.counts[:] = self._all  # the cluster's index finished at once

    def note(self, unit: int, samples: int) -> None:
        self.counts[unit] = samples

    def note_unreadable(self, unit: int, why: str) -> None:
        self.unreadable[unit] = why
        self.note(unit, 0)

    def known_total(self) -> int:
        return int(self.counts[self.counts >= 0].sum())

    def wait_for_more(self, than: int, timeout: float = 5.0) -> bool:
        return False  # nothing counts in the background: the plan asks for every count

    def wait_complete(self) -> IntArray:
        self.counts[:] = self._all
        return self.counts.copy()


def grown(plan: Plan, length: int, counts: IntArray) -> int:
    """``plan.known(length)``, handing the plan the counts it asks for as a reader would (opening the units)."""
    known = plan.known(length)
    while known < length and (wanted := plan.uncounted()):
        for unit in wanted:
            plan.counted(unit, int(counts[unit]))
        known = plan.known(length)
    return known


def read_ids(plan: Plan, counts: IntArray, upto: int | None = None) -> list[int]:
    """The sample ids ``plan`` yields (its first ``upto``), as `EpochIterator` walks it: growing it as it goes."""
    bounds = exclusive_sum(counts)
    found: list[int] = []
    position = 0
    while (upto is None or position < upto) and position < grown(plan, position + 1, counts):
        found.append(int(bounds[plan.positions.unit_of[position]]) + int(plan.positions.local[position]))
        position += 1
    return found


class PlanTests:
    """The contract of a kind of epoch plan; subclass with `make_plan`."""

    shuffle = True

    def make_plan(
        self, counts: IntArray, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]
    ) -> Plan:
        """Reader ``layout``'s plan of epoch ``epoch`` of a dataset of units of ``counts`` samples."""
        raise NotImplementedError

    def _epoch(
        self, counts: IntArray, shape: tuple[int, int, int], cursors: tuple[Cursor, ...], drop_last: bool = False
    ) -> list[list[Plan]]:
        world, workers, chunk = shape
        dealing = Dealing(seed=11, shuffle=self.shuffle, drop_last=drop_last)
        return [
            [
                self.make_plan(counts, Layout(world, rank, workers, worker, chunk), dealing, epoch=2, cursors=cursors)
                for worker in range(workers)
            ]
            for rank in range(world)
        ]

    @settings(max_examples=60, deadline=None, suppress_health_check=_EACH_KIND)
    @given(counts=_counts, shape=_layouts, drop_last=st.booleans())
    def test_every_sample_once_and_every_rank_as_long(
        self, counts: IntArray, shape: tuple[int, int, int], drop_last: bool
    ) -> None:
        total, world = int(counts.sum()), shape[0]
        seen: list[int] = []
        lengths, padded = [], 0
        for readers in self._epoch(counts, shape, (), drop_last):
            rank_length = 0
            for plan in readers:
                ids = read_ids(plan, counts)
                padded += plan.positions.padded
                seen.extend(ids[: len(ids) - plan.positions.padded])
                rank_length += len(ids)
            lengths.append(rank_length)
        assert len(set(lengths)) == 1, f"ranks read {lengths} samples: not all as many"
        assert len(seen) == len(set(seen)), "a sample was read twice (padding aside)"
        if drop_last:
            assert lengths[0] == total // world
        else:
            assert sorted(seen) == list(range(total)), "a sample was skipped"
            assert padded < world, "more padding than equal lengths need"

    @settings(max_examples=40, deadline=None, suppress_health_check=_EACH_KIND)
    @given(counts=_counts, shape=_layouts)
    def test_a_unit_is_opened_before_and_released_after_its_reads(
        self, counts: IntArray, shape: tuple[int, int, int]
    ) -> None:
        for readers in self._epoch(counts, shape, ()):
            for plan in readers:
                length = grown(plan, 1 << 62, counts)
                reads = plan.positions
                released: dict[int, int] = {}
                for position in range(length):
                    for unit in reads.releases_after(position):
                        released.setdefault(unit, position)
                sequence = set(reads.unit_sequence)
                for position in range(length):
                    unit = int(reads.unit_of[position])
                    assert unit in sequence, f"unit {unit} is read but not in the unit sequence"
                    assert reads.first_use[unit] <= position, f"unit {unit} is read before its first use"
                    assert released.get(unit, length) >= position, f"unit {unit} is released before a read"
                    assert plan.readable(position, 3, length) == length, "a whole plan is readable to its end"

    @settings(max_examples=60, deadline=None, suppress_health_check=_EACH_KIND)
    @given(counts=_counts, before=_layouts, after=_layouts, fraction=st.floats(0, 1))
    def test_resume_on_another_layout_reads_exactly_the_rest(
        self, counts: IntArray, before: tuple[int, int, int], after: tuple[int, int, int], fraction: float
    ) -> None:
        consumed: list[int] = []
        first = self._epoch(counts, before, ())
        # Every rank's workers got as far: equal rank lengths make their positions alike.
        produced = tuple(int(grown(plan, 1 << 62, counts) * fraction) for plan in first[0])
        for readers in first:
            for worker, plan in enumerate(readers):
                consumed.extend(read_ids(plan, counts, produced[worker]))
        cursor = Cursor(before[0], before[1], before[2], produced, cold=first[0][0].cold)
        again = self._epoch(counts, after, (cursor,))
        resumed = [i for readers in again for plan in readers for i in read_ids(plan, counts)]
        everything = Counter(consumed + resumed)
        assert set(everything) == set(range(int(counts.sum()))), "a sample was skipped"
        assert sum(n - 1 for n in everything.values()) < before[0] + after[0], "only padding repeats"
