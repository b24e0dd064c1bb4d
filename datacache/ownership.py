"""Who a dataset is shared with (``readers``), and whose files datacache believes (owner and mode checks).

docs/SECURITY.md, "Who may read what": a copy another uid could open exists only for a dataset
the operator declared shared with that uid. And, as ssh does with ``~/.ssh``, a file that steers
what datacache trusts (the config file, the node cache and its catalog) is refused when a uid
other than its reader (or root) could have written it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datacache.errors import ConfigError
from datacache.tiers.files import ReadersIds, readers_mode

__all__ = [
    "Readers",
    "check_not_writable_by_others",
    "group_name",
    "operator_writes",
    "parse_readers",
    "shared_metadata_mode",
]


@dataclass(frozen=True)
class Readers:
    """The uids and groups a dataset is declared shared with; empty: private to each reader."""

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    def __bool__(self) -> bool:
        return bool(self.uids or self.gids)

    def admits(self, uid: int, gids: Iterable[int]) -> bool:
        """Whether a process of ``uid`` with the groups ``gids`` is one of these readers."""
        return uid in self.uids or not self.gids.isdisjoint(gids)

    def describe(self) -> str:
        """The readers as the config names them (for a refusal's message)."""
        names = [_name(pwd.getpwuid, uid, "pw_name") for uid in sorted(self.uids)]
        names += ["@" + _name(grp.getgrgid, gid, "gr_name") for gid in sorted(self.gids)]
        return ", ".join(names) or "nobody"



def operator_writes(daemon_uid: int | None) -> bool:
    """Whether this process writes as the node's operator (root, the configured daemon account).

    An undeclared dataset's metadata on the shared tier (its manifest: its URL and every shard's
    name; its counts) is the group's only when the operator wrote it: a job user's own dataset,
    read in its own process, keeps it 0600, as its shards are (docs/SECURITY.md).
    """
    return os.geteuid() in (0, daemon_uid)


def shared_metadata_mode(readers: ReadersIds | None, root: Path, *, operator: bool) -> int:
    """The mode of a dataset's metadata (manifest, counts) on the shared tier at ``root``.

    Its readers' (`readers_mode`) where the dataset is declared shared; else the group's only
    when the operator writes it (`operator_writes`), and the writer's own otherwise.
    """
    if readers is not None:
        return readers_mode(0o640, readers, root)
    return 0o640 if operator else 0o600

def group_name(gid: int) -> str:
    """A group's name, or its gid where it has none."""
    return _name(grp.getgrgid, gid, "gr_name")


def _name(lookup: Any, ident: int, attribute: str) -> str:
    try:
        return str(getattr(lookup(ident), attribute))
    except KeyError:
        return str(ident)


def _one_reader(entry: Any, what: str) -> tuple[str, int]:
    if isinstance(entry, int) and not isinstance(entry, bool) and entry >= 0:
        return "uid", entry
    if not isinstance(entry, str) or not entry.strip("@"):
        raise ConfigError(f"{what}: expected user names, uids or '@group' entries, got {entry!r}")
    if entry.startswith("@"):
        group = entry[1:]
        if group.isdigit():
            return "gid", int(group)
        try:
            return "gid", grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"{what}: no group named {group!r} on this machine") from None
    if entry.isdigit():
        return "uid", int(entry)
    try:
        return "uid", pwd.getpwnam(entry).pw_uid
    except KeyError:
        raise ConfigError(f"{what}: no user named {entry!r} on this machine") from None


def parse_readers(value: Any, what: str) -> Readers:
    """``readers = ["alice", 1001, "@team"]`` of a ``[datasets.NAME]`` table, resolved to ids."""
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{what}: expected a non-empty list of user names, uids or '@group' entries")
    uids: set[int] = set()
    gids: set[int] = set()
    for entry in value:
        kind, ident = _one_reader(entry, what)
        (uids if kind == "uid" else gids).add(ident)
    return Readers(frozenset(uids), frozenset(gids))


def _writers_problem(
    st: os.stat_result, trusted: Collection[int], *, directory: bool, owner_only: bool = False
) -> str | None:
    """Why a uid outside ``trusted`` could change what ``st`` describes, or None."""
    if st.st_uid not in trusted:
        return f"it belongs to {_name(pwd.getpwuid, st.st_uid, 'pw_name')} (uid {st.st_uid})"
    mode = stat.S_IMODE(st.st_mode)
    if owner_only or (directory and mode & stat.S_ISVTX):
        return None  # /tmp: others may create beside it, not rename or remove what is ours
    if mode & 0o002:
        return f"anyone can write it (mode {mode:04o})"
    if mode & 0o020 and st.st_gid != os.getegid():
        return f"its group {_name(grp.getgrgid, st.st_gid, 'gr_name')} can write it (mode {mode:04o})"
    return None


def check_not_writable_by_others(
    path: Path, what: str, *, trusted: Collection[int], parent: bool = True, owner_only: bool = False
) -> None:
    """Raise `ConfigError` if a uid outside ``trusted`` (and root) could have written ``path``.

    ``path`` itself (followed, as it is opened) and, with ``parent``, the directory holding it:
    whoever can write that directory can replace the file. With ``owner_only``, only whose it
    is counts (a pod's emptyDir is 0777 by design). A missing ``path`` is fine (nothing to
    believe yet).
    """
    trusted = {0, *trusted}
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot check who owns it ({exc.strerror})") from None
    problem = _writers_problem(st, trusted, directory=stat.S_ISDIR(st.st_mode), owner_only=owner_only)
    where = path
    if problem is None and parent:
        where = Path(os.path.realpath(path)).parent
        try:
            problem = _writers_problem(os.stat(where), trusted, directory=True)
        except OSError:
            problem = None
    if problem is not None:
        shown = f"{path}" if where == path else f"{path} (its directory {where})"
        raise ConfigError(
            f"{what} {shown}: {problem}, so another user could have written it; refusing it "
            "(make it yours and not writable by others, as ssh asks of ~/.ssh)"
        )
