"""The wrappers around private names of the standard library and torch (one place each).

Each wraps a name its owner does not publish; these tests fail here, with the name, when an
upgrade moves it, instead of in a user's training run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from datacache.loaders.dataloader import pin_batch


def test_a_hook_registered_before_the_thread_pools_stop_may_still_use_one() -> None:
    # atexit runs after concurrent.futures refused new work: the copy being made durable there
    # could only be cancelled. The hook the wrapper registers runs first, so it still can.
    script = textwrap.dedent(
        """
        import atexit, concurrent.futures
        from datacache._sync import before_thread_pools_stop
        pool = concurrent.futures.ThreadPoolExecutor(1)
        def finish(label):
            try:
                print(label, pool.submit(lambda: "done").result(), flush=True)
            except RuntimeError as exc:
                print(label, "refused", flush=True)
        atexit.register(finish, "atexit")
        print("registered", before_thread_pools_stop(lambda: finish("hook")), flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.split("\n")[:3] == ["registered True", "hook done", "atexit refused"], run.stdout


def test_pin_batch_is_torchs_pinning_of_a_batch() -> None:
    from torch.utils.data._utils import pin_memory

    batch = {"__key__": ["a", "b"], "bin": [b"xy", b"z"]}
    assert pin_batch(batch, "cpu") == batch  # raw samples have no tensor to pin: the batch as it was
    assert pin_memory.pin_memory is not None
    if torch.accelerator.is_available():  # pragma: no cover - on a machine with an accelerator
        pinned = pin_batch({"x": torch.zeros(4)}, torch.accelerator.current_accelerator().type)
        assert pinned["x"].is_pinned()



def test_gcsfs_request_without_its_retry_decorator_is_still_reachable() -> None:
    # tiers/_gcs.py calls gcsfs's request undecorated (its own retries off, the tier's policy on).
    core = pytest.importorskip("gcsfs.core")
    from datacache.tiers._gcs import OneTryGCSFileSystem
    from gcsfs.retry import is_retriable

    request = core.GCSFileSystem._request
    assert callable(getattr(request, "__wrapped__", None)), "gcsfs.core.GCSFileSystem._request lost __wrapped__"
    assert callable(is_retriable)
    assert issubclass(OneTryGCSFileSystem, core.GCSFileSystem)
