"""(T3) safe eviction: kept fraction of the cache vs threshold, and the deviation bound."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import fpa

from .registry import CheckResult, check, verdict
from .stack import bracket_field, bracket_tokens


@dataclass(frozen=True)
class EvictionPoint:
    field_kind: str
    eps: float
    theta: float
    kept_fraction: float
    deviation: float
    bound: float


def eviction_fields(T: int = 256, seed: int = 13) -> dict[str, NDArray[np.float64]]:
    """Two field families, scaled so that descents are deep: brackets and a random walk."""
    rng = np.random.default_rng(seed)
    return {
        "brackets": 4.0 * bracket_field(bracket_tokens(rng, T)),
        "random walk": 2.0 * np.cumsum(rng.standard_normal(T)),
    }


def eviction_sweep(
    eps_values: Iterable[float] = (1e-1, 1e-2, 1e-4, 1e-8),
    *,
    fpa_decode: Callable[..., fpa.DecodeResult] = fpa.fpa_decode,
    fpa_attention: Callable[..., NDArray[np.float64]] = fpa.fpa_attention,
    T: int = 256,
) -> list[EvictionPoint]:
    """Decode with theta = 2U + log N - log eps (T3) for each eps; level = field (one walk)."""
    rng = np.random.default_rng(14)
    dk, dv = 8, 4
    q, k = rng.standard_normal((2, T, dk))
    v = rng.standard_normal((T, dv))
    s = 1.0 / np.sqrt(dk)
    U = s * np.abs(q @ k.T).max()
    points = []
    for kind, field in eviction_fields(T).items():
        full = fpa_attention(q, k, v, field, field)
        for eps in eps_values:
            theta = fpa.eviction_threshold(U, T, eps)
            res = fpa_decode(q, k, v, field, field, theta=theta)
            deviation = float(np.linalg.norm(res.o - full, axis=-1).max())
            bound = 2 * eps * float(np.linalg.norm(v, axis=-1).max())
            points.append(EvictionPoint(kind, eps, theta, res.kept_fraction, deviation, bound))
    return points


@check("T3")
def eviction_bound(*, fpa_decode: Callable[..., fpa.DecodeResult] = fpa.fpa_decode) -> CheckResult:
    points = eviction_sweep(fpa_decode=fpa_decode)
    table = [f"{'field':<12} {'eps':>7} {'theta':>7} {'kept':>6} {'deviation':>10} {'bound':>9}"]
    table += [
        f"{p.field_kind:<12} {p.eps:>7.0e} {p.theta:>7.2f} {p.kept_fraction:>6.3f} "
        f"{p.deviation:>10.2e} {p.bound:>9.2e}"
        for p in points
    ]
    worst = max(p.deviation / p.bound for p in points)
    return verdict(
        "T3",
        "evicting keys with pi >= 2U + log N - log eps moves each output by <= 2 eps max||v||",
        "streaming decode (F7) vs the parallel op on bracket and random-walk fields, T = 256; "
        "measured = worst deviation / bound",
        worst,
        1.0,
        table=table,
    )
