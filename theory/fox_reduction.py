"""FoX as the special case of FPA (F6), its gradients, and "the sum becomes a maximum"."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import fpa

from .registry import CheckResult, check, relative_error, verdict


def _fox_inputs(
    seed: int, unit_gates: float
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, 2, 3, 24, 8))
    v = rng.standard_normal((2, 3, 24, 5))
    log_f = -rng.exponential(0.5, size=(2, 3, 24))
    log_f[rng.random(log_f.shape) < unit_gates] = 0.0  # gates f = 1 create ties in (F1)
    return q, k, v, log_f


@check("F6")
def fox_reduction(
    *,
    fox_attention: Callable[..., NDArray[np.float64]] = fpa.fox_attention,
    fox_attention_direct: Callable[..., NDArray[np.float64]] = fpa.fox_attention_direct,
) -> CheckResult:
    worst = 0.0
    for seed, unit in [(0, 0.0), (1, 0.3), (2, 1.0)]:
        q, k, v, log_f = _fox_inputs(seed, unit)
        worst = max(
            worst,
            relative_error(fox_attention(q, k, v, log_f), fox_attention_direct(q, k, v, log_f)),
        )
    return verdict(
        "F6",
        "FoX = FPA with field = level = cumsum(log f)",
        "FoX from its own formula s<q,k> + sum_{l=j+1..i} log f_l; 3 seeds, gates f = 1 included",
        worst,
        1e-12,
    )


@check("F6-grad")
def fox_gradients(
    *,
    fpa_attention_vjp: Callable[..., fpa.FPAGrads] = fpa.fpa_attention_vjp,
    fox_attention_vjp: Callable[..., fpa.FoXGrads] = fpa.fox_attention_vjp,
) -> CheckResult:
    worst = 0.0
    for seed, unit in [(3, 0.0), (4, 0.5), (5, 1.0)]:
        q, k, v, log_f = _fox_inputs(seed, unit)
        d_out = np.random.default_rng(seed).standard_normal(v.shape)
        c = np.cumsum(log_f, axis=-1)
        g = fpa_attention_vjp(q, k, v, c, c, d_out)
        dlog_f = np.cumsum((g.dfield + g.dlevel)[..., ::-1], axis=-1)[..., ::-1]  # cumsum adjoint
        ref = fox_attention_vjp(q, k, v, log_f, d_out)
        for got, want in [(g.dq, ref.dq), (g.dk, ref.dk), (g.dv, ref.dv), (dlog_f, ref.dlog_f)]:
            worst = max(worst, relative_error(got, want))
    return verdict(
        "F6-grad",
        "FPA gradients through (F6) equal FoX gradients, also with ties (gates f = 1)",
        "FoX backward from its own formula dL/dlog f_l = sum_{j<l<=i} G_ij",
        worst,
        1e-12,
    )


@check("F2-max")
def sum_becomes_max(
    *, descent_depth: Callable[..., NDArray[np.float64]] = fpa.descent_depth
) -> CheckResult:
    rng = np.random.default_rng(6)
    T = 20
    worst = 0.0
    for _ in range(5):
        field = np.cumsum(rng.standard_normal(T))
        offset = rng.standard_normal(T)
        pi = descent_depth(field, field + offset)
        d = np.concatenate([[0.0], field[:-1] - field[1:]])  # decrements d_t = phi_{t-1} - phi_t
        for i in range(T):
            for j in range(i):
                partial = np.cumsum(d[j + 1 : i + 1])  # sum_{u in (j, t]} d_u for t in (j, i]
                want = max(0.0, offset[j] + partial.max())
                worst = max(worst, abs(pi[i, j] - want))
    return verdict(
        "F2-max",
        "FPA's penalty is the largest partial sum of decrements (plus the key offset); "
        "FoX's is the total",
        "loop over (i, j) of max_{t in (j,i]} sum_{u in (j,t]} d_u",
        worst,
        1e-12,
    )
