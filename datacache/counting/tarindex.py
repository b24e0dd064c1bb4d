"""WebDataset-style tar shards: header scanning, sample grouping, and the shard index.

A WebDataset sample is the run of consecutive members whose names share a key
(``cat/0001.jpg`` and ``cat/0001.json`` form sample ``cat/0001`` with fields
``jpg`` and ``json``), exactly as the ``webdataset`` library groups them.

`scan_tar` reads headers straight from a buffer already in memory (no system
call per member), checks each header's checksum, and understands ustar
prefixes, GNU long names and pax ``path``/``size`` records. The index
``datacache shard`` writes next to each shard (``<shard>.idx.json``) holds the
same spans, so a reader can fetch one sample by a ranged read; readers keep
them per node as a `datacache.counting.spantable.SpanTable`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from datacache.errors import ShardReadError

__all__ = [
    "INDEX_SUFFIX",
    "SampleSpan",
    "TarMember",
    "TarScanner",
    "group_samples",
    "index_from_json",
    "index_to_json",
    "scan_tar",
    "split_key",
]

INDEX_SUFFIX = ".idx.json"
_BLOCK = 512
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_REGULAR = (b"0", b"\x00", b"7")


@dataclass(frozen=True, slots=True)
class TarMember:
    """A regular file in a tar: its name, and where its bytes lie in the tar."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True, slots=True)
class SampleSpan:
    """One sample: its key and, per field (extension), the byte span of its data."""

    key: str
    fields: tuple[tuple[str, int, int], ...]

    @property
    def start(self) -> int:
        return min(offset for _, offset, _ in self.fields)

    @property
    def end(self) -> int:
        return max(offset + size for _, offset, size in self.fields)

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.fields)


def split_key(name: str) -> tuple[str, str] | None:
    """Split ``name`` into (key, extension) as webdataset does; ``None`` if it has no extension."""
    match = _KEY_EXT.match(name)
    if match is None:
        return None
    return match.group(1), match.group(2).lower()


def _octal(field: bytes | memoryview, where: str) -> int:
    raw = bytes(field)
    if raw and raw[0] & 0x80:  # GNU base-256 for sizes over 8 GiB
        value = int.from_bytes(raw[1:], "big")
        return value
    text = raw.split(b"\x00", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise ShardReadError(f"{where}: corrupt tar header (bad number {text[:16]!r})") from None


def _pax_records(data: bytes, where: str) -> dict[str, str]:
    records: dict[str, str] = {}
    position = 0
    while position < len(data):
        space = data.find(b" ", position)
        if space < 0:
            break
        try:
            length = int(data[position:space])
        except ValueError:
            raise ShardReadError(f"{where}: corrupt pax header") from None
        if length <= 0:
            raise ShardReadError(f"{where}: corrupt pax header")
        record = data[space + 1 : position + length - 1]
        keyword, _, value = record.partition(b"=")
        records[keyword.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        position += length
    return records


def scan_tar(buffer: bytes | bytearray | memoryview, *, where: str = "tar") -> list[TarMember]:
    """Return the regular files of the tar in ``buffer``, in order.

    Raises `ShardReadError` naming ``where`` for a truncated tar, a header
    whose checksum is wrong, or a member that runs past the end.
    """
    view = memoryview(buffer).cast("B") if not isinstance(buffer, bytes) else memoryview(buffer)
    try:
        return _scan(view, where)
    finally:
        # Release the export at once, even when an exception keeps this frame alive:
        # the caller may need to unmap the buffer.
        view.release()


def _check_header(header: bytes, position: int, where: str) -> tuple[bytes, int]:
    """Check one header block's checksum; return its typeflag and the size it declares."""
    stored = _octal(header[148:156], where)
    computed = sum(header[:148]) + 8 * 32 + sum(header[156:])
    if stored != computed:
        raise ShardReadError(f"{where}: corrupt tar header at byte {position} (checksum mismatch)")
    size = _octal(header[124:136], where)
    if size < 0:  # int() reads "-17" in octal too: a size going backwards would loop forever
        raise ShardReadError(f"{where}: corrupt tar header at byte {position} (negative size)")
    return bytes(header[156:157]), size


def _pax_size(pax: dict[str, str], where: str) -> int | None:
    if "size" not in pax:
        return None
    try:
        size = int(pax["size"])
    except ValueError:
        raise ShardReadError(f"{where}: corrupt pax size") from None
    if size < 0:
        raise ShardReadError(f"{where}: corrupt pax size (negative)")
    return size


def _member_name(header: bytes, long_name: str | None, pax: dict[str, str]) -> str:
    if long_name is not None:
        return long_name
    if "path" in pax:
        return pax["path"]
    name = bytes(header[0:100]).split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
    if bytes(header[257:262]) == b"ustar":
        prefix = bytes(header[345:500]).split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
        if prefix:
            name = f"{prefix}/{name}"
    return name


def _padded(size: int) -> int:
    return (size + _BLOCK - 1) // _BLOCK * _BLOCK


def _scan(view: memoryview, where: str) -> list[TarMember]:
    total = len(view)
    members: list[TarMember] = []
    position = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    ended = False
    while position + _BLOCK <= total:
        header = bytes(view[position : position + _BLOCK])
        if not any(header):  # an end-of-archive block
            ended = True
            break
        typeflag, size = _check_header(header, position, where)
        data_start = position + _BLOCK
        if typeflag not in (b"L", b"x", b"g", b"K"):
            # A pax `size` record overrides the header's size (as tarfile and the stream scanner
            # read it): bounds are checked against the size that is really used.
            pax_size = _pax_size(pax, where)
            if pax_size is not None:
                size = pax_size
        data_end = data_start + size
        if data_end > total:
            raise ShardReadError(
                f"{where}: truncated tar: a member at byte {position} runs past the end ({total} bytes)"
            )
        position = data_start + _padded(size)
        if typeflag == b"L":  # GNU long name for the next member
            long_name = bytes(view[data_start:data_end]).split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
            continue
        if typeflag == b"x":
            pax = _pax_records(bytes(view[data_start:data_end]), where)
            continue
        if typeflag in (b"g", b"K"):
            continue
        name = _member_name(header, long_name, pax)
        long_name = None
        pax = {}
        if typeflag in _REGULAR:
            members.append(TarMember(name, data_start, size))
    if not ended:
        _check_unended(position, total, where)
    return members


def _check_unended(position: int, total: int, where: str) -> None:
    """Refuse a buffer with no end-of-archive block whose members do not end exactly at its end."""
    if position < total:
        raise ShardReadError(f"{where}: truncated tar: {total - position} stray bytes at the end")
    if position > total:
        # Cut inside the last member's padding: a member (and any sample after it) is missing.
        raise ShardReadError(f"{where}: truncated tar: it ends inside a member's padding ({total} bytes)")
    if position == 0 and total:
        raise ShardReadError(f"{where}: not a tar file")


class TarScanner:
    """`scan_tar` over a stream: feed the tar's bytes in chunks of any size, keep only headers.

    What indexing a shard at the origin's GET rate needs: member data is
    skipped as it passes, so memory stays at one chunk plus a header, whatever
    the shard's size. The result (and every error) is the one `scan_tar` gives
    for the same bytes.
    """

    _MAX_META = 1 << 20
    """Largest GNU long name or pax record kept (a hostile header could declare gigabytes)."""

    def __init__(self, *, where: str = "tar") -> None:
        self._where = where
        self._pending = bytearray()
        self._position = 0
        """Offset in the tar of ``_pending[0]``."""
        self._skip = 0
        self._missing = 0
        """Bytes of the current member's data not seen yet (its padding may be cut off, as `scan_tar` allows)."""
        self._members: list[TarMember] = []
        self._long_name: str | None = None
        self._pax: dict[str, str] = {}
        self._ended = False
        self._seen = 0

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Take the next bytes of the tar."""
        view = memoryview(chunk).cast("B")
        self._seen += len(view)
        if self._ended:
            return
        if self._skip:
            taken = min(self._skip, len(view))
            self._skip -= taken
            self._missing = max(0, self._missing - taken)
            self._position += taken
            view = view[taken:]
        if not len(view):
            return
        self._pending += view
        self._parse()

    def _parse(self) -> None:
        pending = self._pending
        used = 0
        while len(pending) - used >= _BLOCK:
            header = bytes(pending[used : used + _BLOCK])
            at = self._position + used
            if not any(header):
                self._ended = True
                break
            typeflag, size = _check_header(header, at, self._where)
            if typeflag in (b"L", b"x"):
                if size > self._MAX_META:
                    raise ShardReadError(f"{self._where}: tar header at byte {at} declares a {size}-byte name")
                if len(pending) - used < _BLOCK + size:
                    break  # wait for the whole record
                data = bytes(pending[used + _BLOCK : used + _BLOCK + size])
                if typeflag == b"L":
                    self._long_name = data.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")
                else:
                    self._pax = _pax_records(data, self._where)
                used += _BLOCK + size
                size, padding = 0, _padded(size) - size
            else:
                used += _BLOCK
                if typeflag not in (b"g", b"K"):
                    pax_size = _pax_size(self._pax, self._where)
                    if pax_size is not None:
                        size = pax_size
                    name = _member_name(header, self._long_name, self._pax)
                    self._long_name = None
                    self._pax = {}
                    if typeflag in _REGULAR:
                        self._members.append(TarMember(name, at + _BLOCK, size))
                padding = _padded(size) - size
            inside = min(size + padding, len(pending) - used)
            used += inside
            self._skip = size + padding - inside
            self._missing = max(0, size - inside)
        del pending[:used]
        self._position += used
        if self._ended:
            self._position += len(pending)
            pending.clear()

    def finish(self) -> list[TarMember]:
        """The tar's regular files, once every byte was fed; raise `ShardReadError` if it is incomplete."""
        where = self._where
        if not self._ended:
            if self._missing or len(self._pending) >= _BLOCK:
                last = self._members[-1].offset - _BLOCK if self._members else self._position
                raise ShardReadError(
                    f"{where}: truncated tar: a member at byte {last} runs past the end ({self._seen} bytes)"
                )
            if self._pending:
                raise ShardReadError(f"{where}: truncated tar: {len(self._pending)} stray bytes at the end")
            if self._skip:
                raise ShardReadError(f"{where}: truncated tar: it ends inside a member's padding ({self._seen} bytes)")
            if self._position == 0 and self._seen:
                raise ShardReadError(f"{where}: not a tar file")
        return self._members


def group_samples(members: Iterable[TarMember]) -> list[SampleSpan]:
    """Group consecutive members sharing a key into samples, as webdataset does.

    Members without an extension and webdataset's ``__meta__`` members are
    skipped; a field repeated within one sample is an error.
    """
    samples: list[SampleSpan] = []
    key: str | None = None
    fields: list[tuple[str, int, int]] = []
    for member in members:
        if _META.match(member.name) or (
            "/" not in member.name and member.name.startswith("__") and member.name.endswith("__")
        ):
            continue
        split = split_key(member.name)
        if split is None:
            continue
        member_key, extension = split
        if member_key != key:
            if key is not None and fields:
                samples.append(SampleSpan(key, tuple(fields)))
            key, fields = member_key, []
        if any(existing == extension for existing, _, _ in fields):
            raise ShardReadError(f"duplicate field {extension!r} in sample {member_key!r}")
        fields.append((extension, member.offset, member.size))
    if key is not None and fields:
        samples.append(SampleSpan(key, tuple(fields)))
    return samples


def index_to_json(samples: Sequence[SampleSpan], *, shard_size: int) -> bytes:
    """Encode a shard's sample spans as the ``.idx.json`` document."""
    document = {
        "format_version": 1,
        "size": shard_size,
        "samples": [[span.key, [list(field) for field in span.fields]] for span in samples],
    }
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()


def index_from_json(raw: bytes, *, where: str) -> tuple[int, list[SampleSpan]]:
    """Decode an ``.idx.json`` document; return (shard size, sample spans)."""
    try:
        document: Any = json.loads(raw)
    except ValueError as exc:
        raise ShardReadError(f"{where}: index is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format_version") != 1:
        raise ShardReadError(f"{where}: not a datacache shard index")
    size = document.get("size")
    entries = document.get("samples")
    if not isinstance(size, int) or not isinstance(entries, list):
        raise ShardReadError(f"{where}: index lacks size or samples")
    samples: list[SampleSpan] = []
    for entry in entries:
        try:
            key, fields = entry
            parsed = tuple((str(ext), int(offset), int(length)) for ext, offset, length in fields)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an offset of Infinity
            raise ShardReadError(f"{where}: malformed sample entry") from None
        if not isinstance(key, str) or any(o < 0 or n < 0 or o + n > size for _, o, n in parsed):
            raise ShardReadError(f"{where}: sample {key!r} lies outside the shard")
        samples.append(SampleSpan(key, parsed))
    return size, samples
