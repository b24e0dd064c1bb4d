"""Decoders for common WebDataset field types; any plain callable works as well."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

__all__ = ["basic_decoders"]


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _integer(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _json(data: bytes) -> Any:
    return json.loads(data)


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def basic_decoders() -> dict[str, Callable[[Any], Any]]:
    """Decoders by field name: ``txt``/``text``, ``cls``/``index``, ``json``, ``npy``.

    Pass the result as ``decode=`` (add your own image decoder to it, e.g. with PIL).
    """
    return {
        "txt": _text,
        "text": _text,
        "cls": _integer,
        "cls2": _integer,
        "index": _integer,
        "json": _json,
        "npy": _npy,
    }
