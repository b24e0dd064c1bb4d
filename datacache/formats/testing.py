"""`FormatTests`: the contract every sample format promises, as a pytest suite any format can run.

As `datacache.tiers.testing` does for tiers, this suite ships with the package,
so that a third-party format (registered with `register_format` or under the
``datacache.formats`` entry point group) proves itself with the same tests as
datacache's own. It needs pytest, imported here only: ``import
datacache.formats`` never imports it. It needs no torch: it checks what the
format gives the loader, not the loader.

Example
-------
::

    from pathlib import Path
    from datacache.formats.testing import FormatTests

    class TestJsonLines(FormatTests):
        format_name = "jsonl"

        def write_dataset(self, directory: Path) -> dict[str, int]:
            (directory / "a.jsonl").write_text('{"x": 1}\\n{"x": 2}\\n')
            return {"a.jsonl": 2}  # shard key -> samples it holds
"""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path
from typing import Any

import pytest

from datacache.config import DatasetConfig, Settings
from datacache.errors import ShardReadError
from datacache.formats import detect_format_name, format_names, get_format
from datacache.formats._base import PlanContext, SampleFormat, UnitPlan, UnitReader
from datacache.manifest import Manifest, take_manifest
from datacache.tiers import ByteRange, ObjectTier

__all__ = ["FormatTests"]


class FormatTests:
    """The format contract. Subclass it, set `format_name`, and write a small dataset in `write_dataset`."""

    format_name: str = ""
    foreign_keys: tuple[str, ...] = ("photos/0001.jpg", "photos/0002.jpg", "README.md")
    """A listing of another format's files, which `SampleFormat.detect` must not claim (except plain files)."""

    def write_dataset(self, directory: Path) -> dict[str, int]:
        """Write a dataset of a few shards into ``directory``; return each shard key's sample count."""
        raise NotImplementedError

    def damage(self, data: bytes) -> bytes | None:
        """A damaged copy of a shard's bytes that the format must refuse (None: every byte string is valid)."""
        return data[: len(data) // 2]

    # -- helpers ----------------------------------------------------------------------------

    @pytest.fixture
    def fmt(self) -> SampleFormat:
        return get_format(self.format_name)

    @pytest.fixture
    def dataset(self, tmp_path: Path) -> tuple[Path, dict[str, int]]:
        directory = tmp_path / "origin"
        directory.mkdir()
        return directory, self.write_dataset(directory)

    def _plan(self, tmp_path: Path, directory: Path) -> tuple[Manifest, UnitPlan]:
        settings = Settings(local_dir=tmp_path / "local")
        (tmp_path / "local").mkdir(exist_ok=True)

        async def body() -> tuple[Manifest, UnitPlan]:
            origin = ObjectTier(str(directory))
            try:
                manifest = await take_manifest(DatasetConfig(name="contract", url=str(directory)), origin)

                async def read(key: str, byte_range: ByteRange | None) -> bytes:
                    return await origin.get(key, byte_range)

                context = PlanContext(manifest, origin, settings, read)
                return manifest, await get_format(manifest.format.value).plan(context, wait=True)
            finally:
                await origin.close()

        return asyncio.run(body())

    def _readers(self, directory: Path, plan: UnitPlan) -> list[UnitReader]:
        fmt = get_format(self.format_name)
        readers = []
        for unit in plan.units:
            buffers = {key: (directory / key).read_bytes() for key in unit.keys}
            readers.append(fmt.open_reader(unit, f"shard {unit.label!r}", buffers, plan.extra))
        return readers

    # -- the contract -----------------------------------------------------------------------

    def test_registered_under_its_name(self, fmt: SampleFormat) -> None:
        assert self.format_name in format_names()
        assert fmt.name == self.format_name
        assert fmt.batch in ("fields", "arrays", "arrow", "collate")

    def test_pickles(self, fmt: SampleFormat) -> None:
        # A dataset holding its format goes to DataLoader workers by pickle.
        assert pickle.loads(pickle.dumps(fmt)).name == fmt.name  # noqa: S301 - our own object

    def test_the_one_detector_names_it(self, fmt: SampleFormat, dataset: tuple[Path, dict[str, int]]) -> None:
        directory, _ = dataset
        keys = [str(path.relative_to(directory)) for path in directory.rglob("*") if path.is_file()]
        assert fmt.detect(keys)
        assert detect_format_name(keys) == self.format_name

    def test_does_not_claim_other_files(self, fmt: SampleFormat) -> None:
        if fmt.name != "files":
            assert not fmt.detect(list(self.foreign_keys))

    def test_plan_counts_every_shard(
        self, fmt: SampleFormat, dataset: tuple[Path, dict[str, int]], tmp_path: Path
    ) -> None:
        directory, counts = dataset
        manifest, plan = self._plan(tmp_path, directory)
        assert manifest.format.value == self.format_name
        assert not plan.unreadable
        assert plan.total == sum(counts.values())
        assert all(unit.count >= 0 for unit in plan.units)
        for shard in manifest.shards:
            bound = fmt.max_samples(shard.size)
            if bound is not None and shard.key in counts:
                assert counts[shard.key] <= bound, "a real shard's count must be within max_samples"

    def test_readers_serve_every_sample_once(self, dataset: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
        directory, counts = dataset
        _, plan = self._plan(tmp_path, directory)
        seen: set[str] = set()
        for reader in self._readers(directory, plan):
            try:
                assert reader.samples == reader.unit.count
                for index in range(reader.unit.count):
                    sample = reader.sample(index)
                    assert isinstance(sample, dict) and isinstance(sample["__key__"], str)
                    assert sample["__key__"] not in seen, "sample keys are unique in a dataset"
                    seen.add(sample["__key__"])
                with pytest.raises(IndexError):
                    reader.sample(reader.unit.count)
            finally:
                reader.close()
        assert len(seen) == sum(counts.values())

    def test_batch_fast_path(self, fmt: SampleFormat, dataset: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
        directory, _ = dataset
        _, plan = self._plan(tmp_path, directory)
        for reader in self._readers(directory, plan):
            try:
                if fmt.batch == "fields":
                    assert reader.packable
                    if reader.unit.count:
                        fields = reader.fields(0)
                        assert fields[0][0] == "__key__" and all(isinstance(v, memoryview) for _, v in fields)
                elif reader.unit.count and fmt.batch == "arrow":
                    import pyarrow as pa

                    assert pa.RecordBatch.from_pylist([reader.sample(0)]).num_rows == 1
            finally:
                reader.close()

    def test_kept_index_reads_the_same(
        self, fmt: SampleFormat, dataset: tuple[Path, dict[str, int]], tmp_path: Path
    ) -> None:
        if not fmt.keeps_index:
            return
        directory, _ = dataset
        _, plan = self._plan(tmp_path, directory)
        for unit in plan.units:
            buffers = {key: (directory / key).read_bytes() for key in unit.keys}
            first = fmt.open_reader(unit, "first", buffers, plan.extra)
            again = fmt.open_reader(unit, "again", buffers, plan.extra, index=first.index)
            try:
                assert [again.sample(i)["__key__"] for i in range(unit.count)] == [
                    first.sample(i)["__key__"] for i in range(unit.count)
                ]
            finally:
                first.close()
                again.close()

    def test_a_damaged_shard_is_a_shard_read_error(self, dataset: tuple[Path, dict[str, int]], tmp_path: Path) -> None:
        directory, _ = dataset
        _, plan = self._plan(tmp_path, directory)
        fmt = get_format(self.format_name)
        unit = next(unit for unit in plan.units if unit.count)
        buffers: dict[str, Any] = {key: (directory / key).read_bytes() for key in unit.keys}
        damaged = self.damage(buffers[unit.keys[-1]])
        if damaged is None:
            return
        buffers[unit.keys[-1]] = damaged
        with pytest.raises(ShardReadError):
            reader = fmt.open_reader(unit, "damaged", buffers, plan.extra)
            try:
                for index in range(unit.count):
                    reader.sample(index)
            finally:
                reader.close()
