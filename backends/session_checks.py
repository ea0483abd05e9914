"""The argument checks every decode session shares (spec/fpa.md F8 rows, F9 rollback; the
session contract of docs/conformance.md), framework-free so that the torch and JAX sessions
refuse the same calls with the same messages. Each raises a ValueError naming the argument
before a session changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnspec.reference.validation import nonnegative_int


def max_rollback(config: dict[str, object]) -> int:
    """The delay W of (F9) from a session config (default 0: plain (F7))."""
    return nonnegative_int("max_rollback", config.get("max_rollback", 0))


def selected_rows(rows: object, R: int) -> list[int]:
    """select(rows): a non-empty sequence of row indices in [0, R), repetitions allowed."""
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence | np.ndarray):
        raise ValueError(f"rows: expected a sequence of row indices, got {type(rows).__name__}")
    picked = list(rows)
    if not picked:
        raise ValueError("rows: expected at least one row index, got an empty sequence")
    for r in picked:
        if isinstance(r, bool) or not isinstance(r, int | np.integer) or not 0 <= r < R:
            raise ValueError(f"rows: expected indices in [0, {R}), got {r!r} in {picked}")
    return [int(r) for r in picked]


def rollback_args(
    row: object, n: object, R: int, delay: int, budget: Sequence[int]
) -> tuple[int, int]:
    """rollback(row, n): row in [0, R); n an integer >= 0, at most the delay W
    ("max_rollback") and at most the row's undoable tokens ``budget[row]``."""
    if isinstance(row, bool) or not isinstance(row, int | np.integer) or not 0 <= row < R:
        raise ValueError(f"row: expected a row index in [0, {R}), got {row!r}")
    n = nonnegative_int("n", n)
    if n > delay:
        raise ValueError(
            f"max_rollback: the session keeps W = {delay} tokens for rollback (F9), "
            f"asked to undo n = {n}"
        )
    if n > budget[int(row)]:
        raise ValueError(
            f"n: row {int(row)} can undo at most {budget[int(row)]} tokens now "
            f"(its tokens since the last W = {delay} were seen or undone), asked for {n}"
        )
    return int(row), n
