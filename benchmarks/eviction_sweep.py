"""The eviction sweep: auto, LRU and no-thrash beside the offline optimum, on the loader's own plans.

Run by `benchmarks.run` (``make bench`` / ``make bench-quick``) or alone::

    python -m benchmarks.eviction_sweep [--quick]

No bytes move. Each cell replays one node's reads as the loader plans them
(`datacache.loaders.plans.positions`: every reader's samples dealt from the seeded epoch
order, each shard opened at its first use and closed after its last) through
the code that decides eviction in the stager (`Residency.chooser`, hence
`datacache.eviction.choose_victims`), with the node's future order handed over
at each epoch's start and each reader's position reported as it opens a shard,
as the loader does. What the stager adds is modelled: a shard a reader holds
(open, or among its next ``HOLD_AHEAD``) is never a candidate; a shard missing
when a reader opens it is read from the next tier while its local copy goes in
(the eviction choice decides whether it does); at a training step's pace the
prefetch has staged the reader's next shards before it reaches them, at full
speed it has not (each arrives as the reader opens it).

The figure is the local share: shard opens found on the local tier, over the
epochs after the first (the first starts with an empty tier). ``optimum`` is
Belady's rule with bypass over the same sequence of opens, the whole future
known, prefetch free and nothing held: the limit no online policy reaches.
The table goes into RESULTS.md between ``<!-- eviction-sweep -->`` markers.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from datacache.loaders.order.layout import Dealing, Layout
from datacache.loaders.plans.positions import auto_window, node_unit_sequences, plan_epoch
from datacache.loaders.reading.prefetch import initial_prefetch

from datacache.catalog import ReaderRow
from datacache.eviction import Candidate
from datacache.staging.residency import Residency
from datacache.staging.types import FutureOrder

__all__ = ["Cell", "main", "optimum_share", "saved_table", "simulate", "sweep", "write_table"]

REPO = Path(__file__).resolve().parent.parent
MARK = "<!-- eviction-sweep -->"
POLICIES = ("auto", "lru", "nothrash")
SAMPLES_PER_SHARD = (20, 128, 1000)
CAPACITIES = (0.25, 0.5, 0.75)
READERS = ((1, 1), (2, 2), (4, 2))
PACES = ("fast", "paced")
HOLD_AHEAD = 4  # as `datacache.loaders.reading.units.HOLD_AHEAD`
CONCURRENCY = 8  # the stager's default transfer slots: the prefetch is at least this deep
DATASET = "sweep"


@dataclass(frozen=True)
class Cell:
    """One point of the sweep."""

    samples_per_shard: int
    capacity: float
    ranks: int
    workers: int
    pace: str
    shards: int = 48
    epochs: int = 4
    seed: int = 17


@dataclass
class _Reader:
    name: str
    events: list[tuple[int, int, int]]  # (tick, 0 open / 1 close, unit), in order
    sequence: tuple[int, ...]  # units in order of first use
    index: dict[int, int] = field(default_factory=dict)  # unit -> its place in ``sequence``
    open: set[int] = field(default_factory=set)
    asked: set[int] = field(default_factory=set)  # units its prefetch has asked for
    position: int = 0


def _plans(cell: Cell, epoch: int) -> tuple[list[_Reader], dict[str, tuple[int, ...]]]:
    """Every reader's opens and closes in epoch ``epoch``, and the node's future (this epoch and the next)."""
    counts = [cell.samples_per_shard] * cell.shards
    window = auto_window(sum(counts), len(counts))
    dealing = Dealing(cell.seed, shuffle=True, drop_last=False)
    readers = []
    for rank, worker in itertools.product(range(cell.ranks), range(cell.workers)):
        layout = Layout(cell.ranks, rank, cell.workers, worker)
        plan = plan_epoch(counts, dealing=dealing, epoch=epoch, window=window, cursors=(), layout=layout)
        sequence = tuple(plan.unit_sequence)
        index = {u: i for i, u in enumerate(sequence)}
        # Opens that fall on one tick happen in the plan's order (as a reader opens ahead), closes too.
        events = [(t, 0, u) for u, t in plan.first_use.items()] + [(t, 1, u) for u, t in plan.last_use.items()]
        events.sort(key=lambda event: (event[0], event[1], index[event[2]]))
        readers.append(_Reader(f"{rank}.{worker}", events, sequence, index))
    future = node_unit_sequences(
        counts,
        dealing=dealing,
        epoch=epoch,
        window=window,
        cursors=(),
        layout=Layout(cell.ranks, 0, cell.workers, 0),
    )
    return readers, future


def _key(unit: int) -> str:
    return f"train-{unit:05d}.tar"


class _Node:
    """One node's local tier, as eviction sees it: which shards it holds, and when each was last used."""

    def __init__(self, cell: Cell, policy: str) -> None:
        self.capacity = max(1, int(cell.shards * cell.capacity))
        self.residency = Residency()
        self.handle: Any = SimpleNamespace(id=DATASET, config=SimpleNamespace(policy=policy, pinned=False))
        self.local: dict[int, float] = {}  # unit -> last access
        self.clock = 0.0

    def touch(self, unit: int) -> None:
        self.clock += 1
        if unit in self.local:
            self.local[unit] = self.clock

    def admit(self, unit: int, readers: Sequence[_Reader], epoch: int, *, wanted_now: bool) -> bool:
        """The shard's copy goes in, if the policy makes room for it; whether it went in."""
        if unit in self.local:
            return False
        self.clock += 1
        if len(self.local) < self.capacity:
            self.local[unit] = self.clock
            return True
        held = {u for r in readers for u in r.open} | {
            u for r in readers for u in r.sequence[r.position : r.position + HOLD_AHEAD + 1]
        }
        rows = [ReaderRow(r.name, epoch, r.position) for r in readers]
        choose = self.residency.chooser(self.handle, rows, wanted_now=wanted_now)
        residents = [Candidate(DATASET, _key(u), 1, seen) for u, seen in self.local.items() if u not in held]
        victims = choose(Candidate(DATASET, _key(unit), 1, self.clock), residents, 1)
        if victims is None:
            return False
        for victim in victims:
            del self.local[int(victim.key[6:11])]
        self.local[unit] = self.clock
        return True


def simulate(cell: Cell, policy: str) -> tuple[float, float]:
    """``policy`` in ``cell``, over the epochs after the first: the local share, and the share saved.

    The local share is the shard opens found on the local tier (what the loader's
    stats count). The share saved is one less the shards read from the next tier
    per open, prefetches included: a prefetch turns a miss into a local open, not
    into a transfer saved; the optimum bounds this one.
    """
    node = _Node(cell, policy)
    hits = opens = fetches = 0
    counts = [cell.samples_per_shard] * cell.shards
    window = auto_window(sum(counts), len(counts))
    depth = initial_prefetch(sum(counts), len(counts), window, CONCURRENCY) if cell.pace == "paced" else 0
    for epoch in range(cell.epochs):
        readers, future = _plans(cell, epoch)
        node.residency.set_future_order(
            DATASET, FutureOrder(epoch, {name: tuple(map(_key, units)) for name, units in future.items()})
        )
        merged = sorted((t, kind, n, i, u) for n, r in enumerate(readers) for i, (t, kind, u) in enumerate(r.events))
        for _, kind, n, _, unit in merged:
            reader = readers[n]
            if kind == 1:
                reader.open.discard(unit)
                continue
            reader.position = reader.index[unit]
            reader.open.add(unit)
            found = unit in node.local
            node.touch(unit)
            fetched = 0 if found else 1
            if not found:
                node.admit(unit, readers, epoch, wanted_now=True)
            for ahead in reader.sequence[reader.position + 1 : reader.position + 1 + depth]:
                if ahead not in reader.asked:  # the prefetch asks for each unit once
                    reader.asked.add(ahead)
                    fetched += node.admit(ahead, readers, epoch, wanted_now=False)
            if epoch:
                opens += 1
                hits += found
                fetches += fetched
    return (hits / opens, 1 - fetches / opens) if opens else (0.0, 0.0)


def optimum_share(trace_all: Sequence[str], counted_from: int, capacity: int) -> float:
    """Belady's rule with bypass over ``trace_all``: hits among the opens from ``counted_from`` on."""
    nexts: list[float] = [math.inf] * len(trace_all)
    seen: dict[str, int] = {}
    for i in range(len(trace_all) - 1, -1, -1):
        nexts[i] = seen.get(trace_all[i], math.inf)
        seen[trace_all[i]] = i
    cache: dict[str, float] = {}  # key -> its next use
    hits = 0
    for i, key in enumerate(trace_all):
        if key in cache:
            hits += i >= counted_from
            cache[key] = nexts[i]
            continue
        if len(cache) < capacity:
            cache[key] = nexts[i]
            continue
        farthest = max(cache, key=cache.__getitem__)
        if cache[farthest] > nexts[i]:
            del cache[farthest]
            cache[key] = nexts[i]
    counted = len(trace_all) - counted_from
    return hits / counted if counted else 0.0


def _full_trace(cell: Cell) -> tuple[list[str], int]:
    """Every open of every epoch in order (the order does not depend on the policy), and where epoch 1 starts."""
    trace: list[str] = []
    start = 0
    for epoch in range(cell.epochs):
        if epoch == 1:
            start = len(trace)
        readers, _ = _plans(cell, epoch)
        merged = sorted((t, kind, n, i, u) for n, r in enumerate(readers) for i, (t, kind, u) in enumerate(r.events))
        trace.extend(_key(u) for _, kind, _, _, u in merged if kind == 0)
    return trace, start


def sweep(*, quick: bool) -> list[dict[str, Any]]:
    """Every cell: each policy's local share and the optimum's."""
    shards, epochs = (24, 3) if quick else (48, 4)
    rows = []
    for s, c, (ranks, workers), pace in itertools.product(SAMPLES_PER_SHARD, CAPACITIES, READERS, PACES):
        cell = Cell(s, c, ranks, workers, pace, shards=shards, epochs=epochs)
        row: dict[str, Any] = {"samples_per_shard": s, "capacity": c, "readers": f"{ranks}x{workers}", "pace": pace}
        for policy in POLICIES:
            row[policy], row[f"{policy}_saved"] = simulate(cell, policy)
        trace, start = _full_trace(cell)
        row["optimum"] = optimum_share(trace, start, max(1, int(shards * c)))
        row["auto_margin"] = row["auto"] - max(row["lru"], row["nothrash"])
        row["auto_saved_margin"] = row["auto_saved"] - max(row["lru_saved"], row["nothrash_saved"])
        rows.append(row)
    return rows


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "Local share / share saved (one less next-tier reads per open), epochs after the first:",
        "",
        "| samples/shard | local tier | readers | pace | auto | LRU | no-thrash | optimum (saved) "
        "| auto - max(LRU, no-thrash), local share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        flag = " **below**" if r["auto_margin"] < -0.02 else ""
        shares = " | ".join(f"{r[p]:.2f} / {r[p + '_saved']:.2f}" for p in POLICIES)
        lines.append(
            f"| {r['samples_per_shard']} | {r['capacity']:g} | {r['readers']} | {r['pace']} | {shares} "
            f"| {r['optimum']:.2f} | {r['auto_margin']:+.2f}{flag} |"
        )
    worst = min(rows, key=lambda r: r["auto_margin"])
    gap = sum(r["optimum"] - r["auto_saved"] for r in rows) / len(rows)
    lines.append("")
    lines.append(
        f"Worst cell for auto: {worst['auto_margin']:+.2f} against the better simple policy "
        f"({worst['samples_per_shard']} samples/shard, local {worst['capacity']:g}, {worst['readers']}, "
        f"{worst['pace']}, local share); auto saves on average {gap:.2f} less than the offline optimum."
    )
    return "\n".join(lines)


def saved_table(path: Path) -> str:
    """The sweep's table as ``path`` holds it now, its marks included (empty if none)."""
    text = path.read_text() if path.exists() else ""
    if text.count(MARK) < 2:
        return ""
    _, _, rest = text.partition(MARK)
    return MARK + rest.partition(MARK)[0] + MARK + "\n"


def write_table(block: str, path: Path, *, mark: str = MARK) -> None:
    """Put ``block`` (marks included) into ``path`` in place of the table there, or at its end."""
    if not block:
        return
    text = path.read_text() if path.exists() else ""
    if text.count(mark) >= 2:
        head, _, rest = text.partition(mark)
        text = head + block.rstrip("\n") + rest.partition(mark)[2]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="24 shards, 3 epochs (else 48 shards, 4 epochs)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = sweep(quick=args.quick)
    shown = table(rows)
    print(shown)
    print(f"\n({time.perf_counter() - started:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.results:
        size = "24 shards, 3 epochs" if args.quick else "48 shards, 4 epochs"
        heading = (
            f"### Eviction sweep (`benchmarks/eviction_sweep.py`, simulated on the loader's plans, {size})\n\n"
        )
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results)
    return 0 if all(r["auto_margin"] >= -0.02 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
