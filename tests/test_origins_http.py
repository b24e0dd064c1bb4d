"""http(s):// origins against a real HTTP server: with and without Range, with and without Content-Length.

The shards of an HTTP dataset are named by a listing page (the links of the URL's index page,
as a web server's directory listing has them). A shard whose size cannot be known (no
Content-Length) is an error that says so: never a 0-byte shard taken as real.
"""

from __future__ import annotations

import html
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_shards, run_cli, tar_of


@dataclass
class Site:
    """A static site on 127.0.0.1 serving ``files`` under /ds/, with an index page."""

    files: dict[str, bytes]
    ranges: bool = True
    lengths: bool = True
    listing: bool = True
    gets: dict[str, int] = field(default_factory=dict)
    port: int = 0

    def url(self, path: str = "ds/") -> str:
        return f"http://127.0.0.1:{self.port}/{path}"


class _SiteHandler(BaseHTTPRequestHandler):
    """Serves `site`: a page of links at /ds/, its files (ranged reads if it allows), HEAD too."""

    site: Site
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        if self.site.lengths:
            self.send_header("Content-Length", str(len(body)))
        else:
            self.send_header("Connection", "close")  # the body ends when the connection does
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        if not self.site.lengths:
            self.close_connection = True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path in ("/ds", "/ds/") and not self.site.listing:
            self._send(404, b"no listing here", {})
            return
        if path in ("/ds", "/ds/"):
            links = "".join(f'<a href="{html.escape(name)}">{html.escape(name)}</a>\n' for name in self.site.files)
            self._send(200, f"<html><body>\n{links}</body></html>".encode(), {"Content-Type": "text/html"})
            return
        name = path.removeprefix("/ds/")
        if name not in self.site.files:
            self._send(404, b"not found", {})
            return
        if self.command == "GET":
            self.site.gets[name] = self.site.gets.get(name, 0) + 1
        self._send_file(self.site.files[name])

    def _send_file(self, data: bytes) -> None:
        span = self.headers.get("Range")
        if self.site.ranges and span and span.startswith("bytes="):
            first, _, last = span.removeprefix("bytes=").partition("-")
            start, end = int(first or 0), min(int(last) + 1 if last else len(data), len(data))
            headers = {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}", "Accept-Ranges": "bytes"}
            self._send(206, data[start:end], headers)
            return
        self._send(200, data, {"Accept-Ranges": "bytes"} if self.site.ranges else {})


def _handler(site: Site) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_SiteHandler,), {"site": site})


@pytest.fixture
def site() -> Iterator[Site]:
    served = Site(files=make_shards(4, 40_000))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(served))
    server.daemon_threads = True
    served.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def env(cache_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    clean.update({"DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "PYTHONWARNINGS": "error::ResourceWarning"})
    return clean


def cached(tmp_path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (tmp_path / "local").rglob("*.tar") if p.is_file()}


@pytest.mark.parametrize("ranges", [True, False], ids=["with-range", "without-range"])
def test_warm_from_a_listing_page_reads_each_shard_once(
    site: Site, env: dict[str, str], tmp_path: Path, ranges: bool
) -> None:
    site.ranges = ranges
    result = run_cli(["warm", site.url(), "--json"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert done["complete"] is True and done["bytes_transferred"] == 160_000
    assert cached(tmp_path) == site.files
    assert site.gets == dict.fromkeys(site.files, 1)
    assert "Unclosed" not in result.stderr and "Traceback" not in result.stderr
    verify = run_cli(["warm", site.url(), "--verify"], env, check=True)
    assert "Unclosed" not in verify.stderr


def test_an_object_of_unknown_size_is_an_error_never_an_empty_shard(
    site: Site, env: dict[str, str], tmp_path: Path
) -> None:
    site.lengths = False
    result = run_cli(["warm", site.url()], env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("datacache: error: "), result.stderr
    assert "size" in lines[0] and "shard-0000.tar" in lines[0] and "Content-Length" in lines[0], lines[0]
    assert cached(tmp_path) == {}


def test_an_unreachable_origin_is_a_connection_failure_not_an_empty_dataset(env: dict[str, str]) -> None:
    """Connection refused said `no objects under http://127.0.0.1:1/x (... empty or does not exist)`."""
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens on it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = run_cli(["warm", f"http://127.0.0.1:{port}/x/"], env)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("datacache: error: "), result.stderr
    assert "connection to the origin failed" in lines[0] and "no objects" not in lines[0], lines[0]


def test_one_http_shard_url_is_a_dataset_of_that_shard(site: Site, env: dict[str, str], tmp_path: Path) -> None:
    """The README: one object is a dataset, over http(s) as over S3 (issue 24 item 5)."""
    result = run_cli(["warm", site.url("ds/shard-0002.tar"), "--json"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert (done["complete"], done["shards_resident"], done["bytes_transferred"]) == (True, 1, 40_000)
    assert cached(tmp_path) == {"shard-0002.tar": site.files["shard-0002.tar"]}
    assert site.gets == {"shard-0002.tar": 1}


def test_a_wids_index_url_is_a_dataset_of_the_shards_it_lists(site: Site, env: dict[str, str], tmp_path: Path) -> None:
    """Issue 24 item 5: http datasets were found only through a page of links; a wids shard index
    (``"__kind__": "wids-shard-index-v1"``) names the shards, relative to it or by full URL, with
    their sample counts. The server here has no listing page at all."""
    site.listing = False
    site.files = {
        f"shard-{i:04d}.tar": tar_of({f"s{i}-{j}.bin": bytes([i, j]) * 50 for j in range(5)}) for i in range(4)
    }
    index = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [
            {"url": "shard-0000.tar", "nsamples": 5},
            {"url": site.url("ds/shard-0002.tar"), "nsamples": 5},
            {"url": "./shard-0003.tar", "nsamples": 5, "filesize": len(site.files["shard-0003.tar"])},
        ],
    }
    site.files["train.json"] = json.dumps(index).encode()
    result = run_cli(["warm", site.url("ds/train.json"), "--json"], env)
    assert result.returncode == 0, result.stdout + result.stderr
    done = json.loads(result.stdout.strip().splitlines()[-1])
    assert (done["complete"], done["shards_resident"]) == (True, 3)
    assert set(cached(tmp_path)) == {"shard-0000.tar", "shard-0002.tar", "shard-0003.tar"}
    assert all(site.gets.get(name) == 1 for name in cached(tmp_path))

    from datacache.loaders import CachedIterableDataset

    from datacache.config import load_settings

    settings = load_settings(env)
    dataset = CachedIterableDataset(site.url("ds/train.json"), config=settings, shuffle=False)
    assert len(dataset) == 15  # the index's counts
    assert sorted(sample["__key__"] for sample in dataset) == sorted(f"s{i}-{j}" for i in (0, 2, 3) for j in range(5))
    dataset.close()

    elsewhere = [{"url": "http://elsewhere.example/x.tar", "nsamples": 1}]
    site.files["bad.json"] = json.dumps({**index, "shardlist": elsewhere}).encode()
    refused = run_cli(["warm", site.url("ds/bad.json")], env)
    [line] = refused.stderr.strip().splitlines()
    assert "bad.json" in line and "http://elsewhere.example/x.tar" in line and "outside" in line, line
