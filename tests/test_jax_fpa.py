"""The JAX backend's FPA, FoX and FPA decoding against the reference (the XLA implementation).

Every comparison is with attnspec.reference (float64, hand-written VJPs) or with an independent
formula; float64 runs inside ``jax.enable_x64`` for the test only (the fixture below).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drawers import gated
from jax_support import canonical, draw, reference_fpa, x64  # noqa: F401  (x64: autouse fixture)

from attnspec.backends.jax import (
    fox_attention,
    fpa_attention,
    fpa_cache,
    fpa_decode,
    fpa_decode_step,
)
from attnspec.conformance.metrics import relative_error as rel
from attnspec.reference import fpa as ref

TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3, "bfloat16": 2e-2}
GRAD_TOL = {"float64": 1e-12, "float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


def run_fpa(args, do, dlse, dtype, **kw):
    q, k, v, field, level = args
    wide = "float64" if dtype == "float64" else "float32"
    inputs = [jnp.asarray(x, dtype) for x in (q, k, v)]
    inputs += [jnp.asarray(x, wide) for x in (field, level)]
    (o, lse), pullback = jax.vjp(lambda *a: fpa_attention(*a, return_lse=True, **kw), *inputs)
    grads = pullback((jnp.asarray(do, dtype), jnp.asarray(dlse, lse.dtype)))
    return o, lse, grads, inputs


def rounded(args, dtype):
    """The inputs as the op sees them (q, k, v in dtype; field, level float32 or wider)."""
    wide = "float64" if dtype == "float64" else "float32"
    return [
        np.asarray(jnp.asarray(x, dtype if i < 3 else wide), dtype=np.float64)
        for i, x in enumerate(args)
    ]


CASES = [
    # (B, T, N, K, H, Hv, block, dtype, field kind): GQA, ragged T over several tiles, T = 1,
    # ties across tile borders, half precision
    (2, 70, 4, 2, 8, 5, 16, "float64", "walk"),
    (1, 1, 1, 1, 4, 4, 128, "float64", "walk"),
    (1, 40, 2, 2, 8, 8, 16, "float64", "brackets"),
    (1, 40, 2, 2, 8, 8, 16, "float64", "constant"),
    (1, 40, 2, 1, 8, 8, 16, "float32", "walk"),
    (1, 40, 2, 2, 8, 8, 16, "bfloat16", "walk"),
    (1, 40, 2, 2, 8, 8, 16, "float16", "walk"),
]


@pytest.mark.parametrize("B, T, N, K, H, Hv, block, dtype, field_kind", CASES)
def test_fpa_matches_reference(B, T, N, K, H, Hv, block, dtype, field_kind):
    args = draw(B, T, N, K, H, Hv, seed=T + N, field_kind=field_kind)
    rng = np.random.default_rng(1)
    do, dlse = rng.standard_normal((B, T, N, Hv)), rng.standard_normal((B, T, N))
    do, dlse = (np.asarray(jnp.asarray(x, dtype), dtype=np.float64) for x in (do, dlse))
    o, lse, grads, inputs = run_fpa(args, do, dlse, dtype, block_size=block)
    ref_o, ref_lse, ref_grads = reference_fpa(*rounded(args, dtype), do, dlse)
    assert o.dtype == jnp.dtype(dtype)
    assert lse.dtype == jnp.dtype("float64" if dtype == "float64" else "float32")
    assert rel(canonical(o), ref_o) <= TOL[dtype]
    assert rel(canonical(lse), ref_lse) <= TOL[dtype]
    for name, g, r, x in zip("q k v field level".split(), grads, ref_grads, inputs, strict=True):
        assert g.dtype == x.dtype, name  # each gradient in its input's dtype
        assert rel(canonical(g), r) <= GRAD_TOL[dtype], name


def test_fox_matches_reference_and_the_fpa_chain_with_unit_gates():
    """FoX against the reference's direct formula; and (F6): jax.grad through fpa_attention with
    field = level = cumsum(log f) equals FoX's gradient, also with gates f = 1 (ties)."""
    B, T, N, H = 1, 50, 2, 8
    rng = np.random.default_rng(3)
    args = gated(rng, B, T, N, N, H, H, unit=0.4)  # the reference layout (B, N, T, ...)
    do = rng.standard_normal((B, T, N, H))
    x = [jnp.asarray(np.swapaxes(a, 1, 2)) for a in args]
    o, pullback = jax.vjp(lambda *a: fox_attention(*a, block_size=16), *x)
    grads = pullback(jnp.asarray(do))
    assert rel(canonical(o), ref.fox_attention_direct(*args)) <= 1e-12
    expected = ref.fox_attention_vjp(*args, canonical(do))
    for g, r in zip(grads, expected, strict=True):
        assert rel(canonical(g), r) <= 1e-12

    def through_fpa(log_f):
        c = jnp.cumsum(log_f, axis=1)
        return jnp.vdot(fpa_attention(x[0], x[1], x[2], c, c, block_size=16), do)

    chained = jax.grad(through_fpa)(x[3])
    assert rel(chained, np.asarray(grads[3])) <= 1e-12


def test_fox_keeps_float32_precision_after_large_decays():
    """Decay sums run over (j, i] only: weak gates after a few closed ones (log f = -1000) keep
    float32 an order of magnitude inside its tolerance, where the difference of a global float32
    cumsum, c_i - c_j with |c| ~ 4000, fails it fivefold (so this test can fail)."""
    B, T, N, H = 1, 512, 1, 16
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((3, B, T, N, H)).astype(np.float32)
    log_f = -rng.exponential(0.02, (B, T, N))
    log_f[:, [37, 150, 290, 400]] = -1000.0
    log_f = log_f.astype(np.float32)
    expected = ref.fox_attention(*(canonical(a) for a in (q, k, v, log_f)))
    got = fox_attention(*(jnp.asarray(a) for a in (q, k, v, log_f)))
    assert rel(canonical(got), expected) <= TOL["float32"] / 10
    c = np.cumsum(log_f[0, :, 0], dtype=np.float32)  # the global cumsum, rounded in float32
    bias = (c[:, None] - c[None, :]).astype(np.float64)
    logits = canonical(q)[0, 0] @ canonical(k)[0, 0].T / 4.0 + bias
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    p = np.exp(logits - logits.max(1, keepdims=True))
    naive = (p / p.sum(1, keepdims=True)) @ canonical(v)[0, 0]
    assert rel(naive, expected[0, 0]) > 5 * TOL["float32"]


def test_packed_sequences_match_the_reference_per_segment():
    cu = (0, 1, 20, 45)
    args = draw(1, 45, 2, 2, 8, 4, seed=5)
    rng = np.random.default_rng(6)
    do, dlse = rng.standard_normal((1, 45, 2, 4)), rng.standard_normal((1, 45, 2))
    o, _, grads, _ = run_fpa(args, do, dlse, "float64", block_size=16, cu_seqlens=cu)
    r_o, _, r_grads = reference_fpa(*args, do, dlse, cu_seqlens=cu)
    for start, stop in itertools.pairwise(cu):  # each sequence on its own scale
        assert rel(canonical(o[:, start:stop]), r_o[:, :, start:stop]) <= 1e-12
        for g, r in zip(grads, r_grads, strict=True):
            assert rel(canonical(g[:, start:stop]), r[:, :, start:stop]) <= 1e-12


def test_memory_grows_linearly_with_T():
    """Blockwise: the compiled forward+backward needs O(T * block) scratch, far below one T x T
    float32 buffer, and 4x the length needs about 4x the scratch (a T x T form: 16x)."""

    def scratch(T):
        x = jax.ShapeDtypeStruct((1, T, 1, 16), jnp.float32)
        s = jax.ShapeDtypeStruct((1, T, 1), jnp.float32)

        def loss(q, k, v, f, lev):
            return jnp.sum(fpa_attention(q, k, v, f, lev, validate=False))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, x, x, s, s).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = scratch(2048), scratch(8192)
    assert large < 8192 * 8192 * 4 / 8
    assert large / small < 5


BAD = [
    (lambda a: {**a, "q": a["q"][0]}, "q: expected 4 dimensions"),
    (lambda a: {**a, "k": a["k"][:, :-1]}, "k: expected shape"),
    (lambda a: {**a, "k": jnp.concatenate([a["k"]] * 3, axis=2)}, "k: expected a number of heads"),
    (lambda a: {**a, "v": a["v"][:, :, :, :0]}, "v: expected shape"),
    (lambda a: {**a, "v": a["v"].astype(jnp.float16)}, "v: expected dtype float32"),
    (lambda a: {**a, "field": a["field"].astype(jnp.int32)}, "field: expected dtype"),
    (lambda a: {**a, "level": a["level"][:, :, :1]}, "level: expected shape"),
    (lambda a: {**a, "field": a["field"].at[0, 3, 1].set(jnp.nan)}, "field: contains NaN"),
    (lambda a: {**a, "level": a["level"].at[0, 2, 0].set(jnp.inf)}, "level: contains NaN or Inf"),
    (lambda a: {k: x[:, :0] for k, x in a.items()}, "q: expected a sequence of length T >= 1"),
    (lambda a: {**a, "q": a["q"].astype(jnp.int32)}, "q: expected dtype"),
]
KW_BAD = [
    ({"scale": "0.5"}, "scale: expected a real number"),
    ({"scale": float("nan")}, "scale: expected a finite number"),
    ({"implementation": "cuda"}, "implementation: expected one of"),
    ({"block_size": 48}, "block_size: expected a power of two"),
    ({"cu_seqlens": (0, 5, 3, 12)}, "cu_seqlens: expected non-decreasing offsets"),
    ({"cu_seqlens": (0, 5)}, "cu_seqlens: expected offsets from 0 to T = 12"),
]


def _good():
    q, k, v, field, level = draw(1, 12, 2, 2, 4, 4, seed=7)
    names = ("q", "k", "v", "field", "level")
    return {
        n: jnp.asarray(x, jnp.float32) for n, x in zip(names, (q, k, v, field, level), strict=True)
    }


@pytest.mark.parametrize("mutate, message", BAD)
def test_bad_arrays_are_named(mutate, message):
    with pytest.raises(ValueError, match=message):
        fpa_attention(**mutate(_good()))


@pytest.mark.parametrize("kw, message", KW_BAD)
def test_bad_options_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        fpa_attention(**_good(), **kw)


def test_log_gates_are_checked_eagerly_and_shapes_under_jit():
    a = _good()
    positive = (-jnp.abs(a["field"])).at[0, 4, 1].set(0.25)
    with pytest.raises(ValueError, match=r"log_f: expected log forget gates <= 0, got 0.25"):
        fox_attention(a["q"], a["k"], a["v"], positive)
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need B = 1"):
        fox_attention(
            *(jnp.concatenate([x, x]) for x in (a["q"], a["k"], a["v"])),
            -jnp.ones((2, 12, 2)),
            cu_seqlens=(0, 12),
        )
    # under jit the static checks still raise; value checks are documented as eager-only
    jitted = jax.jit(lambda q, k, v, f: fox_attention(q, k, v, f))
    with pytest.raises(ValueError, match="log_f: expected shape"):
        jitted(a["q"], a["k"], a["v"], a["field"][:, :, :1])
    assert jnp.all(jnp.isfinite(jitted(a["q"], a["k"], a["v"], -jnp.abs(a["field"]))))


def test_value_checks_copy_no_input_to_the_host(monkeypatch):
    """An eager call reads two verdicts per checked input, not the input: NumPy sees field,
    level and log_f only when a check fails and the message names the first bad index."""
    from attnspec.backends.jax import validation

    copied = []

    class Watched:
        def __getattr__(self, name):
            return getattr(np, name)

        def asarray(self, x, *args, **kwargs):
            copied.append(np.shape(x))
            return np.asarray(x, *args, **kwargs)

    monkeypatch.setattr(validation, "np", Watched())
    a = _good()
    fpa_attention(**a)
    fox_attention(a["q"], a["k"], a["v"], -jnp.abs(a["field"]))
    assert copied == []
    with pytest.raises(
        ValueError, match=r"level: contains NaN or Inf \(first at index \(0, 3, 1\)"
    ):
        fpa_attention(**(a | {"level": a["level"].at[0, 3, 1].set(jnp.nan)}))
    assert copied == [a["level"].shape]


# decoding


def test_decode_without_eviction_equals_the_parallel_op():
    q, k, v, field, level = (jnp.asarray(x) for x in draw(2, 33, 4, 2, 8, 4, seed=8))
    o, cache = fpa_decode(q, k, v, field, level)
    assert rel(o, np.asarray(fpa_attention(q, k, v, field, level))) <= 1e-12
    assert np.all(np.asarray(cache.kept_fraction) == 1.0)
    assert not np.any(np.asarray(cache.overflowed))


def test_decode_with_eviction_matches_the_reference_decoder():
    B, T, N = 2, 130, 2
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((3, B, T, N, 8))
    field = 4.0 * np.cumsum(rng.choice([1.0, -1.0, 0.0], (B, T, N)), axis=1)
    level = field.copy()
    theta = 8.0  # equals occurring depths: (F7) evicts at pi >= theta
    expected = ref.fpa_decode(*(canonical(a) for a in (q, k, v, field, level)), theta=theta)
    o, cache = fpa_decode(*(jnp.asarray(a) for a in (q, k, v, field, level)), theta=theta)
    assert rel(canonical(o), expected.o) <= 1e-12
    peaks = np.asarray(cache.peak)
    np.testing.assert_array_equal(peaks, expected.cache_sizes.max(axis=-1))
    assert float(np.mean(peaks / T)) == expected.kept_fraction
    assert expected.kept_fraction < 1.0  # eviction really happened


def test_decode_steps_compose_and_a_full_cache_fails_loudly():
    """A full cache (6 keys, 4 slots, no eviction): eagerly a ValueError naming the capacity,
    with the cache passed in unchanged; under jit the ``overflowed`` flag."""
    q, k, v, field, level = (jnp.asarray(x) for x in draw(1, 6, 2, 1, 4, 3, seed=10))
    cache = fpa_cache(1, 2, 4, 4, 3, dtype=jnp.float64)
    outs = []
    for t in range(4):
        o, cache = fpa_decode_step(cache, q[:, t], k[:, t], v[:, t], field[:, t], level[:, t])
        outs.append(o)
    full, _ = fpa_decode(q, k, v, field, level)
    np.testing.assert_allclose(np.stack(outs, 1), full[:, :4], rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="capacity: the cache of 4 slots per head is full"):
        fpa_decode_step(cache, q[:, 4], k[:, 4], v[:, 4], field[:, 4], level[:, 4])
    assert int(cache.steps) == 4 and not np.any(np.asarray(cache.overflowed))  # unchanged
    step = jax.jit(lambda c, *x: fpa_decode_step(c, *x))
    _, jitted = step(cache, q[:, 4], k[:, 4], v[:, 4], field[:, 4], level[:, 4])
    assert np.all(np.asarray(jitted.overflowed))
    with pytest.raises(ValueError, match="capacity: the cache of 5 slots per head is full"):
        fpa_decode(q, k, v, field, level, capacity=5)
    with pytest.raises(ValueError, match="cache: expected shape"):
        fpa_decode_step(
            fpa_cache(2, 2, 4, 4, 3), q[:, 0], k[:, 0], v[:, 0], field[:, 0], level[:, 0]
        )


@pytest.mark.parametrize("theta", [0.0, -1.0, float("nan"), 2 + 1j])
def test_decode_rejects_a_threshold_that_is_not_positive(theta):
    q, k, v, field, level = (jnp.asarray(x) for x in draw(1, 4, 2, 1, 4, 3, seed=11))
    with pytest.raises(ValueError, match="theta: expected a positive threshold"):
        fpa_decode(q, k, v, field, level, theta=theta)


# drop-in gates, empty batches and sequences


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_gates_are_widened_to_float32(dtype):
    # parallel_forgetting_attn(q, k, v, g) takes g in the input dtype: the drop-in call equals
    # the call with the gates widened first (they carry no more precision), gradients included
    a = {n: x.astype(dtype) for n, x in _good().items()}
    g = -jnp.abs(a["field"])
    o, lse = fox_attention(a["q"], a["k"], a["v"], g, return_lse=True)
    wide = fox_attention(a["q"], a["k"], a["v"], g.astype(jnp.float32), return_lse=True)
    assert o.dtype == dtype and lse.dtype == jnp.float32
    assert bool(jnp.array_equal(o, wide[0])) and bool(jnp.array_equal(lse, wide[1]))
    grad = jax.grad(lambda g: jnp.sum(fox_attention(a["q"], a["k"], a["v"], g)))(g)
    assert grad.dtype == dtype
    half = fpa_attention(a["q"], a["k"], a["v"], a["field"], a["level"])
    widened = [a[n].astype(jnp.float32) for n in ("field", "level")]
    assert bool(jnp.array_equal(half, fpa_attention(a["q"], a["k"], a["v"], *widened)))
    token = [a[n][:, 0] for n in ("q", "k", "v", "field", "level")]
    step, _ = fpa_decode_step(fpa_cache(1, 2, 4, 4, 4), *token)
    wide_step, _ = fpa_decode_step(
        fpa_cache(1, 2, 4, 4, 4), *token[:3], *(x[:, 0] for x in widened)
    )
    assert bool(jnp.array_equal(step, wide_step))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_empty_batch_gives_empty_outputs_and_gradients(implementation):
    a = {n: x[:0] for n, x in _good().items()}
    o, lse = fpa_attention(**a, return_lse=True, implementation=implementation)
    assert (o.shape, o.dtype, lse.shape, lse.dtype) == (
        (0, 12, 2, 4),
        a["q"].dtype,
        (0, 12, 2),
        jnp.float32,
    )
    gates = -jnp.abs(a["field"])
    assert fox_attention(a["q"], a["k"], a["v"], gates, implementation=implementation).shape == (
        0,
        12,
        2,
        4,
    )
    grads = jax.grad(lambda q, f: jnp.sum(fpa_attention(q, a["k"], a["v"], f, a["level"])), (0, 1))(
        a["q"], a["field"]
    )
    assert [g.shape for g in grads] == [a["q"].shape, a["field"].shape]


def test_traced_scale_is_named():
    a = _good()
    with pytest.raises(ValueError, match="scale must be a static Python number"):
        jax.jit(lambda s: fpa_attention(**a, scale=s))(0.5)
    fixed = jax.jit(fpa_attention, static_argnames="scale")(**a, scale=0.5)
    assert bool(jnp.array_equal(fixed, fpa_attention(**a, scale=0.5)))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_a_zero_length_packed_sequence_contributes_nothing(implementation):
    # [decision, as FlashAttention's varlen]: (0, 5, 5, 12) is (0, 5), (5, 12) and an empty one
    args = draw(1, 12, 2, 2, 4, 4, seed=8)
    rng = np.random.default_rng(9)
    do, dlse = rng.standard_normal((1, 12, 2, 4)), rng.standard_normal((1, 12, 2))
    kw = dict(cu_seqlens=(0, 5, 5, 12), implementation=implementation, block_size=16)
    o, _, grads, _ = run_fpa(args, do, dlse, "float64", **kw)
    r_o, _, r_grads = reference_fpa(*args, do, dlse, cu_seqlens=(0, 5, 12))
    for start, stop in [(0, 5), (5, 12)]:
        assert rel(canonical(o[:, start:stop]), r_o[:, :, start:stop]) <= 1e-12
        for g, r in zip(grads, r_grads, strict=True):
            assert rel(canonical(g[:, start:stop]), r[:, :, start:stop]) <= 1e-12
    gates = -np.abs(args[3])
    got = fox_attention(*(jnp.asarray(x) for x in (*args[:3], gates)), **kw)
    for start, stop in [(0, 5), (5, 12)]:
        want = fox_attention(*(jnp.asarray(x[:, start:stop]) for x in (*args[:3], gates)))
        assert rel(got[:, start:stop], np.asarray(want)) <= 1e-12
