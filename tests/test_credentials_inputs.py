"""Credentials stay off the command line and out of every message (issue 33 item 12).

``ps`` shows every user of the machine each process's argv: a password in ``datacache warm
https://user:pw@host/...`` is everyone's. A configured dataset (the URL in the config file) is
the way to give one; a URL with userinfo on argv is warned of. Redaction covers every form a
credential takes in a URL, a bare ``#token`` or ``?token`` included.
"""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from _helpers import make_shards, run_cli
from datacache.tiers import redact_url

_FORMS = [
    ("https://alice:PW-S3CRET@h.example/ds/", "PW-S3CRET"),
    ("s3://AKIAX:se/cr3t-KEY@bucket/p", "se/cr3t-KEY"),
    ("https://h.example/x.tar?X-Amz-Signature=SIG-S3CRET&a=1", "SIG-S3CRET"),
    ("https://h.example/cb#access_token=TOK-S3CRET&x=1", "TOK-S3CRET"),
    ("https://h.example/ds/#BARE-TOK3N", "BARE-TOK3N"),
    ("https://h.example/ds/x.tar?BARE-QUERY-TOK3N", "BARE-QUERY-TOK3N"),
    ("https://h.example/ds/x.tar?a=1&BARE-AMP-TOK3N", "BARE-AMP-TOK3N"),
    ("https://h.example/ds/x.tar#a=1&BARE-FRAG-TOK3N", "BARE-FRAG-TOK3N"),
    ("https://h.example/ds/x.tar;jsessionid=SESS-S3CRET", "SESS-S3CRET"),
]


@pytest.mark.parametrize(("url", "secret"), _FORMS)
def test_every_credential_form_is_redacted_in_a_message(url: str, secret: str) -> None:
    for message in (url, f"reading {url} failed", f"error: '{url}' (403)", f"{url}\tnext"):
        redacted = redact_url(message)
        assert secret not in redacted, redacted
        assert "h.example" in redacted or "bucket" in redacted, redacted


def test_what_is_not_a_credential_is_kept() -> None:
    for url in ("https://h.example/ds/", "s3://bucket/img@2x.png", "https://host:8080/a@b/c", "file:///x/y"):
        assert redact_url(url) == url


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def env(cache_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    clean.update({"DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "DATACACHE_MAX_ATTEMPTS": "1"})
    return clean


def test_no_credential_form_reaches_the_errors_or_the_logs(env: dict[str, str]) -> None:
    port = _closed_port()
    url = f"http://alice:PW-S3CRET@127.0.0.1:{port}/ds/x.tar?sig=SIG-S3CRET#BARE-TOK3N"
    result = run_cli(["warm", url, "-vv"], env)
    assert result.returncode != 0
    text = result.stdout + result.stderr
    for secret in ("PW-S3CRET", "SIG-S3CRET", "BARE-TOK3N"):
        assert secret not in text, text
    assert "carries credentials on the command line" in text, text


_USER, _PASSWORD = "reader", "PW-0f-the-config-FILE"


@pytest.fixture
def private_site() -> Iterator[tuple[str, dict[str, bytes], list[str]]]:
    """An http site whose /ds/ answers only with basic auth; records the Authorization headers it saw."""
    files = make_shards(2, 4_000, seed=4)
    seen: list[str] = []
    expected = "Basic " + base64.b64encode(f"{_USER}:{_PASSWORD}".encode()).decode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization", ""))
            if self.headers.get("Authorization") != expected:
                self._send(401, b"who are you", {"WWW-Authenticate": 'Basic realm="ds"'})
            elif self.path in ("/ds/", "/ds"):
                links = "".join(f'<a href="{name}">{name}</a>\n' for name in files)
                self._send(200, links.encode(), {"Content-Type": "text/html"})
            elif self.path.removeprefix("/ds/") in files:
                self._send(200, files[self.path.removeprefix("/ds/")], {})
            else:
                self._send(404, b"", {})

        do_HEAD = do_GET

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", files, seen
    finally:
        server.shutdown()
        server.server_close()


def test_a_password_goes_in_the_config_file_never_on_argv(
    private_site: tuple[str, dict[str, bytes], list[str]], env: dict[str, str], tmp_path: Path
) -> None:
    host, files, seen = private_site
    config = tmp_path / "datacache.toml"
    config.write_text(f'[datasets.private]\nurl = "http://{_USER}:{_PASSWORD}@{host}/ds/"\n')
    config.chmod(0o600)
    argv = ["warm", "private", "--json"]
    result = run_cli(argv, {**env, "DATACACHE_CONFIG": str(config)})
    assert result.returncode == 0, result.stderr
    assert _PASSWORD not in " ".join(argv) and _PASSWORD not in result.stdout + result.stderr
    assert "carries credentials" not in result.stderr
    cached = {p.name: p.read_bytes() for p in (tmp_path / "local").rglob("shard-*.tar") if p.is_file()}
    assert cached == files
    assert all(header.startswith("Basic ") for header in seen), seen  # the origin was asked with them
