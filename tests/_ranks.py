"""Real torch.distributed ranks for the tests: gloo process groups in spawned processes.

A test hands `spawn_ranks` a top-level function ``main(rank, world, init_file, *args)``; the
function runs its body ``with process_group(rank, world, init_file):`` (gloo, rendezvous
through a file, destroyed however the body ends) and may collect every rank's result with
`gather_json` (rank 0 writes them, in rank order, for the test to read).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["gather_json", "process_group", "spawn_ranks"]


@contextmanager
def process_group(rank: int, world: int, init_file: str) -> Iterator[None]:
    """This process as rank ``rank`` of ``world``, for the block (gloo; ``init_file`` is the rendezvous)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def gather_json(value: Any, out: str | Path) -> None:
    """Every rank's ``value``, in rank order, written as JSON to ``out`` by rank 0 (a collective call)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))


def spawn_ranks(
    main: Callable[..., None], init_file: str | Path, *args: Any, world: int = 2, join: bool = True
) -> mp.ProcessContext | None:
    """``main(rank, world, init_file, *args)`` in ``world`` spawned processes; joined unless ``join=False``.

    A rank that raises makes the join raise, with its traceback. Not joined: the caller polls
    the returned context (``context.join(0.01)`` raises if a rank failed) while it looks on.
    """
    return mp.spawn(main, args=(world, str(init_file), *args), nprocs=world, join=join)
