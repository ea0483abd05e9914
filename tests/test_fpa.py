"""Tests of reference/fpa.py against independent computations (loops, brute force, FoX, FD)."""

import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnspec.conformance.cases import fpa_kink_margin
from attnspec.conformance.gradcheck import directional_check
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


def rel_err(x, ref):
    return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-300)


# ------------------------------------------------------------------------- (F1)-(F5) forward


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


# ------------------------------------------------------------------------- (F6) FoX


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


# ------------------------------------------------------------------------- (G1)-(G4) gradients


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


# ------------------------------------------------------------------------- section 4 liveness


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


# ------------------------------------------------------------------------- (F7) decoding


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


# ------------------------------------------------------------------------- bad input


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


def test_empty_sequence_rejected():
    args = good()
    args = {n: x[..., :0, :] if x.ndim == 4 else x[..., :0] for n, x in args.items()}
    with pytest.raises(ValueError, match="T >= 1, got T = 0"):
        fpa.fpa_attention(**args)


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


# ------------------------------------------------------------------------- the layer (section 3)


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


def test_fox_initialised_layer_is_fox():
    p = fpa.init_fpa_params(d=4, H=1, dk=2, dv=2, seed=2)
    p["w_lam"][:] = 0.0
    x = np.random.default_rng(31).standard_normal((1, 8, 4))
    log_f = -np.logaddexp(0.0, -(x @ p["w_delta"][:, 0]))
    want = fpa.fox_attention_direct(x @ p["wq"], x @ p["wk"], x @ p["wv"], log_f) @ p["wo"]
    np.testing.assert_allclose(fpa.fpa_layer(x, p, increments="logsigmoid"), want, rtol=1e-12)


# ------------------------------------------------------------------------- section 7 tiles


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
