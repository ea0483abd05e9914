"""First Passage Attention (FPA) and its Forgetting-Transformer special case.

The executable statement of ``docs/spec/fpa.md``; labels in comments (``# (F3)``) are the spec's.
Everything is float64; positions are 0-based: the spec's segment (j, i] is ``range(j + 1, i + 1)``.

Shapes: q, k (..., T, dk); v (..., T, dv); field, level (..., T). Any leading batch dims are allowed
and must agree exactly across arguments; nothing is broadcast. No axis may be empty but the
batch dims: an empty batch (B = 0) gives empty results of the right shape, as SDPA does.

Costs are stated per function with n = the product of the leading dims; the parallel forms hold a
few (n, T, T) float64 arrays at once (8 n T^2 bytes each), e.g. about 1.1 GB for
:func:`fpa_attention` at T = 4096.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import logsumexp

from .validation import (
    check_shape,
    empty_batch_call,
    finite_result,
    nonnegative_int,
    positive_int,
    real_array,
    scalar,
    threshold,
)

# Validation


def _check_qkv(
    q: ArrayLike, k: ArrayLike, v: ArrayLike, *, scale: float | None
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64], float]:
    q = real_array("q", q, min_ndim=2)
    *lead, T, dk = q.shape
    k = real_array("k", k, min_ndim=2)
    check_shape("k", k, (*lead, T, dk), "leading dims and T of q, then dk of q")
    v = real_array("v", v, min_ndim=2)
    if v.shape[:-1] != (*lead, T):
        raise ValueError(
            f"v: expected shape {(*lead, T)} + (dv,) (leading dims and T of q), got {v.shape}"
        )
    s = 1.0 / np.sqrt(dk) if scale is None else scalar("scale", scale)
    _check_logit_bound(q, k, s)
    return q, k, v, s


# Half the float64 maximum: headroom for the rounding of the sums in <q_i, k_j>.
LOGIT_LIMIT = float(np.finfo(np.float64).max) / 2
OUTPUT_OVERFLOW = "v: the output sum_j p_ij v_j overflows float64; rescale v"
GRADIENT_OVERFLOW = "q, k, v, d_out: the gradients overflow float64; rescale the inputs"


def _log_max_norm(x: NDArray[np.float64]) -> float:
    """log max_i ||x_i|| over the last axis, without overflowing on the squares."""
    top = np.abs(x).max()
    if top == 0:
        return -np.inf
    return float(np.log(top) + 0.5 * np.log(np.max(np.sum((x / top) ** 2, axis=-1))))


def _check_logit_bound(q: NDArray[np.float64], k: NDArray[np.float64], s: float) -> None:
    """Require |s| max ||q_i|| max ||k_j|| < LOGIT_LIMIT, which bounds every |s <q_i, k_j>| and
    its partial sums (Cauchy-Schwarz): past it the logits overflow to inf and then NaN."""
    if s == 0:
        return
    log_bound = np.log(abs(s)) + _log_max_norm(q) + _log_max_norm(k)
    if log_bound >= np.log(LOGIT_LIMIT):
        raise ValueError(
            f"q, k, scale: expected |s| max_i ||q_i|| max_j ||k_j|| < {LOGIT_LIMIT:.3g}, so "
            f"that the logits s <q_i, k_j> cannot overflow float64; got about "
            f"1e{log_bound / np.log(10):.0f}"
        )


def _check_per_token(name: str, x: ArrayLike, q: NDArray[np.float64]) -> NDArray[np.float64]:
    x = real_array(name, x, min_ndim=1)
    check_shape(name, x, q.shape[:-1], "leading dims and T of q")
    return x


def _check_fpa(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    scale: float | None,
) -> tuple[
    NDArray[np.float64],
    NDArray[np.float64],
    NDArray[np.float64],
    NDArray[np.float64],
    NDArray[np.float64],
    float,
]:
    q, k, v, s = _check_qkv(q, k, v, scale=scale)
    field = _check_per_token("field", field, q)
    level = _check_per_token("level", level, q)
    return q, k, v, field, level, s


def _check_log_f(log_f: ArrayLike, q: NDArray[np.float64]) -> NDArray[np.float64]:
    log_f = _check_per_token("log_f", log_f, q)
    if (log_f > 0).any():
        index = tuple(int(i) for i in np.argwhere(log_f > 0)[0])
        raise ValueError(
            f"log_f: expected log forget gates <= 0, got {log_f[index]:.6g} at index {index}"
        )
    # Every gate is <= 0, so the walk cumsum(log_f) of (F6) stays finite iff its end does.
    with np.errstate(over="ignore"):
        total = log_f.sum(axis=-1)
    if not np.isfinite(total).all():
        raise ValueError(
            "log_f: expected a sum along T above -1.8e308 (cumsum(log_f) is the "
            "field of (F6)), got one that overflows float64"
        )
    return log_f


# The operator, vectorised (F1)-(F5)


def _causal(T: int, window: int | None = None) -> NDArray[np.bool_]:
    """Boolean (T, T), True where j <= i (and i - j < window when a window is given, (F3w))."""
    mask = np.tril(np.ones((T, T), dtype=bool))
    if window is not None:
        mask &= np.triu(np.ones((T, T), dtype=bool), k=1 - window)  # (F3w) i - j <= W - 1
    return mask


def _check_window(window: object) -> int | None:
    """(F3w) the window: None (no window) or an integer W >= 1."""
    return None if window is None else positive_int("window", window)


def segment_min(field: ArrayLike) -> NDArray[np.float64]:
    """(F1) segment minimum m[..., i, j] = min_{j < t <= i} field[..., t].

    Args:
        field: (..., T) real.

    Returns:
        (..., T, T) float64; +inf where the segment is empty (j >= i), so m_ii = +inf.

    Cost: O(n T^2) time and memory.
    """
    field = real_array("field", field, min_ndim=1)
    T = field.shape[-1]
    i = np.arange(T)[:, None]
    j = np.arange(T)[None, :]
    # --8<-- [start:f1]
    # X[i, j] = phi_i if j < i else +inf; a running min down the rows gives min over (j, i].
    X = np.where(j < i, field[..., :, None], np.inf)  # (..., T, T)
    return np.minimum.accumulate(X, axis=-2)
    # --8<-- [end:f1]


def descent_depth(field: ArrayLike, level: ArrayLike) -> NDArray[np.float64]:
    """(F2) descent depth pi[..., i, j] = max(0, level_j - m_ij); zero on and above the diagonal.

    Args:
        field, level: (..., T) real, same shape.

    Returns:
        (..., T, T) float64, non-negative.

    Cost: O(n T^2) time and memory.
    """
    field = real_array("field", field, min_ndim=1)
    level = real_array("level", level, min_ndim=1)
    check_shape("level", level, field.shape, "same as field")
    # --8<-- [start:f2]
    m = segment_min(field)  # (..., T, T)
    return np.maximum(0.0, level[..., None, :] - m)  # (F2)
    # --8<-- [end:f2]


def _attend(
    logits: NDArray[np.float64], v: NDArray[np.float64], window: int | None = None
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    """(F4)-(F5) causal softmax of ``logits`` (..., T, T) and the weighted sum of v (..., T, dv);
    with a window W, also a_ij = -inf for i - j >= W (F3w)."""
    T = logits.shape[-1]
    # --8<-- [start:f4]
    a = np.where(_causal(T, window), logits, -np.inf)  # (F3) a_ij = -inf for j > i; (F3w)
    lse = logsumexp(a, axis=-1)  # (..., T); finite since a_ii is finite
    p = np.exp(a - lse[..., None])  # (F4)
    with np.errstate(over="ignore", invalid="ignore"):
        o = p @ v  # (F5) (..., T, dv)
    # --8<-- [end:f4]
    return p, lse, finite_result(o, OUTPUT_OVERFLOW)


@overload
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[False] = False,
) -> NDArray[np.float64]: ...
@overload
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[True],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]: ...
@overload
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]: ...
def fpa_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]:
    """First Passage Attention, (F1)-(F5).

    Args:
        q, k: (..., T, dk) queries and keys, real floating (any width; computed in float64).
        v: (..., T, dv) values.
        field: (..., T) the scalar field phi.
        level: (..., T) the key levels l.
        scale: softmax scale s, a real number; default 1/sqrt(dk).
        window: None, or the window W >= 1 of (F3w): query i sees keys i-W+1..i only.
        return_lse: also return lse (..., T) of (F4).

    Returns:
        o (..., T, dv) float64, or (o, lse) when ``return_lse``.

    Cost: O(n T^2 (dk + dv)) time, O(n T^2) memory (a few (T, T) float64 arrays per sequence:
    1.1 GB peak at n = 1, T = 4096).

    Inputs whose logits could overflow float64 (|s| max ||q_i|| max ||k_j|| >= 9e307) are a
    ValueError, not NaN.
    """
    empty = empty_batch_call(
        fpa_attention,
        dict(q=q, k=k, v=v, field=field, level=level),
        dict(q=2, k=2, v=2, field=1, level=1),
        scale=scale,
        window=window,
        return_lse=return_lse,
    )
    if empty is not None:  # B = 0
        return empty
    q, k, v, field, level, s = _check_fpa(q, k, v, field, level, scale)
    window = _check_window(window)
    # --8<-- [start:f3]
    pi = descent_depth(field, level)  # (F2) (..., T, T)
    logits = s * (q @ np.swapaxes(k, -1, -2)) - pi  # (F3)
    # --8<-- [end:f3]
    _, lse, o = _attend(logits, v, window)  # (F3w)
    return (o, lse) if return_lse else o


@overload
def fpa_attention_loops(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[False] = False,
) -> NDArray[np.float64]: ...
@overload
def fpa_attention_loops(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[True],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]: ...
@overload
def fpa_attention_loops(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]: ...
def fpa_attention_loops(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The definition read aloud: (F1)-(F5) as nested loops, one scalar at a time.

    Same contract as :func:`fpa_attention` (a window W restricts j to i-W+1..i, (F3w)). Cost:
    O(n T^3 + n T^2 (dk + dv)) time in Python loops, O(n T (dk + dv)) memory; slow, for
    checking only.
    """
    q, k, v, field, level, s = _check_fpa(q, k, v, field, level, scale)
    window = _check_window(window)
    *lead, T, _ = q.shape
    o = np.zeros((*lead, T, v.shape[-1]))
    lse = np.zeros((*lead, T))
    # --8<-- [start:loops]
    for b in np.ndindex(*lead):
        for i in range(T):
            first = 0 if window is None else max(0, i - window + 1)  # (F3w) keys i-W+1..i
            logits = np.empty(i + 1 - first)
            for j in range(first, i + 1):
                m = np.inf  # (F1) min over the half-open segment (j, i]
                for t in range(j + 1, i + 1):
                    m = min(m, field[b][t])
                depth = max(0.0, level[b][j] - m)  # (F2)
                logits[j - first] = s * float(np.dot(q[b][i], k[b][j])) - depth  # (F3)
            top = logits.max()
            lse[b][i] = top + np.log(np.sum(np.exp(logits - top)))  # (F4)
            weights = np.exp(logits - lse[b][i])
            o[b][i] = weights @ v[b][first : i + 1]  # (F5)
    # --8<-- [end:loops]
    return (o, lse) if return_lse else o


# FoX, the special case (F6)


@overload
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[False] = False,
) -> NDArray[np.float64]: ...
@overload
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[True],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]: ...
@overload
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]: ...
def fox_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Forgetting Transformer attention through (F6): FPA with field = level = cumsum(log_f).

    Args:
        q, k: (..., T, dk); v: (..., T, dv); log_f: (..., T) log forget gates, all <= 0.
        scale: default 1/sqrt(dk).
        window: None, or the window W >= 1 of (F3w) (flash-linear-attention's ``window_size``).

    Returns:
        o (..., T, dv), or (o, lse) when ``return_lse``.

    Cost: that of :func:`fpa_attention`, O(n T^2 (dk + dv)) time and O(n T^2) memory.
    """
    empty = empty_batch_call(
        fox_attention,
        dict(q=q, k=k, v=v, log_f=log_f),
        dict(q=2, k=2, v=2, log_f=1),
        fill={"log_f": 0.0},
        scale=scale,
        window=window,
        return_lse=return_lse,
    )
    if empty is not None:  # B = 0
        return empty
    q, k, v, s = _check_qkv(q, k, v, scale=scale)
    log_f = _check_log_f(log_f, q)
    # --8<-- [start:f6]
    c = np.cumsum(log_f, axis=-1)  # (F6) one walk, non-increasing
    return fpa_attention(q, k, v, c, c, scale=s, window=window, return_lse=return_lse)
    # --8<-- [end:f6]


def _fox_decay(log_f: NDArray[np.float64]) -> NDArray[np.float64]:
    """FoX decay bias D_ij = sum_{l=j+1..i} log f_l (0 for j >= i), summed term by term.

    Row i holds log f_l for l <= i; summing it from the right gives every D_ij of the row, so
    each D_ij adds exactly the gates of its segment (no difference of two long prefix sums).
    """
    # --8<-- [start:fox-decay]
    T = log_f.shape[-1]
    gates = np.where(_causal(T), log_f[..., None, :], 0.0)  # (..., T, T) [l <= i] log f_l
    from_l = np.cumsum(gates[..., ::-1], axis=-1)[..., ::-1]  # sum over l' >= l of row i
    return np.concatenate([from_l[..., 1:], np.zeros((*log_f.shape, 1))], axis=-1)  # l > j
    # --8<-- [end:fox-decay]


@overload
def fox_attention_direct(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[False] = False,
) -> NDArray[np.float64]: ...
@overload
def fox_attention_direct(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: Literal[True],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]: ...
@overload
def fox_attention_direct(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]: ...
def fox_attention_direct(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_lse: bool = False,
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.float64]]:
    """FoX written from its own formula: a_ij = s <q_i, k_j> + sum_{l=j+1..i} log f_l.

    Independent of (F1)-(F2); :func:`fox_attention` must agree with it to rounding. Same
    contract as :func:`fox_attention`. Cost: O(n T^2 (dk + dv)) time, O(n T^2) memory (0.96 GB
    peak at n = 1, T = 4096).
    """
    q, k, v, s = _check_qkv(q, k, v, scale=scale)
    log_f = _check_log_f(log_f, q)
    logits = s * (q @ np.swapaxes(k, -1, -2)) + _fox_decay(log_f)
    _, lse, o = _attend(logits, v, _check_window(window))  # (F3w)
    return (o, lse) if return_lse else o


# Gradients (G1)-(G4)


class FPAGrads(NamedTuple):
    """Input cotangents of :func:`fpa_attention`, shaped like the inputs."""

    dq: NDArray[np.float64]
    dk: NDArray[np.float64]
    dv: NDArray[np.float64]
    dfield: NDArray[np.float64]
    dlevel: NDArray[np.float64]


class FoXGrads(NamedTuple):
    """Input cotangents of FoX attention, shaped like the inputs."""

    dq: NDArray[np.float64]
    dk: NDArray[np.float64]
    dv: NDArray[np.float64]
    dlog_f: NDArray[np.float64]


def segment_argmin(field: ArrayLike) -> NDArray[np.int64]:
    """t*_ij of (G3): the LATEST t in (j, i] with field_t = m_ij; -1 where j >= i.

    Args:
        field: (..., T) real.

    Returns:
        (..., T, T) int64.

    Cost: O(n T^2) time and memory (T vectorised steps of the (T2) recursion).
    """
    field = real_array("field", field, min_ndim=1)
    T = field.shape[-1]
    m = segment_min(field)
    tstar = np.full(m.shape, -1, dtype=np.int64)
    # --8<-- [start:g3-ties]
    for i in range(1, T):
        # (T2) m_{j,i} = min(m_{j,i-1}, phi_i); "<=" sends ties to the latest position.
        newest = field[..., i, None] <= m[..., i - 1, :i]
        tstar[..., i, :i] = np.where(newest, i, tstar[..., i - 1, :i])
    # --8<-- [end:g3-ties]
    return tstar


def _logit_cotangent(
    p: NDArray[np.float64],
    o: NDArray[np.float64],
    v: NDArray[np.float64],
    d_out: NDArray[np.float64],
    d_lse: NDArray[np.float64] | None,
) -> NDArray[np.float64]:
    """G_ij = p_ij (<dO_i, v_j> - <dO_i, o_i>) (+ p_ij dLSE_i by (G4))."""
    # --8<-- [start:g4]
    delta = np.sum(d_out * o, axis=-1)  # (..., T)
    G = p * (d_out @ np.swapaxes(v, -1, -2) - delta[..., None])  # (..., T, T)
    if d_lse is not None:
        G = G + p * d_lse[..., None]  # (G4)
    # --8<-- [end:g4]
    return G


def _finite_grads(*grads: NDArray[np.float64]) -> tuple[NDArray[np.float64], ...]:
    return tuple(finite_result(g, GRADIENT_OVERFLOW) for g in grads)


def _check_cotangents(
    d_out: ArrayLike,
    d_lse: ArrayLike | None,
    o_shape: tuple[int, ...],
    lse_shape: tuple[int, ...],
) -> tuple[NDArray[np.float64], NDArray[np.float64] | None]:
    d_out = real_array("d_out", d_out, min_ndim=2)
    check_shape("d_out", d_out, o_shape, "shape of the output o")
    if d_lse is not None:
        d_lse = real_array("d_lse", d_lse, min_ndim=1)
        check_shape("d_lse", d_lse, lse_shape, "shape of lse")
    return d_out, d_lse


def fpa_attention_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    d_out: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
    d_lse: ArrayLike | None = None,
) -> FPAGrads:
    """Hand-written backward of :func:`fpa_attention`, (G1)-(G4).

    Args:
        q, k, v, field, level, scale, window: as for :func:`fpa_attention`; with a window
            the sums of (G1)-(G4) run over the pairs inside it (F3w).
        d_out: (..., T, dv) cotangent of o.
        d_lse: optional (..., T) cotangent of lse.

    Returns:
        :class:`FPAGrads` (dq, dk, dv, dfield, dlevel), float64, shaped like the inputs.

    Conventions (spec section 6): d max(0, x)/dx = 1 at x = 0, and argmin ties go to the latest t.

    Cost: O(n T^2 (dk + dv)) time, O(n T^2) memory (1.2 GB peak at n = 1, T = 4096).
    """
    arrays = dict(q=q, k=k, v=v, field=field, level=level, d_out=d_out)
    axes = dict(q=2, k=2, v=2, field=1, level=1, d_out=2)
    if d_lse is not None:
        arrays["d_lse"], axes["d_lse"] = d_lse, 1
    empty = empty_batch_call(fpa_attention_vjp, arrays, axes, scale=scale, window=window)
    if empty is not None:  # B = 0
        return empty
    q, k, v, field, level, s = _check_fpa(q, k, v, field, level, scale)
    window = _check_window(window)
    T = q.shape[-2]
    m = segment_min(field)  # (F1) (..., T, T)
    pi = np.maximum(0.0, level[..., None, :] - m)  # (F2)
    p, lse, o = _attend(s * (q @ np.swapaxes(k, -1, -2)) - pi, v, window)
    d_out, d_lse = _check_cotangents(d_out, d_lse, o.shape, lse.shape)

    # --8<-- [start:g1]
    G = _logit_cotangent(p, o, v, d_out, d_lse)  # (..., T, T)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported on return
        dq = s * G @ k  # (G1)
        dk = s * np.swapaxes(G, -1, -2) @ q
        dv = np.swapaxes(p, -1, -2) @ d_out
    # --8<-- [end:g1]

    # --8<-- [start:g2]
    strictly_lower = np.tril(np.ones((T, T), dtype=bool), k=-1) & _causal(T, window)  # (F3w)
    active = (level[..., None, :] >= m) & strictly_lower  # active_ij = [l_j >= m_ij], j < i
    W = G * active  # dL/d(l_j - m_ij) = -G_ij on active pairs
    dlevel = -W.sum(axis=-2)  # (G2)
    # --8<-- [end:g2]

    # --8<-- [start:g3]
    tstar = segment_argmin(field)  # (G3) scatter G_ij to the latest argmin of the segment
    n_seq = W[..., 0, 0].size
    rows = np.broadcast_to(np.arange(n_seq).reshape(*W.shape[:-2], 1, 1), W.shape)
    flat = np.zeros((n_seq, T))
    np.add.at(flat, (rows[active], tstar[active]), W[active])
    dfield = flat.reshape(field.shape)
    # --8<-- [end:g3]
    return FPAGrads(*_finite_grads(dq, dk, dv, dfield, dlevel))


def fox_attention_vjp(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    log_f: ArrayLike,
    d_out: ArrayLike,
    *,
    scale: float | None = None,
    window: int | None = None,
) -> FoXGrads:
    """Backward of FoX from its own formula: dL/dlog f_l = sum_{(i, j): j < l <= i} G_ij.

    An independent witness for the tie conventions: FPA gradients chained through (F6) must equal
    these exactly, also with gates f = 1 (log_f = 0).

    Args:
        q, k, v, log_f, scale, window: as for :func:`fox_attention` (F3w: G_ij = 0 outside
            the window, so its pairs add nothing).
        d_out: (..., T, dv) cotangent of o.

    Returns:
        :class:`FoXGrads` (dq, dk, dv, dlog_f), float64, shaped like the inputs.

    Cost: O(n T^2 (dk + dv)) time, O(n T^2) memory (0.96 GB peak at n = 1, T = 4096).
    """
    empty = empty_batch_call(
        fox_attention_vjp,
        dict(q=q, k=k, v=v, log_f=log_f, d_out=d_out),
        dict(q=2, k=2, v=2, log_f=1, d_out=2),
        fill={"log_f": 0.0},
        scale=scale,
        window=window,
    )
    if empty is not None:  # B = 0
        return empty
    q, k, v, s = _check_qkv(q, k, v, scale=scale)
    log_f = _check_log_f(log_f, q)
    window = _check_window(window)
    T = q.shape[-2]
    p, lse, o = _attend(s * (q @ np.swapaxes(k, -1, -2)) + _fox_decay(log_f), v, window)
    d_out, _ = _check_cotangents(d_out, None, o.shape, lse.shape)
    G = _logit_cotangent(p, o, v, d_out, None)  # (..., T, T), zero above the diagonal
    # Pairs with j < l <= i: row sums over j < l (an exclusive prefix sum along j), then the
    # column sum over i >= l.
    none_before = np.zeros((*G.shape[:-1], 1))
    before_l = np.concatenate([none_before, np.cumsum(G[..., :-1], axis=-1)], axis=-1)  # j < l
    dlog_f = np.where(_causal(T), before_l, 0.0).sum(axis=-2)  # sum over i >= l
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported on return
        dq = s * G @ k  # (G1)
        dk = s * np.swapaxes(G, -1, -2) @ q
        dv = np.swapaxes(p, -1, -2) @ d_out
    return FoXGrads(*_finite_grads(dq, dk, dv, dlog_f))


# Liveness and the stack theorem (spec section 4)


def live_keys(field: ArrayLike, level: ArrayLike) -> NDArray[np.bool_]:
    """Key j is live at query i iff j <= i and pi_ij = 0 (weak inequality l_j <= m_ij).

    Args:
        field, level: (..., T).

    Returns:
        (..., T, T) bool, live[..., i, j].

    Cost: O(n T^2) time and memory.
    """
    pi = descent_depth(field, level)
    T = pi.shape[-1]
    return (pi == 0.0) & _causal(T)


def stack_live_keys(field: ArrayLike) -> NDArray[np.bool_]:
    """(T1) the live keys when level = field, by the monotonic-stack algorithm (not the definition).

    At each step pop every key whose field value is strictly above the new value, then push the
    new key. The stack after step i is the live set L_i.

    Args:
        field: (..., T).

    Returns:
        (..., T, T) bool, live[..., i, j].

    Cost: amortised O(1) stack operations per token, O(n T^2) time and memory to write the
    (T, T) answer.
    """
    field = real_array("field", field, min_ndim=1)
    *lead, T = field.shape
    live = np.zeros((*lead, T, T), dtype=bool)
    # --8<-- [start:t1]
    for b in np.ndindex(*lead):
        stack: list[int] = []
        for i in range(T):
            while stack and field[b][stack[-1]] > field[b][i]:
                stack.pop()
            stack.append(i)
            live[b][i, stack] = True
    # --8<-- [end:t1]
    return live


# Decoding with a KV cache and eviction (F7)


class FPADecoder:
    """(F7) one head decoded token by token with a KV cache and eviction threshold theta.

    Each cache entry holds (k_j, v_j, l_j, m_j), m_j the running minimum of the field since j.
    With ``theta = inf`` nothing is evicted and the outputs equal :func:`fpa_attention`.

    Args:
        scale: the softmax scale s (a real number; no default, since dk is not known yet).
        theta: eviction threshold > 0; ``inf`` keeps every key.

    Cost per step: O(C (dk + dv)) time for a cache of C keys (C <= steps so far), O(C (dk + dv))
    memory held.
    """

    def __init__(self, *, scale: float, theta: float = np.inf) -> None:
        self.scale = scalar("scale", scale)
        self.theta = threshold("theta", theta)
        self.keys: list[NDArray[np.float64]] = []
        self.values: list[NDArray[np.float64]] = []
        self.levels: list[float] = []
        self.mins: list[float] = []
        self.positions: list[int] = []
        self.steps = 0
        self.peak_cache_size = 0

    @property
    def cache_size(self) -> int:
        return len(self.positions)

    @property
    def kept_fraction(self) -> float:
        """Peak cache size over the tokens seen so far (1.0 without eviction)."""
        return self.peak_cache_size / max(self.steps, 1)

    def step(
        self, q: ArrayLike, k: ArrayLike, v: ArrayLike, field: float, level: float
    ) -> NDArray[np.float64]:
        """Consume token t = ``self.steps`` and return its output o_t, shape (dv,).

        Args:
            q, k: (dk,) this token's query and key; v: (dv,) its value (one head, no batch).
            field, level: real numbers phi_t and l_t.
        """
        q = real_array("q", q, min_ndim=1)
        if q.ndim != 1:
            raise ValueError(f"q: expected one token's query, shape (dk,), got shape {q.shape}")
        k = real_array("k", k, min_ndim=1)
        v = real_array("v", v, min_ndim=1)
        check_shape("k", k, q.shape, "same as q: (dk,)")
        if v.ndim != 1:
            raise ValueError(f"v: expected one token's value, shape (dv,), got shape {v.shape}")
        if self.keys:
            check_shape("q", q, self.keys[0].shape, "dk of the cached keys")
            check_shape("v", v, self.values[0].shape, "dv of the cached values")
        field = scalar("field", field)
        level = scalar("level", level)
        _check_logit_bound(q, np.stack([*self.keys, k]), self.scale)

        # --8<-- [start:f7]
        kept = []
        for n in range(self.cache_size):
            self.mins[n] = min(self.mins[n], field)  # (F7) m_j <- min(m_j, phi_t)
            depth = max(0.0, self.levels[n] - self.mins[n])  # (F2)
            if not depth >= self.theta:  # evict when pi_j >= theta; by (T2) for good
                kept.append(n)
        stores: tuple[list[Any], ...] = (
            self.keys,
            self.values,
            self.levels,
            self.mins,
            self.positions,
        )
        for store in stores:
            store[:] = [store[n] for n in kept]

        self.keys.append(k)
        self.values.append(v)
        self.levels.append(level)
        self.mins.append(np.inf)  # empty segment: pi_tt = 0
        # --8<-- [end:f7]
        self.positions.append(self.steps)
        self.steps += 1
        self.peak_cache_size = max(self.peak_cache_size, self.cache_size)

        K = np.stack(self.keys)  # (n, dk)
        depth = np.maximum(0.0, np.array(self.levels) - np.array(self.mins))  # (F2)
        logits = self.scale * (K @ q) - depth  # (F3)
        weights = np.exp(logits - logsumexp(logits))  # (F4)
        with np.errstate(over="ignore", invalid="ignore"):
            o = weights @ np.stack(self.values)  # (F5)
        return finite_result(o, OUTPUT_OVERFLOW)


class DecodeResult(NamedTuple):
    """Output of :func:`fpa_decode`.

    o: (..., T, dv) outputs. cache_sizes: (..., T) cache size after each step.
    kept_fraction: peak cache size over T, averaged over the leading dims (the fraction of a
    full KV cache that must be allocated).
    """

    o: NDArray[np.float64]
    cache_sizes: NDArray[np.int64]
    kept_fraction: float


def fpa_decode(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    field: ArrayLike,
    level: ArrayLike,
    *,
    theta: float = np.inf,
    scale: float | None = None,
) -> DecodeResult:
    """(F7) streaming decode of every (batch, head) sequence with :class:`FPADecoder`.

    Same inputs as :func:`fpa_attention` plus the eviction threshold ``theta`` > 0.

    Returns:
        :class:`DecodeResult` (o (..., T, dv), cache_sizes (..., T) int64, kept_fraction).

    Cost: O(n T C (dk + dv)) time in Python steps, C the peak cache size (C = T without
    eviction: O(n T^2 (dk + dv))); O(n T dv + C (dk + dv)) memory.
    """
    q, k, v, field, level, s = _check_fpa(q, k, v, field, level, scale)
    theta = threshold("theta", theta)
    *lead, T, _ = q.shape
    o = np.zeros((*lead, T, v.shape[-1]))
    sizes = np.zeros((*lead, T), dtype=np.int64)
    peaks = []
    for b in np.ndindex(*lead):
        decoder = FPADecoder(scale=s, theta=theta)
        for t in range(T):
            o[b][t] = decoder.step(q[b][t], k[b][t], v[b][t], field[b][t], level[b][t])
            sizes[b][t] = decoder.cache_size
        peaks.append(decoder.kept_fraction)
    return DecodeResult(o, sizes, float(np.mean(peaks)))


def eviction_threshold(bound_logit: float, n_keys: int, eps: float) -> float:
    """(T3) theta = 2U + log N - log eps, with U >= s * max |<q_i, k_j>|.

    Args:
        bound_logit: U, a finite number >= 0.
        n_keys: N, the number of keys a row may attend to, an integer >= 1.
        eps: the budget, 0 < eps < 1 [decision: with eps >= 1 the bound 2 eps max ||v|| says
            nothing (two convex combinations of the values never differ by more than
            2 max ||v||), and theta could be <= 0, which no decoder accepts].

    Returns:
        theta > 0, a float. Cost: O(1).
    """
    U = scalar("bound_logit", bound_logit)
    if U < 0:
        raise ValueError(f"bound_logit: expected U >= 0 (a bound on |logits|), got {U}")
    N = positive_int("n_keys", n_keys)
    eps = scalar("eps", eps, positive=True)
    if not eps < 1:
        raise ValueError(f"eps: expected 0 < eps < 1, got {eps}")
    # --8<-- [start:t3]
    return 2.0 * U + float(np.log(N)) - float(np.log(eps))
    # --8<-- [end:t3]


# Tiled computation (spec section 7), for kernel writers


def segment_min_tiled(field: ArrayLike, block: int) -> NDArray[np.float64]:
    """(F1) assembled tile by tile, as a blocked kernel computes it; equals :func:`segment_min`.

    For a key block [j0, j1] strictly before a query block [i0, i1]:
    m_ij = min(A_j, mid, B_i), A_j = min phi over (j, j1] (suffix min inside the key block),
    mid = min phi over (j1, i0) (the gap), B_i = min phi over [i0, i] (prefix min inside the
    query block). Diagonal blocks use the direct in-block segment minimum.

    Args:
        field: (..., T); block: tile size, an integer >= 1.

    Returns:
        (..., T, T) float64, +inf where j >= i.

    Cost: O(n T^2) time in (T / block)^2 tiles, O(n T^2) memory.
    """
    field = real_array("field", field, min_ndim=1)
    block = positive_int("block", block)
    T = field.shape[-1]
    m = np.full((*field.shape, T), np.inf)
    starts = range(0, T, block)
    for i0 in starts:
        i1 = min(i0 + block, T) - 1
        rows = field[..., i0 : i1 + 1]
        B = np.minimum.accumulate(rows, axis=-1)  # min over [i0, i]
        m[..., i0 : i1 + 1, i0 : i1 + 1] = segment_min(rows)  # diagonal block
        for j0 in starts:
            j1 = min(j0 + block, T) - 1
            if j1 >= i0:
                break
            # --8<-- [start:tiled]
            cols = field[..., j0 : j1 + 1]
            # A_j = min over (j, j1]: a reversed running min, shifted by one, +inf at j = j1.
            suffix = np.minimum.accumulate(cols[..., ::-1], axis=-1)[..., ::-1]
            A = np.concatenate([suffix[..., 1:], np.full((*cols.shape[:-1], 1), np.inf)], axis=-1)
            gap = field[..., j1 + 1 : i0]
            mid = gap.min(axis=-1) if gap.shape[-1] else np.full(field.shape[:-1], np.inf)
            tile = np.minimum(np.minimum(A[..., None, :], mid[..., None, None]), B[..., :, None])
            m[..., i0 : i1 + 1, j0 : j1 + 1] = tile
            # --8<-- [end:tiled]
    return m


def tile_skippable(
    field: ArrayLike, level: ArrayLike, keys: tuple[int, int], query_start: int, theta: float
) -> bool:
    """Section 7: may the key block [j0, j1] be skipped for every query at or after i0?

    True when min_j l_j - min phi over (j1, i0] >= theta: then pi_ij >= theta for every key of
    the block and every i >= i0, and by (T2) for every later query block too.

    Args:
        field, level: (..., T); with leading dims the answer is True only if the block is
            skippable in every sequence.
        keys: (j0, j1) integers, the key block; query_start: i0, with j0 <= j1 < i0 < T.
        theta: the eviction threshold > 0.

    Returns:
        bool. Cost: O(n T) time, O(n T) memory.
    """
    field = real_array("field", field, min_ndim=1)
    level = real_array("level", level, min_ndim=1)
    check_shape("level", level, field.shape, "same as field")
    theta = threshold("theta", theta)
    if not (isinstance(keys, tuple | list) and len(keys) == 2):
        raise ValueError(f"keys: expected a pair (j0, j1), got {keys!r}")
    j0, j1 = (nonnegative_int("keys", j) for j in keys)
    i0 = nonnegative_int("query_start", query_start)
    if not j0 <= j1 < i0 <= field.shape[-1] - 1:
        raise ValueError(
            f"keys, query_start: expected j0 <= j1 < i0 < T = {field.shape[-1]}, "
            f"got {tuple(keys)}, {query_start}"
        )
    lowest_level = level[..., j0 : j1 + 1].min(axis=-1)  # per sequence
    lowest_field = field[..., j1 + 1 : i0 + 1].min(axis=-1)  # over (j1, i0]
    return bool(np.all(lowest_level - lowest_field >= theta))


# The layer (spec section 3)

FPA_PARAMETER_SCHEMA = {
    "wq": "(d, H*dk) query projection",
    "wk": "(d, H*dk) key projection",
    "wv": "(d, H*dv) value projection",
    "wo": "(H*dv, d) output projection",
    "w_delta": "(d, H) field increments delta_t = x_t w_delta + b_delta",
    "b_delta": "(H,)",
    "w_lam": "(d, H) key offsets lam_j = x_j w_lam + b_lam; levels l_j = phi_j + lam_j",
    "b_lam": "(H,)",
}


def fpa_parameter_shapes(d: int, H: int, dk: int, dv: int) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of :func:`fpa_layer` (:data:`FPA_PARAMETER_SCHEMA`) for model
    width d, H heads, key width dk and value width dv: the one table the torch and JAX layers
    take theirs from."""
    return {
        "wq": (d, H * dk),
        "wk": (d, H * dk),
        "wv": (d, H * dv),
        "wo": (H * dv, d),
        "w_delta": (d, H),
        "b_delta": (H,),
        "w_lam": (d, H),
        "b_lam": (H,),
    }


def init_fpa_params(
    d: int, H: int, dk: int, dv: int, seed: int = 0
) -> dict[str, NDArray[np.float64]]:
    """Parameters of :func:`fpa_layer` (:data:`FPA_PARAMETER_SCHEMA`), normal / sqrt(fan-in).

    d, H, dk, dv: integers >= 1. Returns float64 arrays shaped as the schema says.
    Cost: O(d H (dk + dv)) time and memory.
    """
    for name, val in dict(d=d, H=H, dk=dk, dv=dv).items():
        positive_int(name, val)
    rng = np.random.default_rng(seed)
    return {
        "wq": rng.standard_normal((d, H * dk)) / np.sqrt(d),
        "wk": rng.standard_normal((d, H * dk)) / np.sqrt(d),
        "wv": rng.standard_normal((d, H * dv)) / np.sqrt(d),
        "wo": rng.standard_normal((H * dv, d)) / np.sqrt(H * dv),
        "w_delta": rng.standard_normal((d, H)) / np.sqrt(d),
        "b_delta": np.zeros(H),
        "w_lam": rng.standard_normal((d, H)) / np.sqrt(d),
        "b_lam": np.zeros(H),
    }


def fpa_layer(
    x: ArrayLike, params: Mapping[str, ArrayLike], *, increments: str = "signed"
) -> NDArray[np.float64]:
    """Multi-head FPA layer: x (B, T, d) -> y (B, T, d).

    Per head: delta_t = x_t . w_delta + b_delta (signed; ``increments="logsigmoid"`` gives the
    FoX-initialised layer, with lam = 0 when w_lam = b_lam = 0), phi = cumsum(delta),
    lam_j = x_j . w_lam + b_lam, l_j = phi_j + lam_j [decision: levels relative to the field].

    Args:
        x: (B, T, d) hidden states (any leading dims before T).
        params: the arrays of :data:`FPA_PARAMETER_SCHEMA`; H from b_delta, dk and dv from wq, wv.

    Cost: O(B T d H (dk + dv) + B H T^2 (dk + dv)) time, O(B H T^2) memory (that of
    :func:`fpa_attention`).
    """
    empty = empty_batch_call(fpa_layer, dict(x=x), dict(x=2), params=params, increments=increments)
    if empty is not None:  # B = 0
        return empty
    x = real_array("x", x, min_ndim=3)
    missing = sorted(set(FPA_PARAMETER_SCHEMA) - set(params))
    if missing:
        raise ValueError(f"params: missing {missing}; see FPA_PARAMETER_SCHEMA")
    P = {name: real_array(f"params[{name!r}]", val) for name, val in params.items()}
    if increments not in ("signed", "logsigmoid"):
        raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
    d = x.shape[-1]
    if P["b_delta"].ndim != 1 or P["wq"].ndim != 2 or P["wv"].ndim != 2:
        raise ValueError(
            "params: expected b_delta (H,), wq (d, H*dk), wv (d, H*dv), got shapes "
            f"{P['b_delta'].shape}, {P['wq'].shape}, {P['wv'].shape}"
        )
    H = P["b_delta"].shape[0]
    dk = P["wq"].shape[1] // H
    dv = P["wv"].shape[1] // H
    for name, shape in fpa_parameter_shapes(d, H, dk, dv).items():
        check_shape(f"params[{name!r}]", P[name], shape, FPA_PARAMETER_SCHEMA[name])

    def heads(
        y: NDArray[np.float64], width: int
    ) -> NDArray[np.float64]:  # (B, T, H*width) -> (B, H, T, width)
        return np.swapaxes(y.reshape(*y.shape[:-1], H, width), -2, -3)

    delta = x @ P["w_delta"] + P["b_delta"]  # (B, T, H)
    if increments == "logsigmoid":
        delta = -np.logaddexp(0.0, -delta)
    field = np.cumsum(np.swapaxes(delta, -1, -2), axis=-1)  # (B, H, T)
    level = field + np.swapaxes(x @ P["w_lam"] + P["b_lam"], -1, -2)
    o = fpa_attention(
        heads(x @ P["wq"], dk), heads(x @ P["wk"], dk), heads(x @ P["wv"], dv), field, level
    )
    o = np.swapaxes(o, -2, -3).reshape(*x.shape[:-1], H * dv)  # concatenate heads
    return finite_result(o @ P["wo"], "x, params: the output overflows float64")
