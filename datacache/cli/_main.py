"""The command line: the top-level parser, and running one verb with its errors made one line."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Sequence

from datacache import __version__
from datacache._logging import configure_logging
from datacache.cli import _build, _cache, _node, _top, _warm
from datacache.cli._common import Parser, one_line
from datacache.errors import ConfigError, DatacacheError
from datacache.tiers import redact_url, split_userinfo


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="datacache", description="Tiered caching of AI training data.")
    parser.add_argument("--version", action="version", version=f"datacache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for verbs in (_warm, _cache, _build, _node, _top):  # the order of `datacache --help`
        verbs.add_parsers(commands)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line (without the program name) as `main` does."""
    return _parser().parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``datacache`` command; return its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    configure_logging(args.verbose, json_format=args.log_json or os.environ.get("DATACACHE_LOG_FORMAT") == "json")
    _warn_of_credentials(sys.argv[1:] if argv is None else argv)
    try:
        result: int = asyncio.run(args.run(args))
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
    except KeyboardInterrupt:
        sys.stderr.write("datacache: interrupted; no partial file was left visible\n")
        return 130
    except BrokenPipeError:
        return _reader_gone()
    except DatacacheError as exc:
        sys.stderr.write(f"datacache: error: {one_line(exc)}\n")
        return 2 if isinstance(exc, ConfigError) else 1
    except OSError as exc:
        sys.stderr.write(f"datacache: error: {one_line(exc)}\n")
        return 1
    return result


def _warn_of_credentials(argv: Sequence[str]) -> None:
    """Say so when a URL on the command line carries a secret: every user of the machine reads argv (ps)."""
    for word in argv:
        if "://" not in word or split_userinfo(word)[0] is None:
            continue
        if word.split("://", 1)[0].lower() in ("s3", "s3a", "gs", "gcs"):
            continue  # refused with its own one-line error: such URLs cannot carry credentials at all
        sys.stderr.write(
            f"datacache: warning: {redact_url(word)} carries credentials on the command line, where every "
            "user of this machine can read them (ps); name a dataset of the config file instead "
            "(docs/SECURITY.md, 'Secrets in URLs')\n"
        )


def _reader_gone() -> int:
    """Whoever read our output left (`datacache ls | head -3`): end silently, as SIGPIPE would."""
    # Python's flush of stdout at exit would raise again: point it at /dev/null first.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE
