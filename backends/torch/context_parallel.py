"""Context parallelism: FPA, FoX and the Interdomain S4D core with the sequence sharded over a
``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).

Every rank holds a shard of the sequence (dim 1 of the torch layout ``[B, T, H, D]``) and gets
its shard of the output; gradients arrive on the shards of their inputs. The identities are
(CP1)-(CP5) of docs/context_parallel.md:

- FPA (CP1, CP2, CP5): the keys, values, field and levels of every shard are all-gathered; each
  query chunk meets its own chunk through the single-device kernel (Triton on CUDA, the eager
  twin elsewhere) and every earlier chunk through a rectangular tile whose segment minimum is
  min(suffix min of the key chunk, minima of the chunks strictly between, prefix min of the query
  chunk); the partials are merged by log-sum-exp. The backward hands the merged (o, lse) to the
  same kernels, and the key, value, field and level cotangents of every rank are summed onto
  their owners (a field cotangent goes to the owner of the segment's latest argmin).
- FoX (CP3): the walk cumsum(log f) entering a chunk is the exclusive scan of chunk totals; the
  log f cotangent is its adjoint (a local reverse cumsum plus the reverse scan of totals).
- S4D (CP4): each shard scans from zero to get its final state; the state entering shard r is the
  exclusive scan of the pairs (Lambda^L, final state), and the shard runs again from it. Both
  passes are the single-device op, so autograd carries the gradients, the all-gather of states
  included.

Layouts: ``"contiguous"`` (rank r holds chunk r) and, for FPA and FoX, ``"zigzag"`` (rank r holds
chunks r and 2P - 1 - r, concatenated, which balances the causal work). Memory per rank: the
queries, outputs and their gradients O(T/P (K + V)); the gathered keys and values and their
gradient buffers O(T (K + V)) (the price of the all-gather design); the tiles O(T/P * block).

Bad input (shards of unequal length, dtypes, devices or options that differ across ranks,
cu_seqlens not covering the gathered sequence, NaN) raises the same ValueError on every rank
before any tensor collective, so no rank waits for a peer that has given up.

Replicated parameters (the S4D lam, b, c) receive this rank's share of their gradient; sum it
over the group (DDP and FSDP over the context-parallel ranks do).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from attnspec.reference.packing import Packing, packing

from ..tile_sizes import CONTEXT_PARALLEL_QUERY_BLOCK
from . import checks, dispatch, ops
from .eager_fpa import compute_dtype, from_rows, prefix_min, suffix_min, to_rows

LAYOUTS = ("contiguous", "zigzag")
_INF = float("inf")


# Layout


def chunk_count(world: int, layout: str) -> int:
    """Chunks of the sequence: P (contiguous) or 2P (zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return world if layout == "contiguous" else 2 * world


def rank_chunks(rank: int, world: int, layout: str) -> list[int]:
    """The global chunk indices rank ``rank`` holds, in the order of its local shard."""
    return [rank] if chunk_count(world, layout) == world else [rank, 2 * world - 1 - rank]


def shard_sequence(
    x: Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = 1
) -> Tensor:
    """This rank's shard of a full-sequence tensor (the chunks of :func:`rank_chunks`).

    ValueError if the number of chunks does not divide the length of ``dim``.
    """
    n = chunk_count(world, layout)
    T = x.shape[dim]
    if T % n:
        raise ValueError(
            f"x: the sequence length T = {T} must be divisible by the {n} chunks of the "
            f"{layout!r} layout on {world} ranks"
        )
    L = T // n
    return torch.cat([x.narrow(dim, c * L, L) for c in rank_chunks(rank, world, layout)], dim)


def unshard_sequence(
    parts: Sequence[Tensor], *, layout: str = "contiguous", dim: int = 1
) -> Tensor:
    """The full sequence from the shards of every rank (rank order), inverse of
    :func:`shard_sequence`."""
    world = len(parts)
    n = chunk_count(world, layout)
    L = parts[0].shape[dim] * world // n
    chunks: list[Tensor | None] = [None] * n
    for r, part in enumerate(parts):
        for i, c in enumerate(rank_chunks(r, world, layout)):
            chunks[c] = part.narrow(dim, i * L, L)
    return torch.cat([c for c in chunks if c is not None], dim)


class _Layout(NamedTuple):
    rank: int
    world: int
    L: int  # chunk length
    chunks: list[int]  # this rank's chunks (global indices), in local order
    owner: list[tuple[int, int]]  # chunk -> (rank, local position)

    def span(self, c: int) -> tuple[int, int]:
        return c * self.L, (c + 1) * self.L


def _layout(group: Any, T_local: int, layout: str) -> _Layout:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = chunk_count(world, layout)
    L = T_local * world // n
    owner = [(0, 0)] * n
    for r in range(world):
        for i, c in enumerate(rank_chunks(r, world, layout)):
            owner[c] = (r, i)
    return _Layout(rank, world, L, rank_chunks(rank, world, layout), owner)


# Agreement: every rank raises the same error, before any tensor collective


def _describe(x: Tensor | None) -> Any:
    return None if x is None else (tuple(x.shape), str(x.dtype), x.device.type)


def agree(group: Any, local_error: str | None, description: dict[str, Any]) -> None:
    """Exchange each rank's verdict on its own inputs and a description of them; raise the same
    ValueError on every rank if any rank failed or the descriptions differ."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (local_error, description), group=group)
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(gathered) if e]
    if errors:
        raise ValueError("; ".join(errors))
    for name in description:
        values = [d[name] for _, d in gathered]
        if any(v != values[0] for v in values):
            if name == "T":
                raise ValueError(
                    f"T: every rank must hold a shard of the same length (the world size must "
                    f"divide the sequence length); got shard lengths {values}"
                )
            raise ValueError(f"{name}: must agree across ranks, got {values} (by rank)")


def _offsets(cu_seqlens: Any, T: int) -> tuple[int, ...] | None:
    """Global cu_seqlens checked by the one rule of :mod:`attnspec.reference.packing` against
    the gathered length (every rank passes the same offsets of the whole sequence), without
    zero-length sequences (they contribute nothing): strictly increasing."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens: expected int32 or int64 offsets, got {cu_seqlens.dtype}")
        cu_seqlens = cu_seqlens.tolist()
    plan = packing(cu_seqlens, T, what="global offsets")
    assert plan is not None
    return plan.nonempty_offsets


def _local_offsets(offsets: tuple[int, ...], start: int, stop: int) -> Packing:
    inside = [o - start for o in offsets if start < o < stop]
    return Packing((0, *inside, stop - start))


def _segment_ids(offsets: tuple[int, ...] | None, T: int, device: Any) -> Tensor | None:
    if offsets is None:
        return None
    pos = torch.arange(T, device=device)
    return torch.searchsorted(torch.tensor(offsets, device=device), pos, right=True) - 1


# Collectives


def all_gather(x: Tensor, group: Any) -> list[Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _sum_to_owners(parts: list[Tensor], group: Any) -> Tensor:
    """parts[r] is this rank's contribution to rank r's shard; returns the sum over ranks of
    the contributions to this rank (reduce-scatter; all-reduce on gloo, which lacks it)."""
    if dist.get_backend(group) == "nccl":
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, [p.contiguous() for p in parts], group=group)
        return out
    stacked = torch.stack(parts)
    dist.all_reduce(stacked, group=group)
    return stacked[dist.get_rank(group)].clone()


class _GatherStates(torch.autograd.Function):
    """All-gather with a gradient: the backward sums each rank's cotangent onto its owner."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return torch.stack(all_gather(x, group))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _sum_to_owners(list(grad.unbind(0)), ctx.group), None


# The strategy: the identities, as methods a wrong implementation can override


class Sharding:
    """(CP1) the gap minimum, (CP3) the scan of chunk totals, (CP4) the carry of S4D states."""

    def gap(self, mu: Tensor, argmu: Tensor, key: int, query: int) -> tuple[Tensor, Tensor]:
        """(CP1) min of the field over the chunks strictly between chunk ``key`` and chunk
        ``query``, and its latest argmin; mu, argmu [N, n_chunks] (argmins global)."""
        mid = torch.full_like(mu[:, 0], _INF)
        argmid = torch.zeros_like(argmu[:, 0])
        for c in range(key + 1, query):  # a later chunk wins ties: the latest argmin
            newer = mu[:, c] <= mid
            mid = torch.where(newer, mu[:, c], mid)
            argmid = torch.where(newer, argmu[:, c], argmid)
        return mid, argmid

    def scan(self, totals: Tensor) -> Tensor:
        """(CP3) exclusive scan along the last axis: the walk entering each chunk."""
        return torch.cumsum(totals, dim=-1) - totals

    def carry(self, decays: list[Tensor], finals: list[Tensor], keep: list[bool]) -> list[Tensor]:
        """(CP4) S_0 = 0, S_{r+1} = keep_r (decays_r S_r + finals_r): the exclusive scan of
        the pairs (decay, final state); keep_r is False when a sequence starts at the border."""
        states = [torch.zeros_like(finals[0])]
        for a, x, kept in zip(decays[:-1], finals[:-1], keep[:-1], strict=True):
            nxt = a * states[-1] + x
            states.append(nxt if kept else torch.zeros_like(nxt))
        return states


DEFAULT = Sharding()


# Cross-chunk tiles: queries of chunk a, keys of an earlier chunk b


class _FPACross:
    """The (CP1) penalty of a (query chunk, key chunk) pair and the routing of its gradient."""

    def __init__(
        self,
        field: Tensor,
        level: Tensor,
        a: tuple[int, int],
        b: tuple[int, int],
        mid: Tensor,
        argmid: Tensor,
    ) -> None:
        # field, level: [N, T] gathered (rows layout); a, b: global spans
        self.a, self.b = a, b
        S, argS = suffix_min(field[:, b[0] : b[1]])
        self.A = torch.cat([S[:, 1:], torch.full_like(S[:, :1], _INF)], dim=1)  # over (j, j1)
        self.argA = torch.cat([argS[:, 1:], torch.zeros_like(argS[:, :1])], dim=1) + b[0]
        self.B, argB = prefix_min(field[:, a[0] : a[1]])
        self.argB = argB + a[0]
        self.mid, self.argmid = mid, argmid
        self.Am = torch.minimum(self.A, mid[:, None])
        self.level = level[:, None, b[0] : b[1]]

    def penalty(self, i0: int, i1: int) -> tuple[Tensor, Tensor]:
        m = torch.minimum(self.Am[:, None, :], self.B[:, i0:i1, None])  # (CP1)
        return torch.sub(self.level, m).clamp_min_(0.0), m  # (F2)

    def route(self, G: Tensor, m: Tensor, i0: int, i1: int, dfield: Tensor, dlevel: Tensor) -> None:
        W = G * (self.level >= m)  # active_ij
        dlevel[:, self.b[0] : self.b[1]] -= W.sum(dim=1)  # (G2)
        in_B = self.B[:, i0:i1, None] <= self.Am[:, None, :]  # (G3): latest argmin first
        in_mid = ~in_B & (self.mid[:, None] <= self.A)[:, None, :]
        in_A = ~in_B & ~in_mid
        dfield.scatter_add_(1, self.argB[:, i0:i1], (W * in_B).sum(dim=2))
        dfield.scatter_add_(1, self.argmid[:, None], (W * in_mid).sum(dim=(1, 2))[:, None])
        dfield.scatter_add_(1, self.argA, (W * in_A).sum(dim=1))


class _FoXCross:
    """FoX's decay c_j - c_i of a chunk pair, from the walk of (CP3), and its cotangent."""

    def __init__(self, walk: Tensor, a: tuple[int, int], b: tuple[int, int], dtype: torch.dtype):
        origin = walk[:, a[0] : a[0] + 1]  # float64 walk, offset before meeting the logits
        self.ci = (walk[:, a[0] : a[1]] - origin).to(dtype)
        self.cj = (walk[:, b[0] : b[1]] - origin).to(dtype)
        self.a, self.b = a, b

    def penalty(self, i0: int, i1: int) -> tuple[Tensor, Tensor]:
        return self.cj[:, None, :] - self.ci[:, i0:i1, None], self.ci

    def route(self, G: Tensor, m: Tensor, i0: int, i1: int, dc: Tensor, _: Tensor) -> None:
        dc[:, self.b[0] : self.b[1]] -= G.sum(dim=1).to(dc.dtype)
        dc[:, self.a[0] + i0 : self.a[0] + i1] += G.sum(dim=2).to(dc.dtype)


def _cross_forward(
    q: Tensor, k: Tensor, v: Tensor, tile: Any, scale: float, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Softmax partial (o, lse) of queries q [N, La, K] over keys [N, Lb, .] with the tile's
    penalty; rows with every key masked get lse = -inf and o = 0."""
    N, La, _ = q.shape
    o = q.new_empty(N, La, v.shape[2])
    lse = q.new_empty(N, La)
    for i0 in range(0, La, CONTEXT_PARALLEL_QUERY_BLOCK):
        i1 = min(La, i0 + CONTEXT_PARALLEL_QUERY_BLOCK)
        pen, _ = tile.penalty(i0, i1)
        s = torch.baddbmm(pen, q[:, i0:i1], k.transpose(1, 2), beta=-1, alpha=scale)
        if mask is not None:
            s = s.masked_fill(~mask[i0:i1], -_INF)
        top = s.amax(dim=2)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(s - top[:, :, None])
        total = p.sum(dim=2)
        o[:, i0:i1] = torch.bmm(p, v) / total.clamp_min(torch.finfo(total.dtype).tiny)[:, :, None]
        lse[:, i0:i1] = top + torch.log(total)
    return o, lse


def _cross_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lse: Tensor,
    do: Tensor,
    delta: Tensor,
    tile: Any,
    scale: float,
    mask: Tensor | None,
    dq: Tensor,
    dk: Tensor,
    dv: Tensor,
    dfield: Tensor,
    dlevel: Tensor,
) -> None:
    """(G1)-(G3) of a cross tile with the merged lse and delta = <dO, o> - dLSE."""
    La = q.shape[1]
    for i0 in range(0, La, CONTEXT_PARALLEL_QUERY_BLOCK):
        i1 = min(La, i0 + CONTEXT_PARALLEL_QUERY_BLOCK)
        pen, m = tile.penalty(i0, i1)
        s = torch.baddbmm(pen, q[:, i0:i1], k.transpose(1, 2), beta=-1, alpha=scale)
        if mask is not None:
            s = s.masked_fill(~mask[i0:i1], -_INF)
        p = torch.exp(s - lse[:, i0:i1, None])
        G = (torch.bmm(do[:, i0:i1], v.transpose(1, 2)) - delta[:, i0:i1, None]) * p
        dq[:, i0:i1] += scale * torch.bmm(G, k)
        dk += scale * torch.bmm(G.transpose(1, 2), q[:, i0:i1])
        dv += torch.bmm(p.transpose(1, 2), do[:, i0:i1])
        tile.route(G, m, i0, i1, dfield, dlevel)


def _merge(parts: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """(CP5) lse = logsumexp_b lse_b, o = sum_b exp(lse_b - lse) o_b, in float64 and with
    normalised weights w_b = exp(lse_b - max_b lse_b) / sum_b' (...): the backward's
    delta = <dO, o> cancels against <dO, v_j> where one key dominates, so o must be the convex
    combination of the partials to their own precision. exp(lse_b - lse) from lse rounded to
    float32 at |lse| in the hundreds errs by |lse| eps ~ 2e-5 per partial, which made the
    float32 dq at scale 40 1.7e-3 off (the single-device op: 2.9e-5)."""
    dtype = parts[0][0].dtype
    lses = torch.stack([p[1] for p in parts]).to(torch.float64)
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lses - top)  # the largest partial has weight exactly 1
    total = w.sum(dim=0)
    o = sum(w[b][..., None] * p[0].to(torch.float64) for b, p in enumerate(parts))
    assert isinstance(o, Tensor)
    o = o / total.clamp_min(torch.finfo(torch.float64).tiny)[..., None]
    return o.to(dtype), (top + torch.log(total)).to(parts[0][1].dtype)


# FPA and FoX


class _Plan(NamedTuple):
    group: Any
    lay: _Layout
    kind: str  # "fpa" | "fox"
    scale: float
    offsets: tuple[int, ...] | None
    impl: str
    sharding: Sharding


def _chunk_rows(parts: list[Tensor], lay: _Layout, dtype: torch.dtype, groups: int = 1) -> Tensor:
    """Gathered shards (rank order) -> rows [N, T, .] in global chunk order."""
    L = lay.L
    chunks = [parts[r].narrow(1, i * L, L) for r, i in lay.owner]
    return to_rows(torch.cat(chunks, dim=1), dtype, groups)


def _owner_parts(full: Tensor, lay: _Layout) -> list[Tensor]:
    """[B, T, ...] in global chunk order -> per-rank shards (rank order), for the reduction."""
    L = lay.L
    per_rank: list[list[Tensor]] = [[] for _ in range(lay.world)]
    for c, (r, _) in enumerate(lay.owner):
        per_rank[r].append(full.narrow(1, c * L, L))
    return [torch.cat(p, dim=1) for p in per_rank]


class _AttentionCP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, plan: _Plan, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor
    ) -> tuple[Tensor, Tensor]:
        # FoX passes log_f as ``field`` and ``level`` is unused
        lay, kind, group = plan.lay, plan.kind, plan.group
        B, _, HQ, _ = q.shape
        groups = HQ // k.shape[2]
        dtype = compute_dtype(q, field)
        gathered = [all_gather(x, group) for x in (k, v, field, level)]
        ks = _chunk_rows(gathered[0], lay, dtype, groups)
        vs = _chunk_rows(gathered[1], lay, dtype, groups)
        fs = _chunk_rows(gathered[2], lay, torch.float64 if kind == "fox" else dtype)
        ls = _chunk_rows(gathered[3], lay, dtype)
        qs = to_rows(q, dtype)
        stats = _chunk_stats(plan, fs)
        seg = _segment_ids(plan.offsets, fs.shape[1], q.device)
        os_, lses = [], []
        L = lay.L
        fwd = dispatch.lookup(f"{kind}_fwd", plan.impl)
        for i, a in enumerate(lay.chunks):
            sl = slice(i * L, (i + 1) * L)
            span = lay.span(a)
            cu = None if plan.offsets is None else _local_offsets(plan.offsets, *span)
            wide = (field[:, sl],) if kind == "fox" else (field[:, sl], level[:, sl])
            o_d, lse_d = fwd(
                q[:, sl].contiguous(),
                k[:, sl].contiguous(),
                v[:, sl].contiguous(),
                *(w.contiguous() for w in wide),
                plan.scale,
                cu,
            )
            parts = [(to_rows(o_d, dtype), to_rows(lse_d, dtype))]
            for b in range(a):
                tile, mask = _tile(plan, stats, fs, ls, a, b, seg, dtype)
                if mask is not None and not mask.any():
                    continue
                kb = slice(*lay.span(b))
                parts.append(
                    _cross_forward(qs[:, sl], ks[:, kb], vs[:, kb], tile, plan.scale, mask)
                )
            o_a, lse_a = _merge(parts)
            os_.append(o_a)
            lses.append(lse_a)
        o = from_rows(torch.cat(os_, dim=1), B, q.dtype)
        lse = from_rows(torch.cat(lses, dim=1), B, field.dtype)
        ctx.plan, ctx.groups = plan, groups
        ctx.save_for_backward(q, k, v, field, level, o, lse, ks, vs, fs, ls)
        return o, lse

    @staticmethod
    def backward(ctx: Any, do: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
        plan: _Plan = ctx.plan
        lay, kind, groups = plan.lay, plan.kind, ctx.groups
        q, k, v, field, level, o, lse, ks, vs, fs, ls = ctx.saved_tensors
        B = q.shape[0]
        dtype = ks.dtype
        do = do.contiguous()
        dlse = dlse.contiguous()
        qs, dos, os_, lses = (to_rows(x, dtype) for x in (q, do, o, lse))
        delta = (dos * os_).sum(dim=2) - to_rows(dlse, dtype)
        dq = torch.zeros_like(qs)
        dks, dvs = torch.zeros_like(ks), torch.zeros_like(vs)
        dfs = torch.zeros_like(fs)  # FoX: dL/dc in float64
        dls = torch.zeros_like(ls)
        stats = _chunk_stats(plan, fs)
        seg = _segment_ids(plan.offsets, fs.shape[1], q.device)
        bwd = dispatch.lookup(f"{kind}_bwd", ops._backward_impl(f"{kind}_bwd", plan.impl))
        L = lay.L
        dq_loc = torch.zeros_like(q)
        dk_loc, dv_loc = torch.zeros_like(k), torch.zeros_like(v)
        dfield_loc, dlevel_loc = torch.zeros_like(field), torch.zeros_like(level)
        for i, a in enumerate(lay.chunks):
            sl = slice(i * L, (i + 1) * L)
            span = lay.span(a)
            cu = None if plan.offsets is None else _local_offsets(plan.offsets, *span)
            wide = (field[:, sl],) if kind == "fox" else (field[:, sl], level[:, sl])
            grads = bwd(
                q[:, sl].contiguous(),
                k[:, sl].contiguous(),
                v[:, sl].contiguous(),
                *(w.contiguous() for w in wide),
                o[:, sl].contiguous(),
                lse[:, sl].contiguous(),
                do[:, sl].contiguous(),
                dlse[:, sl].contiguous(),
                plan.scale,
                cu,
            )
            dq_loc[:, sl] += grads[0]
            dk_loc[:, sl] += grads[1]
            dv_loc[:, sl] += grads[2]
            dfield_loc[:, sl] += grads[3]
            if kind == "fpa":
                dlevel_loc[:, sl] += grads[4]
            for b in range(a):
                tile, mask = _tile(plan, stats, fs, ls, a, b, seg, dtype)
                if mask is not None and not mask.any():
                    continue
                kb = slice(*lay.span(b))
                _cross_backward(
                    qs[:, sl],
                    ks[:, kb],
                    vs[:, kb],
                    lses[:, sl],
                    dos[:, sl],
                    delta[:, sl],
                    tile,
                    plan.scale,
                    mask,
                    dq[:, sl],
                    dks[:, kb],
                    dvs[:, kb],
                    dfs,
                    dls,
                )
        # the cross-chunk shares of every rank, summed onto the owners (the reduction)
        dk_full = from_rows(dks, B, k.dtype, groups)
        dv_full = from_rows(dvs, B, v.dtype, groups)
        dk_loc += _sum_to_owners(_owner_parts(dk_full, lay), plan.group)
        dv_loc += _sum_to_owners(_owner_parts(dv_full, lay), plan.group)
        dq_loc += from_rows(dq, B, q.dtype)
        if kind == "fpa":
            dfield_loc += _sum_to_owners(
                _owner_parts(from_rows(dfs, B, field.dtype), lay), plan.group
            )
            dlevel_loc += _sum_to_owners(
                _owner_parts(from_rows(dls, B, level.dtype), lay), plan.group
            )
            return None, dq_loc, dk_loc, dv_loc, dfield_loc, dlevel_loc
        dc = _sum_to_owners(_owner_parts(from_rows(dfs, B, torch.float64), lay), plan.group)
        dfield_loc += _walk_adjoint(plan, dc).to(field.dtype)
        return None, dq_loc, dk_loc, dv_loc, dfield_loc, None


class _Stats(NamedTuple):
    mu: Tensor  # [N, n_chunks] chunk minima of the field (FPA) or None-like for FoX
    argmu: Tensor
    walk: Tensor  # FoX: the global walk c [N, T] float64 by (CP3)


def _chunk_stats(plan: _Plan, fs: Tensor) -> _Stats:
    n = fs.shape[1] // plan.lay.L
    chunks = fs.reshape(fs.shape[0], n, plan.lay.L)
    if plan.kind == "fox":
        local = torch.cumsum(chunks, dim=2)
        offsets = plan.sharding.scan(local[:, :, -1])  # (CP3)
        walk = (local + offsets[:, :, None]).reshape(fs.shape)
        return _Stats(fs[:, :0], fs[:, :0].long(), walk)
    mu = chunks.amin(dim=2)
    L = plan.lay.L
    t = torch.arange(L, device=fs.device)
    last = torch.where(chunks == mu[:, :, None], t, -1).amax(dim=2)  # latest argmin
    argmu = last + torch.arange(n, device=fs.device) * L
    return _Stats(mu, argmu, fs)


def _tile(
    plan: _Plan,
    stats: _Stats,
    fs: Tensor,
    ls: Tensor,
    a: int,
    b: int,
    seg: Tensor | None,
    dtype: torch.dtype,
) -> tuple[Any, Tensor | None]:
    span_a, span_b = plan.lay.span(a), plan.lay.span(b)
    mask = None
    if seg is not None:
        mask = seg[span_a[0] : span_a[1], None] == seg[None, span_b[0] : span_b[1]]
    if plan.kind == "fox":
        return _FoXCross(stats.walk, span_a, span_b, dtype), mask
    mid, argmid = plan.sharding.gap(stats.mu, stats.argmu, b, a)
    return _FPACross(fs, ls, span_a, span_b, mid, argmid), mask


def _walk_adjoint(plan: _Plan, dc: Tensor) -> Tensor:
    """(CP3) adjoint: dlog f_l = sum_{t >= l} dL/dc_t = local reverse cumsum + the exclusive
    reverse scan of the chunk totals of every rank (gathered), for this rank's chunks."""
    lay = plan.lay
    L = lay.L
    locals_ = [dc[:, i * L : (i + 1) * L].flip(1).cumsum(1).flip(1) for i in range(len(lay.chunks))]
    mine = torch.stack([x[:, 0] for x in locals_], dim=1)  # [B, n_local, HQ] totals
    gathered = all_gather(mine, plan.group)
    n = chunk_count(lay.world, "contiguous" if len(lay.chunks) == 1 else "zigzag")
    totals = torch.zeros((*mine.shape[:1], n, *mine.shape[2:]), dtype=dc.dtype, device=dc.device)
    for c, (r, i) in enumerate(lay.owner):
        totals[:, c] = gathered[r][:, i]
    later = plan.sharding.scan(totals.flip(1).movedim(1, -1)).movedim(-1, 1).flip(1)
    return torch.cat([x + later[:, c, None] for x, c in zip(locals_, lay.chunks, strict=True)], 1)


def _setup(
    group: Any,
    q: Tensor,
    named: dict[str, Tensor],
    layout: str,
    extra: dict[str, Any],
    local_checks: Any,
) -> tuple[Any, _Layout]:
    group = dist.group.WORLD if group is None else group
    error = None
    try:
        chunk_count(dist.get_world_size(group), layout)
        local_checks()
    except ValueError as exc:
        error = str(exc)
    description = {"T": q.shape[1] if q.dim() > 1 else None, "layout": layout, **extra}
    description.update({name: _describe(x) for name, x in named.items()})
    agree(group, error, description)
    T_loc = q.shape[1]
    n = chunk_count(dist.get_world_size(group), layout)
    world = dist.get_world_size(group)
    if (T_loc * world) % n:
        raise ValueError(
            f"q: a zigzag shard holds two chunks, so its length must be even; got {T_loc}"
        )
    return group, _layout(group, T_loc, layout)


def fpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    *,
    group: Any = None,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: Any = None,
    return_lse: bool = False,
    impl: str | None = None,
    sharding: Sharding = DEFAULT,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`attnspec.backends.torch.ops.fpa_attention` with the sequence sharded over ``group``.

    Args:
        q, k, v, field, level: this rank's shard, [B, T/P, ...] in the torch layout (GQA kept).
        group: the process group (default: the world).
        layout: "contiguous" or "zigzag" (see :func:`shard_sequence`).
        cu_seqlens: offsets of the packed sequences of the WHOLE gathered sequence (B = 1),
            the same on every rank; sequences may cross shard borders.
        scale, return_lse, impl: as for the single-device op.

    Returns:
        this rank's shard of o (and lse).
    """
    s_holder: dict[str, Any] = {}

    def local_checks() -> None:
        dims = checks.attention_inputs(q, k, v)
        s_holder["field"] = checks.per_token("field", field, q)  # half gates widened, as ops
        s_holder["level"] = checks.per_token("level", level, q)
        checks.same_dtype(("field", "level"), (s_holder["field"], s_holder["level"]))
        checks.finite("field", field)
        checks.finite("level", level)
        s_holder["scale"] = checks.scale(scale, dims.K)
        if cu_seqlens is not None and dims.B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {dims.B}")

    world = dist.get_world_size(dist.group.WORLD if group is None else group)
    T_all = q.shape[1] * world if q.dim() > 1 else 0
    extra = {"scale": scale, "impl": impl, "cu_seqlens": _try_offsets(cu_seqlens, T_all)}
    group, lay = _setup(
        group, q, dict(q=q, k=k, v=v, field=field, level=level), layout, extra, local_checks
    )
    offsets = _offsets(cu_seqlens, T_all)
    plan = _Plan(
        group,
        lay,
        "fpa",
        s_holder["scale"],
        offsets,
        ops.resolve_impl("fpa_fwd", impl, q.device),
        sharding,
    )
    field, level = s_holder["field"], s_holder["level"]
    if q.dtype == torch.float64:
        field, level = field.to(torch.float64), level.to(torch.float64)
    o, lse = _AttentionCP.apply(plan, q, k, v, field, level)
    return (o, lse) if return_lse else o


def fox_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    *,
    group: Any = None,
    layout: str = "contiguous",
    scale: float | None = None,
    cu_seqlens: Any = None,
    impl: str | None = None,
    sharding: Sharding = DEFAULT,
) -> Tensor:
    """:func:`attnspec.backends.torch.ops.fox_attention` with the sequence sharded over
    ``group``; arguments as for :func:`fpa_attention` (log_f [B, T/P, HQ] this rank's gates)."""
    s_holder: dict[str, Any] = {}

    def local_checks() -> None:
        dims = checks.attention_inputs(q, k, v)
        s_holder["log_f"] = checks.per_token("log_f", log_f, q)  # half gates widened, as ops
        checks.log_gates(log_f)
        s_holder["scale"] = checks.scale(scale, dims.K)
        if cu_seqlens is not None and dims.B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {dims.B}")

    world = dist.get_world_size(dist.group.WORLD if group is None else group)
    T_all = q.shape[1] * world if q.dim() > 1 else 0
    extra = {"scale": scale, "impl": impl, "cu_seqlens": _try_offsets(cu_seqlens, T_all)}
    group, lay = _setup(group, q, dict(q=q, k=k, v=v, log_f=log_f), layout, extra, local_checks)
    offsets = _offsets(cu_seqlens, T_all)
    plan = _Plan(
        group,
        lay,
        "fox",
        s_holder["scale"],
        offsets,
        ops.resolve_impl("fox_fwd", impl, q.device),
        sharding,
    )
    log_f = s_holder["log_f"]
    if q.dtype == torch.float64:
        log_f = log_f.to(torch.float64)
    o, _ = _AttentionCP.apply(plan, q, k, v, log_f, log_f)
    return o


def _try_offsets(cu_seqlens: Any, T: int) -> Any:
    """cu_seqlens as a comparable value for the agreement (its validity is checked later, the
    same way on every rank)."""
    if cu_seqlens is None:
        return None
    try:
        return tuple(cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)
    except TypeError:
        return repr(cu_seqlens)


# S4D


def interdomain_s4d(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    *,
    group: Any = None,
    readout: str = "linear",
    cu_seqlens: Any = None,
    impl: str | None = None,
    sharding: Sharding = DEFAULT,
) -> Tensor:
    """:func:`attnspec.backends.torch.ops.interdomain_s4d` with the sequence sharded over
    ``group`` (contiguous layout), by (CP4).

    Args:
        fq, kt, vt: this rank's shard [B, T/P, H, .]; lam, b [H, M], c [H, M, M] complex,
            replicated (their gradients on each rank are this rank's share: sum over the group).
        cu_seqlens: offsets of the whole gathered sequence (B = 1), the same on every rank.
        readout, impl: as for the single-device op.

    Returns:
        this rank's shard of o [B, T/P, H, V].

    Two passes of the single-device op per shard (the first only for the final state), and an
    all-gather of P states [N, H, M, C].
    """

    def local_checks() -> None:
        dims = checks.interdomain_features(("fq", "kt", "vt"), fq, kt, vt)
        checks.readout(readout)
        checks.s4d_parameters(lam, b, c, dims.H, pairs=False)
        for name, x in (("lam", lam), ("b", b), ("c", c)):
            checks.finite(name, torch.view_as_real(x))
        checks.decays(torch.view_as_real(lam))
        if cu_seqlens is not None and dims.B != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {dims.B}")

    world = dist.get_world_size(dist.group.WORLD if group is None else group)
    T_all = fq.shape[1] * world if fq.dim() > 1 else 0
    extra = {"readout": readout, "impl": impl, "cu_seqlens": _try_offsets(cu_seqlens, T_all)}
    named = dict(fq=fq, kt=kt, vt=vt, lam=lam, b=b, c=c)
    group, lay = _setup(group, fq, named, "contiguous", extra, local_checks)
    offsets = _offsets(cu_seqlens, T_all)
    L, r = lay.L, lay.rank
    r0, r1 = r * L, (r + 1) * L
    wide = torch.float64 if fq.dtype == torch.float64 else None
    pairs = [
        torch.view_as_real(x).to(wide or torch.view_as_real(x).dtype).contiguous()
        for x in (lam, b, c)
    ]
    cu = None if offsets is None else _local_offsets(offsets, r0, r1)
    cfg = (readout, cu, ops.resolve_impl("s4d_fwd", impl, fq.device))
    fq, kt, vt = fq.contiguous(), kt.contiguous(), vt.contiguous()
    _, final = _S4DLocal.apply(cfg, fq, kt, vt, *pairs, None)
    last = final[-1:] if offsets is not None else final  # the sequence crossing the right border
    finals = list(_GatherStates.apply(last, group).unbind(0))
    starts = set(offsets or ()) - {0}
    decays, keep = [], []
    lam_c = lam.to(torch.complex128 if fq.dtype == torch.float64 else lam.dtype)
    for s in range(lay.world):
        inside = any(s * L < o < (s + 1) * L for o in starts)
        power = torch.view_as_real(lam_c**L)[None, :, :, None, :]  # [1, H, M, 1, 2]
        decays.append(_Decay(torch.zeros_like(power) if inside else power))
        keep.append((s + 1) * L not in starts)
    states = sharding.carry(decays, finals, keep)  # type: ignore[arg-type]
    entering = states[r]
    init = torch.zeros_like(final)
    if offsets is None:
        init = entering
    elif r0 not in starts:
        init = torch.cat([entering, init[1:]], dim=0)
    # every rank's graph reaches the gathered states, so every rank joins their backward
    init = init + 0 * torch.stack(finals).sum()
    o, _ = _S4DLocal.apply(cfg, fq, kt, vt, *pairs, init.to(final.dtype).contiguous())
    return o


class _S4DLocal(torch.autograd.Function):
    """The single-device S4D kernels (fwd, bwd) of one shard, with an initial state."""

    @staticmethod
    def forward(
        ctx: Any,
        cfg: tuple[str, Packing | None, str],
        fq: Tensor,
        kt: Tensor,
        vt: Tensor,
        lam: Tensor,
        b: Tensor,
        c: Tensor,
        init: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        readout, cu, impl = cfg
        kernel = dispatch.lookup("s4d_fwd", impl)
        o, final, saved = kernel(fq, kt, vt, lam, b, c, readout, cu, init, return_saved=True)
        ctx.cfg = cfg
        ctx.save_for_backward(fq, kt, vt, lam, b, c, init, *saved)
        return o, final

    @staticmethod
    def backward(ctx: Any, do: Tensor, dfinal: Tensor) -> tuple[Tensor | None, ...]:
        readout, cu, impl = ctx.cfg
        fq, kt, vt, lam, b, c, init, *saved = ctx.saved_tensors
        kernel = dispatch.lookup("s4d_bwd", ops._backward_impl("s4d_bwd", impl))
        *grads, d_init = kernel(
            fq, kt, vt, lam, b, c, readout, cu, init, do.contiguous(), dfinal.contiguous(), saved
        )
        return (None, *grads, None if init is None else d_init)


class _Decay:
    """A complex factor as (re, im) pairs that multiplies (re, im) state pairs: ``a * x``."""

    def __init__(self, pairs: Tensor) -> None:
        self.pairs = pairs

    def __mul__(self, x: Tensor) -> Tensor:
        ar, ai = self.pairs[..., 0], self.pairs[..., 1]
        xr, xi = x[..., 0], x[..., 1]
        return torch.stack([ar * xr - ai * xi, ar * xi + ai * xr], dim=-1)


def world_info(group: Any = None) -> tuple[int, int]:
    """(rank, world size) of ``group`` (default: the world)."""
    group = dist.group.WORLD if group is None else group
    return dist.get_rank(group), dist.get_world_size(group)


__all__ = [
    "DEFAULT",
    "LAYOUTS",
    "Sharding",
    "agree",
    "fox_attention",
    "fpa_attention",
    "interdomain_s4d",
    "rank_chunks",
    "shard_sequence",
    "unshard_sequence",
    "world_info",
]
