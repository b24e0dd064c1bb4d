"""A keyed bijection over ``[0, n)``: the order of samples inside a window, computed, never stored.

A balanced Feistel network over the smallest even number of bits that holds
``n``, with cycle walking (a value that lands outside ``[0, n)`` is permuted
again until it lands inside), is a permutation of ``[0, n)`` for every key and
every ``n``, including 1 and primes. It needs no memory, costs a few integer
operations per position (vectorised over numpy arrays, one key per element, so
one call spans many windows), and `unpermute` inverts it exactly.

Pure arithmetic (numpy, no I/O, no torch).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["mix_key", "permute", "unpermute"]

U64 = npt.NDArray[np.uint64]
IntArray = npt.NDArray[np.int64]

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(x: U64) -> U64:
    """splitmix64's finaliser: a cheap, well-mixed hash of 64-bit words (wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def mix_key(*parts: int | IntArray) -> U64:
    """One 64-bit key per element from integers (scalars or arrays broadcast together)."""
    key = np.zeros((), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for part in parts:
            word = (
                np.asarray(part).astype(np.int64).view(np.uint64)
                if np.ndim(part)
                else np.uint64(int(part) & (2**64 - 1))
            )
            key = _splitmix(key * _GOLDEN + word + _GOLDEN)
    return np.asarray(key, dtype=np.uint64)


def _half_bits(n: IntArray) -> IntArray:
    """Bits of each half of the Feistel domain for ``n`` positions: the smallest ``h`` with ``4**h >= n``."""
    bits = np.ceil(np.log2(np.maximum(n, 2).astype(np.float64))).astype(np.int64)
    # float rounding can only err for huge n; correct it exactly
    bits = np.where((np.int64(1) << np.maximum(bits - 1, 0)) >= n, bits - 1, bits)
    bits = np.where((np.int64(1) << bits) < n, bits + 1, bits)
    return np.maximum((bits + 1) // 2, 1)


def _round(right: U64, key: U64, number: int, mask: U64) -> U64:
    with np.errstate(over="ignore"):
        return _splitmix(right ^ (key + np.uint64(number) * _GOLDEN)) & mask


def _forward(x: U64, key: U64, half: U64, mask: U64) -> U64:
    left, right = x >> half, x & mask
    for number in range(_ROUNDS):
        left, right = right, left ^ _round(right, key, number, mask)
    return (left << half) | right


def _backward(x: U64, key: U64, half: U64, mask: U64) -> U64:
    left, right = x >> half, x & mask
    for number in reversed(range(_ROUNDS)):
        left, right = right ^ _round(left, key, number, mask), left
    return (left << half) | right


def _walk(values: IntArray, n: IntArray, key: U64, *, inverse: bool) -> IntArray:
    values = np.asarray(values, dtype=np.int64)
    n = np.broadcast_to(np.asarray(n, dtype=np.int64), values.shape)
    key = np.broadcast_to(np.asarray(key, dtype=np.uint64), values.shape)
    if np.any((values < 0) | (values >= n)):
        raise ValueError("a position is outside [0, n)")
    half_bits = _half_bits(n)
    half = half_bits.astype(np.uint64)
    mask = ((np.uint64(1) << half) - np.uint64(1)).astype(np.uint64)
    step = _backward if inverse else _forward
    out = values.astype(np.uint64)
    todo = np.nonzero(n > 1)[0]
    while len(todo):
        out[todo] = step(out[todo], key[todo], half[todo], mask[todo])
        # Cycle walking: the domain holds at most 4n values, so few positions go round again.
        todo = todo[out[todo] >= n[todo].astype(np.uint64)]
    return out.astype(np.int64)


def permute(values: IntArray, n: int | IntArray, key: int | U64) -> IntArray:
    """Where each position of ``values`` goes under the bijection of ``[0, n)`` keyed by ``key``.

    ``n`` and ``key`` are scalars or arrays of ``values``'s shape (one window per element).
    """
    return _walk(values, np.asarray(n), np.asarray(key, dtype=np.uint64), inverse=False)


def unpermute(values: IntArray, n: int | IntArray, key: int | U64) -> IntArray:
    """The inverse of `order.permute`: ``unpermute(permute(x, n, k), n, k) == x``."""
    return _walk(values, np.asarray(n), np.asarray(key, dtype=np.uint64), inverse=True)
