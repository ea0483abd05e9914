"""(CP1)-(CP5) context parallelism: FPA, FoX and the S4D core with the sequence split into shards.

The identities are stated in docs/context_parallel.md. Here each is simulated in NumPy, float64,
rank by rank: a rank sees the keys, values, field and levels of every chunk (the all-gather) but
only its own queries, and its gradient contributions are full-length buffers that are summed over
the ranks (the reduction). The witness is always the single-sequence reference.

Layouts: the sequence of T positions is cut into chunks of equal length; ``contiguous`` gives
rank r chunk r (P chunks), ``zigzag`` gives rank r chunks r and 2P - 1 - r (2P chunks), which
balances the causal work.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import numpy as np
from numpy.typing import NDArray
from scipy.special import logsumexp

from attnspec.reference import fpa
from attnspec.reference import interdomain as idm

from .registry import CheckResult, check, relative_error, verdict

Array = NDArray[np.float64]
INF = np.inf


def layout_chunks(T: int, P: int, layout: str) -> list[list[tuple[int, int]]]:
    """The chunks [(start, stop), ...] of each rank, in global order within the rank."""
    n = P if layout == "contiguous" else 2 * P
    if layout not in ("contiguous", "zigzag") or T % n:
        raise ValueError(f"layout/T: {layout!r} needs T divisible by {n}, got T = {T}")
    L = T // n
    chunk = [(c * L, (c + 1) * L) for c in range(n)]
    if layout == "contiguous":
        return [[chunk[r]] for r in range(P)]
    return [[chunk[r], chunk[2 * P - 1 - r]] for r in range(P)]


# (CP1) the segment minimum across chunks, and its latest argmin (the routing of (G3))


def suffix_min_exclusive(x: Array) -> tuple[Array, NDArray[np.int64]]:
    """A_j = min x over (j, end] of one chunk (+inf at the end), its latest argmin (-1: none)."""
    L = x.shape[-1]
    A = np.full(x.shape, INF)
    arg = np.full(x.shape, -1, dtype=np.int64)
    for j in range(L - 2, -1, -1):
        take = x[..., j + 1] < A[..., j + 1]  # strictly smaller: ties keep the later position
        A[..., j] = np.where(take, x[..., j + 1], A[..., j + 1])
        arg[..., j] = np.where(take, j + 1, arg[..., j + 1])
    return A, arg


def prefix_min(x: Array) -> tuple[Array, NDArray[np.int64]]:
    """B_i = min x over [start, i] of one chunk and its latest argmin."""
    B = np.minimum.accumulate(x, axis=-1)
    idx = np.where(x == B, np.arange(x.shape[-1]), -1)
    return B, np.maximum.accumulate(idx, axis=-1)


def cross_chunk_min(
    field: Array, key: tuple[int, int], query: tuple[int, int], chunks: list[tuple[int, int]]
) -> tuple[Array, NDArray[np.int64]]:
    """(CP1) m_ij for keys of chunk ``key`` strictly before queries of chunk ``query``:
    min(suffix min of the key chunk after j, minima of the chunks strictly between, prefix min
    of the query chunk up to i); returns m (..., Lq, Lk) and the latest argmin (global positions).
    """
    (j0, j1), (i0, i1) = key, query
    A, argA = suffix_min_exclusive(field[..., j0:j1])
    argA = np.where(argA >= 0, argA + j0, -1)
    B, argB = prefix_min(field[..., i0:i1])
    argB = argB + i0
    mid = np.full(field.shape[:-1], INF)
    argmid = np.full(field.shape[:-1], -1, dtype=np.int64)
    for c0, c1 in chunks:  # in global order: a later chunk wins ties
        if j1 <= c0 and c1 <= i0:
            mu = field[..., c0:c1].min(axis=-1)
            last = c0 + (c1 - c0 - 1) - np.argmin(field[..., c0:c1][..., ::-1], axis=-1)
            newer = mu <= mid
            mid = np.where(newer, mu, mid)
            argmid = np.where(newer, last, argmid)
    Am = np.minimum(A, mid[..., None])  # (..., Lk)
    m = np.minimum(Am[..., None, :], B[..., :, None])
    in_B = B[..., :, None] <= Am[..., None, :]
    in_mid = (mid[..., None] <= A)[..., None, :]
    arg = np.where(
        in_B, argB[..., :, None], np.where(in_mid, argmid[..., None, None], argA[..., None, :])
    )
    return m, arg


def sharded_segment_min(
    field: Array,
    chunks: list[tuple[int, int]],
    *,
    cross: Callable[..., tuple[Array, NDArray[np.int64]]] = cross_chunk_min,
) -> tuple[Array, NDArray[np.int64]]:
    """The full (..., T, T) segment minimum and latest argmin assembled chunk pair by chunk pair:
    the diagonal pairs locally (reference), the others by (CP1)."""
    T = field.shape[-1]
    m = np.full((*field.shape, T), INF)
    arg = np.full(m.shape, -1, dtype=np.int64)
    for a in chunks:
        for b in chunks:
            qa, kb = slice(*a), slice(*b)
            if a == b:
                m[..., qa, kb] = fpa.segment_min(field[..., qa])
                local = fpa.segment_argmin(field[..., qa])
                arg[..., qa, kb] = np.where(local >= 0, local + a[0], -1)
            elif b[0] < a[0]:
                m[..., qa, kb], arg[..., qa, kb] = cross(field, b, a, chunks)
    return m, arg


def _fields(rng: np.random.Generator, shape: tuple[int, ...], T: int) -> Iterator[Array]:
    yield np.cumsum(rng.standard_normal((*shape, T)), axis=-1)
    walk = np.cumsum(rng.integers(-1, 2, size=(*shape, T)), axis=-1).astype(float)
    yield walk  # integer walk: ties and plateaus, also across chunk borders
    flat = np.zeros((*shape, T))
    flat[..., T // 2] = -3.0  # the global minimum on a chunk border
    flat[..., T // 2 - 1] = -3.0
    yield flat
    yield np.zeros((*shape, T))  # one plateau: every segment is a tie


def _layouts() -> Iterator[tuple[int, int, str]]:
    yield from [
        (8, 2, "contiguous"),
        (12, 3, "contiguous"),
        (16, 4, "contiguous"),
        (16, 4, "zigzag"),
        (8, 4, "contiguous"),
        (8, 4, "zigzag"),
    ]


@check("CP1")
def cp1_segment_minimum(
    *, cross_chunk_min: Callable[..., tuple[Array, NDArray[np.int64]]] = cross_chunk_min
) -> CheckResult:
    rng = np.random.default_rng(30)
    wrong = 0
    for T, P, layout in _layouts():
        chunks = sorted(c for rank in layout_chunks(T, P, layout) for c in rank)
        for field in _fields(rng, (2,), T):
            m, arg = sharded_segment_min(field, chunks, cross=cross_chunk_min)
            wrong += int(np.sum(m != fpa.segment_min(field)))
            wrong += int(np.sum(arg != fpa.segment_argmin(field)))
    return verdict(
        "CP1",
        "segment min across chunks = min(suffix min of j's chunk, minima of the chunks strictly "
        "between, prefix min of i's chunk); its latest argmin is the latest of the three",
        "reference segment_min and segment_argmin on the whole sequence; contiguous P = 2, 3, 4 "
        "and zigzag P = 4; ties, plateaus, the minimum on a chunk border",
        wrong,
        0,
    )


# (CP2) FPA rank by rank: log-sum-exp merge forward, reduced gradients backward (CP5)


def sharded_fpa(
    q: Array,
    k: Array,
    v: Array,
    field: Array,
    level: Array,
    d_out: Array,
    P: int,
    layout: str,
    *,
    cross: Callable[..., tuple[Array, NDArray[np.int64]]] = cross_chunk_min,
    reduce: bool = True,
) -> tuple[Array, Array, fpa.FPAGrads]:
    """FPA forward and backward simulated on P ranks; returns (o, lse, grads).

    Each rank computes its query chunks against every earlier key chunk with the (CP1) penalty,
    merges the per-key-chunk partials by log-sum-exp (CP5), and in the backward adds its share
    of dk, dv, dfield, dlevel into full-length buffers; the buffers of all ranks are summed
    (``reduce=False`` keeps only the owner's own contributions: a wrong variant).
    """
    T = q.shape[-2]
    s = 1.0 / np.sqrt(q.shape[-1])
    ranks = layout_chunks(T, P, layout)
    chunks = sorted(c for rank in ranks for c in rank)
    o, lse = np.zeros(v.shape), np.zeros(q.shape[:-1])
    dq = np.zeros(q.shape)
    per_rank = []
    for owned in ranks:
        dk, dv, dfield, dlevel = (
            np.zeros(k.shape),
            np.zeros(v.shape),
            np.zeros(field.shape),
            np.zeros(level.shape),
        )
        for a in owned:
            qa = slice(*a)
            blocks = []
            for b in chunks:
                if b[0] > a[0]:
                    continue
                kb = slice(*b)
                if a == b:
                    m = fpa.segment_min(field[..., kb])
                    arg = fpa.segment_argmin(field[..., kb]) + b[0]
                    causal = np.tril(np.ones((b[1] - b[0],) * 2, dtype=bool))
                    below = np.tril(causal, -1)
                else:
                    m, arg = cross(field, b, a, chunks)
                    causal = below = np.ones(m.shape[-2:], dtype=bool)
                logits = s * q[..., qa, :] @ np.swapaxes(k[..., kb, :], -1, -2)
                logits = logits - np.maximum(0.0, level[..., None, kb] - m)
                logits = np.where(causal, logits, -INF)
                part_lse = logsumexp(logits, axis=-1)
                part_o = np.exp(logits - part_lse[..., None]) @ v[..., kb, :]
                blocks.append((b, m, arg, below, logits, part_lse, part_o))
            # (CP5) merge: lse = logsumexp_b lse_b, o = sum_b exp(lse_b - lse) o_b
            lse_a = logsumexp(np.stack([blk[5] for blk in blocks]), axis=0)
            o_a = sum(np.exp(blk[5] - lse_a)[..., None] * blk[6] for blk in blocks)
            o[..., qa, :], lse[..., qa] = o_a, lse_a
            delta = np.sum(d_out[..., qa, :] * o_a, axis=-1)
            for b, m, arg, below, logits, _, _ in blocks:
                kb = slice(*b)
                p = np.exp(logits - lse_a[..., None])  # the global lse: each block's share
                G = p * (d_out[..., qa, :] @ np.swapaxes(v[..., kb, :], -1, -2) - delta[..., None])
                dq[..., qa, :] += s * G @ k[..., kb, :]
                dk[..., kb, :] += s * np.swapaxes(G, -1, -2) @ q[..., qa, :]
                dv[..., kb, :] += np.swapaxes(p, -1, -2) @ d_out[..., qa, :]
                W = G * ((level[..., None, kb] >= m) & below)
                dlevel[..., kb] -= W.sum(axis=-2)
                for idx in np.ndindex(*W.shape[:-2]):  # (G3) to the argmin, on whichever rank
                    np.add.at(dfield[idx], arg[idx][W[idx] != 0], W[idx][W[idx] != 0])
        per_rank.append((owned, dk, dv, dfield, dlevel))
    grads = [np.zeros(x.shape) for x in (k, v, field, level)]
    for owned, *parts in per_rank:
        mine = np.zeros(T, dtype=bool)
        for c0, c1 in owned:
            mine[c0:c1] = True
        for total, part in zip(grads, parts, strict=True):
            keep = mine if part.ndim == field.ndim else mine[:, None]
            total += part if reduce else np.where(keep, part, 0.0)
    return o, lse, fpa.FPAGrads(dq, *grads)


def _fpa_inputs(rng: np.random.Generator, T: int, field: Array) -> tuple[Array, ...]:
    q, k = rng.standard_normal((2, 2, T, 4))
    v = rng.standard_normal((2, T, 3))
    level = field + rng.choice([0.0, 0.5, 2.0], size=field.shape)
    return q, k, v, field, level, rng.standard_normal(v.shape)


@check("CP2")
def cp2_sharded_fpa(
    *, sharded_fpa: Callable[..., tuple[Array, Array, fpa.FPAGrads]] = sharded_fpa
) -> CheckResult:
    rng = np.random.default_rng(31)
    worst = 0.0
    for T, P, layout in [(8, 2, "contiguous"), (16, 4, "contiguous"), (16, 4, "zigzag")]:
        for field in _fields(rng, (2,), T):
            q, k, v, field, level, d_out = _fpa_inputs(rng, T, field)
            o, lse, g = sharded_fpa(q, k, v, field, level, d_out, P, layout)
            ref_o, ref_lse = fpa.fpa_attention(q, k, v, field, level, return_lse=True)
            ref = fpa.fpa_attention_vjp(q, k, v, field, level, d_out)
            worst = max(worst, relative_error(o, ref_o), relative_error(lse, ref_lse))
            for got, want in zip(g, ref, strict=True):
                worst = max(worst, relative_error(got, want))
    return verdict(
        "CP2",
        "FPA on P ranks: per-key-chunk partials merged by log-sum-exp (CP5); gradients of a "
        "chunk's keys, field and levels are the sum over ranks of each rank's share (the field "
        "cotangent reaches the argmin's owner from queries on later ranks)",
        "reference fpa_attention and fpa_attention_vjp; contiguous P = 2, 4 and zigzag P = 4; "
        "ties, plateaus, the minimum on a chunk border",
        worst,
        1e-12,
    )


# (CP3) FoX: the walk entering a chunk is an exclusive scan of chunk totals of log f


def exclusive_scan(totals: Array) -> Array:
    """E_c = sum_{c' < c} totals_c' along the last axis (0 for the first chunk)."""
    return np.concatenate(
        [np.zeros((*totals.shape[:-1], 1)), np.cumsum(totals, axis=-1)[..., :-1]], axis=-1
    )


def sharded_walk(
    log_f: Array, chunks: list[tuple[int, int]], *, scan: Callable[[Array], Array] = exclusive_scan
) -> Array:
    """(CP3) c_t = E_chunk(t) + local inclusive cumsum of log f inside t's chunk."""
    local = [np.cumsum(log_f[..., c0:c1], axis=-1) for c0, c1 in chunks]
    E = scan(np.stack([x[..., -1] for x in local], axis=-1))
    return np.concatenate([E[..., n, None] + x for n, x in enumerate(local)], axis=-1)


def sharded_fox(
    q: Array,
    k: Array,
    v: Array,
    log_f: Array,
    d_out: Array,
    P: int,
    layout: str,
    *,
    scan: Callable[[Array], Array] = exclusive_scan,
) -> tuple[Array, fpa.FoXGrads]:
    """FoX on P ranks through (CP3) and (F6); the gradient of log f is the adjoint of the scan:
    a local reverse cumsum plus the exclusive reverse scan of the chunk totals of dL/dc."""
    T = q.shape[-2]
    chunks = sorted(c for rank in layout_chunks(T, P, layout) for c in rank)
    c = sharded_walk(log_f, chunks, scan=scan)
    o, _, g = sharded_fpa(q, k, v, c, c, d_out, P, layout)
    dc = g.dfield + g.dlevel
    local = [np.cumsum(dc[..., c0:c1][..., ::-1], axis=-1)[..., ::-1] for c0, c1 in chunks]
    totals = np.stack([x[..., 0] for x in local], axis=-1)
    later = scan(totals[..., ::-1])[..., ::-1]  # sum over later chunks
    dlog_f = np.concatenate([later[..., n, None] + x for n, x in enumerate(local)], axis=-1)
    return o, fpa.FoXGrads(g.dq, g.dk, g.dv, dlog_f)


@check("CP3")
def cp3_fox_scan(*, exclusive_scan: Callable[[Array], Array] = exclusive_scan) -> CheckResult:
    rng = np.random.default_rng(32)
    worst = 0.0
    for T, P, layout in [(8, 2, "contiguous"), (16, 4, "contiguous"), (16, 4, "zigzag")]:
        for unit in (0.0, 0.5):
            q, k = rng.standard_normal((2, 2, T, 4))
            v = rng.standard_normal((2, T, 3))
            log_f = -rng.exponential(0.5, size=(2, T))
            log_f[rng.random(log_f.shape) < unit] = 0.0  # gates f = 1: ties
            d_out = rng.standard_normal(v.shape)
            o, g = sharded_fox(q, k, v, log_f, d_out, P, layout, scan=exclusive_scan)
            ref = fpa.fox_attention_vjp(q, k, v, log_f, d_out)
            worst = max(worst, relative_error(o, fpa.fox_attention_direct(q, k, v, log_f)))
            for got, want in zip(g, ref, strict=True):
                worst = max(worst, relative_error(got, want))
    return verdict(
        "CP3",
        "FoX on P ranks: the walk entering a chunk is the exclusive scan of the chunk totals of "
        "log f; dlog f is a local reverse cumsum plus the exclusive reverse scan of chunk totals",
        "FoX from its own formula (fox_attention_direct, fox_attention_vjp); contiguous P = 2, 4 "
        "and zigzag P = 4; gates f = 1 included",
        worst,
        1e-12,
    )


# (CP4) S4D: the state entering a shard is an exclusive scan of (decay, local final state) pairs


def carry_scan(decays: list[Array], finals: list[Array]) -> list[Array]:
    """S_0 = 0, S_{r+1} = decays_r * S_r + finals_r: the exclusive scan of the pairs
    (a_r, X_r) under (a, x) o (a', x') = (a a', a' x + x')."""
    states = [np.zeros_like(finals[0])]
    for a, x in zip(decays[:-1], finals[:-1], strict=True):
        states.append(a * states[-1] + x)
    return states


def sharded_s4d_states(
    z: Array,
    lam: Array,
    b: Array,
    P: int,
    starts: frozenset[int] | set[int] = frozenset(),
    *,
    carry: Callable[..., list[Array]] = carry_scan,
) -> Array:
    """States (..., H, T, M, C) on P contiguous shards: each shard scans from zero, the entering
    states come from (CP4), and x_t = x^0_t + Lambda^(t - t0 + 1) S (reset at segment starts)."""
    T = z.shape[-2]
    L = T // P
    local, decays, finals = [], [], []
    for r in range(P):
        zr = z[..., r * L : (r + 1) * L, :]
        x0 = np.zeros((*zr.shape[:-2], L, lam.shape[1], zr.shape[-1]), dtype=np.complex128)
        a = np.ones((L, *lam.shape), dtype=np.complex128)  # Lambda^(t - t0 + 1), 0 after a start
        state = np.zeros(x0[..., 0, :, :].shape, dtype=np.complex128)
        run = np.ones(lam.shape, dtype=np.complex128)
        for t in range(L):
            reset = (r * L + t) in starts
            state = (0 if reset else lam[:, :, None]) * state + b[:, :, None] * zr[..., t, None, :]
            run = 0 * run if reset else run * lam
            x0[..., t, :, :], a[t] = state, run
        local.append((x0, a))
        decays.append(a[-1][:, :, None])
        finals.append(state)
    S = carry(decays, finals)
    return np.concatenate(
        [
            x0 + np.moveaxis(a, 0, 1)[..., None] * S[r][..., :, None, :, :]
            for r, (x0, a) in enumerate(local)
        ],
        axis=-3,
    )


def _segmented_states(z: Array, lam: Array, b: Array, starts: set[int]) -> Array:
    T = z.shape[-2]
    bounds = sorted({0, T} | set(starts))
    return np.concatenate(
        [idm.s4d_states(z[..., s:e, :], lam, b) for s, e in itertools.pairwise(bounds)], axis=-3
    )


@check("CP4")
def cp4_s4d_carry(*, carry_scan: Callable[..., list[Array]] = carry_scan) -> CheckResult:
    rng = np.random.default_rng(33)
    worst = 0.0
    H, M, C = 2, 3, 4
    for T, P, starts in [(8, 2, set()), (16, 4, set()), (16, 4, {4, 6, 13}), (12, 4, {3})]:
        z = rng.standard_normal((2, H, T, C))
        lam = np.exp(-rng.uniform(0.01, 0.3, (H, M)) + 1j * rng.uniform(0, 1, (H, M)))
        b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
        got = sharded_s4d_states(z, lam, b, P, starts, carry=carry_scan)
        worst = max(worst, relative_error(got, _segmented_states(z, lam, b, starts)))
    return verdict(
        "CP4",
        "S4D on P shards: the state entering shard r is the exclusive scan of the pairs "
        "(Lambda^L or 0 after a segment start, the shard's final state from zero)",
        "reference s4d_states on the whole sequence (each packed segment from zero); P = 2, 4; "
        "segment starts inside shards and on a shard border",
        worst,
        1e-12,
    )


# The figure of docs/context_parallel.md


def layout_figure(path: str, P: int = 4) -> str:
    """Draw the shard layouts (contiguous and zigzag on P ranks) as the causal attention matrix
    coloured by the rank that computes each tile, with the three pieces of (CP1) marked; write a
    PNG to ``path`` and return it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    colours = [plt.get_cmap("tab10")(i) for i in range(10)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 5.9))
    for ax, layout in zip(axes, ("contiguous", "zigzag"), strict=True):
        ranks = layout_chunks(8 * P, P, layout)
        n = sum(len(r) for r in ranks)
        owner = {chunks[0]: r for r, rank in enumerate(ranks) for chunks in [[c] for c in rank]}
        work = [0] * P
        for (a0, _), r in sorted(owner.items()):
            a = a0 * n // (8 * P)
            for b in range(a + 1):
                kind = "diag" if a == b else "cross"
                ax.add_patch(
                    Rectangle(
                        (b, n - 1 - a),
                        1,
                        1,
                        facecolor=colours[r],
                        alpha=0.85 if kind == "diag" else 0.4,
                        edgecolor="white",
                        hatch="" if kind == "diag" else "//",
                    )
                )
                work[r] += 1
        for a in range(n):
            r = next(r for (a0, _), r in owner.items() if a0 * n // (8 * P) == a)
            ax.text(-0.15, n - 0.5 - a, f"rank {r}", ha="right", va="center", fontsize=8)
        ax.set_xlim(-1.6, n)
        ax.set_ylim(0, n)
        ax.set_xticks([c + 0.5 for c in range(n)], [str(c) for c in range(n)])
        ax.set_yticks([])
        ax.set_xlabel("key chunk (all-gathered)")
        ax.set_aspect("equal")
        ax.set_title(f"{layout}: {n} chunks on {P} ranks; tiles per rank {work}", fontsize=10)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
    # (CP1) on the contiguous layout: queries of chunk P-1, keys of chunk 0
    ax = axes[0]
    ax.annotate(
        "m_ij = min(A_j, mid, B_i)\nA: suffix min of key chunk 0 after j\n"
        "mid: minima of chunks 1..P-2\nB: prefix min of query chunk up to i",
        xy=(0.5, 0.5),
        xytext=(1.2, P - 0.9),
        fontsize=8,
        arrowprops={"arrowstyle": "->"},
    )
    fig.suptitle(
        "Query chunks (rows) per rank; solid: diagonal tile by the single-device kernel, "
        "hatched: cross-chunk tiles (CP1), merged by log-sum-exp (CP5)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
