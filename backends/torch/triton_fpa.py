"""Triton kernels for First Passage Attention and its FoX special case (spec/fpa.md section 7).

Registered in :mod:`attnspec.backends.torch.dispatch` as implementation ``"triton"`` of
``fpa_fwd``, ``fpa_bwd``, ``fox_fwd`` and ``fox_bwd``, with the signatures stated there; layout
``[B, T, H, D]``, per-token scalars ``[B, T, H]``, GQA (HQ query heads, H key/value heads) and
varlen (``cu_seqlens``, B = 1). On a machine without a GPU they run under the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported).

Tiling (section 7). A program owns a tile of BT rows (the queries of a query tile in the forward
and dq passes, the keys of a key tile in the dk/dv pass) and visits tiles of BS rows of the other
side, the diagonal first and then outward, so the gap between the two tiles grows by one tile per
step. Tiles are aligned to the start of each sequence. For i and j in different BT tiles:

    m_ij = min(A_j, mid, B_i)    A_j: min phi over (j, end of j's tile]
                                 mid: min phi over the BT tiles strictly between (running min)
                                 B_i: min phi over [start of i's tile, i]

Inside a BT tile the segment minimum is exact: with k the highest bit in which the in-tile
offsets of j < i differ, (j, i] is the end of j's aligned 2^k-block after j followed by the start
of i's 2^k-block up to i, so m_ij = min(Suf_k[j], Pre_k[i]). ``_block_minima_kernel`` computes
Pre_k and Suf_k for every k by doubling (aligned blocks merge pairwise), once per tile; A = Suf
and B = Pre at the top level.

Backward (G3): the latest argmin t*_ij lies in B, in the gap or in A. Each part is summed by the
program that owns its target: the dq program sums rows into B's argmin (and owns the whole
diagonal tile), the dk/dv program sums columns into A's argmin, and the dq program writes one sum
per (query tile, gap tile holding the gap's latest minimum) into a buffer that
``_dfield_kernel`` reduces in a second pass. No atomics: every output has one writer.

The FoX fast path (F6) uses only the bias sum_{(j, i]} log f, the sum-analogue of the same
split: cumulative sums local to each BT tile (``_block_sums_kernel``) plus a carried gap sum, so
long sequences keep float32 precision in the logits. Its dlog_f is a reverse sum of row minus
column sums of G per sequence, taken in float64 (``_segment_sums_kernel``, no host sync).

Precision. Penalties, logits, softmax statistics and accumulators are float32 (float64 with
float64 inputs). tl.dot takes bf16/fp16 operands as they come; float32 and float64 operands use
input_precision "ieee" (TF32 would miss the kit's float32 tolerance), except the diagonal's
dfield rectangle sums, three TF32 passes. As in FlashAttention, delta_i = <dO_i, o_i> uses o as
stored, in q's dtype: with bfloat16 and near one-hot rows (strong decay) this is the largest
error of the gradients. Under the interpreter, whose bfloat16 arithmetic is wrong, bfloat16 dots
run in float32 on operands rounded to bfloat16 first, so tests see a GPU's rounding.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from attnspec.reference.packing import Packing

from ..tile_sizes import HOPPER_WIDE, TILE_TABLE, Tiles
from . import checks, dispatch
from .devices import device_class, interpreting
from .triton_helpers import WIDE, bf16_nearest, dot_dtype, precision

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MAX_HEAD_DIM = 256


# tile sizes


PREPASS_WARPS = 4  # the per-token passes (block minima and sums, delta, dfield, segment sums)
ROW_BLOCK = 64  # tokens per program of the delta pass; gap sums per step of the dfield pass
SEGMENT_BLOCK = 1024  # tokens per step of the FoX reverse segment sums
_forced_tiles: tuple[Tiles, Tiles] | None = None


@contextmanager
def forced_tiles(forward: Tiles, backward: Tiles | None = None) -> Iterator[None]:
    """Use these tile sizes inside the ``with`` block instead of the device table.

    Tests force small tiles so that short sequences cross several of them.
    """
    global _forced_tiles
    previous, _forced_tiles = _forced_tiles, (forward, backward or forward)
    try:
        yield
    finally:
        _forced_tiles = previous


def tile_choice(kind: str, backward: bool, K: int, V: int, dtype: torch.dtype) -> Tiles:
    """The tile sizes of a launch on a device of class ``kind`` (a row of :data:`TILE_TABLE`)
    for head dims K, V and input dtype; forced ones first. The static Hopper gate
    (bench/gpu_static.py) compiles the kernels with exactly these."""
    pair = _forced_tiles or TILE_TABLE[kind]
    row = _block(max(K, V)) * torch.empty((), dtype=dtype).element_size()
    if _forced_tiles is None and kind == "hopper" and row > 256:
        pair = next(HOPPER_WIDE[w] for w in sorted(HOPPER_WIDE) if row <= w)
    return pair[1 if backward else 0]


def tiles_for(
    device: torch.device,
    backward: bool,
    K: int = 128,
    V: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> Tiles:
    """The tile sizes a launch on ``device`` uses (forced ones first)."""
    return tile_choice(device_class(device), backward, K, V, dtype)


# Triton kernels


@triton.jit
def _bit(LOG: tl.constexpr, b: tl.constexpr) -> tl.tensor:
    """0/1 along the axis of bit b of an in-tile offset, in ``reshape(x, [2] * LOG)``."""
    return tl.reshape(tl.arange(0, 2), [1] * (LOG - 1 - b) + [2] + [1] * b)


@triton.jit(do_not_specialize=["N_TOK"])
def _block_minima_kernel(
    field: tl.tensor,
    level: tl.tensor,
    minima: tl.tensor,
    links: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    BT: tl.constexpr,
    LOG_BT: tl.constexpr,
    WITH_LINKS: tl.constexpr,
) -> None:
    """Per position t of a BT tile, for k = 1..LOG_BT (aligned 2^k-blocks of in-tile offsets):
    minima[k - 1] = Pre_k = min phi over [block start, t], minima[LOG_BT + k - 1] = Suf_k =
    min phi over (t, block end] (+inf if empty); minima[2 LOG_BT] = max(0, level_t - Suf_top[t])
    (the part of every off-diagonal penalty of key t that does not depend on the query).
    With WITH_LINKS, for the backward:
    links[0] = last u < t in the tile with phi_u < phi_t (-1: none),
    links[1] = first u > t in the tile with phi_u <= phi_t (BT: none).
    """
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    n_tok = N_TOK.to(tl.int64)  # a plane's offset (plane x HQ + head) x N_TOK: 64-bit
    seq = tl.load(tiles + 2 * tile)
    start = tl.load(tiles + 2 * tile + 1) * BT
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    r = tl.arange(0, BT)
    ok = start + r < T
    tok = bos + start + r
    phi = tl.load(field + tok * HQ + hq, mask=ok, other=float("inf"))

    pre = tl.reshape(phi, [2] * LOG_BT)  # level 0: [t, t]
    suf = tl.full([2] * LOG_BT, float("inf"), phi.dtype)  # level 0: (t, t], empty
    block = pre  # min over the whole aligned block, broadcast along the merged axes
    for b in tl.static_range(LOG_BT):
        bit = _bit(LOG_BT, b)
        left = tl.min(tl.where(bit == 0, block, float("inf")), axis=LOG_BT - 1 - b, keep_dims=True)
        right = tl.min(tl.where(bit == 1, block, float("inf")), axis=LOG_BT - 1 - b, keep_dims=True)
        pre = tl.where(bit == 1, tl.minimum(pre, left), pre)  # right half: prefix + left block
        suf = tl.where(bit == 0, tl.minimum(suf, right), suf)  # left half: suffix + right block
        block = tl.minimum(left, right)
        tl.store(minima + (b * HQ + hq) * n_tok + tok, tl.reshape(pre, [BT]), mask=ok)
        tl.store(minima + ((LOG_BT + b) * HQ + hq) * n_tok + tok, tl.reshape(suf, [BT]), mask=ok)
    lev = tl.load(level + tok * HQ + hq, mask=ok, other=0.0)
    excess = tl.maximum(lev - tl.reshape(suf, [BT]), 0.0)
    tl.store(minima + (2 * LOG_BT * HQ + hq) * n_tok + tok, excess, mask=ok)

    if WITH_LINKS:
        t = r[:, None]
        u = r[None, :]
        lower = phi[None, :] < phi[:, None]
        lower_or_equal = phi[None, :] <= phi[:, None]
        before = tl.max(tl.where((u < t) & lower, u, -1), axis=1)
        after = tl.min(tl.where((u > t) & lower_or_equal, u, BT), axis=1)
        tl.store(links + hq * n_tok + tok, before, mask=ok)
        tl.store(links + (HQ + hq) * n_tok + tok, after, mask=ok)


@triton.jit(do_not_specialize=["N_TOK"])
def _block_sums_kernel(
    log_f: tl.tensor,
    sums: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    BT: tl.constexpr,
) -> None:
    """FoX: sums[0, t] = sum of log f over [start of t's BT tile, t] and sums[1, t] = sum over
    (t, end of t's BT tile], so that every bias is a difference of sums over at most one tile
    plus a carried gap sum (float32 stays exact enough at any T)."""
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    n_tok = N_TOK.to(tl.int64)  # a plane's offset (plane x HQ + head) x N_TOK: 64-bit
    seq = tl.load(tiles + 2 * tile)
    start = tl.load(tiles + 2 * tile + 1) * BT
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    r = tl.arange(0, BT)
    ok = start + r < T
    tok = bos + start + r
    g = tl.load(log_f + tok * HQ + hq, mask=ok, other=0.0)
    prefix = tl.cumsum(g, 0)
    tl.store(sums + hq * n_tok + tok, prefix, mask=ok)
    tl.store(sums + (HQ + hq) * n_tok + tok, tl.sum(g, 0) - prefix, mask=ok)


@triton.jit
def _in_tile_segment_min(
    field: tl.tensor,
    blocks: tl.tensor,
    tok_q: tl.tensor,
    off_q: tl.tensor,
    ok_q: tl.tensor,
    tok_k: tl.tensor,
    off_k: tl.tensor,
    ok_k: tl.tensor,
    hq: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    LOG_BT: tl.constexpr,
    QUERY_AXIS: tl.constexpr,
) -> tl.tensor:
    """(F1) m_ij for queries i and keys j of one BT tile (``off_*``: in-tile offsets).

    m_ij = min(Suf_k[j], Pre_k[i]), k the highest bit in which off_q[i] and off_k[j] differ:
    bits are swept from 0 up, so the last write wins. +inf where i == j; garbage where j > i.
    Shape [len(q), len(k)] when QUERY_AXIS == 0, else [len(k), len(q)].
    """
    phi_q = tl.load(field + tok_q * HQ + hq, mask=ok_q, other=float("inf"))  # Pre_0
    if QUERY_AXIS == 0:
        m = tl.where(off_q[:, None] != off_k[None, :], phi_q[:, None], float("inf"))
    else:
        m = tl.where(off_k[:, None] != off_q[None, :], phi_q[None, :], float("inf"))
    for b in tl.static_range(1, LOG_BT):
        pre = tl.load(blocks + ((b - 1) * HQ + hq) * N_TOK + tok_q, mask=ok_q, other=float("inf"))
        suf = tl.load(
            blocks + ((LOG_BT + b - 1) * HQ + hq) * N_TOK + tok_k, mask=ok_k, other=float("inf")
        )
        if QUERY_AXIS == 0:
            split = (off_q >> b)[:, None] != (off_k >> b)[None, :]
            m = tl.where(split, tl.minimum(pre[:, None], suf[None, :]), m)
        else:
            split = (off_k >> b)[:, None] != (off_q >> b)[None, :]
            m = tl.where(split, tl.minimum(suf[:, None], pre[None, :]), m)
    return m


@triton.jit
def _softmax_step(
    s: tl.tensor,
    v: tl.tensor,
    m_i: tl.tensor,
    l_i: tl.tensor,
    acc: tl.tensor,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    log2e: tl.tensor,
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """FlashAttention-2 online softmax: fold logits s [BT, BS] (natural units; exp2 of
    s log2(e) - m log2(e), one fused multiply-add per logit) and values v."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf in keyless rows
    alpha = tl.exp2((m_i - m_safe) * log2e)
    p = tl.exp2(s * log2e - (m_safe * log2e)[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p_op = bf16_nearest(p) if ROUND_BF16 else p
    acc = tl.dot(p_op.to(DOT), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["N_TOK", "NTILES", "WS"])
def _fwd_kernel(
    q: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    field: tl.tensor,
    level: tl.tensor,
    blocks: tl.tensor,
    o: tl.tensor,
    lse: tl.tensor,
    consts: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    N_TOK: tl.tensor,
    NTILES: tl.tensor,
    HQ: tl.constexpr,
    G: tl.tensor,
    WS: tl.tensor,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    LOG_BT: tl.constexpr,
    FOX: tl.constexpr,
    SKIP: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
) -> None:
    """(F1)-(F5) for one query tile and head. ``blocks``: the block minima of the field, or with
    FOX the tile-local sums of log f (then ``field`` holds log f and only the bias is used).
    WINDOW: the window of (F3w), WS keys per query; key tiles wholly outside it are not
    visited, and pairs with i - j >= WS are masked in the tiles it covers partly."""
    H = HQ // G
    tile = NTILES - 1 - tl.program_id(0)  # the longest query tiles start first
    hq = tl.program_id(1)
    n_tok = N_TOK.to(tl.int64)  # a plane's offset (plane x HQ + head) x N_TOK: 64-bit
    h = hq // G
    seq = tl.load(tiles + 2 * tile)
    qs = tl.load(tiles + 2 * tile + 1) * BT
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    scale = tl.load(consts + 3)  # logits in natural units; exp2 folds in log2(e)
    log2e = tl.load(consts)

    r = tl.arange(0, BT)
    iq = qs + r
    q_ok = iq < T
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    q_rows = ((bos + iq) * HQ + hq)[:, None]
    b_q = tl.load(q + q_rows * K + dk[None, :], mask=q_ok[:, None] & (dk < K)[None, :], other=0.0)
    b_q = b_q.to(DOT)
    if FOX:
        c_q = tl.load(blocks + hq * n_tok + bos + iq, mask=q_ok, other=0.0)  # log f over [qs, i]
    else:
        b_min = tl.load(  # B_i = Pre at the top level
            blocks + ((LOG_BT - 1) * HQ + hq) * n_tok + bos + iq, mask=q_ok, other=float("inf")
        )
    m_i = tl.full([BT], float("-inf"), scale.dtype)
    l_i = tl.zeros([BT], scale.dtype)
    acc = tl.zeros([BT, BV], scale.dtype)

    # Diagonal tile: key tiles inside [qs, qs + BT), causal mask, exact in-tile segment minimum.
    for s in range(qs, tl.minimum(qs + BT, T), BS):
        ik = s + tl.arange(0, BS)
        k_ok = ik < T
        k_rows = (bos + ik) * H + h
        b_k = tl.load(
            k + k_rows[None, :] * K + dk[:, None], mask=(dk < K)[:, None] & k_ok[None, :], other=0.0
        )
        b_v = tl.load(
            v + k_rows[:, None] * V + dv[None, :], mask=k_ok[:, None] & (dv < V)[None, :], other=0.0
        )
        b_s = tl.dot(b_q, b_k.to(DOT), input_precision=PRECISION).to(scale.dtype) * scale
        if FOX:
            c_k = tl.load(blocks + hq * n_tok + bos + ik, mask=k_ok, other=0.0)  # over [qs, j]
            b_s += c_q[:, None] - c_k[None, :]  # (F6) sum of log f over (j, i]
        else:
            m = _in_tile_segment_min(
                field, blocks, bos + iq, r, q_ok, bos + ik, ik - qs, k_ok, hq, n_tok, HQ, LOG_BT, 0
            )
            lev = tl.load(level + (bos + ik) * HQ + hq, mask=k_ok, other=0.0)
            b_s -= tl.maximum(lev[None, :] - m, 0.0)  # (F2)-(F3)
        causal = (iq[:, None] >= ik[None, :]) & k_ok[None, :]
        if WINDOW:  # (F3w)
            causal = causal & (iq[:, None] - ik[None, :] < WS)
        b_s = tl.where(causal, b_s, float("-inf"))
        m_i, l_i, acc = _softmax_step(
            b_s, b_v.to(DOT), m_i, l_i, acc, DOT, PRECISION, ROUND_BF16, log2e
        )

    # Key tiles before the diagonal, nearest first: mid and the FoX gap sum grow by one BT tile
    # when the loop enters the next BT key tile, by the minimum (sum) of the tile it leaves,
    # loaded when that tile was entered (no load on the path to the dot).
    mid = tl.full([], float("inf"), scale.dtype)  # min phi over the BT tiles strictly between
    pending = tl.full([], float("inf"), scale.dtype)  # min phi over the current BT key tile
    gap = tl.zeros([], scale.dtype)  # FoX: sum of log f over the BT tiles strictly between
    total = tl.zeros([], scale.dtype)  # FoX: sum of log f over the current BT key tile
    if SKIP:
        theta = tl.load(consts + 2)
        phi_qs = tl.load(field + (bos + qs) * HQ + hq)
        cur = tl.full([], float("inf"), scale.dtype)  # min phi over its visited part
    n_tiles = qs // BS
    if WINDOW:  # (F3w) the key tiles [s, s + BS) with qs - (s + BS - 1) < WS
        n_tiles = tl.minimum(n_tiles, tl.cdiv(WS - 1, BS))
    for n in range(0, n_tiles):
        s = qs - (n + 1) * BS
        ik = s + tl.arange(0, BS)
        enter = (s + BS) % BT == 0  # s is the last BS tile of a farther BT key tile
        last = bos + s + BS - 1  # that BT tile's last token
        if FOX:
            gap = tl.where(enter, gap + total, gap)
            total = tl.where(enter, tl.load(blocks + hq * n_tok + last, mask=enter), total)
            after = tl.load(blocks + (HQ + hq) * n_tok + bos + ik) + gap  # log f over (j, qs)
            live = True
        else:
            mid = tl.where(enter, tl.minimum(mid, pending), mid)
            top = blocks + ((LOG_BT - 1) * HQ + hq) * n_tok  # Pre at the top level
            pending = tl.where(enter, tl.load(top + last, mask=enter), pending)
            lev = tl.load(level + (bos + ik) * HQ + hq)
            excess = tl.load(blocks + (2 * LOG_BT * HQ + hq) * n_tok + bos + ik)
            theta_q = tl.minimum(b_min, mid)
            live = True
            if SKIP:  # section 7: every pi_ij of the tile is >= theta, for this and later queries
                cur = tl.where(enter, float("inf"), cur)
                live = tl.min(lev, 0) - tl.minimum(tl.minimum(mid, cur), phi_qs) < theta
                cur = tl.minimum(cur, tl.min(tl.load(field + (bos + ik) * HQ + hq), 0))
        if live:
            k_rows = (bos + ik) * H + h
            b_k = tl.load(k + k_rows[None, :] * K + dk[:, None], mask=(dk < K)[:, None], other=0.0)
            b_v = tl.load(v + k_rows[:, None] * V + dv[None, :], mask=(dv < V)[None, :], other=0.0)
            b_s = tl.dot(b_q, b_k.to(DOT), input_precision=PRECISION).to(scale.dtype) * scale
            if FOX:
                b_s += c_q[:, None] + after[None, :]
            else:
                # (F1)-(F3): max(0, lev_j - min(A_j, mid, B_i))
                #          = max(max(0, lev_j - A_j), lev_j - min(mid, B_i))
                b_s -= tl.maximum(excess[None, :], lev[None, :] - theta_q[:, None])
            if WINDOW:  # (F3w) the tile's pairs outside the window
                b_s = tl.where(iq[:, None] - ik[None, :] < WS, b_s, float("-inf"))
            m_i, l_i, acc = _softmax_step(
                b_s, b_v.to(DOT), m_i, l_i, acc, DOT, PRECISION, ROUND_BF16, log2e
            )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptr = o + ((bos + iq) * HQ + hq)[:, None] * V + dv[None, :]
    if ROUND_BF16:  # the interpreter's conversion truncates; a GPU's rounds to nearest
        out = bf16_nearest(out)
    tl.store(o_ptr, out.to(o.dtype.element_ty), mask=q_ok[:, None] & (dv < V)[None, :])
    ln2 = tl.load(consts + 1)
    tl.store(lse + (bos + iq) * HQ + hq, m_i + tl.log2(l_safe) * ln2, mask=q_ok)


@triton.jit(do_not_specialize=["N_TOK"])
def _delta_kernel(
    o: tl.tensor,
    do: tl.tensor,
    dlse: tl.tensor,
    delta: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DLSE: tl.constexpr,
) -> None:
    """delta_i = <dO_i, o_i> - dLSE_i, so that G_ij = p_ij (<dO_i, v_j> - delta_i) holds (G4)."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # x HQ x V: 64-bit
    hq = tl.program_id(1)
    ok = tok < N_TOK
    dv = tl.arange(0, BV)
    ptr = (tok * HQ + hq)[:, None] * V + dv[None, :]
    mask = ok[:, None] & (dv < V)[None, :]
    b_o = tl.load(o + ptr, mask=mask, other=0.0).to(delta.dtype.element_ty)
    b_do = tl.load(do + ptr, mask=mask, other=0.0).to(delta.dtype.element_ty)
    d = tl.sum(b_o * b_do, 1)
    if HAS_DLSE:
        d -= tl.load(dlse + tok * HQ + hq, mask=ok, other=0.0)
    tl.store(delta + tok * HQ + hq, d, mask=ok)


@triton.jit(do_not_specialize=["N_TOK", "NTILES", "NT_MAX", "WS"])
def _bwd_dq_kernel(
    q: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    field: tl.tensor,
    level: tl.tensor,
    blocks: tl.tensor,
    links: tl.tensor,
    do: tl.tensor,
    lse: tl.tensor,
    delta: tl.tensor,
    dq: tl.tensor,
    d_rows: tl.tensor,
    mid_sums: tl.tensor,
    consts: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    N_TOK: tl.tensor,
    NTILES: tl.tensor,
    NT_MAX: tl.tensor,
    HQ: tl.constexpr,
    G: tl.tensor,
    WS: tl.tensor,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BDQ: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    LOG_BT: tl.constexpr,
    FOX: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    SUM_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
) -> None:
    """(G1) dq for one query tile; (G3) the dfield parts whose argmin lies in this tile (rows
    into B's argmin, the whole diagonal tile) into d_rows, and per gap tile one sum into
    mid_sums. FOX: d_rows = sum_j G_ij. WINDOW: as in _fwd_kernel (G_ij = 0 outside it, so the
    sums of (G3) see only the pairs inside)."""
    H = HQ // G
    tile = NTILES - 1 - tl.program_id(0)
    hq = tl.program_id(1)
    n_tok = N_TOK.to(tl.int64)  # a plane's offset (plane x HQ + head) x N_TOK: 64-bit
    h = hq // G
    seq = tl.load(tiles + 2 * tile)
    qs = tl.load(tiles + 2 * tile + 1) * BT
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    scale = tl.load(consts + 3)  # logits in natural units; exp2 folds in log2(e)
    log2e = tl.load(consts)

    r = tl.arange(0, BT)
    iq = qs + r
    q_ok = iq < T
    dk = tl.arange(0, BK)
    dv = tl.arange(0, BV)
    tok_q = bos + iq
    q_rows = (tok_q * HQ + hq)[:, None]
    b_q = tl.load(q + q_rows * K + dk[None, :], mask=q_ok[:, None] & (dk < K)[None, :], other=0.0)
    b_q = b_q.to(DOT)
    b_do = tl.load(do + q_rows * V + dv[None, :], mask=q_ok[:, None] & (dv < V)[None, :], other=0.0)
    b_do = b_do.to(DOT)
    lse2 = tl.load(lse + tok_q * HQ + hq, mask=q_ok, other=float("inf")) * log2e
    b_delta = tl.load(delta + tok_q * HQ + hq, mask=q_ok, other=0.0)
    if DOT == tl.float64:  # accumulate in the operands' precision, as dk and dv
        dq_acc = tl.zeros([BT, BK], tl.float64)
    else:
        dq_acc = tl.zeros([BT, BK], tl.float32)
    d_row = tl.zeros([BT], scale.dtype)
    if FOX:
        c_q = tl.load(blocks + hq * n_tok + tok_q, mask=q_ok, other=0.0)
    else:
        b_min = tl.load(
            blocks + ((LOG_BT - 1) * HQ + hq) * n_tok + tok_q, mask=q_ok, other=float("inf")
        )
        before = tl.load(links + hq * n_tok + tok_q, mask=q_ok, other=-1)
        after = tl.load(links + (HQ + hq) * n_tok + tok_q, mask=q_ok, other=0)
        to_prefix = tl.zeros([BT], scale.dtype)  # G of pairs whose argmin lies in B
        in_gap = tl.zeros([BT], scale.dtype)  # G of pairs whose argmin lies in the gap, by row

    for s in range(qs, tl.minimum(qs + BT, T), BDQ):  # the diagonal tile
        ik = s + tl.arange(0, BDQ)
        k_ok = ik < T
        k_rows = (bos + ik) * H + h
        b_k = tl.load(
            k + k_rows[None, :] * K + dk[:, None], mask=(dk < K)[:, None] & k_ok[None, :], other=0.0
        )
        b_k = b_k.to(DOT)
        b_v = tl.load(
            v + k_rows[None, :] * V + dv[:, None], mask=(dv < V)[:, None] & k_ok[None, :], other=0.0
        )
        b_s = tl.dot(b_q, b_k, input_precision=PRECISION).to(scale.dtype) * scale
        if FOX:
            c_k = tl.load(blocks + hq * n_tok + bos + ik, mask=k_ok, other=0.0)
            b_s += c_q[:, None] - c_k[None, :]
        else:
            m = _in_tile_segment_min(
                field, blocks, tok_q, r, q_ok, bos + ik, ik - qs, k_ok, hq, n_tok, HQ, LOG_BT, 0
            )
            lev = tl.load(level + (bos + ik) * HQ + hq, mask=k_ok, other=0.0)
            b_s -= tl.maximum(lev[None, :] - m, 0.0)
        causal = (iq[:, None] >= ik[None, :]) & k_ok[None, :]
        if WINDOW:  # (F3w)
            causal = causal & (iq[:, None] - ik[None, :] < WS)
        # mask first: no overflow
        p = tl.exp2(tl.where(causal, b_s, float("-inf")) * log2e - lse2[:, None])
        dp = tl.dot(b_do, b_v.to(DOT), input_precision=PRECISION).to(scale.dtype)
        ds = p * (dp - b_delta[:, None])  # G_ij
        ds_op = bf16_nearest(ds) if ROUND_BF16 else ds
        dq_acc = tl.dot(ds_op.to(DOT), tl.trans(b_k), dq_acc, input_precision=PRECISION)
        if FOX:
            d_row += tl.sum(ds, 1)
        else:
            w = tl.where(lev[None, :] >= m, ds, 0.0)  # G on active pairs
            # t*_ij = t exactly for before(t) <= j < t <= i < after(t): the product with the
            # indicator of [t, after(t)) sums each t's rows, the span mask its columns.
            reach = (r[:, None] <= r[None, :]) & (r[None, :] < after[:, None])
            if SUM_PRECISION == "bf16x2":  # 16-bit inputs: w = hi + lo, both bfloat16, and the
                # exact 0/1 matrix in bfloat16: float32-like sums at a quarter of the shared
                # memory of a float32 product (which does not fit a Hopper block at D = 128)
                if INTERPRET:  # float32 products of bfloat16-rounded operands
                    hi = bf16_nearest(w)
                    lo = bf16_nearest(w - hi)
                    ones = reach.to(tl.float32)
                    per_t = tl.dot(ones, hi, input_precision="ieee")
                    per_t = tl.dot(ones, lo, per_t, input_precision="ieee")
                else:
                    hi = w.to(tl.bfloat16)
                    lo = (w - hi.to(tl.float32)).to(tl.bfloat16)
                    ones = reach.to(tl.bfloat16)
                    per_t = tl.dot(ones, hi)
                    per_t = tl.dot(ones, lo, per_t)  # [BT(t), BS]
            else:
                per_t = tl.dot(reach.to(w.dtype), w, input_precision=SUM_PRECISION)
            span = (tl.maximum(before, 0)[:, None] <= (ik - qs)[None, :]) & (
                (ik - qs)[None, :] < r[:, None]
            )
            d_row += tl.sum(tl.where(span, per_t, 0.0), 1)

    # Key tiles before the diagonal, nearest first; mid, the FoX gap and the holder of the gap's
    # latest minimum change when the loop enters the next BT key tile (see _fwd_kernel).
    mid = tl.full([], float("inf"), scale.dtype)
    pending = tl.full([], float("inf"), scale.dtype)
    gap = tl.zeros([], scale.dtype)
    total = tl.zeros([], scale.dtype)
    holder = tl.full([], -1, tl.int32)  # the BT tile holding the gap's latest minimum
    n_tiles = qs // BS
    if WINDOW:  # (F3w) as in _fwd_kernel
        n_tiles = tl.minimum(n_tiles, tl.cdiv(WS - 1, BS))
    for n in range(0, n_tiles):
        s = qs - (n + 1) * BS
        ik = s + tl.arange(0, BS)
        enter = (s + BS) % BT == 0
        last = bos + s + BS - 1
        if FOX:
            gap = tl.where(enter, gap + total, gap)
            total = tl.where(enter, tl.load(blocks + hq * n_tok + last, mask=enter), total)
            after_j = tl.load(blocks + (HQ + hq) * n_tok + bos + ik) + gap
        else:
            if enter & (pending < mid):  # strict: on ties the later tile keeps the argmin
                # the rows' gap sums belong to the holder that ends here
                tl.store(
                    mid_sums + (hq.to(tl.int64) * NTILES + tile) * NT_MAX + holder,
                    tl.sum(in_gap, 0),
                    mask=holder >= 0,
                )
                in_gap = tl.zeros([BT], scale.dtype)
                holder = (s + BS) // BT
            mid = tl.where(enter, tl.minimum(mid, pending), mid)
            top = blocks + ((LOG_BT - 1) * HQ + hq) * n_tok
            pending = tl.where(enter, tl.load(top + last, mask=enter), pending)
            lev = tl.load(level + (bos + ik) * HQ + hq)
            a_min = tl.load(blocks + ((2 * LOG_BT - 1) * HQ + hq) * n_tok + bos + ik)  # A_j
            floor = tl.minimum(a_min, lev)  # pairs with m_ij = min(B_i, mid) that are active
            theta = tl.minimum(b_min, mid)
        k_rows = (bos + ik) * H + h
        b_k = tl.load(k + k_rows[None, :] * K + dk[:, None], mask=(dk < K)[:, None], other=0.0)
        b_k = b_k.to(DOT)
        b_v = tl.load(v + k_rows[None, :] * V + dv[:, None], mask=(dv < V)[:, None], other=0.0)
        b_v = b_v.to(DOT)
        b_s = tl.dot(b_q, b_k, input_precision=PRECISION).to(scale.dtype) * scale
        if FOX:
            b_s += c_q[:, None] + after_j[None, :]
        else:  # max(0, lev_j - min(A_j, mid, B_i)) = lev_j - min(A_j, lev_j, mid, B_i)
            b_s -= lev[None, :] - tl.minimum(floor[None, :], theta[:, None])
        if WINDOW:  # (F3w)
            b_s = tl.where(iq[:, None] - ik[None, :] < WS, b_s, float("-inf"))
        p = tl.exp2(b_s * log2e - lse2[:, None])
        dp = tl.dot(b_do, b_v, input_precision=PRECISION).to(scale.dtype)
        ds = p * (dp - b_delta[:, None])
        ds_op = bf16_nearest(ds) if ROUND_BF16 else ds
        dq_acc = tl.dot(ds_op.to(DOT), tl.trans(b_k), dq_acc, input_precision=PRECISION)
        if FOX:
            d_row += tl.sum(ds, 1)
        else:
            # t*_ij is in B (B_i <= mid) or in the gap (mid < B_i) exactly for the active pairs
            # with A_j >= min(B_i, mid): one masked row sum, routed by row.
            row = tl.sum(tl.where(floor[None, :] >= theta[:, None], ds, 0.0), 1)
            to_prefix += tl.where(b_min <= mid, row, 0.0)
            in_gap += tl.where(b_min <= mid, 0.0, row)

    if not FOX:
        tl.store(
            mid_sums + (hq.to(tl.int64) * NTILES + tile) * NT_MAX + holder,
            tl.sum(in_gap, 0),
            mask=holder >= 0,
        )
    dq_ptr = dq + q_rows * K + dk[None, :]
    dq_acc *= scale
    if ROUND_BF16 and dq.dtype.element_ty == tl.bfloat16:  # as the forward's store of o
        dq_acc = bf16_nearest(dq_acc)
    tl.store(dq_ptr, dq_acc.to(dq.dtype.element_ty), mask=q_ok[:, None] & (dk < K)[None, :])
    if not FOX:
        # B's latest argmin up to i is t when nothing in [qs, t) is lower and t <= i < after(t).
        owns = (r[:, None] <= r[None, :]) & (r[None, :] < after[:, None]) & (before < 0)[:, None]
        d_row += tl.sum(tl.where(owns, to_prefix[None, :], 0.0), 1)
    tl.store(d_rows + tok_q * HQ + hq, d_row, mask=q_ok)


@triton.jit(do_not_specialize=["N_TOK", "WS"])
def _bwd_dkv_kernel(
    q: tl.tensor,
    k: tl.tensor,
    v: tl.tensor,
    field: tl.tensor,
    level: tl.tensor,
    blocks: tl.tensor,
    links: tl.tensor,
    do: tl.tensor,
    lse: tl.tensor,
    delta: tl.tensor,
    dk: tl.tensor,
    dv: tl.tensor,
    d_cols: tl.tensor,
    d_level: tl.tensor,
    consts: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    G: tl.tensor,
    WS: tl.tensor,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BDK: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    LOG_BT: tl.constexpr,
    FOX: tl.constexpr,
    WINDOW: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
) -> None:
    """(G1) dk, dv for one key tile and query head; (G2) dlevel; (G3) the dfield part whose
    argmin lies in A (columns into A's argmin) into d_cols. FOX: d_cols = sum_i G_ij. WINDOW:
    query tiles wholly outside the window of (F3w) are not visited, pairs outside it masked."""
    H = HQ // G
    tile = tl.program_id(0)  # the first key tiles have the most query tiles: they start first
    hq = tl.program_id(1)
    n_tok = N_TOK.to(tl.int64)  # a plane's offset (plane x HQ + head) x N_TOK: 64-bit
    h = hq // G
    seq = tl.load(tiles + 2 * tile)
    ks = tl.load(tiles + 2 * tile + 1) * BT
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    scale = tl.load(consts + 3)  # logits in natural units; exp2 folds in log2(e)
    log2e = tl.load(consts)

    r = tl.arange(0, BT)
    ik = ks + r
    k_ok = ik < T
    dd = tl.arange(0, BK)
    dw = tl.arange(0, BV)
    tok_k = bos + ik
    k_rows = (tok_k * H + h)[:, None]
    b_k = tl.load(k + k_rows * K + dd[None, :], mask=k_ok[:, None] & (dd < K)[None, :], other=0.0)
    b_k = b_k.to(DOT)
    b_v = tl.load(v + k_rows * V + dw[None, :], mask=k_ok[:, None] & (dw < V)[None, :], other=0.0)
    b_v = b_v.to(DOT)
    # The products accumulate in their operands' precision (float32 unless DOT is float64), also
    # when the field is float64 and q is not.
    if DOT == tl.float64:
        dk_acc = tl.zeros([BT, BK], tl.float64)
        dv_acc = tl.zeros([BT, BV], tl.float64)
    else:
        dk_acc = tl.zeros([BT, BK], tl.float32)
        dv_acc = tl.zeros([BT, BV], tl.float32)
    d_col = tl.zeros([BT], scale.dtype)
    if FOX:
        c_k = tl.load(blocks + hq * n_tok + tok_k, mask=k_ok, other=0.0)  # log f over [ks, j]
        last = bos + tl.minimum(ks + BT, T) - 1
        after_k = tl.load(blocks + hq * n_tok + last) - c_k  # over (j, end of the key tile]
    else:
        lev = tl.load(level + tok_k * HQ + hq, mask=k_ok, other=0.0)
        a_min = tl.load(
            blocks + ((2 * LOG_BT - 1) * HQ + hq) * n_tok + tok_k, mask=k_ok, other=float("inf")
        )
        to_suffix = tl.zeros([BT], scale.dtype)  # G of pairs whose argmin lies in A

    for s in range(ks, tl.minimum(ks + BT, T), BDK):  # the diagonal tile
        iq = s + tl.arange(0, BDK)
        q_ok = iq < T
        q_rows = ((bos + iq) * HQ + hq)[:, None]
        b_q = tl.load(
            q + q_rows * K + dd[None, :], mask=q_ok[:, None] & (dd < K)[None, :], other=0.0
        )
        b_q = b_q.to(DOT)
        b_do = tl.load(
            do + q_rows * V + dw[None, :], mask=q_ok[:, None] & (dw < V)[None, :], other=0.0
        )
        b_do = b_do.to(DOT)
        lse2 = tl.load(lse + (bos + iq) * HQ + hq, mask=q_ok, other=float("inf")) * log2e
        b_delta = tl.load(delta + (bos + iq) * HQ + hq, mask=q_ok, other=0.0)
        b_s = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION).to(scale.dtype) * scale
        if FOX:
            c_q = tl.load(blocks + hq * n_tok + bos + iq, mask=q_ok, other=0.0)  # over [ks, i]
            b_s += c_q[None, :] - c_k[:, None]
        else:
            m = _in_tile_segment_min(
                field, blocks, bos + iq, iq - ks, q_ok, tok_k, r, k_ok, hq, n_tok, HQ, LOG_BT, 1
            )
            b_s -= tl.maximum(lev[:, None] - m, 0.0)
        causal = (ik[:, None] <= iq[None, :]) & q_ok[None, :]
        if WINDOW:  # (F3w)
            causal = causal & (iq[None, :] - ik[:, None] < WS)
        p = tl.exp2(tl.where(causal, b_s, float("-inf")) * log2e - lse2[None, :])
        p_op = bf16_nearest(p) if ROUND_BF16 else p
        dv_acc = tl.dot(p_op.to(DOT), b_do, dv_acc, input_precision=PRECISION)
        dp = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION).to(scale.dtype)
        ds = p * (dp - b_delta[None, :])
        ds_op = bf16_nearest(ds) if ROUND_BF16 else ds
        dk_acc = tl.dot(ds_op.to(DOT), b_q, dk_acc, input_precision=PRECISION)
        if FOX:
            d_col += tl.sum(ds, 1)
        else:
            d_col += tl.sum(tl.where(lev[:, None] >= m, ds, 0.0), 1)  # in-tile argmins: dq's

    # Query tiles after the key tile, nearest first; mid grows by a whole BT query tile when the
    # loop enters the next one, by the minimum loaded when that tile was entered.
    mid = tl.full([], float("inf"), scale.dtype)
    pending = tl.full([], float("inf"), scale.dtype)
    gap = tl.zeros([], scale.dtype)
    top = blocks + ((LOG_BT - 1) * HQ + hq) * n_tok  # Pre at the top level
    stop = T
    if WINDOW:  # (F3w) the query tiles [s, s + BS) with s - (ks + BT - 1) < WS
        stop = tl.minimum(T, ks + BT - 1 + WS)
    for s in range(ks + BT, stop, BS):  # query tiles after the key tile, nearest first
        iq = s + tl.arange(0, BS)
        q_ok = iq < T
        if FOX:
            boundary = (s % BT == 0) & (s > ks + BT)  # a whole query tile joins the gap
            gap += tl.load(blocks + hq * n_tok + bos + s - 1, mask=boundary, other=0.0)
            c_q = tl.load(blocks + hq * n_tok + bos + iq, mask=q_ok, other=0.0)
            bias = (after_k + gap)[:, None] + c_q[None, :]  # log f over (j, i]
        else:
            enter = s % BT == 0  # the first BS tile of a farther BT query tile
            mid = tl.where(enter, tl.minimum(mid, pending), mid)
            end = bos + tl.minimum(s + BT, T) - 1  # that BT tile's last token
            pending = tl.where(enter, tl.load(top + end, mask=enter), pending)
            b_min = tl.load(top + bos + iq, mask=q_ok, other=0.0)  # B_i
            a = tl.minimum(a_min, mid)
            c = tl.maximum(lev - a, 0.0)
            # t* in A: A_j < mid, A_j < B_i, active iff lev_j >= A_j (rows "suffix"); other rows
            # are active for the pairs with B_i <= lev_j, or all pairs when a_j <= lev_j.
            suffix = (a_min < mid) & (lev >= a_min)
            theta = tl.where(suffix, a_min, tl.where(a <= lev, float("inf"), lev))
        q_rows = ((bos + iq) * HQ + hq)[:, None]
        b_q = tl.load(
            q + q_rows * K + dd[None, :], mask=q_ok[:, None] & (dd < K)[None, :], other=0.0
        )
        b_q = b_q.to(DOT)
        b_do = tl.load(
            do + q_rows * V + dw[None, :], mask=q_ok[:, None] & (dw < V)[None, :], other=0.0
        )
        b_do = b_do.to(DOT)
        # Queries past T: q and dO rows are 0, so their logits and dp are 0 and G = p (0 - 0) = 0
        # exactly while p is finite; FPA's penalty is >= 0, so p <= 1 with lse 0 and B 0 there
        # (zero-filled loads: no mask carried through the software pipeline).
        lse2 = (
            tl.load(lse + (bos + iq) * HQ + hq, mask=q_ok, other=float("inf") if FOX else 0.0)
            * log2e
        )
        b_delta = tl.load(delta + (bos + iq) * HQ + hq, mask=q_ok, other=0.0)
        b_s = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION).to(scale.dtype) * scale
        if FOX:
            b_s += bias
        else:  # max(0, lev_j - min(a_j, B_i))
            b_s -= tl.maximum(c[:, None], lev[:, None] - b_min[None, :])
        if WINDOW:  # (F3w)
            b_s = tl.where(iq[None, :] - ik[:, None] < WS, b_s, float("-inf"))
        p = tl.exp2(b_s * log2e - lse2[None, :])
        p_op = bf16_nearest(p) if ROUND_BF16 else p
        dv_acc = tl.dot(p_op.to(DOT), b_do, dv_acc, input_precision=PRECISION)
        dp = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION).to(scale.dtype)
        ds = p * (dp - b_delta[None, :])
        ds_op = bf16_nearest(ds) if ROUND_BF16 else ds
        dk_acc = tl.dot(ds_op.to(DOT), b_q, dk_acc, input_precision=PRECISION)
        if FOX:
            d_col += tl.sum(ds, 1)
        else:
            every = tl.sum(ds, 1)
            below = tl.sum(tl.where(b_min[None, :] <= theta[:, None], ds, 0.0), 1)
            d_col += tl.where(suffix, every, below)  # G on active pairs
            to_suffix += tl.where(suffix, every - below, 0.0)  # and with t* in A

    out_rows = (tok_k * HQ + hq)[:, None]  # dk, dv per query head (reduced over G outside)
    dk_acc *= scale
    if ROUND_BF16 and dk.dtype.element_ty == tl.bfloat16:  # as the forward's store of o
        dk_acc = bf16_nearest(dk_acc)
        dv_acc = bf16_nearest(dv_acc)
    tl.store(
        dk + out_rows * K + dd[None, :],
        dk_acc.to(dk.dtype.element_ty),
        mask=k_ok[:, None] & (dd < K)[None, :],
    )
    tl.store(
        dv + out_rows * V + dw[None, :],
        dv_acc.to(dv.dtype.element_ty),
        mask=k_ok[:, None] & (dw < V)[None, :],
    )
    if FOX:
        tl.store(d_cols + tok_k * HQ + hq, d_col, mask=k_ok)
    else:
        tl.store(d_level + tok_k * HQ + hq, -d_col, mask=k_ok)  # (G2)
        # A's latest argmin after j is t when nothing after t in the tile is lower or equal and
        # before(t) <= j < t.
        before = tl.load(links + hq * n_tok + tok_k, mask=k_ok, other=-1)
        after = tl.load(links + (HQ + hq) * n_tok + tok_k, mask=k_ok, other=0)
        owns = (tl.maximum(before, 0)[:, None] <= r[None, :]) & (r[None, :] < r[:, None])
        owns = owns & (after == BT)[:, None]
        tl.store(
            d_cols + tok_k * HQ + hq, tl.sum(tl.where(owns, to_suffix[None, :], 0.0), 1), mask=k_ok
        )


@triton.jit(do_not_specialize=["N_TOK", "NTILES", "NT_MAX"])
def _dfield_kernel(
    field: tl.tensor,
    d_rows: tl.tensor,
    d_cols: tl.tensor,
    mid_sums: tl.tensor,
    dfield: tl.tensor,
    cu_seqlens: tl.tensor,
    tiles: tl.tensor,
    tile_start: tl.tensor,
    N_TOK: tl.tensor,
    NTILES: tl.tensor,
    NT_MAX: tl.tensor,
    HQ: tl.constexpr,
    BT: tl.constexpr,
    BN: tl.constexpr,
) -> None:
    """(G3) second pass: dfield = d_rows + d_cols, plus, at the latest minimum of this BT tile,
    the gap sums of every later query tile whose gap had its latest minimum here."""
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    seq = tl.load(tiles + 2 * tile)
    it = tl.load(tiles + 2 * tile + 1)
    bos = tl.load(cu_seqlens + seq)
    T = (tl.load(cu_seqlens + seq + 1) - bos).to(tl.int32)
    r = tl.arange(0, BT)
    ok = it * BT + r < T
    ptr = (bos + it * BT + r) * HQ + hq
    d = tl.load(d_rows + ptr, mask=ok, other=0.0) + tl.load(d_cols + ptr, mask=ok, other=0.0)
    phi = tl.load(field + ptr, mask=ok, other=float("inf"))
    latest = tl.max(tl.where(phi == tl.min(phi, 0), r, -1), 0)
    first = tl.load(tile_start + seq).to(tl.int64)
    count = (tl.load(tile_start + seq + 1) - first).to(tl.int32)
    total = tl.zeros([], d.dtype)
    for c in range(it + 1, count, BN):
        rows = c + tl.arange(0, BN)
        sums = tl.load(
            mid_sums + (hq.to(tl.int64) * NTILES + first + rows) * NT_MAX + it,
            mask=rows < count,
            other=0.0,
        )
        total += tl.sum(tl.where(rows < count, sums, 0.0), 0)
    d += tl.where(r == latest, total, 0.0)
    tl.store(dfield + ptr, d, mask=ok)


@triton.jit(do_not_specialize=["N_TOK"])
def _segment_sums_kernel(
    d_rows: tl.tensor,
    d_cols: tl.tensor,
    out: tl.tensor,
    cu_seqlens: tl.tensor,
    N_TOK: tl.tensor,
    HQ: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    """FoX: out_t = sum over u >= t in t's sequence of (d_rows_u - d_cols_u), accumulated in
    float64: dlog_f_l = sum_{i >= l} sum_j G_ij - sum_{j >= l} sum_i G_ij (bias c_i - c_j).
    One program per (sequence, head), blocks of BLOCK tokens from the sequence's end."""
    seq = tl.program_id(0)
    hq = tl.program_id(1)
    bos = tl.load(cu_seqlens + seq)
    eos = tl.load(cu_seqlens + seq + 1)
    r = tl.arange(0, BLOCK)
    carry = tl.zeros([], tl.float64)
    for n in range(0, tl.cdiv(eos - bos, BLOCK)):
        tok = eos - (n + 1) * BLOCK + r
        ok = tok >= bos
        x = tl.load(d_rows + tok * HQ + hq, mask=ok, other=0.0).to(tl.float64)
        x -= tl.load(d_cols + tok * HQ + hq, mask=ok, other=0.0).to(tl.float64)
        y = tl.cumsum(x, 0, reverse=True) + carry
        tl.store(out + tok * HQ + hq, y.to(out.dtype.element_ty), mask=ok)
        carry += tl.sum(x, 0)


# launchers

_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class _Layout:
    """Shapes of one call: N sequences of the given lengths packed along N_TOK tokens."""

    B: int
    T: int
    HQ: int
    H: int
    K: int
    V: int
    lengths: tuple[int, ...]

    @property
    def G(self) -> int:
        return self.HQ // self.H

    @property
    def n_tok(self) -> int:
        return self.B * self.T


def _layout(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    wide: dict[str, torch.Tensor],
    packing: Packing | None,
) -> _Layout:
    """The shapes of one call and the lengths of its sequences.

    The public ops check the inputs once (:mod:`.checks`; offsets by the one rule of
    :mod:`attnspec.reference.packing`) and pass contiguous tensors; the launchers assert only the
    invariants they rely on: shapes that agree, one dtype for q, k, v and one float32-or-wider
    dtype for the per-token scalars (float64 with float64 q), one device, contiguity."""
    B, T, HQ, K = q.shape
    H, V = k.shape[2], v.shape[3]
    assert T >= 1 and H >= 1 and HQ % H == 0, (tuple(q.shape), tuple(k.shape))
    assert (tuple(k.shape), tuple(v.shape)) == ((B, T, H, K), (B, T, H, V)), (k.shape, v.shape)
    assert q.dtype in _DTYPES and q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    dtypes = {x.dtype for x in wide.values()}
    assert len(dtypes) == 1 and dtypes <= set(WIDE), dtypes
    assert q.dtype != torch.float64 or dtypes == {torch.float64}, dtypes
    for name, x in {"q": q, "k": k, "v": v, **wide}.items():
        assert x.device == q.device and x.is_contiguous(), name
        assert name not in wide or tuple(x.shape) == (B, T, HQ), (name, x.shape)
    if packing is None:
        return _Layout(B, T, HQ, H, K, V, (T,) * B)
    offsets = packing.offsets
    assert B == 1 and offsets[0] == 0 and offsets[-1] == T, offsets
    lengths = tuple(b - a for a, b in itertools.pairwise(offsets))
    return _Layout(B, T, HQ, H, K, V, lengths)


@functools.lru_cache(maxsize=64)
def _sequences(
    lengths: tuple[int, ...], BT: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(cu_seqlens, tiles, tile_start, NT_MAX): tiles lists (sequence, tile) pairs in order."""
    offsets = [0, *itertools.accumulate(lengths)]
    rows = Packing(tuple(offsets)).chunks(BT)  # (sequence, start, end) of every tile, in order
    pairs = [(int(n), (int(a) - offsets[n]) // BT) for n, a, _ in rows]
    counts = np.bincount(rows[:, 0], minlength=len(lengths)).tolist()  # tiles per sequence
    starts = [0, *itertools.accumulate(counts)]
    return (
        torch.tensor(offsets, dtype=torch.int64, device=device),
        torch.tensor(pairs, dtype=torch.int32, device=device).reshape(-1, 2),
        torch.tensor(starts, dtype=torch.int32, device=device),
        max(counts),
    )


@functools.lru_cache(maxsize=64)
def _constants(
    scale: float, theta: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[log2(e), ln 2, theta, scale] in the dtype of the penalty arithmetic."""
    values = [LOG2E, LN2, theta, scale]
    return torch.tensor(values, dtype=dtype, device=device)


def _sum_precision(dtype: torch.dtype) -> str:
    """Precision of the product that sums the diagonal tile's dfield rectangles: three TF32
    passes keep float32 accuracy for float32 inputs; for 16-bit inputs "bf16x2", two bfloat16
    products (the 0/1 matrix is exact, G split into a high and a low bfloat16 part)."""
    return {torch.float64: "ieee", torch.float32: "tf32x3"}.get(dtype, "bf16x2")


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _resolve_scale(scale: float | None, K: int) -> float:
    """None: 1/sqrt(K) (direct calls of the kernels); the ops pass the checked scale."""
    value = K**-0.5 if scale is None else float(scale)
    assert math.isfinite(value), value
    return value


def kernel_sizes(
    HQ: int,
    K: int,
    V: int,
    tiles: Tiles,
    dtype: torch.dtype,
    fox: bool,
    interpret: bool,
    window: int | None = None,
) -> dict[str, object]:
    """The compile-time arguments (and launch options) that the forward, dq and dk/dv kernels of
    one call all declare, with the window of (F3w) (WS, WINDOW); dq and dk/dv add their own
    diagonal steps (BDQ, BDK)."""
    BT = tiles.own
    return dict(
        WS=1 if window is None else window,
        WINDOW=window is not None,
        HQ=HQ,
        K=K,
        V=V,
        BT=BT,
        BS=tiles.visit,
        BK=_block(K),
        BV=_block(V),
        LOG_BT=BT.bit_length() - 1,
        FOX=fox,
        DOT=dot_dtype(dtype, interpret),
        PRECISION=precision(dtype),
        ROUND_BF16=interpret and dtype == torch.bfloat16,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _block_minima(
    field: torch.Tensor,
    level: torch.Tensor,
    cu: torch.Tensor,
    tiles: torch.Tensor,
    shape: _Layout,
    BT: int,
    with_links: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre_k and Suf_k of every BT tile (and the backward's links), see _block_minima_kernel."""
    log_bt = BT.bit_length() - 1
    minima = torch.empty(
        2 * log_bt + 1, shape.HQ, shape.n_tok, dtype=field.dtype, device=field.device
    )
    links = torch.empty(2, shape.HQ, shape.n_tok, dtype=torch.int32, device=field.device)
    _block_minima_kernel[(tiles.shape[0], shape.HQ)](
        field=field,
        level=level,
        minima=minima,
        links=links,
        cu_seqlens=cu,
        tiles=tiles,
        N_TOK=shape.n_tok,
        HQ=shape.HQ,
        BT=BT,
        LOG_BT=log_bt,
        WITH_LINKS=with_links,
        num_warps=PREPASS_WARPS,
    )
    return minima, links


def _block_sums(
    log_f: torch.Tensor, cu: torch.Tensor, tiles: torch.Tensor, shape: _Layout, BT: int
) -> torch.Tensor:
    """FoX: cumulative sums of log f local to each BT tile, see _block_sums_kernel."""
    sums = torch.empty(2, shape.HQ, shape.n_tok, dtype=log_f.dtype, device=log_f.device)
    _block_sums_kernel[(tiles.shape[0], shape.HQ)](
        log_f=log_f,
        sums=sums,
        cu_seqlens=cu,
        tiles=tiles,
        N_TOK=shape.n_tok,
        HQ=shape.HQ,
        BT=BT,
        num_warps=PREPASS_WARPS,
    )
    return sums


def _per_token_scalars(
    field: torch.Tensor, level: torch.Tensor | None, fox: bool
) -> dict[str, torch.Tensor]:
    """The per-token scalars by the names the caller knows them: log_f, or field and level."""
    if fox:
        return {"log_f": field}
    assert level is not None
    return {"field": field, "level": level}


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    field: torch.Tensor,
    level: torch.Tensor | None,
    scale: float | None,
    packing: Packing | None,
    theta: float | None,
    fox: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    wide = _per_token_scalars(field, level, fox)
    shape = _layout(q, k, v, wide, packing)
    checks.head_dims(shape.K, shape.V, MAX_HEAD_DIM, "Triton FPA/FoX")
    scale = _resolve_scale(scale, shape.K)
    tiles = tiles_for(q.device, backward=False, K=shape.K, V=shape.V, dtype=q.dtype)
    BT = tiles.own
    cu, tile_list, _, _ = _sequences(shape.lengths, BT, q.device)
    consts = _constants(scale, math.inf if theta is None else theta, field.dtype, q.device)
    o = torch.empty(shape.B, shape.T, shape.HQ, shape.V, dtype=q.dtype, device=q.device)
    lse = torch.empty(shape.B, shape.T, shape.HQ, dtype=field.dtype, device=q.device)
    if fox:
        blocks = _block_sums(field, cu, tile_list, shape, BT)
    else:
        blocks = _block_minima(field, wide["level"], cu, tile_list, shape, BT, with_links=False)[0]
    sizes = kernel_sizes(shape.HQ, shape.K, shape.V, tiles, q.dtype, fox, interpreting(), window)
    _fwd_kernel[(tile_list.shape[0], shape.HQ)](
        q=q,
        k=k,
        v=v,
        field=field,
        level=level,
        blocks=blocks,
        o=o,
        lse=lse,
        consts=consts,
        cu_seqlens=cu,
        tiles=tile_list,
        N_TOK=shape.n_tok,
        NTILES=tile_list.shape[0],
        G=shape.G,
        SKIP=theta is not None,
        **sizes,
    )
    return o, lse


def _backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    field: torch.Tensor,
    level: torch.Tensor | None,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float | None,
    packing: Packing | None,
    fox: bool,
    window: int | None = None,
) -> tuple[torch.Tensor, ...]:
    wide = _per_token_scalars(field, level, fox)
    shape = _layout(q, k, v, wide, packing)
    B, T, HQ, H, G = shape.B, shape.T, shape.HQ, shape.H, shape.G
    acc = field.dtype
    assert max(shape.K, shape.V) <= MAX_HEAD_DIM, (shape.K, shape.V)
    outputs = {"o": (o, q.dtype, shape.V), "do": (do, q.dtype, shape.V), "lse": (lse, acc, None)}
    if dlse is not None:
        outputs["dlse"] = (dlse, acc, None)
    for name, (x, dtype, width) in outputs.items():
        expected = (B, T, HQ) if width is None else (B, T, HQ, width)
        assert (tuple(x.shape), x.dtype) == (expected, dtype) and x.is_contiguous(), name
    scale = _resolve_scale(scale, shape.K)
    tiles = tiles_for(q.device, backward=True, K=shape.K, V=shape.V, dtype=q.dtype)
    BT = tiles.own
    cu, tile_list, tile_start, nt_max = _sequences(shape.lengths, BT, q.device)
    ntiles = tile_list.shape[0]
    consts = _constants(scale, math.inf, field.dtype, q.device)
    delta = torch.empty(B, T, HQ, dtype=acc, device=q.device)
    _delta_kernel[(triton.cdiv(shape.n_tok, ROW_BLOCK), HQ)](
        o=o,
        do=do,
        dlse=dlse,
        delta=delta,
        N_TOK=shape.n_tok,
        HQ=HQ,
        V=shape.V,
        BLOCK=ROW_BLOCK,
        BV=_block(shape.V),
        HAS_DLSE=dlse is not None,
        num_warps=PREPASS_WARPS,
    )
    if fox:
        blocks, links = _block_sums(field, cu, tile_list, shape, BT), None
    else:
        blocks, links = _block_minima(
            field, wide["level"], cu, tile_list, shape, BT, with_links=True
        )
    dq = torch.empty_like(q)
    partial = acc if G > 1 else None  # GQA: dk, dv per query head, reduced below
    dk = torch.empty(B, T, HQ, shape.K, dtype=partial or k.dtype, device=q.device)
    dv = torch.empty(B, T, HQ, shape.V, dtype=partial or v.dtype, device=q.device)
    d_rows = torch.empty(B, T, HQ, dtype=acc, device=q.device)
    d_cols = torch.empty(B, T, HQ, dtype=acc, device=q.device)
    d_level = torch.empty(B, T, HQ, dtype=acc, device=q.device)  # FoX: unused
    mid_sums = None if fox else torch.zeros(HQ, ntiles, nt_max, dtype=acc, device=q.device)
    sizes = kernel_sizes(HQ, shape.K, shape.V, tiles, q.dtype, fox, interpreting(), window)
    diagonal = min(tiles.visit, tiles.diagonal)  # rows per step over the diagonal tile
    common = dict(
        q=q,
        k=k,
        v=v,
        field=field,
        level=level,
        blocks=blocks,
        links=links,
        do=do,
        lse=lse,
        delta=delta,
        consts=consts,
        cu_seqlens=cu,
        tiles=tile_list,
        N_TOK=shape.n_tok,
        G=G,
    )
    _bwd_dq_kernel[(ntiles, HQ)](
        **common,
        dq=dq,
        d_rows=d_rows,
        mid_sums=mid_sums,
        NTILES=ntiles,
        NT_MAX=nt_max,
        BDQ=tiles.visit if fox else diagonal,  # FoX's dq steps a whole visit tile
        SUM_PRECISION=_sum_precision(q.dtype),
        INTERPRET=interpreting(),
        **sizes,
    )
    _bwd_dkv_kernel[(ntiles, HQ)](
        **common,
        dk=dk,
        dv=dv,
        d_cols=d_cols,
        d_level=d_level,
        BDK=diagonal,
        **sizes,
    )
    if G > 1:
        dk = dk.view(B, T, H, G, shape.K).sum(3).to(k.dtype)
        dv = dv.view(B, T, H, G, shape.V).sum(3).to(v.dtype)
    if fox:
        dlog_f = torch.empty(B, T, HQ, dtype=acc, device=q.device)
        _segment_sums_kernel[(len(shape.lengths), HQ)](
            d_rows=d_rows,
            d_cols=d_cols,
            out=dlog_f,
            cu_seqlens=cu,
            N_TOK=shape.n_tok,
            HQ=HQ,
            BLOCK=SEGMENT_BLOCK,
            num_warps=PREPASS_WARPS,
        )
        return dq, dk, dv, dlog_f
    _dfield_kernel[(ntiles, HQ)](
        field=field,
        d_rows=d_rows,
        d_cols=d_cols,
        mid_sums=mid_sums,
        dfield=d_rows,
        cu_seqlens=cu,
        tiles=tile_list,
        tile_start=tile_start,
        N_TOK=shape.n_tok,
        NTILES=ntiles,
        NT_MAX=nt_max,
        HQ=HQ,
        BT=BT,
        BN=ROW_BLOCK,
        num_warps=PREPASS_WARPS,
    )
    return dq, dk, dv, d_rows, d_level


@dispatch.register("fpa_fwd", "triton")
def fpa_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    field: torch.Tensor,
    level: torch.Tensor,
    scale: float | None,
    packing: Packing | None,
    *,
    theta: float | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First Passage Attention forward, (F1)-(F5) tiled as in spec section 7.

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; bf16, fp16, fp32 or fp64, one dtype.
        field, level: [B, T, HQ] float32 (float64 with float64 q).
        scale: softmax scale (None: K ** -0.5).
        packing: None or the checked offsets (a ``Packing``), B = 1.
        theta: optional eviction threshold: key tiles whose every descent depth is >= theta are
            skipped (section 7); None (default) computes exactly.
        window: None, or the window W of (F3w): key tiles wholly outside it are not visited
            (time O(T W (K + V)) per head).

    Returns:
        o [B, T, HQ, V] in q's dtype; lse [B, T, HQ] natural log, in field's dtype.

    Time O(T^2 (K + V) / 2) per head; memory O(T) beyond the inputs (2 log2(BT) floats per token
    for the block minima).
    """
    assert theta is None or theta > 0, theta
    return _forward(q, k, v, field, level, scale, packing, theta, fox=False, window=window)


@dispatch.register("fpa_bwd", "triton")
def fpa_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    field: torch.Tensor,
    level: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float | None,
    packing: Packing | None,
    *,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`fpa_fwd`, (G1)-(G4): derivative of max(0, x) at 0 is 1, argmin ties
    go to the latest position; with ``window``, over the pairs inside it (F3w), tiles wholly
    outside not visited. Deterministic (no atomics).

    Returns:
        dq, dk, dv (shaped and typed like q, k, v; dk, dv summed over each GQA group), dfield,
        dlevel (like field). Time O(T^2 (K + V)) per head; memory O(T K HQ) for GQA partials
        and O(HQ (T / BT)^2) for the per-tile-pair gap sums.
    """
    dq, dk, dv, dfield, dlevel = _backward(
        q, k, v, field, level, o, lse, do, dlse, scale, packing, fox=False, window=window
    )
    return dq, dk, dv, dfield, dlevel


@dispatch.register("fox_fwd", "triton")
def fox_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    scale: float | None,
    packing: Packing | None,
    *,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forgetting attention forward (F6) on the bias-only fast path; ``window``: (F3w), as in
    :func:`fpa_fwd`.

    Args: as :func:`fpa_fwd` with log_f [B, T, HQ] (log forget gates <= 0) for field and level.
    Returns: o [B, T, HQ, V] in q's dtype, lse [B, T, HQ] in log_f's dtype.
    Time O(T^2 (K + V) / 2) per head; memory O(1) beyond inputs and outputs.
    """
    return _forward(q, k, v, log_f, None, scale, packing, None, fox=True, window=window)


@dispatch.register("fox_bwd", "triton")
def fox_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_f: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dlse: torch.Tensor | None,
    scale: float | None,
    packing: Packing | None,
    *,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`fox_fwd`: dq, dk, dv, dlog_f, dlog_f_l = sum over (i, j) with
    j < l <= i (inside the window of (F3w) when given) of G_ij. Deterministic. Time
    O(T^2 (K + V)) per head."""
    dq, dk, dv, dlog_f = _backward(
        q, k, v, log_f, None, o, lse, do, dlse, scale, packing, fox=True, window=window
    )
    return dq, dk, dv, dlog_f
