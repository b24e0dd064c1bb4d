"""Byte sizes and bandwidths as people write them ("256MB", "1.5GiB", "1GB/s")."""

from __future__ import annotations

import math
import re

from datacache.errors import ConfigError

__all__ = ["format_bytes", "format_rate", "parse_bandwidth", "parse_size", "unit_hint"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "p": 10**15,
    "pb": 10**15,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, *, what: str = "size", _per: str = "") -> int:
    """Return a byte count from ``value``: an int, or a string such as ``"256MB"``.

    Decimal units (kB, MB, GB, TB) are powers of 1000 and binary units (KiB,
    MiB, GiB, TiB) powers of 1024, as disks and S3 consoles report them.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size such as '256MB', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(f"{what}: expected a size such as '256MB', got {value!r}")
        if value < 0:
            raise ConfigError(f"{what}: must not be negative, got {value!r}")
        return int(value)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a size such as '256MB', got {value!r}")
    match = _SIZE.match(value)
    if match is None and value.strip().startswith("-") and _SIZE.match(value.strip()[1:]):
        raise ConfigError(f"{what}: must not be negative, got {value.strip()!r}")
    if match is None:
        raise ConfigError(f"{what}: expected a size such as '256MB' or '1.5GiB', got {value!r}")
    number, unit = match.groups()
    if not unit and float(number) != 0:
        # A size or rate written as text says its unit, wherever it is given (a flag, a variable,
        # the config file): a bare "500" is refused, not taken as 500 bytes (or bytes/s); an int is.
        raise ConfigError(f"{what}: {value.strip()!r} has no unit; write it with one{unit_hint(number, _per)}")
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"{what}: unknown unit {unit!r} in {value!r} (use kB, MB, GB, TB or KiB, MiB, GiB, TiB)")
    size = float(number) * factor
    if not math.isfinite(size):
        raise ConfigError(f"{what}: {value!r} is too large")
    return int(size)


_BYTES_LIKELY = 10**6
"""A bare whole number from here up most likely counts bytes (a cache or a rate of a few kB is no one's aim)."""
_DECIMAL = (("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3))
_BINARY = (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _rounded_bytes(count: int) -> str:
    """``count`` bytes in the unit that reads best: exact where a unit divides it, else 3 significant digits."""
    for units in (_DECIMAL, _BINARY):
        for unit, factor in units:
            if count % factor == 0 and count // factor < 1000:
                return f"{count // factor}{unit}"
    for unit, factor in _DECIMAL:
        if count >= factor:
            return f"{count / factor:.3g}{unit}"
    return f"{count}B"  # pragma: no cover - below _BYTES_LIKELY, never asked


def unit_hint(number: str, per: str = "") -> str:
    """What to write for a size (or, with ``per="/s"``, a rate) given as the bare ``number``.

    A large whole number is most likely a count of bytes, so it is suggested as that count rounded
    to a unit (``12000000`` -> ``'12MB'``), not multiplied by one (``'12000000GB'``, 12 PB). A small
    one or a fraction is most likely in a unit left out (``500`` -> ``'500GB'``).
    """
    value = float(number)
    if value.is_integer() and value >= _BYTES_LIKELY:
        count = int(value)
        rounded = _rounded_bytes(count)
        exact = "" if parse_size(rounded) == count else f", or exactly '{count}B{per}'"
        return f": '{rounded}{per}' if it counts bytes{' per second' if per else ''} ({count:,}{exact})"
    example = "MB" if per else "GB"
    return f", e.g. '{number}{example}{per}' (or '{number}B{per}' for bytes)"


def parse_bandwidth(value: str | int | float, *, what: str = "bandwidth") -> float:
    """Return bytes per second from ``value``: a number, or a size per second such as ``"1GB/s"``.

    A string is a size with its unit and ``/s`` (or ``ps``: ``"200MBps"``); ``"0"`` (no cap)
    needs neither. A size without ``/s`` (``"1GB"``) is refused, as is a bare ``"10"``: a rate
    is never guessed. A number is bytes per second. Errors name ``what`` (the flag, setting or
    parameter) and the value.
    """
    if isinstance(value, str):
        text = value.strip()
        per_second = text.lower().endswith(("/s", "ps"))
        amount = text[:-2] if per_second else text
        if amount.startswith("-"):
            raise ConfigError(f"{what}: must not be negative, got {text!r}")
        size = _SIZE.match(amount)
        if size is None:
            raise ConfigError(f"{what}: expected a rate such as '1GB/s' or '200MB/s', got {value!r}")
        if size.group(2) and not per_second:
            raise ConfigError(f"{what}: {text!r} is a size, not a rate; write it per second: '{text}/s'")
        return float(parse_size(amount, what=what, _per="/s"))
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what}: expected a rate such as '1GB/s', got {value!r}")
    return float(value)


def format_bytes(n: float) -> str:
    """Format a byte count with a decimal unit, e.g. ``1.23 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def format_rate(bytes_per_second: float) -> str:
    """Format a bandwidth, e.g. ``480.1 MB/s``."""
    return f"{bytes_per_second / 1e6:.1f} MB/s"
