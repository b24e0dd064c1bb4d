"""Decoders and what each sample carries: ``__key__`` and ``__url__`` whatever the decoder, and decoder failures."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, payload, write_wds

from datacache.config import Settings
from datacache.errors import DatacacheError


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    directory = tmp_path / "origin"
    write_wds(directory, samples=30, per_shard=10)
    return directory


def test_every_decoder_keeps_url_and_key(origin: Path, settings: Settings) -> None:
    want = f"{origin}/train-0000.tar"
    for decode in ("auto", None, lambda s: s, {"cls": int}):
        first = next(iter(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=decode)))
        assert first["__key__"] == "sample000000", decode
        assert first["__url__"] == want, decode
    raw = next(iter(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=None)))
    assert raw["bin"] == payload(0)


def _bad_cls(value: bytes) -> int:
    if value == b"3":
        raise ValueError("three is not allowed")
    return int(value)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_decoder_error_names_dataset_shard_key_and_field(
    origin: Path, settings: Settings, batch_size: int | None
) -> None:
    dataset = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, decode={"cls": _bad_cls}, batch_size=batch_size
    )
    with pytest.raises(DatacacheError) as failure:
        list(dataset)
    message = str(failure.value)
    assert "dataset" in message and "'train-0000.tar'" in message
    assert "sample000003" in message and "'cls'" in message and "three is not allowed" in message
    assert isinstance(failure.value.__cause__, ValueError)
    skipping = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, decode={"cls": _bad_cls}, batch_size=batch_size, on_error="skip"
    )
    got = keys_of(skipping)
    assert sorted(got) == [f"sample{i:06d}" for i in range(30) if i % 10 != 3]
    assert skipping.stats().skipped_samples == 3


def test_a_whole_sample_decoder_error_names_the_decoder(origin: Path, settings: Settings) -> None:
    def broken(sample: dict[str, Any]) -> Any:
        return sample["missing"]

    with pytest.raises(DatacacheError, match=r"sample000000.*broken.*KeyError"):
        list(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=broken))


def test_parquet_rows_have_keys(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path / "pq"
    directory.mkdir()
    for part in range(2):
        pq.write_table(pa.Table.from_pylist([{"i": part * 5 + j} for j in range(5)]), directory / f"p{part}.parquet")
    rows = list(CachedIterableDataset(str(directory), config=settings, shuffle=False))
    assert [row["__key__"] for row in rows] == [f"p{part}/{j}" for part in range(2) for j in range(5)]
    assert [row["i"] for row in rows] == list(range(10))


def _image_shards(directory: Path) -> dict[str, Any]:
    """Two shards whose samples hold a jpg, png and webp image of the same pixels, npy, json, txt and cls."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image

    directory.mkdir(parents=True)
    pixels = {}
    with wds.ShardWriter(str(directory / "img-%04d.tar"), maxcount=3, verbose=0) as writer:
        for i in range(6):
            array = np.full((4 + i, 6, 3), 40 * i, dtype=np.uint8)
            array[0, 0] = (255, 0, 0)
            fields: dict[str, Any] = {"__key__": f"s{i}"}
            for ext, fmt, extra in (
                ("jpg", "JPEG", {"quality": 100}),
                ("png", "PNG", {}),
                ("webp", "WEBP", {"lossless": True}),
            ):
                sink = io.BytesIO()
                Image.fromarray(array).save(sink, fmt, **extra)
                fields[ext] = sink.getvalue()
            sink = io.BytesIO()
            np.save(sink, np.arange(i + 1))
            fields.update(npy=sink.getvalue(), json=b'{"i": %d}' % i, txt=f"caption {i}".encode(), cls=str(i).encode())
            writer.write(fields)
            pixels[f"s{i}"] = array
    return pixels


def test_builtin_decoders_decode_images_arrays_json_text_and_labels(tmp_path: Path, settings: Settings) -> None:
    import numpy as np
    import torch
    from PIL import Image

    pixels = _image_shards(tmp_path / "img")
    url = str(tmp_path / "img")
    for sample in CachedIterableDataset(url, config=settings, shuffle=False, decode="pil"):
        want = pixels[sample["__key__"]]
        assert isinstance(sample["png"], Image.Image) and isinstance(sample["webp"], Image.Image)
        assert np.array_equal(np.asarray(sample["png"].convert("RGB")), want)
        assert np.array_equal(np.asarray(sample["webp"].convert("RGB")), want)
        assert sample["jpg"].size == (want.shape[1], want.shape[0])
        index = int(sample["__key__"][1:])
        assert sample["json"] == {"i": index} and sample["txt"] == f"caption {index}" and sample["cls"] == index
        assert np.array_equal(sample["npy"], np.arange(index + 1))
        assert sample["__url__"].startswith(url) and sample["__url__"].endswith(".tar")
    for sample in CachedIterableDataset(url, config=settings, shuffle=False, decode="numpy"):
        want = pixels[sample["__key__"]]
        assert sample["png"].dtype == np.uint8 and np.array_equal(sample["png"], want)
        assert sample["jpg"].shape == want.shape
    for sample in CachedIterableDataset(url, config=settings, shuffle=False, decode="torch"):
        want = torch.from_numpy(pixels[sample["__key__"]]).permute(2, 0, 1)
        assert sample["webp"].dtype == torch.uint8 and torch.equal(sample["webp"], want)
        assert sample["jpg"].shape == want.shape


def test_a_corrupt_image_is_named_and_skippable(tmp_path: Path, settings: Settings) -> None:
    import webdataset as wds

    directory = tmp_path / "bad"
    directory.mkdir()
    with wds.ShardWriter(str(directory / "img-%04d.tar"), maxcount=10, verbose=0) as writer:
        writer.write({"__key__": "broken", "seg.png": b"\x89PNG not really"})
    with pytest.raises(DatacacheError, match=r"'img-0000.tar'.*'broken'.*field 'seg.png'"):
        list(CachedIterableDataset(str(directory), config=settings, decode="pil"))
    assert list(CachedIterableDataset(str(directory), config=settings, decode="pil", on_error="skip")) == []


def test_unknown_decoder_names_and_a_missing_pillow_are_clear(
    origin: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DatacacheError, match=r"unknown decoder 'jpeg'.*'pil'"):
        CachedIterableDataset(str(origin), config=settings, decode="jpeg")
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    monkeypatch.setitem(sys.modules, "torchvision", None)
    with pytest.raises(DatacacheError, match=r"Pillow, which is not installed: pip install 'datacache\[image\]'"):
        CachedIterableDataset(str(origin), config=settings, decode="pil")
    assert isinstance(next(iter(CachedIterableDataset(str(origin), config=settings, decode="basic")))["cls"], int)


def _relabel(sample: dict[str, Any]) -> dict[str, Any]:
    return {"label": int(sample["cls"])}


def test_a_custom_decoder_returning_a_new_dict_keeps_key_and_url(origin: Path, settings: Settings) -> None:
    first = next(iter(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=_relabel)))
    assert first == {"label": 0, "__key__": "sample000000", "__url__": f"{origin}/train-0000.tar"}


def _bad_odd_cls(value: bytes) -> int:
    if int(value) % 2:
        raise ValueError("odd")
    return int(value)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_skipped_samples_are_logged_a_few_then_counted(
    tmp_path: Path, settings: Settings, batch_size: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """`on_error="skip"` logged one WARNING line per skipped sample: 1,000 bad samples, 1,000 lines."""
    write_wds(tmp_path / "many", samples=300, per_shard=100)  # cls = i % 10: 150 odd ones
    dataset = CachedIterableDataset(
        str(tmp_path / "many"), config=settings, decode={"cls": _bad_odd_cls}, batch_size=batch_size, on_error="skip"
    )
    with caplog.at_level(logging.WARNING, logger="datacache"):
        got = keys_of(dataset)
    assert len(got) == 150 and dataset.stats().skipped_samples == 150
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "skipping" in r.getMessage()]
    assert len(lines) == 5 and all("odd" in line for line in lines), lines  # the first few, each with its reason
    counted = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "skipped" in r.getMessage()]
    assert counted and "later ones are counted" in counted[0], counted


def test_skipped_samples_are_logged_a_few_per_dataset_not_again_every_epoch(
    tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """The decoding and its log of skips are the dataset's, made once per process: every epoch's reader had
    its own, and each epoch logged its first few skips in full again."""
    write_wds(tmp_path / "few", samples=40, per_shard=20)  # 20 odd ones an epoch
    decode = {"cls": _bad_odd_cls}
    dataset = CachedIterableDataset(str(tmp_path / "few"), config=settings, decode=decode, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="datacache"):
        for epoch in range(2):
            dataset.set_epoch(epoch)
            assert len(keys_of(dataset)) == 20
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "skipping" in r.getMessage()]
    assert len(lines) == 5, lines


def test_a_mistyped_decoder_or_keyword_gets_the_guess_the_command_line_makes(
    origin: Path, settings: Settings
) -> None:
    """`decode="pill"` listed the decoders, and `shufle=True` was Python's bare TypeError, where a mistyped flag on
    the command line is answered with what it most likely meant: one guess (`errors.close_match`), everywhere."""
    from datacache.loaders import CachedMapDataset, DataLoader

    from datacache.errors import close_match

    assert close_match("pill", ["auto", "basic", "pil", "numpy", "torch"]) == "pil"
    with pytest.raises(DatacacheError) as decoder:
        CachedIterableDataset(str(origin), config=settings, decode="pill")
    assert str(decoder.value) == (
        "unknown decoder 'pill' (did you mean 'pil'?): use one of 'basic', 'pil', 'numpy', 'torch', or a callable"
    )
    cases: list[tuple[Any, dict[str, Any], str]] = [
        (lambda **kw: CachedIterableDataset(str(origin), config=settings, **kw), {"shufle": True}, "shuffle"),
        (lambda **kw: CachedMapDataset(str(origin), config=settings, **kw), {"decod": "pil"}, "decode"),
        (lambda **kw: DataLoader(CachedIterableDataset(str(origin), config=settings), **kw), {"shufle": 1}, "shuffle"),
        (lambda **kw: DataLoader([1, 2], **kw), {"num_worker": 2}, "num_workers"),
    ]
    for make, keywords, meant in cases:
        with pytest.raises(TypeError) as caught:
            make(**keywords)
        [typed] = keywords
        assert str(caught.value).endswith(f"() got an unexpected keyword argument {typed!r}; did you mean {meant!r}?")
    with pytest.raises(TypeError, match=r"^DataLoader\(\) got an unexpected keyword argument 'zzzz'$"):
        DataLoader([1, 2], zzzz=1)
    # What is spelt right still works, positional or by keyword, as torch's own.
    assert [b.tolist() for b in DataLoader([1, 2, 3], batch_size=2, shuffle=False)] == [[1, 2], [3]]
    assert len(list(DataLoader(CachedIterableDataset(str(origin), config=settings), batch_size=10))) == 3


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("batch_size", "256", "batch_size must be a positive integer, got '256'"),
        ("batch_size", 0, "batch_size must be a positive integer, got 0"),
        ("shuffle_buffer", 2.5, "shuffle_buffer must be a positive integer, got 2.5"),
        ("prefetch", -1, "prefetch must be an integer >= 0, got -1"),
    ],
)
def test_an_option_of_the_wrong_type_is_said_in_one_line_naming_it(
    origin: Path, settings: Settings, option: str, value: Any, said: str
) -> None:
    """A new user's trial: `batch_size="256"` (from argv) was a TypeError, '<' not supported between str and int."""
    with pytest.raises(DatacacheError) as refused:
        CachedIterableDataset(str(origin), config=settings, **{option: value})
    assert str(refused.value) == said
