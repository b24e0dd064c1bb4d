"""An origin that cannot be reached (gs://, az://): the tier's retry policy is the one rule, one line says so.

gcsfs and the Azure SDK retry on their own (gcsfs six times with back-off up to 32 s, logging a
traceback each time: an unreachable gs:// origin took 3m40s). Here a server on 127.0.0.1 answers
every request 503 (a transient error each backend retries on its own), counting the requests by
their first line: each must be made exactly as often as the policy's attempts (one backend call may
make several requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from _emulators import AZURITE_ACCOUNT, AZURITE_KEY
from _helpers import run_cli
from datacache.tiers import ObjectTier, RetryPolicy

from datacache.errors import TransientOriginError


class Hangup:
    """Answers each request on 127.0.0.1 with 503 and hangs up; counts the requests by their first line."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: Counter[str] = Counter()
        self.thread = threading.Thread(target=self._serve, name="hangup", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n" not in head:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    head += chunk
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                self.requests[line.split("?", 1)[0]] += 1
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    def attempts(self) -> int:
        """The most times one request was made."""
        return max(self.requests.values(), default=0)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def hangup() -> Iterator[Hangup]:
    server = Hangup()
    try:
        yield server
    finally:
        server.close()


def _tier(scheme: str, port: int, attempts: int) -> ObjectTier:
    policy = RetryPolicy(max_attempts=attempts, base_delay=0.001, max_delay=0.001)
    if scheme == "gs":
        options = {"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon"}
        return ObjectTier("gs://bucket/ds", storage_options=options, retry=policy)
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
    )
    return ObjectTier("az://container/ds", storage_options={"connection_string": connection}, retry=policy)


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_the_backend_tries_each_request_once_and_the_policy_decides(scheme: str, hangup: Hangup) -> None:
    tier = _tier(scheme, hangup.port, attempts=3)

    async def main() -> None:
        try:
            with pytest.raises(TransientOriginError, match=r"gave up after 3 attempts"):
                await tier.stat("shard-0000.tar")
        finally:
            await tier.close()

    asyncio.run(main())
    assert hangup.attempts() == 3, hangup.requests  # gcsfs alone tried 6 times per attempt, the SDK 4


@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_warm_from_an_unreachable_origin_fails_in_one_line(
    scheme: str, cache_env: dict[str, str], tmp_path: Path
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # closed when the block ends: nothing listens there
    env = {k: v for k, v in cache_env.items() if not k.startswith(("AZURE_", "STORAGE_EMULATOR", "FSSPEC_"))}
    if scheme == "gs":
        env.update({"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}", "FSSPEC_GS_TOKEN": "anon"})
        url = "gs://bucket/ds/"
    else:
        env["AZURE_STORAGE_CONNECTION_STRING"] = (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};"
        )
        url = "az://container/ds/"
    env.update({"DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "DATACACHE_MAX_ATTEMPTS": "2"})
    result = run_cli(["warm", url, "--no-daemon"], env)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no backend's traceback, no "Loop is not running" at exit
    assert url.rstrip("/") in lines[0] and "gave up after 2 attempts" in lines[0]
