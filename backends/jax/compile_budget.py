"""The JAX adapters' compilation budget (``kit`` and ``session_adapter``): shape buckets that keep
the number of compiled programs small, and a count of the programs asked for.

Shape buckets [decision]: the kit runs many small shapes and every new shape recompiles, so the
adapters zero-pad batch, T and head dims to powers of two before the jitted calls. This is
exact: the ops are causal (real rows never see padded tokens, padded cotangents are zero), padded
head dims leave every dot product unchanged, and padded value channels come out zero. Packed
sequences and decoding keep their T (static offsets; kept fractions count real tokens only).

Compilation budget [decision]: every compiled program keeps its machine code mapped (about 70
memory maps each on XLA:CPU), and a process may hold 65,530 maps, so the full kit on four dtypes
(about 1,000 programs) ended in "LLVM compilation error: Cannot allocate memory". The adapters
count the distinct programs they ask for and clear JAX's caches every ``PROGRAM_BUDGET`` of them.
"""

from __future__ import annotations

from typing import Any

import jax


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def time_bucket(T: int) -> int:
    """T padded: a power of two >= 64 up to 512, then a multiple of 512 (quadratic cost)."""
    return pow2(max(T, 64)) if T <= 512 else -(-T // 512) * 512


def small(T: int) -> bool:
    return time_bucket(T) <= 256


def rows_bucket(Z: int, T: int) -> int:
    """Batch rows padded to a power of two, at least 8 for short sequences."""
    return pow2(max(Z, 8 if small(T) else 1))


def width_bucket(d: int, T: int) -> int:
    """Head dims padded to a power of two, at least 64 for short sequences (16 otherwise)."""
    return pow2(max(d, 64 if small(T) else 16))


PROGRAM_BUDGET = 128  # distinct compiled programs between two clears of JAX's caches
programs: set[tuple[Any, ...]] = set()


def count_program(op: str, impl: str, static: Any, arrays: dict[str, jax.Array]) -> None:
    """Record the program a call compiles (or reuses); clear JAX's caches when the budget of
    distinct programs is spent, before this one compiles."""
    key = (op, impl, static, tuple((n, x.shape, x.dtype) for n, x in sorted(arrays.items())))
    if key in programs:
        return
    if len(programs) >= PROGRAM_BUDGET:
        jax.clear_caches()
        programs.clear()
    programs.add(key)
