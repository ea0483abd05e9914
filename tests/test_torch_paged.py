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
    """Pages held, and the table columns up to the last held page, per (row, kv head) within
    one page of the stored entries; reference counts equal the table's uses; every stored slot
    on a held page."""
    P = s.P
    stored = s.counts()["stored"]
    assert bool((s.pages_held() <= -(-stored // P)).all())
    table = s.state.table
    held_cols = [[int(c) + 1 for c in torch.nonzero(row >= 0)[-1:]] for row in table.flatten(0, 1)]
    span = torch.tensor([c[0] if c else 0 for c in held_cols]).view(stored.shape)
    assert bool((span <= -(-stored // P)).all()), (span, stored)
    uses = torch.bincount(table[table >= 0], minlength=s.refs.numel())
    assert torch.equal(uses, s.refs)
    slots_on = (table >= 0).repeat_interleave(P, dim=2)
    assert bool(((s.state.pos < 0) | slots_on).all())


def run_program(program, *, R, HQ, H, dk, dv, dtype, theta, window, W, P, seed, attention=None):
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
        **({} if attention is None else {"attention": attention}),
    )
    s.decode_reserve = 3  # decode calls cross reservations
    lit = LiteralSession(R, HQ, H, scale, theta, window, W)
    for call in program:
        if call[0] == "decode":  # tokens one at a time in every row; then what reserve(0) frees
            for _ in range(call[1]):
                chunk = make_chunk(rng, s.rows, HQ, H, 1, dk, dv)
                got = s.decode(torch_chunk(chunk, dtype))["o"]
                want = lit.advance(rounded(chunk, dtype), np.ones((s.rows, 1), dtype=bool))
                err = np.abs(got.to(torch.float64).numpy() - want).max(initial=0.0)
                assert err <= TOL[dtype], (call, err)
            s.reserve(0)
        elif call[0] == "advance":
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
        (torch.float32, math.inf, None, 2, 4, 2),  # nothing evicted: no release pass
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


DECODE_PROGRAM = [
    ("advance", 7, 1.0),
    ("decode", 4),
    ("select", [1, 0, 0]),
    ("decode", 5),  # shared pages copied by the reservation
    ("rollback", 1, 2),
    ("advance", 3, 0.6),
    ("decode", 2),
]


@pytest.mark.parametrize(
    ("dtype", "theta", "window", "W"),
    [(torch.float64, 1.0, None, 3), (torch.float32, math.inf, 5, 2)],
)
def test_decode_matches_literal_loops(dtype, theta, window, W):
    """decode (reservations on the host, the step on the device) gives advance's outputs, and
    after reserve(0) its counts and pages."""
    run_program(
        DECODE_PROGRAM, R=2, HQ=4, H=2, dk=4, dv=3, dtype=dtype, theta=theta, window=window,
        W=W, P=4, seed=4,
    )  # fmt: skip


def test_decode_step_compiles_whole_and_agrees():
    """torch.compile(decode_step, fullgraph=True) traces the step with no graph break (no host
    read, no data-dependent branch; the "eager" backend: the tracing is what is checked) and
    decodes as the eager step does."""
    rng = np.random.default_rng(6)
    sessions = [
        PagedFPASession(rows=2, heads=4, kv_heads=2, dk=4, dv=3, dtype=torch.float32, scale=0.5,
                        theta=1.0, window=6, max_rollback=2, page_size=4)
        for _ in range(2)
    ]  # fmt: skip
    prompt = torch_chunk(make_chunk(rng, 2, 4, 2, 9, 4, 3), torch.float32)
    for s in sessions:
        s.prefill_state(prompt)
    sessions[1].decode_step = torch.compile(
        sessions[1].decode_step, fullgraph=True, backend="eager"
    )
    for _ in range(3):
        chunk = torch_chunk(make_chunk(rng, 2, 4, 2, 1, 4, 3), torch.float32)
        eager, compiled = (s.decode(chunk)["o"] for s in sessions)
        torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_decode_refuses_chunks_and_an_overfull_pool():
    s = PagedFPASession(
        rows=1, heads=2, kv_heads=2, dk=4, dv=3, dtype=torch.float32, scale=0.5, page_size=4,
        max_pages=4,
    )  # fmt: skip
    rng = np.random.default_rng(7)
    with pytest.raises(ValueError, match=r"q: expected one token a row, .*\(advance takes"):
        s.decode(torch_chunk(make_chunk(rng, 1, 2, 2, 2, 4, 3), torch.float32))
    with pytest.raises(ValueError, match="max_pages: the pool of 4 pages has 4 free, reserving"):
        s.reserve(9)  # 3 pages for each of 2 kv heads
    with pytest.raises(ValueError, match="steps: expected an integer >= 0, got -1"):
        s.reserve(-1)


@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_paged_attention_custom_op_passes_opcheck(monkeypatch, impl):
    """The op a compiled decode step calls for the Triton kernel (schema, fake tensor, AOT)."""
    if impl == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(8)
    s = PagedFPASession(
        rows=2, heads=4, kv_heads=2, dk=4, dv=3, dtype=torch.float32, scale=0.5, page_size=4
    )
    s.prefill_state(torch_chunk(make_chunk(rng, 2, 4, 2, 6, 4, 3), torch.float32))
    st = s.state
    x = torch_chunk(make_chunk(rng, 2, 4, 2, 1, 4, 3), torch.float32)
    tok = st.tokens[:, None].clone()
    args = (x["q"], s.k_pool, s.v_pool, st.table, st.pos, st.level, st.mins, st.evict, tok,
            x["field"].float(), 0.5, impl)  # fmt: skip
    torch.library.opcheck(torch.ops.attnspec.paged_attention.default, args)


def reference_decode(chunk, G, **kw):
    """The reference decoder (F7) on a chunk of every row, k and v repeated for GQA."""
    k, v = (np.repeat(chunk[x], G, axis=1) for x in ("k", "v"))
    return fpa_decode(chunk["q"], k, v, chunk["field"], chunk["level"], **kw)


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
    ref = reference_decode(chunk, HQ // H, theta=theta, scale=0.5)
    np.testing.assert_allclose(o.numpy(), ref.o, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(s.counts()["live"].numpy(), ref.cache_sizes[:, :, -1])


def test_pages_in_place_on_literal_tables():
    from attnspec.backends.torch.paged import pages_in_place

    def table(rows):
        return torch.tensor(rows, dtype=torch.int64).view(2, 1, -1)

    assert pages_in_place(table([[4, 5, 6], [9, 10, 11]])) == (3, 4, 5)
    assert pages_in_place(table([[4, 5, 20], [9, 10, 11]])) == (2, 4, 5)  # shortest run
    assert pages_in_place(table([[4, 5, 6], [4, 5, 6]])) == (3, 4, 0)  # shared pages
    assert pages_in_place(table([[9, 10], [4, 5]]))[0] == 0  # spacing < 0
    assert pages_in_place(table([[-1, 5], [4, 5]]))[0] == 0
    three = torch.tensor([[0, 1], [2, 3], [5, 6]]).view(3, 1, 2)  # spacing 2, then 3
    assert pages_in_place(three)[0] == 0
    assert pages_in_place(torch.zeros(2, 1, 0, dtype=torch.int64))[0] == 0


def test_attention_reads_pages_in_place_as_gathered():
    """After a prefill the pages of every (row, kv head) lie at equal spacing and the eager
    attention reads them in place: the same state with the pool's pages permuted (so every
    page is gathered) gives the same outputs, and the next token's output is the reference
    decoder's."""
    from attnspec.backends.torch import paged

    rng = np.random.default_rng(6)
    R, HQ, H, T, dk, dv = 3, 4, 2, 21, 4, 3
    chunk = make_chunk(rng, R, HQ, H, T + 1, dk, dv)
    s = PagedFPASession(
        rows=R, heads=HQ, kv_heads=H, dk=dk, dv=dv, dtype=torch.float64, scale=0.5, page_size=4
    )
    s.prefill_state(torch_chunk({x: a[:, :, :T] for x, a in chunk.items()}, torch.float64))
    last = torch_chunk({x: a[:, :, T:] for x, a in chunk.items()}, torch.float64)
    NT = s.state.table.shape[2]
    assert paged.pages_in_place(s.state.table)[0] == NT
    st = s.state
    tok = torch.full((R, 1), T, dtype=torch.int64)
    args = (st.table, st.pos, st.level, st.mins, st.evict, tok, last["field"], 0.5)
    q = last["q"]
    in_place = paged.paged_attention_eager(q, s.k_pool, s.v_pool, *args)
    perm = torch.randperm(s.k_pool.shape[0], generator=torch.Generator().manual_seed(0))
    moved = st.table.where(st.table < 0, torch.argsort(perm)[st.table.clamp_min(0)])
    assert paged.pages_in_place(moved)[0] < NT
    gathered = paged.paged_attention_eager(q, s.k_pool[perm], s.v_pool[perm], moved, *args[1:])
    torch.testing.assert_close(in_place, gathered, rtol=0, atol=1e-14)
    ref = reference_decode(chunk, HQ // H, scale=0.5)
    o = s.advance(last, torch.ones(R, 1, dtype=torch.bool))["o"]  # read in place
    np.testing.assert_allclose(o[:, :, 0].numpy(), ref.o[:, :, T], rtol=0, atol=1e-12)


def test_compaction_keeps_a_prefill_read_in_place():
    """A prompt whose keys die leaves holes; compaction moves each (row, kv head)'s entries
    into its own pages in column order, so its leading pages stay where the prefill put them
    and the attention still reads them in place (the shortest row's pages)."""
    from attnspec.backends.torch import paged

    rng = np.random.default_rng(7)
    R, HQ, H, T = 3, 4, 2, 200
    s = PagedFPASession(
        rows=R, heads=HQ, kv_heads=H, dk=4, dv=3, dtype=torch.float64, scale=0.5, theta=0.8,
        page_size=4,
    )  # fmt: skip
    s.prefill_state(torch_chunk(make_chunk(rng, R, HQ, H, T, 4, 3), torch.float64))
    held, stored = s.pages_held(), s.counts()["stored"]
    assert int(stored.max()) < T // 2  # keys died: the pages were compacted
    assert torch.equal(held, -(-stored // 4))
    assert paged.pages_in_place(s.state.table) == (int(held.min()), 0, T // 4)
    check_pages(s)


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
        (lambda: s.advance(ok, torch.ones(2, 4, dtype=torch.bool)), "present"),
        # q as [R, n, HQ, dk] (the layers' [B, T, N, d] order): q is named, with its layout
        (
            lambda: s.advance({**ok, "q": ok["q"].transpose(1, 2)}, torch.ones(2, 3, dtype=bool)),
            r"^q: expected shape \(2, 2, n, 4\) \(\(rows, heads, n, dim\).*got \(2, 3, 2, 4\)",
        ),
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


@pytest.mark.parametrize(
    ("dtype", "P", "split", "rows"),
    [(torch.float32, 4, 2, None), (torch.bfloat16, 16, 1, None), (torch.float32, 4, 2, 1)],
)
def test_triton_kernel_under_the_interpreter(monkeypatch, dtype, P, split, rows):
    """The decode kernel in the session against the literal loops, and against its eager twin
    on the same state (several page splits: the combine pass; ``rows``: at most that many query
    rows per program, so that each query head of a GQA group takes its own programs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnspec.backends.torch import triton_decode
    from attnspec.backends.torch.paged import paged_attention_eager

    if rows is not None:
        monkeypatch.setattr(triton_decode, "MAX_ROWS", rows)

    calls = []

    def kernel(*args, **kw):
        got = triton_decode.paged_attention_triton(*args, **kw, pages_per_split=split)
        want = paged_attention_eager(*args)
        calls.append(float((got - want).abs().max()))
        return got

    run_program(
        PROGRAM[:7],
        R=3,
        HQ=4,
        H=2,
        dk=4,
        dv=3,
        dtype=dtype,
        theta=0.9,
        window=7,
        W=3,
        P=P,
        seed=2,
        attention=kernel,
    )
    assert calls and max(calls) <= TOL[dtype]


def test_open_session_in_the_kit_adapters(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnspec.conformance.registry import get_backend

    config = {
        "heads": 4,
        "kv_heads": 2,
        "dk": 4,
        "dv": 3,
        "scale": 0.5,
        "theta": 1.0,
        "window": None,
        "max_rollback": 2,
    }
    for name, attention in (
        ("torch", "paged_attention_eager"),
        ("triton", "paged_attention_triton"),
    ):
        backend = get_backend(name)
        assert "fpa_decode.session" in backend.capabilities()
        s = backend.open_session("fpa_decode", rows=2, dtype="float32", config=config)
        assert s.attention.__name__ == attention and s.dtype == torch.float32
        with pytest.raises(ValueError, match="config"):
            backend.open_session("fpa_decode", rows=2, dtype="float32", config={"heads": 4})
        with pytest.raises(NotImplementedError, match="op"):
            backend.open_session("fox_attention", rows=2, dtype="float32", config=config)


@pytest.mark.parametrize(
    ("theta", "window", "W"), [(0.8, None, 3), (1.5, 5, 0), (math.inf, None, 2)]
)
def test_prefill_state_equals_advancing_the_prompt(theta, window, W):
    rng = np.random.default_rng(4)
    R, HQ, H, T, dk, dv = 2, 4, 2, 37, 4, 3
    kw = dict(
        rows=R,
        heads=HQ,
        kv_heads=H,
        dk=dk,
        dv=dv,
        dtype=torch.float64,
        scale=0.5,
        theta=theta,
        window=window,
        max_rollback=W,
        page_size=4,
    )
    stepped, filled = PagedFPASession(**kw), PagedFPASession(**kw)
    prompt = torch_chunk(make_chunk(rng, R, HQ, H, T, dk, dv), torch.float64)
    stepped.advance(prompt, torch.ones(R, T, dtype=torch.bool))
    filled.prefill_state(prompt)
    for _ in range(2):
        for key in ("tokens", "live", "stored"):
            assert torch.equal(stepped.counts()[key], filled.counts()[key]), key
        assert torch.equal(stepped.pages_held(), filled.pages_held())
        if W:
            stepped.rollback(1, 2)
            filled.rollback(1, 2)
        chunk = torch_chunk(make_chunk(rng, R, HQ, H, 3, dk, dv), torch.float64)
        present = torch.ones(R, 3, dtype=torch.bool)
        a, b = stepped.advance(chunk, present)["o"], filled.advance(chunk, present)["o"]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("theta", [math.inf, 0.7])
def test_layer_session_ragged_and_padded(theta):
    """FirstPassageAttention.open_session on rows of different lengths with left and right
    padding against the layer on each row alone: the parallel forward (theta = inf) or the
    single-stream (F7) cache stepped token by token."""
    from attnspec.backends.torch.modules import FirstPassageAttention

    torch.manual_seed(0)
    layer = FirstPassageAttention(8, 2, 4, dtype=torch.float64)
    with torch.no_grad():
        layer.b_delta.fill_(-0.3)  # a falling field: keys die at finite theta
    s = layer.open_session(3, theta=theta, max_rollback=2, page_size=4)
    chunks = [
        torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool),
        torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]], dtype=torch.bool),
    ]
    seen = [[] for _ in range(3)]
    got = [[] for _ in range(3)]
    for present in chunks:
        x = torch.randn(3, present.shape[1], 8, dtype=torch.float64)
        with torch.no_grad():
            y = s.advance({"x": x}, present)["y"]
        assert not y[~present].any()
        for r in range(3):
            seen[r] += list(x[r][present[r]])
            got[r] += list(y[r][present[r]])
    for r in range(3):
        if not seen[r]:
            continue
        xr = torch.stack(seen[r])[None]
        with torch.no_grad():
            if math.isinf(theta):
                want = layer(xr)[0]
            else:
                cache = layer.new_cache(theta=theta)
                want = torch.cat([layer.step(xr[:, t], cache) for t in range(xr.shape[1])])
        torch.testing.assert_close(torch.stack(got[r]), want, rtol=0, atol=1e-10)
    assert s.counts()["tokens"].tolist() == [7, 6, 2]
    if math.isinf(theta):  # rollback restores the row's field: the row continues exactly
        s.rollback(1, 2)
        x = torch.randn(3, 2, 8, dtype=torch.float64)
        with torch.no_grad():
            y = s.advance({"x": x}, torch.tensor([[0, 0], [1, 1], [0, 0]], dtype=torch.bool))
            want = layer(torch.cat([torch.stack(seen[1][:4]), x[1]])[None])[0, 4:]
        torch.testing.assert_close(y["y"][1], want, rtol=0, atol=1e-10)


def test_a_copied_layer_session_continues_as_the_original_and_shares_the_layer():
    """copy.deepcopy of FirstPassageAttention's session (the models' cache undoes a failed chunk
    from one): the copy holds the decode state, not the weights; both continue alike, and
    advancing one leaves the other as it was."""
    import copy

    from attnspec.backends.torch.modules import FirstPassageAttention

    torch.manual_seed(4)
    layer = FirstPassageAttention(8, 4, 4, n_kv_heads=2, dtype=torch.float64)
    with torch.no_grad():
        layer.b_delta.fill_(-0.3)  # a falling field: keys die at theta = 0.7
    s = layer.open_session(2, theta=0.7, max_rollback=1, page_size=4)
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    present = torch.ones(2, 9, dtype=torch.bool)
    present[1, :2] = False
    with torch.no_grad():
        s.advance({"x": x[:, :6]}, present[:, :6])
        c = copy.deepcopy(s)
        assert c.layer is layer and c.attention is not s.attention
        counts = {k: v.clone() for k, v in s.counts().items()}
        a = c.advance({"x": x[:, 6:]}, present[:, 6:])["y"]
        assert all(torch.equal(s.counts()[k], v) for k, v in counts.items())
        b = s.advance({"x": x[:, 6:]}, present[:, 6:])["y"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    counts = s.counts()
    assert (counts["live"] < counts["tokens"][:, None]).any()  # keys were evicted


def test_kit_fpa_layer_session_against_the_reference_layer():
    from attnspec.conformance.registry import get_backend
    from attnspec.reference.fpa import fpa_layer, init_fpa_params

    backend = get_backend("torch")
    assert "fpa_layer.session" in backend.capabilities()
    params = init_fpa_params(8, 2, 4, 3, seed=1)
    config = {
        "params": {n: backend.asarray(a, "float64") for n, a in params.items()},
        "increments": "logsigmoid",
        "theta": math.inf,
        "window": None,
        "max_rollback": 1,
    }
    s = backend.open_session("fpa_layer", rows=2, dtype="float64", config=config)
    x = np.random.default_rng(0).normal(size=(2, 5, 8))
    present = np.array([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=bool)
    y = s.advance({"x": backend.asarray(x, "float64")}, torch.from_numpy(present))["y"]
    want0 = fpa_layer(x[:1], params, increments="logsigmoid")[0]
    want1 = fpa_layer(x[1:, 1:4], params, increments="logsigmoid")[0]
    np.testing.assert_allclose(y[0].numpy(), want0, rtol=0, atol=1e-10)
    np.testing.assert_allclose(y[1, 1:4].numpy(), want1, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["gqa", "window"])
def test_kit_session_families_on_the_triton_kernel(monkeypatch, family):
    """The kit's session programs (first case) on the triton backend: the decode kernel under
    the interpreter (the whole set: python -m attnspec.conformance --backend triton --ops
    fpa_decode fpa_layer --cases decode/session fpa_layer/session)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnspec.conformance import cases, runner
    from attnspec.conformance.registry import get_backend

    backend = get_backend("triton")
    case = cases.build_case(f"decode/session_{family}/0")
    report = runner.run(backend, [case], ["float32"])
    assert [r.verdict for r in report.results] == ["passed"], report.results[0].message
