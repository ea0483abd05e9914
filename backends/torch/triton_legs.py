"""Triton kernels for Interdomain Attention with the LegS basis, (I2)-(I6), and its decode step.

Registered in :mod:`.dispatch` as impl ``"triton"`` of ``legs_fwd`` and ``legs_bwd``; layout
``[B, T, H, D]`` (varlen: B = 1, packed offsets); the launch plan of :mod:`.triton_chunks`.
The exact steps c_n = E_n c_{n-1} + F_n f_n (I5) are time-varying, so the kernels read products
of the cached steps per chunk from float64 position tables; the readout is the ratio (I3) with
eta = e_0 exactly (I6). Derivations: docs/kernels-interdomain.md, sections L1-L3, cited below
as [L1]...; why A is not diagonalised: [L1].
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from attnspec.reference import hippo
from attnspec.reference.packing import Packing

from ..tile_sizes import LEGS_POSITION_COLUMNS
from . import dispatch
from .triton_chunks import (
    Layout,
    acc_types,
    blocks_for,
    channel_block,
    check_cotangent,
    check_inputs,
    flat,
    layout,
    load_rows,
    pow2,
    sequences,
    store_rows,
    stored_type,
    sub_chunk,
)

__all__ = ["LegsState", "legs_bwd", "legs_chunk_tables", "legs_fwd", "legs_step"]


# Position tables (host side)


@functools.lru_cache(maxsize=8)
def legs_chunk_tables(M: int, chunk: int, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Products of the exact LegS steps (I5) within chunks of ``chunk`` positions, float64:
    ``hippo.legs_chunk_products(M, chunk, n_max)``, Phi (n_max, M, M) and K (n_max, chunk, M)
    with c_p = Phi[p] c_{n0-1} + sum_j K[p, j] f_{n0+j} for the chunk that starts at n0."""
    return hippo.legs_chunk_products(M, chunk, n_max)


_LEGS_DEVICE_TABLES: dict[
    tuple[int, int, int, int, torch.dtype, str], tuple[torch.Tensor, torch.Tensor]
] = {}


def _legs_tables(
    M: int, chunk: int, max_len: int, BM: int, acc: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of :func:`legs_chunk_tables` on ``device`` as [n_max, BM, BM] and
    [n_max, chunk, BM] (zero-padded), n_max a power-of-two number of chunks >= max_len."""
    n_max = chunk * triton.next_power_of_2(-(-max_len // chunk))
    key = (M, chunk, n_max, BM, acc, str(device))
    if key not in _LEGS_DEVICE_TABLES:
        phi, weights = legs_chunk_tables(M, chunk, n_max)
        phi_t = torch.zeros(n_max, BM, BM, dtype=acc)
        phi_t[:, :M, :M] = torch.from_numpy(phi).to(acc)
        k_t = torch.zeros(n_max, chunk, BM, dtype=acc)
        k_t[:, :, :M] = torch.from_numpy(weights).to(acc)
        if len(_LEGS_DEVICE_TABLES) >= 8:
            _LEGS_DEVICE_TABLES.pop(next(iter(_LEGS_DEVICE_TABLES)))
        _LEGS_DEVICE_TABLES[key] = (phi_t.to(device), k_t.to(device))
    return _LEGS_DEVICE_TABLES[key]


# Kernels


# Chunk programs [L2], [L3]: the products of one head run with the chunk's tokens as rows
# (_legs_front, _legs_back, _legs_bwd_inputs); the per-position tables Phi_t and K(t, .) are
# shared by every head, so the products with them run in _legs_positions with the heads as
# columns, one program per position. Every product has a full tile of rows (wgmma on Hopper).


@triton.jit
def _legs_front(
    x: tl.tensor,
    z: tl.tensor,
    states: tl.tensor,
    sub_info: tl.tensor,
    y_buf: tl.tensor,
    a_buf: tl.tensor,
    H: tl.tensor,
    W: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    c_off: tl.tensor,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The head's side of p_t = Phi_t (S0 x_t) + sum_u K(t, u) (x_t . z_u) [L2]: y_t = S0 x_t
    over the state channels [c_off, c_off + W) into y_buf [T, H, BM], and a[t, u] = x_t . z_u
    (u <= t in the chunk) into a_buf [T, H, BT]. Grid (chunks, H)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, _, _ = sub_chunk(sub_info, i_c)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    tok = t0 + o_t
    m_t = tok < t1
    b_x = load_rows(x, tok, i_h, H, W, o_d, m_t, ACC)
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C
    p_s = s0 + o_m[None, :] * C + c_off + o_d[:, None]  # S0^T [BD, BM]
    s_t = tl.load(p_s, mask=(o_d < W)[:, None] & (o_m < M)[None, :], other=0.0).to(ACC)
    row = tok.to(tl.int64)[:, None] * H + i_h
    tl.store(
        y_buf + row * BM + o_m[None, :], tl.dot(b_x, s_t, input_precision=PREC), mask=m_t[:, None]
    )
    b_z = load_rows(z, tok, i_h, H, W, o_d, m_t, ACC)
    a = tl.dot(b_x, tl.trans(b_z), input_precision=PREC)
    a = tl.where(o_t[None, :] <= o_t[:, None], a, 0.0)
    tl.store(a_buf + row * BT + o_t[None, :], a, mask=m_t[:, None])


@triton.jit
def _legs_positions(
    y_buf: tl.tensor,
    a_buf: tl.tensor,
    add0: tl.tensor,
    p_buf: tl.tensor,
    hat_buf: tl.tensor,
    c_buf: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    cu: tl.tensor,
    H: tl.tensor,
    NH: tl.tensor,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BH: tl.constexpr,
    ADD0: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The tables' side [L2], for position k * BT + i of every sequence and head (the columns,
    NH = sequences x heads, BH of them per program): p_t = Phi_t y_t + sum_u K(t, u) a[t, u]
    (+ e_0 add0_t if ADD0), then hat_t = Phi_t^T p_t and c[t, u] = K(t, u) . p_t, stored per
    token like y_buf and a_buf. Grid (chunks of the longest sequence, BT, column blocks)."""
    k, i, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = k * BT + i  # the same position in every sequence: one Phi_t, K(t, .) for all columns
    col = i_b * BH + tl.arange(0, BH)
    n = col // H
    bos = tl.load(cu + n, mask=col < NH, other=0)
    eos = tl.load(cu + n + 1, mask=col < NH, other=0)
    m_h = (col < NH) & (bos + pos < eos)
    row = (bos + pos).to(tl.int64) * H + col % H  # [BH] rows of the [T, H] buffers
    o_m = tl.arange(0, BM)
    o_u = tl.arange(0, BT)
    m_hm = m_h[None, :] & (o_m < BM)[:, None]  # [BM, BH]
    m_hu = m_h[None, :] & (o_u < BT)[:, None]  # [BT, BH]
    y = tl.load(y_buf + row[None, :] * BM + o_m[:, None], mask=m_hm, other=0.0)
    a = tl.load(a_buf + row[None, :] * BT + o_u[:, None], mask=m_hu, other=0.0)
    ph = tl.load(phi + (pos.to(tl.int64) * BM + o_m[:, None]) * BM + o_m[None, :])  # Phi_t [BM, BM]
    kt = tl.load(
        ktab + (pos.to(tl.int64) * BT + o_u[None, :]) * BM + o_m[:, None]
    )  # K(t, u) [BM, BT]
    p = tl.dot(ph, y, input_precision=PREC) + tl.dot(kt, a, input_precision=PREC)
    if ADD0:
        e0 = tl.load(add0 + row, mask=m_h, other=0.0)
        p += tl.where(o_m[:, None] == 0, e0[None, :], 0.0)
    tl.store(p_buf + row[None, :] * BM + o_m[:, None], p, mask=m_hm)
    hat = tl.dot(tl.trans(ph), p, input_precision=PREC)
    tl.store(hat_buf + row[None, :] * BM + o_m[:, None], hat, mask=m_hm)
    c = tl.dot(tl.trans(kt), p, input_precision=PREC)
    tl.store(c_buf + row[None, :] * BT + o_u[:, None], c, mask=m_hu)


@triton.jit
def _legs_back(
    hat_buf: tl.tensor,
    c_buf: tl.tensor,
    z: tl.tensor,
    states: tl.tensor,
    sub_info: tl.tensor,
    out: tl.tensor,
    p_buf: tl.tensor,
    do: tl.tensor,
    dden_buf: tl.tensor,
    H: tl.tensor,
    W: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    c_off: tl.tensor,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    MODE: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The readout through the state [L2]: r_t = hat_t^T S0[:, c_off + d] + sum_u c[t, u] z_u
    over W channels. MODE 0: out = r / p[0], the output (I3) (eta = e_0, (I6)); MODE 1: the
    backward through the ratio [L3], out = dnum = do / p[0] and dden = -<dnum, r> / p[0] into
    dden_buf [T, H]; MODE 2: out = r. Grid (chunks, H)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, _, _ = sub_chunk(sub_info, i_c)
    o_t = tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    tok = t0 + o_t
    m_t = tok < t1
    row = tok.to(tl.int64)[:, None] * H + i_h
    hat = tl.load(hat_buf + row * BM + o_m[None, :], mask=m_t[:, None], other=0.0)
    s0 = states + (g.to(tl.int64) * H + i_h) * M * C
    p_s = s0 + o_m[:, None] * C + c_off + o_d[None, :]
    s_blk = tl.load(p_s, mask=(o_m < M)[:, None] & (o_d < W)[None, :], other=0.0).to(ACC)
    r = tl.dot(hat, s_blk, input_precision=PREC)
    c = tl.load(c_buf + row * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    r += tl.dot(c, load_rows(z, tok, i_h, H, W, o_d, m_t, ACC), input_precision=PREC)
    if MODE == 2:
        store_rows(out, r, tok, i_h, H, W, o_d, m_t)
    else:
        den = tl.load(p_buf + (tok.to(tl.int64) * H + i_h) * BM, mask=m_t, other=1.0)
        if MODE == 0:
            store_rows(out, r / den[:, None], tok, i_h, H, W, o_d, m_t)  # (I3)
        else:
            dnum = load_rows(do, tok, i_h, H, W, o_d, m_t, ACC) / den[:, None]
            store_rows(out, dnum, tok, i_h, H, W, o_d, m_t)
            dden = -tl.sum(dnum * r, axis=1) / den  # -<do, o> / den
            tl.store(dden_buf + tok.to(tl.int64) * H + i_h, dden, mask=m_t)


@triton.jit
def _legs_bwd_inputs(
    fq: tl.tensor,
    dnum: tl.tensor,
    cp_buf: tl.tensor,
    cg_buf: tl.tensor,
    dstates: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    dfk: tl.tensor,
    dv: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dz_t = F_t^T gc_t = K(e, t)^T D + sum_{t<=s<=e} (K(s, t) . q_s) zq_s [L3], with
    c[s, t] = K(s, t) . q_s from :func:`_legs_positions`: dfk from (g(p), fq, D^K), dv from
    (p, dnum, D^V); D the adjoint entering c_e (e = t1 - 1) from later tokens.
    Grid (chunks, H)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, _, pos0 = sub_chunk(sub_info, i_c)
    o_t = tl.arange(0, BT)
    o_m = tl.arange(0, BM)
    tok = t0 + o_t
    m_t = tok < t1
    row = tok.to(tl.int64)[:, None] * H + i_h
    p_e = pos0 + t1 - 1 - t0
    k_e = tl.load(
        ktab + (p_e.to(tl.int64) * BT + o_t[:, None]) * BM + o_m[None, :]
    )  # K(e, t) [BT, BM]
    d_st = dstates + (g.to(tl.int64) * H + i_h) * M * C
    o_r = tl.arange(0, BR)
    d_k = tl.load(
        d_st + o_m[:, None] * C + o_r[None, :],
        mask=(o_m < M)[:, None] & (o_r < R)[None, :],
        other=0.0,
    )
    cg = tl.load(cg_buf + row * BT + o_t[None, :], mask=m_t[:, None], other=0.0)  # [BT (s), BT (t)]
    dk = tl.dot(k_e, d_k.to(ACC), input_precision=PREC)
    dk += tl.dot(tl.trans(cg), load_rows(fq, tok, i_h, H, R, o_r, m_t, ACC), input_precision=PREC)
    store_rows(dfk, dk, tok, i_h, H, R, o_r, m_t)
    o_v = tl.arange(0, BV)
    d_v = tl.load(
        d_st + o_m[:, None] * C + R + o_v[None, :],
        mask=(o_m < M)[:, None] & (o_v < V)[None, :],
        other=0.0,
    )
    cp = tl.load(cp_buf + row * BT + o_t[None, :], mask=m_t[:, None], other=0.0)
    dz = tl.dot(k_e, d_v.to(ACC), input_precision=PREC)
    dz += tl.dot(tl.trans(cp), load_rows(dnum, tok, i_h, H, V, o_v, m_t, ACC), input_precision=PREC)
    store_rows(dv, dz, tok, i_h, H, V, o_v, m_t)


@triton.jit
def _legs_state_pass(
    fk: tl.tensor,
    v: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    states: tl.tensor,
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
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I5) chunk by chunk: store the state before each chunk, then
    c_e = Phi_e c_{t0-1} + sum_u K(e, u) f_u. Grid (N * H, channel blocks): N * H on axis x,
    whose limit is 2^31 - 1 (y and z: 65,535)."""
    i_nh, i_c = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = channel_block(i_c, NKB, R, V, BC)
    p_hm = o_m[:, None] * C + c_st[None, :]
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    s = tl.zeros([BM, BC], dtype=ACC)
    for k in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_s = states + ((g0 + k).to(tl.int64) * H + i_h) * M * C + p_hm
        tl.store(p_s, s.to(states.dtype.element_ty), mask=m_hm)
        tok = t0 + o_t
        if i_c < NKB:
            z = load_rows(fk, tok, i_h, H, R, c_loc, o_t < L, ACC)
        else:
            z = load_rows(v, tok, i_h, H, V, c_loc, o_t < L, ACC)
        p_e = k * BT + L - 1
        ph = tl.load(phi + (p_e.to(tl.int64) * BM + o_m[:, None]) * BM + o_m[None, :])  # [BM, BM]
        kw = tl.load(
            ktab + (p_e.to(tl.int64) * BT + o_t[None, :]) * BM + o_m[:, None]
        )  # K(e, u) [BM, BT]
        s = tl.dot(ph, s, input_precision=PREC) + tl.dot(kw, z, input_precision=PREC)


@triton.jit
def _legs_reverse_state_pass(
    fq: tl.tensor,
    dnum: tl.tensor,
    phat_buf: tl.tensor,
    ghat_buf: tl.tensor,
    phi: tl.tensor,
    dstates: tl.tensor,
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
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The adjoint state, chunk by chunk from the last: store D_k (the adjoint entering c_e
    from later tokens), then D_{k-1} = Phi_e^T D_k + sum_s (Phi_s^T q_s) zq_s^T with
    (q, zq) = (g(p), fq) on key channels and (p, dnum) on value channels."""
    i_nh, i_c = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = channel_block(i_c, NKB, R, V, BC)
    p_hm = o_m[:, None] * C + c_st[None, :]
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    d = tl.zeros([BM, BC], dtype=ACC)
    NT = tl.cdiv(eos - bos, BT)
    for kk in range(0, NT):
        k = NT - 1 - kk
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_d = dstates + ((g0 + k).to(tl.int64) * H + i_h) * M * C + p_hm
        tl.store(p_d, d.to(dstates.dtype.element_ty), mask=m_hm)
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            zq = load_rows(fq, tok, i_h, H, R, c_loc, m_t, ACC)
            p_q = ghat_buf + (tok.to(tl.int64)[None, :] * H + i_h) * BM + o_m[:, None]
        else:
            zq = load_rows(dnum, tok, i_h, H, V, c_loc, m_t, ACC)
            p_q = phat_buf + (tok.to(tl.int64)[None, :] * H + i_h) * BM + o_m[:, None]
        q_hat = tl.load(p_q, mask=m_t[None, :], other=0.0)  # (Phi_s^T q_s)^T [BM, BT]
        p_e = k * BT + L - 1
        ph_t = tl.load(phi + (p_e.to(tl.int64) * BM + o_m[None, :]) * BM + o_m[:, None])  # Phi_e^T
        d = tl.dot(ph_t, d, input_precision=PREC) + tl.dot(q_hat, zq, input_precision=PREC)


# Launchers


class _LegsPlan(NamedTuple):
    """Everything a LegS launch needs besides the data: sizes, tiles, layout, tables."""

    acc: torch.dtype
    layout: Layout  # one chunk program per chunk (sub-chunk = chunk)
    sizes: dict[str, int]  # H, M, C: the integer arguments of every chunk program
    R: int
    V: int
    NKB: int  # channel blocks of the key channels in a state pass
    grid_states: tuple[int, int]
    grid_chunks: tuple[int, int]  # (chunks, H)
    grid_positions: tuple[int, int, int]  # (chunks of the longest sequence, chunk, columns)
    phi: torch.Tensor
    ktab: torch.Tensor
    BH: int  # (sequence, head) columns per _legs_positions program
    common: dict[str, Any]  # BT, BM, ACC, PREC, num_warps
    state_tiles: dict[str, Any]  # ... and BC, of the state passes


def _legs_plan(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    packing: Packing | None,
) -> _LegsPlan:
    check_inputs(("fq", "fk", "v"), (fq, fk, v), (None, fq.shape[-1], None))
    assert isinstance(M, int) and M >= 1, M
    _, _, H, R = fq.shape
    V = v.shape[-1]
    cu = sequences("fq", fq, packing)
    acc, ACC, PREC = acc_types(fq.dtype)
    blocks = blocks_for(fq.device)
    lay = layout(cu, blocks.chunk, blocks.chunk, fq.device)
    BM = pow2(M)
    BC = pow2(min(max(R, V), blocks.channels))
    NKB = triton.cdiv(R, BC)
    phi, ktab = _legs_tables(M, blocks.chunk, lay.max_len, BM, acc, fq.device)
    NH = lay.N * H  # the columns of _legs_positions: every (sequence, head)
    BH = min(pow2(NH), LEGS_POSITION_COLUMNS)
    common = dict(BT=blocks.chunk, BM=BM, ACC=ACC, PREC=PREC, num_warps=blocks.num_warps)
    return _LegsPlan(
        acc=acc,
        layout=lay,
        sizes=dict(H=H, M=M, C=R + V),
        R=R,
        V=V,
        NKB=NKB,
        grid_states=(lay.N * H, NKB + triton.cdiv(V, BC)),
        grid_chunks=(lay.n_chunks, H),
        grid_positions=(triton.cdiv(lay.max_len, blocks.chunk), blocks.chunk, triton.cdiv(NH, BH)),
        phi=phi,
        ktab=ktab,
        BH=BH,
        common=common,
        state_tiles=dict(BC=BC, **common),
    )


def _legs_state_pass_launch(plan: _LegsPlan, fk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    lay, sizes = plan.layout, plan.sizes
    shape = (lay.n_chunks, sizes["H"], sizes["M"], sizes["C"])
    states = torch.empty(shape, dtype=stored_type(fk.dtype, plan.acc), device=fk.device)
    _legs_state_pass[plan.grid_states](
        fk=fk,
        v=v,
        phi=plan.phi,
        ktab=plan.ktab,
        states=states,
        cu=lay.cu,
        chunk_offsets=lay.chunk_offsets,
        R=plan.R,
        V=plan.V,
        NKB=plan.NKB,
        **sizes,
        **plan.state_tiles,
    )
    return states


def _chunk_args(plan: _LegsPlan, states: torch.Tensor, W: int, c_off: int) -> dict[str, Any]:
    """The arguments of a per-(chunk, head) program over the W state channels from c_off."""
    return dict(
        states=states,
        sub_info=plan.layout.sub_info,
        W=W,
        c_off=c_off,
        BD=pow2(W),
        **plan.sizes,
        **plan.common,
    )


class _Modes(NamedTuple):
    """Per-token buffers of one pass through the tables [L2]: p [T, H, BM], hat = Phi^T p
    [T, H, BM] and c[t, u] = K(t, u) . p [T, H, chunk]."""

    p: torch.Tensor
    hat: torch.Tensor
    c: torch.Tensor


def _legs_modes(
    plan: _LegsPlan,
    x: torch.Tensor,
    z: torch.Tensor,
    states: torch.Tensor,
    c_off: int,
    add0: torch.Tensor | None = None,
) -> _Modes:
    """p_t = Phi_t (S0 x_t) + sum_u K(t, u) (x_t . z_u) (+ e_0 add0_t) over the state channels
    [c_off, c_off + width of x), with Phi^T p and K . p: :func:`_legs_front`, then
    :func:`_legs_positions`."""
    T, H, W = x.shape
    BT, BM = plan.common["BT"], plan.common["BM"]
    new = lambda n: torch.empty(T, H, n, dtype=plan.acc, device=x.device)  # noqa: E731
    y, a = new(BM), new(BT)
    lay = plan.layout
    _legs_front[plan.grid_chunks](x=x, z=z, y_buf=y, a_buf=a, **_chunk_args(plan, states, W, c_off))
    out = _Modes(new(BM), new(BM), new(BT))
    _legs_positions[plan.grid_positions](
        y_buf=y,
        a_buf=a,
        add0=add0,
        p_buf=out.p,
        hat_buf=out.hat,
        c_buf=out.c,
        phi=plan.phi,
        ktab=plan.ktab,
        cu=lay.cu,
        H=H,
        NH=lay.N * H,
        BH=plan.BH,
        ADD0=add0 is not None,
        **(plan.common | dict(num_warps=4)),  # [BM, BH] products: one warpgroup
    )
    return out


def _legs_back_launch(
    plan: _LegsPlan,
    modes: _Modes,
    z: torch.Tensor,
    states: torch.Tensor,
    c_off: int,
    out: torch.Tensor,
    mode: int,
    do: torch.Tensor | None = None,
    dden: torch.Tensor | None = None,
) -> None:
    _legs_back[plan.grid_chunks](
        hat_buf=modes.hat,
        c_buf=modes.c,
        z=z,
        out=out,
        p_buf=modes.p,
        do=do,
        dden_buf=dden,
        MODE=mode,
        **_chunk_args(plan, states, z.shape[-1], c_off),
    )


@dispatch.register("legs_fwd", "triton")
def legs_fwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    packing: Packing | None,
) -> torch.Tensor:
    """Interdomain attention with the LegS basis, (I2)-(I6), chunked over the exact steps.

    Args:
        fq, fk: [B, T, H, R] features; v: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        M: the number of basis functions.
        packing: None, or the checked offsets of N sequences (a ``Packing``, none empty),
            B = 1; each segment starts at n = 1.

    Returns:
        o [B, T, H, V] in the dtype of fq (ratio readout (I3), eta = e_0 (I6)). Time
        O(T (M^2 + chunk M + M (R + V))) per head; memory O(T / chunk M (R + V)) for the chunk
        states, O(T (M + chunk)) per head for the per-token buffers, plus the position tables
        O(T M (M + chunk)), shared by all heads and calls.
    """
    plan = _legs_plan(fq, fk, v, M, packing)
    fq_, fk_, v_ = flat(fq), flat(fk), flat(v)
    states = _legs_state_pass_launch(plan, fk_, v_)
    modes = _legs_modes(plan, fq_, fk_, states, 0)
    o = torch.empty_like(v_)
    _legs_back_launch(plan, modes, v_, states, plan.R, o, mode=0)
    return o.reshape(v.shape)


@dispatch.register("legs_bwd", "triton")
def legs_bwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    packing: Packing | None,
    do: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`legs_fwd` for the cotangent do [B, T, H, V] (the adjoint of (I5)
    run backwards, as ``attnspec.reference.interdomain.interdomain_legs_vjp``).

    Returns:
        (dfq, dfk, dv) in the dtype of their inputs. Time about 3x the forward; memory
        O(T (M + chunk)) per head for the per-token buffers of p and g(p), dnum and dden, plus
        two sets of chunk states.
    """
    plan = _legs_plan(fq, fk, v, M, packing)
    check_cotangent("do", do, v)
    fq_, fk_, v_, do_ = flat(fq), flat(fk), flat(v), flat(do)
    states = _legs_state_pass_launch(plan, fk_, v_)
    modes = _legs_modes(plan, fq_, fk_, states, 0)  # p
    dnum = torch.empty(do_.shape, dtype=plan.acc, device=fq.device)
    dden = torch.empty(do_.shape[:2], dtype=plan.acc, device=fq.device)
    _legs_back_launch(plan, modes, v_, states, plan.R, dnum, mode=1, do=do_, dden=dden)
    grads = _legs_modes(plan, dnum, v_, states, plan.R, add0=dden)  # g(p) = Gamma dnum + e_0 dden
    dfq = torch.empty_like(fq_)
    _legs_back_launch(plan, grads, fk_, states, 0, dfq, mode=2)  # dfq = U^T g(p)
    lay = plan.layout
    dstates = torch.empty_like(states)
    _legs_reverse_state_pass[plan.grid_states](
        fq=fq_,
        dnum=dnum,
        phat_buf=modes.hat,
        ghat_buf=grads.hat,
        phi=plan.phi,
        dstates=dstates,
        cu=lay.cu,
        chunk_offsets=lay.chunk_offsets,
        R=plan.R,
        V=plan.V,
        NKB=plan.NKB,
        **plan.sizes,
        **plan.state_tiles,
    )
    dfk, dv = torch.empty_like(fk_), torch.empty_like(v_)
    _legs_bwd_inputs[plan.grid_chunks](
        fq=fq_,
        dnum=dnum,
        cp_buf=modes.c,
        cg_buf=grads.c,
        dstates=dstates,
        ktab=plan.ktab,
        sub_info=lay.sub_info,
        dfk=dfk,
        dv=dv,
        R=plan.R,
        V=plan.V,
        BR=pow2(plan.R),
        BV=pow2(plan.V),
        **plan.sizes,
        **plan.common,
    )
    return dfq.reshape(fq.shape), dfk.reshape(fk.shape), dv.reshape(v.shape)


# Decode: one token, fixed-size state (H6)


class LegsState(NamedTuple):
    """The LegS decode state: coefficients c [B, H, M, R + V] after ``n`` tokens."""

    c: torch.Tensor
    n: int


@triton.jit
def _legs_step(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    E: tl.tensor,
    F: tl.tensor,
    state: tl.tensor,
    new_state: tl.tensor,
    o: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    FIRST: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """One token of (I5) and (I3) for one (sequence, head): c <- E_n c + F_n f,
    p = U fq, o = Gamma^T p / p[0]. Grid (B * H,)."""
    i_bh = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_r = tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    e = tl.load(E + o_m[:, None] * BM + o_m[None, :])
    f = tl.load(F + o_m)
    base = i_bh.to(tl.int64) * M * C
    z = tl.load(fk + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p_c = o_m[:, None] * C + o_r[None, :]
    m_c = (o_m < M)[:, None] & (o_r < R)[None, :]
    u = f[:, None] * z[None, :]
    if not FIRST:
        c_k = tl.load(state + base + p_c, mask=m_c, other=0.0).to(ACC)
        u += tl.dot(e, c_k, input_precision=PREC)  # (I5)
    tl.store(new_state + base + p_c, u, mask=m_c)
    q = tl.load(fq + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p = tl.sum(u * q[None, :], axis=1)  # U fq
    z = tl.load(v + i_bh * V + o_v, mask=o_v < V, other=0.0).to(ACC)
    p_c = o_m[:, None] * C + R + o_v[None, :]
    m_c = (o_m < M)[:, None] & (o_v < V)[None, :]
    g = f[:, None] * z[None, :]
    if not FIRST:
        c_v = tl.load(state + base + p_c, mask=m_c, other=0.0).to(ACC)
        g += tl.dot(e, c_v, input_precision=PREC)
    tl.store(new_state + base + p_c, g, mask=m_c)
    den = tl.sum(tl.where(o_m == 0, p, 0.0), axis=0)  # (I6) eta = e_0
    out = tl.sum(p[:, None] * g, axis=0) / den  # (I3)
    tl.store(o + i_bh * V + o_v, out.to(o.dtype.element_ty), mask=o_v < V)


def legs_step(
    fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, M: int, state: LegsState | None
) -> tuple[torch.Tensor, LegsState]:
    """One decode step of Interdomain attention with the LegS basis (I5), (I3) (H6).

    The step E_n depends on the token index n, so the state carries a counter; every
    sequence of the batch is at the same n.

    Args:
        fq, fk: [B, H, R]; v: [B, H, V] (this token); M: basis size.
        state: the :class:`LegsState` after the previous tokens, or None before the first.

    Returns:
        o [B, H, V] in the dtype of fq and the new state (float32, float64 for float64
        inputs; the old one is not modified). Time O(M^2 (R + V)) per (sequence, head);
        memory O(M (R + V)).
    """
    assert fq.ndim == fk.ndim == v.ndim == 3, "one token: [B, H, D]"
    check_inputs(
        ("fq", "fk", "v"), (fq[:, None], fk[:, None], v[:, None]), (None, fq.shape[-1], None)
    )
    assert isinstance(M, int) and M >= 1, M
    B, H, R = fq.shape
    V = v.shape[-1]
    acc, ACC, PREC = acc_types(fq.dtype)
    shape = (B, H, M, R + V)
    n = 1 if state is None else state.n + 1
    if state is not None:
        assert (tuple(state.c.shape), state.c.dtype, state.c.device) == (shape, acc, fq.device)
    BM = pow2(M)
    E, F = hippo.legs_step(n, M)
    e_t = torch.zeros(BM, BM, dtype=acc)
    e_t[:M, :M] = torch.from_numpy(E).to(acc)
    f_t = torch.zeros(BM, dtype=acc)
    f_t[:M] = torch.from_numpy(F).to(acc)
    new_c = torch.empty(shape, dtype=acc, device=fq.device)
    o = torch.empty(B, H, V, dtype=v.dtype, device=fq.device)
    _legs_step[(B * H,)](
        fq=fq.contiguous(),
        fk=fk.contiguous(),
        v=v.contiguous(),
        E=e_t.to(fq.device),
        F=f_t.to(fq.device),
        state=state.c.contiguous() if state is not None else None,  # read unless FIRST
        new_state=new_c,
        o=o,
        R=R,
        V=V,
        M=M,
        C=R + V,
        BR=pow2(R),
        BV=pow2(V),
        BM=BM,
        FIRST=state is None,
        ACC=ACC,
        PREC=PREC,
    )
    return o, LegsState(new_c, n)
