"""Triton kernels for the gradients of the S4D core of Interdomain Attention, (I11)-(I13).

Registered in :mod:`.dispatch` as impl ``"triton"`` of ``s4d_bwd``: the backward of
:func:`.triton_s4d.s4d_fwd`, the same two passes run in reverse. For a real loss and complex z,
g(z) = dL/dRe z + i dL/dIm z; gx_t is the adjoint of the state x_t. Derivations:
docs/kernels-interdomain.md, sections S4-S6, cited below as [S4]...
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from attnspec.reference.packing import Packing

from . import dispatch
from .triton_chunks import (
    channel_block,
    check_cotangent,
    check_param,
    flat,
    load_modes,
    load_rows,
    state_pairs,
    store_modes,
    store_reload,
    store_rows,
    sub_chunk,
)
from .triton_s4d import OUTPUT_STAGES, check_saved, s4d_plan, s4d_state_pass_launch
from .triton_s4d_tiles import (
    b_modes,
    cadd,
    cmul,
    lag_apply,
    lag_scores,
    lag_skew,
    lag_table,
    mm,
    mm_state,
    ones_readout,
    pow_at,
    rows_of,
    s4d_diag,
    s4d_mix,
    s4d_readout,
    same_block,
    start_state,
    store_ratio_den,
    store_state,
)

__all__ = ["s4d_bwd"]


# Device helpers (complex values as (re, im) tuples, sub-chunks as in .triton_s4d)


@triton.jit
def _row_sum_conj(x: tl.tuple, y: tl.tuple) -> tl.tuple:
    """sum over the rows of x conj(y), complex [BS, BM] -> [BM]."""
    re = tl.sum(x[0] * y[0] + x[1] * y[1], axis=0)
    return re, tl.sum(x[1] * y[0] - x[0] * y[1], axis=0)


@triton.jit
def _s4d_chunk_sum_dlam(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
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
    """:func:`.triton_s4d_tiles._s4d_chunk_sum` and its derivative by Lambda (dpw: the table of
    k Lambda^(k-1)); for the split products d(Lambda^(t-n) Lambda^(n-u)) = dLambda^(t-n)
    Lambda^(n-u) + Lambda^(t-n) dLambda^(n-u) [S4]. Returns (sum, derivative), [BS, BM] each."""
    t0, t1, i_s, i_h, H = sc
    r = i_s * BS + tl.arange(0, BS)
    o_b = tl.arange(0, BB)
    o_m = tl.arange(0, BM)
    t_re = tl.zeros([BS, BM], dtype=ACC)
    t_im = tl.zeros([BS, BM], dtype=ACC)
    d_re = tl.zeros([BS, BM], dtype=ACC)
    d_im = tl.zeros([BS, BM], dtype=ACC)
    if BT > BB:  # (a chunk of one block has no earlier block)
        v_re, v_im = pow_at(pw, (BB - o_b)[:, None], o_m[None, :], TAB, BM)
        dv_re, dv_im = pow_at(dpw, (BB - o_b)[:, None], o_m[None, :], TAB, BM)
        for j in range(0, i_s * (BS // BB) + BS // BB - 1):
            tok_u = t0 + j * BB + o_b
            z = load_rows(src, tok_u, i_h, H, W, tl.arange(0, BD), tok_u < t1, OP)
            s = mm(b_q, tl.trans(z), OP, RB, PREC)  # q_t . z_u [BS, BB]
            k = tl.where(r >= (j + 1) * BB, r - (j + 1) * BB, BT + 1)[:, None]
            f, df = pow_at(pw, k, o_m[None, :], TAB, BM), pow_at(dpw, k, o_m[None, :], TAB, BM)
            x = tl.dot(s, v_re, input_precision=PREC), tl.dot(s, v_im, input_precision=PREC)
            y_re, y_im = cmul(f, x)
            t_re += y_re
            t_im += y_im
            y_re, y_im = cmul(df, x)
            d_re += y_re
            d_im += y_im
            x = tl.dot(s, dv_re, input_precision=PREC), tl.dot(s, dv_im, input_precision=PREC)
            y_re, y_im = cmul(f, x)
            d_re += y_re
            d_im += y_im
    if DIAG == "lag":  # one skew of the scores serves both tables
        sk = lag_scores(b_q, src, W, sc, BS, BB, BD, OP, RB, PREC)
        t = lag_apply(sk, pw, (t_re, t_im), BB, BM, TAB, PREC)
        d = lag_apply(sk, dpw, (d_re, d_im), BB, BM, TAB, PREC)
    else:
        t = s4d_diag(
            b_q, src, W, pw, sc, (t_re, t_im), BT, BS, BB, BD, BM, TAB, DIAG, ACC, OP, RB, PREC
        )
        d = s4d_diag(
            b_q, src, W, dpw, sc, (d_re, d_im), BT, BS, BB, BD, BM, TAB, DIAG, ACC, OP, RB, PREC
        )
    return t, d


@triton.jit
def _s4d_adjoint_inputs(
    q_buf: tl.tensor,
    zsrc: tl.tensor,
    W: tl.tensor,
    d_st: tl.tensor,
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
    PREC: tl.constexpr,
) -> tl.tensor:
    """dz_t[c] = Re(sum_m conj(b_m) gx_t[m, c]) for the rows t of sub-chunk sc, with
    gx_t = conj(Lambda)^(e-t) D + sum_{t<=s<=e} conj(Lambda)^(s-t) q_s zq_s^T [S5]:
    q_buf [T, H, 2, BM] rows q_s, zsrc [T, H, W] rows zq_s, d_st the adjoint D entering the
    chunk's last token e = t1 - 1 from later tokens. Returns dz [BS, BD]."""
    t0, t1, i_s, i_h, H = sc
    tok, m_t, _ = rows_of(sc, BS)
    r = i_s * BS + tl.arange(0, BS)
    o_b = tl.arange(0, BB)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    dz = tl.zeros([BS, BD], dtype=ACC)
    # Later diagonal blocks i: Lambda^(s-t) = Lambda^(s-n) Lambda^(n-t), n the start of block i.
    if BT > BB:
        w_re, w_im = pow_at(pw, o_b[:, None], o_m[None, :], TAB, BM)  # Lambda^(s-n) [BB, BM]
        for i in range(i_s * (BS // BB) + 1, tl.cdiv(t1 - t0, BB)):
            tok_s = t0 + i * BB + o_b
            m_s = tok_s < t1
            q_re, q_im = load_modes(q_buf, tok_s, i_h, H, m_s, BM)
            qf_re = q_re * w_re + q_im * w_im  # q_s conj(Lambda^(s-n))
            qf_im = q_im * w_re - q_re * w_im
            k = tl.where(r < i * BB, i * BB - r, BT + 1)[:, None]
            wk_re, wk_im = cmul(b, pow_at(pw, k, o_m[None, :], TAB, BM))  # b Lambda^(n-t)
            st = mm(wk_re, tl.trans(qf_re), ACC, False, PREC)
            st += mm(wk_im, tl.trans(qf_im), ACC, False, PREC)  # [BS (t), BB (s)]
            dz += mm(st, load_rows(zsrc, tok_s, i_h, H, W, o_d, m_s, ACC), ACC, False, PREC)
    if DIAG == "loop":
        for s_off in range(0, BB):
            s = (r // BB) * BB + s_off  # the s_off-th token of each row's block
            tok_s = t0 + s
            m_s = tok_s < t1
            p_q = q_buf + ((tok_s.to(tl.int64) * H + i_h) * 2 * BM)[:, None] + o_m[None, :]
            q_re = tl.load(p_q, mask=m_s[:, None], other=0.0)
            q_im = tl.load(p_q + BM, mask=m_s[:, None], other=0.0)
            k = tl.where(s >= r, s - r, BT + 1)[:, None]
            wk_re, wk_im = cmul(b, pow_at(pw, k, o_m[None, :], TAB, BM))
            st_s = tl.sum(q_re * wk_re + q_im * wk_im, axis=1)  # [BS (t)]
            p_z = zsrc + (tok_s.to(tl.int64) * H + i_h)[:, None] * W + o_d[None, :]
            z_s = tl.load(p_z, mask=m_s[:, None] & (o_d < W)[None, :], other=0.0)
            dz += st_s[:, None] * z_s.to(ACC)
    else:  # "lag": P[s, k] = Re(q_s^H b Lambda^k), st[t, s] = P[s, s - t]
        wk_re, wk_im = cmul(b, lag_table(pw, BB, BM, TAB))  # [BB, BM]
        q_re, q_im = load_modes(q_buf, tok, i_h, H, m_t, BM)
        st = mm(q_re, tl.trans(wk_re), ACC, False, PREC)
        st += mm(q_im, tl.trans(wk_im), ACC, False, PREC)  # [BS (s), BB]
        st = lag_skew(st, same_block(sc, BS, BB), BS, BS, BB)  # [BS (s), BS (t)]
        z = load_rows(zsrc, tok, i_h, H, W, o_d, m_t, ACC)
        dz += mm(tl.trans(st), z, ACC, False, PREC)
    k_e = tl.maximum(t1 - 1 - tok, 0)[:, None]
    fe_re, fe_im = cmul(b, pow_at(pw, k_e, o_m[None, :], TAB, BM))  # b Lambda^(e-t)
    d_re, d_im = state_pairs(d_st, c_off, W, C, M, BD, BM, False)
    dz += mm(fe_re, d_re, ACC, False, PREC)  # on operands of the stored states' type
    dz += mm(fe_im, d_im, ACC, False, PREC)
    return dz


@triton.jit
def _s4d_bwd_query(
    fq: tl.tensor,
    kt: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    gs: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    sub_info: tl.tensor,
    p_buf: tl.tensor,
    qe_buf: tl.tensor,
    pt_buf: tl.tensor,
    pd_buf: tl.tensor,
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
    MIX: tl.constexpr,
    DIAG: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The key side of the backward through the readout for the rows of one sub-chunk [S4]:
    p, the chunk sum without b (pt) and dp/dLambda (pd), each kept in a per-token buffer
    [T, H, 2, BM]; with MIX (qe not kept from the forward) also qe = G p; for the ratio
    readout den = Re(qe^H x^1) in den_buf [T, H]. Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, i_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    o_m = tl.arange(0, BM)
    b_c = b_modes(b, i_h, M, BM, ACC)
    pw_h = pw + i_h * 2 * TAB
    dpw_h = dpw + i_h * 2 * TAB
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C * 2
    k_i = (tok - t0 + 1)[:, None]
    b_q = load_rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, OP)
    s_re, s_im = state_pairs(s0, 0, R, C, M, BR, BM, True)
    y = mm_state(b_q, s_re, OP, RB, PREC), mm_state(b_q, s_im, OP, RB, PREC)  # S0 q_t
    pt, pd = _s4d_chunk_sum_dlam(
        b_q, kt, R, pw_h, dpw_h, sc, BT, BS, BB, BR, BM, TAB, DIAG, ACC, OP, RB, PREC
    )
    store_modes(pt_buf, pt[0], pt[1], tok, i_h, H, m_t, BM)
    pd = cadd(cmul(pow_at(dpw_h, k_i, o_m[None, :], TAB, BM), y), cmul(b_c, pd))
    store_modes(pd_buf, pd[0], pd[1], tok, i_h, H, m_t, BM)
    p = cadd(cmul(pow_at(pw_h, k_i, o_m[None, :], TAB, BM), y), cmul(b_c, pt))
    if MIX:
        p = store_reload(p_buf, p, tok, i_h, H, m_t, BM)  # the sums above: off the chain to G p
        qe = s4d_mix(p, gmat, i_h, BM, PREC)
        store_modes(qe_buf, qe[0], qe[1], tok, i_h, H, m_t, BM)
    else:  # qe kept from the forward
        store_modes(p_buf, p[0], p[1], tok, i_h, H, m_t, BM)
    if RATIO:  # (I13) the ratio readout's denominator, as _s4d_query
        if not MIX:
            qe = load_modes(qe_buf, tok, i_h, H, m_t, BM)
        tabs = (pw_h, gs + i_h * 2 * TAB)
        store_ratio_den(den_buf, qe, s0, R + V, tabs, b_c, sc, C, M, BS, BM, TAB)


@triton.jit
def _s4d_bwd_values(
    vt: tl.tensor,
    do: tl.tensor,
    den_buf: tl.tensor,
    dnum_buf: tl.tensor,
    dden_buf: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    gs: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    sub_info: tl.tensor,
    qe_buf: tl.tensor,
    gq_buf: tl.tensor,
    gp_buf: tl.tensor,
    glam_part: tl.tensor,
    gb_part: tl.tensor,
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
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The value side for the rows of one sub-chunk [S4]: g(qe_t) = x^V_t dnum_t (+ x^1_t dden_t
    for the ratio readout; dnum is do for the linear one) and its chunk sum without b and
    derivative by Lambda, their parts of g(Lambda) and g(b) against qe (part 0 of the
    partial sums), g(p) = G g(qe) into gp_buf, g(qe) into gq_buf. The ratio readout's
    dnum = do / den and dden = -<do, o> / den = -Re(qe^H x^V dnum) / den (no second readout,
    [S4]) go to dnum_buf and dden_buf. Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, i_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    o_m = tl.arange(0, BM)
    b_c = b_modes(b, i_h, M, BM, ACC)
    pw_h = pw + i_h * 2 * TAB
    dpw_h = dpw + i_h * 2 * TAB
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C * 2
    k_i = (tok - t0 + 1)[:, None]
    s_re, s_im = state_pairs(s0, R, V, C, M, BV, BM, True)
    dn = load_rows(do, tok, i_h, H, V, tl.arange(0, BV), m_t, OP)
    y = mm_state(dn, s_re, OP, RB, PREC), mm_state(dn, s_im, OP, RB, PREC)
    gqt, gqd = _s4d_chunk_sum_dlam(
        dn, vt, V, pw_h, dpw_h, sc, BT, BS, BB, BV, BM, TAB, DIAG, ACC, OP, RB, PREC
    )
    gqd = cadd(cmul(pow_at(dpw_h, k_i, o_m[None, :], TAB, BM), y), cmul(b_c, gqd))
    gq = cadd(cmul(pow_at(pw_h, k_i, o_m[None, :], TAB, BM), y), cmul(b_c, gqt))
    # g(Lambda) and g(b): qe conj(d g(qe)/dLambda), qe conj(the chunk sum without b) [S4]
    qe = load_modes(qe_buf, tok, i_h, H, m_t, BM)
    if RATIO:  # dnum = do / den: the products took the input rows do; each row / den now
        den = tl.load(den_buf + tok.to(tl.int64) * H + i_h, mask=m_t, other=1.0)
        inv = (1.0 / den)[:, None]
        qs = qe[0] * inv, qe[1] * inv
    else:
        qs = qe
    gl_re, gl_im = _row_sum_conj(qs, gqd)
    gb_re, gb_im = _row_sum_conj(qs, gqt)
    if RATIO:  # + x^1_t dden_t (its parts of g(Lambda) and g(b): _s4d_bwd_readout)
        # <do, o> = Re(qe^H x^V do) / den: dden from the value part of g(qe) itself
        dd = -tl.sum(qs[0] * gq[0] + qs[1] * gq[1], axis=1) / den  # gq: do's part, not / den
        tl.store(dden_buf + tok.to(tl.int64) * H + i_h, dd, mask=m_t)
        x1, _ = ones_readout(s0, R + V, (pw_h, gs + i_h * 2 * TAB), b_c, sc, C, M, BS, BM, TAB)
        gq = gq[0] * inv + dd[:, None] * x1[0], gq[1] * inv + dd[:, None] * x1[1]
    gq = store_reload(gq_buf, gq, tok, i_h, H, m_t, BM)  # off the chain to G g(qe)
    gp = s4d_mix(gq, gmat, i_h, BM, PREC)  # G^H = G
    store_modes(gp_buf, gp[0], gp[1], tok, i_h, H, m_t, BM)
    p_part = (i_p.to(tl.int64) * H + i_h) * 2 * BM + o_m
    tl.store(glam_part + p_part, gl_re)
    tl.store(glam_part + p_part + BM, gl_im)
    tl.store(gb_part + p_part, gb_re)
    tl.store(gb_part + p_part + BM, gb_im)
    if RATIO:  # dnum for the later programs
        o_v = tl.arange(0, BV)
        dnum = dn.to(ACC) / den[:, None]
        store_rows(dnum_buf, dnum, tok, i_h, H, V, o_v, m_t)


@triton.jit
def _s4d_bwd_readout(
    kt: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    gs: tl.tensor,
    dgs: tl.tensor,
    b: tl.tensor,
    sub_info: tl.tensor,
    gp_buf: tl.tensor,
    pt_buf: tl.tensor,
    pd_buf: tl.tensor,
    qe_buf: tl.tensor,
    dden: tl.tensor,
    dfq: tl.tensor,
    glam_part: tl.tensor,
    gb_part: tl.tensor,
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
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dfq_t = Re(x^K_t^H g(p_t)) for the rows of one sub-chunk (the readout of g(p) over the
    key channels) and the key side's parts of g(Lambda) and g(b), g(p) conj(pd) and
    g(p) conj(pt) (part 1 of the partial sums), and the ratio readout's ones channel's,
    qe conj(dden d x^1/dLambda) and qe conj(dden sum_{j<k} Lambda^j) (part 2) (g(qe) has + x^1 dden;
    here, not in :func:`_s4d_bwd_values`, whose 64-row program spilled with them) [S4].
    Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, i_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    o_m = tl.arange(0, BM)
    gp = load_modes(gp_buf, tok, i_h, H, m_t, BM)
    gl_re, gl_im = _row_sum_conj(gp, load_modes(pd_buf, tok, i_h, H, m_t, BM))
    gb_re, gb_im = _row_sum_conj(gp, load_modes(pt_buf, tok, i_h, H, m_t, BM))
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C * 2
    pw_h, b_c = pw + i_h * 2 * TAB, b_modes(b, i_h, M, BM, ACC)
    p_part = ((tl.num_programs(0) + i_p).to(tl.int64) * H + i_h) * 2 * BM + o_m
    tl.store(glam_part + p_part, gl_re)
    tl.store(glam_part + p_part + BM, gl_im)
    tl.store(gb_part + p_part, gb_re)
    tl.store(gb_part + p_part + BM, gb_im)
    dq = s4d_readout(  # TF32: bf16 here costs the kit's bf16 gradients
        gp, kt, R, s0, 0, pw_h, b_c, sc, C, M, BT, BS, BB, BR, BM, TAB, DIAG, ACC, ACC, False, PREC
    )
    store_rows(dfq, dq, tok, i_h, H, R, tl.arange(0, BR), m_t)
    if RATIO:  # the ones channel's parts, after the readout (before it, 8 B spilled): part 2
        qe = load_modes(qe_buf, tok, i_h, H, m_t, BM)
        dd = tl.load(dden + tok.to(tl.int64) * H + i_h, mask=m_t, other=0.0)[:, None]
        tabs = (pw_h, gs + i_h * 2 * TAB)
        _, g1 = ones_readout(s0, R + V, tabs, b_c, sc, C, M, BS, BM, TAB)
        gb_re, gb_im = _row_sum_conj(qe, (dd * g1[0], dd * g1[1]))
        tabs = (dpw + i_h * 2 * TAB, dgs + i_h * 2 * TAB)
        dx1, _ = ones_readout(s0, R + V, tabs, b_c, sc, C, M, BS, BM, TAB)
        gl_re, gl_im = _row_sum_conj(qe, (dd * dx1[0], dd * dx1[1]))
        p_part = ((2 * tl.num_programs(0) + i_p).to(tl.int64) * H + i_h) * 2 * BM + o_m
        tl.store(glam_part + p_part, gl_re)
        tl.store(glam_part + p_part + BM, gl_im)
        tl.store(gb_part + p_part, gb_re)
        tl.store(gb_part + p_part + BM, gb_im)


@triton.jit
def _s4d_reverse_state_pass(
    fq: tl.tensor,
    dnum: tl.tensor,
    dden: tl.tensor,
    qe_buf: tl.tensor,
    gp_buf: tl.tensor,
    pw: tl.tensor,
    dht: tl.tensor,
    dstates: tl.tensor,
    dh0: tl.tensor,
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
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The adjoint state, chunk by chunk from the last [S5]: store D_k (the adjoint entering the
    last token of chunk k from later tokens), then D_{k-1} = conj(Lambda)^L D_k +
    sum_s conj(Lambda)^(s-t0+1) q_s zq_s^T, with (q, zq) = (g(p), fq) on key channels and
    (qe, [dnum, dden]) on value channels; D_{-1} is the gradient of the initial state.
    Grid as the forward state pass; the ratio readout's ones channel (zq = dden) takes no
    product: its column D^1 is a [BT, BM] weighted sum, carried by the first value block."""
    i_nh, i_c = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = channel_block(i_c, NKB, R, V, BC)
    p_hm = (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    pw_h = pw + i_h * 2 * TAB
    p_dht = dht
    if USE_DHT:
        p_dht = dht + i_nh.to(tl.int64) * M * C * 2
    x0, x1, one = start_state(  # flat targets: Triton < 3.8 cannot scan nested ones
        p_dht, p_hm, m_hm, o_m, i_c, NKB, R, V, M, C, USE_DHT, RATIO, BM, BC, ACC
    )
    d_re, d_im = x0
    d1_re, d1_im = x1
    NT = tl.cdiv(eos - bos, BT)
    for kk in range(0, NT):
        k = NT - 1 - kk
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_ds = dstates + ((g0 + k).to(tl.int64) * H + i_h) * M * C * 2
        store_state(p_ds, (d_re, d_im), (d1_re, d1_im), p_hm, m_hm, one, RATIO)
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            zq = load_rows(fq, tok, i_h, H, R, c_loc, m_t, ACC)
            q_re, q_im = load_modes(gp_buf, tok, i_h, H, m_t, BM)
        else:
            zq = load_rows(dnum, tok, i_h, H, V, c_loc, m_t, ACC)
            q_re, q_im = load_modes(qe_buf, tok, i_h, H, m_t, BM)
        w_re, w_im = pow_at(pw_h, (o_t + 1)[:, None], o_m[None, :], TAB, BM)
        qw_re = q_re * w_re + q_im * w_im  # q_s conj(Lambda^(s-t0+1)) [BT, BM]
        qw_im = q_im * w_re - q_re * w_im
        e_re, e_im = pow_at(pw_h, L, o_m, TAB, BM)
        d_re, d_im = cmul((e_re[:, None], -e_im[:, None]), (d_re, d_im))  # conj(Lambda)^L D
        d_re += tl.dot(tl.trans(qw_re), zq, input_precision=PREC)
        d_im += tl.dot(tl.trans(qw_im), zq, input_precision=PREC)
        if RATIO:  # D^1: zq = dden, one value per token
            zd = tl.load(dden + tok.to(tl.int64) * H + i_h, mask=m_t, other=0.0)[:, None]
            d1_re, d1_im = cmul((e_re, -e_im), (d1_re, d1_im))
            d1_re += tl.sum(qw_re * zd, axis=0)
            d1_im += tl.sum(qw_im * zd, axis=0)
    if STORE_DH0:
        p_dh0 = dh0 + i_nh.to(tl.int64) * M * C * 2
        store_state(p_dh0, (d_re, d_im), (d1_re, d1_im), p_hm, m_hm, one, RATIO)


@triton.jit
def _s4d_chunk_grads(
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    gs: tl.tensor,
    dgs: tl.tensor,
    states: tl.tensor,
    dstates: tl.tensor,
    chunk_info: tl.tensor,
    glam_part: tl.tensor,
    gb_part: tl.tensor,
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
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The parts of g(b) and g(Lambda) that pair a chunk with its start state S0 or with D (the
    adjoint entering its last token e) [S6]. Grid (chunks, channel blocks, H), independent
    programs; the ratio readout's ones channel (z = 1) in closed form, with the first value
    block: sum_u conj(Lambda^(e-u)) = conj(sum_{j<L} Lambda^j) and its derivative."""
    i_g, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(chunk_info + i_g * 2)
    L = tl.load(chunk_info + i_g * 2 + 1) - t0
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = channel_block(i_c, NKB, R, V, BC)
    off = (i_g.to(tl.int64) * H + i_h) * M * C * 2 + (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    s_re = tl.load(states + off, mask=m_hm, other=0.0).to(ACC)
    s_im = tl.load(states + off + 1, mask=m_hm, other=0.0).to(ACC)
    ds_re = tl.load(dstates + off, mask=m_hm, other=0.0)  # the stored type, for mm_state
    ds_im = tl.load(dstates + off + 1, mask=m_hm, other=0.0)
    d_re, d_im = ds_re.to(ACC), ds_im.to(ACC)
    b_re, b_im = b_modes(b, i_h, M, BM, ACC)
    pw_h = pw + i_h * 2 * TAB
    dpw_h = dpw + i_h * 2 * TAB
    w_re, w_im = pow_at(dpw_h, L, o_m, TAB, BM)  # L Lambda^(L-1)
    c_re = tl.sum(s_re * d_re + s_im * d_im, axis=1)  # <S0, D>
    c_im = tl.sum(s_re * d_im - s_im * d_re, axis=1)
    gl_re, gl_im = cmul((w_re, -w_im), (c_re, c_im))
    tok = t0 + o_t
    m_t = o_t < L
    if i_c < NKB:
        z = load_rows(kt, tok, i_h, H, R, c_loc, m_t, ACC)
    else:
        z = load_rows(vt, tok, i_h, H, V, c_loc, m_t, ACC)
    # The channel sums first: y[u, m] = sum_c D[m, c] z_u[c], one [BT, BC] x [BC, BM] product
    # per plane, shared by both parts; then per mode the sums over u with the tables,
    # g(b) = sum_u conj(Lambda^(e-u)) y[u] and g(Lambda) += conj(b) sum_u conj((e-u)
    # Lambda^(e-u-1)) y[u] (on CUDA cores: [BT, BM] elementwise)
    y_re = mm_state(z, tl.trans(ds_re), OP, RB, PREC)
    y_im = mm_state(z, tl.trans(ds_im), OP, RB, PREC)
    k_u = tl.maximum(L - 1 - o_t, 0)[:, None]
    w_re, w_im = pow_at(pw_h, k_u, o_m[None, :], TAB, BM)  # Lambda^(e-u) [BT, BM]
    gb_re = tl.sum(w_re * y_re + w_im * y_im, axis=0)
    gb_im = tl.sum(w_re * y_im - w_im * y_re, axis=0)
    w_re, w_im = pow_at(dpw_h, k_u, o_m[None, :], TAB, BM)  # (e-u) Lambda^(e-u-1)
    x_re = tl.sum(w_re * y_re + w_im * y_im, axis=0)
    x_im = tl.sum(w_re * y_im - w_im * y_re, axis=0)
    if RATIO:  # the ones column: <S0^1, D^1> and y[u] = D^1 for every token of the chunk
        p_one = (i_g.to(tl.int64) * H + i_h) * M * C * 2 + (o_m * C + R + V) * 2
        m_one = (o_m < M) & (o_m * 0 + i_c == NKB)
        s1_re = tl.load(states + p_one, mask=m_one, other=0.0).to(ACC)
        s1_im = tl.load(states + p_one + 1, mask=m_one, other=0.0).to(ACC)
        d1_re = tl.load(dstates + p_one, mask=m_one, other=0.0).to(ACC)
        d1_im = tl.load(dstates + p_one + 1, mask=m_one, other=0.0).to(ACC)
        w_re, w_im = pow_at(dpw_h, L, o_m, TAB, BM)
        gl1 = cmul((w_re, -w_im), (s1_re * d1_re + s1_im * d1_im, s1_re * d1_im - s1_im * d1_re))
        w_re, w_im = pow_at(gs + i_h * 2 * TAB, L, o_m, TAB, BM)  # sum_{j<L} Lambda^j
        gb_re += w_re * d1_re + w_im * d1_im
        gb_im += w_re * d1_im - w_im * d1_re
        w_re, w_im = pow_at(dgs + i_h * 2 * TAB, L, o_m, TAB, BM)  # its derivative
        x_re += w_re * d1_re + w_im * d1_im
        x_im += w_re * d1_im - w_im * d1_re
        gl_re += gl1[0]
        gl_im += gl1[1]
    gl_re += b_re * x_re + b_im * x_im
    gl_im += b_re * x_im - b_im * x_re
    p_part = ((i_g.to(tl.int64) * tl.num_programs(1) + i_c) * H + i_h) * 2 * BM + o_m
    tl.store(glam_part + p_part, gl_re)
    tl.store(glam_part + p_part + BM, gl_im)
    tl.store(gb_part + p_part, gb_re)
    tl.store(gb_part + p_part + BM, gb_im)


@triton.jit
def _s4d_bwd_inputs(
    fq: tl.tensor,
    dnum: tl.tensor,
    qe_buf: tl.tensor,
    gp_buf: tl.tensor,
    dstates: tl.tensor,
    pw: tl.tensor,
    b: tl.tensor,
    sub_info: tl.tensor,
    dkt: tl.tensor,
    dvt: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BB: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG: tl.constexpr,
    ACC: tl.constexpr,
    OP: tl.constexpr,
    RB: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dz_t = Re(conj(b)^T gx_t) for the rows of one sub-chunk [S5]: dkt from (g(p), fq, D^K)
    and dvt from (qe, dnum, D^V), in programs of their own (a 64-row program with both would not
    fit the registers). Grid (sub-chunks, H, 2): key side, value side."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, j_s, _ = sub_chunk(sub_info, i_p)
    sc = (t0, t1, j_s, i_h, H)
    tok, m_t, _ = rows_of(sc, BS)
    bc = b_modes(b, i_h, M, BM, ACC)
    pw = pw + i_h * 2 * TAB
    ds = dstates + (g.to(tl.int64) * H + i_h) * M * C * 2
    if tl.program_id(2) == 0:
        dk = _s4d_adjoint_inputs(
            gp_buf, fq, R, ds, 0, pw, bc, sc, C, M, BT, BS, BB, BR, BM, TAB, DIAG, ACC, PREC
        )
        store_rows(dkt, dk, tok, i_h, H, R, tl.arange(0, BR), m_t)
    else:
        dv = _s4d_adjoint_inputs(
            qe_buf, dnum, V, ds, R, pw, bc, sc, C, M, BT, BS, BB, BV, BM, TAB, DIAG, ACC, PREC
        )
        store_rows(dvt, dv, tok, i_h, H, V, tl.arange(0, BV), m_t)


# Launcher


def _args(kernel: Any, shared: dict[str, Any]) -> dict[str, Any]:
    """The launch arguments of ``shared`` that ``kernel`` takes (tiles, sizes, options)."""
    names = set(kernel.arg_names) | {"num_warps", "num_stages"}
    return {k: v for k, v in shared.items() if k in names}


def _complex_modes(buf: torch.Tensor, M: int) -> torch.Tensor:
    """[T, H, 2, BM] mode buffer -> complex [T, H, M] (complex64 for float32 buffers)."""
    return torch.complex(buf[:, :, 0, :M], buf[:, :, 1, :M])


@dispatch.register("s4d_bwd", "triton")
def s4d_bwd(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    packing: Packing | None,
    initial_state: torch.Tensor | None,
    do: torch.Tensor,
    dfinal_state: torch.Tensor | None,
    saved: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of :func:`s4d_fwd` for the cotangents do [B, T, H, V] and dfinal_state.

    Complex gradients are (dL/dRe, dL/dIm) pairs, the convention of
    ``attnspec.reference.interdomain.interdomain_s4d_vjp``.

    Args:
        saved: what ``s4d_fwd(..., return_saved=True)`` returned for the same inputs (the
            chunk states and qe): the backward then runs no state pass and no G p. None or
            []: recomputed from the inputs.

    Returns:
        (dfq, dkt, dvt, dlam, db, dc, dinitial_state), each in the dtype of its input;
        dinitial_state is None without initial_state. Time about 3x the forward (2.4x with
        saved); memory O(T M) for four per-token mode buffers plus two sets of chunk states.
    """
    plan = s4d_plan(fq, kt, vt, lam, b, c, readout, packing, initial_state)
    check_cotangent("do", do, vt)
    lay, sizes, tab = plan.layout, plan.sizes, plan.tables
    H, M = sizes["H"], sizes["M"]
    if dfinal_state is not None:
        check_param("dfinal_state", dfinal_state, (lay.N, H, M, sizes["C"], 2), fq.device)
    fq_, kt_, vt_, do_ = flat(fq), flat(kt), flat(vt), flat(do)
    dev, acc, BM = fq.device, plan.acc, plan.tiles["BM"]
    mix = not saved  # qe = G p formed again by _s4d_bwd_query
    if saved:
        states, qe_buf = check_saved(plan, saved, fq_.shape[0], fq.dtype, dev)
    else:
        states, _ = s4d_state_pass_launch(plan, kt_, vt_, initial_state)
        qe_buf = torch.empty(fq_.shape[0], H, 2, BM, dtype=acc, device=dev)
    p_buf, gq_buf, gp_buf, pt_buf, pd_buf = (
        torch.empty(fq_.shape[0], H, 2, BM, dtype=acc, device=dev) for _ in range(5)
    )
    # With the ratio readout dnum = do / den and dden are written by _s4d_bwd_values.
    dnum = torch.empty(do_.shape, dtype=acc, device=dev) if plan.ratio else do_
    dden = torch.empty(do_.shape[:2], dtype=acc, device=dev) if plan.ratio else None
    den = torch.empty(do_.shape[:2], dtype=acc, device=dev) if plan.ratio else None
    dfq = torch.empty_like(fq_)
    # parts: the value side, the key side (and the ratio readout's ones channel)
    glam1 = torch.empty(2 + plan.ratio, lay.n_sub, H, 2, BM, dtype=acc, device=dev)
    gb1 = torch.empty_like(glam1)
    launch = dict(states=states, b=plan.b, sub_info=lay.sub_info, **sizes)
    launch |= dict(num_stages=OUTPUT_STAGES, **plan.tiles)
    grid = plan.grid_sub
    _s4d_bwd_query[grid](
        fq=fq_,
        kt=kt_,
        pw=tab.pw,
        dpw=tab.dpw,
        gmat=plan.gmat,
        p_buf=p_buf,
        qe_buf=qe_buf,
        pt_buf=pt_buf,
        pd_buf=pd_buf,
        gs=tab.gs,
        den_buf=den,
        RATIO=plan.ratio,
        MIX=mix,
        **_args(_s4d_bwd_query, launch),
    )
    _s4d_bwd_values[grid](
        vt=vt_,
        do=do_,
        den_buf=den,
        dnum_buf=dnum if plan.ratio else None,
        dden_buf=dden,
        pw=tab.pw,
        dpw=tab.dpw,
        gs=tab.gs,
        gmat=plan.gmat,
        qe_buf=qe_buf,
        gq_buf=gq_buf,
        gp_buf=gp_buf,
        glam_part=glam1,
        gb_part=gb1,
        RATIO=plan.ratio,
        **_args(_s4d_bwd_values, launch),
    )
    _s4d_bwd_readout[grid](
        kt=kt_,
        **tab._asdict(),
        gp_buf=gp_buf,
        pt_buf=pt_buf,
        pd_buf=pd_buf,
        qe_buf=qe_buf,
        dden=dden,
        dfq=dfq,
        RATIO=plan.ratio,
        glam_part=glam1,
        gb_part=gb1,
        **_args(_s4d_bwd_readout, launch),
    )
    dstates = torch.empty_like(states)
    dh0 = (
        torch.empty(states[: lay.N].shape, dtype=acc, device=dev)
        if initial_state is not None
        else None
    )
    _s4d_reverse_state_pass[plan.grid_states](
        fq=fq_,
        dnum=dnum,
        dden=dden,
        qe_buf=qe_buf,
        gp_buf=gp_buf,
        pw=tab.pw,
        dht=dfinal_state.to(acc).contiguous() if dfinal_state is not None else None,
        dstates=dstates,
        dh0=dh0,
        cu=lay.cu,
        chunk_offsets=lay.chunk_offsets,
        NKB=plan.NKB,
        USE_DHT=dfinal_state is not None,
        STORE_DH0=dh0 is not None,
        **sizes,
        **plan.state_tiles,
    )
    blocks = plan.grid_states[1]
    glam2 = torch.empty(lay.n_chunks, blocks, H, 2, BM, dtype=acc, device=dev)
    gb2 = torch.empty_like(glam2)
    _s4d_chunk_grads[(lay.n_chunks, blocks, H)](
        kt=kt_,
        vt=vt_,
        b=plan.b,
        pw=tab.pw,
        dpw=tab.dpw,
        gs=tab.gs,
        dgs=tab.dgs,
        states=states,
        dstates=dstates,
        chunk_info=lay.chunk_info,
        glam_part=glam2,
        gb_part=gb2,
        NKB=plan.NKB,
        OP=plan.operands[0],
        RB=plan.operands[1],
        **sizes,
        **plan.state_tiles,
    )
    dkt, dvt = torch.empty_like(kt_), torch.empty_like(vt_)
    _s4d_bwd_inputs[(*plan.grid_sub, 2)](
        fq=fq_,
        dnum=dnum,
        qe_buf=qe_buf,
        gp_buf=gp_buf,
        dstates=dstates,
        pw=tab.pw,
        b=plan.b,
        sub_info=lay.sub_info,
        dkt=dkt,
        dvt=dvt,
        **sizes,
        **plan.tiles,
    )
    # g(G) = sum_t g(qe_t) p_t^H; G = C^H C gives g(C) = C (g(G) + g(G)^H) [S4].
    g_gram = torch.einsum(
        "thm,thn->hmn", _complex_modes(gq_buf, M), _complex_modes(p_buf, M).conj()
    )
    c_c = torch.view_as_complex(c.to(torch.float64).contiguous())
    g_gram = g_gram.to(torch.complex128)
    dc = torch.view_as_real(c_c @ (g_gram + g_gram.conj().transpose(-1, -2)))
    part = lambda x: x[..., :M].double().sum(dim=tuple(range(x.ndim - 3)))  # noqa: E731
    dlam = (part(glam1) + part(glam2)).transpose(-1, -2)  # (H, M, 2)
    db = (part(gb1) + part(gb2)).transpose(-1, -2)
    return (
        dfq.reshape(fq.shape),
        dkt.reshape(kt.shape),
        dvt.reshape(vt.shape),
        dlam.to(lam.dtype).contiguous(),
        db.to(b.dtype).contiguous(),
        dc.to(c.dtype).contiguous(),
        dh0.to(initial_state.dtype) if dh0 is not None and initial_state is not None else None,
    )
