"""`SharedTier`: one directory on the cluster's distributed filesystem (Lustre, Ceph, NFS)."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import stat as stat_module
from dataclasses import dataclass
from pathlib import Path

from datacache.tiers._directory import DirectoryTier
from datacache.tiers._dirfd import Place, UnsafeFileError

__all__ = ["SharedTier", "SharedTierAccess"]

_AREAS = ("data", "meta", "locks", "manifests")


@dataclass(frozen=True, slots=True)
class SharedTierAccess:
    """What `SharedTier.check_access` found: whether this user can write the tier, and what is wrong."""

    writable: bool
    problems: tuple[str, ...] = ()
    """One sentence each, naming the directory and the fix (docs/SECURITY.md, "The shared tier")."""


class SharedTier(DirectoryTier):
    """One copy of each shard for every node of the cluster.

    Many nodes write here at once: writes are atomic renames, the metadata of
    each object (its checksum) travels beside it, and transfers are made
    single-flight across nodes with lease lock files under `lock_dir`.

    It is a group resource (docs/SECURITY.md, "The shared tier"): the root
    belongs to the cluster's group, directories are setgid and group-writable
    (2770), so whatever a member creates belongs to that group, and files are
    readable by the group (0640).
    """

    kind = "shared"
    dir_mode = 0o2770
    file_mode = 0o640
    private_file_mode = 0o600

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        durable: bool = True,
        group: int | None = None,
    ) -> None:
        super().__init__(root, capacity=capacity, durable=durable)
        self._group = group
        """The configured group of the tier (``shared_group``): its root gets it when datacache creates it."""

    @property
    def lock_dir(self) -> Path:
        """Where cross-node lease locks live."""
        return self.root / "locks"

    def lock_path(self, key: str) -> Path:
        """The lease lock file of ``key``; raises `InvalidKeyError` if it would resolve outside `lock_dir`."""
        return self._contained(self.lock_dir, key, ".lock")

    def lock_place(self, key: str) -> Place:
        """The lease lock file of ``key``, to be reached without following links (see `LeaseLock`)."""
        return self._place("locks", key, ".lock")

    def check_access(self) -> SharedTierAccess:
        """Check, as this process's user, that the tier is safe and writable; create its root if missing.

        Blocking: run it in a thread. Not writable (or a link where its own
        directories go) makes ``writable`` false: callers read around the tier.
        """
        who = _user_name(os.geteuid())
        existed = os.path.lexists(self._root)
        try:
            root = Place(self._root, (), ".", self.dir_mode).open_parent(create=True)
        except OSError as exc:
            problem = f"shared tier {self._root}: {who} cannot open or create it ({exc.strerror})"
            with contextlib.suppress(OSError):  # whose it is says why (a first user's own group, say)
                problem = f"{problem[:-1]}; {_owner_text(os.stat(self._root))})"
            return SharedTierAccess(False, (problem,))
        try:
            problems = self._group_problems(root, created=not existed)
            problems += _mode_problems(self._root, os.fstat(root))
            writable = _can_write(root)
            if not writable:
                problems.append(f"shared tier {self._root}: {who} cannot write it ({_owner_text(os.fstat(root))})")
            for area in _AREAS:
                try:
                    # Made if missing; one another member made that the group cannot use is moved aside.
                    os.close(Place(self._root, (area,), ".", self.dir_mode).open_parent(create=writable))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                except UnsafeFileError as exc:
                    problems.append(f"shared tier: {exc}")
                    writable = False
                    continue
                except PermissionError:
                    st = os.stat(area, dir_fd=root, follow_symlinks=False)
                    problems.append(f"shared tier {self._root / area}: {who} cannot enter it ({_owner_text(st)})")
                    writable = False
                    continue
                st = os.stat(area, dir_fd=root, follow_symlinks=False)
                if not os.access(self._root / area, os.W_OK | os.X_OK):
                    problems.append(f"shared tier {self._root / area}: {who} cannot write it ({_owner_text(st)})")
                    writable = False
        finally:
            os.close(root)
        return SharedTierAccess(writable, tuple(problems))


    def _group_problems(self, root: int, *, created: bool) -> list[str]:
        """Give a root this process just made its group; name a group that is not the tier's."""
        st = os.fstat(root)
        if self._group is None:
            # A first run that made the root takes the parent's setgid group, else this user's own:
            # right for one user; other users' start-up checks name that group when they cannot use it.
            return []
        if created and st.st_uid == os.geteuid() and st.st_gid != self._group:
            try:
                os.fchown(root, -1, self._group)
                os.fchmod(root, self.dir_mode)  # chown may clear the setgid bit
            except OSError as exc:
                group = _group_name(self._group)
                return [f"shared tier {self._root}: cannot give it the group {group} ({exc.strerror})"]
            return []
        if st.st_gid != self._group:
            return [
                f"shared tier {self._root}: its group is {_group_name(st.st_gid)}, not the configured shared_group "
                f"{_group_name(self._group)} ({_owner_text(st)}); chgrp {_group_name(self._group)} {self._root}"
            ]
        return []


def _user_name(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"user {pwd.getpwuid(uid).pw_name}"
    return f"uid {uid}"


def _group_name(gid: int) -> str:
    with contextlib.suppress(KeyError):
        return grp.getgrgid(gid).gr_name
    return str(gid)


def _owner_text(st: os.stat_result) -> str:
    return f"owner {_user_name(st.st_uid)}, group {_group_name(st.st_gid)}, mode {stat_module.S_IMODE(st.st_mode):04o}"


def _mode_problems(root: Path, st: os.stat_result) -> list[str]:
    mode = stat_module.S_IMODE(st.st_mode)
    fix = f"(chgrp GROUP {root} && chmod 2770 {root}; docs/SECURITY.md)"
    problems = []
    if mode & 0o002 and not mode & stat_module.S_ISVTX:
        problems.append(f"shared tier {root}: anyone can write it ({_owner_text(st)}); make it the group's {fix}")
    if mode & 0o070 != 0o070:
        problems.append(f"shared tier {root}: its group cannot use it ({_owner_text(st)}) {fix}")
    if not mode & stat_module.S_ISGID:
        problems.append(
            f"shared tier {root}: not setgid, so files take each writer's own group and other members "
            f"may not read them ({_owner_text(st)}) {fix}"
        )
    return problems


def _can_write(dir_fd: int) -> bool:
    """Whether this process can create a file in ``dir_fd`` (tried, not guessed from the mode bits)."""
    name = f".datacache-probe.{os.getpid()}.{os.urandom(16).hex()}.partial"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError:
        return False
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    return True
