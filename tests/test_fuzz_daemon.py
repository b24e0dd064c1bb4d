"""Fuzzing the daemon's socket: any request gets a documented error (or an answer), and the daemon stays up.

Requests mix valid and invalid verbs, methods, bodies and fields; raw bytes
that are not HTTP at all are sent too. Never an ``internal`` error, never a
credential in a reply or the log, never a file outside the cache directory.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _daemon import REPO, DaemonProcess, make_shards, start_daemon, unix_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

SECRET = "S3CRET-daemon-fuzz-Q7"
CODES = {
    "bad_request",
    "invalid_key",
    "invalid_request",
    "unsupported_url",
    "forbidden",
    "not_found",
    "unknown_request",
    "unknown_dataset",
    "origin_changed",
    "too_large",
    "origin_permission",
    "origin_unavailable",
    "origin_error",
    "checksum_mismatch",
    "shutting_down",
    "tier_full",
    "error",
}  # every code of docs/DAEMON.md but "internal"
VERBS = [
    "open",
    "ensure",
    "locate",
    "prefetch",
    "future_order",
    "report_corrupt",
    "warm",
    "evict",
    "pin",
    "unpin",
    "report",
    "status",
]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, str, Path]]:
    root = tmp_path_factory.mktemp("daemon-fuzz")
    origin = root / "origin"
    make_shards(origin, 4, 20_000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(
        {
            "HOME": str(root / "home"),
            "XDG_CACHE_HOME": str(root / "home" / ".cache"),
            "XDG_CONFIG_HOME": str(root / "home" / ".config"),
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9",  # any S3 dataset fails at once
            "AWS_ACCESS_KEY_ID": "AKIADAEMONFUZZ",
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    daemon = start_daemon({**env, "DATACACHE_MAX_ATTEMPTS": "1"}, root / "cache")
    daemon.env["DATACACHE_MAX_ATTEMPTS"] = "1"
    try:
        code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin)})
        assert code == 200, opened
        yield daemon, opened["dataset_id"], origin
    finally:
        daemon.kill()


def safe_text(token: str) -> bool:
    """A dataset string that cannot make the daemon read a real tree or reach the network."""
    if "://" in token and not token.startswith(("s3://", "bogus://", "memory://")):
        return False
    if token.startswith(("/", "~", ".")) or not token.strip():
        return False
    return not (REPO / token).exists() and not Path(os.path.expanduser(token)).exists()


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=24)
numbers = st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True) | st.booleans() | st.none()
keys = (
    st.sampled_from(["shard-0000.tar", "shard-0003.tar", "missing.tar", "../../etc/passwd", "/abs", "a//b", "."]) | text
)
json_values = st.recursive(
    numbers | text, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=8
)


@st.composite
def datasets(draw: st.DrawFn, dataset_id: str, origin: str) -> Any:
    choice = draw(st.integers(0, 4))
    if choice == 0:
        return dataset_id
    if choice == 1:
        return draw(st.sampled_from([origin, "s3://bucket-fuzz/prefix", "bogus://x/y", "never-opened", ""]))
    if choice == 2:
        token = draw(text)
        return token if safe_text(token) else "never-opened"
    if choice == 3:
        return {
            "name": draw(st.sampled_from(["fz", "fz/../x", "", "ok.name"]) | text),
            "url": draw(
                st.sampled_from(
                    [origin, "s3://AKIA:" + SECRET + "@bucket-fuzz/p", "s3://bucket-fuzz/q", "memory://nothing"]
                )
            ),
            "storage_options": {"key": "AKIADAEMONFUZZ", "secret": SECRET, "endpoint_url": "http://127.0.0.1:9"},
            "policy": draw(st.sampled_from(["lru", "auto", "fifo"]) | json_values),
            "pinned": draw(json_values),
            "format": draw(st.sampled_from([None, "tar", "csv"])),
        }
    return draw(json_values)


@st.composite
def bodies(draw: st.DrawFn, dataset_id: str, origin: str) -> dict[str, Any]:
    fields = {
        "dataset": datasets(dataset_id, origin),
        "snapshot": st.none() | text,
        "key": keys | json_values,
        "keys": st.lists(keys, max_size=4) | json_values,
        "tier": st.sampled_from(["local", "shared", "all", "nvme"]) | json_values,
        "priority": numbers,
        "refresh": st.booleans() | json_values,
        "verify": st.booleans(),
        "shards": st.sampled_from(["0:2", "shard-0001.tar", "9:", "a:b:c:d", ""]) | json_values,
        "client": text | json_values,
        "delivered_bytes_per_s": numbers,
        "stall_fraction": numbers,
        "delivered_bytes": numbers,
    }
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=6))
    return {name: draw(fields[name]) for name in chosen}


def check_reply(status: int, reply: Any) -> None:
    assert 200 <= status < 600
    assert SECRET not in json.dumps(reply) if not isinstance(reply, str) else SECRET not in reply
    if (status >= 400 and status != 404) or (isinstance(reply, dict) and "error" in reply):
        assert isinstance(reply, dict) and isinstance(reply.get("error"), dict), reply
        code, message = reply["error"].get("code"), reply["error"].get("message")
        assert code in CODES, reply
        assert isinstance(message, str) and "\n" not in message and len(message) < 2000


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_requests_get_documented_answers_and_the_daemon_stays_up(fuzzed: Any, data: Any) -> None:
    daemon, dataset_id, origin = fuzzed
    verb = data.draw(st.sampled_from(VERBS) | text.map(lambda t: t.replace("/", "").replace("?", "")))
    method = data.draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    path = f"/v1/{verb}" if data.draw(st.booleans()) or not verb else f"/{verb}"
    if data.draw(st.integers(0, 4)) == 0:
        raw: bytes | None = data.draw(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
        body = None
    else:
        raw, body = None, data.draw(bodies(dataset_id, str(origin)))
    try:
        status, reply = unix_request(
            daemon.socket, method, path.encode("utf-8", "replace").decode("latin-1"), body, raw=raw, timeout=60
        )
    except (UnicodeEncodeError, http.client.InvalidURL, ValueError):
        return  # a path http.client itself refuses to send
    if verb == "warm" and status == 200 and isinstance(reply, str):
        for line in reply.splitlines():
            event = json.loads(line)
            assert SECRET not in line
            if event.get("event") == "error":
                assert event.get("code") in CODES, event
        return
    check_reply(status, reply)


RAW_INPUT = {
    "raw": st.binary(max_size=400)
    | st.sampled_from(
        [
            b"GET /v1/status HTTP/1.1\r\n\r\n",
            b"POST /v1/open HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
            b"POST /v1/open HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
            b"POST /v1/ensure HTTP/1.1\r\nContent-Length: 5\r\n\r\n{",
        ]
    )
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(**RAW_INPUT)
@example(raw=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a TLS hello
def test_bytes_that_are_not_http_get_a_400_or_a_close(fuzzed: Any, raw: bytes) -> None:
    daemon, _, _ = fuzzed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    try:
        sock.connect(str(daemon.socket))
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)  # no more bytes will come: the daemon must not wait forever
        received = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    finally:
        sock.close()
    assert received == b"" or received.startswith(b"HTTP/1."), received[:200]
    assert SECRET.encode() not in received


def test_after_the_fuzzing_the_daemon_is_whole(fuzzed: Any) -> None:
    daemon, _, origin = fuzzed
    assert daemon.ready()
    code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin)})
    assert code == 200
    code, location = daemon.request("POST", "/v1/ensure", {"dataset": opened["dataset_id"], "key": "shard-0001.tar"})
    assert code == 200 and location["tier"] == "local"
    log = daemon.log_text()
    assert SECRET not in log
    assert "internal error" not in log and "Traceback" not in log, log[-3000:]
    # Nothing was written outside the cache directory (the origin and the home stay as they were).
    assert sorted(p.name for p in origin.iterdir()) == [f"shard-{i:04d}.tar" for i in range(4)]
    home = daemon.local_dir.parent / "home"
    assert not home.exists() or not [p for p in home.rglob("*") if p.is_file()]
    stray = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--", "."],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    assert "shard-" not in stray and "datacache-manifest" not in stray, stray
    assert sys.executable  # (the daemon ran with this interpreter)


# -- the same properties, ten times longer, in `make test-faults` -----------------------------


@pytest.mark.faults
@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_requests_long(fuzzed: Any, data: Any) -> None:
    test_requests_get_documented_answers_and_the_daemon_stays_up.hypothesis.inner_test(fuzzed, data)


@pytest.mark.faults
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(**RAW_INPUT)
def test_raw_bytes_long(fuzzed: Any, raw: bytes) -> None:
    test_bytes_that_are_not_http_get_a_400_or_a_close.hypothesis.inner_test(fuzzed, raw)


@pytest.mark.faults
def test_after_the_long_fuzzing_the_daemon_is_whole(fuzzed: Any) -> None:
    test_after_the_fuzzing_the_daemon_is_whole(fuzzed)
