"""Interdomain Attention: the HiPPO-LegS projection with U, Gamma, eta, and the S4D layer.

The executable statement of ``shared/spec/interdomain.md``; labels (``# (I3)``) are the spec's.
float64 / complex128 throughout.

Gradient convention for complex parameters: for a real loss L and complex z the returned
gradient is dL/dRe(z) + i dL/dIm(z) (the real-pair gradient packed as one complex number).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.special import expit

from .hippo import discrete_orthonormal_basis, legs_project, legs_project_vjp, s4d_init
from .validation import (
    check_length,
    check_shape,
    complex_array,
    positive_int,
    real_array,
)

# --------------------------------------------------------------------------------------------
# Validation


def _check_fq_fk_v(fq, fk, v, names=("fq", "fk", "v")):
    fq = real_array(names[0], fq, min_ndim=2)
    *lead, T, R = fq.shape
    check_length(names[0], T)
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


# --------------------------------------------------------------------------------------------
# The idealised mechanism (I1)-(I7)


def linear_attention(fq, fk, v) -> np.ndarray:
    """(I1) causal linear attention o_i = sum_{n<=i} (fq_i . fk_n) v_n / sum_{n<=i} fq_i . fk_n.

    Args:
        fq, fk: (..., T, R) feature maps xi(q), xi(k); v: (..., T, dv).

    Returns:
        o (..., T, dv).
    """
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    # --8<-- [start:i1]
    scores = np.tril(fq @ np.swapaxes(fk, -1, -2))  # (..., T, T), zero above the diagonal
    return (scores @ v) / scores.sum(axis=-1, keepdims=True)  # (I1)
    # --8<-- [end:i1]


class Coefficients(NamedTuple):
    """(I2) the causal coefficients after each token: U (..., T, M, R), Gamma (..., T, M, dv),
    eta (..., T, M)."""

    U: np.ndarray
    Gamma: np.ndarray
    eta: np.ndarray


def basis_coefficients(fk, v, M: int) -> Coefficients:
    """(I2)/(I5) project xi(k), v and the constant 1 onto the LegS basis, causally.

    Args:
        fk: (..., T, R); v: (..., T, dv); M: number of basis functions.

    Returns:
        :class:`Coefficients`; row i is built from tokens 0..i only.
    """
    fk = real_array("fk", fk, min_ndim=2)
    v = real_array("v", v, min_ndim=2)
    *lead, T, R = fk.shape
    check_length("fk", T)
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


def ratio_readout(fq, coeffs: Coefficients) -> np.ndarray:
    """(I3) o_i = sum_m (fq_i . u_m) gamma_m / sum_m (fq_i . u_m) eta_m, row by row."""
    # --8<-- [start:i3]
    a = np.einsum("...tmr,...tr->...tm", coeffs.U, fq)  # (..., T, M) = U_i fq_i
    num = np.einsum("...tm,...tmd->...td", a, coeffs.Gamma)  # (I3) sum_m (fq . u_m) gamma_m
    den = np.einsum("...tm,...tm->...t", a, coeffs.eta)  # (I3) sum_m (fq . u_m) eta_m
    return num / den[..., None]
    # --8<-- [end:i3]


def interdomain_legs(fq, fk, v, M: int) -> np.ndarray:
    """Interdomain attention with the LegS basis: (I2) coefficients, (I3) ratio readout.

    Args:
        fq, fk: (..., T, R) features; v: (..., T, dv); M: basis size.

    Returns:
        o (..., T, dv).
    """
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    return ratio_readout(fq, basis_coefficients(fk, v, M))


def discrete_coefficients(fk, v, M: int) -> Coefficients:
    """(I7) coefficients on the discrete orthonormal basis of each prefix [decision: causal].

    At position i the history 0..i is projected on G_i = discrete_orthonormal_basis(i+1,
    min(M, i+1)): U_i = G_i^T Xi / (i+1), and likewise Gamma_i, eta_i (= e_0). Columns beyond
    i+1 are zero, so the shapes match :func:`basis_coefficients`.
    """
    fk = real_array("fk", fk, min_ndim=2)
    v = real_array("v", v, min_ndim=2)
    *lead, T, R = fk.shape
    check_length("fk", T)
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


def interdomain_discrete(fq, fk, v, M: int) -> np.ndarray:
    """(I3) with the discrete basis (I7); with M >= T it equals :func:`linear_attention` exactly."""
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    return ratio_readout(fq, discrete_coefficients(fk, v, M))


class LegsGrads(NamedTuple):
    dfq: np.ndarray
    dfk: np.ndarray
    dv: np.ndarray


def interdomain_legs_vjp(fq, fk, v, M: int, d_out) -> LegsGrads:
    """Hand-written backward of :func:`interdomain_legs`.

    With a_i = U_i fq_i, num_i = Gamma_i^T a_i, den_i = eta_i . a_i, o_i = num_i / den_i:
    dnum = dO / den, dden = -<dO, o> / den, da = Gamma dnum + eta dden, dfq = U^T da,
    dU = da fq^T, dGamma = a dnum^T, then the adjoint of the linear projection (I5).
    """
    fq, fk, v = _check_fq_fk_v(fq, fk, v)
    M = positive_int("M", M)
    T = fq.shape[-2]
    d_out = real_array("d_out", d_out, min_ndim=2)
    check_shape("d_out", d_out, v.shape, "shape of the output o")
    co = basis_coefficients(fk, v, M)
    a = np.einsum("...tmr,...tr->...tm", co.U, fq)
    den = np.einsum("...tm,...tm->...t", a, co.eta)
    o = np.einsum("...tm,...tmd->...td", a, co.Gamma) / den[..., None]
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
    return LegsGrads(dfq, dfk, dv)


# --------------------------------------------------------------------------------------------
# The scalable layer: pieces (I8)-(I10)


def short_conv(x, w) -> np.ndarray:
    """(I8) causal depthwise convolution SC(x)_t = sum_s w_s * x_{t-s}, zero-padded, no bias.

    Args:
        x: (..., T, C); w: (K, C), K = 4 in the layer.

    Returns:
        (..., T, C).
    """
    x = real_array("x", x, min_ndim=2)
    w = real_array("w", w, min_ndim=2)
    if w.shape[1] != x.shape[-1]:
        raise ValueError(f"w: expected shape (K, {x.shape[-1]}) (channels of x), got {w.shape}")
    T = x.shape[-2]
    out = np.zeros_like(x)
    # --8<-- [start:i8]
    for s in range(min(w.shape[0], T)):
        out[..., s:, :] += w[s] * x[..., : T - s, :]  # (I8) x_{t-s}, zero for t < s
    # --8<-- [end:i8]
    return out


def feature_map(y, eps: float = 1e-6) -> np.ndarray:
    """(I9) xi(y) = SiLU(y) / sqrt(||y||^2 + eps) over the last axis (the head dim)."""
    y = real_array("y", y, min_ndim=1)
    # --8<-- [start:i9]
    silu = y * expit(y)  # SiLU, stable for large |y|
    return silu / np.sqrt(np.sum(y**2, axis=-1, keepdims=True) + eps)  # (I9)
    # --8<-- [end:i9]


def rms_norm(x, g, eps: float = 1e-6) -> np.ndarray:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g over the last axis."""
    x = real_array("x", x, min_ndim=1)
    g = real_array("g", g, min_ndim=1)
    if g.shape != x.shape[-1:]:
        raise ValueError(f"g: expected shape {x.shape[-1:]} (last axis of x), got {g.shape}")
    # --8<-- [start:i10]
    return x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * g  # (I10)
    # --8<-- [end:i10]


def rope(x) -> np.ndarray:
    """Rotary position embedding on the last axis of x (..., T, R), R even; base 10000."""
    x = real_array("x", x, min_ndim=2)
    T, R = x.shape[-2:]
    if R % 2:
        raise ValueError(f"x: RoPE needs an even head dim, got {R}")
    freq = 10000.0 ** (-np.arange(R // 2) / (R // 2))
    angle = np.arange(T)[:, None] * freq  # (T, R/2)
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    cos, sin = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def s4d_lambda(log_dt, a_log, a_im) -> np.ndarray:
    """(I11) Lambda = exp(dt * a), a = -exp(a_log) + i a_im, dt = exp(log_dt) per head.

    Args:
        log_dt: (H,); a_log, a_im: (H, M).

    Returns:
        Lambda (H, M) complex128.
    """
    log_dt = real_array("log_dt", log_dt, min_ndim=1)
    a_log = real_array("a_log", a_log, min_ndim=2)
    a_im = real_array("a_im", a_im, min_ndim=2)
    check_shape("a_log", a_log, (log_dt.shape[0], a_log.shape[1]), "(H, M), H from log_dt")
    check_shape("a_im", a_im, a_log.shape, "same as a_log")
    # --8<-- [start:i11]
    a = -np.exp(a_log) + 1j * a_im  # (I11)
    return np.exp(np.exp(log_dt)[:, None] * a)  # (I11) Lambda = exp(dt a)
    # --8<-- [end:i11]


# --------------------------------------------------------------------------------------------
# The S4D core (I11)-(I13)


def _check_s4d(fq, kt, vt, lam, b, c):
    fq, kt, vt = _check_fq_fk_v(fq, kt, vt, names=("fq", "kt", "vt"))
    if fq.ndim < 3:
        raise ValueError(f"fq: expected (..., H, T, R) with a head axis, got shape {fq.shape}")
    H = fq.shape[-3]
    lam = complex_array("lam", lam, min_ndim=2)
    if lam.shape[0] != H or lam.ndim != 2:
        raise ValueError(f"lam: expected shape ({H}, M) (H = heads of fq), got {lam.shape}")
    M = lam.shape[1]
    b = complex_array("b", b, min_ndim=2)
    check_shape("b", b, (H, M), "(H, M), as lam")
    c = complex_array("c", c, min_ndim=3)
    check_shape("c", c, (H, M, M), "(H, M, M), M from lam")
    return fq, kt, vt, lam, b, c


def _ssm_inputs(kt, vt, readout):
    """z_t = [k~_t, v~_t] (+ a constant-ones channel for the ratio readout), (..., H, T, C)."""
    # --8<-- [start:ssm-inputs]
    parts = [kt, vt]
    if readout == "ratio":
        parts.append(np.ones((*kt.shape[:-1], 1)))
    return np.concatenate(parts, axis=-1)
    # --8<-- [end:ssm-inputs]


def s4d_states(z, lam, b) -> np.ndarray:
    """(I11) x_t[:, c] = Lambda * x_{t-1}[:, c] + b z_t[c], x_{-1} = 0, sequentially.

    Args:
        z: (..., H, T, C) real inputs; lam, b: (H, M) complex.

    Returns:
        x (..., H, T, M, C) complex128.
    """
    T = z.shape[-2]
    x = np.zeros((*z.shape[:-2], T, lam.shape[1], z.shape[-1]), dtype=np.complex128)
    state = np.zeros(x[..., 0, :, :].shape, dtype=np.complex128)  # (..., H, M, C)
    for t in range(T):
        state = lam[:, :, None] * state + b[:, :, None] * z[..., t, None, :]  # (I11)
        x[..., t, :, :] = state
    return x


def s4d_states_chunked(z, lam, b, chunk: int) -> np.ndarray:
    """(H8) the same states in chunks: within a chunk the convolution form, across chunks
    the carried state x_end * Lambda^(offset+1)."""
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


def s4d_states_fft(z, lam, b) -> np.ndarray:
    """(H8) the convolution form x_t = sum_{s<=t} Lambda^(t-s) b z_s computed with the FFT."""
    T = z.shape[-2]
    n = 2 * T
    kernel = lam[:, None, :] ** np.arange(T)[None, :, None] * b[:, None, :]  # (H, T, M)
    Kf = np.fft.fft(kernel, n=n, axis=-2)  # (H, n, M)
    Zf = np.fft.fft(z, n=n, axis=-2)  # (..., H, n, C)
    return np.fft.ifft(Kf[..., :, None] * Zf[..., :, None, :], axis=-3)[..., :T, :, :]


def interdomain_s4d(fq, kt, vt, lam, b, c, *, readout: str = "linear") -> np.ndarray:
    """The S4D core of the layer, (I11)-(I13).

    Args:
        fq: (..., H, T, R) query features xi(q).
        kt: (..., H, T, R) SSM key inputs k~; vt: (..., H, T, dv) SSM value inputs v~.
        lam, b: (H, M) complex; c: (H, M, M) complex.
        readout: "linear" (denominator-free, the default) or "ratio".

    Returns:
        o (..., H, T, dv) real.
    """
    readout = _check_readout(readout)
    fq, kt, vt, lam, b, c = _check_s4d(fq, kt, vt, lam, b, c)
    R, dv = kt.shape[-1], vt.shape[-1]
    z = _ssm_inputs(kt, vt, readout)
    state = np.zeros((*z.shape[:-2], lam.shape[1], z.shape[-1]), dtype=np.complex128)
    o = np.zeros(vt.shape)
    # --8<-- [start:s4d-core]
    for t in range(z.shape[-2]):
        state = lam[:, :, None] * state + b[:, :, None] * z[..., t, None, :]  # (I11)
        Y = c @ state  # (I12) (..., H, M, C)
        a = np.einsum("...mr,...r->...m", Y[..., :R], fq[..., t, :])  # U_t fq_t
        num = np.einsum("...m,...md->...d", a.conj(), Y[..., R : R + dv]).real  # (I13)
        if readout == "ratio":
            den = np.einsum("...m,...m->...", a.conj(), Y[..., R + dv]).real
            num = num / den[..., None]
        o[..., t, :] = num
    # --8<-- [end:s4d-core]
    return o


def interdomain_s4d_oracle(fq, kt, vt, lam, b, c, *, readout: str = "linear") -> np.ndarray:
    """H9: the O(T^2) double-sum form, written independently of the recurrence.

    o_t = Re sum_{s,s'<=t} (fq_t . kt_s) w(t-s, t-s') vt_s',
    w(p, p') = (conj(Lambda)^p conj(b))^T C^H C (Lambda^p' b); the ratio readout divides by the
    same sum with vt replaced by 1.
    """
    readout = _check_readout(readout)
    fq, kt, vt, lam, b, c = _check_s4d(fq, kt, vt, lam, b, c)
    T = fq.shape[-2]
    K = np.einsum("hmn,hpn->hpm", c, lam[:, None, :] ** np.arange(T)[None, :, None] * b[:, None])
    w = np.einsum("hpm,hqm->hpq", K.conj(), K)  # H9: (H, T, T) w(p, p')
    o = np.zeros(vt.shape)
    for t in range(T):
        lag = t - np.arange(t + 1)  # p = t - s for s = 0..t
        W = w[:, lag][:, :, lag]  # (H, t+1, t+1)
        scores = np.einsum("...hr,...hsr->...hs", fq[..., t, :], kt[..., : t + 1, :])
        num = np.einsum("...hs,hsu,...hud->...hd", scores, W, vt[..., : t + 1, :]).real
        if readout == "ratio":
            den = np.einsum("...hs,hsu->...h", scores, W).real
            num = num / den[..., None]
        o[..., t, :] = num
    return o


class S4DGrads(NamedTuple):
    """Cotangents of :func:`interdomain_s4d`; dlam, db, dc are dL/dRe + i dL/dIm."""

    dfq: np.ndarray
    dkt: np.ndarray
    dvt: np.ndarray
    dlam: np.ndarray
    db: np.ndarray
    dc: np.ndarray


def interdomain_s4d_vjp(fq, kt, vt, lam, b, c, d_out, *, readout: str = "linear") -> S4DGrads:
    """Hand-written backward of :func:`interdomain_s4d`.

    Rules for a real loss, with g(z) = dL/dRe z + i dL/dIm z: y = Re(conj(a) . g) gives
    g(a) = Gamma dO, g(Gamma) = a dO^T; Y = C x gives g(x) = C^H g(Y), g(C) = sum_t g(Y_t) x_t^H;
    the recurrence is run backwards with gx_t = C^H g(Y_t) + conj(Lambda) gx_{t+1}, then
    g(Lambda) = sum_t conj(x_{t-1}) gx_t, g(b) = sum_t gx_t z_t, dz_t = Re(conj(b) gx_t).
    """
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
        o = num / den[..., None]
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
    return S4DGrads(dfq, dz[..., :R], dz[..., R : R + dv], glam, gb, gc)


# --------------------------------------------------------------------------------------------
# Decoding with a fixed-size state (H6)


class InterdomainDecoder:
    """Step-by-step decode of :func:`interdomain_s4d`; the state x (..., H, M, C) never grows."""

    def __init__(self, lam, b, c, *, readout: str = "linear"):
        self.readout = _check_readout(readout)
        self.lam = complex_array("lam", lam, min_ndim=2)
        H, M = self.lam.shape
        self.b = complex_array("b", b, min_ndim=2)
        check_shape("b", self.b, (H, M), "(H, M), as lam")
        self.c = complex_array("c", c, min_ndim=3)
        check_shape("c", self.c, (H, M, M), "(H, M, M), M from lam")
        self.state: np.ndarray | None = None

    def state_size(self) -> int:
        """Real numbers held per head: 2 M (R + dv [+ 1 for the ratio channel]); 0 before step."""
        if self.state is None:
            return 0
        return 2 * self.state.shape[-2] * self.state.shape[-1]

    def step(self, fq, kt, vt) -> np.ndarray:
        """Consume one token: fq, kt (..., H, R), vt (..., H, dv). Returns o_t (..., H, dv)."""
        fq = real_array("fq", fq, min_ndim=1)
        kt = real_array("kt", kt, min_ndim=1)
        vt = real_array("vt", vt, min_ndim=1)
        check_shape("kt", kt, fq.shape, "same as fq")
        if vt.shape[:-1] != fq.shape[:-1]:
            raise ValueError(f"vt: expected shape {fq.shape[:-1]} + (dv,), got {vt.shape}")
        R, dv = kt.shape[-1], vt.shape[-1]
        z = _ssm_inputs(kt[..., None, :], vt[..., None, :], self.readout)[..., 0, :]
        if self.state is None:
            self.state = np.zeros((*z.shape[:-1], self.lam.shape[1], z.shape[-1]), complex)
        elif self.state.shape[-1] != z.shape[-1] or self.state.shape[:-2] != z.shape[:-1]:
            raise ValueError(f"step: inputs changed shape from the first step ({z.shape})")
        self.state = (
            self.lam[:, :, None] * self.state + self.b[:, :, None] * z[..., None, :]
        )  # (I11)
        Y = self.c @ self.state  # (I12)
        a = np.einsum("...mr,...r->...m", Y[..., :R], fq)
        o = np.einsum("...m,...md->...d", a.conj(), Y[..., R : R + dv]).real  # (I13)
        if self.readout == "ratio":
            o = o / np.einsum("...m,...m->...", a.conj(), Y[..., R + dv]).real[..., None]
        return o


# --------------------------------------------------------------------------------------------
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
    "wg": "(d, H*dv) output gate, only with gate=True (I13)",
}


def init_interdomain_params(
    d: int, H: int, R: int, dv: int, M: int, seed: int = 0, *, gate: bool = False
) -> dict[str, np.ndarray]:
    """Parameters of :func:`interdomain_layer` (schema :data:`PARAMETER_SCHEMA`), S4D-Inv init.

    a_log = log(1/2), a_im by S4D-Inv, log_dt ~ U[log 1e-3, log 1e-1], b = 1,
    C ~ complex normal / sqrt(M); projections ~ normal / sqrt(fan-in); conv ~ normal / 2.
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
    if gate:
        p["wg"] = rng.standard_normal((d, H * dv)) / np.sqrt(d)
    return p


def _split_heads(x, H):
    *lead, T, D = x.shape
    return np.swapaxes(x.reshape(*lead, T, H, D // H), -2, -3)  # (..., H, T, D/H)


def interdomain_layer(
    x, params: dict, *, readout: str = "linear", use_rope: bool = False, gate: bool = False
) -> np.ndarray:
    """The Interdomain layer (I8)-(I13): x (B, T, d) -> y (B, T, d).

    Projections, short conv on q and k (I8), optional RoPE, feature map (I9), norms and biases
    (I10), the S4D core (I11)-(I13), optional output gate, output projection.
    """
    x = real_array("x", x, min_ndim=3)
    missing = sorted(set(PARAMETER_SCHEMA) - {"wg"} - set(params)) + (
        ["wg"] if gate and "wg" not in params else []
    )
    if missing:
        raise ValueError(f"params: missing {missing}; see PARAMETER_SCHEMA")
    P = {name: real_array(f"params[{name!r}]", val) for name, val in params.items()}
    d = x.shape[-1]
    H, R = P["norm_k_g"].shape
    dv = P["norm_v_g"].shape[1]
    M = P["a_log"].shape[1]
    expected = {
        "wq": (d, H * R),
        "wk": (d, H * R),
        "wv": (d, H * dv),
        "wo": (H * dv, d),
        "conv_q": (4, H * R),
        "conv_k": (4, H * R),
        "norm_k_b": (H, R),
        "norm_v_b": (H, dv),
        "log_dt": (H,),
        "a_im": (H, M),
        "b_re": (H, M),
        "b_im": (H, M),
        "c_re": (H, M, M),
        "c_im": (H, M, M),
        "wg": (d, H * dv),
    }
    for name, shape in expected.items():
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
    o = interdomain_s4d(
        fq, kt, vt, lam, P["b_re"] + 1j * P["b_im"], P["c_re"] + 1j * P["c_im"], readout=readout
    )  # (B, H, T, dv)
    o = np.swapaxes(o, -2, -3).reshape(*x.shape[:-1], H * dv)  # concatenate heads
    if gate:
        g = x @ P["wg"]
        o = g * expit(g) * o  # SiLU(W_g x) * o
    return o @ P["wo"]
    # --8<-- [end:layer]


__all__ = [
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
    "interdomain_s4d",
    "interdomain_s4d_oracle",
    "interdomain_s4d_vjp",
    "linear_attention",
    "ratio_readout",
    "rms_norm",
    "rope",
    "s4d_lambda",
    "s4d_states",
    "s4d_states_chunked",
    "s4d_states_fft",
    "short_conv",
]
