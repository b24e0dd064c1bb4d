"""A uid alone on the node leases what its readers read next; its share binds only while others use the tier.

Issue 25: through the daemon with a local tier smaller than the dataset, each reader holds the
unit it opens and the next few; a bound of half the tier for the one uid of the node refused
readers the leases of the shards they read next (refused in every run of
`benchmarks/daemon_bigger.py`), so eviction could take them between the note and the map. The
bound exists so that one uid cannot pin the tier against another (docs/SECURITY.md): it now
applies while another uid asks this daemon for room, and cuts what the first holds past its
share as soon as that other uid arrives (`tests/test_daemon_leases.py` for the other uid).
A real daemon subprocess, a real S3 server (moto).
"""

from __future__ import annotations

import collections
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from _daemon import start_daemon, unix_request
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.config import load_settings

if TYPE_CHECKING:
    from conftest import S3Bucket  # the fixture's type; tests/faults has a conftest of that name too


def _upload(s3: S3Bucket, directory: Path) -> str:
    for path in sorted(directory.iterdir()):
        s3.put(f"wds/{path.name}", path.read_bytes())
    return s3.url("wds/")


def test_a_lone_uid_reading_a_dataset_bigger_than_the_tier_is_never_refused_a_lease(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=120, per_shard=10)  # 12 shards
    size = max(p.stat().st_size for p in origin.glob("*.tar"))
    url = _upload(s3, origin)
    # Room for 4 shards: a bound of half the tier is 2, and each reader holds the unit it opens
    # and up to 4 next ones.
    daemon = start_daemon(cache_env, tmp_path / "local", "--local-capacity", f"{4 * size}B")
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(url, config=settings, seed=7, shuffle=True)
        for epoch in range(2):
            dataset.set_epoch(epoch)
            keys = keys_of(DataLoader(dataset, batch_size=None, num_workers=2))
            assert collections.Counter(keys) == collections.Counter(list(expected)), f"epoch {epoch}: each sample once"
        assert dataset.stats().mode == "daemon"
        dataset.close()
        refused = [line for line in daemon.log_text().splitlines() if "may lease" in line]
        assert refused == [], refused
    finally:
        daemon.stop()


def test_a_lone_uid_holds_past_half_the_tier_when_no_other_uid_uses_it(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=60, per_shard=10)  # 6 shards
    size = max(p.stat().st_size for p in origin.glob("*.tar"))
    url = _upload(s3, origin)
    daemon = start_daemon(cache_env, tmp_path / "local", "--local-capacity", f"{4 * size}B")
    try:
        code, opened = daemon.request("POST", "/v1/open", {"dataset": url})
        assert code == 200, opened
        keys = [f"train-{i:04d}.tar" for i in range(3)]
        dataset = opened["dataset_id"]
        for key in keys:
            assert daemon.request("POST", "/v1/ensure", {"dataset": dataset, "key": key})[0] == 200
        # This test's own process is the lease's owner (the kernel names it): it lives throughout.
        progress = {"reader": "r0", "epoch": 0, "position": 0, "holding": keys, "owner": f"{socket.gethostname()}:1"}
        body = {"dataset": dataset, "progress": progress, "locate": keys}
        code, reply = unix_request(daemon.socket, "POST", "/v1/progress", body, timeout=60)
        assert code == 200, reply
        assert reply["holding"] == 3, reply  # three of a 4-shard tier: more than half, and all it reads next
        assert [location["tier"] for location in reply["locations"]] == ["local"] * 3
    finally:
        daemon.stop()
