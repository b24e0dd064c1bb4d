"""The command line every separately run benchmark section shares (``python -m benchmarks.<section>``)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._common import REPO


def run_section(
    section: str,
    description: str | None,
    job: Callable[[dict[str, Any]], dict[str, Any]],
    measure: Callable[..., dict[str, Any]],
) -> None:
    """The command line of one benchmark section (``python -m benchmarks.<section> [--quick]``).

    ``--job SPEC`` runs one measurement in this fresh process and prints its result as JSON;
    otherwise the S3 server is started, ``measure(endpoint, work, quick=...)`` runs, and its
    entry is added as ``section`` to ``results.json`` and rendered into ``RESULTS.md``.
    """
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    if args.job:
        result = job(json.loads(args.job))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)  # background work of the job (an index being built) is not waited for
    from benchmarks._report import write_report
    from benchmarks.warm_vs_awscli import start_s3_server

    server, endpoint = start_s3_server()
    try:
        with tempfile.TemporaryDirectory(prefix=f"datacache-{section}-") as work:
            entry = measure(endpoint, Path(work), quick=args.quick)
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
    saved = args.out / ("results-quick.json" if args.quick else "results.json")
    results = json.loads(saved.read_text())
    results[section] = entry
    from benchmarks import bigger

    report = args.out / ("RESULTS-quick.md" if args.quick else "RESULTS.md")
    kept = bigger.saved_table(report)  # write_report rewrites the file; the scenario's tables stay
    written = write_report(results, args.out)
    bigger.write_table(kept, report)
    print(f"wrote {', '.join(str(p) for p in written)}", file=sys.stderr)
