"""One tolerance table keyed by (dtype, quantity), with per-op overrides.

The metric is the normwise relative error ||x - ref|| / max(||ref||, tiny); the reference always
runs in float64 on the same inputs, rounded to the tested dtype first. Tolerances are never read
from the environment.
"""

from __future__ import annotations

import numpy as np

DTYPES = ("float64", "float32", "tf32", "float16", "bfloat16")
QUANTITIES = ("output", "lse", "gradient", "state")

TOLERANCES: dict[tuple[str, str], float] = {}
for _dtype, _base, _grad in [
    ("float64", 1e-12, 1e-12),
    ("float32", 1e-5, 1e-4),
    ("tf32", 5e-4, 5e-4),
    ("float16", 5e-3, 5e-3),
    ("bfloat16", 2e-2, 2e-2),
]:
    TOLERANCES.update(
        {
            (_dtype, "output"): _base,
            (_dtype, "lse"): _base,
            (_dtype, "gradient"): _grad,
            (_dtype, "state"): _base,
        }
    )

# (op, dtype, quantity) -> tolerance. The kept fraction of decoding is a count: exact.
OVERRIDES: dict[tuple[str, str, str], float] = {
    ("fpa_decode", dtype, "state"): 0.0 for dtype in DTYPES
}


def tolerance(op: str, dtype: str, quantity: str) -> float:
    """The tolerance for ``quantity`` of ``op`` at ``dtype``."""
    if (op, dtype, quantity) in OVERRIDES:
        return OVERRIDES[(op, dtype, quantity)]
    try:
        return TOLERANCES[(dtype, quantity)]
    except KeyError:
        raise ValueError(f"dtype: no tolerance for {dtype!r}; known: {list(DTYPES)}") from None


def format_table() -> str:
    """The tolerance table as printed in reports."""
    lines = [f"{'dtype':<9}" + "".join(f"{q:>10}" for q in QUANTITIES)]
    for dtype in DTYPES:
        lines.append(
            f"{dtype:<9}" + "".join(f"{TOLERANCES[(dtype, q)]:>10.0e}" for q in QUANTITIES)
        )
    shared = {(op, q, tol) for (op, _, q), tol in OVERRIDES.items()}
    for op, q, tol in sorted(shared):
        dtypes = [d for (o, d, qq), t in OVERRIDES.items() if (o, qq, t) == (op, q, tol)]
        where = "all dtypes" if len(dtypes) == len(DTYPES) else ", ".join(dtypes)
        lines.append(f"override: {op} {q} ({where}): {tol:g}")
    return "\n".join(lines)


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` and return them as float64 (what the backend receives).

    bfloat16 is rounded to nearest-even from float32; tf32 inputs are float32.
    """
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    if dtype in ("float32", "tf32"):
        return x.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x.astype(np.float32)).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
        return rounded.astype(np.uint32).view(np.float32).astype(np.float64)
    raise ValueError(f"dtype: unknown {dtype!r}; known: {list(DTYPES)}")


def wide_dtype(dtype: str) -> str:
    """The dtype of field, level, gates and SSM parameters: float32 or wider [decision]."""
    return "float64" if dtype == "float64" else "float32"
