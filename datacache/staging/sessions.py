"""Whether the local tier was left clean: the marker its last user leaves, and every user's session file.

Recovery lists the whole tier and reads every catalog row (seconds at 1e5 shards) to repair what
a killed process left. After a clean shutdown there is nothing to repair, so the last process to
close the tier leaves a marker (``locks/clean``), and the next to open it removes the marker
(durably, before it stages anything) and skips the listing. A killed process leaves none:

- every process that opens the tier holds a shared lock on ``locks/users`` while it uses it
  and leaves a session file (``locks/sessions/<host:pid>``) that only a clean close removes;
- a closing process leaves the marker only if it takes that lock exclusively (no other user is
  alive) and no other session file is left (none was killed since the tier was last recovered).

Full recovery removes the session files of processes that no longer exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from datacache.catalog.rows import owner_alive
from datacache.errors import InvalidKeyError
from datacache.tiers.files import Place

__all__ = ["TierSession", "forget_dead_sessions"]

logger = logging.getLogger(__name__)

_MARKER = "clean"
_USERS = "users"  # not "*.lock": those are the shards' node locks
_SESSIONS = "sessions"


class TierSession:
    """This process's use of the local tier at ``local_dir`` (blocking calls: run them in a thread)."""

    def __init__(self, local_dir: Path, owner: str, dir_mode: int | None) -> None:
        self._locks = Place(local_dir, ("locks",), ".", dir_mode)
        self._sessions = Place(local_dir, ("locks", _SESSIONS), ".", dir_mode)
        self._name = owner.replace("/", "_")
        self._fd: int | None = None
        self.found_clean = False
        """Whether the last user had left the tier clean when this one opened it (the marker was there)."""

    def open(self) -> bool:
        """Register as a user, and take the marker away; return whether it was there."""
        try:
            locks = self._locks.open_parent(create=True)
        except (OSError, InvalidKeyError) as exc:
            logger.warning("the local tier's session cannot be recorded (%s): recovery runs in full", exc)
            return False
        try:
            fd = os.open(_USERS, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=locks)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a last user is leaving its marker
            self._fd = fd
            sessions = self._sessions.open_parent(create=True)
            try:
                # Not fsynced: a kill leaves it in the page cache, and a power loss that loses it finds
                # no marker either (its removal below is durable), so the next open recovers in full.
                os.close(
                    os.open(self._name, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=sessions)
                )
            finally:
                os.close(sessions)
            try:
                os.unlink(_MARKER, dir_fd=locks)
            except FileNotFoundError:
                return False
            os.fsync(locks)  # gone for good before anything is staged: a crash from here on is recovered
            self.found_clean = True
            return True
        except (OSError, InvalidKeyError) as exc:
            logger.warning("the local tier's session cannot be recorded (%s): recovery runs in full", exc)
            return False
        finally:
            os.close(locks)

    def close(self) -> bool:
        """End this process's session; leave the marker if it was the last user and none was killed."""
        fd, self._fd = self._fd, None
        if fd is None:
            return False
        try:
            sessions = self._sessions.open_parent()
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._name, dir_fd=sessions)
                others = os.listdir(sessions)
            finally:
                os.close(sessions)
            if others:
                return False  # another user is alive, or was killed: the next open recovers
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # another process uses the tier (it registers before it stages)
            locks = self._locks.open_parent()
            try:
                marker = os.open(_MARKER, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=locks)
                os.fsync(marker)
                os.close(marker)
                os.fsync(locks)
            finally:
                os.close(locks)
            return True
        except (OSError, InvalidKeyError) as exc:
            logger.debug("no clean-shutdown marker left: %s", exc)
            return False
        finally:
            os.close(fd)


def forget_dead_sessions(local_dir: Path, dir_mode: int | None) -> int:
    """Remove the session files of processes that no longer exist (after a full recovery); return how many."""
    try:
        sessions = Place(local_dir, ("locks", _SESSIONS), ".", dir_mode).open_parent()
    except (OSError, InvalidKeyError):
        return 0
    removed = 0
    try:
        for name in os.listdir(sessions):
            if not owner_alive(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=sessions)
                removed += 1
    finally:
        os.close(sessions)
    return removed
