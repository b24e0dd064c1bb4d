"""Decoding and transforming samples: built-in decoders by field, and the user's callables.

A sample is a dict of raw fields (``__key__``, ``__url__``, then ``jpg``, ``cls``,
...). ``decode=`` turns fields into values: a built-in set named by a string
(`DECODERS`), a mapping of field name to callable, or one callable taking the
whole sample. ``transform=`` then runs on each decoded sample. Both run in the
process that reads (the DataLoader worker). An exception raised by either
becomes a `SampleDecodeError` that names the dataset, shard, sample key and the
field or callable, so that ``on_error="skip"`` can skip that sample.
"""

from __future__ import annotations

import importlib.util
import io
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from datacache.errors import ConfigError, SampleDecodeError, close_match

__all__ = [
    "DECODERS",
    "IMAGE_FIELDS",
    "Compose",
    "Decoder",
    "FieldDecoders",
    "SampleDecoding",
    "basic_decoders",
    "check_decoder",
    "check_transform",
    "field_decoders",
]

Decoder = Callable[[dict[str, Any]], Any] | Mapping[str, Callable[[Any], Any]] | str
"""What ``decode=`` takes: ``"auto"``, a name from `DECODERS`, a mapping of field to callable, or a callable."""

IMAGE_FIELDS = ("jpg", "jpeg", "png", "webp")
"""Fields the image decoders decode (by the last dot-separated part of the field name)."""

DECODERS = {
    "basic": "txt/text as str, cls/cls2/index as int, json as parsed JSON, npy as numpy arrays",
    "pil": "basic, and jpg/jpeg/png/webp as PIL images (needs datacache[image])",
    "numpy": "basic, and images as uint8 numpy arrays, height x width x 3 (RGB; needs datacache[image])",
    "torch": "basic, and images as uint8 tensors, 3 x height x width (RGB): torchvision's decode_image when "
    "torchvision is installed, else Pillow (datacache[image])",
}
"""The built-in decoders ``decode=`` accepts by name, and what each gives."""

_IMAGE_EXTRA = "pip install 'datacache[image]'"


def _text(data: bytes) -> str:
    return data.decode("utf-8")


def _integer(data: bytes) -> int:
    return int(data.decode("ascii").strip())


def _json(data: bytes) -> Any:
    return json.loads(data)


def _npy(data: bytes) -> Any:
    import numpy as np

    return np.load(io.BytesIO(data), allow_pickle=False)


def _pil(data: bytes) -> Any:
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()  # decode now, inside the decoder, so that a bad image fails here and is named
    return image


def _numpy_rgb(data: bytes) -> Any:
    import numpy as np

    return np.asarray(_pil(data).convert("RGB"))


def _torch_rgb(data: bytes) -> Any:
    import torch

    if _has_torchvision():
        from torchvision.io import ImageReadMode, decode_image

        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return decode_image(encoded, mode=ImageReadMode.RGB)
    return torch.from_numpy(_numpy_rgb(data).copy()).permute(2, 0, 1).contiguous()


def _has_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # torchvision built for another torch fails in many ways at import
        return False
    return True


def basic_decoders() -> dict[str, Callable[[Any], Any]]:
    """Decoders by field name: ``txt``/``text``, ``cls``/``index``, ``json``, ``npy``.

    Pass the result as ``decode=`` (or ``decode="basic"``), or add your own to it.
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


_IMAGE_DECODERS: dict[str, Callable[[bytes], Any]] = {"pil": _pil, "numpy": _numpy_rgb, "torch": _torch_rgb}


@dataclass(frozen=True)
class FieldDecoders(Mapping[str, Callable[[Any], Any]]):
    """A built-in decoder set: a field is matched by the last dot-separated part of its name.

    ``seg.png`` is decoded as ``png``, ``JPG`` as ``jpg``. Holds only its name, so it pickles.
    """

    name: str

    def _table(self) -> dict[str, Callable[[Any], Any]]:
        table = basic_decoders()
        image = _IMAGE_DECODERS.get(self.name)
        if image is not None:
            table.update(dict.fromkeys(IMAGE_FIELDS, image))
        return table

    def __getitem__(self, field: str) -> Callable[[Any], Any]:
        table = self._table()
        decoder = table.get(field) or table.get(field.rsplit(".", 1)[-1].lower())
        if decoder is None or field.startswith("__"):
            raise KeyError(field)
        return decoder

    def __iter__(self) -> Iterator[str]:
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


def field_decoders(name: str) -> FieldDecoders:
    """The built-in decoder set ``name`` (see `DECODERS`); a clear error if it is unknown or needs a missing extra."""
    if name not in DECODERS:
        close = close_match(name, ["auto", *DECODERS])
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ConfigError(f"unknown decoder {name!r}{hint}: use one of {', '.join(map(repr, DECODERS))}, or a callable")
    pillow = importlib.util.find_spec("PIL") is not None
    if name in _IMAGE_DECODERS and not pillow and not (name == "torch" and _has_torchvision()):
        raise ConfigError(f"decode={name!r} decodes images with Pillow, which is not installed: {_IMAGE_EXTRA}")
    return FieldDecoders(name)


def check_decoder(decode: Decoder | None) -> Decoder:
    """``decode=`` as given, validated (None means ``"auto"``: raw bytes)."""
    if decode is None:
        return "auto"
    if isinstance(decode, str):
        if decode != "auto":
            field_decoders(decode)
        return decode
    if callable(decode) or isinstance(decode, Mapping):
        return decode
    raise ConfigError(
        f"decode must be 'auto', None, one of {', '.join(map(repr, DECODERS))}, a callable, "
        "or a mapping of field name to callable"
    )


@dataclass(frozen=True)
class Compose:
    """Callables applied in order (what ``ds.map(f)`` builds); picklable when they are."""

    functions: tuple[Callable[[Any], Any], ...]

    def __call__(self, value: Any) -> Any:
        for function in self.functions:
            try:
                value = function(value)
            except Exception as exc:
                raise _StepFailed(function, exc) from exc
        return value

    @classmethod
    def of(cls, first: Callable[[Any], Any] | None, then: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``then`` after ``first`` (flattened, so that the failing step is named)."""
        if first is None:
            return then
        head = first.functions if isinstance(first, Compose) else (first,)
        return cls((*head, then))


def check_transform(transform: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    if transform is not None and not callable(transform):
        raise ConfigError(f"transform must be a callable taking one sample, got {type(transform).__name__}")
    return transform


class SampleDecoding:
    """Applies a dataset's decoder, then its transform, to one sample; names the sample in any failure.

    A sample's ``__url__`` is its reader's to give (`reading.batching.name_sample`), before decoding:
    a dataset without decoder or transform (`raw`) calls nothing here per sample.
    """

    def __init__(self, decode: Decoder, transform: Callable[[Any], Any] | None) -> None:
        self._decode: Mapping[str, Callable[[Any], Any]] | Callable[[dict[str, Any]], Any] | None
        if isinstance(decode, str):
            self._decode = None if decode == "auto" else field_decoders(decode)
        else:
            self._decode = decode
        self._transform = transform
        self.raw = self._decode is None and transform is None
        """Whether samples pass unchanged (raw bytes: batch mode may pack them)."""

    def apply(self, sample: dict[str, Any], where: str) -> Any:
        """The decoded, transformed sample; raises `SampleDecodeError` naming where it failed."""
        decode = self._decode
        if isinstance(decode, Mapping):
            sample = {k: (_call(decode[k], v, sample, where, k) if k in decode else v) for k, v in sample.items()}
        elif decode is not None:
            decoded = _call(decode, sample, sample, where, None)
            if isinstance(decoded, dict) and decoded is not sample:
                # A custom decoder keeps the sample's identity (what webdataset's decoders keep).
                for name in ("__key__", "__url__"):
                    if name in sample:
                        decoded.setdefault(name, sample[name])
            sample = decoded
        if self._transform is None:
            return sample
        return _call(self._transform, sample, sample, where, None, role="transform")


def _call(
    function: Callable[[Any], Any],
    value: Any,
    sample: Mapping[str, Any],
    where: str,
    name: str | None,
    role: str = "decoder",
) -> Any:
    """``function(value)``; its exception becomes one that says where it happened."""
    try:
        return function(value)
    except Exception as exc:
        failing: Any = function
        if isinstance(exc, _StepFailed):
            failing, exc = exc.step, exc.error
        what = f"field {name!r}" if name is not None else f"{role} {getattr(failing, '__name__', failing)!r}"
        key = sample.get("__key__")
        raise SampleDecodeError(f"{where}: sample {key!r}: {what} raised {type(exc).__name__}: {exc}") from exc


class _StepFailed(Exception):
    """A step of a `Compose` failed: carries which one, so that the error names it."""

    def __init__(self, step: Callable[[Any], Any], error: Exception) -> None:
        super().__init__(str(error))
        self.step = step
        self.error = error
