"""A complete minimal session backend: FPA decode sessions in plain NumPy, float64 and float32.

Run the kit's session families on it:

    attnspec conformance --backend docs/examples/minimal_session.py:MinimalSession \\
        --ops fpa_decode --cases decode/session_

Each row keeps its cache as arrays over every token it has seen, with the step at which each
entry was evicted for each query head (-1 while live), and the states before its last W tokens
for rollback. Written from the spec's (F7), (F8), (F9) and (F3w) directly, without attnspec.
"""

import numpy as np


class Row:
    def __init__(self, cache=None, tokens=0, past=()):
        self.cache, self.tokens, self.past = cache, tokens, list(past)

    def copy(self):
        return Row(self.cache, self.tokens, self.past)  # caches are never modified in place


class FPADecodeSession:
    def __init__(self, rows, heads, kv_heads, dk, dv, scale, theta, window, max_rollback):
        self.rows = [Row() for _ in range(rows)]
        self.HQ, self.H, self.dk, self.dv = heads, kv_heads, dk, dv
        self.scale, self.theta, self.window, self.W = scale, theta, window, max_rollback

    def _step(self, cache, q, k, v, phi, level, t):
        if cache is None:
            cache = {
                "k": np.zeros((0, self.H, self.dk)),
                "v": np.zeros((0, self.H, self.dv)),
                "level": np.zeros((0, self.HQ)),
                "min": np.zeros((0, self.HQ)),
                "evicted": np.zeros((0, self.HQ), dtype=int),
            }
        live = cache["evicted"] < 0
        mins = np.where(live, np.minimum(cache["min"], phi), cache["min"])  # m_j <- min(m_j, phi_t)
        depth = np.maximum(0.0, cache["level"] - mins)
        old = t - np.arange(len(mins))[:, None] >= (self.window or np.inf)
        evicted = np.where(live & ((depth >= self.theta) | old), t, cache["evicted"])
        cache = {
            "k": np.concatenate([cache["k"], k[None]]),
            "v": np.concatenate([cache["v"], v[None]]),
            "level": np.concatenate([cache["level"], level[None]]),
            "min": np.concatenate([mins, np.full((1, self.HQ), np.inf)]),
            "evicted": np.concatenate([evicted, np.full((1, self.HQ), -1)]),
        }
        depth = np.concatenate([depth, np.zeros((1, self.HQ))])
        o = np.zeros((self.HQ, self.dv))
        for h in range(self.HQ):
            g, keep = h // (self.HQ // self.H), cache["evicted"][:, h] < 0
            a = self.scale * cache["k"][keep, g] @ q[h] - depth[keep, h]
            p = np.exp(a - a.max())
            o[h] = p @ cache["v"][keep, g] / p.sum()
        return cache, o

    def advance(self, inputs, present):
        if set(inputs) != {"q", "k", "v", "field", "level"}:
            raise ValueError(f"inputs: expected q, k, v, field, level, got {sorted(inputs)}")
        q, k, v, phi, level = (np.asarray(inputs[n]) for n in ("q", "k", "v", "field", "level"))
        R, n = len(self.rows), q.shape[2]
        shapes = {
            "q": (R, self.HQ, n, self.dk),
            "k": (R, self.H, n, self.dk),
            "v": (R, self.H, n, self.dv),
            "field": (R, self.HQ, n),
            "level": (R, self.HQ, n),
        }
        for name, shape in shapes.items():
            if np.shape(inputs[name]) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {np.shape(inputs[name])}")
        present = np.asarray(present)
        if present.dtype != bool or present.shape != (R, n):
            raise ValueError(f"present: expected a bool array ({R}, {n})")
        out = np.zeros((R, self.HQ, n, self.dv))
        rows = [row.copy() for row in self.rows]  # committed at the end: a failure changes nothing
        for r, row in enumerate(rows):
            for p in np.flatnonzero(present[r]):
                row.past = [*row.past, row.cache][-self.W :] if self.W else []
                w = np.float64
                row.cache, out[r, :, p] = self._step(
                    row.cache,
                    *(x[r, :, p].astype(w) for x in (q, k, v, phi, level)),
                    row.tokens,
                )
                row.tokens += 1
        self.rows = rows
        return {"o": out.astype(q.dtype)}

    def select(self, rows):
        if not rows or any(not 0 <= i < len(self.rows) for i in rows):
            raise ValueError(f"rows: expected indices in [0, {len(self.rows)}), got {rows}")
        self.rows = [self.rows[i].copy() for i in rows]

    def rollback(self, row, n):
        if not 0 <= row < len(self.rows):
            raise ValueError(f"row: expected a row in [0, {len(self.rows)}), got {row}")
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an integer >= 0, got {n!r}")
        if n > self.W:
            raise ValueError(f"max_rollback: n = {n} exceeds W = {self.W}")
        target = self.rows[row]
        if n > len(target.past):
            raise ValueError(f"n: only {len(target.past)} tokens can be undone, got {n}")
        if n:
            self.rows[row] = Row(target.past[-n], target.tokens - n, target.past[:-n])

    def counts(self):
        tokens, live, stored = [], [], []
        for row in self.rows:
            tokens.append(row.tokens)
            if row.cache is None:
                live.append(np.zeros(self.HQ, int))
                stored.append(np.zeros(self.H, int))
                continue
            evicted = row.cache["evicted"]
            kept = (evicted < 0) | (evicted >= row.tokens - len(row.past))  # the F9 delay
            live.append((evicted < 0).sum(axis=0))
            stored.append(kept.reshape(len(kept), self.H, -1).any(axis=-1).sum(axis=0))  # union
        return {"tokens": np.array(tokens), "live": np.array(live), "stored": np.array(stored)}


class MinimalSession:
    name = "minimal-session"
    dtypes = ("float64", "float32")

    def __init__(self, device="cpu"):
        self.device = device

    def capabilities(self):
        return {"fpa_decode.session"}

    def asarray(self, x, dtype):
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x):
        return np.asarray(x)

    def open_session(self, op, *, rows, dtype, config):
        if op != "fpa_decode":
            raise ValueError(f"op: no session for {op!r}")
        return FPADecodeSession(rows, **config)
