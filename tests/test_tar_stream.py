"""`TarScanner`: indexing a tar from a stream agrees with `scan_tar` on the whole buffer, byte for byte."""

from __future__ import annotations

import tarfile

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from test_fuzz_parsers import FUZZ, crafted_loop, crafted_tars, member_lists, raw_header, real_tar

from datacache.counting.tarindex import TarMember, TarScanner, scan_tar
from datacache.errors import DatacacheError


def scan_in_chunks(raw: bytes, cuts: list[int]) -> list[TarMember]:
    scanner = TarScanner(where="stream.tar")
    position = 0
    for cut in sorted(c % (len(raw) + 1) for c in cuts):
        scanner.feed(raw[position:cut])
        position = max(position, cut)
    scanner.feed(raw[position:])
    return scanner.finish()


def agree(raw: bytes, cuts: list[int]) -> None:
    try:
        whole = scan_tar(raw, where="stream.tar")
    except DatacacheError:
        with pytest.raises(DatacacheError, match=r"stream\.tar"):
            scan_in_chunks(raw, cuts)
        return
    assert scan_in_chunks(raw, cuts) == whole


chunkings = st.lists(st.integers(0, 10**6), max_size=12)


@FUZZ
@given(
    members=member_lists,
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    cuts=chunkings,
    cut=st.none() | st.integers(0, 10**6),
)
def test_stream_scan_of_real_tars_agrees(
    members: list[tuple[str, bytes]], fmt: int, cuts: list[int], cut: int | None
) -> None:
    try:
        raw = real_tar(members, fmt)
    except (ValueError, UnicodeEncodeError):
        return
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    agree(raw, cuts)


@FUZZ
@given(raw=crafted_tars(), cuts=chunkings)
@example(raw=crafted_loop(-1536), cuts=[1, 513])
@example(raw=raw_header(b"a.bin", b"-1000", b"0") + b"\0" * 2048, cuts=[])
def test_stream_scan_of_crafted_tars_agrees(raw: bytes, cuts: list[int]) -> None:
    agree(raw, cuts)


def test_stream_scan_keeps_no_member_data() -> None:
    """A 4 MB member fed in 64 KB chunks: the scanner never holds more than a chunk and a header."""
    raw = real_tar([("big/0.bin", b"x" * (4 << 20)), ("big/0.json", b"{}")])
    scanner = TarScanner(where="big.tar")
    most = 0
    for start in range(0, len(raw), 1 << 16):
        scanner.feed(raw[start : start + (1 << 16)])
        most = max(most, len(scanner._pending))
    assert [m.name for m in scanner.finish()] == ["big/0.bin", "big/0.json"]
    assert most <= (1 << 16) + 512
