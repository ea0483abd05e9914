"""Decoding token by token: the FPA KV cache with eviction (F7) and the Interdomain states (H6).

:class:`FPADecodeCache` is the single-stream face of the paged session of :mod:`.paged`: its
state, the entries (k_j, v_j, l_j, m_j) of spec/fpa.md F7 with m_j the running minimum of the
field since j, lives in a :class:`.paged.PagedFPASession`; a key whose depth
pi_j = max(0, l_j - m_j) reaches theta is evicted and, by (T2), never needed again, and its
slot is freed once no query head of its kv head attends it. :class:`S4DDecodeState` and
:class:`LegSDecodeState` hold the Interdomain recurrent state, whose size does not depend on T.

Layout per step: q [B, HQ, K], k [B, H, K], v [B, H, V] (GQA: HQ a multiple of H), per-token
scalars [B, HQ]; prefills take the sequence layout [B, T, ...] of the parallel ops.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from attnspec.reference import hippo
from attnspec.reference.validation import positive_int, threshold

from ..tile_sizes import EAGER_QUERY_BLOCK
from . import checks
from .eager_fpa import FPAPenalty, Tile, attend, compute_dtype, from_rows, to_rows
from .ops import interdomain_s4d
from .paged import PagedFPASession

_INF = float("inf")


def _theta(theta: float) -> float:
    return threshold("theta", theta)


class FPADecodeCache:
    """(F7) streaming FPA with eviction threshold ``theta`` (inf: no eviction, outputs equal the
    parallel op): a one-token-per-step view of a :class:`.paged.PagedFPASession` with one row
    per batch row, k and v stored once per kv head (the union rule of F8 gqa), no rollback.

    Attributes:
        steps: tokens consumed.
        peak: [B * HQ] the largest live count seen per (batch, query head), row-major.
        kept_fraction: the peak live-cache size over the tokens seen, averaged over the rows
            (1.0 without eviction), as the reference's ``fpa_decode`` reports it.
        cache_size: [B, HQ] live entries now.
        capacity: the largest number of entries stored for a (batch, kv head) now, the union
            of its query heads' live keys (the largest live count without GQA).
        session: the session holding the state (None before the first token).

    Time per step O(S (K + V)) for S stored entries; memory O(B H S_max (K + V)), in pages.
    """

    def __init__(self, *, theta: float = _INF, scale: float | None = None):
        self.theta = _theta(theta)
        self.scale = scale
        self.steps = 0
        self.session: PagedFPASession | None = None
        self.peak: Tensor | None = None  # [N] largest live count seen per row
        self.dims: tuple[int, int, int, int, int, torch.dtype, torch.device] | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.session is None else int(self.session.counts()["stored"].max())

    @property
    def cache_size(self) -> Tensor:
        if self.session is None:
            return torch.zeros(0, dtype=torch.long)
        return self.session.counts()["live"]

    @property
    def kept_fraction(self) -> float:
        if self.peak is None:
            return 0.0
        return float(self.peak.to(torch.float64).mean()) / max(self.steps, 1)

    def _open(self, dims: tuple[int, int, int, int, int, torch.dtype, torch.device]) -> None:
        B, HQ, H, K, V, dtype, device = self.dims = dims
        self.session = PagedFPASession(
            rows=B, heads=HQ, kv_heads=H, dk=K, dv=V, dtype=dtype, device=device,
            scale=checks.scale(self.scale, K), theta=self.theta,
        )  # fmt: skip

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
        if checks.values_checked():
            checks.finite("field", field)
            checks.finite("level", level)
        return dims

    def step(self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor) -> Tensor:
        """Consume one token: q [B, HQ, K], k [B, H, K], v [B, H, V], field, level [B, HQ].

        Returns:
            o [B, HQ, V] in q's dtype.
        """
        dims = self._check_step(q, k, v, field, level)
        if self.session is None:
            self._open(dims)
        assert self.session is not None
        wide = compute_dtype(q, field)  # half precision widened, as by the parallel ops
        inputs = {"q": q, "k": k, "v": v, "field": field.to(wide), "level": level.to(wide)}
        present = torch.ones(dims[0], 1, dtype=torch.bool, device=q.device)
        o = self.session.advance({n: x[:, :, None] for n, x in inputs.items()}, present)["o"]
        self._count(self.session.counts()["live"].flatten())
        return o[:, :, 0]

    def _count(self, live: Tensor, tokens: int = 1) -> None:
        self.steps += tokens
        self.peak = live if self.peak is None else torch.maximum(self.peak, live)

    def prefill(self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor) -> Tensor:
        """Consume a whole prompt at once into an empty cache; equals T calls of :meth:`step`.

        By (T2) key j is in the cache at step i iff pi_ij < theta, so the outputs are the
        parallel op with keys at depth >= theta masked, computed by the tiles of
        :mod:`.eager_fpa`, and the peak live count is counted on the same tiles; the session
        takes the prompt's state by :meth:`.PagedFPASession.prefill_state`.

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
        if checks.values_checked():
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
        self._open((B, HQ, H, K, V, q.dtype, q.device))
        assert self.session is not None
        heads_second = {"k": k, "v": v, "field": field.to(wide), "level": level.to(wide)}
        self.session.prefill_state({n: x.transpose(1, 2) for n, x in heads_second.items()})
        self._count(evicting.counts.max(dim=1).values, T)
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
        self.M, self.n = positive_int("M", M), 0
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
