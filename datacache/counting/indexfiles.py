"""The files of a dataset snapshot's cluster index on the shared tier, and what each one holds.

`datacache.counting.cluster` decides what to count and who counts it; this module
only reaches, reads and writes its files: every one reached without following
a link, read bounded, aged by the file server's clock (see docs/SECURITY.md,
"The shared tier"). `decide_cold` records, beside the counts, whether an
epoch is read cold, so that every process of every node deals it one way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pwd
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from datacache.config import Settings, default_cache_dir
from datacache.counting.sidecars import KnownCount
from datacache.errors import ShardReadError
from datacache.manifest import Manifest, max_samples
from datacache.ownership import operator_writes, shared_metadata_mode
from datacache.tiers.files import (
    Place,
    UnsafeFileError,
    apply_mode,
    read_bounded,
    read_bounded_stat,
    server_now,
)

__all__ = ["IndexFiles", "backed_counts", "decide_cold", "encode_batch", "index_dir", "node_plan_path", "parse_batch"]

logger = logging.getLogger(__name__)


def node_plan_path(local_dir: Path, manifest: Manifest) -> Path:
    """Where a node keeps the unit plan (every shard's count) of one dataset snapshot for its readers.

    A client of the node's daemon that may not write the daemon's cache (another user, a
    member of its group) keeps its plans in its own cache directory instead, one folder per
    node cache.
    """
    name = f"{manifest.dataset}-{manifest.snapshot}.json"
    if not local_dir.exists() or os.access(local_dir, os.W_OK | os.X_OK):
        return local_dir / "indexes" / name
    return _own_folder(local_dir, "node-plans") / name


def _own_folder(local_dir: Path, kind: str) -> Path:
    """This user's folder for one node cache it may read but not write (a daemon's, as its group)."""
    node = hashlib.sha256(str(local_dir).encode()).hexdigest()[:16]
    return default_cache_dir(os.environ) / kind / node


def index_dir(shared_dir: Path, manifest: Manifest) -> Path:
    """Where the cluster keeps the counts of one dataset snapshot."""
    return shared_dir / "indexes" / manifest.dataset / manifest.snapshot


# Shared tiers this process found it cannot use, each named once.
_UNUSABLE: set[Path] = set()


def _usable(shared_dir: Path) -> bool:
    """Whether this user can use the shared tier's index (enter and write ``indexes/``, or make it).

    A tier this user cannot use is read around, as the stager reads around it (docs/SECURITY.md,
    "What datacache checks"): the index is kept in the node's own directory instead, with one warning.
    """
    target = shared_dir / "indexes"
    probe = next((p for p in (target, *target.parents) if os.path.exists(p)), Path("/"))
    if os.access(probe, os.W_OK | os.X_OK):
        return True
    if shared_dir not in _UNUSABLE:
        _UNUSABLE.add(shared_dir)
        logger.warning(
            "not using the shared tier for sample counts, reading around it: %s cannot be written by uid %d",
            probe,
            os.geteuid(),
        )
    return False


# Untrusted files already named in a warning (one line per file, not one per read).
_NAMED: set[Path] = set()

# A count file is a few bytes a shard; anything past this is not one (a planted /dev/zero, say).
_INDEX_FILE_LIMIT = 256 << 20


def _file_mode(settings: Settings, dataset_id: str, base: Path) -> int:
    """A count file's mode: its readers' on the shared tier, the group's if the operator writes, else 0600."""
    if base != settings.shared_dir:
        return 0o600
    declared = [d.readers for d in settings.datasets.values() if d.id == dataset_id and d.readers]
    readers = (declared[0].uids, declared[0].gids) if declared else None
    return shared_metadata_mode(readers, base, operator=operator_writes(settings.daemon_uid))


class IndexFiles:
    """The files of one snapshot's cluster index, reached as the shared tier's own files are.

    Other users can write the shared tier: every file here is reached by walking down
    from the tier's root without following a link, read only if it is a regular file of
    bounded size, and written by an atomic write in the directory so reached (see
    docs/SECURITY.md, "The shared tier"). Ages are measured by the file server's clock.
    """

    def __init__(self, settings: Settings, manifest: Manifest) -> None:
        base = settings.shared_dir if settings.shared_dir and _usable(settings.shared_dir) else settings.local_dir
        if base == settings.local_dir and base.exists() and not os.access(base, os.W_OK | os.X_OK):
            # A reader of a daemon's cache (its group) with no shared tier: its own folder, as for plans.
            base = _own_folder(base, "node-indexes")
        self.path = index_dir(base, manifest)
        self._base = base
        self._parts = self.path.relative_to(base).parts
        # The shared tier is the group's (setgid 2770); without one, the node's private cache.
        self._dir_mode = 0o2770 if base == settings.shared_dir else 0o700
        self.file_mode = _file_mode(settings, manifest.dataset, base)
        """The exact mode of the files written here, whatever the umask (the group's, or this user's)."""
        self._trusted = settings.trusted_uids
        declared = [d.readers for d in settings.datasets.values() if d.id == manifest.dataset and d.readers]
        self._readers = declared[0] if declared else None

    def place(self, name: str) -> Place:
        return Place(self._base, self._parts, name, self._dir_mode)

    def _directory(self) -> int:
        """An fd of the index directory; FileNotFoundError if it does not exist yet."""
        return self.place("_").open_parent()

    def names(self) -> list[str]:
        try:
            fd = self._directory()
        except FileNotFoundError:
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes | None:
        """The file's bytes, None if absent; `UnsafeFileError` for a link, FIFO, device or huge file."""
        try:
            return read_bounded(self.place(name), _INDEX_FILE_LIMIT)
        except FileNotFoundError:
            return None

    def read_trusted(self, name: str) -> bytes | None:
        """`read`, but only a file written by a trusted uid (this user, root, the daemon's).

        Any member of the shared tier's group can write this directory: a count is
        believed as a cached copy is (docs/SECURITY.md, "Who vouches for a cached
        copy"), on its writer's word only if that writer is trusted; anyone else's file
        is ignored (named once) and its shards are counted again.
        """
        try:
            st, raw = read_bounded_stat(self.place(name), _INDEX_FILE_LIMIT)
        except (FileNotFoundError, PermissionError):  # none, or another user's own: counted again
            return None
        if st.st_uid not in self._trusted:
            where = self.path / name
            if where not in _NAMED:
                _NAMED.add(where)
                # Another declared reader's counts are what the next reader finds (a trial's noise): said
                # quietly, and still not believed; anyone else's is a warning.
                logger.log(
                    logging.INFO if self._a_reader(st.st_uid) else logging.WARNING,
                    "ignoring the cluster index file %s: written by uid %d, not by this user, root or the "
                    "daemon's uid; its shards are counted again",
                    where,
                    st.st_uid,
                )
            return None
        return raw

    def _a_reader(self, uid: int) -> bool:
        """Whether ``uid`` is one of the dataset's declared readers (its groups as the system says)."""
        if self._readers is None:
            return False
        try:
            entry = pwd.getpwuid(uid)
        except KeyError:
            return self._readers.admits(uid, ())
        return self._readers.admits(uid, os.getgrouplist(entry.pw_name, entry.pw_gid))

    def exists(self, name: str) -> bool:
        try:
            fd = self._directory()
        except FileNotFoundError:
            return False
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return True

    def unlink(self, name: str) -> None:
        try:
            fd = self._directory()
        except FileNotFoundError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def age(self, name: str) -> float | None:
        """Seconds since ``name`` was last touched, by the file server's clock; None if absent."""
        try:
            fd = self._directory()
        except FileNotFoundError:
            return None
        try:
            mtime = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime
            return server_now(fd) - mtime
        except FileNotFoundError:
            return None
        finally:
            os.close(fd)

    def link_once(self, name: str, data: bytes) -> None:
        """Create ``name`` holding ``data`` unless it exists (the first writer wins, atomically)."""
        fd = self.place(name).open_parent(create=True)
        temporary = f".{name}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            out = os.open(temporary, flags, 0o600, dir_fd=fd)
            try:
                apply_mode(out, self.file_mode)
                os.write(out, data)
            finally:
                os.close(out)
            try:
                os.link(temporary, name, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.unlink(temporary, dir_fd=fd)
        finally:
            os.close(fd)


def parse_batch(raw: bytes, where: str) -> dict[str, KnownCount]:
    """A cluster index file: each count with where it came from (the file itself, for counts it scanned)."""
    try:
        document = json.loads(raw)
    except ValueError:
        raise ShardReadError(f"{where}: not valid JSON") from None
    counts = document.get("counts") if isinstance(document, dict) else None
    if not isinstance(counts, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in counts.items()
    ):
        raise ShardReadError(f"{where}: not a datacache count batch")
    sources = document.get("sources")
    source_of = document.get("source_of")
    if not (isinstance(sources, list) and isinstance(source_of, list) and len(source_of) == len(counts)):
        sources, source_of = [], [-1] * len(counts)
    found: dict[str, KnownCount] = {}
    for (key, samples), which in zip(counts.items(), source_of):
        known = isinstance(which, int) and 0 <= which < len(sources) and isinstance(sources[which], str)
        found[key] = KnownCount(samples, sources[which] if known else f"cluster index {where}")
    return found


def encode_batch(counts: Mapping[str, KnownCount]) -> bytes:
    sources = sorted({count.source for count in counts.values() if count.source != "scanned"})
    number = {source: i for i, source in enumerate(sources)}
    document = {
        "host": socket.gethostname(),
        "written": time.time(),
        "counts": {key: count.samples for key, count in counts.items()},
        "sources": sources,
        "source_of": [number.get(count.source, -1) for count in counts.values()],
    }
    return json.dumps(document, separators=(",", ":")).encode()


def decide_cold(settings: Settings, manifest: Manifest, *, seed: int, epoch: int, cold: bool) -> bool:
    """Whether epoch ``epoch`` of ``seed`` is read cold: one answer for every process of every node.

    The first process to ask decides (``cold``: its counts were incomplete)
    and records it beside the cluster index; every later one, on any node,
    reads that record, so that no two ranks deal one epoch two ways. A rerun
    of the same seed and epoch reads it the same way again.
    """
    files = IndexFiles(settings, manifest)
    if not cold and not files.names():
        return False  # every count came from the manifest: no process could have started cold
    name = f"epoch-{seed}-{epoch}.json"

    def recorded() -> bool | None:
        try:
            raw = files.read(name)
            return None if raw is None else bool(json.loads(raw).get("cold") is True)
        except (ValueError, AttributeError, UnsafeFileError):
            logger.warning("%s is damaged; reading epoch %d cold", files.path / name, epoch)
            return True
        except PermissionError:
            # Another user's own record (0600: its dataset is not declared shared), or planted: every
            # process of this user finds the same, so every one reads the epoch cold, one way.
            logger.info("%s is another user's; reading epoch %d cold", files.path / name, epoch)
            return True

    decided = recorded()
    if decided is not None:
        return decided
    files.link_once(name, json.dumps({"cold": cold}).encode())  # fails quietly if another decided first
    decided = recorded()
    return cold if decided is None else decided


def backed_counts(
    manifest: Manifest, counts: Mapping[str, KnownCount], path: Path
) -> tuple[dict[str, KnownCount], int]:
    """The counts of ``manifest``'s shards that their bytes can back (the manifest's rule, `max_samples`),
    and how many of ``counts`` are this snapshot's shards.

    A count above it (3,000,000 samples in a 40 KB tar) is dropped with a warning: the
    shard is counted again rather than planned for samples it cannot hold.
    """
    keys = list(counts)
    table = manifest.table
    positions = table.positions(keys)
    ours = positions >= 0
    sizes = np.where(ours, table.sizes[np.where(ours, positions, 0)], 0).tolist()
    backed: dict[str, KnownCount] = {}
    for key, mine, size in zip(keys, ours.tolist(), sizes, strict=True):
        if not mine:
            continue
        count = counts[key]
        bound = max_samples(manifest.format, size)
        if bound is not None and count.samples > bound:
            logger.warning(
                "%s: shard %r counted %d samples in %d bytes (at most %d); counting it again",
                path,
                key,
                count.samples,
                size,
                bound,
            )
            continue
        backed[key] = count
    return backed, int(ours.sum())
