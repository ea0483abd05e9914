"""Triton kernels for the S4D core of Interdomain Attention, (I11)-(I13), and its decode step.

Registered in :mod:`.dispatch` as impl ``"triton"`` of ``s4d_fwd`` (``s4d_bwd``: the gradient
kernels in :mod:`.triton_s4d_bwd`); layout ``[B, T, H, D]`` (varlen: B = 1, packed offsets);
the launch plan of :mod:`.triton_chunks`; the tables and device helpers both share in
:mod:`.triton_s4d_tiles`. The derivations (C folded into the query side as
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

from attnspec.reference.packing import Packing

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
from .triton_helpers import bf16_nearest
from .triton_s4d_tiles import (
    Tables,
    _s4d_chunk_sum,
    b_modes,
    cadd,
    cmul,
    gram,
    lag_scores,
    lag_skew_cols,
    lag_table,
    mm,
    mm_state,
    pow_at,
    power_tables,
    readout_cols,
    rows_of,
    s4d_mix,
    s4d_offdiag,
    s4d_readout,
    start_state,
    store_ratio_den,
    store_state,
)

__all__ = ["s4d_fwd", "s4d_step"]

# Software-pipeline depth of the chunk programs of the forward and of the backward through the
# readout: with Triton's default (3) they hold more prefetched tiles than the registers fit.
OUTPUT_STAGES = 2


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
    x_e = Lambda^L x_{t0-1} + sum_u b Lambda^(e-u) z_u [S1]. Grid (N * H, channel blocks), N * H
    on axis x (limit 2^31 - 1; y and z: 65,535);
    blocks < NKB hold key channels, the rest value channels. The ratio readout's ones channel
    takes no product: x^1_e = Lambda^L x^1_{t0-1} + b sum_{j<L} Lambda^j from the table gs,
    carried by the first value block [S3]."""
    i_nh, i_c = tl.program_id(0), tl.program_id(1)
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
    p_h0 = h0
    if USE_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * M * C * 2
    x0, x1, one = start_state(  # flat targets: Triton < 3.8 cannot scan nested ones
        p_h0, p_hm, m_hm, o_m, i_c, NKB, R, V, M, C, USE_H0, RATIO, BM, BC, ACC
    )
    s_re, s_im = x0
    s1_re, s1_im = x1
    for k in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_st = states + ((g0 + k).to(tl.int64) * H + i_h) * M * C * 2
        store_state(p_st, (s_re, s_im), (s1_re, s1_im), p_hm, m_hm, one, RATIO)
        if RATIO:
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
            wb_re, wb_im = bf16_nearest(wb_re), bf16_nearest(wb_im)
        z = z.to(OP)  # exact: 16-bit inputs give 16-bit products, float32 accumulation
        s_re += tl.dot(wb_re.to(OP), z, input_precision=PREC)
        s_im += tl.dot(wb_im.to(OP), z, input_precision=PREC)
    p_ht = ht + i_nh.to(tl.int64) * M * C * 2
    store_state(p_ht, (s_re, s_im), (s1_re, s1_im), p_hm, m_hm, one, RATIO)


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
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C * 2
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
    sp = s0 + (o_m[:, None] * C + o_r[None, :]) * 2  # [BM, BR] planes: the products' first
    sm = (o_m < M)[:, None] & (o_r < R)[None, :]  # operand, read from shared memory
    s_re, s_im = tl.load(sp, mask=sm, other=0.0), tl.load(sp + 1, mask=sm, other=0.0)
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
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C * 2
    if COLS:
        readout_cols(
            qe_buf, vt, V, R, o, s0, (pw_h, gs + i_h * 2 * TAB), b_c, sc, C, M,
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


# Launchers


class S4DPlan(NamedTuple):
    """Everything a S4D launch needs besides the data: sizes, tiles, layout, tables."""

    ratio: bool
    acc: torch.dtype
    layout: Layout
    sizes: dict[str, int]  # H, R, V, M, C: the integer arguments of every kernel
    CV: int  # value channels of the state (V, + 1 for the ratio readout)
    NKB: int  # channel blocks of the key channels in a state pass
    grid_states: tuple[int, int]  # the state passes' programs: key and value channel blocks
    # (the ratio readout's ones channel takes none: the first value block carries it)
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
    packing: Packing | None,
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
    cu = sequences("fq", fq, packing)
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
        grid_states=(lay.N * H, NKB + triton.cdiv(V, BC)),
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
    _s4d_state_pass[plan.grid_states](
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


def saved_shapes(
    chunks: Any, T: Any, H: int, M: int, C: int, dtype: torch.dtype
) -> list[tuple[tuple[Any, ...], torch.dtype]]:
    """(shape, dtype) of each tensor :func:`s4d_fwd` returns as saved, for T tokens in all
    and inputs of ``dtype``: the chunk states [chunks, H, M, C, 2] in the stored type, qe
    [T, H, 2, BM] in the accumulation type."""
    acc = acc_types(dtype)[0]
    return [((chunks, H, M, C, 2), stored_type(dtype, acc)), ((T, H, 2, pow2(M)), acc)]


def saved_fake(fq: torch.Tensor, lam: torch.Tensor, C: int, chunks: Any) -> list[torch.Tensor]:
    """Empty tensors shaped as :func:`s4d_fwd`'s saved (the op's fake implementation);
    chunks: the chunk count, None for batches of equal length (B x chunks per sequence)."""
    B, T, H, _ = fq.shape
    if chunks is None:
        chunks = B * -(-T // blocks_for(fq.device).chunk)
    shapes = saved_shapes(chunks, B * T, H, lam.shape[1], C, fq.dtype)
    return [fq.new_empty(shape, dtype=dtype) for shape, dtype in shapes]


def check_saved(
    plan: S4DPlan, saved: list[torch.Tensor], T: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """``saved`` as :func:`s4d_fwd` returns it for the inputs of ``plan``, or a ValueError."""
    sizes = plan.sizes
    want = saved_shapes(plan.layout.n_chunks, T, sizes["H"], sizes["M"], sizes["C"], dtype)
    got = [(tuple(x.shape), x.dtype) for x in saved]
    if got != want or any(x.device != device or not x.is_contiguous() for x in saved):
        raise ValueError(
            f"saved: expected what s4d_fwd(..., return_saved=True) returns for these inputs, "
            f"contiguous on {device}: (shape, dtype) {want}; got {got}"
        )
    return list(saved)


@dispatch.register("s4d_fwd", "triton")
def s4d_fwd(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    packing: Packing | None,
    initial_state: torch.Tensor | None,
    return_saved: bool = False,
) -> tuple[Any, ...]:
    """The S4D core (I11)-(I13), chunked: o and the state after the last token.

    Args:
        fq, kt: [B, T, H, R]; vt: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        lam, b: [H, M, 2]; c: [H, M, M, 2] (re, im last), float32 or float64.
        readout: "linear" (I13) or "ratio" (divided by Re(fq^T conj(U)^T eta)).
        packing: None, or the checked offsets of N sequences (a ``Packing``, none empty),
            B = 1; the state restarts at each.
        initial_state: None or [N, H, M, C, 2], C = R + V (+ 1 for "ratio"): x before token 0.
        return_saved: also return the tensors :func:`.triton_s4d_bwd.s4d_bwd` takes as
            ``saved`` (the autograd op keeps them from the forward for the backward).

    Returns:
        o [B, T, H, V] in the dtype of fq; the final state [N, H, M, C, 2] in float32
        (float64 for float64 inputs); with return_saved, the list saved = [chunk states, qe]
        (:func:`saved_shapes`). Time O(T (M (R + V + M) + chunk (R + V + M))) per head;
        memory O(T / chunk * M (R + V)) for the chunk states (bf16 for bf16 inputs), O(T M)
        for qe.
    """
    plan = s4d_plan(fq, kt, vt, lam, b, c, readout, packing, initial_state)
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
    if return_saved:
        return o.reshape(vt.shape), final, [states, qe]
    return o.reshape(vt.shape), final


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
