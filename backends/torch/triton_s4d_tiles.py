"""Tiles of the S4D chunk programs (:mod:`.triton_s4d`, :mod:`.triton_s4d_bwd`): the per-head
power tables and G = C^H C (host side), and the device helpers the forward and backward
kernels share: complex tiles, the products' operand types, rows of the power tables, the sums
inside a chunk in the loop and lag forms ([S2]), the readouts ([S3]) and the ratio readout's
ones channel. Derivations: docs/kernels-interdomain.md, cited as [S1]...
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .triton_chunks import load_modes, load_rows, state_pairs, store_rows
from .triton_helpers import bf16_nearest

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
        return bf16_nearest(x.to(tl.float32))
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
    a, b = x, s
    if LEFT:
        a, b = s, x
    if s.dtype == tl.bfloat16:
        out = mm(a, b, OP, RB, PREC)
    else:
        out = tl.dot(a.to(s.dtype), b.to(s.dtype), input_precision=PREC)
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
    if LEFT:
        x, y = b, a
    if RB or OP == tl.bfloat16:
        out = mm(x, y, OP, RB, PREC)
    else:
        out = tl.dot(x.to(a.dtype), y.to(a.dtype), input_precision=PREC)
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
def start_state(
    src: tl.tensor,
    p_hm: tl.tensor,
    m_hm: tl.tensor,
    o_m: tl.tensor,
    i_c: tl.tensor,
    NKB: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    LOAD: tl.constexpr,
    RATIO: tl.constexpr,
    BM: tl.constexpr,
    BC: tl.constexpr,
    ACC: tl.constexpr,
) -> tl.tuple:
    """What a state pass's program (channel block i_c) starts from: its block of the state (or
    adjoint) src [M, C, 2] at (p_hm, m_hm), [BM, BC], and the ratio readout's ones column [BM],
    which the first value block (i_c == NKB) carries; zeros without LOAD. Returns (x, x1, (the
    ones column's offsets, mask)), complex values as (re, im)."""
    p_one = (o_m * C + R + V) * 2
    m_one = (o_m < M) & (o_m * 0 + i_c == NKB)
    x_re = tl.zeros([BM, BC], dtype=ACC)
    x_im = tl.zeros([BM, BC], dtype=ACC)
    x1_re = tl.zeros([BM], dtype=ACC)
    x1_im = tl.zeros([BM], dtype=ACC)
    if LOAD:
        x_re = tl.load(src + p_hm, mask=m_hm, other=0.0).to(ACC)
        x_im = tl.load(src + p_hm + 1, mask=m_hm, other=0.0).to(ACC)
        if RATIO:
            x1_re = tl.load(src + p_one, mask=m_one, other=0.0).to(ACC)
            x1_im = tl.load(src + p_one + 1, mask=m_one, other=0.0).to(ACC)
    return (x_re, x_im), (x1_re, x1_im), (p_one, m_one)


@triton.jit
def store_state(
    dst: tl.tensor,
    x: tl.tuple,
    x1: tl.tuple,
    p_hm: tl.tensor,
    m_hm: tl.tensor,
    one: tl.tuple,
    RATIO: tl.constexpr,
) -> None:
    """Store what :func:`start_state` loads: the block x of a state pass's program into the
    state dst [M, C, 2] (in dst's type: bf16 chunk states for bf16 inputs), and its ones
    column x1 at one = (offsets, mask) for the ratio readout."""
    tl.store(dst + p_hm, x[0].to(dst.dtype.element_ty), mask=m_hm)
    tl.store(dst + p_hm + 1, x[1].to(dst.dtype.element_ty), mask=m_hm)
    if RATIO:
        tl.store(dst + one[0], x1[0].to(dst.dtype.element_ty), mask=one[1])
        tl.store(dst + one[0] + 1, x1[1].to(dst.dtype.element_ty), mask=one[1])


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


@triton.jit
def readout_cols(
    q_buf: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    c_off: tl.tensor,
    dst: tl.tensor,
    s0: tl.tensor,
    tabs: tl.tuple,
    b_c: tl.tuple,
    sc: tl.tuple,
    C: tl.tensor,
    M: tl.tensor,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    COLS: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """:func:`s4d_readout` of a chunk-wide program with the tokens as columns, stored into the
    rows of dst [T, H, W]: q from the mode buffer q_buf; per slice of COLS tokens
    out^T = Re(S0^H (q conj(Lambda^k))^T) + z^T S^T [BD, COLS], S^T the scores of the slice's
    tokens skewed back from the scores by lag, over the keys u < (slice + 1) COLS they reach
    [S2], [S3]; divided by Re(q_t^H x^1_t) for the ratio readout (RATIO; the ones channel
    after the W channels from c_off). tabs = (Lambda^k, sum_{j<k} Lambda^j) of the head."""
    t0, t1, _, i_h, H = sc
    pw_h = tabs[0]
    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    s_re, s_im = state_pairs(s0, c_off, W, C, M, BD, BM, True)  # [BD, BM]
    w_re, w_im = cmul((b_c[0][None, :], b_c[1][None, :]), lag_table(pw_h, BS, BM, TAB))
    if RATIO:
        s1 = ones_column(s0, c_off + W, C, M, BM, ACC)
    for i_c in tl.static_range(BS // COLS):
        tok_c = t0 + i_c * COLS + tl.arange(0, COLS)
        m_c = tok_c < t1
        q_re, q_im = load_modes(q_buf, tok_c, i_h, H, m_c, BM)
        q_re, q_im = tl.trans(q_re), tl.trans(q_im)  # [BM, COLS]
        f_re, f_im = pow_at(pw_h, (tok_c - t0 + 1)[None, :], o_m[:, None], TAB, BM)
        out = mm_state(q_re * f_re + q_im * f_im, s_re, OP, RB, PREC, True)  # [BD, COLS]
        out += mm_state(q_im * f_re - q_re * f_im, s_im, OP, RB, PREC, True)
        s = mm(w_re, q_re, ACC, False, PREC) + mm(w_im, q_im, ACC, False, PREC)  # [lag, COLS]
        s = lag_skew_cols(s, i_c * COLS, (i_c + 1) * COLS, BS)  # [u, COLS]
        tok_u = t0 + tl.arange(0, (i_c + 1) * COLS)
        z = tl.trans(load_rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, OP))  # [BD, u]
        out += mm_scores(s, z, OP, RB, PREC, True)
        if RATIO:  # (I13) the ratio readout's denominator Re(q_t^H x^1_t)
            x1, _ = ones_channel(s1, tabs, b_c, tok_c - t0 + 1, BM, TAB)
            q_re, q_im = load_modes(q_buf, tok_c, i_h, H, m_c, BM)  # read again, as rows
            den = tl.sum(q_re * x1[0] + q_im * x1[1], axis=1)
            out = out / tl.where(m_c, den, 1.0)[None, :]
        store_rows(dst, tl.trans(out), tok_c, i_h, H, W, o_d, m_c)
