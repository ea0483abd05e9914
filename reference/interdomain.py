"""Interdomain Attention: the HiPPO-LegS projection with U, Gamma, eta, and the S4D layer.

The executable statement of ``docs/spec/interdomain.md``; labels (``# (I3)``) are the spec's.
float64 / complex128 throughout. No axis may be empty but the batch dims (B = 0 gives empty
results of the right shape, as SDPA does). Costs are stated per function with n = the
product of the leading (batch) dims.

Ratio readouts [decision]: where a denominator of (I1), (I3) or the ratio form of (I13) is exactly
0 the ratio is undefined, and the function raises a ValueError naming the row instead of
returning inf or NaN. Denominators near 0 give large but finite outputs (the readout is then
ill-conditioned; the conformance cases keep denominators away from 0 with positive features).

Gradient convention for complex parameters: for a real loss L and complex z the returned
gradient is dL/dRe(z) + i dL/dIm(z) (the real-pair gradient packed as one complex number).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import expit

from .hippo import discrete_orthonormal_basis, legs_project, legs_project_vjp, s4d_init
from .validation import (
    ScalarT,
    check_shape,
    complex_array,
    empty_batch_call,
    finite_result,
    positive_int,
    real_array,
    scalar,
)

# Validation


def _check_fq_fk_v(
    fq: ArrayLike,
    fk: ArrayLike,
    v: ArrayLike,
    names: tuple[str, str, str] = ("fq", "fk", "v"),
) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.float64]]:
    fq = real_array(names[0], fq, min_ndim=2)
    *lead, T, R = fq.shape
    fk = real_array(names[1], fk, min_ndim=2)
    check_shape(names[1], fk, (*lead, T, R), f"leading dims and T of {names[0]}, then R = {R}")
    v = real_array(names[2], v, min_ndim=2)
    if v.shape[:-1] != (*lead, T):
        raise ValueError(
            f"{names[2]}: expected shape {(*lead, T)} + (dv,) (leading dims and T of "
            f"{names[0]}), got {v.shape}"
        )
    return fq, fk, v


def _check_readout(readout: str) -> str:
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    return readout


def _ratio(num: NDArray[np.float64], den: NDArray[np.float64], names: str) -> NDArray[np.float64]:
    """num (..., T, dv) / den (..., T) row by row; a zero denominator is a ValueError [decision]."""
    zero = den == 0
    if zero.any():
        row = tuple(int(i) for i in np.argwhere(zero)[0])
        raise ValueError(
            f"{names}: the ratio readout's denominator is 0 at row {row}, where the ratio is "
            "undefined; use features that keep it away from 0 (e.g. positive ones)"
        )
    with np.errstate(over="ignore"):
        o = num / den[..., None]
    return finite_result(o, f"{names}: the ratio readout overflows float64 (denominator near 0)")


def _finite_output(o: NDArray[ScalarT], names: str, what: str = "output") -> NDArray[ScalarT]:
    return finite_result(o, f"{names}: the {what} overflows float64; rescale the inputs")


# The idealised mechanism (I1)-(I7)


def linear_attention(fq: ArrayLike, fk: ArrayLike, v: ArrayLike) -> NDArray[np.float64]:
    """(I1) causal linear attention o_i = sum_{n<=i} (fq_i . fk_n) v_n / sum_{n<=i} fq_i . fk_n.

    Args:
        fq, fk: (..., T, R) feature maps xi(q), xi(k); v: (..., T, dv).

    Returns:
        o (..., T, dv) float64. A row whose denominator is exactly 0 is a ValueError (see the
        module docstring).

    Cost: O(n T^2 (R + dv)) time, O(n T^2) memory.
    """
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    with np.errstate(over="ignore", invalid="ignore"):
        # --8<-- [start:i1]
        scores = np.tril(fq @ np.swapaxes(fk, -1, -2))  # (..., T, T), zero above the diagonal
        num = _finite_output(scores @ v, "fq, fk, v")
    return _ratio(num, scores.sum(axis=-1), "fq, fk")  # (I1)
    # --8<-- [end:i1]


class Coefficients(NamedTuple):
    """(I2) the causal coefficients after each token: U (..., T, M, R), Gamma (..., T, M, dv),
    eta (..., T, M)."""

    U: NDArray[np.float64]
    Gamma: NDArray[np.float64]
    eta: NDArray[np.float64]


def basis_coefficients(fk: ArrayLike, v: ArrayLike, M: int) -> Coefficients:
    """(I2)/(I5) project xi(k), v and the constant 1 onto the LegS basis, causally.

    Args:
        fk: (..., T, R); v: (..., T, dv); M: number of basis functions.

    Returns:
        :class:`Coefficients`; row i is built from tokens 0..i only.

    Cost: O(n T M^2 (R + dv) + T M^3) time, O(n T M (R + dv)) memory. The T M^3 part, one expm
    per step of (I5), is paid once per (T, M) and cached (10 s at T = 2048, M = 16).
    """
    fk = real_array("fk", fk, min_ndim=2)
    v = real_array("v", v, min_ndim=2)
    *lead, T, R = fk.shape
    if v.shape[:-1] != (*lead, T):
        raise ValueError(f"v: expected shape {(*lead, T)} + (dv,) (as fk), got {v.shape}")
    M = positive_int("M", M)
    dv = v.shape[-1]
    # --8<-- [start:i2]
    # One recurrence for [xi(k), v, 1] (I5), token axis first; the 1 gives eta = e_0 (I6).
    z = np.concatenate([fk, v, np.ones((*lead, T, 1))], axis=-1)  # (..., T, R+dv+1)
    z = np.moveaxis(z, -2, 0)  # (T, ..., C)
    c = legs_project(z.reshape(T, -1), M).reshape(T, M, *lead, R + dv + 1)
    c = np.moveaxis(c, (0, 1), (-3, -2))  # (..., T, M, C)
    return Coefficients(c[..., :R], c[..., R : R + dv], c[..., R + dv])
    # --8<-- [end:i2]


def ratio_readout(fq: ArrayLike, coeffs: Coefficients) -> NDArray[np.float64]:
    """(I3) o_i = sum_m (fq_i . u_m) gamma_m / sum_m (fq_i . u_m) eta_m, row by row.

    Args:
        fq: (..., T, R); coeffs: U (..., T, M, R), Gamma (..., T, M, dv), eta (..., T, M).

    Returns:
        o (..., T, dv); a row whose denominator is exactly 0 is a ValueError.

    Cost: O(n T M (R + dv)) time, O(n T (M + dv)) memory.
    """
    fq = real_array("fq", fq, min_ndim=2)
    U = real_array("coeffs.U", coeffs.U, min_ndim=3)
    check_shape("coeffs.U", U, (*fq.shape[:-1], U.shape[-2], fq.shape[-1]), "(..., T, M, R)")
    *lead, T, M, _ = U.shape
    Gamma = real_array("coeffs.Gamma", coeffs.Gamma, min_ndim=3)
    if Gamma.shape[:-1] != (*lead, T, M):
        raise ValueError(f"coeffs.Gamma: expected {(*lead, T, M)} + (dv,), got {Gamma.shape}")
    eta = real_array("coeffs.eta", coeffs.eta, min_ndim=2)
    check_shape("coeffs.eta", eta, (*lead, T, M), "(..., T, M), as U")
    return _ratio_readout(fq, Coefficients(U, Gamma, eta), "fq, coeffs")


def _ratio_readout(
    fq: NDArray[np.float64], coeffs: Coefficients, names: str
) -> NDArray[np.float64]:
    """(I3) without validation: a = U_i fq_i, then the two sums over m and their ratio."""
    # --8<-- [start:i3]
    a = np.einsum("...tmr,...tr->...tm", coeffs.U, fq)  # (..., T, M) = U_i fq_i
    num = np.einsum("...tm,...tmd->...td", a, coeffs.Gamma)  # (I3) sum_m (fq . u_m) gamma_m
    den = np.einsum("...tm,...tm->...t", a, coeffs.eta)  # (I3) sum_m (fq . u_m) eta_m
    return _ratio(_finite_output(num, names), den, names)
    # --8<-- [end:i3]


def interdomain_legs(fq: ArrayLike, fk: ArrayLike, v: ArrayLike, M: int) -> NDArray[np.float64]:
    """Interdomain attention with the LegS basis: (I2) coefficients, (I3) ratio readout.

    Args:
        fq, fk: (..., T, R) features; v: (..., T, dv); M: basis size, an integer >= 1.

    Returns:
        o (..., T, dv) float64; a row whose denominator xi(q_i)^T u_0 is exactly 0 is a
        ValueError (see the module docstring).

    Cost: that of :func:`basis_coefficients`, O(n T M^2 (R + dv) + T M^3) time,
    O(n T M (R + dv)) memory.
    """
    empty = empty_batch_call(interdomain_legs, dict(fq=fq, fk=fk, v=v), dict(fq=2, fk=2, v=2), M=M)
    if empty is not None:  # B = 0
        return empty
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    return _ratio_readout(fq, basis_coefficients(fk, v, M), "fq, fk")


def discrete_coefficients(fk: ArrayLike, v: ArrayLike, M: int) -> Coefficients:
    """(I7) coefficients on the discrete orthonormal basis of each prefix [decision: causal].

    At position i the history 0..i is projected on G_i = discrete_orthonormal_basis(i+1,
    min(M, i+1)): U_i = G_i^T Xi / (i+1), and likewise Gamma_i, eta_i (= e_0). Columns beyond
    i+1 are zero, so the shapes match :func:`basis_coefficients`.

    Cost: O(n T^2 M (R + dv) + T^2 M^2) time (one QR per prefix), O(n T M (R + dv)) memory.
    """
    fk = real_array("fk", fk, min_ndim=2)
    v = real_array("v", v, min_ndim=2)
    *lead, T, R = fk.shape
    if v.shape[:-1] != (*lead, T):
        raise ValueError(f"v: expected shape {(*lead, T)} + (dv,) (as fk), got {v.shape}")
    M = positive_int("M", M)
    U = np.zeros((*lead, T, M, R))
    Gamma = np.zeros((*lead, T, M, v.shape[-1]))
    eta = np.zeros((*lead, T, M))
    for i in range(T):
        n = i + 1
        G = discrete_orthonormal_basis(n, min(M, n))  # (I7) (n, M_i)
        w = G.shape[1]
        U[..., i, :w, :] = np.einsum("tm,...tr->...mr", G, fk[..., :n, :]) / n
        Gamma[..., i, :w, :] = np.einsum("tm,...td->...md", G, v[..., :n, :]) / n
        eta[..., i, :w] = G.sum(axis=0) / n
    return Coefficients(U, Gamma, eta)


def interdomain_discrete(fq: ArrayLike, fk: ArrayLike, v: ArrayLike, M: int) -> NDArray[np.float64]:
    """(I3) with the discrete basis (I7); with M >= T it equals :func:`linear_attention` exactly.

    Same contract as :func:`interdomain_legs`. Cost: that of :func:`discrete_coefficients`.
    """
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    return _ratio_readout(fq, discrete_coefficients(fk, v, M), "fq, fk")


class LegsGrads(NamedTuple):
    """Input cotangents of :func:`interdomain_legs`, shaped like the inputs."""

    dfq: NDArray[np.float64]
    dfk: NDArray[np.float64]
    dv: NDArray[np.float64]


def interdomain_legs_vjp(
    fq: ArrayLike, fk: ArrayLike, v: ArrayLike, M: int, d_out: ArrayLike
) -> LegsGrads:
    """Hand-written backward of :func:`interdomain_legs`.

    With a_i = U_i fq_i, num_i = Gamma_i^T a_i, den_i = eta_i . a_i, o_i = num_i / den_i:
    dnum = dO / den, dden = -<dO, o> / den, da = Gamma dnum + eta dden, dfq = U^T da,
    dU = da fq^T, dGamma = a dnum^T, then the adjoint of the linear projection (I5).

    Args:
        fq, fk, v, M: as for :func:`interdomain_legs`; d_out: (..., T, dv) cotangent of o.

    Returns:
        :class:`LegsGrads` (dfq, dfk, dv), float64, shaped like the inputs.

    Cost: that of :func:`interdomain_legs` (forward plus one reverse scan).
    """
    empty = empty_batch_call(
        interdomain_legs_vjp,
        dict(fq=fq, fk=fk, v=v, d_out=d_out),
        dict(fq=2, fk=2, v=2, d_out=2),
        M=M,
    )
    if empty is not None:  # B = 0
        return empty
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    M = positive_int("M", M)
    T = fq.shape[-2]
    d_out = real_array("d_out", d_out, min_ndim=2)
    check_shape("d_out", d_out, v.shape, "shape of the output o")
    co = basis_coefficients(fk, v, M)
    a = np.einsum("...tmr,...tr->...tm", co.U, fq)
    den = np.einsum("...tm,...tm->...t", a, co.eta)
    o = _ratio(np.einsum("...tm,...tmd->...td", a, co.Gamma), den, "fq, fk")
    dnum = d_out / den[..., None]  # (..., T, dv)
    dden = -np.sum(d_out * o, axis=-1) / den  # (..., T)
    da = np.einsum("...tmd,...td->...tm", co.Gamma, dnum) + co.eta * dden[..., None]
    dfq = np.einsum("...tmr,...tm->...tr", co.U, da)
    dU = np.einsum("...tm,...tr->...tmr", da, fq)
    dGamma = np.einsum("...tm,...td->...tmd", a, dnum)
    # Adjoint of the projection (I5) of the channels [fk, v], by the reverse scan; the layout
    # mirrors basis_coefficients: token axis first, batch and channels flattened.
    dc = np.concatenate([dU, dGamma], axis=-1)  # (..., T, M, R + dv)
    dc = np.moveaxis(dc, (-3, -2), (0, 1))  # (T, M, ..., C)
    df = legs_project_vjp((T, dc[0, 0].size), dc.reshape(T, M, -1))  # (T, prod(lead) * C)
    df = np.moveaxis(df.reshape(T, *dc.shape[2:]), 0, -2)  # (..., T, C)
    R = fk.shape[-1]
    dfk, dv = df[..., :R], df[..., R:]
    grads = (_finite_output(g, "fq, fk, v, d_out", "gradient") for g in (dfq, dfk, dv))
    return LegsGrads(*grads)


# The scalable layer: pieces (I8)-(I10)


def short_conv(x: ArrayLike, w: ArrayLike) -> NDArray[np.float64]:
    """(I8) causal depthwise convolution SC(x)_t = sum_s w_s * x_{t-s}, zero-padded, no bias.

    Args:
        x: (..., T, C); w: (K, C), K = 4 in the layer.

    Returns:
        (..., T, C). Cost: O(n T C K) time, O(n T C) memory.
    """
    x = real_array("x", x, min_ndim=2)
    w = real_array("w", w, min_ndim=2)
    if w.ndim != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"w: expected shape (K, {x.shape[-1]}) (channels of x), got {w.shape}")
    T = x.shape[-2]
    out = np.zeros_like(x)
    with np.errstate(over="ignore", invalid="ignore"):
        # --8<-- [start:i8]
        for s in range(min(w.shape[0], T)):
            out[..., s:, :] += w[s] * x[..., : T - s, :]  # (I8) x_{t-s}, zero for t < s
        # --8<-- [end:i8]
    return _finite_output(out, "x, w")


def _norm(
    name: str, y: NDArray[np.float64], reduce: Callable[..., NDArray[np.float64]], eps: float
) -> NDArray[np.float64]:
    """sqrt(reduce(y^2) + eps) over the last axis (reduce: sum or mean). Overflow (|y| near
    1e154) is a ValueError, since dividing by an infinite norm would silently return 0; so is a
    zero norm (a row of zeros with eps = 0), which would return NaN."""
    with np.errstate(over="ignore"):
        squares = reduce(y**2, axis=-1, keepdims=True)
    norm = np.sqrt(finite_result(squares, f"{name}: {name}^2 overflows float64") + eps)
    if (norm == 0).any():
        index = tuple(int(i) for i in np.argwhere(norm[..., 0] == 0)[0])
        raise ValueError(f"{name}: a row of zeros at index {index} with eps = 0 (division by 0)")
    return norm


def _nonnegative(name: str, x: object) -> float:
    value = scalar(name, x)
    if value < 0:
        raise ValueError(f"{name}: expected a number >= 0, got {value}")
    return value


def feature_map(y: ArrayLike, eps: float = 1e-6) -> NDArray[np.float64]:
    """(I9) xi(y) = SiLU(y) / sqrt(||y||^2 + eps) over the last axis (the head dim).

    Args:
        y: (..., R) real; eps: eps_xi >= 0.

    Returns:
        (..., R) float64. Cost: O(size of y) time and memory.
    """
    y = real_array("y", y, min_ndim=1)
    eps = _nonnegative("eps", eps)
    # --8<-- [start:i9]
    silu = y * expit(y)  # SiLU, stable for large |y|
    return silu / _norm("y", y, np.sum, eps)  # (I9) sqrt(||y||^2 + eps)
    # --8<-- [end:i9]


def rms_norm(x: ArrayLike, g: ArrayLike, eps: float = 1e-6) -> NDArray[np.float64]:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g over the last axis.

    Args:
        x: (..., C); g: (C,); eps >= 0.

    Returns:
        (..., C) float64. Cost: O(size of x) time and memory.
    """
    x = real_array("x", x, min_ndim=1)
    g = real_array("g", g, min_ndim=1)
    if g.shape != x.shape[-1:]:
        raise ValueError(f"g: expected shape {x.shape[-1:]} (last axis of x), got {g.shape}")
    eps = _nonnegative("eps", eps)
    # --8<-- [start:i10]
    return x / _norm("x", x, np.mean, eps) * g  # (I10) sqrt(mean(x^2) + eps)
    # --8<-- [end:i10]


def rope(x: ArrayLike) -> NDArray[np.float64]:
    """Rotary position embedding on the last axis of x (..., T, R), R even; base 10000.

    Returns:
        (..., T, R) float64. Cost: O(n T R) time and memory.
    """
    x = real_array("x", x, min_ndim=2)
    T, R = x.shape[-2:]
    if R % 2:
        raise ValueError(f"x: RoPE needs an even head dim, got {R}")
    freq = 10000.0 ** (-np.arange(R // 2) / (R // 2))
    angle = np.arange(T)[:, None] * freq  # (T, R/2)
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    cos, sin = np.cos(angle), np.sin(angle)
    with np.errstate(over="ignore", invalid="ignore"):
        rotated = np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return _finite_output(rotated, "x")


def s4d_lambda(log_dt: ArrayLike, a_log: ArrayLike, a_im: ArrayLike) -> NDArray[np.complex128]:
    """(I11) Lambda = exp(dt * a), a = -exp(a_log) + i a_im, dt = exp(log_dt) per head.

    Args:
        log_dt: (H,); a_log, a_im: (H, M).

    Returns:
        Lambda (H, M) complex128, |Lambda| <= 1. Cost: O(H M).
    """
    log_dt = real_array("log_dt", log_dt, min_ndim=1)
    if log_dt.ndim != 1:
        raise ValueError(f"log_dt: expected shape (H,), got {log_dt.shape}")
    a_log = real_array("a_log", a_log, min_ndim=2)
    a_im = real_array("a_im", a_im, min_ndim=2)
    check_shape("a_log", a_log, (log_dt.shape[0], a_log.shape[1]), "(H, M), H from log_dt")
    check_shape("a_im", a_im, a_log.shape, "same as a_log")
    with np.errstate(over="ignore", invalid="ignore"):
        # --8<-- [start:i11]
        a = -np.exp(a_log) + 1j * a_im  # (I11)
        lam = np.exp(np.exp(log_dt)[:, None] * a)  # (I11) Lambda = exp(dt a)
        # --8<-- [end:i11]
    return finite_result(lam, "log_dt, a_log, a_im: dt * a overflows float64")


def s4d_b_bar(
    log_dt: ArrayLike, a_log: ArrayLike, a_im: ArrayLike, b: ArrayLike
) -> NDArray[np.complex128]:
    """(I11) the zero-order hold of b: b_bar = (Lambda - 1) / a (.) b, ~ dt b for small |dt a|.

    Args:
        log_dt: (H,); a_log, a_im: (H, M); b: (H, M) complex (or real).

    Returns:
        b_bar (H, M) complex128, the ``b`` that :func:`interdomain_s4d` takes. Cost: O(H M).
    """
    lam = s4d_lambda(log_dt, a_log, a_im)  # validates the three
    b = complex_array("b", b, min_ndim=2)
    check_shape("b", b, lam.shape, "(H, M), as a_log")
    dt = np.exp(real_array("log_dt", log_dt))[:, None]
    # --8<-- [start:zoh]
    a = -np.exp(real_array("a_log", a_log)) + 1j * real_array("a_im", a_im)  # (I11)
    return np.expm1(dt * a) / a * b  # (I11) (Lambda - 1) / a (.) b; expm1: no cancellation
    # --8<-- [end:zoh]


# The S4D core (I11)-(I13)


def _check_s4d(
    fq: ArrayLike, kt: ArrayLike, vt: ArrayLike, lam: ArrayLike, b: ArrayLike, c: ArrayLike
) -> tuple[
    NDArray[np.float64],
    NDArray[np.float64],
    NDArray[np.float64],
    NDArray[np.complex128],
    NDArray[np.complex128],
    NDArray[np.complex128],
]:
    fq, kt, vt = _check_fq_fk_v(fq, kt, vt, names=("fq", "kt", "vt"))
    if fq.ndim < 3:
        raise ValueError(f"fq: expected (..., H, T, R) with a head axis, got shape {fq.shape}")
    lam, b = _check_lam_b(lam, b, fq.shape[-3], "fq")
    c = complex_array("c", c, min_ndim=3)
    M = lam.shape[1]
    check_shape("c", c, (lam.shape[0], M, M), "(H, M, M), M from lam")
    return fq, kt, vt, lam, b, c


# Room for the rounding of |Lambda| = 1 (float32 inputs included); (1 + 1e-6)^T stays below e up
# to T = 1e6, while a truly unstable Lambda grows like |Lambda|^T until the states overflow.
STABLE_MODULUS = 1 + 1e-6


def _check_lam_b(
    lam: ArrayLike, b: ArrayLike, H: int, heads_of: str
) -> tuple[NDArray[np.complex128], NDArray[np.complex128]]:
    """lam, b (H, M) complex with |lam| <= 1 (to rounding): (I11) gives |Lambda| =
    exp(-dt exp(a_log)) < 1."""
    lam = complex_array("lam", lam, min_ndim=2)
    if lam.shape[0] != H or lam.ndim != 2:
        raise ValueError(f"lam: expected shape ({H}, M) (H = heads of {heads_of}), got {lam.shape}")
    modulus = np.abs(lam)
    if (modulus > STABLE_MODULUS).any():
        index = tuple(int(i) for i in np.argwhere(modulus > STABLE_MODULUS)[0])
        raise ValueError(
            f"lam: expected |lam| <= 1 (a stable recurrence, to rounding: <= {STABLE_MODULUS}), "
            f"got |lam| = {float(modulus[index])!r} at index {index}"
        )
    b = complex_array("b", b, min_ndim=2)
    check_shape("b", b, lam.shape, "(H, M), as lam")
    return lam, b


def _check_states(
    z: ArrayLike, lam: ArrayLike, b: ArrayLike
) -> tuple[NDArray[np.float64], NDArray[np.complex128], NDArray[np.complex128]]:
    z = real_array("z", z, min_ndim=3)
    lam, b = _check_lam_b(lam, b, z.shape[-3], "z")
    return z, lam, b


def _ssm_inputs(
    kt: NDArray[np.float64], vt: NDArray[np.float64], readout: str
) -> NDArray[np.float64]:
    """z_t = [k~_t, v~_t] (+ a constant-ones channel for the ratio readout), (..., H, T, C)."""
    # --8<-- [start:ssm-inputs]
    parts = [kt, vt]
    if readout == "ratio":
        parts.append(np.ones((*kt.shape[:-1], 1)))
    return np.concatenate(parts, axis=-1)
    # --8<-- [end:ssm-inputs]


def s4d_states(z: ArrayLike, lam: ArrayLike, b: ArrayLike) -> NDArray[np.complex128]:
    """(I11) x_t[:, c] = Lambda * x_{t-1}[:, c] + b z_t[c], x_{-1} = 0, sequentially.

    Args:
        z: (..., H, T, C) real inputs; lam, b: (H, M) complex, |lam| <= 1.

    Returns:
        x (..., H, T, M, C) complex128.

    Cost: O(n H T M C) time in T steps, O(n H T M C) memory.
    """
    z, lam, b = _check_states(z, lam, b)
    T = z.shape[-2]
    x = np.zeros((*z.shape[:-2], T, lam.shape[1], z.shape[-1]), dtype=np.complex128)
    state = np.zeros(x[..., 0, :, :].shape, dtype=np.complex128)  # (..., H, M, C)
    for t in range(T):
        state = lam[:, :, None] * state + b[:, :, None] * z[..., t, None, :]  # (I11)
        x[..., t, :, :] = state
    return x


def s4d_states_chunked(
    z: ArrayLike, lam: ArrayLike, b: ArrayLike, chunk: int
) -> NDArray[np.complex128]:
    """(H8) the same states in chunks: within a chunk the convolution form, across chunks
    the carried state x_end * Lambda^(offset+1).

    Same contract as :func:`s4d_states`, plus ``chunk``, an integer >= 1. Cost: O(n H T L M C)
    time for chunks of L = min(chunk, T), O(n H T M C + H L^2 M) memory.
    """
    z, lam, b = _check_states(z, lam, b)
    chunk = positive_int("chunk", chunk)
    T = z.shape[-2]
    M = lam.shape[1]
    x = np.zeros((*z.shape[:-2], T, M, z.shape[-1]), dtype=np.complex128)
    carry = np.zeros(x[..., 0, :, :].shape, dtype=np.complex128)
    for start in range(0, T, chunk):
        L = min(chunk, T - start)
        p = np.arange(L)
        lag = p[:, None] - p[None, :]  # (L, L): s - u within the chunk
        powers = lam[:, None, None, :] ** lag.clip(0)[None, :, :, None]  # (H, L, L, M)
        kernel = np.where(lag[None, :, :, None] >= 0, powers, 0) * b[:, None, None, :]
        local = np.einsum("hsum,...huc->...hsmc", kernel, z[..., start : start + L, :])
        decay = lam[:, None, :] ** (p + 1)[None, :, None]  # (H, L, M)
        x[..., start : start + L, :, :] = local + decay[..., None] * carry[..., None, :, :]
        carry = x[..., start + L - 1, :, :]
    return x


def s4d_states_fft(z: ArrayLike, lam: ArrayLike, b: ArrayLike) -> NDArray[np.complex128]:
    """(H8) the convolution form x_t = sum_{s<=t} Lambda^(t-s) b z_s computed with the FFT.

    Same contract as :func:`s4d_states`. Cost: O(n H T log T M C) time, O(n H T M C) memory.
    """
    z, lam, b = _check_states(z, lam, b)
    T = z.shape[-2]
    n = 2 * T
    kernel = lam[:, None, :] ** np.arange(T)[None, :, None] * b[:, None, :]  # (H, T, M)
    Kf = np.fft.fft(kernel, n=n, axis=-2)  # (H, n, M)
    Zf = np.fft.fft(z, n=n, axis=-2)  # (..., H, n, C)
    return np.fft.ifft(Kf[..., :, None] * Zf[..., :, None, :], axis=-3)[..., :T, :, :]


def interdomain_s4d(
    fq: ArrayLike,
    kt: ArrayLike,
    vt: ArrayLike,
    lam: ArrayLike,
    b: ArrayLike,
    c: ArrayLike,
    *,
    readout: str = "linear",
) -> NDArray[np.float64]:
    """The S4D core of the layer, (I11)-(I13).

    Args:
        fq: (..., H, T, R) query features xi(q).
        kt: (..., H, T, R) SSM key inputs k~; vt: (..., H, T, dv) SSM value inputs v~.
        lam, b: (H, M) complex, |lam| <= 1 (a larger modulus, beyond rounding, is a
            ValueError); c: (H, M, M) complex.
        readout: "linear" (denominator-free, the default) or "ratio".

    Returns:
        o (..., H, T, dv) real. With the ratio readout a row whose denominator is exactly 0
        is a ValueError (see the module docstring).

    Cost: O(n H T M^2 (R + dv)) time in T steps, O(n H M (R + dv) + n H T dv) memory.
    """
    empty = empty_batch_call(
        interdomain_s4d,
        dict(fq=fq, kt=kt, vt=vt),
        dict(fq=3, kt=3, vt=3),
        lam=lam,
        b=b,
        c=c,
        readout=readout,
    )
    if empty is not None:  # B = 0
        return empty
    readout = _check_readout(readout)
    fq, kt, vt, lam, b, c = _check_s4d(fq, kt, vt, lam, b, c)
    R, dv = kt.shape[-1], vt.shape[-1]
    z = _ssm_inputs(kt, vt, readout)
    state = np.zeros((*z.shape[:-2], lam.shape[1], z.shape[-1]), dtype=np.complex128)
    o = np.zeros(vt.shape)
    den = np.zeros(vt.shape[:-1])
    # --8<-- [start:s4d-core]
    for t in range(z.shape[-2]):
        state = lam[:, :, None] * state + b[:, :, None] * z[..., t, None, :]  # (I11)
        Y = c @ state  # (I12) (..., H, M, C)
        a = np.einsum("...mr,...r->...m", Y[..., :R], fq[..., t, :])  # U_t fq_t
        num = np.einsum("...m,...md->...d", a.conj(), Y[..., R : R + dv]).real  # (I13)
        if readout == "ratio":
            den[..., t] = np.einsum("...m,...m->...", a.conj(), Y[..., R + dv]).real
        o[..., t, :] = num
    # --8<-- [end:s4d-core]
    o = _finite_output(o, "fq, kt, vt, b, c")
    return _ratio(o, den, "fq, kt, b, c") if readout == "ratio" else o


def interdomain_s4d_oracle(
    fq: ArrayLike,
    kt: ArrayLike,
    vt: ArrayLike,
    lam: ArrayLike,
    b: ArrayLike,
    c: ArrayLike,
    *,
    readout: str = "linear",
) -> NDArray[np.float64]:
    """H9: the double-sum form (O(t^2) terms for output t), written without the recurrence.

    o_t = Re sum_{s,s'<=t} (fq_t . kt_s) w(t-s, t-s') vt_s',
    w(p, p') = (conj(Lambda)^p conj(b))^T C^H C (Lambda^p' b); the ratio readout divides by the
    same sum with vt replaced by 1.

    Same contract as :func:`interdomain_s4d`. Cost: O(n H T^3 dv + H T M^2) time,
    O(H T (T + M)) memory; for checking at small T.
    """
    readout = _check_readout(readout)
    fq, kt, vt, lam, b, c = _check_s4d(fq, kt, vt, lam, b, c)
    T = fq.shape[-2]
    K = np.einsum("hmn,hpn->hpm", c, lam[:, None, :] ** np.arange(T)[None, :, None] * b[:, None])
    w = np.einsum("hpm,hqm->hpq", K.conj(), K)  # H9: (H, T, T) w(p, p')
    o = np.zeros(vt.shape)
    den = np.zeros(vt.shape[:-1])
    for t in range(T):
        lag = t - np.arange(t + 1)  # p = t - s for s = 0..t
        W = w[:, lag][:, :, lag]  # (H, t+1, t+1)
        scores = np.einsum("...hr,...hsr->...hs", fq[..., t, :], kt[..., : t + 1, :])
        o[..., t, :] = np.einsum("...hs,hsu,...hud->...hd", scores, W, vt[..., : t + 1, :]).real
        if readout == "ratio":
            den[..., t] = np.einsum("...hs,hsu->...h", scores, W).real
    o = _finite_output(o, "fq, kt, vt, b, c")
    return _ratio(o, den, "fq, kt, b, c") if readout == "ratio" else o


class S4DGrads(NamedTuple):
    """Cotangents of :func:`interdomain_s4d`; dlam, db, dc are dL/dRe + i dL/dIm."""

    dfq: NDArray[np.float64]
    dkt: NDArray[np.float64]
    dvt: NDArray[np.float64]
    dlam: NDArray[np.complex128]
    db: NDArray[np.complex128]
    dc: NDArray[np.complex128]


def interdomain_s4d_vjp(
    fq: ArrayLike,
    kt: ArrayLike,
    vt: ArrayLike,
    lam: ArrayLike,
    b: ArrayLike,
    c: ArrayLike,
    d_out: ArrayLike,
    *,
    readout: str = "linear",
) -> S4DGrads:
    """Hand-written backward of :func:`interdomain_s4d`.

    Rules for a real loss, with g(z) = dL/dRe z + i dL/dIm z: y = Re(conj(a) . g) gives
    g(a) = Gamma dO, g(Gamma) = a dO^T; Y = C x gives g(x) = C^H g(Y), g(C) = sum_t g(Y_t) x_t^H;
    the recurrence is run backwards with gx_t = C^H g(Y_t) + conj(Lambda) gx_{t+1}, then
    g(Lambda) = sum_t conj(x_{t-1}) gx_t, g(b) = sum_t gx_t z_t, dz_t = Re(conj(b) gx_t).

    Args:
        fq, kt, vt, lam, b, c, readout: as for :func:`interdomain_s4d`.
        d_out: (..., H, T, dv) cotangent of o.

    Returns:
        :class:`S4DGrads` (dfq, dkt, dvt real; dlam, db, dc complex), shaped like the inputs.

    Cost: O(n H T M^2 (R + dv)) time, O(n H T M (R + dv)) memory: the states are kept, about
    seven complex128 arrays of that size (250 MB at n = 1, H = 2, T = 2048, R = dv = M = 16).
    """
    empty = empty_batch_call(
        interdomain_s4d_vjp,
        dict(fq=fq, kt=kt, vt=vt, d_out=d_out),
        dict(fq=3, kt=3, vt=3, d_out=3),
        unbatched=("dlam", "db", "dc"),
        lam=lam,
        b=b,
        c=c,
        readout=readout,
    )
    if empty is not None:  # B = 0: the parameter gradients are empty sums, 0
        return empty
    readout = _check_readout(readout)
    fq, kt, vt, lam, b, c = _check_s4d(fq, kt, vt, lam, b, c)
    d_out = real_array("d_out", d_out, min_ndim=2)
    check_shape("d_out", d_out, vt.shape, "shape of the output o")
    R, dv = kt.shape[-1], vt.shape[-1]
    z = _ssm_inputs(kt, vt, readout)  # (..., H, T, C)
    x = s4d_states(z, lam, b)  # (..., H, T, M, C)
    Y = np.einsum("hmn,...htnc->...htmc", c, x, optimize=True)  # (I12); optimize: use BLAS
    U, Gamma = Y[..., :R], Y[..., R : R + dv]
    a = np.einsum("...tmr,...tr->...tm", U, fq)  # U_t fq_t
    num = np.einsum("...tm,...tmd->...td", a.conj(), Gamma).real
    gY = np.zeros_like(Y)
    if readout == "ratio":
        eta = Y[..., R + dv]
        den = np.einsum("...tm,...tm->...t", a.conj(), eta).real
        o = _ratio(num, den, "fq, kt, b, c")
        dnum = d_out / den[..., None]
        dden = -np.sum(d_out * o, axis=-1) / den
        ga = np.einsum("...tmd,...td->...tm", Gamma, dnum) + eta * dden[..., None]
        gY[..., R + dv] = a * dden[..., None]
    else:
        dnum = d_out
        ga = np.einsum("...tmd,...td->...tm", Gamma, dnum)
    gY[..., R : R + dv] = np.einsum("...tm,...td->...tmd", a, dnum)
    gY[..., :R] = np.einsum("...tm,...tr->...tmr", ga, fq)
    dfq = np.einsum("...tmr,...tm->...tr", U.conj(), ga).real

    lead = tuple(range(x.ndim - 4))  # the batch axes before (H, T, M, C)
    gc = np.einsum("...htmc,...htnc->...hmn", gY, x.conj(), optimize=True).sum(axis=lead)
    gx_ext = np.einsum("hmn,...htmc->...htnc", c.conj(), gY, optimize=True)  # C^H g(Y_t)
    T = z.shape[-2]
    gx = np.zeros_like(x)
    carry = np.zeros_like(x[..., 0, :, :])
    decay = lam.conj()[:, :, None]  # the adjoint recurrence runs with conj(Lambda)
    for t in range(T - 1, -1, -1):
        carry = gx_ext[..., t, :, :] + decay * carry
        gx[..., t, :, :] = carry
    x_prev = np.concatenate([np.zeros_like(x[..., :1, :, :]), x[..., :-1, :, :]], axis=-3)
    glam = np.einsum("...htmc,...htmc->...hm", x_prev.conj(), gx).sum(axis=lead)
    gb = np.einsum("...htmc,...htc->...hm", gx, z).sum(axis=lead)
    dz = np.einsum("hm,...htmc->...htc", b.conj(), gx).real
    grads = (dfq, dz[..., :R], dz[..., R : R + dv], glam, gb, gc)
    return S4DGrads(*(_finite_output(g, "fq, kt, vt, b, c, d_out", "gradient") for g in grads))


# Decoding with a fixed-size state (H6)


class InterdomainDecoder:
    """Step-by-step decode of :func:`interdomain_s4d`; the state x (..., H, M, C) never grows.

    Args:
        lam, b: (H, M) complex, |lam| <= 1; c: (H, M, M) complex; readout: as for
            :func:`interdomain_s4d`.

    Cost per step: O(n H M^2 (R + dv)) time, O(n H M (R + dv)) memory held, independent of T.
    """

    def __init__(
        self, lam: ArrayLike, b: ArrayLike, c: ArrayLike, *, readout: str = "linear"
    ) -> None:
        self.readout = _check_readout(readout)
        lam_array = complex_array("lam", lam, min_ndim=2)
        self.lam, self.b = _check_lam_b(lam_array, b, lam_array.shape[0], "lam")
        H, M = self.lam.shape
        self.c = complex_array("c", c, min_ndim=3)
        check_shape("c", self.c, (H, M, M), "(H, M, M), M from lam")
        self.state: NDArray[np.complex128] | None = None
        self.first_shapes: tuple | None = None

    def state_size(self) -> int:
        """Real numbers held per head: 2 M (R + dv [+ 1 for the ratio channel]); 0 before step."""
        if self.state is None:
            return 0
        return 2 * self.state.shape[-2] * self.state.shape[-1]

    def step(self, fq: ArrayLike, kt: ArrayLike, vt: ArrayLike) -> NDArray[np.float64]:
        """Consume one token: fq, kt (..., H, R), vt (..., H, dv). Returns o_t (..., H, dv).

        The shapes must stay those of the first step. A step that raises leaves the state as
        it was.
        """
        H = self.lam.shape[0]
        fq = real_array("fq", fq, min_ndim=2)
        if fq.shape[-2] != H:
            raise ValueError(
                f"fq: expected shape (..., {H}, R) (H = {H} heads of lam), got {fq.shape}"
            )
        kt = real_array("kt", kt, min_ndim=2)
        check_shape("kt", kt, fq.shape, "same as fq: (..., H, R)")
        vt = real_array("vt", vt, min_ndim=2)
        if vt.shape[:-1] != fq.shape[:-1]:
            raise ValueError(f"vt: expected shape {fq.shape[:-1]} + (dv,), got {vt.shape}")
        if self.state is not None and self.first_shapes != (fq.shape, vt.shape):
            raise ValueError(
                f"fq, vt: expected the shapes of the first step {self.first_shapes}, got "
                f"{(fq.shape, vt.shape)}"
            )
        R, dv = kt.shape[-1], vt.shape[-1]
        z = _ssm_inputs(kt[..., None, :], vt[..., None, :], self.readout)[..., 0, :]
        if self.state is None:
            previous = np.zeros((*z.shape[:-1], self.lam.shape[1], z.shape[-1]), complex)
        else:
            previous = self.state
        state = self.lam[:, :, None] * previous + self.b[:, :, None] * z[..., None, :]  # (I11)
        Y = self.c @ state  # (I12)
        a = np.einsum("...mr,...r->...m", Y[..., :R], fq)
        o = np.einsum("...m,...md->...d", a.conj(), Y[..., R : R + dv]).real  # (I13)
        o = _finite_output(o, "fq, kt, vt")
        if self.readout == "ratio":
            den = np.einsum("...m,...m->...", a.conj(), Y[..., R + dv]).real
            o = _ratio(o, den, "fq, kt")
        self.state, self.first_shapes = state, (fq.shape, vt.shape)
        return o


# The full layer


PARAMETER_SCHEMA = {
    "wq": "(d, H*R) query projection",
    "wk": "(d, H*R) key projection",
    "wv": "(d, H*dv) value projection",
    "wo": "(H*dv, d) output projection",
    "conv_q": "(4, H*R) short-conv weights for queries (I8)",
    "conv_k": "(4, H*R) short-conv weights for keys (I8)",
    "norm_k_g": "(H, R) RMSNorm scale for k~ (I10)",
    "norm_k_b": "(H, R) bias for k~ (I10)",
    "norm_v_g": "(H, dv) RMSNorm scale for v~ (I10)",
    "norm_v_b": "(H, dv) bias for v~ (I10)",
    "log_dt": "(H,) log step (I11)",
    "a_log": "(H, M) log of -Re(a) (I11)",
    "a_im": "(H, M) Im(a) (I11)",
    "b_re": "(H, M) Re(b) (I11)",
    "b_im": "(H, M) Im(b) (I11)",
    "c_re": "(H, M, M) Re(C) (I12)",
    "c_im": "(H, M, M) Im(C) (I12)",
    "norm_o_g": "(H, dv) RMSNorm scale of the readout, only with output_norm=True (I14)",
    "wg": "(d, H*dv) output gate, only with gate=True (I13)",
}
OPTIONAL_PARAMETERS = {"norm_o_g": "output_norm", "wg": "gate"}  # parameter: the flag asking for it


def interdomain_parameter_shapes(
    d: int, H: int, R: int, dv: int, M: int, *, output_norm: bool = True, gate: bool = False
) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of :func:`interdomain_layer` (:data:`PARAMETER_SCHEMA`) for
    model width d, H heads, feature width R, value width dv and M modes, with the optional ones
    the flags ask for: the one table the torch and JAX layers take theirs from."""
    shapes = {
        "wq": (d, H * R),
        "wk": (d, H * R),
        "wv": (d, H * dv),
        "wo": (H * dv, d),
        "conv_q": (4, H * R),
        "conv_k": (4, H * R),
        "norm_k_g": (H, R),
        "norm_k_b": (H, R),
        "norm_v_g": (H, dv),
        "norm_v_b": (H, dv),
        "log_dt": (H,),
        "a_log": (H, M),
        "a_im": (H, M),
        "b_re": (H, M),
        "b_im": (H, M),
        "c_re": (H, M, M),
        "c_im": (H, M, M),
        "norm_o_g": (H, dv),
        "wg": (d, H * dv),
    }
    flags = {"gate": gate, "output_norm": output_norm}
    return {n: s for n, s in shapes.items() if flags.get(OPTIONAL_PARAMETERS.get(n, ""), True)}


def init_interdomain_params(
    d: int,
    H: int,
    R: int,
    dv: int,
    M: int,
    seed: int = 0,
    *,
    gate: bool = False,
    output_norm: bool = True,
) -> dict[str, NDArray[np.float64]]:
    """Parameters of :func:`interdomain_layer` (schema :data:`PARAMETER_SCHEMA`), S4D-Inv init.

    a_log = log(1/2), a_im by S4D-Inv, log_dt ~ U[log 1e-3, log 1e-1], b = 1,
    C ~ complex normal / sqrt(M); projections ~ normal / sqrt(fan-in); conv ~ normal / 2;
    the readout's RMSNorm scale g_o = 1 (I14, with ``output_norm``); wg with ``gate``.

    d, H, R, dv, M: integers >= 1. Cost: O(d H (R + dv) + H M^2) time and memory.
    """
    for name, val in dict(d=d, H=H, R=R, dv=dv, M=M).items():
        positive_int(name, val)
    rng = np.random.default_rng(seed)
    a_log, a_im = s4d_init(M, "inv")
    p = {
        "wq": rng.standard_normal((d, H * R)) / np.sqrt(d),
        "wk": rng.standard_normal((d, H * R)) / np.sqrt(d),
        "wv": rng.standard_normal((d, H * dv)) / np.sqrt(d),
        "wo": rng.standard_normal((H * dv, d)) / np.sqrt(H * dv),
        "conv_q": rng.standard_normal((4, H * R)) / 2,
        "conv_k": rng.standard_normal((4, H * R)) / 2,
        "norm_k_g": np.ones((H, R)),
        "norm_k_b": np.zeros((H, R)),
        "norm_v_g": np.ones((H, dv)),
        "norm_v_b": np.zeros((H, dv)),
        "log_dt": rng.uniform(np.log(1e-3), np.log(1e-1), size=H),
        "a_log": np.tile(a_log, (H, 1)),
        "a_im": np.tile(a_im, (H, 1)),
        "b_re": np.ones((H, M)),
        "b_im": np.zeros((H, M)),
        "c_re": rng.standard_normal((H, M, M)) / np.sqrt(2 * M),
        "c_im": rng.standard_normal((H, M, M)) / np.sqrt(2 * M),
    }
    if output_norm:
        p["norm_o_g"] = np.ones((H, dv))
    if gate:
        p["wg"] = rng.standard_normal((d, H * dv)) / np.sqrt(d)
    return p


def _split_heads(x: NDArray[np.float64], H: int) -> NDArray[np.float64]:
    *lead, T, D = x.shape
    return np.swapaxes(x.reshape(*lead, T, H, D // H), -2, -3)  # (..., H, T, D/H)


def interdomain_layer(
    x: ArrayLike,
    params: Mapping[str, ArrayLike],
    *,
    readout: str = "linear",
    use_rope: bool = False,
    gate: bool = False,
    output_norm: bool = True,
) -> NDArray[np.float64]:
    """The Interdomain layer (I8)-(I14): x (B, T, d) -> y (B, T, d).

    Projections, short conv on q and k (I8), optional RoPE, feature map (I9), norms and biases
    (I10), b discretised by zero-order hold and the S4D core (I11)-(I13), the readout's per-head
    RMSNorm (I14), optional output gate, output projection.

    Args:
        x: (B, T, d) hidden states (any leading dims before T; B = 0 gives an empty output).
        params: the arrays of :data:`PARAMETER_SCHEMA`; H and R from norm_k_g, dv from
            norm_v_g, M from a_log; norm_o_g with ``output_norm``, wg with ``gate``.
        output_norm: the RMSNorm of (I14), on by default; False gives the paper-literal layer
            (its output at initialisation grows with T).

    Cost: O(B T d H (R + dv) + B H T M^2 (R + dv)) time, O(B H T (R + dv) + H M^2) memory.
    """
    empty = empty_batch_call(
        interdomain_layer,
        dict(x=x),
        dict(x=2),
        params=params,
        readout=readout,
        gate=gate,
        output_norm=output_norm,
    )
    if empty is not None:  # B = 0
        return empty
    x = real_array("x", x, min_ndim=3)
    flags = {"gate": gate, "output_norm": output_norm}
    optional = {name for name, flag in OPTIONAL_PARAMETERS.items() if not flags[flag]}
    missing = sorted(set(PARAMETER_SCHEMA) - optional - set(params))
    if missing:
        raise ValueError(
            f"params: missing {missing}; see PARAMETER_SCHEMA (norm_o_g: output_norm=True, "
            "wg: gate=True)"
        )
    P = {name: real_array(f"params[{name!r}]", val) for name, val in params.items()}
    d = x.shape[-1]
    for name in ("norm_k_g", "norm_v_g", "a_log"):
        if P[name].ndim != 2:
            raise ValueError(
                f"params[{name!r}]: expected {PARAMETER_SCHEMA[name]}, got shape {P[name].shape}"
            )
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    M = P["a_log"].shape[1]
    # every parameter given is checked, the optional ones too when their flag is off
    every = interdomain_parameter_shapes(d, H, R, dv, M, output_norm=True, gate=True)
    for name, shape in every.items():
        if name in P:
            check_shape(f"params[{name!r}]", P[name], shape, PARAMETER_SCHEMA[name])

    # --8<-- [start:layer]
    q = short_conv(x @ P["wq"], P["conv_q"])  # (I8) (B, T, H*R)
    k = short_conv(x @ P["wk"], P["conv_k"])
    v = x @ P["wv"]  # values are not convolved
    q, k, v = _split_heads(q, H), _split_heads(k, H), _split_heads(v, H)  # (B, H, T, .)
    if use_rope:
        q, k = rope(q), rope(k)
    fq, fk = feature_map(q), feature_map(k)  # (I9)
    kt = rms_norm(fk, np.ones(R)) * P["norm_k_g"][:, None] + P["norm_k_b"][:, None]  # (I10)
    vt = rms_norm(v, np.ones(dv)) * P["norm_v_g"][:, None] + P["norm_v_b"][:, None]
    lam = s4d_lambda(P["log_dt"], P["a_log"], P["a_im"])
    b_bar = s4d_b_bar(P["log_dt"], P["a_log"], P["a_im"], P["b_re"] + 1j * P["b_im"])  # (I11)
    c = P["c_re"] + 1j * P["c_im"]
    o = interdomain_s4d(fq, kt, vt, lam, b_bar, c, readout=readout)  # (B, H, T, dv)
    if output_norm:
        o = rms_norm(o, np.ones(dv)) * P["norm_o_g"][:, None]  # (I14) per head
    o = np.swapaxes(o, -2, -3).reshape(*x.shape[:-1], H * dv)  # concatenate heads
    if gate:
        g = x @ P["wg"]
        o = g * expit(g) * o  # SiLU(W_g x) * o
    return _finite_output(o @ P["wo"], "x, params")
    # --8<-- [end:layer]


__all__ = [
    "OPTIONAL_PARAMETERS",
    "PARAMETER_SCHEMA",
    "Coefficients",
    "InterdomainDecoder",
    "LegsGrads",
    "S4DGrads",
    "basis_coefficients",
    "discrete_coefficients",
    "feature_map",
    "init_interdomain_params",
    "interdomain_discrete",
    "interdomain_layer",
    "interdomain_legs",
    "interdomain_legs_vjp",
    "interdomain_parameter_shapes",
    "interdomain_s4d",
    "interdomain_s4d_oracle",
    "interdomain_s4d_vjp",
    "linear_attention",
    "ratio_readout",
    "rms_norm",
    "rope",
    "s4d_b_bar",
    "s4d_lambda",
    "s4d_states",
    "s4d_states_chunked",
    "s4d_states_fft",
    "short_conv",
]
