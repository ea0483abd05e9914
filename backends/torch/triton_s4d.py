"""Triton kernels for the S4D core of Interdomain Attention, (I11)-(I13), and its decode step.

Registered in :mod:`.dispatch` as impl ``"triton"`` of ``s4d_fwd`` (``s4d_bwd``: the gradient
kernels in :mod:`.triton_s4d_bwd`); layout ``[B, T, H, D]`` (varlen: B = 1 and ``cu_seqlens``);
the launch plan of :mod:`.triton_chunks`. The derivations (C folded into the query side as
G = C^H C, the two gated sums, the split of Lambda^(t-u) at a sub-chunk start, the adjoint passes)
are in docs/kernels-interdomain.md, sections S1-S6, cited below as [S1]...; notation:
p_t = x^K_t fq_t, qe_t = G p_t, o_t = Re(qe_t^H x^V_t), every power Lambda^k from a per-head
table built in complex128.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from . import dispatch
from .triton_chunks import (
    Layout,
    acc_types,
    blocks_for,
    channel_block,
    check_inputs,
    check_param,
    flat,
    layout,
    load_modes,
    load_rows,
    operand_type,
    pow2,
    sequences,
    state_pairs,
    store_modes,
    store_rows,
    stored_type,
    sub_chunk,
)
from .triton_fpa import _bf16_nearest

__all__ = ["s4d_fwd", "s4d_step"]

# Software-pipeline depth of the chunk programs of the forward and of the backward through the
# readout: with Triton's default (3) they hold more prefetched tiles than the registers fit.
OUTPUT_STAGES = 2


# --------------------------------------------------------------------------------------------
# Tables (host side)


class Tables(NamedTuple):
    """Per-head tables, each [H, 2, chunk + 2, BM] (re, im planes) for k = 0..chunk: pw =
    Lambda^k, dpw = k Lambda^(k-1), gs = sum_{j<k} Lambda^j, dgs = sum_{j<k} j Lambda^(j-1).
    Row chunk + 1 and the modes beyond M are zero: kernels send masked pairs there."""

    pw: torch.Tensor
    dpw: torch.Tensor
    gs: torch.Tensor
    dgs: torch.Tensor


def power_tables(lam: torch.Tensor, chunk: int, BM: int, acc: torch.dtype) -> Tables:
    """The :class:`Tables` of lam [H, M, 2], by a complex128 running product: Lambda = 0 gives
    exact zeros (0^0 = 1) and no power is formed with a negative exponent."""
    lam_c = torch.view_as_complex(lam.to(torch.float64).contiguous())  # (H, M)
    H, M = lam_c.shape
    pw = torch.ones(H, chunk + 1, M, dtype=torch.complex128, device=lam.device)
    pw[:, 1:] = torch.cumprod(lam_c[:, None, :].expand(H, chunk, M), dim=1)
    k = torch.arange(1, chunk + 1, device=lam.device, dtype=torch.float64)
    dpw = torch.zeros_like(pw)
    dpw[:, 1:] = k[None, :, None] * pw[:, :-1]  # d/dLambda Lambda^k
    gs, dgs = torch.zeros_like(pw), torch.zeros_like(pw)
    gs[:, 1:] = torch.cumsum(pw[:, :-1], dim=1)
    dgs[:, 1:] = torch.cumsum(dpw[:, :-1], dim=1)
    tables = []
    for x in (pw, dpw, gs, dgs):
        t = torch.zeros(H, 2, chunk + 2, BM, dtype=acc, device=lam.device)
        t[:, 0, : chunk + 1, :M] = x.real.to(acc)
        t[:, 1, : chunk + 1, :M] = x.imag.to(acc)
        tables.append(t)
    return Tables(*tables)


def gram(c: torch.Tensor, BM: int, acc: torch.dtype) -> torch.Tensor:
    """G = C^H C per head as [H, 4, BM, BM] (zero-padded): its re and im planes, then the two
    sums the 3M product takes (:func:`s4d_mix`), Im G - Re G and Re G + Im G, in float64."""
    c_c = torch.view_as_complex(c.to(torch.float64).contiguous())
    G = c_c.conj().transpose(-1, -2) @ c_c
    H, M = G.shape[:2]
    out = torch.zeros(H, 4, BM, BM, dtype=acc, device=c.device)
    for i, plane in enumerate((G.real, G.imag, G.imag - G.real, G.real + G.imag)):
        out[:, i, :M, :M] = plane.to(acc)
    return out


# --------------------------------------------------------------------------------------------
# Device helpers. Complex values are (re, im) tuples; a sub-chunk is sc = (t0, t1, i_s, i_h, H):
# its chunk's first and end tokens, its index in the chunk, the head and the number of heads.


@triton.jit
def cmul(a: tl.tuple, b: tl.tuple) -> tl.tuple:
    """a b, complex, broadcasting."""
    return a[0] * b[0] - a[1] * b[1], a[0] * b[1] + a[1] * b[0]


@triton.jit
def cadd(a: tl.tuple, b: tl.tuple) -> tl.tuple:
    return a[0] + b[0], a[1] + b[1]


@triton.jit
def opnd(x: tl.tensor, OP: tl.constexpr, ROUND_BF16: tl.constexpr) -> tl.tensor:
    """x as a tl.dot operand of type OP (``triton_chunks.operand_type``): the inputs' 16-bit
    type for 16-bit inputs (float32 accumulation), else x; under the interpreter a bfloat16
    operand is a float32 value rounded to bfloat16 (ROUND_BF16), the rounding a GPU's bfloat16
    product sees."""
    if ROUND_BF16:
        return _bf16_nearest(x.to(tl.float32))
    return x.to(OP)


@triton.jit
def mm(
    a: tl.tensor, b: tl.tensor, OP: tl.constexpr, ROUND_BF16: tl.constexpr, PREC: tl.constexpr
) -> tl.tensor:
    """tl.dot(a, b) on operands of type OP, accumulated in float32 (float64 for float64)."""
    return tl.dot(opnd(a, OP, ROUND_BF16), opnd(b, OP, ROUND_BF16), input_precision=PREC)


@triton.jit
def mm_state(
    x: tl.tensor,
    s: tl.tensor,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
    LEFT: tl.constexpr = False,
) -> tl.tensor:
    """x s (s x if LEFT) for a tile s of a stored chunk state (:func:`stored_type`): operands of
    type OP when the states are bf16 (bf16 inputs: the states are exact bf16 operands), else of
    the states' type (float32 states for fp16 inputs, whose range a state may exceed)."""
    if s.dtype == tl.bfloat16:
        a, b = x, s
    else:
        a, b = x.to(s.dtype), s
    if LEFT:
        a, b = b, a
    if s.dtype == tl.bfloat16:
        out = mm(a, b, OP, RB, PREC)
    else:
        out = tl.dot(a, b, input_precision=PREC)
    return out


@triton.jit
def mm_scores(
    a: tl.tensor,
    b: tl.tensor,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
    LEFT: tl.constexpr = False,
) -> tl.tensor:
    """a b (b a if LEFT) for computed scores a (float32) and input rows b: bf16 operands for
    bf16 inputs (a rounded, as chunk_gla rounds its attention matrix for A v), else a's type
    (fp16's range is too narrow for a computed value)."""
    x, y = a, b
    if not (RB or OP == tl.bfloat16):
        y = b.to(a.dtype)
    if LEFT:
        x, y = y, x
    if RB or OP == tl.bfloat16:
        out = mm(x, y, OP, RB, PREC)
    else:
        out = tl.dot(x, y, input_precision=PREC)
    return out


@triton.jit
def b_modes(
    b: tl.tensor, i_h: tl.tensor, M: tl.tensor, BM: tl.constexpr, ACC: tl.constexpr
) -> tl.tuple:
    """b of head i_h from [H, M, 2]: (re, im) [BM], zero beyond M."""
    o_m = tl.arange(0, BM)
    ptr = b + (i_h * M + o_m) * 2
    return (
        tl.load(ptr, mask=o_m < M, other=0.0).to(ACC),
        tl.load(ptr + 1, mask=o_m < M, other=0.0).to(ACC),
    )


@triton.jit
def pow_at(
    tab: tl.tensor, k: tl.tensor, o_m: tl.tensor, TAB: tl.constexpr, BM: tl.constexpr
) -> tl.tuple:
    """The table entry at row k of each mode (k broadcast against o_m)."""
    off = k * BM + o_m
    return tl.load(tab + off), tl.load(tab + TAB + off)


@triton.jit
def rows_of(sc: tl.tuple, BS: tl.constexpr) -> tl.tuple:
    """The tokens of sub-chunk sc, their mask, and the sub-chunk's first token n."""
    t0, t1, i_s, _, _ = sc
    n_i = t0 + i_s * BS
    tok = n_i + tl.arange(0, BS)
    return tok, tok < t1, n_i


@triton.jit
def lag_skew(
    x: tl.tensor, valid: tl.tensor, BS: tl.constexpr, BK: tl.constexpr, W: tl.constexpr
) -> tl.tensor:
    """y[t, j] = x[t, (t - j) mod W] where valid, else 0: [BS, BK] from x [BS, W] (W a power of
    two). One index map for both directions of the lag domain [S2]: scores by token pair to
    scores by lag (y[t, k] = x[t, t - k], lag k = t - u) and back (y[t, u] = x[t, t - u])."""
    t = tl.arange(0, BS)[:, None]
    j = tl.arange(0, BK)[None, :]
    return tl.where(valid, tl.gather(x, (t - j) & (W - 1), axis=1), 0.0)


@triton.jit
def lag_skew_cols(
    x: tl.tensor, FIRST: tl.constexpr, BK: tl.constexpr, W: tl.constexpr
) -> tl.tensor:
    """:func:`lag_skew` with the tokens as columns: y[i, j] = x[(t - i) mod W, j] for i <= t,
    else 0, t = FIRST + j the chunk position of column j: [BK, n] from x [W, n]. Scores by
    token pair to scores by lag (i = k, x[u, t]) and back (i = u, x[k, t])."""
    i = tl.arange(0, BK)[:, None]
    t = FIRST + tl.arange(0, x.shape[1])[None, :]
    return tl.where(i <= t, tl.gather(x, (t - i) & (W - 1), axis=0), 0.0)


@triton.jit
def lag_table(tab: tl.tensor, BB: tl.constexpr, BM: tl.constexpr, TAB: tl.constexpr) -> tl.tuple:
    """The rows of lags k = 0..BB-1 of a table: (re, im) [BB, BM]."""
    return pow_at(tab, tl.arange(0, BB)[:, None], tl.arange(0, BM)[None, :], TAB, BM)


@triton.jit
def lag_apply(
    sk: tl.tensor,
    tab: tl.tensor,
    acc: tl.tuple,
    BB: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tuple:
    """acc + sum_k sk[t, k] T[k] for scores by lag sk [BS, BB] and the table T = tab: the
    diagonal sum as one [BS, BB] x [BB, BM] matmul per plane [S2]."""
    w_re, w_im = lag_table(tab, BB, BM, TAB)
    re = acc[0] + tl.dot(sk, w_re, input_precision=PREC)
    return re, acc[1] + tl.dot(sk, w_im, input_precision=PREC)


@triton.jit
def same_block(sc: tl.tuple, BS: tl.constexpr, BB: tl.constexpr) -> tl.tensor:
    """[BS, BS] mask of the token pairs (t, u) of sub-chunk sc in one diagonal block, u <= t."""
    r = sc[2] * BS + tl.arange(0, BS)
    return ((r[:, None] // BB) == (r[None, :] // BB)) & (r[None, :] <= r[:, None])


@triton.jit
def lag_scores(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    sc: tl.tuple,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BD: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """The scores q_t . z_u of the pairs inside each row's diagonal block by lag k = t - u:
    [BS, BB], zero for k past the row's position in its block [S2]."""
    tok, m_t, _ = rows_of(sc, BS)
    z = load_rows(src, tok, sc[3], sc[4], W, tl.arange(0, BD), m_t, OP)
    a = mm(b_q, tl.trans(z), OP, RB, PREC)  # [BS (t), BS (u)]
    k = tl.arange(0, BB)[None, :]
    return lag_skew(a, k <= ((sc[2] * BS + tl.arange(0, BS)) % BB)[:, None], BS, BB, BS)


@triton.jit
def s4d_mix(
    p: tl.tuple,
    gmat: tl.tensor,
    i_h: tl.tensor,
    BM: tl.constexpr,
    PREC: tl.constexpr,
    COLS: tl.constexpr = False,
) -> tl.tuple:
    """qe_t = G p_t for every row t, i.e. P G^T, G = C^H C of head i_h (I12) [S1], in three
    real products, not four (the 3M method [S1]): with P = a + i b and G^T = c + i d,
    re = (a + b) c - b (c + d), im = (a + b) c + a (d - c), c, d - c and c + d read from
    :func:`gram`'s planes. With COLS the tokens are columns, p = P^T [BM, n]: G P^T, the same
    three products from the left on the planes untransposed. TF32 (3xTF32 for float32)."""
    o_m = tl.arange(0, BM)
    a, b = p  # the shared product last: the order the compiler keeps fewest tiles live in
    if COLS:
        ptr = gmat + i_h * 4 * BM * BM + o_m[:, None] * BM + o_m[None, :]  # [m, n]: G[m, n]
        im = tl.dot(tl.load(ptr + 2 * BM * BM), a, input_precision=PREC)
        re = -tl.dot(tl.load(ptr + 3 * BM * BM), b, input_precision=PREC)
        k1 = tl.dot(tl.load(ptr), a + b, input_precision=PREC)
    else:
        ptr = gmat + i_h * 4 * BM * BM + o_m[None, :] * BM + o_m[:, None]  # [n, m]: G[m, n]
        im = tl.dot(a, tl.load(ptr + 2 * BM * BM), input_precision=PREC)
        re = -tl.dot(b, tl.load(ptr + 3 * BM * BM), input_precision=PREC)
        k1 = tl.dot(a + b, tl.load(ptr), input_precision=PREC)
    return re + k1, im + k1


@triton.jit
def s4d_offdiag(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    pw: tl.tensor,
    sc: tl.tuple,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tuple:
    """sum over the earlier diagonal blocks j of the chunk of Lambda^(t-n) (q_t . z_u)
    Lambda^(n-u), n the end of block j, for the rows t of sub-chunk sc: per block one
    [BS, BD] x [BD, BB] and two [BS, BB] x [BB, BM] products, then a row scaling [S2]."""
    t0, t1, i_s, i_h, H = sc
    r = i_s * BS + tl.arange(0, BS)  # rows, from the chunk start
    o_b = tl.arange(0, BB)
    o_m = tl.arange(0, BM)
    a_re = tl.zeros([BS, BM], dtype=ACC)
    a_im = tl.zeros([BS, BM], dtype=ACC)
    if BT > BB:  # (a chunk of one block has no earlier block)
        v_re, v_im = pow_at(pw, (BB - o_b)[:, None], o_m[None, :], TAB, BM)  # Lambda^(n-u)
        for j in range(0, i_s * (BS // BB) + BS // BB - 1):
            tok_u = t0 + j * BB + o_b
            z = load_rows(src, tok_u, i_h, H, W, tl.arange(0, BD), tok_u < t1, OP)
            s = mm(b_q, tl.trans(z), OP, RB, PREC)  # q_t . z_u [BS, BB]
            k = r - (j + 1) * BB  # rows at or before the block's end read the zero row
            f = pow_at(pw, tl.where(k >= 0, k, BT + 1)[:, None], o_m[None, :], TAB, BM)
            x = tl.dot(s, v_re, input_precision=PREC), tl.dot(s, v_im, input_precision=PREC)
            x_re, x_im = cmul(f, x)
            a_re += x_re
            a_im += x_im
    return a_re, a_im


@triton.jit
def s4d_diag(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    tab: tl.tensor,
    sc: tl.tuple,
    acc: tl.tuple,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tuple:
    """acc + the sum over the pairs u <= t inside each row's diagonal block of (q_t . z_u)
    T[t - u], T the table tab, in the form DIAG: "loop" token by token with [BS, M] tiles (z rows
    gathered per row), "lag" one matmul of the scores by lag [S2]."""
    t0, t1, i_s, i_h, H = sc
    r = i_s * BS + tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    t_re, t_im = acc
    if DIAG == "loop":
        for u_off in range(0, BB):
            u = (r // BB) * BB + u_off  # the u_off-th token of each row's block
            m_u = (t0 + u < t1)[:, None] & (o_d < W)[None, :]
            z_u = tl.load(
                src + ((t0 + u).to(tl.int64)[:, None] * H + i_h) * W + o_d[None, :],
                mask=m_u,
                other=0.0,
            )
            a_u = tl.sum(b_q.to(ACC) * z_u.to(ACC), axis=1)  # q_t . z_u [BS]
            k = tl.where(r >= u, r - u, BT + 1)[:, None]
            w_re, w_im = pow_at(tab, k, o_m[None, :], TAB, BM)
            t_re += a_u[:, None] * w_re
            t_im += a_u[:, None] * w_im
    else:  # "lag"
        sk = lag_scores(b_q, src, W, sc, BS, BB, BD, OP, RB, PREC)
        t_re, t_im = lag_apply(sk, tab, (t_re, t_im), BB, BM, TAB, PREC)
    return t_re, t_im


@triton.jit
def _s4d_chunk_sum(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    pw: tl.tensor,
    sc: tl.tuple,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tuple:
    """sum_{t0<=u<=t} Lambda^(t-u) (q_t . z_u) for the rows t of sub-chunk sc, [BS, BM]:
    split at the ends of the earlier diagonal blocks, Lambda^(t-u) inside a row's block [S2]."""
    t = s4d_offdiag(b_q, src, W, pw, sc, BT, BS, BB, BD, BM, TAB, ACC, OP, RB, PREC)
    return s4d_diag(b_q, src, W, pw, sc, t, BT, BS, BB, BD, BM, TAB, DIAG, ACC, OP, RB, PREC)


@triton.jit
def s4d_readout(
    q: tl.tuple,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    pw: tl.tensor,
    b: tl.tuple,
    sc: tl.tuple,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """out_t[c] = Re(q_t^H x_t[:, c]) over the channels [c_off, c_off + W) of the state for the
    rows of sub-chunk sc: a gated attention with scores S[t, u] = Re(sum_m conj(q_t[m]) b_m
    Lambda_m^(t-u)), split at the ends of the earlier diagonal blocks, then the state part
    [S3]. The products S z and (q conj(Lambda^k)) S0 take bf16 operands for bf16 inputs with
    OP, RB of the plan (:func:`mm_scores`, :func:`mm_state`); the backward passes float32
    ones. Returns out [BS, BD]."""
    t0, t1, i_s, i_h, H = sc
    tok, m_t, _ = rows_of(sc, BS)
    r = i_s * BS + tl.arange(0, BS)
    q_re, q_im = q
    o_b = tl.arange(0, BB)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    out = tl.zeros([BS, BD], dtype=ACC)
    if BT > BB:
        wk_re, wk_im = cmul(b, pow_at(pw, (BB - o_b)[:, None], o_m[None, :], TAB, BM))
        for j in range(0, i_s * (BS // BB) + BS // BB - 1):
            k = r - (j + 1) * BB
            f_re, f_im = pow_at(pw, tl.where(k >= 0, k, BT + 1)[:, None], o_m[None, :], TAB, BM)
            qf_re = q_re * f_re + q_im * f_im  # q conj(Lambda^(t-n))
            qf_im = q_im * f_re - q_re * f_im
            s = mm(qf_re, tl.trans(wk_re), ACC, False, PREC)
            s += mm(qf_im, tl.trans(wk_im), ACC, False, PREC)  # [BS, BB]
            tok_u = t0 + j * BB + o_b
            z = load_rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, OP)
            out += mm_scores(s, z, OP, RB, PREC)
    if DIAG == "loop":
        for u_off in range(0, BB):
            u = (r // BB) * BB + u_off
            m_u = (t0 + u < t1)[:, None] & (o_d < W)[None, :]
            z_u = tl.load(
                src + ((t0 + u).to(tl.int64)[:, None] * H + i_h) * W + o_d[None, :],
                mask=m_u,
                other=0.0,
            )
            k = tl.where(r >= u, r - u, BT + 1)[:, None]
            w_re, w_im = cmul(b, pow_at(pw, k, o_m[None, :], TAB, BM))
            s_u = tl.sum(q_re * w_re + q_im * w_im, axis=1)  # S[t, u]
            out += s_u[:, None] * z_u.to(ACC)
    else:  # "lag": scores by lag S'[t, k] = Re(q_t^H b Lambda^k), S[t, u] = S'[t, t - u]
        w_re, w_im = cmul(b, lag_table(pw, BB, BM, TAB))  # [BB, BM]
        s = mm(q_re, tl.trans(w_re), ACC, False, PREC)
        s += mm(q_im, tl.trans(w_im), ACC, False, PREC)  # [BS, BB]
        s = lag_skew(s, same_block(sc, BS, BB), BS, BS, BB)
        out += mm_scores(s, load_rows(src, tok, i_h, H, W, o_d, m_t, OP), OP, RB, PREC)
    fi_re, fi_im = pow_at(pw, (tok - t0 + 1)[:, None], o_m[None, :], TAB, BM)
    s_re, s_im = state_pairs(s0, c_off, W, C, M, BD, BM, False)
    # Re(conj(q Lambda^(t-t0+1)) S0) [S3]
    out += mm_state(q_re * fi_re + q_im * fi_im, s_re, OP, RB, PREC)
    out += mm_state(q_im * fi_re - q_re * fi_im, s_im, OP, RB, PREC)
    return out


@triton.jit
def ones_readout(
    s0: tl.tensor,
    c_one: tl.tensor,
    tabs: tl.tuple,
    b: tl.tuple,
    sc: tl.tuple,
    C: tl.tensor,
    M: tl.tensor,
    BS: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
) -> tl.tuple:
    """The ones channel of the ratio readout (I13) for the rows of sub-chunk sc [S3]:
    x^1_t = Lambda^k x^1_{t0-1} + b sum_{j<k} Lambda^j, k = t - t0 + 1, from the tables
    tabs = (Lambda^k, sum_{j<k} Lambda^j). Returns (x^1_t, sum_{j<k} Lambda^j), [BS, BM]."""
    tok, _, _ = rows_of(sc, BS)
    s1 = ones_column(s0, c_one, C, M, BM, tabs[0].dtype.element_ty)
    return ones_channel(s1, tabs, b, tok - sc[0] + 1, BM, TAB)


@triton.jit
def ones_column(
    s0: tl.tensor, c_one: tl.tensor, C: tl.tensor, M: tl.tensor, BM: tl.constexpr, ACC: tl.constexpr
) -> tl.tuple:
    """The ones channel x^1_{t0-1} of a chunk state, (re, im) [BM], in ACC (the states may be
    stored in bf16, :func:`stored_type`)."""
    o_m = tl.arange(0, BM)
    ptr = s0 + (o_m * C + c_one) * 2
    return (
        tl.load(ptr, mask=o_m < M, other=0.0).to(ACC),
        tl.load(ptr + 1, mask=o_m < M, other=0.0).to(ACC),
    )


@triton.jit
def ones_channel(
    s1: tl.tuple, tabs: tl.tuple, b: tl.tuple, k: tl.tensor, BM: tl.constexpr, TAB: tl.constexpr
) -> tl.tuple:
    """:func:`ones_readout` at the chunk positions k = t - t0 + 1 of any tokens, as rows, from
    the ones column s1 of the chunk state (:func:`ones_column`)."""
    o_m = tl.arange(0, BM)[None, :]
    g = pow_at(tabs[1], k[:, None], o_m, TAB, BM)
    x1 = cadd(
        cmul(pow_at(tabs[0], k[:, None], o_m, TAB, BM), (s1[0][None, :], s1[1][None, :])),
        cmul(b, g),
    )
    return x1, g


@triton.jit
def store_ratio_den(
    den_buf: tl.tensor,
    qe: tl.tuple,
    s0: tl.tensor,
    c_one: tl.tensor,
    tabs: tl.tuple,
    b: tl.tuple,
    sc: tl.tuple,
    C: tl.tensor,
    M: tl.tensor,
    BS: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
) -> None:
    """The ratio readout's denominator Re(qe_t^H x^1_t) (I13) for the rows of sub-chunk sc into
    den_buf [T, H] (x^1 the ones channel, :func:`ones_readout`)."""
    x1, _ = ones_readout(s0, c_one, tabs, b, sc, C, M, BS, BM, TAB)
    tok, m_t, _ = rows_of(sc, BS)
    den = tl.sum(qe[0] * x1[0] + qe[1] * x1[1], axis=1)
    tl.store(den_buf + tok.to(tl.int64) * sc[4] + sc[3], den, mask=m_t)


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _s4d_state_pass(
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    gs: tl.tensor,
    h0: tl.tensor,
    states: tl.tensor,
    ht: tl.tensor,
    cu: tl.tensor,
    chunk_offsets: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    USE_H0: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
    OP: tl.constexpr,
    ROUND_BF16: tl.constexpr,
) -> None:
    """(I11) chunk by chunk: store the state before each chunk, then
    x_e = Lambda^L x_{t0-1} + sum_u b Lambda^(e-u) z_u [S1]. Grid (channel blocks, N * H);
    blocks < NKB hold key channels, the rest value channels. The ratio readout's ones channel
    takes no product: x^1_e = Lambda^L x^1_{t0-1} + b sum_{j<L} Lambda^j from the table gs,
    carried by the first value block [S3]."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = channel_block(i_c, NKB, R, V, BC)
    p_hm = (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    b_re, b_im = b_modes(b, i_h, M, BM, ACC)
    pw_h = pw + i_h * 2 * TAB
    s_re = tl.zeros([BM, BC], dtype=ACC)
    s_im = tl.zeros([BM, BC], dtype=ACC)
    p_one = (o_m * C + R + V) * 2  # the ones channel (ratio readout), if any
    m_one = (o_m < M) & (o_m * 0 + i_c == NKB)
    s1_re = tl.zeros([BM], dtype=ACC)
    s1_im = tl.zeros([BM], dtype=ACC)
    if USE_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * M * C * 2
        s_re = tl.load(p_h0 + p_hm, mask=m_hm, other=0.0).to(ACC)
        s_im = tl.load(p_h0 + p_hm + 1, mask=m_hm, other=0.0).to(ACC)
        if RATIO:
            s1_re = tl.load(p_h0 + p_one, mask=m_one, other=0.0).to(ACC)
            s1_im = tl.load(p_h0 + p_one + 1, mask=m_one, other=0.0).to(ACC)
    for k in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_st = states + ((g0 + k) * H + i_h).to(tl.int64) * M * C * 2
        tl.store(p_st + p_hm, s_re.to(states.dtype.element_ty), mask=m_hm)  # bf16 for bf16
        tl.store(p_st + p_hm + 1, s_im.to(states.dtype.element_ty), mask=m_hm)
        if RATIO:
            tl.store(p_st + p_one, s1_re.to(states.dtype.element_ty), mask=m_one)
            tl.store(p_st + p_one + 1, s1_im.to(states.dtype.element_ty), mask=m_one)
            g = pow_at(gs + i_h * 2 * TAB, L, o_m, TAB, BM)  # sum_{j<L} Lambda^j
            s1_re, s1_im = cadd(
                cmul(pow_at(pw_h, L, o_m, TAB, BM), (s1_re, s1_im)), cmul((b_re, b_im), g)
            )
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            z = load_rows(kt, tok, i_h, H, R, c_loc, m_t, ACC)
        else:
            z = load_rows(vt, tok, i_h, H, V, c_loc, m_t, ACC)
        w = pow_at(pw_h, tl.maximum(L - 1 - o_t, 0)[None, :], o_m[:, None], TAB, BM)
        wb_re, wb_im = cmul((b_re[:, None], b_im[:, None]), w)  # b Lambda^(e-u)
        d_re, d_im = pow_at(pw_h, L, o_m, TAB, BM)  # Lambda^L
        s_re, s_im = cmul((d_re[:, None], d_im[:, None]), (s_re, s_im))
        if ROUND_BF16:  # interpreter: a bf16 product as float32 on bf16-rounded operands
            wb_re, wb_im = _bf16_nearest(wb_re), _bf16_nearest(wb_im)
        z = z.to(OP)  # exact: 16-bit inputs give 16-bit products, float32 accumulation
        s_re += tl.dot(wb_re.to(OP), z, input_precision=PREC)
        s_im += tl.dot(wb_im.to(OP), z, input_precision=PREC)
    p_ht = ht + i_nh.to(tl.int64) * M * C * 2
    tl.store(p_ht + p_hm, s_re, mask=m_hm)
    tl.store(p_ht + p_hm + 1, s_im, mask=m_hm)
    if RATIO:
        tl.store(p_ht + p_one, s1_re, mask=m_one)
        tl.store(p_ht + p_one + 1, s1_im, mask=m_one)


@triton.jit
def _s4d_query(
    fq: tl.tensor,
    kt: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    gs: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    sub_info: tl.tensor,
    qe_buf: tl.tensor,
    den_buf: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BR: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    DIAG: tl.constexpr,
    COLS: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I12) for the rows of one sub-chunk: p_t = x^K_t fq_t, qe_t = G p_t [S1], kept in
    qe_buf [T, H, 2, BM] for :func:`_s4d_output` (a program of its own: with the readout's a
    64-row program would not fit the registers), and for the ratio readout its denominator
    Re(qe_t^H x^1_t) [S3] in den_buf [T, H] (the output's 64-row program spilled with it).
    With COLS (a chunk-wide program, the chunk one diagonal block in the lag form) the tokens
    are the products' columns, COLS per slice [S2]. Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, i_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    o_m = tl.arange(0, BM)
    pw_h = pw + i_h * 2 * TAB
    s0 = states + (g * H + i_h).to(tl.int64) * M * C * 2
    if COLS:
        _query_cols(
            fq, kt, s0, pw_h, b, gmat, qe_buf, sc, R, C, M, BS, BR, BM, TAB, COLS, ACC, OP, RB, PREC
        )
    else:
        b_q = load_rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, OP)
        s_re, s_im = state_pairs(s0, 0, R, C, M, BR, BM, True)
        y = mm_state(b_q, s_re, OP, RB, PREC), mm_state(b_q, s_im, OP, RB, PREC)
        p = cmul(pow_at(pw_h, (tok - t0 + 1)[:, None], o_m[None, :], TAB, BM), y)  # the state part
        b_c = b_modes(b, i_h, M, BM, ACC)
        if DIAG == "lag":  # b folded into the table rows, the diagonal sum accumulated onto p: a
            # 64-row program holds two fewer [BS, BM] tiles (static gate)
            if BT > BB:  # the earlier diagonal blocks
                t = s4d_offdiag(b_q, kt, R, pw_h, sc, BT, BS, BB, BR, BM, TAB, ACC, OP, RB, PREC)
                p = cadd(p, cmul(b_c, t))
            sk = lag_scores(b_q, kt, R, sc, BS, BB, BR, OP, RB, PREC)
            w_re, w_im = cmul((b_c[0][None, :], b_c[1][None, :]), lag_table(pw_h, BB, BM, TAB))
            p = (
                p[0] + tl.dot(sk, w_re, input_precision=PREC),
                p[1] + tl.dot(sk, w_im, input_precision=PREC),
            )
        else:
            t = _s4d_chunk_sum(
                b_q, kt, R, pw_h, sc, BT, BS, BB, BR, BM, TAB, DIAG, ACC, OP, RB, PREC
            )
            p = cadd(p, cmul(b_c, t))  # + b t_t
        qe = s4d_mix(p, gmat, i_h, BM, PREC)  # C folded in
        store_modes(qe_buf, qe[0], qe[1], tok, i_h, H, m_t, BM)
        if RATIO:  # (I13) the ratio readout's denominator
            tabs = (pw_h, gs + i_h * 2 * TAB)
            store_ratio_den(den_buf, qe, s0, R + V, tabs, b_c, sc, C, M, BS, BM, TAB)


@triton.jit
def _query_cols(
    fq: tl.tensor,
    kt: tl.tensor,
    s0: tl.tensor,
    pw_h: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    qe_buf: tl.tensor,
    sc: tl.tuple,
    R: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    COLS: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """:func:`_s4d_query` for a chunk-wide program with the tokens as columns: per slice of
    COLS tokens p^T = Lambda^k (S0^T fq^T) + (b Lambda^k)^T A'^T [BM, COLS], with A' the
    scores by lag of the slice's tokens, over the lags k < (slice + 1) COLS they reach (the
    causal triangle's zero lags are not multiplied), then qe^T = G p^T [S2]."""
    t0, t1, _, i_h, H = sc
    o_m = tl.arange(0, BM)
    o_r = tl.arange(0, BR)
    tok, m_t, _ = rows_of(sc, BS)
    s_re, s_im = state_pairs(s0, 0, R, C, M, BR, BM, False)  # [BM, BR]
    z = load_rows(kt, tok, i_h, H, R, o_r, m_t, OP)  # [BS (u), BR]
    b_re, b_im = b_modes(b, i_h, M, BM, ACC)
    for i_c in tl.static_range(BS // COLS):
        tok_c = t0 + i_c * COLS + tl.arange(0, COLS)
        m_c = tok_c < t1
        q = tl.trans(load_rows(fq, tok_c, i_h, H, R, o_r, m_c, OP))  # [BR, COLS]
        y = mm_state(q, s_re, OP, RB, PREC, True), mm_state(q, s_im, OP, RB, PREC, True)
        p = cmul(pow_at(pw_h, (tok_c - t0 + 1)[None, :], o_m[:, None], TAB, BM), y)
        sk = lag_skew_cols(mm(z, q, OP, RB, PREC), i_c * COLS, (i_c + 1) * COLS, BS)
        lags = tl.arange(0, (i_c + 1) * COLS)[None, :]
        w_re, w_im = cmul((b_re[:, None], b_im[:, None]), pow_at(pw_h, lags, o_m[:, None], TAB, BM))
        p = (
            p[0] + tl.dot(w_re, sk, input_precision=PREC),
            p[1] + tl.dot(w_im, sk, input_precision=PREC),
        )
        qe = s4d_mix(p, gmat, i_h, BM, PREC, True)  # C folded in
        store_modes(qe_buf, tl.trans(qe[0]), tl.trans(qe[1]), tok_c, i_h, H, m_c, BM)


@triton.jit
def _output_cols(
    vt: tl.tensor,
    o: tl.tensor,
    s0: tl.tensor,
    tabs: tl.tuple,
    b_c: tl.tuple,
    qe_buf: tl.tensor,
    sc: tl.tuple,
    R: tl.tensor,
    V: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BS: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    COLS: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """:func:`_s4d_output` for a chunk-wide program with the tokens as columns: per slice of
    COLS tokens o^T = Re(S0^H (qe conj(Lambda^k))^T) + z^T S^T [BV, COLS], S^T the readout's
    scores of the slice's tokens skewed back from the scores by lag, over the keys u <
    (slice + 1) COLS they reach [S2], [S3]."""
    t0, t1, _, i_h, H = sc
    pw_h = tabs[0]
    o_m = tl.arange(0, BM)
    o_v = tl.arange(0, BV)
    s_re, s_im = state_pairs(s0, R, V, C, M, BV, BM, True)  # [BV, BM]
    w_re, w_im = cmul((b_c[0][None, :], b_c[1][None, :]), lag_table(pw_h, BS, BM, TAB))
    if RATIO:
        s1 = ones_column(s0, R + V, C, M, BM, ACC)
    for i_c in tl.static_range(BS // COLS):
        tok_c = t0 + i_c * COLS + tl.arange(0, COLS)
        m_c = tok_c < t1
        q_re, q_im = load_modes(qe_buf, tok_c, i_h, H, m_c, BM)
        q_re, q_im = tl.trans(q_re), tl.trans(q_im)  # [BM, COLS]
        f_re, f_im = pow_at(pw_h, (tok_c - t0 + 1)[None, :], o_m[:, None], TAB, BM)
        out = mm_state(q_re * f_re + q_im * f_im, s_re, OP, RB, PREC, True)  # [BV, COLS]
        out += mm_state(q_im * f_re - q_re * f_im, s_im, OP, RB, PREC, True)
        s = mm(w_re, q_re, ACC, False, PREC) + mm(w_im, q_im, ACC, False, PREC)  # [lag, COLS]
        s = lag_skew_cols(s, i_c * COLS, (i_c + 1) * COLS, BS)  # [u, COLS]
        tok_u = t0 + tl.arange(0, (i_c + 1) * COLS)
        z = tl.trans(load_rows(vt, tok_u, i_h, H, V, o_v, tok_u < t1, OP))  # [BV, u]
        out += mm_scores(s, z, OP, RB, PREC, True)
        if RATIO:  # (I13) the ratio readout's denominator Re(qe_t^H x^1_t)
            x1, _ = ones_channel(s1, tabs, b_c, tok_c - t0 + 1, BM, TAB)
            q_re, q_im = load_modes(qe_buf, tok_c, i_h, H, m_c, BM)  # read again, as rows
            den = tl.sum(q_re * x1[0] + q_im * x1[1], axis=1)
            out = out / tl.where(m_c, den, 1.0)[None, :]
        store_rows(o, tl.trans(out), tok_c, i_h, H, V, o_v, m_c)


@triton.jit
def _s4d_output(
    vt: tl.tensor,
    o: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    gs: tl.tensor,
    b: tl.tensor,
    sub_info: tl.tensor,
    qe_buf: tl.tensor,
    den_buf: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    DIAG: tl.constexpr,
    COLS: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I13) for the rows of one sub-chunk: o_t = Re(qe_t^H x^V_t), divided by
    Re(qe_t^H x^1_t) for the ratio readout [S3], qe from :func:`_s4d_query`; tokens as
    columns with COLS (as there). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, i_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    b_c = b_modes(b, i_h, M, BM, ACC)
    pw_h = pw + i_h * 2 * TAB
    s0 = states + (g * H + i_h).to(tl.int64) * M * C * 2
    if COLS:
        _output_cols(
            vt, o, s0, (pw_h, gs + i_h * 2 * TAB), b_c, qe_buf, sc, R, V, C, M,
            BS, BV, BM, TAB, COLS, RATIO, ACC, OP, RB, PREC,
        )  # fmt: skip
    else:
        qe = load_modes(qe_buf, tok, i_h, H, m_t, BM)
        out = s4d_readout(
            qe, vt, V, s0, R, pw_h, b_c, sc, C, M, BT, BS, BB, BV, BM, TAB, DIAG, ACC, OP, RB, PREC
        )
        if RATIO:  # (I13) ratio readout, the denominator from _s4d_query
            out = out / tl.load(den_buf + tok.to(tl.int64) * H + i_h, mask=m_t, other=1.0)[:, None]
        store_rows(o, out, tok, i_h, H, V, tl.arange(0, BV), m_t)


# --------------------------------------------------------------------------------------------
# Launchers


class S4DPlan(NamedTuple):
    """Everything a S4D launch needs besides the data: sizes, tiles, layout, tables."""

    ratio: bool
    acc: torch.dtype
    layout: Layout
    sizes: dict[str, int]  # H, R, V, M, C: the integer arguments of every kernel
    CV: int  # value channels of the state (V, + 1 for the ratio readout)
    NKB: int  # channel blocks of the key channels in a state pass
    grid_states: tuple[int, int]  # the backward's state programs: key and value blocks
    grid_forward_states: tuple[int, int]  # ... the forward's: no block for the ones channel
    grid_sub: tuple[int, int]
    tables: Tables
    b: torch.Tensor
    gmat: torch.Tensor
    tiles: dict[str, Any]  # constexpr tile sizes of the output-pass kernels
    state_tiles: dict[str, Any]  # ... and of the state-pass kernels
    operands: tuple[Any, bool]  # the forward state pass's product type, bf16 rounding emulated
    stored: torch.dtype  # dtype of the chunk states between the passes (see :func:`stored_type`)
    cols: int  # the forward chunk programs' tokens per column slice (0: tokens as rows)


def s4d_plan(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> S4DPlan:
    check_inputs(("fq", "kt", "vt"), (fq, kt, vt), (None, fq.shape[-1], None))
    assert readout in ("linear", "ratio"), readout
    _, _, H, R = fq.shape
    V = vt.shape[-1]
    M = lam.shape[1]
    check_param("lam", lam, (H, M, 2), fq.device)
    check_param("b", b, (H, M, 2), fq.device)
    check_param("c", c, (H, M, M, 2), fq.device)
    cu = sequences("fq", fq, cu_seqlens)
    ratio = readout == "ratio"
    CV = V + int(ratio)
    C = R + CV
    if initial_state is not None:
        check_param("initial_state", initial_state, (len(cu) - 1, H, M, C, 2), fq.device)
    acc, ACC, PREC = acc_types(fq.dtype)
    OP, ROUND_BF16 = operand_type(fq.dtype)
    blocks = blocks_for(fq.device)
    lay = layout(cu, blocks.chunk, blocks.sub_chunk, fq.device)
    BM = pow2(M)
    BC = pow2(min(max(R, CV), blocks.channels))
    NKB = triton.cdiv(R, BC)
    common = dict(BT=blocks.chunk, BM=BM, TAB=(blocks.chunk + 2) * BM, ACC=ACC, PREC=PREC)
    common["num_warps"] = blocks.num_warps
    BB = min(blocks.diag_block or blocks.sub_chunk, blocks.sub_chunk)
    sub = dict(BS=blocks.sub_chunk, BB=BB, BR=pow2(R), BV=pow2(V), DIAG=blocks.diagonal)
    sub |= dict(OP=OP, RB=ROUND_BF16)  # the chunk programs' product operands (see mm_state)
    stored = stored_type(fq.dtype, acc)
    chunk_wide = blocks.diagonal == "lag" and BB == blocks.sub_chunk == blocks.chunk
    assert blocks.columns in (0, blocks.chunk // 2, blocks.chunk), blocks  # (see Blocks)
    return S4DPlan(
        ratio=ratio,
        acc=acc,
        layout=lay,
        sizes=dict(H=H, R=R, V=V, M=M, C=C),
        CV=CV,
        NKB=NKB,
        grid_states=(NKB + triton.cdiv(CV, BC), lay.N * H),
        grid_forward_states=(NKB + triton.cdiv(V, BC), lay.N * H),
        grid_sub=(lay.n_sub, H),
        tables=power_tables(lam, blocks.chunk, BM, acc),
        b=b.to(acc).contiguous(),
        gmat=gram(c, BM, acc),
        tiles=dict(**sub, **common),
        state_tiles=dict(BC=BC, RATIO=ratio, **common),
        operands=(OP, ROUND_BF16),
        stored=stored,
        cols=blocks.columns if chunk_wide else 0,
    )


def s4d_state_pass_launch(
    plan: S4DPlan, kt: torch.Tensor, vt: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    lay, sizes = plan.layout, plan.sizes
    shape = (sizes["H"], sizes["M"], sizes["C"], 2)
    states = torch.empty(lay.n_chunks, *shape, dtype=plan.stored, device=kt.device)
    final = torch.empty(lay.N, *shape, dtype=plan.acc, device=kt.device)
    _s4d_state_pass[plan.grid_forward_states](
        kt=kt,
        vt=vt,
        b=plan.b,
        pw=plan.tables.pw,
        gs=plan.tables.gs,
        h0=initial_state.to(plan.acc).contiguous() if initial_state is not None else None,
        states=states,
        ht=final,
        cu=lay.cu,
        chunk_offsets=lay.chunk_offsets,
        NKB=plan.NKB,
        USE_H0=initial_state is not None,
        OP=plan.operands[0],
        ROUND_BF16=plan.operands[1],
        **sizes,
        **plan.state_tiles,
    )
    return states, final


@dispatch.register("s4d_fwd", "triton")
def s4d_fwd(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The S4D core (I11)-(I13), chunked: o and the state after the last token.

    Args:
        fq, kt: [B, T, H, R]; vt: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        lam, b: [H, M, 2]; c: [H, M, M, 2] (re, im last), float32 or float64.
        readout: "linear" (I13) or "ratio" (divided by Re(fq^T conj(U)^T eta)).
        cu_seqlens: None, or (N + 1,) int offsets with B = 1; the state restarts at each.
        initial_state: None or [N, H, M, C, 2], C = R + V (+ 1 for "ratio"): x before token 0.

    Returns:
        o [B, T, H, V] in the dtype of fq; the final state [N, H, M, C, 2] in float32
        (float64 for float64 inputs). Time O(T (M (R + V + M) + chunk (R + V + M))) per head;
        memory O(T / chunk * M (R + V)) for the chunk states (bf16 for bf16 inputs), O(T M)
        for qe.
    """
    plan = s4d_plan(fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state)
    fq_, kt_, vt_ = flat(fq), flat(kt), flat(vt)
    states, final = s4d_state_pass_launch(plan, kt_, vt_, initial_state)
    lay, sizes, tiles = plan.layout, plan.sizes, plan.tiles
    qe = torch.empty(fq_.shape[0], sizes["H"], 2, tiles["BM"], dtype=plan.acc, device=fq.device)
    common: dict[str, Any] = dict(states=states, pw=plan.tables.pw, gs=plan.tables.gs, b=plan.b)
    common["qe_buf"] = qe
    common["sub_info"] = lay.sub_info
    common |= dict(num_stages=OUTPUT_STAGES, H=sizes["H"], R=sizes["R"], M=sizes["M"], C=sizes["C"])
    tiles = {k: x for k, x in tiles.items() if k not in ("BR", "BV")}
    # the ratio readout's denominator: formed by _s4d_query for tokens as rows, else by _s4d_output
    den = qe.new_empty(qe.shape[:2]) if plan.ratio and not plan.cols else None
    common |= dict(den_buf=den, RATIO=plan.ratio)
    common |= dict(V=sizes["V"], COLS=plan.cols)
    _s4d_query[plan.grid_sub](
        fq=fq_, kt=kt_, gmat=plan.gmat, BR=plan.tiles["BR"], **common, **tiles
    )
    o = torch.empty_like(vt_)
    _s4d_output[plan.grid_sub](vt=vt_, o=o, BV=plan.tiles["BV"], **common, **tiles)
    return o.reshape(vt.shape), final


# --------------------------------------------------------------------------------------------
# Decode: one token, fixed-size state (H6)


@triton.jit
def _s4d_step(
    fq: tl.tensor,
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    gmat: tl.tensor,
    state: tl.tensor,
    new_state: tl.tensor,
    o: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    CV: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
) -> None:
    """One token of (I11)-(I13) for one (sequence, head): x <- Lambda x + b z,
    p = x^K fq, qe = G p, o = Re(qe^H x^V) (/ Re(qe^H x^1)). Grid (B * H,)."""
    i_bh = tl.program_id(0)
    i_h = i_bh % H
    o_m = tl.arange(0, BM)
    o_r = tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    b_re, b_im = b_modes(b, i_h, M, BM, ACC)
    lam = pow_at(pw + i_h * 2 * TAB, 1, o_m, TAB, BM)  # Lambda^1
    lam = lam[0][:, None], lam[1][:, None]
    base = i_bh.to(tl.int64) * M * C * 2
    # key channels: (I11) update, then p = x^K fq
    z = tl.load(kt + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    q = tl.load(fq + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p_x = (o_m[:, None] * C + o_r[None, :]) * 2
    m_x = (o_m < M)[:, None] & (o_r < R)[None, :]
    x = (
        tl.load(state + base + p_x, mask=m_x, other=0.0),
        tl.load(state + base + p_x + 1, mask=m_x, other=0.0),
    )
    x_re, x_im = cadd(cmul(lam, x), (b_re[:, None] * z[None, :], b_im[:, None] * z[None, :]))
    tl.store(new_state + base + p_x, x_re, mask=m_x)
    tl.store(new_state + base + p_x + 1, x_im, mask=m_x)
    p_re = tl.sum(x_re * q[None, :], axis=1)
    p_im = tl.sum(x_im * q[None, :], axis=1)
    # (I12) qe = G p, G = C^H C
    g_h = gmat + i_h * 4 * BM * BM + o_m[:, None] * BM + o_m[None, :]  # planes: gram()
    qe_re, qe_im = cmul((tl.load(g_h), tl.load(g_h + BM * BM)), (p_re[None, :], p_im[None, :]))
    qe_re, qe_im = tl.sum(qe_re, axis=1), tl.sum(qe_im, axis=1)
    # value channels (+ the ones channel): update, then (I13) o = Re(qe^H x^V)
    z = tl.load(vt + i_bh * V + o_v, mask=o_v < V, other=0.0).to(ACC)
    if RATIO:
        z = tl.where(o_v == V, 1.0, z)
    p_x = (o_m[:, None] * C + R + o_v[None, :]) * 2
    m_x = (o_m < M)[:, None] & (o_v < CV)[None, :]
    x = (
        tl.load(state + base + p_x, mask=m_x, other=0.0),
        tl.load(state + base + p_x + 1, mask=m_x, other=0.0),
    )
    x_re, x_im = cadd(cmul(lam, x), (b_re[:, None] * z[None, :], b_im[:, None] * z[None, :]))
    tl.store(new_state + base + p_x, x_re, mask=m_x)
    tl.store(new_state + base + p_x + 1, x_im, mask=m_x)
    out = tl.sum(qe_re[:, None] * x_re + qe_im[:, None] * x_im, axis=0)  # [BV]
    if RATIO:
        out = out / tl.sum(tl.where(o_v == V, out, 0.0), axis=0)
    tl.store(o + i_bh * V + o_v, out.to(o.dtype.element_ty), mask=o_v < V)


def s4d_step(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the S4D core (I11)-(I13) (H6: the state never grows).

    Args:
        fq, kt: [B, H, R]; vt: [B, H, V] (this token); lam, b: [H, M, 2]; c: [H, M, M, 2].
        readout: "linear" or "ratio".
        state: [B, H, M, C, 2] (C = R + V, + 1 for "ratio"), float32 (float64 for float64
            inputs), the state after the previous token; None before the first token.

    Returns:
        o [B, H, V] in the dtype of fq and the new state (a new tensor; ``state`` is not
        modified). Time O(M (R + V + M)) per (sequence, head); memory O(M (R + V)).
    """
    assert fq.ndim == kt.ndim == vt.ndim == 3, "one token: [B, H, D]"
    B = fq.shape[0]
    plan = s4d_plan(fq[:, None], kt[:, None], vt[:, None], lam, b, c, readout, None, None)
    sizes = plan.sizes
    shape = (B, sizes["H"], sizes["M"], sizes["C"], 2)
    if state is None:
        state = torch.zeros(shape, dtype=plan.acc, device=fq.device)
    assert (tuple(state.shape), state.dtype, state.device) == (shape, plan.acc, fq.device)
    state = state.contiguous()
    new_state = torch.empty_like(state)
    o = torch.empty(B, sizes["H"], sizes["V"], dtype=vt.dtype, device=fq.device)
    tiles = plan.tiles
    _s4d_step[(B * sizes["H"],)](
        fq=fq.contiguous(),
        kt=kt.contiguous(),
        vt=vt.contiguous(),
        b=plan.b,
        pw=plan.tables.pw,
        gmat=plan.gmat,
        state=state,
        new_state=new_state,
        o=o,
        CV=plan.CV,
        BR=tiles["BR"],
        BV=pow2(plan.CV),
        BM=tiles["BM"],
        TAB=tiles["TAB"],
        RATIO=plan.ratio,
        ACC=tiles["ACC"],
        num_warps=8,  # the [M, R + V] state tiles and G fit without spilling (4: 1.1 KB)
        **sizes,
    )
    return o, new_state
