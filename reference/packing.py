"""Packed sequences: FlashAttention's ``cu_seqlens``, one rule for every implementation.

Sequences of different lengths are packed along the token axis of a single batch row (B = 1);
the offsets (0, t_1, ..., T) name where each one starts and ends, and every op of the spec runs
on each sequence on its own, as if it were a batch of its own. The rule, shared by the numpy,
torch, Triton, JAX and Pallas backends and their context-parallel paths (docs/decisions.md,
"Zero-length packed sequence"):

- offsets are integers, at least two, starting at 0, ending at T and never decreasing;
- a zero-length sequence is allowed and contributes nothing (no output row; an S4D state passes
  through it unchanged), as in FlashAttention's varlen functions.

:func:`packing` checks offsets against that rule and returns a :class:`Packing`, the host-side
plan the backends build their device tables from: the non-empty sequences and where they sit,
each token's sequence, and the token-to-chunk layout a chunked kernel walks. Pure Python and
NumPy; each backend converts the arrays to its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
from numpy.typing import NDArray

__all__ = ["Packing", "packing"]


@dataclass(frozen=True)
class Packing:
    """Checked offsets (0, ..., T) of packed sequences, as given (zero-length ones included)."""

    offsets: tuple[int, ...]

    @property
    def T(self) -> int:
        """The packed length."""
        return self.offsets[-1]

    @property
    def kept(self) -> tuple[int, ...]:
        """Indices of the non-empty sequences, in order."""
        return tuple(n for n, (a, b) in enumerate(pairwise(self.offsets)) if b > a)

    @property
    def has_empty(self) -> bool:
        """Whether some sequence has length zero."""
        return len(self.kept) < len(self.offsets) - 1

    @property
    def nonempty_offsets(self) -> tuple[int, ...]:
        """The offsets without the zero-length sequences: strictly increasing from 0 to T (just
        (0, 0) when T = 0)."""
        return (0, *(b for a, b in pairwise(self.offsets) if b > a)) if self.T else (0, 0)

    @property
    def bounds(self) -> tuple[tuple[int, int], ...]:
        """(start, end) of each non-empty sequence."""
        return tuple((a, b) for a, b in pairwise(self.offsets) if b > a)

    def segment_ids(self) -> NDArray[np.int64]:
        """The index (among all sequences, empty ones counted) of each token's sequence: [T]."""
        cu = np.asarray(self.offsets, dtype=np.int64)
        return np.searchsorted(cu, np.arange(self.T), side="right").astype(np.int64) - 1

    def chunks(self, size: int) -> NDArray[np.int64]:
        """The token-to-chunk layout of a kernel that walks each sequence in chunks of ``size``
        tokens, no chunk crossing a sequence border: one row (sequence, start, end) per chunk,
        in order, ``end - start <= size`` (shorter at each sequence's end). Zero-length
        sequences have no chunk."""
        if size < 1:
            raise ValueError(f"size: expected a positive chunk size, got {size}")
        rows = [
            (n, start, min(start + size, b))
            for n, (a, b) in enumerate(pairwise(self.offsets))
            for start in range(a, b, size)
        ]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def packing(
    cu_seqlens: object, T: int, *, batch: int | None = None, what: str = "offsets"
) -> Packing | None:
    """Check FlashAttention-style offsets against the rule of this module.

    Args:
        cu_seqlens: None (no packing), or a sequence or 1-D array of integers (0, ..., T);
            a framework tensor is converted by the caller (``tensor.tolist()``).
        T: the length of the token axis the offsets cover.
        batch: the batch size of the inputs, when the caller knows it: packing needs 1.
        what: how the messages name the offsets ("global offsets" for a context-parallel call,
            whose ranks all pass the offsets of the whole gathered sequence).

    Returns:
        The :class:`Packing`, or None when ``cu_seqlens`` is None.

    Raises:
        ValueError: naming ``cu_seqlens``.
    """
    if cu_seqlens is None:
        return None
    values = np.asarray(cu_seqlens)
    if values.ndim != 1 or values.size < 2:
        raise ValueError(
            f"cu_seqlens: expected a 1-D sequence of at least 2 offsets (0, ..., T), got "
            f"{cu_seqlens!r}"
        )
    if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"cu_seqlens: expected integer offsets, got {cu_seqlens!r}")
    offsets = tuple(int(x) for x in values)
    if offsets[0] != 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens: expected {what} from 0 to T = {T}, got {offsets}")
    if any(b < a for a, b in pairwise(offsets)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {offsets}")
    if batch is not None and batch != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {batch}")
    return Packing(offsets)
