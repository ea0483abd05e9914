"""Eager twins of the FPA and FoX kernels, tiled as spec/fpa.md section 7 describes.

Registered as impl "eager" of ``fpa_fwd``, ``fpa_bwd``, ``fox_fwd`` and ``fox_bwd`` (signatures in
:mod:`.dispatch`). Each query block [i0, i1) meets first its diagonal tile (keys [i0, i1), the
in-tile segment minimum computed directly) and then the key blocks to its left, nearest first,
where the segment minimum is assembled as m_ij = min(A_j, mid, B_i): A_j the minimum of the field
over (j, j1) inside the key block, mid the running minimum over the gap between the blocks, B_i
the prefix minimum inside the query block. The softmax is accumulated online over the tiles, so
memory is O(T * block) rather than O(T^2). With ``block >= T`` the diagonal tile is the whole
sequence: the plain dense form.

The backward is hand-written (G1)-(G4): the derivative of max(0, x) is 1 at 0, and the segment
argmin goes to the latest position; within a tile pair the argmin lies in A, mid or B, so (G3)
becomes column sums, one scalar and row sums. Nothing here differentiates through min/cummin.

Arithmetic: q, k, v are read in float32 (float64 when q or the field is float64), the field and
level in their own dtype; FoX's cumulative sums are taken in float64 and made tile-local (offset
by the first query of the block) before they meet float32 logits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from attnspec.reference.packing import Packing

from ..tile_sizes import EAGER_KEY_BLOCK, EAGER_QUERY_BLOCK
from . import dispatch

_INF = float("inf")


# Layout: [B, T, H, D] <-> one row per (batch, query head) sequence, [N, T, D]


def to_rows(x: Tensor, dtype: torch.dtype, groups: int = 1) -> Tensor:
    """[B, T, H, D] -> [B*H*groups, T, D] (each head repeated for its query heads), or
    [B, T, H] -> [B*H, T], converted to ``dtype``."""
    if x.dim() == 3:
        return x.permute(0, 2, 1).to(dtype).reshape(-1, x.shape[1])
    B, T, H, D = x.shape
    x = x.permute(0, 2, 1, 3).to(dtype)
    if groups > 1:
        x = x.repeat_interleave(groups, dim=1)
    return x.reshape(B * H * groups, T, D)


def from_rows(x: Tensor, B: int, dtype: torch.dtype, groups: int = 1) -> Tensor:
    """Inverse of :func:`to_rows`: [N, T, D] -> [B, T, N/B/groups, D] summed over each group
    (the dk, dv of GQA), or [N, T] -> [B, T, N/B]; contiguous, in ``dtype``."""
    if x.dim() == 2:
        return x.reshape(B, -1, x.shape[1]).permute(0, 2, 1).to(dtype).contiguous()
    N, T, D = x.shape
    x = x.reshape(B, N // (B * groups), groups, T, D).sum(dim=2)
    return x.permute(0, 2, 1, 3).to(dtype).contiguous()


def segments(packing: Packing | None, T: int) -> list[tuple[int, int]]:
    """The independent sequences along the time axis: [(bos, eos), ...]."""
    if packing is None:
        return [(0, T)]
    return list(itertools.pairwise(packing.offsets))


def tile_sizes(block: int | None, key_block: int | None) -> tuple[int, int | None]:
    """The tile sizes of a call: the table's EAGER_QUERY_BLOCK and EAGER_KEY_BLOCK unless given."""
    return (EAGER_QUERY_BLOCK if block is None else block), (
        EAGER_KEY_BLOCK if key_block is None else key_block
    )


def compute_dtype(q: Tensor, wide: Tensor) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 when q or the field is float64."""
    return torch.promote_types(torch.promote_types(q.dtype, torch.float32), wide.dtype)


# Segment minima and their latest argmins inside one block


def segment_min_block(field: Tensor) -> Tensor:
    """(F1) m[n, i, j] = min_{j < t <= i} field[n, t] inside one block; +inf where j >= i.

    Args:
        field: [N, L].

    Returns:
        [N, L, L] in the dtype of field.
    """
    L = field.shape[1]
    below = torch.ones(L, L, dtype=torch.bool, device=field.device).tril(-1)  # j < i
    X = torch.where(below, field[:, :, None], _INF)  # X[i, j] = phi_i if j < i
    return torch.cummin(X, dim=1).values  # running min down the rows: min over (j, i]


def latest_argmin_block(field: Tensor, m: Tensor) -> Tensor:
    """(G3) t*[n, i, j]: the latest t in (j, i] with field_t = m_ij (block-local); -1 if j >= i.

    The latest t <= i where the running minimum is attained anew (field_t = m_tj) carries the
    minimum of (j, i]: every later t has field_t > m_tj.
    """
    L = field.shape[1]
    t = torch.arange(L, device=field.device)
    new_min = (field[:, :, None] == m) & (t[None, :, None] > t[None, None, :])
    return torch.cummax(torch.where(new_min, t[None, :, None], -1), dim=1).values


def prefix_min(field: Tensor) -> tuple[Tensor, Tensor]:
    """B_i = min field over [i0, i] and its latest argmin (block-local), for [N, L] rows."""
    t = torch.arange(field.shape[1], device=field.device)
    B = torch.cummin(field, dim=1).values
    argmin = torch.cummax(torch.where(field == B, t, -1), dim=1).values
    return B, argmin


def suffix_min(field: Tensor) -> tuple[Tensor, Tensor]:
    """S_t = min field over [t, L) and its latest argmin (block-local), for [N, L] rows.

    Read from the right, the minimum changes only at a strictly smaller value, so the latest
    argmin of [t, L) is the first such strict record at or after t.
    """
    L = field.shape[1]
    t = torch.arange(L, device=field.device)
    S = torch.cummin(field.flip(1), dim=1).values.flip(1)
    after = torch.cat([S[:, 1:], torch.full_like(S[:, :1], _INF)], dim=1)  # S_{t+1}
    record = torch.where(field < after, t, L)
    return S, torch.cummin(record.flip(1), dim=1).values.flip(1)


# Tiles: the additive penalty of one (query block, key block) pair and its backward


@dataclass
class Tile:
    """Keys [j0, j1) seen by the current query block; logits are s <q, k> - penalty.

    backward(G) adds the tile's share of the gradient of the penalty's inputs, given
    G = dL/d(logits) of the tile.
    """

    j0: int
    j1: int
    penalty: Tensor  # [N, BT, BS]; +inf on keys after the query
    backward: Callable[[Tensor], None]


class FPAPenalty:
    """pi_ij = max(0, l_j - m_ij) (F2) by tiles, with dfield (G3) and dlevel (G2) buffers."""

    def __init__(self, field: Tensor, level: Tensor, key_block: int | None):
        self.field, self.level, self.key_block = field, level, key_block
        self.dfield = torch.zeros_like(field)
        self.dlevel = torch.zeros_like(level)

    def tiles(self, i0: int, i1: int) -> Iterator[Tile]:
        """The diagonal tile, then the key blocks left of it, nearest first (section 7)."""
        field, level = self.field, self.level
        rows = field[:, i0:i1]
        B, argB = prefix_min(rows)
        yield self._diagonal(i0, i1)
        N = field.shape[0]
        mid = field.new_full((N,), _INF)  # min over the gap (j1, i0): empty so far
        argmid = torch.zeros(N, dtype=torch.long, device=field.device)
        j1 = i0
        while j1 > 0:
            j0 = 0 if self.key_block is None else max(0, j1 - self.key_block)
            cols = field[:, j0:j1]
            S, argS = suffix_min(cols)
            A = torch.cat([S[:, 1:], torch.full_like(S[:, :1], _INF)], dim=1)  # min over (j, j1)
            argA = torch.cat([argS[:, 1:], torch.zeros_like(argS[:, :1])], dim=1) + j0
            A_mid = torch.minimum(A, mid[:, None])  # min over (j, i0): [N, BS]
            m = torch.minimum(A_mid[:, None, :], B[:, :, None])  # (F1) min(A_j, mid, B_i)
            penalty = torch.sub(level[:, None, j0:j1], m).clamp_min_(0.0)  # (F2)
            yield Tile(
                j0,
                j1,
                penalty,
                self._off_diagonal(j0, j1, m, A, A_mid, B, argA, argB + i0, mid, argmid),
            )
            # the gap of the next key block also covers this one; ties keep the later argmin
            newer = S[:, 0] < mid
            mid = torch.where(newer, S[:, 0], mid)
            argmid = torch.where(newer, argS[:, 0] + j0, argmid)
            j1 = j0

    def _diagonal(self, i0: int, i1: int) -> Tile:
        rows = self.field[:, i0:i1]
        m = segment_min_block(rows)  # (F1) [N, BT, BT], +inf for j >= i
        level = self.level[:, None, i0:i1]
        L = i1 - i0
        after = torch.ones(L, L, dtype=torch.bool, device=rows.device).triu(1)  # j > i
        penalty = torch.clamp_min(level - m, 0.0).masked_fill(after, _INF)  # (F2), (F3) causal

        def backward(G: Tensor) -> None:
            W = G * (level >= m)  # active_ij = [l_j >= m_ij]; m = +inf for j >= i
            self.dlevel[:, i0:i1] -= W.sum(dim=1)  # (G2)
            tstar = latest_argmin_block(rows, m).clamp_min(0)  # W = 0 where t* = -1
            self.dfield[:, i0:i1].scatter_add_(1, tstar.flatten(1), W.flatten(1))  # (G3)

        return Tile(i0, i1, penalty, backward)

    def _off_diagonal(
        self,
        j0: int,
        j1: int,
        m: Tensor,
        A: Tensor,
        A_mid: Tensor,
        B: Tensor,
        argA: Tensor,
        argB: Tensor,
        mid: Tensor,
        argmid: Tensor,
    ) -> Callable[[Tensor], None]:
        level = self.level[:, None, j0:j1]

        def backward(G: Tensor) -> None:
            W = G * (level >= m)  # every j < i here
            self.dlevel[:, j0:j1] -= W.sum(dim=1)  # (G2)
            # (G3) the latest argmin: in B (the query block) if B attains m, else in the gap,
            # else in A (the key block)
            in_B = B[:, :, None] <= A_mid[:, None, :]
            in_mid = ~in_B & (mid[:, None] <= A)[:, None, :]
            in_A = ~in_B & ~in_mid
            self.dfield.scatter_add_(1, argB, (W * in_B).sum(dim=2))  # row sums
            self.dfield.scatter_add_(1, argmid[:, None], (W * in_mid).sum(dim=(1, 2))[:, None])
            self.dfield.scatter_add_(1, argA, (W * in_A).sum(dim=1))  # column sums

        return backward


class FoXBias:
    """FoX's decay c_j - c_i, c = cumsum(log f) (F6), by tiles, with the dlog_f buffer.

    c is summed in float64 and offset by c at the first query of the block before it meets
    the logits, so long sequences keep the precision of the logits near the diagonal.
    """

    def __init__(self, log_f: Tensor, dtype: torch.dtype, key_block: int | None):
        self.c = torch.cumsum(log_f.to(torch.float64), dim=1)  # [N, T]
        self.dtype, self.key_block = dtype, key_block
        self.dc = torch.zeros(log_f.shape, dtype=dtype, device=log_f.device)

    def tiles(self, i0: int, i1: int) -> Iterator[Tile]:
        origin = self.c[:, i0 : i0 + 1]
        ci = (self.c[:, i0:i1] - origin).to(self.dtype)  # tile-local cumulative sums
        yield self._tile(i0, i1, i0, i1, ci, origin)
        j1 = i0
        while j1 > 0:
            j0 = 0 if self.key_block is None else max(0, j1 - self.key_block)
            yield self._tile(j0, j1, i0, i1, ci, origin)
            j1 = j0

    def _tile(self, j0: int, j1: int, i0: int, i1: int, ci: Tensor, origin: Tensor) -> Tile:
        cj = (self.c[:, j0:j1] - origin).to(self.dtype)
        penalty = cj[:, None, :] - ci[:, :, None]  # (F6) -sum_{l in (j, i]} log f_l >= 0
        if j0 == i0:  # the diagonal tile: (F3) causal
            after = torch.ones(i1 - i0, i1 - i0, dtype=torch.bool, device=ci.device).triu(1)
            penalty = penalty.masked_fill(after, _INF)

        def backward(G: Tensor) -> None:
            self.dc[:, j0:j1] -= G.sum(dim=1)  # the logits carry -c_j ...
            self.dc[:, i0:i1] += G.sum(dim=2)  # ... and +c_i

        return Tile(j0, j1, penalty, backward)

    def dlog_f(self) -> Tensor:
        """dL/dlog f_l = sum_{t >= l} dL/dc_t: a reverse cumulative sum, taken in float64."""
        return self.dc.to(torch.float64).flip(1).cumsum(1).flip(1)


# Attention over the tiles of one sequence batch: (F3)-(F5) forward, (G1) and (G4) backward


def within_window(tiles: Iterator[Tile], i0: int, i1: int, window: int | None) -> Iterator[Tile]:
    """(F3w) the tiles of query block [i0, i1) that meet the window W, their penalty +inf on
    the pairs with i - j >= W. The tiles come nearest first, so the first tile wholly outside
    (i0 - (j1 - 1) >= W) ends the walk: every later one is farther still."""
    for tile in tiles:
        if window is None:
            yield tile
            continue
        if i0 - (tile.j1 - 1) >= window:
            return
        if i1 - 1 - tile.j0 >= window:  # partly outside: mask the pairs out of the window
            i = torch.arange(i0, i1, device=tile.penalty.device)[:, None]
            j = torch.arange(tile.j0, tile.j1, device=tile.penalty.device)[None, :]
            tile.penalty = tile.penalty.masked_fill(i - j >= window, _INF)
        yield tile


class Penalty(Protocol):
    """What :func:`attend` needs of a penalty: its tiles for a query block, the diagonal
    tile first, then the key blocks to its left."""

    def tiles(self, i0: int, i1: int) -> Iterator[Tile]: ...


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    bias: Penalty,
    block: int,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Causal softmax attention with a tiled additive penalty, online over the key tiles.

    Args:
        q, k: [N, T, K]; v: [N, T, V]; one compute dtype.
        bias: :class:`FPAPenalty` or :class:`FoXBias` over the same T.
        block: query rows per block.
        window: None, or the window W of (F3w) (tiles wholly outside it are skipped).

    Returns:
        o [N, T, V], lse [N, T] (natural log), in the compute dtype. Time O(T^2 (K + V)),
        memory O(T * block) beyond the inputs.
    """
    N, T, _ = q.shape
    o = q.new_empty(N, T, v.shape[2])
    lse = q.new_empty(N, T)
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        qi = q[:, i0:i1]
        tiles = within_window(bias.tiles(i0, i1), i0, i1, window)
        diagonal = next(tiles)  # every row has a finite logit there: the running max is finite
        keys = slice(diagonal.j0, diagonal.j1)
        s = torch.baddbmm(diagonal.penalty, qi, k[:, keys].transpose(1, 2), beta=-1, alpha=scale)
        top = s.amax(dim=2)  # (F3), then (F4) online over the tiles
        p = s.sub_(top[:, :, None]).exp_()
        total, acc = p.sum(dim=2), torch.bmm(p, v[:, keys])
        for tile in tiles:
            kj, vj = k[:, tile.j0 : tile.j1], v[:, tile.j0 : tile.j1]
            s = torch.baddbmm(tile.penalty, qi, kj.transpose(1, 2), beta=-1, alpha=scale)
            new_top = torch.maximum(top, s.amax(dim=2))
            rescale = torch.exp(top - new_top)
            p = s.sub_(new_top[:, :, None]).exp_()
            total = total * rescale + p.sum(dim=2)
            acc = torch.baddbmm(acc * rescale[:, :, None], p, vj)
            top = new_top
        o[:, i0:i1] = acc / total[:, :, None]  # (F4)-(F5)
        lse[:, i0:i1] = top + torch.log(total)
    return o, lse


def attend_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    bias: Penalty,
    block: int,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(G1) with (G4): dq, dk, dv of :func:`attend`; the tiles' ``backward`` receive
    G = dL/d(logits) and accumulate the penalty's own gradients.

    Recomputes p = exp(s - lse) tile by tile (FlashAttention's backward): time
    O(T^2 (K + V)), memory O(T * block).
    """
    delta = (do * o).sum(dim=2)  # <dO_i, o_i>
    if dlse is not None:
        delta = delta - dlse  # (G4) p_ij dLSE_i joins G_ij
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    T = q.shape[1]
    for i0 in range(0, T, block):
        i1 = min(T, i0 + block)
        qi, doi = q[:, i0:i1], do[:, i0:i1]
        lse_i, delta_i = lse[:, i0:i1, None], delta[:, i0:i1, None]
        for tile in within_window(bias.tiles(i0, i1), i0, i1, window):
            keys = slice(tile.j0, tile.j1)
            kj, vj = k[:, keys], v[:, keys]
            s = torch.baddbmm(tile.penalty, qi, kj.transpose(1, 2), beta=-1, alpha=scale)
            p = s.sub_(lse_i).exp_()  # (F4)
            G = torch.bmm(doi, vj.transpose(1, 2)).sub_(delta_i).mul_(p)  # G_ij
            # (G1); bmm then add_: baddbmm_ into a slice runs one addmm_ per sequence on CPU
            # (26 aten calls against 8, and 2.5x the time at N = 2, L = 128)
            dv[:, keys].add_(torch.bmm(p.transpose(1, 2), doi))
            dk[:, keys].add_(torch.bmm(G.transpose(1, 2), qi), alpha=scale)
            dq[:, i0:i1].add_(torch.bmm(G, kj), alpha=scale)
            tile.backward(G)
    return dq, dk, dv


# The registered kernels (signatures of dispatch.py)


@dispatch.register("fpa_fwd", "eager")
def fpa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float,
    packing: Packing | None,
    *,
    block: int | None = None,
    key_block: int | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(F1)-(F5) tiled: o [B, T, HQ, V] in q's dtype, lse [B, T, HQ] in field's dtype
    (float32, float64 for float64 inputs), natural-log units; field and level float32 or
    wider. With ``window``, the window of (F3w).

    Time O(T^2 (K + V)) per sequence, memory O(T * block).
    """
    block, key_block = tile_sizes(block, key_block)
    B, T, HQ, _ = q.shape
    groups = HQ // k.shape[2]
    dtype = compute_dtype(q, field)
    qs, ks, vs = to_rows(q, dtype), to_rows(k, dtype, groups), to_rows(v, dtype, groups)
    fs, ls = to_rows(field, dtype), to_rows(level, dtype)
    o, lse = qs.new_empty(*qs.shape[:2], vs.shape[2]), qs.new_empty(qs.shape[:2])
    for bos, eos in segments(packing, T):
        seq = slice(bos, eos)
        bias = FPAPenalty(fs[:, seq], ls[:, seq], key_block)
        o[:, seq], lse[:, seq] = attend(
            qs[:, seq], ks[:, seq], vs[:, seq], scale, bias, block, window
        )
    return from_rows(o, B, q.dtype), from_rows(lse, B, field.dtype)


@dispatch.register("fpa_bwd", "eager")
def fpa_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    packing: Packing | None,
    *,
    block: int | None = None,
    key_block: int | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(G1)-(G4) tiled: dq, dk, dv, dfield, dlevel shaped and typed like their inputs (dk, dv
    reduced over the query heads of each group); ``dlse`` may be None. Conventions of
    spec/fpa.md section 6.

    Time O(T^2 (K + V)) per sequence, memory O(T * block).
    """
    block, key_block = tile_sizes(block, key_block)
    B, T, HQ, _ = q.shape
    groups = HQ // k.shape[2]
    dtype = compute_dtype(q, field)
    qs, ks, vs = to_rows(q, dtype), to_rows(k, dtype, groups), to_rows(v, dtype, groups)
    fs, ls = to_rows(field, dtype), to_rows(level, dtype)
    os_, dos, lses = to_rows(o, dtype), to_rows(do, dtype), to_rows(lse, dtype)
    dlses = None if dlse is None else to_rows(dlse, dtype)
    dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    dfield, dlevel = torch.empty_like(fs), torch.empty_like(ls)
    for bos, eos in segments(packing, T):
        seq = slice(bos, eos)
        bias = FPAPenalty(fs[:, seq], ls[:, seq], key_block)
        dq[:, seq], dk[:, seq], dv[:, seq] = attend_backward(
            qs[:, seq],
            ks[:, seq],
            vs[:, seq],
            os_[:, seq],
            lses[:, seq],
            dos[:, seq],
            None if dlses is None else dlses[:, seq],
            scale,
            bias,
            block,
            window,
        )
        dfield[:, seq], dlevel[:, seq] = bias.dfield, bias.dlevel
    return (
        from_rows(dq, B, q.dtype),
        from_rows(dk, B, k.dtype, groups),
        from_rows(dv, B, v.dtype, groups),
        from_rows(dfield, B, field.dtype),
        from_rows(dlevel, B, level.dtype),
    )


@dispatch.register("fox_fwd", "eager")
def fox_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    scale: float,
    packing: Packing | None,
    *,
    block: int | None = None,
    key_block: int | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(F6) FoX tiled, the decay from segment-local cumulative sums: o [B, T, HQ, V] in q's
    dtype, lse [B, T, HQ] in log_f's dtype; with ``window``, the window of (F3w). Time
    O(T^2 (K + V)), memory O(T * block)."""
    block, key_block = tile_sizes(block, key_block)
    B, T, HQ, _ = q.shape
    groups = HQ // k.shape[2]
    dtype = compute_dtype(q, log_f)
    qs, ks, vs = to_rows(q, dtype), to_rows(k, dtype, groups), to_rows(v, dtype, groups)
    gs = to_rows(log_f, dtype)
    o, lse = qs.new_empty(*qs.shape[:2], vs.shape[2]), qs.new_empty(qs.shape[:2])
    for bos, eos in segments(packing, T):
        seq = slice(bos, eos)  # the cumulative sum restarts with each sequence
        bias = FoXBias(gs[:, seq], dtype, key_block)
        o[:, seq], lse[:, seq] = attend(
            qs[:, seq], ks[:, seq], vs[:, seq], scale, bias, block, window
        )
    return from_rows(o, B, q.dtype), from_rows(lse, B, log_f.dtype)


@dispatch.register("fox_bwd", "eager")
def fox_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    packing: Packing | None,
    *,
    block: int | None = None,
    key_block: int | None = None,
    window: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """FoX backward: dq, dk, dv by (G1), dlog_f as the reverse cumulative sum of
    dL/dc (row sums minus column sums of G), shaped and typed like their inputs; ``dlse`` may
    be None. Time O(T^2 (K + V)), memory O(T * block)."""
    block, key_block = tile_sizes(block, key_block)
    B, T, HQ, _ = q.shape
    groups = HQ // k.shape[2]
    dtype = compute_dtype(q, log_f)
    qs, ks, vs = to_rows(q, dtype), to_rows(k, dtype, groups), to_rows(v, dtype, groups)
    gs = to_rows(log_f, dtype)
    os_, dos, lses = to_rows(o, dtype), to_rows(do, dtype), to_rows(lse, dtype)
    dlses = None if dlse is None else to_rows(dlse, dtype)
    dq, dk, dv = torch.empty_like(qs), torch.empty_like(ks), torch.empty_like(vs)
    dlog_f = torch.empty_like(gs, dtype=torch.float64)
    for bos, eos in segments(packing, T):
        seq = slice(bos, eos)
        bias = FoXBias(gs[:, seq], dtype, key_block)
        dq[:, seq], dk[:, seq], dv[:, seq] = attend_backward(
            qs[:, seq],
            ks[:, seq],
            vs[:, seq],
            os_[:, seq],
            lses[:, seq],
            dos[:, seq],
            None if dlses is None else dlses[:, seq],
            scale,
            bias,
            block,
            window,
        )
        dlog_f[:, seq] = bias.dlog_f()
    return (
        from_rows(dq, B, q.dtype),
        from_rows(dk, B, k.dtype, groups),
        from_rows(dv, B, v.dtype, groups),
        from_rows(dlog_f, B, log_f.dtype),
    )
