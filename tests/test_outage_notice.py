"""A daemon outage is said once per training process and outage, not by every DataLoader worker every epoch.

torch's DataLoader starts new workers each epoch; each opened its own access and said "reading
through this process's own stager" (and, where the cache is the daemon's, where it stages the
rest) again: 2 workers x 4 epochs without the daemon gave 8 of each. What a user expects: once per
outage, "reconnected" once when the daemon is back, and a new outage said again. As the trial ran
it: the daemon as its own account, the job as ``bob`` of its group (tests/test_outage_multiuser.py).
"""

from __future__ import annotations

import json
import re

import _users
import pytest
from _outage import SAY, Node, Scripted, job_env, node
from _users import User, python_as

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]

_TRAIN = SAY + """
import json
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset

ds = CachedIterableDataset("train", shuffle=True, seed=3)
loader = DataLoader(ds, batch_size=None, num_workers=2)
read = []
for epoch in range(5):
    ds.set_epoch(epoch)
    if epoch == 2:
        say("start")  # the daemon answers from epoch 2
    if epoch == 3:
        say("kill")  # a new outage, from epoch 3 on
    read.append([sum(1 for _ in loader), ds.stats().mode])
print(json.dumps(read), flush=True)
"""

OUTAGE = "reading through this process's own stager"
WHERE = "is the daemon's: reading its resident shards there"
BACK = "reconnected to the datacache daemon"


@pytest.mark.timeout(600)  # 5 epochs of DataLoader workers and a daemon start, on a machine others load
def test_each_outage_is_said_once_by_a_training_process_not_by_each_worker_every_epoch(
    node: Node, users: dict[str, User]
) -> None:
    bob = users["bob"]
    tmp, env = job_env(bob, node)
    daemon = None
    try:
        with Scripted(bob, _TRAIN, env, node.world / "trainer.err") as trainer:
            for word in ("start", "kill"):
                trainer.expect(word)
                if word == "start":
                    daemon = node.serve()
                else:
                    assert daemon is not None
                    daemon.kill()
                trainer.go()
            out = trainer.finish(timeout=600)
    finally:
        if daemon is not None:
            daemon.kill()
    read = json.loads(out.strip().splitlines()[-1])
    outage = "embedded (daemon unavailable)"
    assert read == [[96, outage], [96, outage], [96, "daemon"], [96, outage], [96, outage]], read
    log = trainer.errors.read_text()
    said = {words: log.count(words) for words in (OUTAGE, WHERE, BACK)}
    assert said == {OUTAGE: 2, WHERE: 2, BACK: 1}, f"{said}:\n{log}"
    # Its bound in the units the rest of the output uses (a trial read "at most 200000000 bytes").
    assert re.search(r"\(at most \d+(\.\d+)? [kMGT]?B\) until the daemon is back", log), log
    # It ended in an outage: its markers stay until the next process that notices one removes them.
    (left,) = {marker.name.rsplit("-", 2)[1] for marker in tmp.glob("datacache-*/*.notice-*")}
    assert left == str(trainer.pid), left
    noticed = python_as(bob, f"""
        from pathlib import Path
        from datacache._outage import OutageNotice
        OutageNotice(Path({str(node.local)!r})).say("the daemon is away")
    """, env=env)
    assert noticed.returncode == 0 and "the daemon is away" in noticed.stderr, noticed.stderr
    owners = {marker.name.rsplit("-", 2)[1] for marker in tmp.glob("datacache-*/*.notice-*")}
    assert str(trainer.pid) not in owners, "an ended training process's markers are removed"
