"""The wrong FoX backends people really write: the suspects the kit names a FoX failure after.

FoX (spec/fpa.md (F6)) weighs key j for query i by ``exp(s q_i.k_j + c_i - c_j)`` under a
causal softmax, with ``c = cumsum(log f)``. Each variant below is the numpy adapter with one
of the errors found in public FoX implementations:

- :class:`GateAtOwnKey`: the decay counted from key j's own gate, ``c_i - c_{j-1}``;
- :class:`NoCausalMaskInChunk`: a chunked kernel (chunks of 64 tokens) that applies no causal
  mask inside the diagonal chunk, so a query sees the later keys of its chunk;
- :class:`GateMultipliesScores`: the decay multiplies the scores,
  ``s q_i.k_j exp(c_i - c_j)``, instead of adding its log;
- :class:`GatedLinearAttention`: no softmax at all, ``o_i = sum_j exp(c_i - c_j) s q_i.k_j v_j``.

They claim ``fox_attention`` only (gradients are the reference's, as for the other mutants).
:mod:`.naming` runs them, with the kit's shipped mutants, on a failing case to say which bug a
backend's values match. Select one with
``attnspec conformance --backend attnspec.conformance.fox_variants:GateAtOwnKey``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import logsumexp

from attnspec.reference.packing import packing

from .mutants import BLOCK, Mutant
from .numpy_backend import FloatArray

F = NDArray[np.float64]


def _visible(T: int, window: int | None) -> NDArray[np.bool_]:
    """Key j visible to query i: j <= i, and i - j < W under a window (F3w)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    return (j <= i) & (True if window is None else i - j < window)


class FoxVariant(Mutant):
    """The numpy adapter with one wrong ``fox_attention``: :meth:`weights` of (logits, c)."""

    ops: ClassVar[tuple[str, ...]] = ("fox_attention",)
    OPS: ClassVar[tuple[str, ...]] = ("fox_attention",)
    FEATURES: ClassVar[tuple[str, ...]] = (
        "fox_attention.varlen",
        "fox_attention.gqa",
        "fox_attention.window",
    )

    def attend(
        self,
        scores: NDArray[np.float64],
        c: NDArray[np.float64],
        log_f: NDArray[np.float64],
        v: NDArray[np.float64],
        visible: NDArray[np.bool_],
    ) -> NDArray[np.float64]:
        """o (..., T, dv) from the scores s q.k (..., T, T), c = cumsum(log f) (..., T)."""
        raise NotImplementedError

    def fox_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        present: ArrayLike | None = None,
    ) -> FloatArray:
        if present is not None:
            raise NotImplementedError("present: the FoX variants declare no padding")
        q64, k64, v64, g = (np.asarray(x, dtype=np.float64) for x in (q, k, v, log_f))
        group = q64.shape[-3] // k64.shape[-3]  # GQA: each key/value head serves a group
        k64, v64 = np.repeat(k64, group, axis=-3), np.repeat(v64, group, axis=-3)
        s = 1 / np.sqrt(q64.shape[-1]) if scale is None else scale
        T = q64.shape[-2]
        plan = packing(cu_seqlens, T, batch=q64.shape[0]) if cu_seqlens is not None else None
        bounds = [(0, T)] if plan is None else plan.bounds
        parts = []
        for bos, eos in bounds:  # each packed sequence on its own
            part = slice(bos, eos)
            scores = s * q64[..., part, :] @ np.swapaxes(k64[..., part, :], -1, -2)  # (B,H,n,n)
            c = np.cumsum(g[..., part], axis=-1)  # (B, H, n)
            visible = _visible(eos - bos, window)
            parts.append(self.attend(scores, c, g[..., part], v64[..., part, :], visible))
        return np.concatenate(parts, axis=-2).astype(q.dtype)


def _softmax_attend(
    logits: NDArray[np.float64], v: NDArray[np.float64], visible: NDArray[np.bool_]
) -> NDArray[np.float64]:
    a = np.where(visible, logits, -np.inf)
    return np.exp(a - logsumexp(a, axis=-1, keepdims=True)) @ v


def _decay(c: NDArray[np.float64]) -> NDArray[np.float64]:
    """c_i - c_j (..., T, T)."""
    return c[..., :, None] - c[..., None, :]


class GateAtOwnKey(FoxVariant):
    """The gate counted at its own key: decay c_i - c_{j-1} = c_i - c_j + log f_j."""

    def attend(self, scores: F, c: F, log_f: F, v: F, visible: NDArray[np.bool_]) -> F:
        return _softmax_attend(scores + _decay(c) + log_f[..., None, :], v, visible)


class NoCausalMaskInChunk(FoxVariant):
    """No causal mask inside a chunk of 64 tokens: a query sees the later keys of its chunk."""

    def attend(self, scores: F, c: F, log_f: F, v: F, visible: NDArray[np.bool_]) -> F:
        T = scores.shape[-1]
        chunk = np.arange(T) // BLOCK
        seen = visible | (chunk[:, None] == chunk[None, :])
        return _softmax_attend(scores + _decay(c), v, seen)


class GateMultipliesScores(FoxVariant):
    """The decay multiplies the scores: s q_i.k_j exp(c_i - c_j), under the softmax."""

    def attend(self, scores: F, c: F, log_f: F, v: F, visible: NDArray[np.bool_]) -> F:
        with np.errstate(over="ignore"):  # exp of the decay above the diagonal, masked
            return _softmax_attend(scores * np.exp(np.where(visible, _decay(c), 0.0)), v, visible)


class GatedLinearAttention(FoxVariant):
    """Gated linear attention: o_i = sum_j exp(c_i - c_j) s q_i.k_j v_j, no softmax."""

    def attend(self, scores: F, c: F, log_f: F, v: F, visible: NDArray[np.bool_]) -> F:
        weights = np.where(visible, scores * np.exp(np.where(visible, _decay(c), 0.0)), 0.0)
        return weights @ v


FOX_VARIANTS: dict[str, type[FoxVariant]] = {
    cls.__name__: cls
    for cls in [GateAtOwnKey, NoCausalMaskInChunk, GateMultipliesScores, GatedLinearAttention]
}
for _name, _cls in FOX_VARIANTS.items():
    _cls.name = f"mutant-{_name}"
