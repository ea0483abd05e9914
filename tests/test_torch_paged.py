"""The paged FPA session (backends/torch/paged.py) against the reference decoder and a literal
(F7, F3w, F8, F9) session written with loops; the page bookkeeping against its invariants."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest
import torch

from attnspec.backends.torch.paged import PagedFPASession
from attnspec.reference.fpa import fpa_decode

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


class LiteralSession:
    """The contract's session with loops: every row keeps its token history; a call replays
    (F7) with the window (F3w) per query head from the start."""

    def __init__(self, rows, HQ, H, scale, theta, window, W):
        self.hist = [[] for _ in range(rows)]
        self.budget = [0] * rows
        self.HQ, self.H, self.scale, self.theta, self.window, self.W = (
            HQ,
            H,
            scale,
            theta,
            window,
            W,
        )

    def replay(self, tokens):
        """Outputs [T, HQ, dv], live [HQ], evicted steps per head {j: t_e}."""
        G = self.HQ // self.H
        T = len(tokens)
        outs = np.zeros((T, self.HQ, tokens[0][2].shape[1] if T else 0))
        live, steps = [], []
        for hq in range(self.HQ):
            cache, evicted = [], {}  # cache: [j, m_j]
            for t, (q, _, _, f, _) in enumerate(tokens):
                kept = []
                for j, m in cache:
                    m = min(m, f[hq])
                    depth = max(0.0, tokens[j][4][hq] - m)
                    if depth >= self.theta or (self.window and t - j >= self.window):
                        evicted[j] = t
                    else:
                        kept.append([j, m])
                cache = [*kept, [t, math.inf]]
                logits = np.array(
                    [
                        self.scale * q[hq] @ tokens[j][1][hq // G] - max(0.0, tokens[j][4][hq] - m)
                        for j, m in cache
                    ]
                )
                w = np.exp(logits - logits.max())
                w /= w.sum()
                outs[t, hq] = sum(
                    wi * tokens[j][2][hq // G] for wi, (j, _) in zip(w, cache, strict=True)
                )
            live.append(len(cache))
            steps.append(evicted)
        return outs, live, steps

    def advance(self, chunk, present):
        R, n = present.shape
        o = np.zeros((R, self.HQ, n, chunk["v"].shape[-1]))
        for r in range(R):
            new = [p for p in range(n) if present[r, p]]
            for p in new:
                self.hist[r].append(
                    tuple(chunk[x][r, :, p] for x in ("q", "k", "v", "field", "level"))
                )
            self.budget[r] = min(self.budget[r] + len(new), self.W)
            if new:
                outs = self.replay(self.hist[r])[0]
                for i, p in enumerate(new):
                    o[r, :, p] = outs[len(self.hist[r]) - len(new) + i]
        return o

    def select(self, rows):
        self.hist = [list(self.hist[i]) for i in rows]
        self.budget = [self.budget[i] for i in rows]

    def rollback(self, r, n):
        self.hist[r] = self.hist[r][: len(self.hist[r]) - n]
        self.budget[r] -= n

    def counts(self):
        G = self.HQ // self.H
        tokens, live, stored = [], [], []
        for r, hist in enumerate(self.hist):
            T = len(hist)
            tokens.append(T)
            if not T:
                live.append([0] * self.HQ)
                stored.append([0] * self.H)
                continue
            _, lv, steps = self.replay(hist)
            live.append(lv)
            oldest = T - self.budget[r]
            stored.append(
                [
                    sum(
                        any(steps[h * G + g].get(j, T) >= oldest for g in range(G))
                        for j in range(T)
                    )
                    for h in range(self.H)
                ]
            )
        return {"tokens": np.array(tokens), "live": np.array(live), "stored": np.array(stored)}


def make_chunk(rng, R, HQ, H, n, dk, dv, step=0.6):
    """Random tokens; field a random walk (per head), levels near it, so keys die."""
    f = np.cumsum(rng.normal(0.0, step, (R, HQ, n)), axis=2) + rng.normal(0, 1, (R, HQ, 1))
    return {
        "q": rng.normal(size=(R, HQ, n, dk)),
        "k": rng.normal(size=(R, H, n, dk)),
        "v": rng.normal(size=(R, H, n, dv)),
        "field": f,
        "level": f + rng.normal(0.3, 0.5, (R, HQ, n)),
    }


def torch_chunk(chunk, dtype):
    return {
        x: torch.from_numpy(a).to(dtype if x in "qkv" else torch.float64) for x, a in chunk.items()
    }


def rounded(chunk, dtype):
    """The chunk as the session sees it (q, k, v rounded to dtype), in float64."""
    return {x: a.to(torch.float64).numpy() for x, a in torch_chunk(chunk, dtype).items()}


def check_pages(s: PagedFPASession):
    """Pages held per (row, kv head) within one page of the stored entries; reference counts
    equal the table's uses; every stored slot on a held page."""
    P = s.P
    stored = s.counts()["stored"]
    assert bool((s.pages_held() <= -(-stored // P)).all())
    table = s.state.table
    uses = torch.bincount(table[table >= 0], minlength=s.refs.numel())
    assert torch.equal(uses, s.refs)
    slots_on = (table >= 0).repeat_interleave(P, dim=2)
    assert bool(((s.state.pos < 0) | slots_on).all())


def run_program(program, *, R, HQ, H, dk, dv, dtype, theta, window, W, P, seed):
    rng = np.random.default_rng(seed)
    scale = 0.4
    s = PagedFPASession(
        rows=R,
        heads=HQ,
        kv_heads=H,
        dk=dk,
        dv=dv,
        dtype=dtype,
        scale=scale,
        theta=theta,
        window=window,
        max_rollback=W,
        page_size=P,
    )
    lit = LiteralSession(R, HQ, H, scale, theta, window, W)
    for call in program:
        if call[0] == "advance":
            n = call[1]
            R = s.rows
            chunk = make_chunk(rng, R, HQ, H, n, dk, dv)
            present = rng.random((R, n)) < call[2]
            got = s.advance(torch_chunk(chunk, dtype), torch.from_numpy(present))["o"]
            want = lit.advance(rounded(chunk, dtype), present)
            err = np.abs(got.to(torch.float64).numpy() - want).max(initial=0.0)
            assert err <= TOL[dtype], (call, err)
            assert not got[~torch.from_numpy(present)[:, None, :].expand(-1, HQ, -1)].any()
        elif call[0] == "select":
            s.select(call[1])
            lit.select(call[1])
        else:
            n = min(call[2], lit.budget[call[1]])  # within the budget (past it: a test below)
            s.rollback(call[1], n)
            lit.rollback(call[1], n)
        got_counts, want_counts = s.counts(), lit.counts()
        for key in want_counts:
            np.testing.assert_array_equal(got_counts[key].numpy(), want_counts[key], key)
        check_pages(s)
    return s


PROGRAM = [
    ("advance", 7, 0.9),
    ("advance", 1, 1.0),
    ("advance", 3, 0.6),
    ("select", [1, 0, 0]),
    ("advance", 2, 1.0),
    ("rollback", 1, 2),
    ("advance", 20, 0.8),
    ("rollback", 0, 3),
    ("advance", 0, 1.0),
    ("select", [2, 2]),
    ("advance", 4, 0.5),
]


@pytest.mark.parametrize(
    ("dtype", "theta", "window", "W", "HQ", "H"),
    [
        (torch.float64, 1.0, None, 3, 4, 2),
        (torch.float32, math.inf, 6, 2, 2, 2),
        (torch.bfloat16, 0.7, None, 4, 4, 1),
        (torch.float16, 1.2, 9, 3, 2, 1),
    ],
)
def test_session_matches_literal_loops(dtype, theta, window, W, HQ, H):
    run_program(
        PROGRAM,
        R=3,
        HQ=HQ,
        H=H,
        dk=4,
        dv=3,
        dtype=dtype,
        theta=theta,
        window=window,
        W=W,
        P=4,
        seed=1,
    )


def test_matches_reference_fpa_decode_per_row_and_head():
    """Full rows, no window, no rollback: reference fpa_decode with k, v repeated for GQA."""
    rng = np.random.default_rng(3)
    R, HQ, H, T, dk, dv, theta = 2, 4, 2, 24, 4, 3, 0.8
    chunk = make_chunk(rng, R, HQ, H, T, dk, dv)
    s = PagedFPASession(
        rows=R,
        heads=HQ,
        kv_heads=H,
        dk=dk,
        dv=dv,
        dtype=torch.float64,
        scale=0.5,
        theta=theta,
        page_size=4,
    )
    o = torch.cat(
        [
            s.advance(
                torch_chunk({x: a[:, :, t0:t1] for x, a in chunk.items()}, torch.float64),
                torch.ones(R, t1 - t0, dtype=torch.bool),
            )["o"]
            for t0, t1 in ((0, 1), (1, 9), (9, 24))
        ],
        dim=2,
    )
    G = HQ // H
    ref = fpa_decode(
        chunk["q"],
        np.repeat(chunk["k"], G, axis=1),
        np.repeat(chunk["v"], G, axis=1),
        chunk["field"],
        chunk["level"],
        theta=theta,
        scale=0.5,
    )
    np.testing.assert_allclose(o.numpy(), ref.o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(s.counts()["live"].numpy(), ref.cache_sizes[:, :, -1])


def state_of(s: PagedFPASession):
    return [getattr(s.state, f.name).clone() for f in fields(s.state)] + [
        s.refs.clone(),
        s.k_pool.clone(),
    ]


def test_bad_input_names_the_argument_and_changes_nothing():
    rng = np.random.default_rng(0)
    s = PagedFPASession(
        rows=2,
        heads=2,
        kv_heads=1,
        dk=4,
        dv=3,
        dtype=torch.float32,
        scale=0.5,
        theta=1.0,
        max_rollback=2,
        page_size=4,
        max_pages=3,
    )
    ok = torch_chunk(make_chunk(rng, 2, 2, 1, 3, 4, 3), torch.float32)
    s.advance(ok, torch.ones(2, 3, dtype=torch.bool))
    before = state_of(s)
    big = torch_chunk(make_chunk(rng, 2, 2, 1, 9, 4, 3), torch.float32)
    bad = [
        (lambda: s.advance({**ok, "q": ok["q"][:1]}, torch.ones(2, 3, dtype=torch.bool)), "q"),
        (lambda: s.advance(ok, torch.ones(2, 4, dtype=torch.bool)), "q"),
        (lambda: s.advance(ok, torch.ones(2, 3)), "present"),
        (lambda: s.advance({**ok, "k": ok["k"].double()}, torch.ones(2, 3, dtype=torch.bool)), "k"),
        (lambda: s.advance(big, torch.ones(2, 9, dtype=torch.bool)), "max_pages"),
        (lambda: s.rollback(0, 3), "max_rollback"),
        (lambda: s.rollback(2, 1), "row"),
        (lambda: s.select([0, 2]), "rows"),
        (lambda: s.select([]), "rows"),
    ]
    for call, name in bad:
        with pytest.raises(ValueError, match=name):
            call()
        for a, b in zip(state_of(s), before, strict=True):
            assert torch.equal(a, b)
    s.rollback(0, 2)
    with pytest.raises(ValueError, match="n: row 0 can undo at most 0"):
        s.rollback(0, 1)
    s.advance(ok, torch.ones(2, 3, dtype=torch.bool))  # still works


def test_select_shares_pages_and_copies_on_write():
    rng = np.random.default_rng(5)
    s = PagedFPASession(
        rows=1, heads=2, kv_heads=2, dk=4, dv=3, dtype=torch.float32, scale=0.5, page_size=4
    )
    s.advance(
        torch_chunk(make_chunk(rng, 1, 2, 2, 6, 4, 3), torch.float32),
        torch.ones(1, 6, dtype=torch.bool),
    )
    physical = int((s.refs > 0).sum())
    s.select([0, 0, 0])  # three beams, no page copied
    assert int((s.refs > 0).sum()) == physical == 4
    s.advance(
        torch_chunk(make_chunk(rng, 3, 2, 2, 1, 4, 3), torch.float32),
        torch.tensor([[True], [False], [False]]),
    )
    # row 0 wrote into its shared half-full tail page: one copy per kv head
    assert int((s.refs > 0).sum()) == physical + 2
    check_pages(s)
