"""Triton kernels for Interdomain Attention with the LegS basis, (I2)-(I6), and its decode step.

Registered in :mod:`.dispatch` as impl ``"triton"`` of ``legs_fwd`` and ``legs_bwd``; layout
``[B, T, H, D]`` (varlen: B = 1 and ``cu_seqlens``); the launch plan of :mod:`.triton_chunks`.
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


# --------------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _legs_modes(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    i_s: tl.tensor,
    pos: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """p_t = c_t q_t over the channels [c_off, c_off + W) of the state, for the rows of one
    sub-chunk: p_t = Phi_t (S0 q_t) + sum_{t0<=u<=t} K(t, u) (q_t . z_u).

    b_q: [BS, BD] rows q_t; src: [T, H, W] inputs z_u; s0: the state [M, C] before the chunk;
    pos: [BS] table positions of the rows. Returns p [BS, BM].
    """
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_b = tl.arange(0, BMB)
    p = tl.zeros([BS, BM], dtype=ACC)
    for mb in range(0, BM, BMB):  # Phi_t y_t, contracted in blocks of BMB modes
        m_b = mb + o_b
        p_s = s0 + m_b[None, :] * C + c_off + o_d[:, None]
        s_blk = tl.load(p_s, mask=(o_d < W)[:, None] & (m_b < M)[None, :], other=0.0)
        y = tl.dot(b_q, s_blk.to(ACC), input_precision=PREC)  # (S0 q_t)[m_b] [BS, BMB]
        ph = tl.load(phi + (pos[:, None, None] * BM + o_m[None, :, None]) * BM + m_b[None, None, :])
        p += tl.sum(ph * y[:, None, :], axis=2)
    for j in range(0, i_s + 1):
        tok_u = t0 + j * BS + o_s
        b_k = load_rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, ACC)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # q_t . z_u [BS, BS]
        kg = tl.load(
            ktab + (pos[:, None, None] * BT + j * BS + o_s[None, :, None]) * BM + o_m[None, None, :]
        )
        p += tl.sum(a[:, :, None] * kg, axis=1)
    return p


@triton.jit
def _legs_readout(
    p: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    i_s: tl.tensor,
    pos: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """out_t = c_t[:, channels]^T p_t = (Phi_t^T p_t)^T S0 + sum_{t0<=u<=t} (K(t, u) . p_t) z_u
    for the rows of one sub-chunk [L2]. Returns out [BS, BD]."""
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_b = tl.arange(0, BMB)
    out = tl.zeros([BS, BD], dtype=ACC)
    for mb in range(0, BM, BMB):
        m_b = mb + o_b
        ph = tl.load(phi + (pos[:, None, None] * BM + o_m[None, :, None]) * BM + m_b[None, None, :])
        hat = tl.sum(ph * p[:, :, None], axis=1)  # (Phi_t^T p_t)[m_b] [BS, BMB]
        p_s = s0 + m_b[:, None] * C + c_off + o_d[None, :]
        s_blk = tl.load(p_s, mask=(m_b < M)[:, None] & (o_d < W)[None, :], other=0.0)
        out += tl.dot(hat, s_blk.to(ACC), input_precision=PREC)
    for j in range(0, i_s + 1):
        tok_u = t0 + j * BS + o_s
        kg = tl.load(
            ktab + (pos[:, None, None] * BT + j * BS + o_s[None, :, None]) * BM + o_m[None, None, :]
        )
        s = tl.sum(kg * p[:, None, :], axis=2)  # K(t, u) . p_t [BS, BS]
        out += tl.dot(
            s, load_rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, ACC), input_precision=PREC
        )
    return out


@triton.jit
def _legs_store_hat(
    p: tl.tensor,
    phi: tl.tensor,
    pos: tl.tensor,
    hat_buf: tl.tensor,
    tok: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    BS: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
) -> None:
    """Keep Phi_t^T p_t in hat_buf [T, H, BM] for the reverse state pass [L3]."""
    o_m = tl.arange(0, BM)
    for mb in range(0, BM, BMB):
        m_b = mb + tl.arange(0, BMB)
        ph = tl.load(phi + (pos[:, None, None] * BM + o_m[None, :, None]) * BM + m_b[None, None, :])
        hat = tl.sum(ph * p[:, :, None], axis=1)  # (Phi_t^T p_t)[m_b] [BS, BMB]
        p_h = hat_buf + (tok.to(tl.int64)[:, None] * H + i_h) * BM + m_b[None, :]
        tl.store(p_h, hat, mask=m_t[:, None])


@triton.jit
def _legs_adjoint_inputs(
    q_buf: tl.tensor,
    zsrc: tl.tensor,
    W: tl.tensor,
    d_st: tl.tensor,
    c_off: tl.tensor,
    ktab: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    j_s: tl.tensor,
    tok: tl.tensor,
    pos0: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """dz_t = F_t^T gc_t = K(e, t)^T D + sum_{t<=s<=e} (K(s, t) . q_s) zq_s for the rows of one
    sub-chunk; D is the adjoint entering c_e (e = t1 - 1) from later tokens, q_buf [T, H, BM].
    Returns dz [BS, BD]."""
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    p_e = pos0 + t1 - 1 - t0
    k_e = tl.load(ktab + (p_e * BT + (tok - t0)[:, None]) * BM + o_m[None, :])  # K(e, t)
    p_d = d_st + o_m[:, None] * C + c_off + o_d[None, :]
    d_blk = tl.load(p_d, mask=(o_m < M)[:, None] & (o_d < W)[None, :], other=0.0)
    dz = tl.dot(k_e, d_blk.to(ACC), input_precision=PREC)
    for i in range(j_s, tl.cdiv(t1 - t0, BS)):
        tok_s = t0 + i * BS + o_s
        m_s = tok_s < t1
        p_q = q_buf + (tok_s.to(tl.int64)[:, None] * H + i_h) * BM + o_m[None, :]
        q = tl.load(p_q, mask=m_s[:, None], other=0.0)
        pos_s = pos0 + i * BS + o_s
        kg = tl.load(
            ktab + (pos_s[None, :, None] * BT + (tok - t0)[:, None, None]) * BM + o_m[None, None, :]
        )
        st = tl.sum(kg * q[None, :, :], axis=2)  # K(s, t) . q_s [BS (t), BS (s)]
        dz += tl.dot(st, load_rows(zsrc, tok_s, i_h, H, W, o_d, m_s, ACC), input_precision=PREC)
    return dz


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
    c_e = Phi_e c_{t0-1} + sum_u K(e, u) f_u. Grid (channel blocks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
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
        p_s = states + ((g0 + k) * H + i_h).to(tl.int64) * M * C + p_hm
        tl.store(p_s, s.to(states.dtype.element_ty), mask=m_hm)
        tok = t0 + o_t
        if i_c < NKB:
            z = load_rows(fk, tok, i_h, H, R, c_loc, o_t < L, ACC)
        else:
            z = load_rows(v, tok, i_h, H, V, c_loc, o_t < L, ACC)
        p_e = k * BT + L - 1
        ph = tl.load(phi + (p_e * BM + o_m[:, None]) * BM + o_m[None, :])  # [BM, BM]
        kw = tl.load(ktab + (p_e * BT + o_t[None, :]) * BM + o_m[:, None])  # K(e, u) [BM, BT]
        s = tl.dot(ph, s, input_precision=PREC) + tl.dot(kw, z, input_precision=PREC)


@triton.jit
def _legs_output(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    o: tl.tensor,
    states: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I3) for the rows of one sub-chunk: p_t = U_t fq_t, o_t = Gamma_t^T p_t / p_t[0]
    (eta = e_0 exactly, (I6)). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, pos0 = sub_chunk(sub_info, i_p)
    o_s = tl.arange(0, BS)
    tok = t0 + i_s * BS + o_s
    m_t = tok < t1
    pos = pos0 + i_s * BS + o_s
    s0 = states + (g * H + i_h).to(tl.int64) * M * C
    b_q = load_rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p = _legs_modes(
        b_q, fk, R, s0, 0, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BR, BM, BMB, ACC, PREC
    )
    den = tl.sum(tl.where(tl.arange(0, BM)[None, :] == 0, p, 0.0), axis=1)  # (I6) eta = e_0
    num = _legs_readout(
        p, v, V, s0, R, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BV, BM, BMB, ACC, PREC
    )
    out = num / tl.where(m_t, den, 1.0)[:, None]  # (I3)
    store_rows(o, out, tok, i_h, H, V, tl.arange(0, BV), m_t)


@triton.jit
def _legs_bwd_readout(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    do: tl.tensor,
    states: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    p_buf: tl.tensor,
    phat_buf: tl.tensor,
    dnum_buf: tl.tensor,
    dden_buf: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """Backward through the ratio (I3) for the rows of one sub-chunk: recompute p, den, num;
    keep p, Phi^T p, dnum = do / den and dden = -<do, o> / den for :func:`_legs_bwd_modes`
    and the adjoint pass [L3]. Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, pos0 = sub_chunk(sub_info, i_p)
    o_s = tl.arange(0, BS)
    o_m = tl.arange(0, BM)
    tok = t0 + i_s * BS + o_s
    m_t = tok < t1
    pos = pos0 + i_s * BS + o_s
    s0 = states + (g * H + i_h).to(tl.int64) * M * C
    b_q = load_rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p = _legs_modes(
        b_q, fk, R, s0, 0, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BR, BM, BMB, ACC, PREC
    )
    p_m = (tok.to(tl.int64)[:, None] * H + i_h) * BM + o_m[None, :]
    tl.store(p_buf + p_m, p, mask=m_t[:, None])
    _legs_store_hat(p, phi, pos, phat_buf, tok, m_t, i_h, H, BS, BM, BMB)
    den = tl.where(m_t, tl.sum(tl.where(o_m[None, :] == 0, p, 0.0), axis=1), 1.0)
    num = _legs_readout(
        p, v, V, s0, R, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BV, BM, BMB, ACC, PREC
    )
    o_v = tl.arange(0, BV)
    dnum = load_rows(do, tok, i_h, H, V, o_v, m_t, ACC) / den[:, None]
    store_rows(dnum_buf, dnum, tok, i_h, H, V, o_v, m_t)
    dden = -tl.sum(dnum * num, axis=1) / den  # -<do, o> / den
    tl.store(dden_buf + tok.to(tl.int64) * H + i_h, dden, mask=m_t)


@triton.jit
def _legs_bwd_modes(
    fk: tl.tensor,
    v: tl.tensor,
    states: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    dnum_buf: tl.tensor,
    dden_buf: tl.tensor,
    gp_buf: tl.tensor,
    ghat_buf: tl.tensor,
    dfq: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """g(p_t) = Gamma_t dnum_t + e_0 dden_t and dfq_t = U_t^T g(p_t) for the rows of one
    sub-chunk, from what :func:`_legs_bwd_readout` kept; keeps g(p) and Phi^T g(p) for the
    adjoint pass [L3]. A program of its own: with the readout's it would not fit the registers.
    Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, i_s, pos0 = sub_chunk(sub_info, i_p)
    o_s = tl.arange(0, BS)
    o_m = tl.arange(0, BM)
    tok = t0 + i_s * BS + o_s
    m_t = tok < t1
    pos = pos0 + i_s * BS + o_s
    s0 = states + (g * H + i_h).to(tl.int64) * M * C
    dnum = load_rows(dnum_buf, tok, i_h, H, V, tl.arange(0, BV), m_t, ACC)
    gp = _legs_modes(
        dnum, v, V, s0, R, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BV, BM, BMB, ACC, PREC
    )
    dden = tl.load(dden_buf + tok.to(tl.int64) * H + i_h, mask=m_t, other=0.0)
    gp += tl.where(o_m[None, :] == 0, dden[:, None], 0.0)  # + e_0 dden
    p_m = (tok.to(tl.int64)[:, None] * H + i_h) * BM + o_m[None, :]
    tl.store(gp_buf + p_m, gp, mask=m_t[:, None])
    _legs_store_hat(gp, phi, pos, ghat_buf, tok, m_t, i_h, H, BS, BM, BMB)
    dq = _legs_readout(
        gp, fk, R, s0, 0, phi, ktab, t0, t1, i_s, pos, i_h, H, C, M, BT, BS, BR, BM, BMB, ACC, PREC
    )
    store_rows(dfq, dq, tok, i_h, H, R, tl.arange(0, BR), m_t)


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
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
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
        p_d = dstates + ((g0 + k) * H + i_h).to(tl.int64) * M * C + p_hm
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
        ph_t = tl.load(phi + (p_e * BM + o_m[None, :]) * BM + o_m[:, None])  # Phi_e^T
        d = tl.dot(ph_t, d, input_precision=PREC) + tl.dot(q_hat, zq, input_precision=PREC)


@triton.jit
def _legs_bwd_inputs(
    fq: tl.tensor,
    dnum: tl.tensor,
    p_buf: tl.tensor,
    gp_buf: tl.tensor,
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
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dz_t = F_t^T gc_t for the rows of one sub-chunk: dfk from (g(p), fq, D^K) and dv from
    (p, dnum, D^V). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1, g, j_s, pos0 = sub_chunk(sub_info, i_p)
    tok = t0 + j_s * BS + tl.arange(0, BS)
    m_t = tok < t1
    d_st = dstates + (g * H + i_h).to(tl.int64) * M * C
    dk = _legs_adjoint_inputs(
        gp_buf,
        fq,
        R,
        d_st,
        0,
        ktab,
        t0,
        t1,
        j_s,
        tok,
        pos0,
        m_t,
        i_h,
        H,
        C,
        M,
        BT,
        BS,
        BR,
        BM,
        ACC,
        PREC,
    )
    store_rows(dfk, dk, tok, i_h, H, R, tl.arange(0, BR), m_t)
    dz = _legs_adjoint_inputs(
        p_buf,
        dnum,
        V,
        d_st,
        R,
        ktab,
        t0,
        t1,
        j_s,
        tok,
        pos0,
        m_t,
        i_h,
        H,
        C,
        M,
        BT,
        BS,
        BV,
        BM,
        ACC,
        PREC,
    )
    store_rows(dv, dz, tok, i_h, H, V, tl.arange(0, BV), m_t)


# --------------------------------------------------------------------------------------------
# Launchers


class _LegsPlan(NamedTuple):
    """Everything a LegS launch needs besides the data: sizes, tiles, layout, tables."""

    acc: torch.dtype
    layout: Layout
    sizes: dict[str, int]  # H, R, V, M, C: the integer arguments of every kernel
    NKB: int  # channel blocks of the key channels in a state pass
    grid_states: tuple[int, int]
    grid_sub: tuple[int, int]
    phi: torch.Tensor
    ktab: torch.Tensor
    tiles: dict[str, Any]  # constexpr tile sizes of the output-pass kernels
    state_tiles: dict[str, Any]  # ... and of the state-pass kernels


def _legs_plan(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
) -> _LegsPlan:
    check_inputs(("fq", "fk", "v"), (fq, fk, v), (None, fq.shape[-1], None))
    assert isinstance(M, int) and M >= 1, M
    _, _, H, R = fq.shape
    V = v.shape[-1]
    cu = sequences("fq", fq, cu_seqlens)
    acc, ACC, PREC = acc_types(fq.dtype)
    blocks = blocks_for(fq.device)
    sub = blocks.legs_sub_chunk or blocks.sub_chunk
    lay = layout(cu, blocks.chunk, sub, fq.device)
    BM = pow2(M)
    BC = pow2(min(max(R, V), blocks.channels))
    NKB = triton.cdiv(R, BC)
    phi, ktab = _legs_tables(M, blocks.chunk, lay.max_len, BM, acc, fq.device)
    common = dict(BT=blocks.chunk, BM=BM, ACC=ACC, PREC=PREC, num_warps=blocks.num_warps)
    return _LegsPlan(
        acc=acc,
        layout=lay,
        sizes=dict(H=H, R=R, V=V, M=M, C=R + V),
        NKB=NKB,
        grid_states=(NKB + triton.cdiv(V, BC), lay.N * H),
        grid_sub=(lay.n_sub, H),
        phi=phi,
        ktab=ktab,
        tiles=dict(BS=sub, BR=pow2(R), BV=pow2(V), **common),
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
        NKB=plan.NKB,
        **sizes,
        **plan.state_tiles,
    )
    return states


@dispatch.register("legs_fwd", "triton")
def legs_fwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Interdomain attention with the LegS basis, (I2)-(I6), chunked over the exact steps.

    Args:
        fq, fk: [B, T, H, R] features; v: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        M: the number of basis functions.
        cu_seqlens: None, or (N + 1,) int offsets with B = 1; each segment starts at n = 1.

    Returns:
        o [B, T, H, V] in the dtype of fq (ratio readout (I3), eta = e_0 (I6)). Time
        O(T (M^2 + chunk M + M (R + V))) per head; memory O(T / chunk M (R + V)) for the chunk
        states plus the position tables O(T M (M + chunk)), shared by all heads and calls.
    """
    plan = _legs_plan(fq, fk, v, M, cu_seqlens)
    fq_, fk_, v_ = flat(fq), flat(fk), flat(v)
    states = _legs_state_pass_launch(plan, fk_, v_)
    o = torch.empty_like(v_)
    _legs_output[plan.grid_sub](
        fq=fq_,
        fk=fk_,
        v=v_,
        o=o,
        states=states,
        phi=plan.phi,
        ktab=plan.ktab,
        sub_info=plan.layout.sub_info,
        BMB=16,
        **plan.sizes,
        **plan.tiles,
    )
    return o.reshape(v.shape)


@dispatch.register("legs_bwd", "triton")
def legs_bwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
    do: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`legs_fwd` for the cotangent do [B, T, H, V] (the adjoint of (I5)
    run backwards, as ``attnspec.reference.interdomain.interdomain_legs_vjp``).

    Returns:
        (dfq, dfk, dv) in the dtype of their inputs. Time about 3x the forward; memory O(T M)
        for four per-token mode buffers and dnum, dden plus two sets of chunk states.
    """
    plan = _legs_plan(fq, fk, v, M, cu_seqlens)
    check_cotangent("do", do, v)
    lay, sizes = plan.layout, plan.sizes
    fq_, fk_, v_, do_ = flat(fq), flat(fk), flat(v), flat(do)
    dev, acc, BM = fq.device, plan.acc, plan.tiles["BM"]
    states = _legs_state_pass_launch(plan, fk_, v_)
    p_buf, phat, gp_buf, ghat = (
        torch.empty(fq_.shape[0], sizes["H"], BM, dtype=acc, device=dev) for _ in range(4)
    )
    dnum = torch.empty(do_.shape, dtype=acc, device=dev)
    dden = torch.empty(do_.shape[:2], dtype=acc, device=dev)
    tables = dict(states=states, phi=plan.phi, ktab=plan.ktab, sub_info=lay.sub_info, BMB=16)
    _legs_bwd_readout[plan.grid_sub](
        fq=fq_,
        fk=fk_,
        v=v_,
        do=do_,
        p_buf=p_buf,
        phat_buf=phat,
        dnum_buf=dnum,
        dden_buf=dden,
        **tables,
        **sizes,
        **plan.tiles,
    )
    dfq = torch.empty_like(fq_)
    _legs_bwd_modes[plan.grid_sub](
        fk=fk_,
        v=v_,
        dnum_buf=dnum,
        dden_buf=dden,
        gp_buf=gp_buf,
        ghat_buf=ghat,
        dfq=dfq,
        **tables,
        **sizes,
        **plan.tiles,
    )
    dstates = torch.empty_like(states)
    _legs_reverse_state_pass[plan.grid_states](
        fq=fq_,
        dnum=dnum,
        phat_buf=phat,
        ghat_buf=ghat,
        phi=plan.phi,
        dstates=dstates,
        cu=lay.cu,
        chunk_offsets=lay.chunk_offsets,
        NKB=plan.NKB,
        **sizes,
        **plan.state_tiles,
    )
    dfk, dv = torch.empty_like(fk_), torch.empty_like(v_)
    _legs_bwd_inputs[plan.grid_sub](
        fq=fq_,
        dnum=dnum,
        p_buf=p_buf,
        gp_buf=gp_buf,
        dstates=dstates,
        ktab=plan.ktab,
        sub_info=lay.sub_info,
        dfk=dfk,
        dv=dv,
        **sizes,
        **plan.tiles,
    )
    return dfq.reshape(fq.shape), dfk.reshape(fk.shape), dv.reshape(v.shape)


# --------------------------------------------------------------------------------------------
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
