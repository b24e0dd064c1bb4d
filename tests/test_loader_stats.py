"""When `stats().stall_fraction` is measured: the README's promise, checked.

The stall fraction is the consumer's time spent waiting for batches. With
DataLoader worker processes the dataset never sees the consumer's loop, so only
``ds.timed(loader)`` measures it there; without workers it is measured anyway.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from _helpers import REPO
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings


def test_the_readme_example_prints_the_stall_fraction(
    tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's first training loop said `print(ds.stats())` gives the data-stall fraction: it was None."""
    blocks = re.findall(r"^```python\n(.*?)^```", (REPO / "README.md").read_text(), flags=re.S | re.M)
    code = next(block for block in blocks if "print(ds.stats())" in block)
    write_wds(tmp_path / "origin", samples=40, per_shard=10)
    for old, new in [
        ('"s3://bucket/imagenet-wds/"', repr(str(tmp_path / "origin"))),
        ("range(90)", "range(1)"),  # one epoch shows it
        ("num_workers=8", "num_workers=2"),  # worker processes, as the user had; 2 cores here
        ("batch_size=256", "batch_size=4"),
        ("print(ds.stats())", "stats = ds.stats()"),
    ]:
        assert old in code, old
        code = code.replace(old, new)
    for name, value in {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}.items():
        monkeypatch.setenv(name, value)
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    stall = namespace["stats"].stall_fraction
    assert stall is not None and 0.0 <= stall <= 1.0, namespace["stats"]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_stall_fraction_is_measured_exactly_when_the_readme_says(
    tmp_path: Path, settings: Settings, workers: int
) -> None:
    write_wds(tmp_path / "origin", samples=40, per_shard=10)
    plain = CachedIterableDataset(str(tmp_path / "origin"), config=settings)
    for _ in DataLoader(plain, batch_size=4, num_workers=workers):
        pass
    stall = plain.stats().stall_fraction
    # Without workers the dataset runs in the consumer's loop and times it; with them, it cannot.
    assert (stall is not None) == (workers == 0), stall
    timed = CachedIterableDataset(str(tmp_path / "origin"), config=settings)
    for _ in timed.timed(DataLoader(timed, batch_size=4, num_workers=workers)):
        pass
    stall = timed.stats().stall_fraction
    assert stall is not None and 0.0 <= stall <= 1.0
