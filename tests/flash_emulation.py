"""A correct low-precision FPA backend that rounds where a FlashAttention-style kernel rounds.

Inputs in the tested dtype (bfloat16 stored as rounded float32), logits, penalties, the softmax
statistics and every accumulation in float32; the probabilities P and the logit cotangents dS
are rounded to the input dtype before their matmuls, as tensor-core kernels do; outputs and
gradients rounded to the dtype of their inputs. The kit must pass it: it is the witness that the
row factor and the gradient floors of the kit are not tighter than correct kernels need.
"""

from __future__ import annotations

import numpy as np

from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.tolerances import round_to
from attnspec.reference import fpa


class FlashEmulation(NumpyBackend):
    """One instance per tested dtype ``low`` (float32, float16 or bfloat16)."""

    name = "flash-emulation"

    def __init__(self, low: str):
        super().__init__()
        self.low = low
        self.dtypes = (low,)

    def capabilities(self):
        return {"fpa_attention", "fpa_attention.vjp", "fox_attention", "fox_attention.vjp"}

    def asarray(self, x, dtype):
        if dtype == "bfloat16":
            return round_to(x, "bfloat16").astype(np.float32)  # NumPy has no bfloat16
        return np.asarray(x, dtype=dtype)

    def _round(self, x):
        return round_to(x, self.low).astype(np.float32)

    def _forward(self, q, k, v, field, level, scale):
        f32 = np.float32
        q, k, v = (np.asarray(x, f32) for x in (q, k, v))
        s = f32(1 / np.sqrt(q.shape[-1]) if scale is None else scale)
        m = fpa.segment_min(np.asarray(field, f32)).astype(f32)
        pi = np.maximum(f32(0), np.asarray(level, f32)[..., None, :] - m)
        T = q.shape[-2]
        a = np.where(np.tril(np.ones((T, T), bool)), s * (q @ np.swapaxes(k, -1, -2)) - pi, -np.inf)
        row_max = a.max(axis=-1, keepdims=True)
        p = np.exp(a - row_max).astype(f32)
        total = p.sum(axis=-1, keepdims=True, dtype=f32)
        o = (self._round(p) @ v) / total
        lse = (row_max + np.log(total))[..., 0]
        return o, lse, p / total, m, s

    def fpa_attention(self, q, k, v, field, level, *, scale=None, return_lse=False):
        o, lse, *_ = self._forward(q, k, v, field, level, scale)
        o = o.astype(q.dtype) if q.dtype != np.float32 else self._round(o)
        return (o, lse) if return_lse else o

    def fox_attention(self, q, k, v, log_f, *, scale=None):
        c = np.cumsum(np.asarray(log_f, np.float64), axis=-1).astype(np.float32)
        return self.fpa_attention(q, k, v, c, c, scale=scale)

    def vjp(self, op, inputs, params, cotangents):
        f32 = np.float32
        x = dict(inputs)
        if op == "fox_attention":
            c = np.cumsum(np.asarray(x.pop("log_f"), np.float64), axis=-1).astype(f32)
            x["field"] = x["level"] = c
        q, k, v = (np.asarray(x[n], f32) for n in ("q", "k", "v"))
        o, _, p, m, s = self._forward(q, k, v, x["field"], x["level"], params.get("scale"))
        do = np.asarray(cotangents["o"], f32)
        delta = (do * o).sum(axis=-1, keepdims=True)
        dS = p * (do @ np.swapaxes(v, -1, -2) - delta)
        if "lse" in cotangents:
            dS = dS + p * np.asarray(cotangents["lse"], f32)[..., None]  # (G4)
        dS_low = self._round(dS)
        grads = {
            "q": s * dS_low @ k,
            "k": s * np.swapaxes(dS_low, -1, -2) @ q,
            "v": np.swapaxes(self._round(p), -1, -2) @ do,
        }
        T = q.shape[-2]
        level = np.asarray(x["level"], f32)
        active = (level[..., None, :] >= m) & np.tril(np.ones((T, T), bool), k=-1)
        W = np.where(active, dS, f32(0))
        dlevel = -W.sum(axis=-2)  # (G2)
        tstar = fpa.segment_argmin(np.asarray(x["field"], np.float64))  # (G3), latest argmin
        n_seq = W[..., 0, 0].size
        rows = np.broadcast_to(np.arange(n_seq).reshape(*W.shape[:-2], 1, 1), W.shape)
        flat = np.zeros((n_seq, T), f32)
        np.add.at(flat, (rows[active], tstar[active]), W[active])
        dfield = flat.reshape(W.shape[:-1])
        if op == "fox_attention":
            # c = cumsum(log_f): dlog_f_t = sum_{u >= t} (dfield_u + dlevel_u)
            dc = (dfield + dlevel).astype(np.float64)
            grads["log_f"] = np.flip(np.cumsum(np.flip(dc, -1), axis=-1), -1).astype(f32)
        else:
            grads["field"], grads["level"] = dfield, dlevel
        out = {}
        for name, g in grads.items():
            target = inputs[name].dtype
            out[name] = g.astype(target) if target != np.float32 else g
        for name in ("q", "k", "v"):
            out[name] = self._round(out[name]).astype(inputs[name].dtype)
        return out
