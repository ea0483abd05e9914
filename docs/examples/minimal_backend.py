"""A complete minimal backend: FoX attention in plain NumPy, float32 and float64.

Run the kit on it:

    attnspec conformance --backend docs/examples/minimal_backend.py:MinimalFoX

Only ``fox_attention`` and its gradient are implemented; every other op is reported as
"not implemented". The computation is written from the FoX formula directly, in the dtype of the
inputs, without calling attnspec.
"""

import numpy as np


class MinimalFoX:
    name = "minimal-fox"
    dtypes = ("float64", "float32")

    def __init__(self, device="cpu"):
        self.device = device

    def capabilities(self):
        return {"fox_attention", "fox_attention.vjp"}

    # The adapter: the only place arrays cross between NumPy and this backend.
    def asarray(self, x, dtype):
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def _forward(self, q, k, v, log_f, scale):
        T = q.shape[-2]
        s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
        c = np.cumsum(log_f, axis=-1)
        decay = c[..., :, None] - c[..., None, :]  # D_ij = sum_{l=j+1..i} log f_l
        logits = s * q @ np.swapaxes(k, -1, -2) + decay
        logits = np.where(np.tril(np.ones((T, T), dtype=bool)), logits, -np.inf)
        p = np.exp(logits - logits.max(axis=-1, keepdims=True))
        p = p / p.sum(axis=-1, keepdims=True)
        return p, p @ v, s

    def fox_attention(self, q, k, v, log_f, *, scale=None):
        return self._forward(q, k, v, log_f, scale)[1].astype(q.dtype)

    def vjp(self, op, inputs, params, cotangents):
        if op != "fox_attention":
            raise NotImplementedError(op)
        q, k, v, log_f = (inputs[n] for n in ("q", "k", "v", "log_f"))
        d_out = cotangents["o"]
        p, o, s = self._forward(q, k, v, log_f, params.get("scale"))
        G = p * (d_out @ np.swapaxes(v, -1, -2) - np.sum(d_out * o, -1)[..., None])
        # dD_ij / dlog f_l = [j < l <= i]: column sums of G minus row sums, accumulated.
        dc = G.sum(axis=-1) - G.sum(axis=-2)
        dlog_f = np.cumsum(dc[..., ::-1], axis=-1)[..., ::-1]
        grads = {
            "q": s * G @ k,
            "k": s * np.swapaxes(G, -1, -2) @ q,
            "v": np.swapaxes(p, -1, -2) @ d_out,
            "log_f": dlog_f,
        }
        # Each gradient in the dtype of its input (NumPy scalars may have widened them).
        return {n: g.astype(inputs[n].dtype) for n, g in grads.items()}
