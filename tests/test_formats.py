"""The format registry: every built-in format passes the contract suite; one detector; third-party formats.

`datacache.formats.testing.FormatTests` states what every format promises (it
ships with the package, for third-party formats); each subclass here only
writes a small dataset of its format.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from datacache.tiers import ObjectInfo

from datacache.errors import ConfigError
from datacache.formats import detect_format_name, format_names, get_format, register_format
from datacache.formats.testing import FormatTests
from datacache.manifest import ShardFormat, detect_format
from datacache.shard import SOURCE_FORMATS, detect_source_format


def write_tar(path: Path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for key, fields in samples.items():
            for name, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


class TestTarFormat(FormatTests):
    format_name = "tar"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        counts = {}
        for shard in range(3):
            samples = {f"s{shard}-{i:03d}": {"txt": f"text {i}".encode(), "cls": str(i % 3).encode()} for i in range(7)}
            write_tar(directory / f"shard-{shard}.tar", samples)
            counts[f"shard-{shard}.tar"] = 7
        return counts


class TestParquetFormat(FormatTests):
    format_name = "parquet"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        counts = {}
        for part in range(2):
            rows = 5 + part
            pq.write_table(
                pa.table({"i": list(range(rows)), "s": [f"r{i}" for i in range(rows)]}), directory / f"p{part}.parquet"
            )
            counts[f"p{part}.parquet"] = rows
        (directory / "_SUCCESS").write_bytes(b"")
        return counts


class TestZarrFormat(FormatTests):
    format_name = "zarr"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        import numpy as np
        import zarr

        array = zarr.open_array(str(directory), mode="w", shape=(23, 2), chunks=(10, 2), dtype="i4")
        array[:] = np.arange(46, dtype="i4").reshape(23, 2)
        return {"c/0/0": 10, "c/1/0": 10, "c/2/0": 3}  # a sample is a row; a unit is a row of chunks


class TestFilesFormat(FormatTests):
    format_name = "files"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        for name in ("a.jpg", "b.jpg", "c/d.png"):
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(name.encode() * 10)
        return {"a.jpg": 1, "b.jpg": 1, "c/d.png": 1}

    def damage(self, data: bytes) -> bytes | None:
        return None


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["a.tar", "a.parquet", "a_stats.json"], "tar"),  # img2dataset: metadata beside each tar
        (["part-0.parquet", "part-1.parquet", "_SUCCESS"], "parquet"),  # Spark's output
        (["img/1.jpg", "meta.parquet"], "parquet"),
        (["arr/zarr.json", "arr/c/0/0", "x.tar"], "zarr"),
        (["img/1.jpg", "img/1.cls"], "files"),
    ],
)
def test_one_detector_for_reading_and_sharding(keys: list[str], expected: str) -> None:
    assert detect_format_name(keys) == expected
    assert detect_format(keys) is ShardFormat(expected)
    infos = [ObjectInfo(key, 1) for key in keys]
    assert detect_source_format(infos) == (expected if expected in SOURCE_FORMATS else "files")


def test_enum_config_and_shard_choices_come_from_the_registry() -> None:
    assert [member.value for member in ShardFormat] == list(format_names())
    assert set(SOURCE_FORMATS) - {"auto"} <= set(format_names())


def test_unknown_and_taken_names_are_one_line_errors() -> None:
    with pytest.raises(ConfigError, match="unknown format 'lance'") as caught:
        get_format("lance")
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="already registered"):
        register_format("tar", "datacache.formats.tar:FORMAT")
    with pytest.raises(ConfigError, match="lower-case"):
        register_format("Bad Name", "x:y")


def test_a_format_from_an_entry_point_and_one_registered_in_code(tmp_path: Path) -> None:
    """In a fresh interpreter: the registry reads entry points once, at first use."""
    package = tmp_path / "site"
    (package / "toyfmt").mkdir(parents=True)
    (package / "toyfmt" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from datacache.formats.files import FilesFormat

            class Toy(FilesFormat):
                name = "toy"
                suffixes = (".toy",)
                priority = 50

                def detect(self, keys):
                    return any(key.endswith(".toy") for key in keys)

            FORMAT = Toy()
            """
        )
    )
    info = package / "toyfmt-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toyfmt\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[datacache.formats]\ntoy = toyfmt:FORMAT\nbroken = nosuchmodule:FORMAT\n")
    script = textwrap.dedent(
        """
        import json
        from datacache.formats import detect_format_name, format_names, get_format, register_format
        from datacache.formats.files import FilesFormat
        from datacache.manifest import ShardFormat
        from datacache.config import load_settings

        class Late(FilesFormat):
            name = "late"
            suffixes = (".late",)
            priority = 60
            def detect(self, keys):
                return any(key.endswith(".late") for key in keys)

        register_format("late", Late())
        print(json.dumps({
            "names": list(format_names()),
            "toy": detect_format_name(["a.toy", "README"]),
            "late": detect_format_name(["a.late"]),
            "enum": [ShardFormat("toy").value, ShardFormat("late").value],
            "class": type(get_format("toy")).__name__,
        }))
        try:
            get_format("broken")
        except Exception as exc:
            print(json.dumps({"broken": str(exc)}))
        """
    )
    env = {"PYTHONPATH": str(package), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    found, broken = (json.loads(line) for line in done.stdout.splitlines())
    assert broken["broken"].startswith("format 'broken': cannot import nosuchmodule")
    assert "leaving out format broken" in done.stderr, "detection goes on without a package that fails to import"
    assert found["names"][:4] == ["tar", "parquet", "zarr", "files"] and {"toy", "late"} <= set(found["names"])
    assert found["toy"] == "toy" and found["late"] == "late"
    assert found["enum"] == ["toy", "late"] and found["class"] == "Toy"
