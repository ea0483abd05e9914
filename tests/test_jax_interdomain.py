"""The JAX backend's Interdomain ops, decode state and layers against the reference."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drawers import features, positive, s4d_parameters
from jax_support import canonical, x64  # noqa: F401  (x64: autouse fixture)

from attnspec.backends.jax import (
    fpa_layer,
    fpa_layer_prefill,
    fpa_layer_state,
    fpa_layer_step,
    init_fpa_params,
    init_interdomain_params,
    interdomain_layer,
    interdomain_layer_prefill,
    interdomain_layer_state,
    interdomain_layer_step,
    interdomain_legs,
    interdomain_s4d,
    interdomain_s4d_step,
    s4d_state,
)
from attnspec.conformance.metrics import relative_error as rel
from attnspec.reference import fpa as ref_fpa
from attnspec.reference import interdomain as ref


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_matches_the_reference_with_every_gradient(readout):
    B, T, N, R, dv, M = 2, 37, 3, 4, 5, 6
    rng = np.random.default_rng(0)
    lam, b, c = s4d_parameters(rng, N, M, readout)
    fq, kt = features(rng, (2, B, T, N, R), readout)
    vt = rng.standard_normal((B, T, N, dv))
    do = rng.standard_normal((B, T, N, dv))
    pairs = (lam.real, lam.imag, b.real, b.imag, c.real, c.imag)

    def op(fq, kt, vt, lr, li, br, bi, cr, ci):  # complex parameters as (re, im) pairs
        lam, b, c = lr + 1j * li, br + 1j * bi, cr + 1j * ci
        return interdomain_s4d(fq, kt, vt, lam, b, c, readout=readout, chunk=8, validate=False)

    o, pullback = jax.vjp(op, *(jnp.asarray(x) for x in (fq, kt, vt, *pairs)))
    grads = pullback(jnp.asarray(do))
    args = (canonical(fq), canonical(kt), canonical(vt), lam, b, c)
    assert rel(canonical(o), ref.interdomain_s4d(*args, readout=readout)) <= 1e-12
    g = ref.interdomain_s4d_vjp(*args, canonical(do), readout=readout)
    expected = [g.dfq, g.dkt, g.dvt]
    expected += [part for z in (g.dlam, g.db, g.dc) for part in (z.real, z.imag)]
    for got, want in zip(grads, expected, strict=True):
        assert rel(canonical(got) if got.ndim == 4 else got, want) <= 1e-12


def test_s4d_packed_sequences_and_long_memory_in_float32():
    """Per-segment equality with the reference (a length-1 segment included), and T = 2048 with
    |Lambda| ~ 0.999 in float32: the carried states keep the float32 tolerance."""
    rng = np.random.default_rng(1)
    N, R, M = 2, 4, 8
    lam, b, c = s4d_parameters(rng, N, M)
    cu = (0, 1, 40, 41, 70)
    fq, kt, vt = rng.standard_normal((3, 1, 70, N, R))
    o = interdomain_s4d(*(jnp.asarray(x) for x in (fq, kt, vt, lam, b, c)), cu_seqlens=cu, chunk=16)
    for start, stop in itertools.pairwise(cu):
        part = [canonical(x[:, start:stop]) for x in (fq, kt, vt)]
        assert rel(canonical(o[:, start:stop]), ref.interdomain_s4d(*part, lam, b, c)) <= 1e-12

    lam, b, c = s4d_parameters(rng, N, M, dt=(1e-3, 2e-3))
    fq, kt, vt = rng.standard_normal((3, 1, 2048, N, R)).astype(np.float32)
    complex64 = [jnp.asarray(x, jnp.complex64) for x in (lam, b, c)]
    o = interdomain_s4d(*(jnp.asarray(x) for x in (fq, kt, vt)), *complex64)
    expected = ref.interdomain_s4d(*(canonical(x) for x in (fq, kt, vt)), *complex64)
    assert o.dtype == jnp.float32
    assert rel(canonical(o), expected) <= 1e-5


def test_s4d_decode_steps_equal_the_parallel_op():
    """(H6): the fixed-size state, one token at a time, reproduces the chunked op."""
    rng = np.random.default_rng(2)
    B, T, N, R, dv, M = 2, 9, 2, 3, 4, 5
    for readout in ("linear", "ratio"):
        lam, b, c = s4d_parameters(rng, N, M, readout)
        fq, kt = features(rng, (2, B, T, N, R), readout)
        vt = rng.standard_normal((B, T, N, dv))
        x = [jnp.asarray(a) for a in (fq, kt, vt, lam, b, c)]
        full = interdomain_s4d(*x, readout=readout, chunk=4)
        state = s4d_state(B, N, M, R, dv, readout=readout, dtype=jnp.complex128)
        for t in range(T):
            o, state = interdomain_s4d_step(
                state, x[0][:, t], x[1][:, t], x[2][:, t], *x[3:], readout=readout
            )
            assert rel(o, np.asarray(full[:, t])) <= 1e-12
        assert state.x.shape == (B, N, M, R + dv + (readout == "ratio"))  # does not grow with T


@pytest.mark.parametrize("M", [1, 4, 16])
def test_legs_matches_the_reference(M):
    rng = np.random.default_rng(M)
    B, T, N, R, dv = 2, 37, 2, 3, 4
    fq, fk = positive(rng, (2, B, T, N, R))
    v = rng.standard_normal((B, T, N, dv))
    do = rng.standard_normal((B, T, N, dv))
    o, pullback = jax.vjp(
        lambda *a: interdomain_legs(*a, M, chunk=8), *(jnp.asarray(x) for x in (fq, fk, v))
    )
    args = [canonical(x) for x in (fq, fk, v)]
    assert rel(canonical(o), ref.interdomain_legs(*args, M)) <= 1e-12
    if M > 1:  # with M = 1 the readout ignores fq and fk: their gradients vanish
        expected = ref.interdomain_legs_vjp(*args, M, canonical(do))
        for got, want in zip(pullback(jnp.asarray(do)), expected, strict=True):
            assert rel(canonical(got), want) <= 1e-12


def test_layers_take_the_reference_parameter_dicts():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 11, 8))
    params = ref_fpa.init_fpa_params(8, 2, 4, 3, seed=1)
    for increments in ("signed", "logsigmoid"):
        expected = ref_fpa.fpa_layer(x, params, increments=increments)
        assert rel(fpa_layer(jnp.asarray(x), params, increments=increments), expected) <= 1e-12
    params = ref.init_interdomain_params(8, 2, 4, 3, 5, seed=2, gate=True)
    params["norm_k_b"] += 3.0  # positive k~: the ratio readout's denominator stays away from 0
    params["c_re"] += np.eye(5)
    for kw in ({"readout": "linear"}, {"readout": "ratio", "use_rope": True, "gate": True}):
        expected = ref.interdomain_layer(x, params, **kw)
        assert rel(interdomain_layer(jnp.asarray(x), params, **kw), expected) <= 1e-12
    grads = jax.grad(lambda p: jnp.sum(interdomain_layer(jnp.asarray(x), p) ** 2))(
        {k: jnp.asarray(v) for k, v in params.items()}
    )
    assert set(grads) == set(params) and all(np.all(np.isfinite(g)) for g in grads.values())


def test_bad_input_is_named():
    rng = np.random.default_rng(4)
    lam, b, c = (jnp.asarray(x) for x in s4d_parameters(rng, 2, 3))
    fq = jnp.zeros((1, 5, 2, 4))
    vt = jnp.zeros((1, 5, 2, 3))
    cases = [
        (lambda: interdomain_s4d(fq, fq, vt, lam, b, c, readout="soft"), "readout: expected"),
        (lambda: interdomain_s4d(fq, fq[:, :4], vt, lam, b, c), "kt: expected shape"),
        (lambda: interdomain_s4d(fq, fq, vt, lam[:1], b, c), r"lam: expected shape \(2, M\)"),
        (lambda: interdomain_s4d(fq, fq, vt, lam, b, c[:, :2]), "c: expected shape"),
        (lambda: interdomain_s4d(fq, fq, vt, 1.5 * lam / jnp.abs(lam), b, c), r"\|Lambda\| <= 1"),
        (lambda: interdomain_s4d(fq, fq, vt, lam, b.at[0, 0].set(jnp.nan), c), "b: contains NaN"),
        (lambda: interdomain_s4d(fq[:, :0], fq[:, :0], vt[:, :0], lam, b, c), "T >= 1"),
        (lambda: interdomain_s4d(fq, fq, vt.astype(jnp.float16), lam, b, c), "vt: expected dtype"),
        (lambda: interdomain_legs(fq, fq, vt, 0), "M: expected an integer >= 1"),
        (lambda: interdomain_legs(fq, fq.astype(jnp.int32), vt, 4), "fk: expected dtype"),
        (lambda: fpa_layer(jnp.zeros((1, 3, 8)), {"wq": jnp.zeros((8, 8))}), "params: missing"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_interdomain_layer_without_output_norm_is_the_paper_literal_reference_layer():
    x = np.random.default_rng(5).standard_normal((2, 9, 8))
    params = ref.init_interdomain_params(8, 2, 4, 3, 5, seed=3, output_norm=False)
    expected = ref.interdomain_layer(x, params, output_norm=False)
    assert rel(interdomain_layer(jnp.asarray(x), params, output_norm=False), expected) <= 1e-12
    with pytest.raises(ValueError, match=r"params: missing \['norm_o_g'\]"):
        interdomain_layer(jnp.asarray(x), params)


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_interdomain_output_rms_at_initialisation_is_order_one_for_every_length(readout):
    # (I11) zero-order hold and (I14) output norm; before, the linear readout's RMS grew from
    # ~90 at T = 16 to ~9,000 at T = 4,096. float32, as a model would run.
    params = init_interdomain_params(jax.random.key(0), 16, 2, 8, 8, 16)
    for T in (16, 4096):
        x = jax.random.normal(jax.random.key(T), (1, T, 16), jnp.float32)
        y = interdomain_layer(x, params, readout=readout)
        rms = float(jnp.sqrt(jnp.mean(y.astype(jnp.float32) ** 2)))
        assert y.dtype == jnp.float32 and 0.1 <= rms <= 10, (T, rms)


def test_initialisers_draw_the_reference_schema_from_a_key():
    p = init_interdomain_params(jax.random.key(1), 8, 2, 4, 3, 5, gate=True)
    assert set(p) == set(ref.PARAMETER_SCHEMA)
    assert all(v.dtype == jnp.float32 for v in p.values())
    assert p["norm_o_g"].shape == (2, 3) and bool(jnp.all(p["b_re"] == 1.0))
    again = init_interdomain_params(jax.random.key(1), 8, 2, 4, 3, 5, gate=True)
    assert all(bool(jnp.array_equal(p[k], again[k])) for k in p)
    other = init_interdomain_params(jax.random.key(2), 8, 2, 4, 3, 5)
    assert "wg" not in other and not bool(jnp.array_equal(p["wq"], other["wq"]))
    q = init_fpa_params(jax.random.key(1), 8, 2, 4, 3, dtype=jnp.float64)
    assert {k: v.shape for k, v in q.items()} == {
        k: v.shape for k, v in ref_fpa.init_fpa_params(8, 2, 4, 3).items()
    }
    x = jnp.ones((1, 5, 8))
    assert fpa_layer(x, q).shape == (1, 5, 8)


def test_empty_batch_gives_empty_outputs_and_gradients():
    rng = np.random.default_rng(6)
    lam, b, c = (jnp.asarray(x) for x in s4d_parameters(rng, 2, 3))
    fq = jnp.ones((0, 5, 2, 4))
    vt = jnp.ones((0, 5, 2, 3))
    assert interdomain_s4d(fq, fq, vt, lam, b, c).shape == (0, 5, 2, 3)
    assert interdomain_legs(fq, fq, vt, 3).shape == (0, 5, 2, 3)
    g = jax.grad(lambda f, b: jnp.sum(interdomain_s4d(f, f, vt, lam, b, c)), (0, 1))(fq, b)
    assert g[0].shape == fq.shape and bool(jnp.all(g[1] == 0))
    params = init_interdomain_params(0, 8, 2, 4, 3, 5)
    x = jnp.ones((0, 7, 8))
    assert interdomain_layer(x, params).shape == (0, 7, 8)
    grads = jax.grad(lambda p: jnp.sum(interdomain_layer(x, p)))(params)
    assert all(bool(jnp.all(v == 0)) for v in grads.values())
    assert fpa_layer(x, init_fpa_params(0, 8, 2, 4, 3)).shape == (0, 7, 8)


def test_a_zero_length_packed_sequence_contributes_nothing():
    # [decision, as FlashAttention's varlen]: offsets (0, 4, 4, 9) are (0, 4), (4, 9) and an
    # empty sequence
    rng = np.random.default_rng(7)
    lam, b, c = s4d_parameters(rng, 2, 3)
    fq, kt, vt = (rng.standard_normal((1, 9, 2, d)) for d in (4, 4, 3))
    got = interdomain_s4d(
        *(jnp.asarray(x) for x in (fq, kt, vt, lam, b, c)), cu_seqlens=(0, 4, 4, 9)
    )
    parts = [
        ref.interdomain_s4d(*(np.swapaxes(x[:, a:e], 1, 2) for x in (fq, kt, vt)), lam, b, c)
        for a, e in [(0, 4), (4, 9)]
    ]
    assert rel(canonical(got), np.concatenate(parts, axis=-2)) <= 1e-12


@pytest.mark.parametrize(
    "kw", [{}, {"readout": "ratio", "use_rope": True, "gate": True}, {"output_norm": False}]
)
def test_interdomain_layer_decodes_as_the_reference_layer(kw):
    # prefill 6 tokens, then one step per token: the reference's parallel layer, token by token
    x = np.random.default_rng(8).standard_normal((2, 11, 8))
    params = ref.init_interdomain_params(8, 2, 4, 3, 5, seed=4, gate=True, output_norm=True)
    if kw.get("readout") == "ratio":  # positive k~: the denominator stays away from 0
        params["norm_k_b"] += 3.0
        params["c_re"] += np.eye(5)
    expected = ref.interdomain_layer(x, params, **kw)
    state = interdomain_layer_state(
        params, 2, readout=kw.get("readout", "linear"), dtype=jnp.float64
    )
    head, state = interdomain_layer_prefill(jnp.asarray(x[:, :6]), params, state, **kw)
    tail = []
    for t in range(6, 11):
        y, state = interdomain_layer_step(jnp.asarray(x[:, t]), params, state, **kw)
        tail.append(y)
    assert int(state.position) == 11 and state.ssm.x.shape == (
        2,
        2,
        5,
        7 + (kw.get("readout") == "ratio"),
    )
    assert rel(jnp.concatenate([head, jnp.stack(tail, 1)], 1), expected) <= 1e-12


@pytest.mark.parametrize("increments", ["signed", "logsigmoid"])
def test_fpa_layer_decodes_as_the_reference_layer(increments):
    x = np.random.default_rng(9).standard_normal((2, 11, 8))
    params = ref_fpa.init_fpa_params(8, 2, 4, 3, seed=5)
    expected = ref_fpa.fpa_layer(x, params, increments=increments)
    state = fpa_layer_state(params, 2, 11, dtype=jnp.float64)
    head, state = fpa_layer_prefill(jnp.asarray(x[:, :6]), params, state, increments=increments)
    tail = []
    for t in range(6, 11):
        y, state = fpa_layer_step(jnp.asarray(x[:, t]), params, state, increments=increments)
        tail.append(y)
    assert rel(jnp.concatenate([head, jnp.stack(tail, 1)], 1), expected) <= 1e-12
    assert not bool(jnp.any(state.cache.overflowed))
