"""A daemon outage is not a job outage for a torchrun-shaped job either (issue 34 item 1).

2 ranks of real ``torch.distributed`` (gloo, real processes) x 2 DataLoader workers each, run as
``bob``, a member of the daemon's group (by supplementary membership) who is not the daemon's user
and may write nothing of its cache. The daemon is SIGKILLed 10 samples into epoch 0 on each rank,
stays away through epoch 1 (its workers start with no daemon), and is restarted before epoch 2,
which reads through the daemon again. Every epoch is exactly once across the ranks with every byte
right. Before the failover to `datacache._outage.OutageAccess`, each worker failed with "the node
cache ... is not writable by uid".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import _users
import pytest
from _daemon import wait_until
from _outage import Node, job_env, node, owned_only_by
from _users import User

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]


def _both(signals: Path, word: str, trainer: subprocess.Popen[bytes], errors: Path) -> None:
    """Wait until both ranks touched ``word-RANK`` (or the trainer died)."""

    def said() -> bool:
        if trainer.poll() is not None:
            raise AssertionError(f"the trainer left (rc {trainer.returncode}):\n{errors.read_text()}")
        return all((signals / f"{word}-{rank}").exists() for rank in (0, 1))

    wait_until(said, timeout=300, what=f"both ranks to say {word}")


@pytest.mark.timeout(900)  # 3 epochs of 2 ranks x 2 workers and 2 daemon starts, on a machine others load
def test_two_gloo_ranks_of_a_job_user_read_each_epoch_once_through_the_daemons_sigkill_and_back(
    node: Node, users: dict[str, User]
) -> None:
    want = sorted([key, hashlib.sha256(fields["bin"]).hexdigest()] for key, fields in node.expected.items())
    bob = users["bob"]
    assert node.team in bob.groups and bob.gid != node.team and bob.uid != node.user.uid
    tmp, env = job_env(bob, node)
    signals = bob.home / "signals"  # the test (root) writes its answers here; bob reads them
    signals.mkdir(mode=0o700)
    os.chown(signals, bob.uid, bob.gid)
    errors = node.world / "ranks.err"

    daemon = node.serve()
    trainer: subprocess.Popen[bytes] | None = None
    try:
        with errors.open("wb") as err:
            trainer = subprocess.Popen(
                [sys.executable, "-c", f"import _outage_ranks; _outage_ranks.main({str(signals)!r})"],
                user=bob.uid, group=bob.gid, extra_groups=list(bob.groups), env=env, cwd=bob.home,
                stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
            )
        _both(signals, "kill", trainer, errors)  # epoch 0, mid-epoch, on both ranks
        daemon.kill()
        (signals / "killed").touch()
        _both(signals, "restart", trainer, errors)  # epochs 0 and 1 done without the daemon
        private = {path.name for path in tmp.rglob("*.tar")}
        assert private, "the shards not resident were staged in bob's own directory"
        daemon = node.serve()
        (signals / "restarted").touch()
        trainer.wait(timeout=600)
        assert trainer.returncode == 0, errors.read_text()
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        daemon.kill()
    ranks = json.loads((signals / "result.json").read_text())
    assert len(ranks) == 2
    for epoch in range(3):
        first, second = (ranks[rank][epoch]["seen"] for rank in (0, 1))
        assert len(first) == len(second) == len(want) // 2, f"epoch {epoch}: the ranks' halves"
        assert sorted(first + second) == want, f"epoch {epoch}: every sample once across the ranks, every byte right"
        assert max(Counter(key for key, _ in first + second).values()) == 1
    modes = [[ranks[rank][epoch]["mode"] for epoch in range(3)] for rank in (0, 1)]
    outage = "embedded (daemon unavailable)"
    assert modes == [[outage, outage, "daemon"]] * 2, "the last epoch reads through the daemon again"
    log = errors.read_text()
    assert "not writable by uid" not in log and "Traceback" not in log, log
    owned_only_by(node.local, node.user.uid)
    owned_only_by(tmp, bob.uid, private=True)
