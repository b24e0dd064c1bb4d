"""The framework recipes of docs/FRAMEWORKS.md resume exactly from the framework's own checkpoints.

Each test runs the documented code itself (taken from the document), and is
skipped when the framework is not installed (``pip install -e '.[lightning]'``
or ``'.[hf]'``); the plain-loop round trip underneath runs everywhere.
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

DOC = REPO / "docs" / "FRAMEWORKS.md"


def _recipe(marker: str) -> dict[str, Any]:
    """The names the document's python block containing ``marker`` defines (its ``__main__`` part not run)."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    code = next(block for block in blocks if marker in block)
    namespace: dict[str, Any] = {"__name__": "frameworks_recipe"}
    exec(compile(code, f"{DOC}:{marker}", "exec"), namespace)
    return namespace


def _assert_resumed_exactly(
    before: list[tuple[int, list[str]]], after: list[tuple[int, list[str]]], reference: list[tuple[int, list[str]]]
) -> None:
    """Each epoch read once, nothing repeated or skipped; epochs begun after the resume in the same order.

    The epoch that was interrupted is dealt anew to the workers from where it stopped, so its
    remaining samples may come in another order (the README's resume contract).
    """
    resumed = after[0][0]

    def keys(run: list[tuple[int, list[str]]], epoch: int) -> list[str]:
        return [key for e, batch in run if e == epoch for key in batch]

    assert sorted(keys(before, resumed) + keys(after, resumed)) == sorted(keys(reference, resumed))
    assert len(set(keys(reference, resumed))) == len(keys(reference, resumed))
    assert [b for b in after if b[0] > resumed] == [b for b in reference if b[0] > resumed]


def _origin(tmp_path: Path) -> str:
    write_wds(tmp_path / "origin", samples=60, per_shard=10)
    return str(tmp_path / "origin")


@pytest.mark.parametrize("stop", [0, 1])  # in the first (cold) epoch, and in a later one
def test_plain_loop_state_round_trip_with_workers(tmp_path: Path, settings: Settings, stop: int) -> None:
    """What every recipe relies on: consumed batches -> state -> a new dataset continues exactly."""
    url = _origin(tmp_path)

    def run(dataset: CachedIterableDataset, epochs: range, stop: int | None = None) -> list[tuple[int, list[str]]]:
        seen = []
        for epoch in epochs:
            dataset.set_epoch(epoch)
            for step, batch in enumerate(DataLoader(dataset, batch_size=8, num_workers=2)):
                seen.append((epoch, batch["__key__"]))
                if epoch == stop and step + 1 == 3:
                    return seen
        return seen

    reference = run(CachedIterableDataset(url, config=settings, seed=3), range(3))
    first = CachedIterableDataset(url, config=settings, seed=3)
    head = run(first, range(3), stop=stop)
    state = first.state_dict(samples_consumed=3 * 8, batch_size=8)
    second = CachedIterableDataset(url, config=settings, seed=3)
    second.load_state_dict(state)
    _assert_resumed_exactly(head, run(second, range(stop, 3)), reference)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # lightning 2.6 on torch 2.13's pytree
# Lightning's advice (an IterableDataset with __len__, a new checkpoint folder per resumed run) is not an error here.
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`:UserWarning")
@pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_lightning_data_module_resumes_exactly_from_the_trainers_checkpoint(tmp_path: Path, settings: Settings) -> None:
    pytest.importorskip("lightning", reason="pip install -e '.[lightning]'")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    recipe = _recipe("class CachedDataModule")
    url = _origin(tmp_path)
    seen: list[tuple[int, list[str]]] = []

    class Recording(recipe["Model"]):  # type: ignore[misc]
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            seen.append((self.current_epoch, list(batch["__key__"])))
            return super().training_step(batch, batch_idx)

    runs: list[str | None] = []

    def fit(checkpoint: str | None) -> list[tuple[int, list[str]]]:
        seen.clear()
        data = recipe["CachedDataModule"](url, batch_size=8, num_workers=2, seed=5, config=settings, decode="basic")
        trainer = L.Trainer(
            max_epochs=3,
            reload_dataloaders_every_n_epochs=1,
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
            callbacks=[ModelCheckpoint(dirpath=tmp_path / f"ckpt-{len(runs)}", every_n_train_steps=3, save_top_k=-1)],
        )
        trainer.fit(Recording(), datamodule=data, ckpt_path=checkpoint)
        runs.append(checkpoint)
        return list(seen)

    reference = fit(None)
    assert len(reference) == 24 and reference[0][0] == 0 and reference[-1][0] == 2  # 8 batches per epoch
    for step in (3, 9, 15):  # mid-epoch in each epoch
        checkpoint = next((tmp_path / "ckpt-0").glob(f"*-step={step}.ckpt"))
        _assert_resumed_exactly(reference[:step], fit(str(checkpoint)), reference)


class _Crash(Exception):
    """What kills the first run of the recipe's script mid-epoch."""


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # lightning 2.6 on torch 2.13's pytree
@pytest.mark.filterwarnings("ignore:Your `IterableDataset` has `__len__`:UserWarning")
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
@pytest.mark.filterwarnings("ignore:The number of training batches .* is smaller than the logging interval")
# A rerun writes into the folder of the run it resumes: Lightning's notice, not an error.
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
def test_lightning_recipe_script_rerun_after_a_crash_resumes_mid_epoch(
    tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The document's own ``train()``, as written, crashed mid-epoch and run again, resumes mid-epoch.

    Only the origin and the checkpoint interval are changed (a 60-sample dataset has 8 steps per
    epoch, fewer than the recipe's interval); the rest is the document's text.
    """
    pytest.importorskip("lightning", reason="pip install -e '.[lightning]'")
    from lightning.pytorch.callbacks import ModelCheckpoint

    url = _origin(tmp_path)
    recipe = _recipe("class CachedDataModule")
    recipe["ModelCheckpoint"] = lambda **kw: ModelCheckpoint(**{**kw, "every_n_train_steps": 3})
    for name, value in cache_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DATACACHE_LOCAL_DIR", str(tmp_path / "local"))
    seen: list[tuple[int, list[str]]] = []
    crash_at: list[int] = []  # the global step whose batch raises, in the run that crashes

    class Recording(recipe["Model"]):  # type: ignore[misc]
        def training_step(self, batch: dict[str, Any], batch_idx: int) -> Any:
            if crash_at and self.global_step == crash_at[0]:
                raise _Crash
            seen.append((self.current_epoch, list(batch["__key__"])))
            return super().training_step(batch, batch_idx)

    recipe["Model"] = Recording
    data_module = recipe["CachedDataModule"]
    recipe["CachedDataModule"] = lambda _doc_url, **kwargs: data_module(url, **kwargs)
    train = recipe["train"]  # looks the names above up in the recipe's namespace, so it runs with them

    reference = _in(tmp_path / "reference", monkeypatch, train, seen)
    assert len(reference) == 16 and reference[-1][0] == 1  # 2 epochs of 8 steps
    crash_at.append(11)  # steps 9, 10 and 11 are in epoch 1; the last checkpoint is step 9's
    with pytest.raises(_Crash):
        _in(tmp_path / "crashed", monkeypatch, train, seen)
    assert seen == reference[:11]
    crash_at.clear()
    resumed = _in(tmp_path / "crashed", monkeypatch, train, seen)  # the rerun, in the same folder
    assert resumed and resumed[0][0] == 1 and len(resumed) == 16 - 9, "the rerun did not resume from step 9"
    _assert_resumed_exactly(reference[:9], resumed, reference)


def _in(
    folder: Path, monkeypatch: pytest.MonkeyPatch, train: Any, seen: list[tuple[int, list[str]]]
) -> list[tuple[int, list[str]]]:
    """The batches ``train()`` trains on (recorded into ``seen``), run in ``folder``, where it writes runs/."""
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    seen.clear()
    train()
    return list(seen)


def test_hugging_face_trainer_resumes_exactly_from_its_checkpoint_folders(tmp_path: Path, settings: Settings) -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[hf]'")
    recipe = _recipe("class CachedTrainer")
    from transformers import TrainingArguments

    url = _origin(tmp_path)
    seen: list[tuple[int, list[str]]] = []

    def fit(checkpoint: str | None) -> list[tuple[int, list[str]]]:
        seen.clear()
        dataset = CachedIterableDataset(url, config=settings, batch_size=8, seed=5, decode="basic")
        if checkpoint is not None:
            recipe["resume_loader"](dataset, checkpoint)

        class Recording(recipe["Model"]):  # type: ignore[misc]
            def forward(self, cls: Any, **fields: Any) -> Any:
                seen.append((dataset.epoch, list(fields["__key__"])))
                return super().forward(cls, **fields)

        args = TrainingArguments(
            str(tmp_path / "runs"),
            num_train_epochs=3,
            save_steps=3,
            ignore_data_skip=True,
            dataloader_num_workers=2,
            use_cpu=True,
            report_to="none",
            logging_strategy="no",
            disable_tqdm=True,
        )
        trainer = recipe["CachedTrainer"](
            model=Recording(), args=args, train_dataset=dataset, callbacks=[recipe["LoaderPosition"](dataset)]
        )
        trainer.train(resume_from_checkpoint=checkpoint)
        return list(seen)

    reference = fit(None)
    assert len(reference) == 24 and reference[0][0] == 0 and reference[-1][0] == 2  # 8 batches per epoch
    for step in (3, 9, 15):  # mid-epoch in each epoch
        _assert_resumed_exactly(reference[:step], fit(str(tmp_path / "runs" / f"checkpoint-{step}")), reference)
