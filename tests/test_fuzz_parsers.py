"""Property tests and fuzzing of everything parsed from outside: manifests, tar headers, indexes, Parquet, Zarr.

For any input the parser either succeeds or raises a `DatacacheError` with a
message; never another exception type, never a hang. Member names and keys
never become paths outside the cache.
"""

from __future__ import annotations

import io
import json
import struct
import tarfile
from pathlib import Path
from typing import Any

import pytest
from datacache.loaders.shardfiles import Unit, open_unit_reader, zarr_plan
from datacache.tiers import validate_key
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from datacache.counting.spantable import SpanTable
from datacache.counting.tarindex import group_samples, index_from_json, index_to_json, scan_tar
from datacache.errors import DatacacheError, InvalidKeyError
from datacache.manifest import Manifest, Shard, ShardFormat

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# JSON as any peer may send it: json.loads also accepts NaN and Infinity.
scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=25,
)
keys = st.text(max_size=40) | st.sampled_from(
    ["a.tar", "../x.tar", "/abs.tar", "a//b.tar", "a/./b", "x\x00y", "ok/0.tar"]
)


# -- manifests ------------------------------------------------------------------------------


shard_entries = st.fixed_dictionaries(
    {},
    optional={
        "key": keys,
        "size": st.integers(-5, 2**70) | scalars,
        "version": scalars,
        "checksum": st.sampled_from(["xxh3_64:00ff", "md5:1", ""]) | scalars,
        "samples": st.integers(-3, 2**70) | scalars,
    },
)
manifests = st.fixed_dictionaries(
    {},
    optional={
        "format_version": st.sampled_from([1, 1, 1, 2, "1"]) | scalars,
        "dataset": scalars,
        "url": scalars,
        "format": st.sampled_from(["tar", "parquet", "zarr", "files", "TAR", "csv"]) | scalars,
        "created": st.floats() | st.integers() | scalars,
        "snapshot": scalars,
        "extra": json_values,
        "shards": st.lists(shard_entries | json_values, max_size=6) | json_values,
    },
)


MANIFEST_INPUT = {"document": manifests | json_values}


@FUZZ
@given(**MANIFEST_INPUT)
@example(document={"format_version": 1, "format": "tar", "shards": [], "created": 10**400})
@example(document={"format_version": 1, "format": "tar", "shards": [], "created": float("nan")})
def test_manifest_from_json_never_crashes(document: Any) -> None:
    try:
        manifest = Manifest.from_json(document, "fuzz.json")
    except DatacacheError as exc:
        assert str(exc).startswith("fuzz.json") or "invalid key" in str(exc)
        return
    # Whatever parses is usable: keys are safe, and it survives its own round trip.
    for shard in manifest.shards:
        validate_key(shard.key)
        assert shard.size >= 0
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())), "again")
    assert again.snapshot == manifest.snapshot


@FUZZ
@given(key=keys)
def test_shard_keys_are_safe_or_refused(key: str) -> None:
    try:
        shard = Shard.from_json({"key": key, "size": 1}, "fuzz")
    except InvalidKeyError:
        return
    assert not shard.key.startswith("/") and ".." not in shard.key.split("/")


# -- tar headers and member names ------------------------------------------------------------


def real_tar(members: list[tuple[str, bytes]], fmt: int = tarfile.USTAR_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def fix_checksum(buffer: bytearray, offset: int) -> None:
    """Make the header at ``offset`` valid again after a mutation, so parsing reaches deeper."""
    header = buffer[offset : offset + 512]
    header[148:156] = b" " * 8
    buffer[offset + 148 : offset + 156] = f"{sum(header):06o}\0 ".encode()


names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=120)
member_lists = st.lists(st.tuples(names, st.binary(max_size=600)), min_size=1, max_size=4)


def check_scan(buffer: bytes) -> None:
    try:
        members = scan_tar(buffer, where="fuzz.tar")
    except DatacacheError as exc:
        assert "fuzz.tar" in str(exc)
        return
    for member in members:
        assert member.offset >= 0 and member.offset + member.size <= len(buffer)
    try:
        samples = group_samples(members)
    except DatacacheError:
        return
    for sample in samples:
        assert sample.start >= 0 and sample.end <= len(buffer)


RANDOM_TAR_INPUT = {"data": st.binary(max_size=3000)}


@FUZZ
@given(**RANDOM_TAR_INPUT)
def test_scan_tar_of_random_bytes(data: bytes) -> None:
    check_scan(data)


DAMAGED_TAR_INPUT = {
    "members": member_lists,
    "fmt": st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    "edits": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
    "fix": st.booleans(),
    "cut": st.none() | st.integers(0, 10**6),
}


@FUZZ
@given(**DAMAGED_TAR_INPUT)
def test_scan_tar_of_damaged_real_tars(
    members: list[tuple[str, bytes]], fmt: int, edits: list[tuple[int, int]], fix: bool, cut: int | None
) -> None:
    try:
        raw = bytearray(real_tar(members, fmt))
    except (ValueError, UnicodeEncodeError):
        return  # a name tarfile itself cannot write
    for position, value in edits:
        raw[position % len(raw)] = value
        if fix:
            fix_checksum(raw, (position % len(raw)) // 512 * 512)
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    check_scan(bytes(raw))


def raw_header(name: bytes, size_field: bytes, typeflag: bytes) -> bytes:
    """One ustar header with any bytes in its size field, and a correct checksum."""
    header = bytearray(512)
    header[0 : min(len(name), 100)] = name[:100]
    header[100:108] = b"0000644\0"
    header[124:136] = size_field[:12].ljust(12, b"\0")
    header[156:157] = typeflag
    header[257:263] = b"ustar\0"
    header[263:265] = b"00"
    fix_checksum(header, 0)
    return bytes(header)


def pax_record(keyword: str, value: str) -> bytes:
    body = f" {keyword}={value}\n".encode()
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))
    return f"{length}".encode() + body


size_fields = st.one_of(
    st.integers(-(8**10), 8**11 - 1).map(lambda n: (f"{n:o}" if n >= 0 else f"-{-n:o}").encode()),
    st.binary(max_size=12),
    st.binary(min_size=11, max_size=11).map(lambda b: b"\x80" + b),  # GNU base-256
    st.binary(min_size=11, max_size=11).map(lambda b: b"\xff" + b),  # base-256, negative
)


@st.composite
def crafted_tars(draw: st.DrawFn) -> bytes:
    """Tars built header by header: any size field, pax and GNU long-name records, bodies of any length."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 4))):
        typeflag = draw(st.sampled_from([b"0", b"\0", b"7", b"x", b"g", b"L", b"K", b"5", b"2"]))
        if typeflag == b"x":
            records = draw(
                st.lists(
                    st.tuples(
                        st.sampled_from(["size", "path", "mtime"]),
                        st.integers(-5000, 5000).map(str) | st.text(max_size=12),
                    ),
                    max_size=3,
                )
            )
            body = b"".join(pax_record(k, v.replace("\n", "")) for k, v in records)
        else:
            body = draw(st.binary(max_size=700))
        size_field = f"{len(body):011o}".encode() if draw(st.booleans()) else draw(size_fields)
        out += raw_header(draw(st.binary(min_size=1, max_size=20)), size_field, typeflag)
        out += body + b"\0" * (-len(body) % 512)
    if draw(st.booleans()):
        out += b"\0" * 1024
    return bytes(out)


def crafted_loop(size: int) -> bytes:
    """A pax header whose size record sends the scanner back to the start."""
    record = pax_record("size", str(size))
    return (
        raw_header(b"pax", f"{len(record):011o}".encode(), b"x")
        + record.ljust(512, b"\0")
        + raw_header(b"a.bin", b"00000000003", b"0")
        + b"abc".ljust(512, b"\0")
        + b"\0" * 1024
    )


CRAFTED_TAR_INPUT = {"raw": crafted_tars()}


@FUZZ
@given(**CRAFTED_TAR_INPUT)
@example(raw=crafted_loop(-1536))
@example(raw=raw_header(b"a.bin", b"-1000", b"0") + b"\0" * 2048)
@pytest.mark.timeout(60)
def test_scan_tar_of_crafted_headers_never_hangs_or_crashes(raw: bytes) -> None:
    check_scan(raw)


@FUZZ
@given(members=member_lists)
def test_member_names_read_back_and_never_become_paths(members: list[tuple[str, bytes]], tmp_path_factory: Any) -> None:
    try:
        raw = real_tar(members, tarfile.PAX_FORMAT)
    except (ValueError, UnicodeEncodeError):
        return
    scanned = scan_tar(raw, where="t")
    assert [m.name for m in scanned] == [tarfile.TarInfo(n).name for n, _ in members]
    for member, (_, data) in zip(scanned, members):
        assert raw[member.offset : member.offset + member.size] == data


INDEX_INPUT = {"document": json_values, "size": st.integers(0, 10**6)}


@FUZZ
@given(**INDEX_INPUT)
@example(document={"format_version": 1, "size": 10, "samples": [["a", [["x", float("inf"), 1]]]]}, size=10)
@example(document={"format_version": 1, "size": 10, "samples": [["a", [["x", 1e300, 1]]]]}, size=10)
@example(document={"format_version": 1, "size": 10, "samples": [[1, [["x", 0, 1]]]]}, size=10)
def test_index_from_json_never_crashes(document: Any, size: int) -> None:
    raw = json.dumps(document).encode()
    try:
        shard_size, spans = index_from_json(raw, where="fuzz.idx.json")
    except DatacacheError as exc:
        assert "fuzz.idx.json" in str(exc)
        return
    for span in spans:
        assert isinstance(span.key, str)
        for _, offset, length in span.fields:
            assert offset >= 0 and offset + length <= shard_size


@FUZZ
@given(data=st.binary(max_size=400))
def test_index_from_json_of_random_bytes(data: bytes) -> None:
    try:
        index_from_json(data, where="fuzz.idx.json")
    except DatacacheError as exc:
        assert "fuzz.idx.json" in str(exc), f"the error does not name the index: {exc}"


def test_index_round_trip() -> None:
    raw = real_tar([("a.cls", b"1"), ("a.jpg", b"xyz"), ("b.cls", b"2")])
    spans = group_samples(scan_tar(raw))
    size, back = index_from_json(index_to_json(spans, shard_size=len(raw)), where="i")
    assert size == len(raw) and back == spans


def test_span_table_round_trip() -> None:
    raw = real_tar([("a.cls", b"1"), ("a.jpg", b"xyz"), ("b.cls", b"2"), ("c\u00e9 d.txt", b"")])
    spans = group_samples(scan_tar(raw))
    table = SpanTable.from_spans(spans, shard_size=len(raw))
    back = SpanTable.from_bytes(table.to_bytes(), where="t")
    assert list(back) == spans and back.shard_size == len(raw)
    assert [back.fields(i) for i in range(len(back))] == [list(s.fields) for s in spans]


def _span_table_bytes(header: Any, columns: list[int]) -> bytes:
    encoded = json.dumps(header).encode()
    return b"DCSPANS1" + struct.pack("<Q", len(encoded)) + encoded + struct.pack(f"<{len(columns)}q", *columns)


SPAN_TABLE_INPUT = {
    "size": st.integers(-5, 100),
    "keys": st.lists(st.text(max_size=5), max_size=4),
    "extensions": st.lists(st.text(max_size=3), max_size=3),
    "columns": st.lists(st.integers(-(2**63), 2**63 - 1), max_size=16),
}


@FUZZ
@given(**SPAN_TABLE_INPUT)
@example(size=10, keys=["a"], extensions=["x"], columns=[0, 1, 0, 2**63 - 1, 2**63 - 1])
@example(size=10, keys=["a"], extensions=["x"], columns=[0, 1, 0, 4, 6])
def test_span_table_never_serves_a_span_outside_the_shard(
    size: int, keys: list[str], extensions: list[str], columns: list[int]
) -> None:
    raw = _span_table_bytes({"size": size, "keys": keys, "extensions": extensions}, columns)
    try:
        table = SpanTable.from_bytes(raw, where="fuzz.spans")
    except DatacacheError as exc:
        assert "fuzz.spans" in str(exc)
        return
    assert len(table) == len(keys)
    for index in range(len(table)):
        for extension, offset, length in table.fields(index):
            assert extension in extensions
            assert offset >= 0 and length >= 0 and offset + length <= size


@FUZZ
@given(data=st.binary(max_size=400))
def test_span_table_of_random_bytes(data: bytes) -> None:
    for raw in (data, b"DCSPANS1" + data):
        try:
            SpanTable.from_bytes(raw, where="fuzz.spans")
        except DatacacheError as exc:
            assert "fuzz.spans" in str(exc), f"the error does not name the table: {exc}"


# -- Zarr metadata --------------------------------------------------------------------------


zarr_documents = st.fixed_dictionaries(
    {},
    optional={
        "node_type": st.sampled_from(["array", "group"]) | scalars,
        "shape": st.lists(st.integers(-2, 50) | scalars, max_size=3) | scalars,
        "chunks": st.lists(st.integers(-2, 20) | scalars, max_size=3) | scalars,
        "chunk_grid": st.fixed_dictionaries(
            {}, optional={"configuration": st.fixed_dictionaries({}, optional={"chunk_shape": json_values})}
        )
        | json_values,
        "chunk_key_encoding": json_values,
        "dimension_separator": scalars,
    },
)


ZARR_INPUT = {
    "documents": st.lists(
        st.tuples(st.sampled_from(["zarr.json", ".zarray", "a/zarr.json", "b/.zarray"]), zarr_documents | json_values),
        min_size=1,
        max_size=3,
    ),
    "raw": st.none() | st.binary(max_size=40),
}


@FUZZ
@given(**ZARR_INPUT)
@example(
    documents=[
        ("zarr.json", {"node_type": "array", "shape": [4], "chunk_grid": {"configuration": {"chunk_shape": [0]}}})
    ],
    raw=None,
)
@example(documents=[(".zarray", {"shape": ["x"], "chunks": [1]})], raw=None)
@example(documents=[("zarr.json", [])], raw=None)
@example(documents=[("zarr.json", {"node_type": "array", "shape": [4], "chunk_grid": "regular"})], raw=None)
def test_zarr_plan_never_crashes(documents: list[tuple[str, Any]], raw: bytes | None) -> None:
    metadata = {key: (raw if raw is not None else json.dumps(doc).encode()) for key, doc in documents}
    shards = tuple(Shard(key, len(data)) for key, data in metadata.items())
    manifest = Manifest(dataset="z", url="memory://z", format=ShardFormat.ZARR, shards=shards)
    try:
        plan = zarr_plan(manifest, metadata.__getitem__)
    except DatacacheError as exc:
        assert "dataset z" in str(exc)
        return
    assert all(unit.count >= 0 for unit in plan.units)


# -- Parquet footers and bodies -------------------------------------------------------------


def parquet_bytes(rows: int) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{"i": i, "s": str(i) * 3} for i in range(rows)]), out)
    return out.getvalue()


GOOD_PARQUET = parquet_bytes(7)


PARQUET_INPUT = {
    "edits": st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
    "tail": st.booleans(),
    "cut": st.none() | st.integers(0, 10**6),
}


@FUZZ
@given(**PARQUET_INPUT)
@example(edits=[(158, 128)], tail=False, cut=None)  # a string value that is not UTF-8
@example(edits=[(270, 128)], tail=False, cut=None)  # a column name that is not UTF-8
@example(edits=[(18310, 2)], tail=False, cut=None)  # a batch decoding to fewer rows the second time
def test_parquet_reader_of_damaged_files(edits: list[tuple[int, int]], tail: bool, cut: int | None) -> None:
    raw = bytearray(GOOD_PARQUET)
    for position, value in edits:
        # Most damage in the footer (the last bytes), where the metadata lives.
        index = len(raw) - 1 - position % 200 if tail else position % len(raw)
        raw[index] = value
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    unit = Unit(("p.parquet",), 7, "p.parquet")
    try:
        reader = open_unit_reader(ShardFormat.PARQUET, unit, "fuzz", {"p.parquet": bytes(raw)}, {})
    except DatacacheError as exc:
        assert "fuzz" in str(exc)
        return
    try:
        # Damage that the footer does not show surfaces when a batch is decoded: named, never raw.
        rows = [reader.sample(i) for i in range(unit.count)]
    except DatacacheError as exc:
        assert "fuzz" in str(exc)
        rows = [None] * 7
    assert len(rows) == 7
    reader.close()


FOOTER_INPUT = {
    "edits": st.lists(st.tuples(st.integers(0, 300), st.integers(0, 255)), max_size=6),
    "cut": st.none() | st.integers(0, 10**6),
    "junk": st.none() | st.binary(max_size=64),
}


@pytest.fixture(scope="module")
def parquet_stager(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One stager (in its own loop) for all the footer examples."""
    from datacache._sync import LoopThread
    from datacache.config import load_settings
    from datacache.staging import Stager

    root = tmp_path_factory.mktemp("parquet-footers")
    settings = load_settings({"HOME": str(root)}, overrides={"local_dir": str(root / "cache")})
    loop = LoopThread()
    stager = Stager(settings)
    yield root, loop, stager
    loop.run(stager.close())
    loop.close()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(**FOOTER_INPUT)
@example(edits=[], cut=None, junk=b"PAR1")
@example(edits=[], cut=None, junk=b"\xff\xff\xff\x7fPAR1")
def test_parquet_footers_read_through_the_cache(
    parquet_stager: Any, edits: list[tuple[int, int]], cut: int | None, junk: bytes | None
) -> None:
    from datacache.loaders.plans.counts import plan_context

    from datacache.formats.parquet import parquet_rows

    root, loop, stager = parquet_stager
    raw = bytearray(GOOD_PARQUET if junk is None else junk)
    for position, value in edits:
        if raw:
            raw[len(raw) - 1 - position % len(raw)] = value
    if cut is not None:
        raw = raw[: cut % (len(raw) + 1)]
    origin = Path(root, f"origin-{len(list(root.iterdir()))}")
    origin.mkdir()
    (origin / "p.parquet").write_bytes(bytes(raw))

    async def rows() -> int:
        handle = await stager.open(str(origin))
        return await parquet_rows(plan_context(stager, handle, stager.settings), "p.parquet", len(raw))

    try:
        count = loop.run(rows())
    except DatacacheError as exc:
        assert "p.parquet" in str(exc)
        return
    assert count >= 0


def test_parquet_rows_of_an_intact_file(parquet_stager: Any) -> None:
    from datacache.loaders.plans.counts import plan_context

    from datacache.formats.parquet import parquet_rows

    root, loop, stager = parquet_stager
    origin = root / "intact"
    origin.mkdir()
    (origin / "p.parquet").write_bytes(GOOD_PARQUET)

    async def rows() -> int:
        handle = await stager.open(str(origin))
        return await parquet_rows(plan_context(stager, handle, stager.settings), "p.parquet", len(GOOD_PARQUET))

    assert loop.run(rows()) == 7


def test_fuzzed_inputs_write_nothing_outside_the_cache(tmp_path: Path) -> None:
    """Parsing is pure: none of the parsers above opens a file for writing (checked on one run of each)."""
    before = set(Path.cwd().iterdir())
    check_scan(real_tar([("../../escape.txt", b"x"), ("/abs/path.bin", b"y")]))
    members = scan_tar(real_tar([("../../escape.txt", b"x")]))
    assert members[0].name == "../../escape.txt"  # a name, never opened as a path
    assert set(Path.cwd().iterdir()) == before


# -- the same properties, ten times longer, in `make test-faults` -----------------------------

LONG = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


def longer(fast: Any, strategies: dict[str, Any]) -> Any:
    """``fast``'s property with `LONG` settings (for properties without fixtures)."""

    @pytest.mark.faults
    @LONG
    @given(**strategies)
    def run(**kwargs: Any) -> None:
        fast.hypothesis.inner_test(**kwargs)

    run.__name__ = f"{fast.__name__}_long"
    return run


test_manifest_from_json_never_crashes_long = longer(test_manifest_from_json_never_crashes, MANIFEST_INPUT)
test_scan_tar_of_random_bytes_long = longer(test_scan_tar_of_random_bytes, RANDOM_TAR_INPUT)
test_scan_tar_of_damaged_real_tars_long = longer(test_scan_tar_of_damaged_real_tars, DAMAGED_TAR_INPUT)
test_scan_tar_of_crafted_headers_long = longer(
    test_scan_tar_of_crafted_headers_never_hangs_or_crashes, CRAFTED_TAR_INPUT
)
test_index_from_json_never_crashes_long = longer(test_index_from_json_never_crashes, INDEX_INPUT)
test_span_table_never_serves_a_span_outside_the_shard_long = longer(
    test_span_table_never_serves_a_span_outside_the_shard, SPAN_TABLE_INPUT
)
test_zarr_plan_never_crashes_long = longer(test_zarr_plan_never_crashes, ZARR_INPUT)
test_parquet_reader_of_damaged_files_long = longer(test_parquet_reader_of_damaged_files, PARQUET_INPUT)


@pytest.mark.faults
@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(**FOOTER_INPUT)
def test_parquet_footers_read_through_the_cache_long(parquet_stager: Any, **kwargs: Any) -> None:
    test_parquet_footers_read_through_the_cache.hypothesis.inner_test(parquet_stager, **kwargs)
