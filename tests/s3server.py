"""A real S3-protocol server for the tests: moto's server, with a request counter.

Run as a program, it serves on 127.0.0.1 at a free port and prints the port.
Besides moto's own ``/moto-api/reset``, it answers ``GET /_counts`` with the
number of requests per ``METHOD /bucket/key`` since the last
``POST /_counts/reset``, so a test can check that each object was fetched once.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter
from typing import Any
from urllib.parse import unquote

from moto.server import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server


class CountingApp:
    def __init__(self, app: Any) -> None:
        self._app = app
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = unquote(environ.get("PATH_INFO", ""))
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/_counts":
            if method == "POST":
                with self._lock:
                    self._counts.clear()
                body = b"{}"
            else:
                with self._lock:
                    body = json.dumps(dict(self._counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        if not path.startswith("/moto-api"):
            with self._lock:
                self._counts[f"{method} {path}"] += 1
        return self._app(environ, start_response)


def main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    sys.stdout.write(f"{server.server_port}\n")
    sys.stdout.flush()
    server.serve_forever()


if __name__ == "__main__":
    main()
