"""Eager twins of the Interdomain kernels: the S4D core and the LegS projection, in chunks.

Registered as impl "eager" of ``s4d_fwd``, ``s4d_bwd``, ``legs_fwd`` and ``legs_bwd``
(signatures in :mod:`.dispatch`). Both are linear recurrences read out by a query, computed
chunk by chunk: inside a chunk of L tokens by matmuls against the chunk's transition kernel,
across chunks by passing the state, so no per-token state is ever materialised.

S4D (I11)-(I13). With W = C^H C, alpha_t = x^K_t xi(q_t) and beta_t = W alpha_t, the readout is
o_t = Re(beta_t^H x^V_t) (divided by the ones channel's readout for "ratio"). Inside a chunk
starting at t0 with carried state x, x_t = Lambda^(t-t0+1) x + sum_{s<=t} Lambda^(t-s) b z_s,
so alpha_t and o_t are sums over s <= t with weights Lambda^(t-s): a Toeplitz kernel, applied as
a matmul with the powers Lambda^p once the (t, s) matrices are re-indexed by lag (``lag_major``);
powers of |Lambda| <= 1 by cumulative products (non-positive exponents: nothing overflows).
Complex numbers are torch complex tensors inside (complex64 for float32 and narrower inputs,
complex128 for float64).

LegS (I2), (I3), (I5). The exact steps c_n = E_n c_{n-1} + F_n f_n are time-varying; a chunk
uses their products P_t = E_t ... E_{t0} (applied to the carried state) and
K[t, s] = E_t ... E_{s+1} F_s, built once from :func:`attnspec.reference.hippo.legs_step` in
float64 and cached per (M, chunk). By (I6) eta = e_0, so the denominator is a_t[0].

Backward, hand-written: reverse state passing. The states at the chunk starts are recomputed,
then the chunks are visited last to first, each recomputed from its carried state and
differentiated with the incoming state cotangent. Complex cotangents are g(z) = dL/dRe z +
i dL/dIm z (the reference's convention): for w = u v, g(u) += g(w) conj(v); for
w = Lambda^p, g(Lambda) += g(w) conj(p Lambda^(p-1)). Conjugates are materialised
(``conj_physical``): lazy conjugate views gave wrong numbers inside the custom op once
AOTAutograd ran it (torch 2.13, caught by ``opcheck``).

Cost per batch-head: S4D time O(T (L M + M (R + V + M))), LegS O(T (L M + M^2 + M (R + V))),
memory O(L^2 + L M (R + V)) for S4D and O(L^2 M + L M (R + V)) for LegS, one chunk at a time.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from attnspec.reference import hippo
from attnspec.reference.packing import Packing

from ..tile_sizes import EAGER_CHUNK
from . import dispatch
from .eager_fpa import segments


def ratio(num: Tensor, den: Tensor, names: str, t0: int) -> Tensor:
    """num / den [N, H, L, 1] row by row in a chunk starting at t0; an exactly zero denominator
    is a ValueError, as in the reference (the ratio is undefined there)."""
    zero = den == 0
    if zero.any():
        n, h, t, _ = (int(i) for i in zero.nonzero()[0])
        raise ValueError(
            f"{names}: the ratio readout's denominator is 0 at batch {n}, head {h}, token "
            f"{t0 + t} of its sequence; use features that keep it away from 0 (e.g. positive)"
        )
    return num / den


class ChunkedScan(Protocol):
    """A recurrence in chunks of ``size`` along the time axis (axis 2 of every input)."""

    size: int

    def advance(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> list[Tensor]:
        """The carry after the chunk starting at t0."""
        ...

    def step(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> tuple[Tensor, list[Tensor]]:
        """(output [N, H, L, V], carry after the chunk)."""
        ...

    def step_vjp(
        self, xs: list[Tensor], carry: list[Tensor], t0: int, d_out: Tensor, d_carry: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """(d xs, d carry before the chunk, d parameters) of one chunk."""
        ...


def scan(model: ChunkedScan, xs: list[Tensor], carry: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """Run ``model`` over the whole time axis; returns (outputs along T, final carry)."""
    T, size = xs[0].shape[2], model.size
    outputs = []
    for t0 in range(0, T, size):
        out, carry = model.step([x[:, :, t0 : t0 + size] for x in xs], carry, t0)
        outputs.append(out)
    return torch.cat(outputs, dim=2), carry


def scan_vjp(
    model: ChunkedScan, xs: list[Tensor], carry: list[Tensor], d_out: Tensor, d_carry: list[Tensor]
) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
    """Cotangents of :func:`scan` by reverse state passing.

    Returns:
        (d xs, d initial carry, d parameters summed over the chunks).
    """
    T, size = xs[0].shape[2], model.size
    starts = list(range(0, T, size))
    carries = [carry]
    for t0 in starts[:-1]:
        carries.append(model.advance([x[:, :, t0 : t0 + size] for x in xs], carries[-1], t0))
    d_xs = [torch.empty_like(x) for x in xs]
    d_params: list[Tensor] = []
    for t0, start in zip(reversed(starts), reversed(carries), strict=True):
        part = [x[:, :, t0 : t0 + size] for x in xs]
        grads, d_carry, d_p = model.step_vjp(part, start, t0, d_out[:, :, t0 : t0 + size], d_carry)
        for d, g in zip(d_xs, grads, strict=True):
            d[:, :, t0 : t0 + size] = g
        d_params = [a + b for a, b in zip(d_params, d_p, strict=True)] if d_params else d_p
    return d_xs, d_carry, d_params


# S4D


def lag_major(x: Tensor) -> Tensor:
    """[..., L, L] -> [..., L, L]: y[t, p] = x[t, t - p] for p <= t, 0 above the diagonal.

    Re-indexes a causal (t, s) matrix by lag p = t - s, so that a Toeplitz kernel
    Lambda^(t-s) becomes the plain matrix of powers Lambda^p. It is an involution on the lower
    triangle, hence also its own adjoint.
    """
    L = x.shape[-1]
    t = torch.arange(L, device=x.device)
    lag = t[:, None] - t[None, :]
    y = torch.gather(x, -1, lag.clamp_min(0).expand(x.shape))
    return y * (lag >= 0)


class S4DScan:
    """(I11)-(I13) in chunks. Inputs fq, kt [N, H, L, R] and zv [N, H, L, V'] (the values, plus
    a ones channel for "ratio"); carry x^K [N, H, M, R], x^V [N, H, M, V'] complex; parameters
    lam, b [H, M] and W = C^H C [H, M, M] complex.

    The chunk's kernel Lambda^(t-s) is Toeplitz: sums over s <= t of a(t, s) Lambda^(t-s) are
    matmuls of ``lag_major(a)`` [L, L] with the powers Lambda^p [L, M], so no [L, L, M] tensor
    is formed.
    """

    def __init__(self, lam: Tensor, b: Tensor, W: Tensor, readout: str, size: int):
        self.lam, self.b, self.W, self.readout, self.size = lam, b, W, readout, size
        H, M = lam.shape
        ones = torch.ones(H, 1, M, dtype=lam.dtype, device=lam.device)
        self.powers = torch.cat([ones, lam[:, None].expand(H, size, M)], 1).cumprod(1)  # Lambda^p

    def _decays(self, L: int) -> tuple[Tensor, Tensor, Tensor]:
        powers = self.powers[:, : L + 1]  # Lambda^p, p = 0..L: [H, L + 1, M]
        decay = powers[:, 1:]  # Lambda^(t+1): the carried state to token t
        back = powers[:, :L].flip(1)  # Lambda^(L-1-s): token s to the chunk's end
        return powers, decay, back

    def advance(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> list[Tensor]:
        _, kt, zv = xs
        xK, xV = carry
        L = kt.shape[2]
        _, decay, back = self._decays(L)
        inflow = back * self.b[:, None]  # Lambda^(t1-s) b: [H, L, M]
        last = decay[None, :, L - 1, :, None]  # Lambda^L
        xK_next = last * xK + torch.einsum("hsm,nhsr->nhmr", inflow, kt.to(inflow.dtype))  # (I11)
        xV_next = last * xV + torch.einsum("hsm,nhsv->nhmv", inflow, zv.to(inflow.dtype))
        return [xK_next, xV_next]

    def step(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> tuple[Tensor, list[Tensor]]:
        fq, kt, zv = xs
        xK, xV = carry
        b, W = self.b, self.W
        L = fq.shape[2]
        powers, decay, _ = self._decays(L)
        cdtype = powers.dtype
        y = fq.to(cdtype) @ xK.transpose(-1, -2)  # carried keys read by xi(q_t): [N, H, L, M]
        scores = fq @ kt.transpose(-1, -2)  # xi(q_t) . k~_s
        Q = lag_major(scores).to(cdtype) @ powers[:, :L]  # the chunk's own keys
        alpha = decay * y + b[:, None] * Q  # x^K_t xi(q_t)
        beta_bar = (alpha @ W.transpose(-1, -2)).conj_physical()  # conj(W alpha_t)
        # (I13) Re(beta_t^H x^V_t): the carried values, then the chunk's own values
        num = ((beta_bar * decay) @ xV).real
        weights = lag_major(((beta_bar * b[:, None]) @ powers[:, :L].transpose(-1, -2)).real)
        num = num + weights @ zv
        if self.readout == "ratio":
            num = ratio(num[..., :-1], num[..., -1:], "fq, kt", t0)
        return num, self.advance(xs, carry, t0)

    def step_vjp(
        self, xs: list[Tensor], carry: list[Tensor], t0: int, d_out: Tensor, d_carry: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        fq, kt, zv = xs
        xK, xV = carry
        gK_next, gV_next = d_carry
        b, W = self.b, self.W
        L = fq.shape[2]
        powers, decay, back = self._decays(L)
        cdtype = powers.dtype
        pw = powers[:, :L]  # Lambda^p, p = 0..L-1
        inflow = back * b[:, None]
        fq_c, kt_c, zv_c = fq.to(cdtype), kt.to(cdtype), zv.to(cdtype)
        # recompute the forward's intermediates
        y = fq_c @ xK.transpose(-1, -2)
        scores_lag = lag_major(fq @ kt.transpose(-1, -2))
        Q = scores_lag.to(cdtype) @ pw
        alpha = decay * y + b[:, None] * Q
        beta_bar = (alpha @ W.transpose(-1, -2)).conj_physical()
        u = beta_bar * decay
        X = beta_bar * b[:, None]
        weights = lag_major((X @ pw.transpose(-1, -2)).real)
        # readout
        if self.readout == "linear":
            g_num = d_out
        else:
            num = (u @ xV).real + weights @ zv
            den, o = num[..., -1:], num[..., :-1] / num[..., -1:]
            g_num = torch.cat([d_out / den, -(d_out * o).sum(-1, keepdim=True) / den], dim=-1)
        g_num_c = g_num.to(cdtype)
        # num = Re(u x^V) + lag_major(Re(X pw^T)) zv, u = beta_bar decay, X = beta_bar b
        g_u = g_num_c @ xV.conj_physical().transpose(-1, -2)
        g_xV = u.conj_physical().transpose(-1, -2) @ g_num_c
        g_beta_bar = g_u * decay.conj_physical()
        g_decay = (g_u * beta_bar.conj_physical()).sum(0)
        g_zv = weights.transpose(-1, -2) @ g_num
        g_lagged = lag_major(g_num @ zv.transpose(-1, -2)).to(cdtype)  # g(X pw^T)
        g_X = g_lagged @ pw.conj_physical()
        g_pw = torch.einsum("nhtm,nhtp->hpm", X.conj_physical(), g_lagged)
        g_beta_bar = g_beta_bar + g_X * b.conj_physical()[:, None]
        g_b = (g_X * beta_bar.conj_physical()).sum((0, 2))
        # beta_bar = conj(alpha W^T)
        g_beta = g_beta_bar.conj_physical()
        g_alpha = g_beta @ W.conj_physical()
        g_W = torch.einsum("nhtm,nhtk->hmk", g_beta, alpha.conj_physical())
        # alpha = decay y + b Q, y = fq x^K^T, Q = lag_major(scores) pw
        g_decay = g_decay + (g_alpha * y.conj_physical()).sum(0)
        g_y = g_alpha * decay.conj_physical()
        g_b = g_b + (g_alpha * Q.conj_physical()).sum((0, 2))
        g_Q = g_alpha * b.conj_physical()[:, None]
        g_xK = g_y.transpose(-1, -2) @ fq_c
        g_fq = (g_y @ xK.conj_physical()).real
        g_scores = lag_major((g_Q @ pw.conj_physical().transpose(-1, -2)).real)
        g_pw = g_pw + torch.einsum("nhtp,nhtm->hpm", scores_lag.to(cdtype), g_Q)
        g_fq = g_fq + g_scores @ kt
        g_kt = g_scores.transpose(-1, -2) @ fq
        # the carried state after the chunk: Lambda^L x + sum_s inflow_s z_s
        last = decay[:, L - 1]
        g_xK = g_xK + last.conj_physical()[None, :, :, None] * gK_next
        g_xV = g_xV + last.conj_physical()[None, :, :, None] * gV_next
        g_last = (gK_next * xK.conj_physical()).sum((0, 3))
        g_last = g_last + (gV_next * xV.conj_physical()).sum((0, 3))
        g_inflow = torch.einsum("nhmr,nhsr->hsm", gK_next, kt_c)
        g_inflow = g_inflow + torch.einsum("nhmv,nhsv->hsm", gV_next, zv_c)
        g_kt = g_kt + torch.einsum("hsm,nhmr->nhsr", inflow.conj_physical(), gK_next).real
        g_zv = g_zv + torch.einsum("hsm,nhmv->nhsv", inflow.conj_physical(), gV_next).real
        g_b = g_b + (g_inflow * back.conj_physical()).sum(1)
        # the powers Lambda^p: collect g(Lambda^p), then g(Lambda) = sum_p g conj(p Lambda^(p-1))
        g_powers = torch.zeros_like(powers)
        g_powers[:, :L] += g_pw
        g_powers[:, 1:] += g_decay
        g_powers[:, L] += g_last
        g_powers[:, :L] += (g_inflow * b.conj_physical()[:, None]).flip(1)
        p = torch.arange(1, L + 1, device=fq.device, dtype=fq.dtype)[None, :, None]
        g_lam = (g_powers[:, 1:] * (p * powers[:, :L]).conj_physical()).sum(1)
        return [g_fq, g_kt, g_zv], [g_xK, g_xV], [g_lam, g_b, g_W]


def _heads_first(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, T, H, D] -> [B, H, T, D] in ``dtype``."""
    return x.permute(0, 2, 1, 3).to(dtype)


def _time_second(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, H, T, D] -> [B, T, H, D], contiguous, in ``dtype``."""
    return x.permute(0, 2, 1, 3).to(dtype).contiguous()


def _as_complex(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[..., 2] real (re, im) -> [...] complex of the real ``dtype``."""
    return torch.view_as_complex(x.to(dtype).contiguous())


def _as_real(x: Tensor, dtype: torch.dtype) -> Tensor:
    """[...] complex -> [..., 2] real (re, im) in ``dtype``, contiguous."""
    return torch.view_as_real(x.contiguous()).to(dtype).contiguous()


def _s4d_inputs(
    fq: Tensor, kt: Tensor, vt: Tensor, readout: str, dtype: torch.dtype
) -> list[Tensor]:
    """fq, kt, and the value channels zv = [v~ (, 1)], all [B, H, T, .] in ``dtype``."""
    zv = _heads_first(vt, dtype)
    if readout == "ratio":
        zv = torch.cat([zv, torch.ones_like(zv[..., :1])], dim=3)
    return [_heads_first(fq, dtype), _heads_first(kt, dtype), zv]


def _rows_of(packing: Packing | None) -> slice:
    """The batch rows of a sequence: all of B, or row 0 (B = 1) for packed sequences."""
    return slice(None) if packing is None else slice(0, 1)


def _states(
    state: Tensor | None,
    n: int,
    packing: Packing | None,
    shape: tuple[int, int, int, int],
    R: int,
    like: Tensor,
) -> list[Tensor]:
    """The carried (x^K, x^V) of sequence n, [rows, H, M, R] and [rows, H, M, C - R]: zeros
    (complex, on the device of ``like``), or split from ``state`` [N, H, M, C]."""
    if state is None:
        zeros = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return [zeros[..., :R], zeros[..., R:]]
    rows = slice(None) if packing is None else slice(n, n + 1)
    return [state[rows, ..., :R], state[rows, ..., R:]]


def _s4d_setup(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    chunk: int | None,
) -> tuple[torch.dtype, Tensor, S4DScan, list[Tensor]]:
    chunk = EAGER_CHUNK["s4d"] if chunk is None else chunk
    dtype = torch.promote_types(torch.promote_types(fq.dtype, torch.float32), lam.dtype)
    lam_c, b_c, c_c = (_as_complex(p, dtype) for p in (lam, b, c))
    model = S4DScan(
        lam_c, b_c, c_c.transpose(-1, -2).conj_physical() @ c_c, readout, chunk
    )  # W = C^H C
    return dtype, c_c, model, _s4d_inputs(fq, kt, vt, readout, dtype)


@dispatch.register("s4d_fwd", "eager")
def s4d_fwd(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    packing: Packing | None,
    initial_state: Tensor | None,
    return_saved: bool = False,
    *,
    chunk: int | None = None,
) -> tuple[Any, ...]:
    """(I11)-(I13) in chunks: fq, kt [B, T, H, R], vt [B, T, H, V]; lam, b [H, M, 2] and
    c [H, M, M, 2] real ((re, im) in the last axis) in float32 or wider; readout "linear" or
    "ratio"; initial_state [N, H, M, C, 2] (N sequences, C = R + V, + 1 for "ratio") or None.
    Returns o [B, T, H, V] in fq's dtype and the final state [N, H, M, C, 2] in the
    parameters' dtype; with return_saved also ``saved``, the tensors an implementation keeps
    for its backward (empty here: the eager backward keeps nothing from the forward)."""
    B, T, H, R = fq.shape
    V = vt.shape[3]
    dtype, _, model, xs = _s4d_setup(fq, kt, vt, lam, b, c, readout, chunk)
    state = None if initial_state is None else _as_complex(initial_state, dtype)
    o = xs[0].new_empty(B, H, T, V)
    finals = []
    for n, (bos, eos) in enumerate(segments(packing, T)):
        rows = _rows_of(packing)
        part = [x[rows, :, bos:eos] for x in xs]
        shape = (part[0].shape[0], H, model.lam.shape[1], R + xs[2].shape[3])
        carry = _states(state, n, packing, shape, R, model.lam)
        o[rows, :, bos:eos], carry = scan(model, part, carry)
        finals.append(torch.cat(carry, dim=3))
    out = _time_second(o, fq.dtype), _as_real(torch.cat(finals), lam.dtype)
    return (*out, []) if return_saved else out


@dispatch.register("s4d_bwd", "eager")
def s4d_bwd(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    packing: Packing | None,
    initial_state: Tensor | None,
    do: Tensor,
    dfinal_state: Tensor | None,
    saved: list[Tensor] | None = None,
    *,
    chunk: int | None = None,
) -> tuple[Tensor | None, ...]:
    """Cotangents of :func:`s4d_fwd`: dfq, dkt, dvt, dlam, db, dc, dinitial_state (None without
    an initial state), shaped and typed like the inputs; complex ones as (re, im) pairs of
    (dL/dRe, dL/dIm); ``dfinal_state`` may be None. ``saved``: what the forward of the same
    implementation on the same inputs returned, or None / [] (recompute); an implementation
    ignores what it does not use, this one all of it (a backward that falls back to this one
    may get another implementation's)."""
    T, H, R = fq.shape[1:]
    V = vt.shape[3]
    dtype, c_c, model, xs = _s4d_setup(fq, kt, vt, lam, b, c, readout, chunk)
    d_out = _heads_first(do, dtype)
    state = None if initial_state is None else _as_complex(initial_state, dtype)
    d_final = None if dfinal_state is None else _as_complex(dfinal_state, dtype)
    d_xs = [torch.empty_like(x) for x in xs]
    d_params = [torch.zeros_like(p) for p in (model.lam, model.b, model.W)]
    d_initial = []
    for n, (bos, eos) in enumerate(segments(packing, T)):
        rows = _rows_of(packing)
        part = [x[rows, :, bos:eos] for x in xs]
        shape = (part[0].shape[0], H, model.lam.shape[1], R + xs[2].shape[3])
        carry = _states(state, n, packing, shape, R, model.lam)
        d_carry = _states(d_final, n, packing, shape, R, model.lam)
        grads, d_start, d_p = scan_vjp(model, part, carry, d_out[rows, :, bos:eos], d_carry)
        for d, g in zip(d_xs, grads, strict=True):
            d[rows, :, bos:eos] = g
        d_params = [a + g for a, g in zip(d_params, d_p, strict=True)]
        d_initial.append(torch.cat(d_start, dim=3))
    d_lam, d_b, d_W = d_params
    d_c = c_c @ (d_W + d_W.transpose(-1, -2).conj_physical())  # W = C^H C
    return (
        _time_second(d_xs[0], fq.dtype),
        _time_second(d_xs[1], kt.dtype),
        _time_second(d_xs[2][..., :V], vt.dtype),
        _as_real(d_lam, lam.dtype),
        _as_real(d_b, b.dtype),
        _as_real(d_c, c.dtype),
        None if initial_state is None else _as_real(torch.cat(d_initial), initial_state.dtype),
    )


# LegS


_LEGS_CONSTANTS: dict[tuple, list[tuple[Tensor, Tensor]]] = {}


def _legs_products(M: int, L: int, index: int) -> tuple[Tensor, Tensor]:
    """Chunk ``index`` (tokens n = index L + 1 ... index L + L, 1-based) in float64, from
    ``hippo.legs_chunk_products``: P [L, M, M], P_t = E_t ... E_{t0}; K [L, L, M],
    K[t, s] = E_t ... E_{s+1} F_s (0 for s > t)."""
    P, K = hippo.legs_chunk_products(M, L, (index + 1) * L, index * L)
    return torch.from_numpy(P), torch.from_numpy(K)


def legs_constants(
    M: int, L: int, index: int, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, Tensor]:
    """(P, K) of chunk ``index`` in ``dtype`` on ``device``: built in float64 once and cached.

    The cache holds T (M^2 + L M) numbers per (M, L, dtype, device) for the longest T seen.
    """
    cached = _LEGS_CONSTANTS.setdefault((M, L, dtype, torch.device(device)), [])
    while len(cached) <= index:
        P, K = _legs_products(M, L, len(cached))
        cached.append((P.to(device, dtype), K.to(device, dtype)))
    return cached[index]


class LegSScan:
    """(I5) with the ratio readout (I3) in chunks. Inputs fq, fk [N, H, L, R], v [N, H, L, V];
    carry U [N, H, M, R], Gamma [N, H, M, V]; no parameters."""

    def __init__(self, M: int, size: int):
        self.M, self.size = M, size

    def _constants(self, t0: int, L: int, like: Tensor) -> tuple[Tensor, Tensor]:
        P, K = legs_constants(self.M, self.size, t0 // self.size, like.dtype, like.device)
        return P[:L], K[:L, :L]

    def advance(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> list[Tensor]:
        _, fk, v = xs
        U, Gamma = carry
        P, K = self._constants(t0, fk.shape[2], fk)
        U_next = torch.einsum("mk,nhkr->nhmr", P[-1], U) + torch.einsum("sm,nhsr->nhmr", K[-1], fk)
        Gamma_next = torch.einsum("mk,nhkv->nhmv", P[-1], Gamma)
        return [U_next, Gamma_next + torch.einsum("sm,nhsv->nhmv", K[-1], v)]  # (I5)

    def step(self, xs: list[Tensor], carry: list[Tensor], t0: int) -> tuple[Tensor, list[Tensor]]:
        fq, fk, v = xs
        U, Gamma = carry
        P, K = self._constants(t0, fq.shape[2], fq)
        # a_t = U_t xi(q_t): the carried coefficients, then the chunk's own keys
        y = torch.einsum("nhkr,nhtr->nhtk", U, fq)
        scores = torch.einsum("nhtr,nhsr->nhts", fq, fk)
        a = torch.einsum("tmk,nhtk->nhtm", P, y) + torch.einsum("nhts,tsm->nhtm", scores, K)
        # (I3) Gamma_t^T a_t over eta_t . a_t = a_t[0] (I6)
        z = torch.einsum("tkm,nhtk->nhtm", P, a)
        weights = torch.einsum("nhtm,tsm->nhts", a, K)
        num = torch.einsum("nhtm,nhmv->nhtv", z, Gamma) + torch.einsum(
            "nhts,nhsv->nhtv", weights, v
        )
        return ratio(num, a[..., :1], "fq, fk", t0), self.advance(xs, carry, t0)

    def step_vjp(
        self, xs: list[Tensor], carry: list[Tensor], t0: int, d_out: Tensor, d_carry: list[Tensor]
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        fq, fk, v = xs
        U, Gamma = carry
        gU_next, gGamma_next = d_carry
        P, K = self._constants(t0, fq.shape[2], fq)
        y = torch.einsum("nhkr,nhtr->nhtk", U, fq)
        scores = torch.einsum("nhtr,nhsr->nhts", fq, fk)
        a = torch.einsum("tmk,nhtk->nhtm", P, y) + torch.einsum("nhts,tsm->nhtm", scores, K)
        z = torch.einsum("tkm,nhtk->nhtm", P, a)
        weights = torch.einsum("nhtm,tsm->nhts", a, K)
        num = torch.einsum("nhtm,nhmv->nhtv", z, Gamma) + torch.einsum(
            "nhts,nhsv->nhtv", weights, v
        )
        den = a[..., :1]
        # o = num / a_0
        g_num = d_out / den
        g_den = -(d_out * num).sum(-1, keepdim=True) / den**2
        g_z = torch.einsum("nhtv,nhmv->nhtm", g_num, Gamma)
        g_Gamma = torch.einsum("nhtm,nhtv->nhmv", z, g_num)
        g_weights = torch.einsum("nhtv,nhsv->nhts", g_num, v)
        g_v = torch.einsum("nhts,nhtv->nhsv", weights, g_num)
        g_a = torch.einsum("tkm,nhtm->nhtk", P, g_z) + torch.einsum("nhts,tsm->nhtm", g_weights, K)
        g_a[..., :1] += g_den
        g_y = torch.einsum("tmk,nhtm->nhtk", P, g_a)
        g_scores = torch.einsum("nhtm,tsm->nhts", g_a, K)
        g_U = torch.einsum("nhtk,nhtr->nhkr", g_y, fq)
        g_fq = torch.einsum("nhtk,nhkr->nhtr", g_y, U) + torch.einsum(
            "nhts,nhsr->nhtr", g_scores, fk
        )
        g_fk = torch.einsum("nhts,nhtr->nhsr", g_scores, fq)
        # the carried coefficients after the chunk
        g_U = g_U + torch.einsum("mk,nhmr->nhkr", P[-1], gU_next)
        g_Gamma = g_Gamma + torch.einsum("mk,nhmv->nhkv", P[-1], gGamma_next)
        g_fk = g_fk + torch.einsum("sm,nhmr->nhsr", K[-1], gU_next)
        g_v = g_v + torch.einsum("sm,nhmv->nhsv", K[-1], gGamma_next)
        return [g_fq, g_fk, g_v], [g_U, g_Gamma], []


def _legs_setup(
    fq: Tensor, fk: Tensor, v: Tensor, M: int, chunk: int | None
) -> tuple[LegSScan, list[Tensor]]:
    chunk = EAGER_CHUNK["legs"] if chunk is None else chunk
    dtype = torch.promote_types(fq.dtype, torch.float32)
    xs = [_heads_first(fq, dtype), _heads_first(fk, dtype), _heads_first(v, dtype)]
    return LegSScan(M, chunk), xs


def _legs_zeros(part: list[Tensor], M: int) -> list[Tensor]:
    N, H = part[0].shape[:2]
    return [part[0].new_zeros(N, H, M, x.shape[3]) for x in part[1:]]


@dispatch.register("legs_fwd", "eager")
def legs_fwd(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    M: int,
    packing: Packing | None,
    *,
    chunk: int | None = None,
) -> Tensor:
    """(I2), (I3), (I5) in chunks: fq, fk [B, T, H, R], v [B, T, H, V]; o [B, T, H, V] in fq's
    dtype."""
    model, xs = _legs_setup(fq, fk, v, M, chunk)
    o = torch.empty_like(xs[2])
    for bos, eos in segments(packing, fq.shape[1]):
        rows = _rows_of(packing)
        part = [x[rows, :, bos:eos] for x in xs]  # each sequence starts at n = 1
        o[rows, :, bos:eos], _ = scan(model, part, _legs_zeros(part, M))
    return _time_second(o, fq.dtype)


@dispatch.register("legs_bwd", "eager")
def legs_bwd(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    M: int,
    packing: Packing | None,
    do: Tensor,
    *,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Cotangents of :func:`legs_fwd`: dfq, dfk, dv shaped and typed like the inputs."""
    model, xs = _legs_setup(fq, fk, v, M, chunk)
    d_out = _heads_first(do, xs[0].dtype)
    d_xs = [torch.empty_like(x) for x in xs]
    for bos, eos in segments(packing, fq.shape[1]):
        rows = _rows_of(packing)
        part = [x[rows, :, bos:eos] for x in xs]
        zeros = _legs_zeros(part, M)
        grads, _, _ = scan_vjp(model, part, zeros, d_out[rows, :, bos:eos], zeros)
        for d, g in zip(d_xs, grads, strict=True):
            d[rows, :, bos:eos] = g
    d_fq, d_fk, d_v = (_time_second(d, x.dtype) for d, x in zip(d_xs, (fq, fk, v), strict=True))
    return d_fq, d_fk, d_v
