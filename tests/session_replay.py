"""Decode sessions checked against replay: each row's tokens kept in a list, and after every
advance the reference's *parallel* op (or layer) on the row's whole history, whose last outputs
the session must have returned (F8 rows, F9, I15). select copies histories, rollback truncates
them, so both are checked by what follows them. Backends are driven through the kit's
interface (``asarray``, ``to_numpy``, ``open_session``), the session contract.
"""

from __future__ import annotations

import numpy as np

from attnspec.conformance.metrics import relative_error
from attnspec.reference import fpa as ref_fpa
from attnspec.reference import interdomain as ref_id

# the sizes of the session programs of the tests: rows, heads, features, dv, modes, delay W
R, H, F, DV, M, W = 3, 2, 4, 3, 6, 3


def program(R: int, bad_inputs) -> list:
    """One program through every rule: prefill, ragged chunks (left and right padding, a row
    with no token, an empty chunk), rollback within W, select with repetitions, the refused
    calls (each then followed by calls that still work)."""
    every = np.ones((R, 4), bool)
    ragged = np.array([[False, True, True], [False, False, False], [True, True, False]])
    return [
        ("advance", every),
        ("advance", ragged),
        ("advance", np.ones((R, 0), bool)),
        ("rollback", 0, 2),
        ("advance", np.array([[True, True]] * R)),
        ("fails", lambda s: s.rollback(0, W + 1), "max_rollback"),
        ("rollback", 2, 3),
        ("fails", lambda s: s.rollback(2, 1), "n: row 2 can undo at most 0 tokens"),
        ("select", [2, 0, 0]),
        ("rollback", 1, 1),
        ("fails", lambda s: s.select([]), "rows"),
        ("fails", lambda s: s.select([0, 3]), "rows"),
        ("fails", lambda s: s.rollback(3, 0), "row"),
        ("fails", lambda s: s.advance(*bad_inputs(s)), "present"),
        ("advance", np.array([[True, False, True], [True, True, True], [False, True, True]])),
        ("advance", np.ones((R, 5), bool)),  # past W: the snapshots follow
        ("rollback", 1, 3),
        ("advance", np.ones((R, 2), bool)),
    ]


# absent positions hold NaN: a session that reads them poisons its rows
ABSENT = np.nan


class Replay:
    """Row histories of one session program (float64 NumPy) and the reference on them.

    op: "fpa_decode", "interdomain_s4d", "interdomain_legs", "fpa_layer" or "interdomain_layer".
    dims: the op's sizes (heads, feature dims, d); reference(history) -> outputs per token.
    """

    def __init__(self, op: str, R: int, dims: dict, reference, rng: np.random.Generator):
        self.op, self.dims, self.reference, self.rng = op, dims, reference, rng
        self.history: list[list[dict]] = [[] for _ in range(R)]

    def draw(self, n: int) -> dict[str, np.ndarray]:
        """A chunk of n positions for every row in the canonical layout."""
        R, d, rng = len(self.history), self.dims, self.rng
        if self.op in ("fpa_layer", "interdomain_layer"):
            return {"x": rng.standard_normal((R, n, d["d"]))}
        if self.op == "fpa_decode":
            HQ, H = d["heads"], d["kv_heads"]
            field = np.cumsum(rng.choice([1.0, -1.0, 0.0], (R, HQ, n)), axis=2) * 2.0
            return {
                "q": rng.standard_normal((R, HQ, n, d["dk"])),
                "k": rng.standard_normal((R, H, n, d["dk"])),
                "v": rng.standard_normal((R, H, n, d["dv"])),
                "field": field,
                "level": field + rng.standard_normal((R, HQ, n)),
            }
        H, F, dv = d["heads"], d["features"], d["dv"]
        positive = self.op == "interdomain_legs" or d.get("readout") == "ratio"
        feats = [
            rng.uniform(0.1, 1.0, (R, H, n, F)) if positive else rng.standard_normal((R, H, n, F))
            for _ in range(2)
        ]
        names = ("fq", "fk", "v") if self.op == "interdomain_legs" else ("fq", "kt", "vt")
        return dict(zip(names, (*feats, rng.standard_normal((R, H, n, dv))), strict=True))

    def _token(self, chunk: dict[str, np.ndarray], r: int, p: int) -> dict:
        if self.op.endswith("layer"):
            return {"x": chunk["x"][r, p]}
        return {name: x[r, :, p] for name, x in chunk.items()}

    def advance(self, chunk: dict[str, np.ndarray], present: np.ndarray) -> np.ndarray:
        """The expected outputs of the chunk (0 at absent positions); the histories grow."""
        R, n = present.shape
        layer = self.op.endswith("layer")
        expected = None
        for r in range(R):
            new = [p for p in range(n) if present[r, p]]
            self.history[r].extend(self._token(chunk, r, p) for p in new)
            if not new:
                continue
            outs = self.reference(self.history[r])[-len(new) :]  # (k, ...) per token
            if expected is None:
                shape = (R, n, *outs.shape[1:]) if layer else (R, outs.shape[1], n, outs.shape[2])
                expected = np.zeros(shape)
            for p, o in zip(new, outs, strict=True):
                if layer:
                    expected[r, p] = o
                else:
                    expected[r, :, p] = o
        return expected

    def select(self, rows: list[int]) -> None:
        self.history = [list(self.history[r]) for r in rows]

    def rollback(self, r: int, n: int) -> None:
        if n:
            self.history[r] = self.history[r][:-n]


def stacked(history: list[dict], axis: int) -> dict[str, np.ndarray]:
    """A row's tokens as one sequence (batch 1): op inputs (1, H, T, dim), layer x (1, T, d)."""
    return {name: np.stack([t[name] for t in history], axis=axis)[None] for name in history[0]}


def s4d_reference(lam, b, c, readout):
    def run(history):
        x = stacked(history, axis=1)
        o = ref_id.interdomain_s4d(x["fq"], x["kt"], x["vt"], lam, b, c, readout=readout)
        return np.moveaxis(o[0], 1, 0)  # (T, H, dv)

    return run


def legs_reference(M):
    def run(history):
        x = stacked(history, axis=1)
        return np.moveaxis(ref_id.interdomain_legs(x["fq"], x["fk"], x["v"], M)[0], 1, 0)

    return run


def interdomain_layer_reference(params, **options):
    def run(history):
        return ref_id.interdomain_layer(stacked(history, axis=0)["x"], params, **options)[0]

    return run


def fpa_layer_reference(params, **options):
    """The parallel FPA layer (theta = inf: the session's steps must equal it)."""

    def run(history):
        return ref_fpa.fpa_layer(stacked(history, axis=0)["x"], params, **options)[0]

    return run


def fpa_decode_reference(scale, theta, kv_groups, window=None):
    """Each row: the whole-stream (F7) decode of its tokens, k and v repeated per query head
    (F8 gqa). With a window w (F3w) token i's output is the last one of the decode of tokens
    i - w + 1 .. i alone: depths only read the fields inside the window."""

    def decode(history):
        x = stacked(history, axis=1)
        k, v = (np.repeat(x[n], kv_groups, axis=1) for n in ("k", "v"))
        out = ref_fpa.fpa_decode(x["q"], k, v, x["field"], x["level"], theta=theta, scale=scale)
        return np.moveaxis(out.o[0], 1, 0)

    def run(history):
        if window is None:
            return decode(history)
        return np.stack(
            [decode(history[max(0, i - window + 1) : i + 1])[-1] for i in range(len(history))]
        )

    return run


def check_close(backend, got, expected, what: str, tol: float) -> None:
    got = backend.to_numpy(got).astype(np.float64)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    assert np.all(np.isfinite(got)), what
    err = relative_error(got, expected)
    assert err <= tol, (what, err)


def run_program(backend, session, replay: Replay, program, dtype: str, tol: float) -> None:
    """Drive ``session`` through ``program`` (a list of calls) and check every output and the
    token counts against ``replay``. Calls: ("advance", present (R, n) bool),
    ("select", rows), ("rollback", row, n), ("fails", call, message): a call that must raise
    a ValueError matching message and leave the session unchanged (what follows checks it)."""
    import re

    import pytest

    for call in program:
        kind = call[0]
        if kind == "advance":
            present = np.asarray(call[1], bool)
            chunk = replay.draw(present.shape[1])
            expected = replay.advance(chunk, present)
            native = {}
            for name, x in chunk.items():
                x = x.copy()
                if name == "x":
                    x[~present] = ABSENT
                else:
                    x[~present[:, None, :].repeat(x.shape[1], 1)] = ABSENT
                native[name] = backend.asarray(x, dtype)
            out = session.advance(native, _mask(backend, present))
            (name,) = out
            if expected is None:  # no token anywhere: every output 0
                assert not np.any(backend.to_numpy(out[name])), call
            else:
                check_close(backend, out[name], expected, str(call), tol)
                got = backend.to_numpy(out[name]).astype(np.float64)
                assert np.all(got[~_token_mask(present, got.shape)] == 0.0), call
        elif kind == "select":
            session.select(call[1])
            replay.select(call[1])
        elif kind == "rollback":
            session.rollback(call[1], call[2])
            replay.rollback(call[1], call[2])
        elif kind == "fails":
            _, inner, message = call
            with pytest.raises(ValueError, match=re.escape(message)):
                inner(session)
        tokens = backend.to_numpy(session.counts()["tokens"])
        np.testing.assert_array_equal(tokens, [len(h) for h in replay.history], err_msg=str(call))


def _mask(backend, present: np.ndarray):
    """The present mask as the backend's bool array."""
    name = type(backend).__module__
    if "torch" in name:
        import torch

        return torch.from_numpy(present).to(backend.device)
    import jax.numpy as jnp

    return jnp.asarray(present)


def _token_mask(present: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """present broadcast to an output of ``shape``: True where a token is."""
    if len(shape) == 3:  # layer y (R, n, d)
        return np.broadcast_to(present[:, :, None], shape)
    return np.broadcast_to(present[:, None, :, None], shape)
