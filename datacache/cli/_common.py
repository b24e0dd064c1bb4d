"""What every verb of the command shares: the parser class, the cache-settings flags, the daemon probe."""

from __future__ import annotations

import argparse
import logging
import pwd
import re
import sys
from collections.abc import Mapping
from typing import Any, TypeAlias

from datacache.client import DaemonClient
from datacache.config import Settings, load_settings
from datacache.errors import DaemonUnavailableError, DatacacheError, close_match
from datacache.tiers import redact_url

logger = logging.getLogger(__name__)

_UNRECOGNIZED = "unrecognized arguments: "
"""How argparse begins its message for words no option or positional took."""

Commands: TypeAlias = "argparse._SubParsersAction[Parser]"
"""The table of subcommands each verb module adds its parsers to."""


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A dash and a digit is a (negative) value, never a flag: `--local-capacity -5GB` then reaches
        # the size parser, which names the flag and the value, instead of "expected one argument".
        self._negative_number_matcher = re.compile(r"^-\d")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # Kept to tell, if the line is refused, which verb's options a mistyped one was meant to be.
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> Any:  # one line, exit status 2
        # Arguments are echoed in usage errors: a URL among them may carry credentials.
        if message.startswith(_UNRECOGNIZED):
            message = self._unrecognized(message[len(_UNRECOGNIZED) :].split())
        else:
            message += self._did_you_mean(message)
        self.exit(2, f"datacache: error: {redact_url(message)} (see 'datacache --help')\n")

    def _unrecognized(self, words: list[str]) -> str:
        """``unrecognized option --local-capasity; did you mean --local-capacity?``: the options alone.

        A mistyped option's value (``1GB``), and anything after it, is no error of its own: argparse
        listed them all (``unrecognized arguments: --local-capasity 1GB x``) after the guess.
        """
        options = [
            word.split("=", 1)[0]
            for word in words
            if word.startswith("-") and len(word) > 1 and not self._negative_number_matcher.match(word)
        ]
        if not options:
            return f"unrecognized {'argument' if len(words) == 1 else 'arguments'}: {' '.join(words)}"
        known = self._option_strings()
        guesses = [close for word in options if word.startswith("--") and (close := close_match(word, known))]
        hint = f"; did you mean {' or '.join(dict.fromkeys(guesses))}?" if guesses else ""
        return f"unrecognized option{'s' if len(options) > 1 else ''} {' '.join(options)}{hint}"

    def _did_you_mean(self, message: str) -> str:
        """``"; did you mean local?"`` for a mistyped verb or choice; else ``""``."""
        chosen = re.search(r"invalid choice: '([^']*)'", message)
        if chosen is None:
            return ""
        choices = [str(c) for action in self._actions if action.choices for c in action.choices]
        close = close_match(chosen.group(1), choices)
        return f"; did you mean {close}?" if close else ""

    def _option_strings(self) -> list[str]:
        """This parser's long options and those of the verb the command line named."""
        options = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        for action in self._actions:
            if isinstance(action.choices, dict):  # the verbs: name -> parser
                verb = next((arg for arg in getattr(self, "_given", []) if arg in action.choices), None)
                if isinstance(verb_parser := action.choices.get(verb), Parser):
                    options += verb_parser._option_strings()
        return options


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache settings (override the config file and DATACACHE_* variables)")
    group.add_argument(
        "--config", metavar="FILE", help="TOML config file (default: DATACACHE_CONFIG, else the user's config dir)"
    )
    group.add_argument("--local-dir", metavar="DIR", help="local tier directory (DATACACHE_LOCAL_DIR)")
    group.add_argument("--local-capacity", metavar="SIZE", help="local tier capacity, e.g. 500GB")
    group.add_argument("--shared-dir", metavar="DIR", help="shared tier directory on the cluster filesystem")
    group.add_argument("--shared-capacity", metavar="SIZE", help="shared tier capacity, e.g. 20TB")
    group.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    group.add_argument("--log-json", action="store_true", help="log one JSON object per line")


def settings_from(args: argparse.Namespace, env: Mapping[str, str] | None = None, **extra: Any) -> Settings:
    overrides = {
        "local_dir": args.local_dir,
        "local_capacity": args.local_capacity,
        "shared_dir": args.shared_dir,
        "shared_capacity": args.shared_capacity,
        **extra,
    }
    return load_settings(env, config_path=args.config, overrides=overrides)


def bandwidth_flag(args: argparse.Namespace) -> float | None:
    """``--bandwidth`` in bytes/s, its errors naming the flag as typed."""
    from datacache.sizes import parse_bandwidth

    return None if args.bandwidth is None else parse_bandwidth(args.bandwidth, what="--bandwidth")


def progress_mode(args: argparse.Namespace) -> str:
    if getattr(args, "json", False):
        return "json"
    if getattr(args, "quiet", False):
        return "quiet"
    return "bar" if sys.stderr.isatty() else "lines"


async def daemon_client(settings: Settings) -> DaemonClient | None:
    """A client of the node's daemon if one answers on its socket, else None (work in-process)."""
    if not settings.daemon_socket.exists():
        return None
    client = DaemonClient(settings)
    try:
        await client.health()
    except DaemonUnavailableError as exc:
        await client.close()
        logger.info("%s; working in this process", exc)
        return None
    return client


async def daemon_answer(settings: Settings) -> dict[str, Any]:
    """Whether a daemon answers on the configured socket, and whose it is (for ``status``).

    Bounded: a listener that accepts and never replies costs two seconds, not a hang.
    """
    socket_path = settings.daemon_socket
    found: dict[str, Any] = {"socket": str(socket_path), "answers": False}
    if not socket_path.exists():
        return found | {"detail": "no socket there"}
    client = DaemonClient(settings, connect_timeout=_PROBE_SECONDS)
    try:
        health = await client.health(within=_PROBE_SECONDS)
    except DatacacheError as exc:  # nobody listening, a listener of another uid, a garbled reply
        return found | {"detail": one_line(exc)}
    finally:
        await client.close()
    uid = client.server_uid
    return found | {
        "answers": True,
        "pid": health.get("pid"),
        "uid": uid,
        "user": _user_name(uid),
        "version": health.get("version"),
    }


async def daemon_tiers(settings: Settings) -> list[dict[str, Any]] | None:
    """The daemon's tiers as it runs them (paths, usage, capacities), or None if it did not say.

    Bounded as `daemon_answer` is.
    """
    client = DaemonClient(settings, connect_timeout=_PROBE_SECONDS, request_timeout=_PROBE_SECONDS)
    try:
        document = await client.status()
    except DatacacheError as exc:
        logger.info("the daemon's status: %s; showing this process's settings", one_line(exc))
        return None
    finally:
        await client.close()
    tiers = document.get("tiers")
    return tiers if isinstance(tiers, list) and tiers else None


_PROBE_SECONDS = 2.0


def _user_name(uid: int | None) -> str | None:
    try:
        return None if uid is None else pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no account on this machine (a container's)
        return None


def one_line(exc: BaseException) -> str:
    """An error as one line of text, credentials in URLs redacted."""
    text = str(exc).strip().splitlines()
    return redact_url(text[0]) if text else type(exc).__name__


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
