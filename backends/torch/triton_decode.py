"""Triton decode kernel for the paged FPA session (spec/fpa.md F7, F8 gqa; backends/torch/paged.py).

``paged_attention_triton`` has the signature of :func:`.paged.paged_attention_eager`, its twin.
A program owns one (row, kv head, group block) and a split of its pages (flash-decoding): its
query tile holds GB of the G query heads of the kv head times the chunk's n <= 16 positions (row
m = g * NB + p, NB = pow2(n)), so each page of k and v is read once for GB heads. GB is G, or
for wide GQA groups and chunks as many heads as fit in :data:`MAX_ROWS` rows (the tile's rows
set its shared memory: G = 16 heads x 16 positions at D = 256 asked 311,552 B, over a Hopper
block's 232,448 B); the G heads then take ceil(G / GB) programs, each reading the pages. Per
page it loads the slots' token positions, and per query head the levels, the minima m_j before
the chunk and the eviction steps; the chunk's running minimum (F7), the depth (F2) and the mask
(theta and window, through the eviction steps; causality inside the chunk) are formed in
registers, then the logits (F3) and one step of the online softmax. A second pass combines the
splits by their log-sum-exp.

Tensor cores. The tile has GB * NB rows padded to at least 16: tl.dot lowers to mma.sync
(m16n8k16) on sm_90, not to wgmma, whose smallest tile is 64 rows per warpgroup. A one-token
query (n = 1, G <= 4) is a matrix-vector product, bound by the bytes of k and v read, so the
padded rows cost arithmetic that is idle anyway; what matters is that k and v are read once per
kv head (not per query head) and each program streams whole pages (16 tokens x dk contiguous).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .devices import interpreting
from .triton_helpers import bf16_nearest, dot_dtype, precision

PAGES_PER_SPLIT = 16  # pages a program visits (256 tokens at 16 per page)
MAX_ROWS = 64  # query rows (heads x chunk positions) per program at most, when G * NB is more


@triton.jit
def _paged_decode_kernel(
    q: tl.tensor,
    k_pool: tl.tensor,
    v_pool: tl.tensor,
    table: tl.tensor,
    pos: tl.tensor,
    level: tl.tensor,
    mins: tl.tensor,
    evict: tl.tensor,
    tok: tl.tensor,
    field: tl.tensor,
    acc_out: tl.tensor,
    m_out: tl.tensor,
    l_out: tl.tensor,
    scale: tl.tensor,
    n: tl.tensor,
    NT: tl.tensor,
    S: tl.tensor,
    H: tl.constexpr,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    P: tl.constexpr,
    NB: tl.constexpr,
    GB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_BF16: tl.constexpr,
) -> None:
    rhg = tl.program_id(0)  # (row, kv head, group block)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    rh = rhg // ((G + GB - 1) // GB)
    r = rh // H
    h = rh % H
    rows = tl.arange(0, BLOCK_M)
    g = (rhg % ((G + GB - 1) // GB)) * GB + rows // NB
    p = rows % NB
    row_ok = (rows // NB < GB) & (g < G) & (p < n)
    hq = h * G + g
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    offs_p = tl.arange(0, BLOCK_P)
    HQ = H * G
    q_rows = ((r * HQ + hq) * n + p).to(tl.int64)
    b_q = tl.load(
        q + q_rows[:, None] * K + offs_k[None, :],
        mask=row_ok[:, None] & (offs_k[None, :] < K),
        other=0.0,
    ).to(DOT)
    t_row = tl.load(tok + r * n + p, mask=row_ok, other=-1)  # [BLOCK_M] token of each row
    wide = mins.dtype.element_ty
    m_i = tl.full([BLOCK_M], float("-inf"), wide)
    l_i = tl.zeros([BLOCK_M], wide)
    acc = tl.zeros([BLOCK_M, BLOCK_V], wide)
    meta_rows = (r * HQ + hq).to(tl.int64) * S  # [BLOCK_M]
    for i in range(split * PAGES_PER_SPLIT, tl.minimum((split + 1) * PAGES_PER_SPLIT, NT)):
        page = tl.load(table + rh * NT + i)
        slot = i * P + offs_p
        slot_ok = (offs_p < P) & (offs_p * 0 + page >= 0)  # broadcast first (interpreter)
        j = tl.load(pos + rh.to(tl.int64) * S + slot, mask=slot_ok, other=-1)  # [BLOCK_P]
        meta = meta_rows[:, None] + slot[None, :]
        both = row_ok[:, None] & slot_ok[None, :]
        lv = tl.load(level + meta, mask=both, other=0.0)
        running = tl.load(mins + meta, mask=both, other=float("inf"))
        gone = tl.load(evict + meta, mask=both, other=-1)
        for u in tl.static_range(NB):
            at = tl.minimum(u, n - 1)  # position u < NB, absent (-1) beyond n
            t_u = tl.where(u < n, tl.load(tok + r * n + at), -1)
            f_u = tl.load(field + (r * HQ + hq) * n + at, mask=row_ok, other=0.0)
            # (F7) m_j <- min(m_j, phi_u) for the tokens u in (j, t] of this chunk
            reach = (j[None, :] < t_u) & (u <= p)[:, None] & (t_u >= 0)
            running = tl.where(reach, tl.minimum(running, f_u[:, None]), running)
        depth = tl.maximum(lv - running, 0.0)  # (F2)
        keep = both & (j[None, :] >= 0) & (j[None, :] <= t_row[:, None])
        keep = keep & (gone > t_row[:, None]) & (t_row[:, None] >= 0)
        base = tl.maximum(page, 0).to(tl.int64) * P
        b_k = tl.load(
            k_pool + (base + offs_p)[:, None] * K + offs_k[None, :],
            mask=slot_ok[:, None] & (offs_k[None, :] < K),
            other=0.0,
        ).to(DOT)
        b_v = tl.load(
            v_pool + (base + offs_p)[:, None] * V + offs_v[None, :],
            mask=slot_ok[:, None] & (offs_v[None, :] < V),
            other=0.0,
        ).to(DOT)
        s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION).to(wide) * scale - depth
        s = tl.where(keep, s, float("-inf"))  # (F3), theta, window and causality
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        w = tl.exp(s - m_safe[:, None])  # (F4), online
        l_i = l_i * alpha + tl.sum(w, 1)
        w_op = bf16_nearest(w.to(tl.float32)) if ROUND_BF16 else w
        pv = tl.dot(w_op.to(DOT), b_v, input_precision=PRECISION)  # (F5)
        acc = acc * alpha[:, None] + pv.to(wide)
        m_i = m_new
    out = (rhg * nsplit + split).to(tl.int64) * BLOCK_M + rows
    tl.store(m_out + out, m_i)
    tl.store(l_out + out, l_i)
    tl.store(acc_out + out[:, None] * BLOCK_V + offs_v[None, :], acc)


@triton.jit
def _combine_kernel(
    acc_in: tl.tensor,
    m_in: tl.tensor,
    l_in: tl.tensor,
    o: tl.tensor,
    n: tl.tensor,
    nsplit: tl.tensor,
    H: tl.constexpr,
    G: tl.constexpr,
    V: tl.constexpr,
    NB: tl.constexpr,
    GB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
) -> None:
    """o = sum_s e^{m_s - M} acc_s / sum_s e^{m_s - M} l_s over the splits s of a (row, kv head,
    group block)."""
    rhg = tl.program_id(0)
    rh = rhg // ((G + GB - 1) // GB)
    r = rh // H
    h = rh % H
    rows = tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, BLOCK_V)
    g = (rhg % ((G + GB - 1) // GB)) * GB + rows // NB
    p = rows % NB
    row_ok = (rows // NB < GB) & (g < G) & (p < n)
    wide = l_in.dtype.element_ty
    m_all = tl.full([BLOCK_M], float("-inf"), wide)
    l_all = tl.zeros([BLOCK_M], wide)
    acc = tl.zeros([BLOCK_M, BLOCK_V], wide)
    for split in range(nsplit):
        at = (rhg * nsplit + split).to(tl.int64) * BLOCK_M + rows
        m_s = tl.load(m_in + at)
        l_s = tl.load(l_in + at)
        a_s = tl.load(acc_in + at[:, None] * BLOCK_V + offs_v[None, :])
        m_new = tl.maximum(m_all, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        old = tl.exp(m_all - m_safe)
        new = tl.exp(m_s - m_safe)
        l_all = l_all * old + l_s * new
        acc = acc * old[:, None] + a_s * new[:, None]
        m_all = m_new
    res = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]  # rows without keys (absent): 0
    HQ = H * G
    o_rows = ((r * HQ + h * G + g) * n + p).to(tl.int64)
    tl.store(
        o + o_rows[:, None] * V + offs_v[None, :],
        res,
        mask=row_ok[:, None] & (offs_v[None, :] < V),
    )


def _pow2(x: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(x))


def paged_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    pos: torch.Tensor,
    level: torch.Tensor,
    mins: torch.Tensor,
    evict: torch.Tensor,
    tok: torch.Tensor,
    field: torch.Tensor,
    scale: tl.tensor,
    buffers: dict[str, torch.Tensor] | None = None,
    pages_per_split: int = PAGES_PER_SPLIT,
) -> torch.Tensor:
    """The kernel's launch; arguments and result as :func:`.paged.paged_attention_eager`
    (q [R, HQ, n, K] with n <= 16; o [R, HQ, n, V] in the dtype of ``mins``); ``buffers`` is
    not needed (the pages are read in place)."""
    R, HQ, n, K = q.shape
    H, NT = table.shape[1], table.shape[2]
    G, P, V, S = HQ // H, k_pool.shape[1], v_pool.shape[2], pos.shape[2]
    assert n <= 16 and S == NT * P, (n, S, NT, P)
    wide = mins.dtype
    o = torch.zeros(R, HQ, n, V, dtype=wide, device=q.device)
    if n == 0 or NT == 0:
        return o
    NB = triton.next_power_of_2(n)
    GB = min(G, max(1, MAX_ROWS // NB))  # query heads per program
    programs = R * H * math.ceil(G / GB)  # (row, kv head, group block)
    BLOCK_M, BLOCK_V = _pow2(GB * NB), _pow2(V)
    nsplit = max(1, math.ceil(NT / pages_per_split))
    acc = torch.empty(programs * nsplit * BLOCK_M * BLOCK_V, dtype=wide, device=q.device)
    m = torch.empty(programs * nsplit * BLOCK_M, dtype=wide, device=q.device)
    lsum = torch.empty_like(m)
    interpret = interpreting()
    c = lambda x: x.contiguous()  # noqa: E731
    _paged_decode_kernel[(programs, nsplit)](
        c(q),
        c(k_pool),
        c(v_pool),
        c(table),
        c(pos),
        c(level),
        c(mins),
        c(evict),
        c(tok),
        c(field.to(wide)),
        acc,
        m,
        lsum,
        scale,
        n,
        NT,
        S,
        H=H,
        G=G,
        K=K,
        V=V,
        P=P,
        NB=NB,
        GB=GB,
        BLOCK_M=BLOCK_M,
        BLOCK_P=_pow2(P),
        BLOCK_K=_pow2(K),
        BLOCK_V=BLOCK_V,
        PAGES_PER_SPLIT=pages_per_split,
        DOT=dot_dtype(q.dtype, interpret),
        PRECISION=precision(q.dtype),
        ROUND_BF16=interpret and q.dtype == torch.bfloat16,
    )
    _combine_kernel[(programs,)](
        acc, m, lsum, o, n, nsplit, H=H, G=G, V=V, NB=NB, GB=GB, BLOCK_M=BLOCK_M, BLOCK_V=BLOCK_V
    )
    return o
