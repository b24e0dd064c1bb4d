"""Every code block of README.md and docs/*.md that a user would copy runs here.

Blocks are found when the tests are collected, so a block someone adds is run
without touching this file. Python blocks run in a fresh interpreter, shell
blocks line by line as the user would type them, TOML blocks are loaded as the
config file. They run against the session's S3 server (moto on 127.0.0.1): the
bucket the docs call ``bucket`` exists there, filled with small datasets of the
shapes the examples name (`_fill_bucket`). Machine paths a test cannot write
(``/nvme/...``, ``/mnt/lustre/...``) are mapped into the test's directory, and
a few sizes are shrunk (`SHRINK`), each with its reason.

What cannot run here is listed in `UNRUNNABLE` with the reason, and reported as
a skipped test of its own: never dropped silently. A block in no known language
whose lines are not commands (a diagram, sample output) is reported the same way.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _helpers import REPO, wait_for
from test_loader import write_wds

from datacache.config import load_settings

if TYPE_CHECKING:
    # Only for annotations: in the whole suite, `conftest` may resolve to tests/faults/conftest.py.
    from conftest import S3Bucket

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

COMMANDS = frozenset(
    ["datacache", "make", "kubectl", "helm", "docker", "dask", "python", "pip", "sbatch", "torchrun", "install", "ray"]
)
"""First words that make a block without a language a shell block."""

UNRUNNABLE: list[tuple[str, str]] = [
    (r"^make test\b", "runs this very suite (and lint, type checks) from the top"),
    (r"^kubectl\b", "no Kubernetes cluster here; the manifests are validated offline in tests/test_deploy.py"),
    (r"^helm\b", "no Kubernetes cluster here; the chart is rendered and validated in tests/test_deploy.py"),
    (r"^docker\b", "no container engine here; the image's entrypoint is run in tests/test_deploy.py"),
    (
        r"^install -d .*-g team\b",
        "needs the cluster's group 'team'; tests/test_shared_files.py checks the same 2770 set-up with real users",
    ),
    (r"^dask (scheduler|worker)\b", "starts a Dask cluster's long-running processes on other machines"),
    (r"--scheduler tcp://head:", "needs the Dask cluster at tcp://head started by the lines above"),
    (r"^ray start\b", "starts a Ray cluster's head or a node joining it, long-running, on other machines"),
]
"""Command lines that cannot run on this machine, each with the reason."""

OPTIONAL_MODULES = {"transformers": "pip install -e '.[hf]' (left out of the dev extra: ~120 MB)"}
"""Modules a python block may import that `make test` does not install: the block is skipped without them, saying so."""

VERDICTS: list[tuple[str, set[int], str, str]] = [
    (
        r"^datacache bench\b",
        {0, 1},
        "bottleneck",
        "exits 1 when the node cannot meet the need (8 GPUs x 1 GB/s is more than a test machine gives)",
    ),
]
"""Commands whose documented exit status may be non-zero: (pattern, allowed exits, text the output holds, why)."""

RECIPES = {
    "make demo": [sys.executable, "-m", "datacache.demo"],
}
"""Make targets run as their recipe in this venv: make would first reinstall .venv when pyproject.toml changed."""

SHRINK: list[tuple[str, str, str]] = [
    ("range(90)", "range(2)", "90 epochs: two show the loop works, on 2 cores"),
    ("num_workers=8", "num_workers=2", "8 worker processes on 2 cores"),
    ("batch_size=256", "batch_size=32", "the test dataset holds 80 samples"),
    ("0.0.0.0:9464", "127.0.0.1:0", "network only to 127.0.0.1, and a fixed port collides with parallel runs"),
]
"""Sizes and addresses changed before a block runs: (text, replacement, why)."""

PATHS = {
    "/nvme/datacache": "nvme",
    "/mnt/lustre/datacache": "lustre",
    "/lustre/datacache": "lustre",
    "/mnt/lustre/wds": "lustre-wds",
    "/run/datacache/daemon.sock": "run/daemon.sock",
    "/data/raw": "data/raw",
}
"""Machine paths in the docs -> paths under the test's directory."""

PRELUDES = {
    "ds.state_dict(": textwrap.dedent(
        """\
        from torch.utils.data import DataLoader
        from datacache.loaders import CachedIterableDataset
        url, batch_size, step = "s3://bucket/imagenet-wds/", 8, 3
        ds = CachedIterableDataset(url, seed=17)
        batches = iter(DataLoader(ds, batch_size=batch_size))
        for _ in range(step):
            next(batches)
        """
    ),
}
"""What a fragment assumes the user has already written, by a text it contains (and does not define)."""

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def kind(self) -> str:
        """``python``, ``toml``, ``shell``, or ``text`` (not something to run)."""
        if self.lang in ("python", "py"):
            return "python"
        if self.lang == "toml":
            return "toml"
        if self.lang in ("sh", "bash", "shell", "console") or (not self.lang and self.commands()):
            return "shell"
        return "text"

    def commands(self) -> list[str]:
        """The block's command lines (continuations joined), or [] if a line is not a command."""
        joined = self.text.replace("\\\n", " ")
        lines = [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not lines or any(line.split()[0] not in COMMANDS for line in lines):
            return []
        return lines


def _blocks(path: Path) -> Iterator[Block]:
    lines = path.read_text().splitlines()
    index = 0
    while index < len(lines):
        match = _FENCE.match(lines[index])
        if match is None:
            index += 1
            continue
        start, indent, body = index + 1, len(match["indent"]), []
        index += 1
        while index < len(lines) and not lines[index].strip().startswith("```"):
            body.append(lines[index][indent:])
            index += 1
        yield Block(path, start, match["lang"], "\n".join(body) + "\n")
        index += 1


def _unrunnable(command: str) -> str | None:
    return next((why for pattern, why in UNRUNNABLE if re.search(pattern, command)), None)


def _missing_module(block: Block) -> str | None:
    import importlib.util

    for name in OPTIONAL_MODULES:
        imported = re.search(rf"^\s*(from|import) {name}\b", block.text, flags=re.M)
        if imported and importlib.util.find_spec(name) is None:
            return name
    return None


def _cases() -> Iterator[object]:
    for path in DOCS:
        for block in _blocks(path):
            kind = block.kind
            if kind == "text":
                reason = f"a {block.lang} block" if block.lang else "a diagram or sample output, not commands"
                yield pytest.param(block, None, id=block.name, marks=pytest.mark.skip(reason=f"not run: {reason}"))
                continue
            if kind != "shell":
                missing = _missing_module(block) if kind == "python" else None
                marks = [pytest.mark.skip(reason=f"needs {missing}: {OPTIONAL_MODULES[missing]}")] if missing else []
                yield pytest.param(block, None, id=block.name, marks=marks)
                continue
            # The block's lines run in order in one test, as a user types them; a line that cannot
            # run here is left out of it and reported as a skipped test of its own.
            commands = block.commands()
            for number, command in enumerate(commands):
                why = _unrunnable(command)
                if why:
                    skip = pytest.mark.skip(reason=f"cannot run here: {why}")
                    yield pytest.param(block, command, id=f"{block.name}#{number + 1}", marks=[skip])
            if any(_unrunnable(command) is None for command in commands):
                yield pytest.param(block, None, id=block.name)


# -- the world the examples expect ------------------------------------------------------------


def _fill_bucket(s3: S3Bucket, tmp_path: Path) -> None:
    """Bucket ``bucket`` with the datasets the examples name, and the local folders they read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    s3.client.create_bucket(Bucket="bucket")
    upload = tmp_path / "upload"
    write_wds(upload / "wds", samples=80, per_shard=20)
    for shard in sorted((upload / "wds").glob("*.tar")):
        for prefix in ("imagenet-wds", "laion-wds"):
            s3.client.put_object(Bucket="bucket", Key=f"{prefix}/{shard.name}", Body=shard.read_bytes())
    for index, label in enumerate(["cat", "dog", "cat", "dog"]):
        s3.client.put_object(Bucket="bucket", Key=f"raw/{label}/{index:04d}.jpg", Body=os.urandom(300))
        s3.client.put_object(Bucket="bucket", Key=f"raw/{label}/{index:04d}.json", Body=b"{}")
    for part in range(2):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist([{"i": part * 10 + j} for j in range(10)]), sink)
        s3.client.put_object(Bucket="bucket", Key=f"table/part-{part}.parquet", Body=sink.getvalue().to_pybytes())
    _put_zarr(s3, upload / "array.zarr")
    raw = tmp_path / "data" / "raw" / "rec"
    raw.mkdir(parents=True)
    for index in range(3):
        (raw / f"{index:04d}_img.png").write_bytes(os.urandom(200))
        (raw / f"{index:04d}_meta.json").write_bytes(b"{}")


def _put_zarr(s3: S3Bucket, path: Path) -> None:
    import numpy as np
    import zarr

    array = zarr.open_array(str(path), mode="w", shape=(40, 4), chunks=(10, 4), dtype="i4")
    array[:] = np.arange(160, dtype=np.int32).reshape(40, 4)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        key = f"array.zarr/{file.relative_to(path).as_posix()}"
        s3.client.put_object(Bucket="bucket", Key=key, Body=file.read_bytes())


def _environment(s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]) -> dict[str, str]:
    config = tmp_path / "config.toml"
    config.write_text('[datasets.imagenet]\nurl = "s3://bucket/imagenet-wds/"\n')
    (tmp_path / "run").mkdir(exist_ok=True)
    return {
        **cache_env,
        **s3.server.env(),
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_CONFIG": str(config),
        "DATACACHE_SOCKET": str(tmp_path / "run" / "daemon.sock"),
        "DATACACHE_METRICS_ADDRESS": "127.0.0.1:0",
        "PYTHONPATH": str(REPO),
        # A recipe's RayPool() starts a Ray of its own: without it, ray.init() joins the machine's
        # latest `ray start` cluster, another suite's beside this one (its moto: 'NoSuchBucket').
        "RAY_ADDRESS": "local",
    }


def _localize(text: str, tmp_path: Path) -> str:
    for machine, local in sorted(PATHS.items(), key=lambda item: -len(item[0])):
        text = text.replace(machine, str(tmp_path / local))
    for old, new, _ in SHRINK:
        text = text.replace(old, new)
    return text


# -- running them -----------------------------------------------------------------------------


@pytest.mark.parametrize(("block", "command"), list(_cases()))
def test_docs_block_runs(
    block: Block, command: str | None, s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    _fill_bucket(s3, tmp_path)
    env = _environment(s3, tmp_path, cache_env)
    if block.kind == "toml":
        path = tmp_path / "block.toml"
        path.write_text(_localize(block.text, tmp_path))
        load_settings(env, config_path=path)
    elif block.kind == "python":
        _run_python(block, env, tmp_path)
    else:
        for line in block.commands():
            if _unrunnable(line) is None:
                _run_shell(line, env, tmp_path)


def _run_python(block: Block, env: dict[str, str], tmp_path: Path) -> None:
    code = _localize(block.text, tmp_path)
    prelude = "".join(text for marker, text in PRELUDES.items() if marker in code)
    script = tmp_path / "block.py"
    script.write_text(prelude + code)
    result = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{block.name} failed:\n{result.stdout}\n{result.stderr}"


def _run_shell(command: str, env: dict[str, str], tmp_path: Path) -> None:
    argv = shlex.split(_localize(command, tmp_path), comments=True)
    argv = RECIPES.get(" ".join(argv), argv)
    if argv[0] == "datacache":
        argv = [sys.executable, "-m", "datacache.cli", *argv[1:]]
    if argv[3:4] == ["serve"] or argv[1:2] == ["serve"]:
        _run_server(argv, env, tmp_path)
        return
    if argv[3:4] == ["top"] and "--once" not in argv:
        _run_until_interrupted(argv, env, tmp_path)
        return
    result = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    allowed, marker = next(
        ((codes, mark) for pattern, codes, mark, _ in VERDICTS if re.search(pattern, command)), ({0}, "")
    )
    assert result.returncode in allowed, f"{command!r} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    assert marker in result.stdout + result.stderr, f"{command!r} did not say {marker!r}:\n{result.stdout}"


def _run_until_interrupted(argv: list[str], env: dict[str, str], tmp_path: Path) -> None:
    """A view that refreshes until stopped (``datacache top``): it must draw a frame, then end on Ctrl-C (SIGINT)."""
    log = tmp_path / "top.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: b"tier" in log.read_bytes().lower() or process.poll() is not None,
            timeout=120,
            what="a frame of top",
        )
        assert process.poll() is None, f"{argv} exited {process.returncode}:\n{log.read_text()}"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _run_server(argv: list[str], env: dict[str, str], tmp_path: Path) -> None:
    """A command that serves until stopped: it must become ready, then stop cleanly on SIGTERM."""
    socket = Path(env["DATACACHE_SOCKET"])
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: socket.exists() or process.poll() is not None, timeout=120, what="the daemon's socket")
        assert process.poll() is None, f"{argv} exited {process.returncode}:\n{log.read_text()}"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 0, log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
