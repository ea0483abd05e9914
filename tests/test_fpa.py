"""Tests of reference/fpa.py against independent computations (loops, brute force, FoX, FD)."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnspec.conformance.drawers import fpa_kink_margin
from attnspec.conformance.gradcheck import directional_check
from attnspec.conformance.metrics import relative_error as rel_err
from attnspec.reference import fpa

SHAPES = [((), 1, 3, 2), ((), 2, 1, 1), ((2,), 7, 5, 3), ((2, 3), 5, 4, 6), ((1,), 13, 3, 3)]


def random_inputs(rng, lead, T, dk, dv, *, walk=True):
    q = rng.standard_normal((*lead, T, dk))
    k = rng.standard_normal((*lead, T, dk))
    v = rng.standard_normal((*lead, T, dv))
    steps = rng.standard_normal((*lead, T))
    field = np.cumsum(steps, axis=-1) if walk else steps
    level = field + rng.standard_normal((*lead, T))
    return q, k, v, field, level


# (F1)-(F5) forward


def test_segment_min_brute_force():
    rng = np.random.default_rng(0)
    field = rng.integers(-3, 3, size=(2, 9)).astype(float)  # integers: many ties
    m = fpa.segment_min(field)
    for b in range(2):
        for i in range(9):
            for j in range(9):
                seg = field[b, j + 1 : i + 1]
                assert m[b, i, j] == (seg.min() if j < i else np.inf)


def test_segment_argmin_is_latest_minimiser():
    rng = np.random.default_rng(1)
    field = rng.integers(-2, 2, size=(3, 10)).astype(float)
    tstar = fpa.segment_argmin(field)
    for b in range(3):
        for i in range(10):
            for j in range(10):
                if j < i:
                    seg = field[b, j + 1 : i + 1]
                    latest = j + 1 + max(np.flatnonzero(seg == seg.min()))
                    assert tstar[b, i, j] == latest
                else:
                    assert tstar[b, i, j] == -1


def test_descent_depth_diagonal_zero_and_nonnegative():
    rng = np.random.default_rng(2)
    *_, field, level = random_inputs(rng, (3,), 11, 2, 2)
    pi = fpa.descent_depth(field, level)
    assert (pi >= 0).all()
    assert (np.diagonal(pi, axis1=-2, axis2=-1) == 0).all()


@pytest.mark.parametrize(("lead", "T", "dk", "dv"), SHAPES)
def test_vectorised_equals_literal_loops(lead, T, dk, dv):
    rng = np.random.default_rng(T * 10 + dk)
    args = random_inputs(rng, lead, T, dk, dv)
    o, lse = fpa.fpa_attention(*args, return_lse=True)
    o_loop, lse_loop = fpa.fpa_attention_loops(*args, return_lse=True)
    assert o.shape == (*lead, T, dv)
    assert lse.shape == (*lead, T)
    assert rel_err(o, o_loop) < 1e-13
    assert rel_err(lse, lse_loop) < 1e-13


@given(
    T=st.sampled_from([1, 2, 3, 5, 8, 17]),
    dk=st.sampled_from([1, 3, 4]),
    seed=st.integers(0, 2**31 - 1),
    walk=st.booleans(),
    scale=st.sampled_from([None, 0.3, 2.0]),
)
def test_vectorised_equals_loops_hypothesis(T, dk, seed, walk, scale):
    rng = np.random.default_rng(seed)
    args = random_inputs(rng, (2,), T, dk, 2, walk=walk)
    o = fpa.fpa_attention(*args, scale=scale)
    assert rel_err(o, fpa.fpa_attention_loops(*args, scale=scale)) < 1e-13


def test_t1_first_row_is_its_own_value():
    rng = np.random.default_rng(3)
    q, k, v, field, level = random_inputs(rng, (), 6, 3, 2)
    o = fpa.fpa_attention(q, k, v, field, level)
    np.testing.assert_allclose(o[0], v[0], rtol=0, atol=1e-15)


def test_default_scale_is_inverse_sqrt_dk():
    rng = np.random.default_rng(4)
    args = random_inputs(rng, (), 6, 4, 2)
    assert rel_err(fpa.fpa_attention(*args), fpa.fpa_attention(*args, scale=0.5)) < 1e-15
    assert rel_err(fpa.fpa_attention(*args), fpa.fpa_attention(*args, scale=1.0)) > 1e-3


def test_penalty_kills_deeply_descended_key():
    # One key far above the later field: its weight must vanish; the loop form agrees.
    q = np.zeros((3, 1))
    k = np.zeros((3, 1))
    v = np.array([[100.0], [1.0], [1.0]])
    field = np.array([0.0, -50.0, -50.0])
    level = np.array([0.0, -50.0, -50.0])
    o = fpa.fpa_attention(q, k, v, field, level)
    assert o[2, 0] == pytest.approx(1.0, abs=1e-18)  # key 0 has depth 50: weight e^-50 / 2


# (F6) FoX


@pytest.mark.parametrize("gates_one", [False, True])
def test_fox_special_case_equals_fox_formula(gates_one):
    rng = np.random.default_rng(5)
    q, k, v, _, _ = random_inputs(rng, (2, 2), 12, 4, 3)
    log_f = -rng.exponential(0.5, size=(2, 2, 12))
    if gates_one:
        log_f[..., ::3] = 0.0
        log_f[0, 0] = 0.0  # a whole row of gates f = 1: plain softmax attention
    o, lse = fpa.fox_attention(q, k, v, log_f, return_lse=True)
    o_direct, lse_direct = fpa.fox_attention_direct(q, k, v, log_f, return_lse=True)
    assert rel_err(o, o_direct) < 1e-13
    assert rel_err(lse, lse_direct) < 1e-13


def test_fox_with_unit_gates_is_causal_softmax():
    rng = np.random.default_rng(6)
    q, k, v, _, _ = random_inputs(rng, (), 7, 3, 2)
    s = 1 / np.sqrt(3)
    logits = s * q @ k.T + np.triu(np.full((7, 7), -np.inf), 1)
    p = np.exp(logits - logits.max(1, keepdims=True))
    expected = (p / p.sum(1, keepdims=True)) @ v
    assert rel_err(fpa.fox_attention(q, k, v, np.zeros(7)), expected) < 1e-14


def fox_by_masks(q, k, v, log_f, d_out):
    """FoX and its backward with the decay written as masks, D = A diag(log f) B: the O(T^3)
    form the reference used before, kept as an independent witness at small T."""
    T, dk = q.shape[-2:]
    upto_i = np.tril(np.ones((T, T)))  # A[i, l] = [l <= i]
    after_j = np.tril(np.ones((T, T)), k=-1)  # B[l, j] = [l > j]
    decay = np.einsum("il,...l,lj->...ij", upto_i, log_f, after_j)
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(dk) + decay
    logits = np.where(np.tril(np.ones((T, T), dtype=bool)), logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
    p = np.exp(logits - lse[..., None])
    o = p @ v
    G = p * (d_out @ np.swapaxes(v, -1, -2) - np.sum(d_out * o, axis=-1)[..., None])
    dlog_f = np.einsum("il,...ij,lj->...l", upto_i, G, after_j)
    dq = G @ k / np.sqrt(dk)
    dk_ = np.swapaxes(G, -1, -2) @ q / np.sqrt(dk)
    return o, lse, (dq, dk_, np.swapaxes(p, -1, -2) @ d_out, dlog_f)


@pytest.mark.parametrize(("lead", "T"), [((), 1), ((2,), 2), ((2, 3), 7), ((1,), 33), ((2,), 130)])
@pytest.mark.parametrize("unit_gates", [0.0, 0.5])
def test_quadratic_fox_forms_equal_the_cubic_mask_form(lead, T, unit_gates):
    rng = np.random.default_rng(T)
    q, k, v, _, _ = random_inputs(rng, lead, T, 4, 3)
    log_f = -rng.exponential(0.3, size=(*lead, T))
    log_f[rng.random(log_f.shape) < unit_gates] = 0.0
    d_out = rng.standard_normal(v.shape)
    o_want, lse_want, grads_want = fox_by_masks(q, k, v, log_f, d_out)
    o, lse = fpa.fox_attention_direct(q, k, v, log_f, return_lse=True)
    assert rel_err(o, o_want) < 1e-13
    assert rel_err(lse, lse_want) < 1e-13
    for got, want in zip(fpa.fox_attention_vjp(q, k, v, log_f, d_out), grads_want, strict=True):
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("op", ["fox_attention", "fox_attention_direct", "fox_attention_vjp"])
def test_fox_gates_whose_sum_overflows(op):
    # The field cumsum(log f) of (F6) reached -inf, and -inf - (-inf) made NaN.
    args = good(T=3)
    args["field"] = np.broadcast_to([0.0, -1e308, -1e308], args["field"].shape)
    with pytest.raises(ValueError, match=r"log_f: expected a sum along T above -1.8e308"):
        OPS[op](args)


def test_fox_direct_sums_each_segment_on_its_own():
    # A gate of -1e8 at l = 1 enters no D_ij with j >= 1. Summing each segment's own gates keeps
    # those logits exact; a difference of two prefix sums would lose about 8 digits.
    rng = np.random.default_rng(14)
    q, k, v, _, _ = random_inputs(rng, (2,), 40, 4, 3)
    log_f = -rng.uniform(0.0, 0.1, size=(2, 40))
    log_f[:, 1] = -1e8
    d_out = rng.standard_normal(v.shape)
    o_want, _, grads_want = fox_by_masks(q, k, v, log_f, d_out)
    assert rel_err(fpa.fox_attention_direct(q, k, v, log_f), o_want) < 1e-14
    got = fpa.fox_attention_vjp(q, k, v, log_f, d_out)
    assert rel_err(got.dlog_f, grads_want[3]) < 1e-13


# (G1)-(G4) gradients


def fpa_outputs(q, k, v, field, level, scale=None):
    return fpa.fpa_attention(q, k, v, field, level, scale=scale, return_lse=True)


@pytest.mark.parametrize(("lead", "T", "dk", "dv"), SHAPES)
@pytest.mark.parametrize("wrt", ["q", "k", "v", "field", "level", "all"])
def test_vjp_matches_central_differences(lead, T, dk, dv, wrt):
    rng = np.random.default_rng(100 + T)
    for _ in range(50):  # keep the point at least 0.05 away from every kink (h = 1e-3)
        q, k, v, field, level = random_inputs(rng, lead, T, dk, dv)
        if fpa_kink_margin(field, level) > 0.05:
            break
    else:
        pytest.fail("no draw 0.05 away from the kinks")
    inputs = dict(q=q, k=k, v=v, field=field, level=level)
    d_out = rng.standard_normal(v.shape)
    d_lse = rng.standard_normal(field.shape)
    grads = fpa.fpa_attention_vjp(**inputs, d_out=d_out, d_lse=d_lse)._asdict()
    grads = {name[1:]: g for name, g in grads.items()}
    names = list(inputs) if wrt == "all" else [wrt]
    direction = {n: rng.standard_normal(inputs[n].shape) for n in names}
    check = directional_check(fpa_outputs, inputs, [d_out, d_lse], grads, direction, h=1e-3)
    assert check.passes(1e-9), check


def test_vjp_shapes_and_dtype():
    rng = np.random.default_rng(7)
    args = random_inputs(rng, (2, 1), 5, 3, 4)
    g = fpa.fpa_attention_vjp(*args, d_out=np.ones((2, 1, 5, 4)))
    for grad, x in zip(g, args, strict=True):
        assert grad.shape == x.shape
        assert grad.dtype == np.float64


@pytest.mark.parametrize("unit_gate_fraction", [0.0, 0.5, 1.0])
def test_tie_conventions_fpa_gradients_equal_fox_gradients(unit_gate_fraction):
    # Through (F6), with ties from gates f = 1, FPA's conventions must reproduce FoX exactly.
    rng = np.random.default_rng(8)
    q, k, v, _, _ = random_inputs(rng, (2,), 10, 3, 2)
    log_f = -rng.exponential(0.7, size=(2, 10))
    log_f[rng.random((2, 10)) < unit_gate_fraction] = 0.0
    d_out = rng.standard_normal(v.shape)
    c = np.cumsum(log_f, axis=-1)
    g = fpa.fpa_attention_vjp(q, k, v, c, c, d_out)
    dc = g.dfield + g.dlevel
    dlog_f_chain = np.cumsum(dc[..., ::-1], axis=-1)[..., ::-1]  # adjoint of cumsum
    ref = fpa.fox_attention_vjp(q, k, v, log_f, d_out)
    for got, want in [(g.dq, ref.dq), (g.dk, ref.dk), (g.dv, ref.dv), (dlog_f_chain, ref.dlog_f)]:
        assert rel_err(got, want) < 1e-12


def test_fox_vjp_matches_central_differences():
    rng = np.random.default_rng(9)
    q, k, v, _, _ = random_inputs(rng, (2,), 9, 3, 2)
    log_f = -rng.exponential(0.5, size=(2, 9)) - 0.1
    d_out = rng.standard_normal(v.shape)
    g = fpa.fox_attention_vjp(q, k, v, log_f, d_out)._asdict()
    grads = {name[1:]: x for name, x in g.items()}
    inputs = dict(q=q, k=k, v=v, log_f=log_f)
    direction = {n: rng.standard_normal(x.shape) for n, x in inputs.items()}

    def fox(q, k, v, log_f):
        return [fpa.fox_attention_direct(q, k, v, log_f)]

    check = directional_check(fox, inputs, [d_out], grads, direction, h=1e-3)
    assert check.passes(1e-9), check


def test_field_gradient_goes_to_latest_argmin_on_ties():
    # field has a tie in the segment of (i=3, j=0): positions 1 and 3 both reach -1.
    q = np.zeros((4, 1))
    k = np.zeros((4, 1))
    v = np.arange(4.0)[:, None]
    field = np.array([0.0, -1.0, 0.5, -1.0])
    level = np.array([0.0, 5.0, 5.0, 5.0])
    d_out = np.zeros((4, 1))
    d_out[3] = 1.0
    g = fpa.fpa_attention_vjp(q, k, v, field, level, d_out)
    # Row 3: key 0 (level 0 >= m = -1) is active with t* = 3; keys 1, 2 also have t* = 3.
    assert g.dfield[1] == 0.0
    assert g.dfield[3] != 0.0
    assert g.dfield.sum() == pytest.approx(-g.dlevel.sum(), abs=1e-15)


# section 4 liveness


def bracket_field(rng, T):
    steps = rng.choice([1.0, -1.0, 0.0], size=T, p=[0.4, 0.3, 0.3])
    return np.cumsum(steps)


@pytest.mark.parametrize("kind", ["gaussian", "integer", "bracket"])
def test_stack_simulation_equals_definition(kind):
    rng = np.random.default_rng(10)
    for T in [1, 2, 5, 16, 40]:
        if kind == "gaussian":
            field = np.cumsum(rng.standard_normal((3, T)), axis=-1)
        elif kind == "integer":
            field = np.cumsum(rng.integers(-1, 2, size=(3, T)), axis=-1).astype(float)
        else:
            field = np.stack([bracket_field(rng, T) for _ in range(3)])
        assert (fpa.stack_live_keys(field) == fpa.live_keys(field, field)).all()


def test_brackets_keep_open_scopes():
    # "a ( b ( c ) d ) e": delta +1 on "(", -1 on ")". At "e", "(", "b" "(" "c" ")" "d" ")" closed.
    tokens = list("a(b(c)d)e")
    delta = [{"(": 1.0, ")": -1.0}.get(t, 0.0) for t in tokens]
    field = np.cumsum(delta)
    live = fpa.live_keys(field, field)
    at_d = [tokens[j] for j in np.flatnonzero(live[6])]
    assert at_d == ["a", "(", "b", ")", "d"]  # inner block "( c" forgotten, outer scope kept
    at_e = [tokens[j] for j in np.flatnonzero(live[8])]
    assert at_e == ["a", ")", "e"]


# (F7) decoding


@pytest.mark.parametrize(("lead", "T", "dk", "dv"), SHAPES)
def test_decode_without_eviction_equals_parallel(lead, T, dk, dv):
    rng = np.random.default_rng(11)
    args = random_inputs(rng, lead, T, dk, dv)
    res = fpa.fpa_decode(*args, theta=np.inf)
    assert rel_err(res.o, fpa.fpa_attention(*args)) < 1e-13
    assert res.kept_fraction == 1.0
    assert (res.cache_sizes == np.arange(1, T + 1)).all()


@pytest.mark.parametrize("eps", [1e-2, 1e-4, 1e-8])
def test_decode_with_eviction_respects_t3(eps):
    rng = np.random.default_rng(12)
    T, dk = 64, 4
    q, k, v, field, level = random_inputs(rng, (3,), T, dk, 3)
    field, level = 10 * field, 10 * level  # deep descents: many keys evictable
    s = 1 / np.sqrt(dk)
    U = s * np.abs(q @ np.swapaxes(k, -1, -2)).max()
    theta = fpa.eviction_threshold(U, T, eps)
    res = fpa.fpa_decode(q, k, v, field, level, theta=theta)
    deviation = np.linalg.norm(res.o - fpa.fpa_attention(q, k, v, field, level), axis=-1).max()
    assert res.kept_fraction < 0.9  # eviction happened
    assert deviation <= 2 * eps * np.linalg.norm(v, axis=-1).max()


def test_decoder_cache_is_the_live_stack_when_theta_small():
    rng = np.random.default_rng(13)
    field = bracket_field(rng, 30) * 100.0
    dec = fpa.FPADecoder(scale=1.0, theta=1.0)
    live = fpa.live_keys(field, field)
    for t in range(30):
        dec.step(np.zeros(1), np.zeros(1), np.zeros(1), field[t], field[t])
        assert dec.positions == list(np.flatnonzero(live[t]))
    assert dec.kept_fraction == max(live[t].sum() for t in range(30)) / 30


# bad input


def good(T=4):
    rng = np.random.default_rng(0)
    return dict(
        zip(["q", "k", "v", "field", "level"], random_inputs(rng, (2, 3), T, 4, 5), strict=True)
    )


BAD = [
    ("q", lambda a: a["q"][0, 0, 0], "q: expected at least 2 dimensions"),
    ("k", lambda a: a["k"][:, :2], "k: expected shape (2, 3, 4, 4)"),
    ("k", lambda a: a["k"][..., :3], "k: expected shape (2, 3, 4, 4)"),
    ("v", lambda a: a["v"][:, :, :3], "v: expected shape (2, 3, 4) + (dv,)"),
    ("field", lambda a: a["field"][..., :3], "field: expected shape (2, 3, 4)"),
    ("level", lambda a: a["level"][0], "level: expected shape (2, 3, 4)"),
    ("q", lambda a: a["q"].astype(int), "q: expected a real floating-point array, got dtype int"),
    ("v", lambda a: a["v"] + 0j, "v: expected a real floating-point array, got dtype complex"),
    ("field", lambda a: np.where(np.arange(4) == 2, np.nan, a["field"]), "field: contains NaN"),
    ("k", lambda a: a["k"] * np.inf, "k: contains NaN or Inf"),
]


@pytest.mark.parametrize(("name", "corrupt", "message"), BAD)
def test_bad_input_names_the_argument(name, corrupt, message):
    args = good()
    args[name] = corrupt(args)
    with pytest.raises(ValueError, match=re.escape(message)):
        fpa.fpa_attention(**args)


# Every public op of the FPA reference, called on the arrays of good() (log_f from the field).
OPS = {
    "fpa_attention": lambda a: fpa.fpa_attention(**a),
    "fpa_attention_loops": lambda a: fpa.fpa_attention_loops(**a),
    "fpa_attention_vjp": lambda a: fpa.fpa_attention_vjp(**a, d_out=np.ones_like(a["v"])),
    "fox_attention": lambda a: fpa.fox_attention(a["q"], a["k"], a["v"], -abs(a["field"])),
    "fox_attention_direct": lambda a: fpa.fox_attention_direct(
        a["q"], a["k"], a["v"], -abs(a["field"])
    ),
    "fox_attention_vjp": lambda a: fpa.fox_attention_vjp(
        a["q"], a["k"], a["v"], -abs(a["field"]), np.ones_like(a["v"])
    ),
    "fpa_decode": lambda a: fpa.fpa_decode(**a, theta=1.0),
}
FIELD_OPS = {
    "segment_min": lambda f: fpa.segment_min(f),
    "segment_argmin": lambda f: fpa.segment_argmin(f),
    "descent_depth": lambda f: fpa.descent_depth(f, f),
    "live_keys": lambda f: fpa.live_keys(f, f),
    "stack_live_keys": lambda f: fpa.stack_live_keys(f),
    "segment_min_tiled": lambda f: fpa.segment_min_tiled(f, 2),
}
EMPTY = {
    "T = 0": lambda a: {n: x[..., :0, :] if x.ndim == 4 else x[..., :0] for n, x in a.items()},
    "dk = 0": lambda a: {**a, "q": a["q"][..., :0], "k": a["k"][..., :0]},
    "dv = 0": lambda a: {**a, "v": a["v"][..., :0]},
    "B = 0": lambda a: {n: x[:0] for n, x in a.items()},
}


# An empty batch gives empty results, as SDPA does [decision]; the loop and decode forms reject it.
EMPTY_BATCH_OPS = ("fpa_attention", "fpa_attention_vjp", "fox_attention", "fox_attention_vjp")


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("empty", sorted(EMPTY))
def test_empty_axes_rejected(op, empty):
    # Before: dk = 0 gave scale 1/sqrt(0) and NaN; T = 0 or dv = 0 an empty answer.
    if empty == "B = 0" and op in EMPTY_BATCH_OPS:
        pytest.skip("an empty batch is accepted: test_empty_batch_gives_empty_results")
    with pytest.raises(ValueError, match="expected every axis to have length >= 1, got shape"):
        OPS[op](EMPTY[empty](good()))


@pytest.mark.parametrize("op", EMPTY_BATCH_OPS)
def test_empty_batch_gives_empty_results(op):
    args = good()  # batch dims (2, 3)
    full, empty = OPS[op](args), OPS[op](EMPTY["B = 0"](args))
    if op.endswith("_vjp"):  # one gradient per input, shaped like it
        assert [g.shape for g in empty] == [(0, *g.shape[1:]) for g in full]
    else:
        assert empty.shape == (0, *full.shape[1:])


def test_empty_batch_lse_and_mismatched_batch():
    args = EMPTY["B = 0"](good())
    o, lse = fpa.fpa_attention(**args, return_lse=True)
    assert (o.shape, lse.shape) == ((0, 3, 4, 5), (0, 3, 4))
    with pytest.raises(ValueError, match=re.escape("k: expected the leading dims (0, 3) of q")):
        fpa.fpa_attention(**{**args, "k": good()["k"]})
    with pytest.raises(ValueError, match="q: expected a real floating-point array"):
        fpa.fpa_attention(**{**args, "q": args["q"].astype(int)})


@pytest.mark.parametrize("op", sorted(FIELD_OPS))
def test_empty_field_rejected(op):
    with pytest.raises(ValueError, match=r"field: expected every axis .*got shape \(2, 0\)"):
        FIELD_OPS[op](np.zeros((2, 0)))


@pytest.mark.parametrize("op", sorted(OPS))
def test_logits_that_would_overflow_are_rejected(op):
    # |q| |k| ~ 1e320 made the logits inf and the output NaN.
    args = good()
    args["q"], args["k"] = args["q"] * 1e160, args["k"] * 1e160
    with pytest.raises(ValueError, match=r"q, k, scale: expected \|s\| max_i \|\|q_i\|\|"):
        OPS[op](args)


def test_logit_bound_is_on_the_product():
    args = good()
    o = fpa.fpa_attention(**args)
    # Huge q against tiny k: the logits, hence the outputs, are those of the unscaled inputs.
    big_small = {**args, "q": args["q"] * 1e200, "k": args["k"] * 1e-200}
    assert rel_err(fpa.fpa_attention(**big_small), o) < 1e-13
    # Just inside the bound (|s| |q| |k| ~ 1e306): finite, with one-hot rows.
    near = fpa.fpa_attention(**{**args, "q": args["q"] * 1e153, "k": args["k"] * 1e153})
    assert np.isfinite(near).all()
    with pytest.raises(ValueError, match="q, k, scale"):
        fpa.fpa_attention(**args, scale=1e308)


@pytest.mark.parametrize("scale", ["0.5", b"1", True, np.array([0.5]), 1j, [0.5], None])
def test_scale_must_be_a_real_number(scale):
    args = good()
    if scale is None:  # the default is allowed; the others are rejected
        assert rel_err(fpa.fpa_attention(**args, scale=None), fpa.fpa_attention(**args)) == 0
        return
    with pytest.raises(ValueError, match="scale: expected a real number, got"):
        fpa.fpa_attention(**args, scale=scale)
    with pytest.raises(ValueError, match="scale: expected a real number, got"):
        fpa.FPADecoder(scale=scale)
    assert fpa.fpa_attention(**args, scale=np.float32(0.5)).shape == args["v"].shape


def test_positive_log_f_rejected():
    a = good()
    log_f = np.full((2, 3, 4), -0.1)
    log_f[1, 2, 3] = 0.2
    with pytest.raises(ValueError, match=r"log_f: expected log forget gates <= 0, got 0.2"):
        fpa.fox_attention(a["q"], a["k"], a["v"], log_f)


def test_bad_scale_theta_and_cotangent():
    a = good()
    with pytest.raises(ValueError, match="scale: expected a finite number"):
        fpa.fpa_attention(**a, scale=np.nan)
    with pytest.raises(ValueError, match="theta: expected a positive number"):
        fpa.fpa_decode(**a, theta=0.0)
    with pytest.raises(ValueError, match="d_out: expected shape"):
        fpa.fpa_attention_vjp(**a, d_out=np.zeros((2, 3, 4, 4)))


@pytest.mark.parametrize(
    ("bound_logit", "n_keys", "eps", "message"),
    [
        (1.0, 10, 0.0, "eps: expected a positive number, got 0.0"),
        (1.0, 10, -0.1, "eps: expected a positive number, got -0.1"),
        (1.0, 10, 1.0, "eps: expected 0 < eps < 1, got 1.0"),
        (1.0, 10, np.nan, "eps: expected a finite number, got nan"),
        (1.0, 10, "0.1", "eps: expected a real number, got '0.1'"),
        (1.0, 0, 0.1, "n_keys: expected an integer >= 1, got 0"),
        (1.0, 2.5, 0.1, "n_keys: expected an integer >= 1, got 2.5"),
        (1.0, True, 0.1, "n_keys: expected an integer >= 1, got True"),
        (-1.0, 10, 0.1, "bound_logit: expected U >= 0 (a bound on |logits|), got -1.0"),
        (np.inf, 10, 0.1, "bound_logit: expected a finite number, got inf"),
    ],
)
def test_eviction_threshold_bad_arguments(bound_logit, n_keys, eps, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fpa.eviction_threshold(bound_logit, n_keys, eps)


def test_eviction_threshold_is_t3_and_positive():
    assert fpa.eviction_threshold(1.5, 10, 0.01) == 3.0 + np.log(10) - np.log(0.01)
    assert fpa.eviction_threshold(0.0, 1, 0.999) > 0  # the smallest theta is still accepted
    assert fpa.eviction_threshold(0.0, np.int64(1), np.float32(0.5)) == pytest.approx(np.log(2))


def test_decoder_step_names_bad_arguments_and_keeps_its_cache():
    dec = fpa.FPADecoder(scale=0.5)
    with pytest.raises(ValueError, match=re.escape("q: expected one token's query, shape (dk,)")):
        dec.step(np.ones((2, 3)), np.ones((2, 3)), np.ones(3), 0.0, 0.0)
    with pytest.raises(ValueError, match=re.escape("v: expected one token's value, shape (dv,)")):
        dec.step(np.ones(3), np.ones(3), np.ones((1, 2)), 0.0, 0.0)
    dec.step(np.ones(3), np.ones(3), np.ones(2), 0.0, 0.0)
    bad_steps = [
        ((np.ones(4), np.ones(4), np.ones(2), 0.0, 0.0), "q: expected shape (3,)"),
        ((np.ones(3), np.ones(3), np.ones(5), 0.0, 0.0), "v: expected shape (2,)"),
        ((np.ones(3), np.ones(3), np.ones(2), np.nan, 0.0), "field: expected a finite number"),
        ((np.ones(3), np.ones(3), np.ones(2), 0.0, "0"), "level: expected a real number"),
        ((np.full(3, 1e308), np.ones(3), np.ones(2), 0.0, 0.0), "q, k, scale: expected"),
        ((np.ones(3), np.full(3, 1e308), np.ones(2), 0.0, 0.0), "q, k, scale: expected"),
    ]
    for args, message in bad_steps:
        with pytest.raises(ValueError, match=re.escape(message)):
            dec.step(*args)
        assert (dec.steps, dec.cache_size, dec.mins) == (1, 1, [np.inf])


def test_skippable_needs_every_sequence_of_a_batch():
    # Sequence 0 descends 10 below the key's level, sequence 1 descends 200: with theta = 50 the
    # key is live in sequence 0, so the block cannot be skipped for the batch.
    field = np.array([[0.0, 0.0, -10.0, 0.0], [0.0, 0.0, -100.0, 0.0]])
    level = np.array([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    pi = fpa.descent_depth(field, level)
    assert pi[0, 2, 0] == 10.0 and pi[1, 2, 0] == 200.0
    assert not fpa.tile_skippable(field, level, (0, 0), 2, 50.0)
    assert fpa.tile_skippable(field[1], level[1], (0, 0), 2, 50.0)
    assert fpa.tile_skippable(field, level, (0, 0), 2, 10.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda f: fpa.tile_skippable(f, f, (0.5, 1), 2, 1.0), "keys: expected an integer >= 0"),
        (lambda f: fpa.tile_skippable(f, f, (0,), 2, 1.0), "keys: expected a pair (j0, j1)"),
        (lambda f: fpa.tile_skippable(f, f, (0, 1), 2, -1.0), "theta: expected a positive"),
        (lambda f: fpa.tile_skippable(f, f, (0, 1), 9, 1.0), "expected j0 <= j1 < i0 < T = 5"),
        (lambda f: fpa.segment_min_tiled(f, "4"), "block: expected an integer >= 1, got '4'"),
        (lambda f: fpa.segment_min_tiled(f, 2.5), "block: expected an integer >= 1, got 2.5"),
        (lambda f: fpa.segment_min_tiled(f, 0), "block: expected an integer >= 1, got 0"),
    ],
)
def test_tile_helpers_name_bad_arguments(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(np.arange(5.0))


# the layer (section 3)


def test_layer_equals_per_head_fpa():
    p = fpa.init_fpa_params(d=6, H=2, dk=3, dv=2, seed=1)
    p["b_delta"] = np.array([0.3, -0.2])
    x = np.random.default_rng(30).standard_normal((2, 9, 6))
    y = fpa.fpa_layer(x, p)
    outs = []
    for h in range(2):
        delta = x @ p["w_delta"][:, h] + p["b_delta"][h]
        phi = np.cumsum(delta, axis=-1)
        level = phi + x @ p["w_lam"][:, h] + p["b_lam"][h]
        cols = slice(3 * h, 3 * h + 3)
        q, k = x @ p["wq"][:, cols], x @ p["wk"][:, cols]
        v = x @ p["wv"][:, 2 * h : 2 * h + 2]
        outs.append(fpa.fpa_attention_loops(q, k, v, phi, level))
    np.testing.assert_allclose(y, np.concatenate(outs, axis=-1) @ p["wo"], rtol=1e-12)


def test_layer_names_bad_parameters():
    with pytest.raises(ValueError, match=r"d: expected an integer >= 1, got 0"):
        fpa.init_fpa_params(d=0, H=1, dk=2, dv=2)
    p = fpa.init_fpa_params(d=4, H=2, dk=2, dv=2)
    p["b_delta"] = np.float64(0.0)
    with pytest.raises(ValueError, match=re.escape("params: expected b_delta (H,)")):
        fpa.fpa_layer(np.zeros((1, 3, 4)), p)


def test_fox_initialised_layer_is_fox():
    p = fpa.init_fpa_params(d=4, H=1, dk=2, dv=2, seed=2)
    p["w_lam"][:] = 0.0
    x = np.random.default_rng(31).standard_normal((1, 8, 4))
    log_f = -np.logaddexp(0.0, -(x @ p["w_delta"][:, 0]))
    want = fpa.fox_attention_direct(x @ p["wq"], x @ p["wk"], x @ p["wv"], log_f) @ p["wo"]
    np.testing.assert_allclose(fpa.fpa_layer(x, p, increments="logsigmoid"), want, rtol=1e-12)


# section 7 tiles


@pytest.mark.parametrize("block", [1, 3, 4, 16, 64])
def test_tiled_segment_min_equals_direct(block):
    rng = np.random.default_rng(40)
    for T in (1, 5, 16, 37):
        field = np.cumsum(rng.standard_normal((2, T)), axis=-1)
        np.testing.assert_array_equal(fpa.segment_min_tiled(field, block), fpa.segment_min(field))


def test_skippable_tiles_are_evictable_for_every_later_query():
    rng = np.random.default_rng(41)
    T, block, theta = 64, 8, 3.0
    skipped = 0
    for _ in range(20):
        field = 2 * np.cumsum(rng.standard_normal(T))
        level = field + rng.standard_normal(T)
        pi = fpa.descent_depth(field, level)
        for j0 in range(0, T, block):
            for i0 in range(j0 + block, T, block):
                if fpa.tile_skippable(field, level, (j0, j0 + block - 1), i0, theta):
                    skipped += 1
                    assert (pi[i0:, j0 : j0 + block] >= theta).all()
    assert skipped > 50  # the statement was exercised


def test_the_numpy_backend_skips_a_zero_length_packed_sequence():
    # [decision, as FlashAttention's varlen]: offsets (0, 2, 2, 4) are (0, 2), (2, 4) and an
    # empty sequence that contributes nothing.
    from attnspec.conformance.numpy_backend import NumpyBackend

    args = {name: x[:1, :1] for name, x in good().items()}  # B = 1, T = 4
    backend = NumpyBackend()
    got = backend.fpa_attention(**args, cu_seqlens=(0, 2, 2, 4))
    parts = [
        fpa.fpa_attention(*(x[..., a:e, :] if x.ndim == 4 else x[..., a:e] for x in args.values()))
        for a, e in [(0, 2), (2, 4)]
    ]
    np.testing.assert_array_equal(got, np.concatenate(parts, axis=-2))
    with pytest.raises(ValueError, match=re.escape("expected non-decreasing offsets")):
        backend.fpa_attention(**args, cu_seqlens=(0, 3, 2, 4))


# (F3w) the window


@pytest.mark.parametrize("window", [1, 2, 5, 13, 40])
def test_window_vectorised_equals_literal_loops(window):
    rng = np.random.default_rng(window)
    args = random_inputs(rng, (2,), 13, 3, 2)
    o, lse = fpa.fpa_attention(*args, window=window, return_lse=True)
    o_loop, lse_loop = fpa.fpa_attention_loops(*args, window=window, return_lse=True)
    assert rel_err(o, o_loop) < 1e-13
    assert rel_err(lse, lse_loop) < 1e-13
    if window >= 13:  # the window covers every causal pair
        assert rel_err(o, fpa.fpa_attention(*args)) < 1e-15


def test_window_one_returns_the_values():
    rng = np.random.default_rng(3)
    q, k, v, field, level = random_inputs(rng, (2,), 7, 3, 4)
    o, lse = fpa.fpa_attention(q, k, v, field, level, window=1, return_lse=True)
    assert np.array_equal(o, v)  # (F3w) W = 1: each query sees its own key only
    assert rel_err(lse, np.sum(q * k, axis=-1) / np.sqrt(3)) < 1e-15


@pytest.mark.parametrize("window", [1, 3, 9])
def test_window_fox_forms_agree(window):
    rng = np.random.default_rng(40 + window)
    q, k, v, _, _ = random_inputs(rng, (2,), 9, 3, 2)
    log_f = -rng.exponential(0.5, size=(2, 9))
    o = fpa.fox_attention(q, k, v, log_f, window=window)
    assert rel_err(o, fpa.fox_attention_direct(q, k, v, log_f, window=window)) < 1e-12
    d_out = rng.standard_normal(v.shape)
    c = np.cumsum(log_f, axis=-1)
    g = fpa.fpa_attention_vjp(q, k, v, c, c, d_out, window=window)
    dlog_f_chain = np.cumsum((g.dfield + g.dlevel)[..., ::-1], axis=-1)[..., ::-1]
    ref = fpa.fox_attention_vjp(q, k, v, log_f, d_out, window=window)
    for got, want in [(g.dq, ref.dq), (g.dk, ref.dk), (g.dv, ref.dv), (dlog_f_chain, ref.dlog_f)]:
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("window", [1, 2, 4])
def test_window_vjp_matches_central_differences(window):
    rng = np.random.default_rng(200 + window)
    for _ in range(50):
        q, k, v, field, level = random_inputs(rng, (2,), 9, 3, 2)
        if fpa_kink_margin(field, level) > 0.05:
            break
    else:
        pytest.fail("no draw 0.05 away from the kinks")
    inputs = dict(q=q, k=k, v=v, field=field, level=level)
    d_out, d_lse = rng.standard_normal(v.shape), rng.standard_normal(field.shape)
    grads = fpa.fpa_attention_vjp(**inputs, d_out=d_out, d_lse=d_lse, window=window)._asdict()
    grads = {name[1:]: g for name, g in grads.items()}
    direction = {n: rng.standard_normal(x.shape) for n, x in inputs.items()}

    def outputs(q, k, v, field, level):
        return fpa.fpa_attention(q, k, v, field, level, window=window, return_lse=True)

    check = directional_check(outputs, inputs, [d_out, d_lse], grads, direction, h=1e-3)
    assert check.passes(1e-9), check
    # (F3w) the pairs outside the window add nothing, to (G3) included: with W = 1 only the
    # diagonal remains, where pi_ii = 0, so the field and the levels get no gradient at all
    if window == 1:
        assert not grads["field"].any() and not grads["level"].any()


@pytest.mark.parametrize("window", [0, -1, 1.5, True, "2"])
def test_bad_window_names_the_argument(window):
    rng = np.random.default_rng(0)
    args = random_inputs(rng, (), 4, 2, 2)
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        fpa.fpa_attention(*args, window=window)
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        fpa.fox_attention(*args[:3], -np.ones(4), window=window)
