"""Two checks no earlier test would miss if they were weakened (issue 33 item 14).

- A redirect stays inside what the client opened *at a path boundary*: ``http://h/ok/`` may go
  to ``http://h/ok/x``, never to ``http://h/ok-private/``, whose name merely starts the same.
- The cluster's count files are believed on their writer's word only if the writer is trusted
  (`IndexFiles.read_trusted`): a count file another uid planted on the shared tier is ignored,
  both where the known counts are read and where a batch is found done.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_shards
from datacache.tiers import ObjectTier
from datacache.tiers.object import CONFINE_REDIRECTS
from test_cold_index import build_counts, counts_on_disk
from test_index_files import _snapshot_dir
from test_loader import write_wds

from datacache.config import Settings
from datacache.counting.indexfiles import KnownCount, encode_batch
from datacache.errors import OriginPermissionError


class _Redirecting(http.server.ThreadingHTTPServer):
    """Serves ``files`` under /ok/ and /ok-private/; /ok/moved-* answer 302 to where ``moves`` says."""

    def __init__(self, files: dict[str, bytes], moves: dict[str, str]) -> None:
        self.seen: list[str] = []
        site = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                site.seen.append(self.path)
                if self.path in moves:
                    self.send_response(302)
                    self.send_header("Location", moves[self.path])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = files.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            do_HEAD = do_GET

            def log_message(self, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)
        self.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def redirecting() -> Iterator[_Redirecting]:
    data = make_shards(2, 5_000, seed=9)
    files = {"/ok/shard-0000.tar": data["shard-0000.tar"], "/ok-private/secret.tar": data["shard-0001.tar"]}
    moves = {"/ok/moved-out.tar": "/ok-private/secret.tar", "/ok/moved-in.tar": "/ok/shard-0000.tar"}
    server = _Redirecting(files, moves)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_to_a_neighbour_sharing_the_prefix_spelling_is_refused(redirecting: _Redirecting) -> None:
    async def body() -> tuple[bytes, BaseException | None]:
        tier = ObjectTier(f"{redirecting.url}/ok/", storage_options={CONFINE_REDIRECTS: True})
        try:
            inside = await tier.get("moved-in.tar")  # a redirect inside /ok/ is followed
            try:
                await tier.get("moved-out.tar")
            except OriginPermissionError as exc:
                return inside, exc
            return inside, None
        finally:
            await tier.close()

    inside, refused = asyncio.run(body())
    assert len(inside) == 5_000
    assert refused is not None and "outside the dataset's URL" in str(refused), refused
    assert "/ok-private/secret.tar" not in redirecting.seen, redirecting.seen


_STRANGER = 54_321
"""A uid no test user has: files it owns are another user's, by the kernel's record."""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files another uid owns")
@pytest.mark.parametrize("planted", ["batches", "sidecars"])
def test_count_files_another_uid_planted_are_not_believed(planted: str, tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    truth = counts_on_disk(origin)
    directory = _snapshot_dir(settings, str(origin))
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o777)  # as a shared tier's group-writable folder lets any member write
    lies = {key: KnownCount(1, "scanned") for key in truth}  # 1 sample each: within what the bytes allow
    names = [f"batch-{n:06d}.json" for n in range(len(truth))] if planted == "batches" else ["sidecars.json"]
    for name in names:
        path = directory / name
        path.write_bytes(encode_batch(lies))
        os.chown(path, _STRANGER, _STRANGER)
    found, _ = build_counts(settings, str(origin))
    assert {key: count.samples for key, count in found.items()} == truth
