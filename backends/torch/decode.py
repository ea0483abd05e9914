"""Decoding token by token: the FPA KV cache with eviction (F7) and the Interdomain states (H6).

:class:`FPADecodeCache` keeps, per (batch, query head), the entries (k_j, v_j, l_j, m_j) of
spec/fpa.md F7 with m_j the running minimum of the field since j; a key whose depth
pi_j = max(0, l_j - m_j) reaches theta is evicted and, by (T2), never needed again. Evicted
entries are really freed: the cache tensors are compacted to the largest live count over the
rows. :class:`S4DDecodeState` and :class:`LegSDecodeState` hold the Interdomain recurrent
state, whose size does not depend on T.

Layout per step: q [B, HQ, K], k [B, H, K], v [B, H, V] (GQA: HQ a multiple of H), per-token
scalars [B, HQ]; prefills take the sequence layout [B, T, ...] of the parallel ops.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from attnspec.reference import hippo

from ..tile_sizes import EAGER_QUERY_BLOCK
from . import checks
from .eager_fpa import FPAPenalty, Tile, attend, compute_dtype, from_rows, to_rows
from .ops import interdomain_s4d

_INF = float("inf")


def _theta(theta: float) -> float:
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ValueError(f"theta: expected a positive number (or inf), got {theta!r}")
    return float(theta)


@dataclass
class CacheEntries:
    """The entries (k_j, v_j, l_j, m_j) of F7, one row per (batch, query head), S slots a row;
    rows hold different numbers of live keys, so ``live`` marks the slots in use."""

    keys: Tensor  # [N, S, K] in the dtype of k
    values: Tensor  # [N, S, V]
    levels: Tensor  # [N, S] l_j, float32 or wider
    mins: Tensor  # [N, S] m_j, the running minimum of the field since j
    live: Tensor  # [N, S] bool

    def depth(self) -> Tensor:
        return torch.clamp_min(self.levels - self.mins, 0.0)  # (F2)

    def append(self, new: CacheEntries) -> CacheEntries:
        return CacheEntries(
            *(torch.cat([a, b], dim=1) for a, b in zip(astuple(self), astuple(new), strict=True))
        )

    def compact(self) -> CacheEntries:
        """Evicted entries dropped: live ones move to the front (in order), the slots shrink to
        the largest live count."""
        keep = int(self.live.sum(dim=1).max())
        if keep == self.keys.shape[1]:
            return self
        order = torch.argsort((~self.live).to(torch.int8), dim=1, stable=True)[:, :keep]
        return CacheEntries(
            torch.gather(self.keys, 1, order[..., None].expand(-1, -1, self.keys.shape[2])),
            torch.gather(self.values, 1, order[..., None].expand(-1, -1, self.values.shape[2])),
            *(torch.gather(x, 1, order) for x in (self.levels, self.mins, self.live)),
        )


class FPADecodeCache:
    """(F7) streaming FPA with eviction threshold ``theta`` (inf: no eviction, outputs equal the
    parallel op). One cache row per (batch, query head); k and v are stored per query head.

    Attributes:
        steps: tokens consumed.
        kept_fraction: the peak live-cache size over the tokens seen, averaged over the rows
            (1.0 without eviction), as the reference's ``fpa_decode`` reports it.
        cache_size: [B, HQ] live entries now.
        capacity: entries allocated per row now (the largest live count: evicted keys freed).

    Time per step O(S (K + V)) for S live entries; memory O(B HQ S_max (K + V)).
    """

    def __init__(self, *, theta: float = _INF, scale: float | None = None):
        self.theta = _theta(theta)
        self.scale = scale
        self.steps = 0
        self.entries: CacheEntries | None = None
        self.peak: Tensor | None = None  # [N] largest live count seen per row
        self.dims: tuple[int, int, int, int, int, torch.dtype, torch.device] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.entries is None else self.entries.keys.shape[1]

    @property
    def cache_size(self) -> Tensor:
        if self.entries is None or self.dims is None:
            return torch.zeros(0, dtype=torch.long)
        return self.entries.live.sum(dim=1).reshape(self.dims[:2])

    @property
    def kept_fraction(self) -> float:
        if self.peak is None:
            return 0.0
        return float(self.peak.to(torch.float64).mean()) / max(self.steps, 1)

    def _check_step(
        self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor
    ) -> tuple[int, int, int, int, int, torch.dtype, torch.device]:
        for name, x, ndim in (("q", q, 3), ("k", k, 3), ("v", v, 3)):
            checks.tensor(name, x, ndim, checks.QKV_DTYPES, "[B, heads, dim]")
        checks.same_dtype(("q", "k", "v"), (q, k, v))
        B, HQ, K = q.shape
        H, V = k.shape[1], v.shape[2]
        if H < 1 or HQ % H:
            raise ValueError(f"k: expected heads dividing the {HQ} of q, got {tuple(k.shape)}")
        checks.shape("k", k, (B, H, K), "[B, H, K]: B and K of q")
        checks.shape("v", v, (B, H, V), "[B, H, V]: B of q, H of k")
        for name, x in (("field", field), ("level", level)):
            # half precision is widened below, as by the parallel ops
            checks.tensor(name, x, 2, checks.QKV_DTYPES, "[B, HQ]")
            checks.shape(name, x, (B, HQ), "[B, HQ]: B and the query heads of q")
        checks.same_device(("q", "k", "v", "field", "level"), (q, k, v, field, level))
        dims = (B, HQ, H, K, V, q.dtype, q.device)
        if self.dims is not None and dims != self.dims:
            raise ValueError(
                f"q, k, v: expected the (B, HQ, H, K, V, dtype, device) of the first step "
                f"{self.dims}, got {dims}"
            )
        checks.finite("field", field)
        checks.finite("level", level)
        return dims

    def step(self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor) -> Tensor:
        """Consume one token: q [B, HQ, K], k [B, H, K], v [B, H, V], field, level [B, HQ].

        Returns:
            o [B, HQ, V] in q's dtype.
        """
        self.dims = B, HQ, H, K, V, _, _ = self._check_step(q, k, v, field, level)
        wide = compute_dtype(q, field)
        phi = field.reshape(-1, 1).to(wide)  # [N, 1]
        groups = HQ // H
        new = CacheEntries(
            k.repeat_interleave(groups, dim=1).reshape(-1, 1, K),
            v.repeat_interleave(groups, dim=1).reshape(-1, 1, V),
            level.reshape(-1, 1).to(wide),
            torch.full_like(phi, _INF),  # empty segment: pi_tt = 0
            torch.ones_like(phi, dtype=torch.bool),
        )
        entries = self.entries
        if entries is not None:
            entries.mins = torch.minimum(entries.mins, phi)  # (F7) m_j <- min(m_j, phi_t)
            if math.isfinite(self.theta):
                entries.live = entries.live & ~(entries.depth() >= self.theta)  # (T2): for good
                entries = entries.compact()
            new = entries.append(new)
        self.entries = new
        self.steps += 1
        count = new.live.sum(dim=1)
        self.peak = count if self.peak is None else torch.maximum(self.peak, count)
        return self._attend(q, new, wide).reshape(B, HQ, V).to(q.dtype)

    def _attend(self, q: Tensor, entries: CacheEntries, wide: torch.dtype) -> Tensor:
        scale = checks.scale(self.scale, q.shape[2])
        content = torch.einsum(
            "nk,nsk->ns", q.reshape(-1, q.shape[2]).to(wide), entries.keys.to(wide)
        )
        logits = (scale * content - entries.depth()).masked_fill(~entries.live, -_INF)  # (F3)
        p = torch.softmax(logits, dim=1)  # (F4)
        return torch.einsum("ns,nsv->nv", p, entries.values.to(wide))  # (F5)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor) -> Tensor:
        """Consume a whole prompt at once into an empty cache; equals T calls of :meth:`step`.

        By (T2) key j is in the cache at step i iff pi_ij < theta, so the outputs are the
        parallel op with keys at depth >= theta masked, computed by the tiles of
        :mod:`.eager_fpa`; the peak live count is counted on the same tiles.

        Args:
            q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; field, level: [B, T, HQ].

        Returns:
            o [B, T, HQ, V] in q's dtype. Time O(T^2 (K + V)), memory O(T * block).
        """
        if self.steps:
            raise ValueError(f"prefill: expected an empty cache, it has seen {self.steps} tokens")
        dims = checks.attention_inputs(q, k, v)
        field = checks.per_token("field", field, q)
        level = checks.per_token("level", level, q)
        checks.finite("field", field)
        checks.finite("level", level)
        B, T, HQ, H, K, V = dims
        groups = HQ // H
        wide = compute_dtype(q, field)
        fs, ls = to_rows(field, wide), to_rows(level, wide)
        evicting = EvictingPenalty(fs, ls, self.theta)
        o, _ = attend(
            to_rows(q, wide),
            to_rows(k, wide, groups),
            to_rows(v, wide, groups),
            checks.scale(self.scale, K),
            evicting,
            EAGER_QUERY_BLOCK,
        )
        # the cache after the last token: m_j = min field over (j, T), kept if depth < theta
        after = torch.cat([fs[:, 1:], torch.full_like(fs[:, :1], _INF)], dim=1)
        mins = torch.cummin(after.flip(1), dim=1).values.flip(1)
        live = torch.clamp_min(ls - mins, 0.0) < self.theta
        keys, values = to_rows(k, k.dtype, groups), to_rows(v, v.dtype, groups)
        self.entries = CacheEntries(keys, values, ls, mins, live).compact()
        self.dims = (B, HQ, H, K, V, q.dtype, q.device)
        self.steps, self.peak = T, evicting.counts.max(dim=1).values
        return from_rows(o, B, q.dtype)


class EvictingPenalty:
    """The tiles of :class:`.eager_fpa.FPAPenalty` with every key at depth >= theta masked, and
    ``counts`` [N, T]: the keys live at each query (j <= i, pi_ij < theta)."""

    def __init__(self, field: Tensor, level: Tensor, theta: float):
        self.penalty, self.theta = FPAPenalty(field, level, None), theta
        self.counts = torch.zeros(field.shape, dtype=torch.long, device=field.device)

    def tiles(self, i0: int, i1: int) -> Iterator[Tile]:
        for tile in self.penalty.tiles(i0, i1):
            live = tile.penalty < self.theta  # +inf above the diagonal: never live
            self.counts[:, i0:i1] += live.sum(dim=2)
            yield Tile(tile.j0, tile.j1, tile.penalty.masked_fill(~live, _INF), tile.backward)


class S4DDecodeState:
    """(I11)-(I13) one token at a time; the state x [B, H, M, C] (C = R + V, + 1 for "ratio")
    has a size independent of T. Step cost O(M (R + V + M)) per batch-head, through
    W = C^H C as in the chunked kernel.

    Args:
        lam, b: [H, M] complex; c: [H, M, M] complex; readout: "linear" or "ratio".
        state: an initial state [B, H, M, C] complex (e.g. the final state of a prefill).
    """

    def __init__(
        self,
        lam: Tensor,
        b: Tensor,
        c: Tensor,
        *,
        readout: str = "linear",
        state: Tensor | None = None,
    ):
        checks.readout(readout)
        for name, x, ndim in (("lam", lam, 2), ("b", b, 2), ("c", c, 3)):
            checks.tensor(name, x, ndim, checks.COMPLEX_DTYPES, "complex")
        H, M = lam.shape
        checks.shape("b", b, (H, M), "[H, M], as lam")
        checks.shape("c", c, (H, M, M), "[H, M, M], M of lam")
        self.lam, self.b, self.readout = lam, b, readout
        self.W = c.transpose(-1, -2).conj_physical() @ c  # C^H C
        self.c = c
        self.state = state

    @property
    def state_size(self) -> int:
        """Real numbers held per (batch, head): 2 M C; 0 before the first token."""
        return 0 if self.state is None else 2 * self.state.shape[2] * self.state.shape[3]

    def step(self, fq: Tensor, kt: Tensor, vt: Tensor) -> Tensor:
        """Consume one token: fq, kt [B, H, R], vt [B, H, V]. Returns o [B, H, V] in fq's dtype."""
        for name, x in (("fq", fq), ("kt", kt), ("vt", vt)):
            checks.tensor(name, x, 3, checks.QKV_DTYPES, "[B, H, dim]")
        B, H, R = fq.shape
        checks.shape("fq", fq, (B, self.lam.shape[0], R), "[B, H, R]: H of lam")
        checks.shape("kt", kt, (B, H, R), "[B, H, R], as fq")
        if vt.shape[:2] != (B, H):
            raise ValueError(f"vt: expected shape ({B}, {H}, V), got {tuple(vt.shape)}")
        real = self.lam.real.dtype
        parts = [kt.to(real), vt.to(real)]
        if self.readout == "ratio":
            parts.append(torch.ones_like(parts[1][..., :1]))
        z = torch.cat(parts, dim=2).to(self.lam.dtype)  # [B, H, C]
        if self.state is None:
            self.state = torch.zeros(
                B, H, self.lam.shape[1], z.shape[2], dtype=z.dtype, device=z.device
            )
        elif self.state.shape != (B, H, self.lam.shape[1], z.shape[2]):
            raise ValueError(
                f"fq, kt, vt: expected the state's (B, H, C) {tuple(self.state.shape)}, got "
                f"{(B, H, z.shape[2])}"
            )
        self.state = self.lam[..., None] * self.state + self.b[..., None] * z[:, :, None]  # (I11)
        alpha = torch.einsum("bhmr,bhr->bhm", self.state[..., :R], fq.to(self.lam.dtype))
        beta = torch.einsum("hmk,bhk->bhm", self.W, alpha)  # C^H C alpha: (I12) folded in
        o = torch.einsum("bhm,bhmv->bhv", beta.conj_physical(), self.state[..., R:]).real  # (I13)
        if self.readout == "ratio":
            o = o[..., :-1] / o[..., -1:]
        return o.to(fq.dtype)

    def prefill(self, fq: Tensor, kt: Tensor, vt: Tensor, impl: str | None = None) -> Tensor:
        """Consume [B, T, H, .] at once with the chunked op, continuing from the state."""
        o, self.state = interdomain_s4d(
            fq,
            kt,
            vt,
            self.lam,
            self.b,
            self.c,
            readout=self.readout,
            initial_state=self.state,
            output_final_state=True,
            impl=impl,
        )
        return o


class LegSDecodeState:
    """(I5) and the ratio readout (I3) one token at a time; the coefficients c [B, H, M, R + V]
    have a size independent of T. Step cost O(M^2 (R + V)) per batch-head."""

    def __init__(self, M: int):
        if isinstance(M, bool) or not isinstance(M, int) or M < 1:
            raise ValueError(f"M: expected an integer >= 1, got {M!r}")
        self.M, self.n = M, 0
        self.coefficients: Tensor | None = None  # [B, H, M, R + V]

    def step(self, fq: Tensor, fk: Tensor, v: Tensor) -> Tensor:
        """Consume token n: fq, fk [B, H, R], v [B, H, V]. Returns o [B, H, V] in fq's dtype."""
        for name, x in (("fq", fq), ("fk", fk), ("v", v)):
            checks.tensor(name, x, 3, checks.QKV_DTYPES, "[B, H, dim]")
        checks.shape("fk", fk, tuple(fq.shape), "as fq")
        if v.shape[:2] != fq.shape[:2]:
            raise ValueError(
                f"v: expected shape {tuple(fq.shape[:2])} + (V,), got {tuple(v.shape)}"
            )
        dtype = torch.promote_types(fq.dtype, torch.float32)
        f = torch.cat([fk, v], dim=2).to(dtype)  # [B, H, R + V]
        self.n += 1
        E, F = (torch.from_numpy(x).to(f.device, dtype) for x in hippo.legs_step(self.n, self.M))
        c = self.coefficients
        if c is None:
            c = f.new_zeros(*f.shape[:2], self.M, f.shape[2])
        c = self.coefficients = E @ c + F[:, None] * f[:, :, None]  # (I5)
        R = fq.shape[2]
        a = torch.einsum("bhmr,bhr->bhm", c[..., :R], fq.to(dtype))
        num = torch.einsum("bhm,bhmv->bhv", a, c[..., R:])
        return (num / a[..., :1]).to(fq.dtype)  # (I3), eta = e_0 (I6)
