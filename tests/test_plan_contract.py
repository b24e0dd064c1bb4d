"""Every kind of epoch plan keeps one contract (`datacache.loaders.testing.PlanTests`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from datacache.loaders.epochs.dataset import cold_plan, indexed_plan
from datacache.loaders.epochs.mix import MixedPlan
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.order.mixed import MixedOrder
from datacache.loaders.order.windows import epoch_order
from datacache.loaders.plans.interface import Dealing, Plan
from datacache.loaders.plans.positions import auto_window, plan_epoch
from datacache.loaders.testing import MemoryCounts, PlanTests

IntArray = npt.NDArray[np.int64]
WINDOW = 4


class TestIndexedPlan(PlanTests):
    def make_plan(
        self, counts: IntArray, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]
    ) -> Plan:
        return indexed_plan(counts, layout, dealing, epoch=epoch, cursors=cursors, window=WINDOW)


class TestUnshuffledIndexedPlan(TestIndexedPlan):
    shuffle = False


class TestColdPlan(PlanTests):
    """A first epoch whose counts arrive only as its reader counts them (and all when it asks)."""

    background = False

    def make_plan(
        self, counts: IntArray, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]
    ) -> Plan:
        if cursors:  # resumed: every count is known by then (as `DatasetPlanner.plan` deals it)
            return indexed_plan(counts, layout, dealing, epoch=epoch, cursors=cursors, window=WINDOW)
        plan = cold_plan(MemoryCounts(counts, background=self.background), layout, dealing, epoch=epoch)
        return plan


class TestColdPlanIndexedInTheBackground(TestColdPlan):
    """The cluster's index completes as soon as the first window is counted."""

    background = True


class TestMixedPlan(PlanTests):
    """Two sources (the units' first half and the rest), each read whole once an epoch."""

    def make_plan(
        self, counts: IntArray, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]
    ) -> Plan:
        half = max(1, len(counts) // 2)
        sources = [counts[:half], counts[half:]]
        totals = np.asarray([int(s.sum()) for s in sources], dtype=np.int64)
        order = MixedOrder.of(
            sources,
            totals,
            seed=dealing.seed,
            epoch=epoch,
            shuffle=dealing.shuffle,
            windows=(WINDOW, WINDOW),
            replacement=False,
        )
        reads = plan_epoch(
            counts,
            dealing=dealing,
            epoch=epoch,
            window=auto_window(int(counts.sum()), len(counts)),
            cursors=cursors,
            layout=layout,
            order=order,
        )
        return MixedPlan(reads)


def test_each_epoch_orders_the_samples_inside_a_window_afresh() -> None:
    """One shard, one window: the shards' shuffle cannot change the order, only the window's permutation can.

    A permutation keyed by (seed, window) alone would give every epoch the same order inside each window.
    """
    for seed in range(5):
        orders = [epoch_order([64], seed=seed, epoch=epoch, shuffle=True, window=64).tolist() for epoch in range(4)]
        assert all(sorted(order) == list(range(64)) for order in orders)
        assert len({tuple(order) for order in orders}) == 4, f"seed {seed}: epochs repeat a window's order"
