"""Decoding with the torch caches: the FPA KV cache with eviction (F7, T2, T3) against the
reference decoder, prefill against steps, and the fixed-size Interdomain states (H6)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import (  # noqa: E402
    FPADecodeCache,
    LegSDecodeState,
    S4DDecodeState,
    fpa_attention,
    interdomain_legs,
    interdomain_s4d,
)
from attnspec.reference import fpa  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def draw(rng, B=2, H=3, T=40, K=4, V=5):
    """Reference-layout inputs (B, H, T, .): a random-walk field and offset levels."""
    q, k = rng.standard_normal((2, B, H, T, K))
    v = rng.standard_normal((B, H, T, V))
    f = 2.0 * np.cumsum(rng.standard_normal((B, H, T)), axis=-1)
    return q, k, v, f, f + 0.5 * rng.standard_normal(f.shape)


def steps(cache, q, k, v, f, lev):
    """Decode (B, H, T, .) arrays token by token; outputs back in (B, H, T, V)."""
    t_ = [torch.from_numpy(np.ascontiguousarray(x)) for x in (q, k, v, f, lev)]
    outs = [cache.step(*(x[:, :, t] for x in t_)) for t in range(q.shape[2])]
    return torch.stack(outs, dim=2).numpy()


@pytest.mark.parametrize("theta", [np.inf, 3.0, 1.0])
def test_decode_matches_the_reference_decoder(theta):
    rng = np.random.default_rng(0)
    q, k, v, f, lev = draw(rng)
    want = fpa.fpa_decode(q, k, v, f, lev, theta=theta)
    cache = FPADecodeCache(theta=theta)
    np.testing.assert_allclose(steps(cache, q, k, v, f, lev), want.o, rtol=1e-12, atol=1e-12)
    assert cache.kept_fraction == want.kept_fraction
    np.testing.assert_array_equal(cache.cache_size.numpy(), want.cache_sizes[..., -1])
    # evicted keys are freed: the cache holds the largest live count, not T entries
    assert cache.capacity == want.cache_sizes[..., -1].max()
    if np.isfinite(theta):
        assert cache.capacity < q.shape[2]


def test_no_eviction_equals_the_parallel_op_with_gqa():
    rng = np.random.default_rng(1)
    q, k, v, f, lev = (torch.from_numpy(x) for x in draw(rng, B=1, H=4, T=25))
    k, v = k[:, :2], v[:, :2]  # two key/value heads for four query heads
    cache = FPADecodeCache()
    o = torch.stack([cache.step(*(x[:, :, t] for x in (q, k, v, f, lev))) for t in range(25)], 2)
    parallel = fpa_attention(*(x.transpose(1, 2) for x in (q, k, v, f, lev)))
    assert torch.allclose(o, parallel.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("prefill", [False, True])
def test_gqa_eviction_stores_the_union_of_the_query_heads_live_keys(prefill):
    rng = np.random.default_rng(4)
    q, k, v, f, lev = draw(rng, B=2, H=4, T=30)
    k, v = k[:, ::2], v[:, ::2]  # query heads 2h and 2h + 1 read kv head h
    theta = 2.0
    want = fpa.fpa_decode(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), f, lev, theta=theta)
    cache = FPADecodeCache(theta=theta)
    if prefill:
        swapped = (
            torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))) for x in (q, k, v, f, lev)
        )
        o = np.swapaxes(cache.prefill(*swapped).numpy(), 1, 2)
    else:
        o = steps(cache, q, k, v, f, lev)
    np.testing.assert_allclose(o, want.o, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(cache.peak.numpy(), want.cache_sizes.max(-1).flatten())
    assert cache.kept_fraction == pytest.approx(want.kept_fraction, rel=1e-15)  # a mean of counts
    np.testing.assert_array_equal(cache.cache_size.numpy(), want.cache_sizes[..., -1])
    # the last query's live keys (F2, T2), per query head; stored: their union per kv head
    depth = fpa.descent_depth(f, lev)[:, :, -1]  # [B, HQ, T]
    live = depth < theta
    union = live.reshape(2, 2, 2, -1).any(axis=2)  # [B, H, T]
    assert union.sum(-1).max() > live.sum(-1).max()  # the union rule is exercised
    assert cache.capacity == union.sum(-1).max()


@pytest.mark.parametrize("theta", [np.inf, 2.5])
def test_prefill_equals_steps_and_decoding_continues_alike(theta):
    rng = np.random.default_rng(2)
    q, k, v, f, lev = draw(rng, T=50)
    stepped = FPADecodeCache(theta=theta)
    o_steps = steps(stepped, q[:, :, :40], k[:, :, :40], v[:, :, :40], f[:, :, :40], lev[:, :, :40])
    filled = FPADecodeCache(theta=theta)
    o_fill = filled.prefill(
        *(
            torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[:, :, :40], 1, 2)))
            for x in (q, k, v, f, lev)
        )
    )
    np.testing.assert_allclose(np.swapaxes(o_fill.numpy(), 1, 2), o_steps, rtol=1e-12, atol=1e-12)
    assert filled.kept_fraction == stepped.kept_fraction
    assert filled.capacity == stepped.capacity
    rest = [x[:, :, 40:] for x in (q, k, v, f, lev)]
    np.testing.assert_allclose(steps(filled, *rest), steps(stepped, *rest), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="prefill: expected an empty cache"):
        filled.prefill(*(torch.from_numpy(np.swapaxes(x, 1, 2)) for x in (q, k, v, f, lev)))


def test_eviction_bound_t3():
    # theta = 2U + log N - log eps moves each output by at most 2 eps max ||v_j|| (T3)
    rng = np.random.default_rng(3)
    q, k, v, f, lev = draw(rng, B=1, H=2, T=60)
    scale, eps = 0.5, 1e-3
    U = scale * np.abs(np.einsum("bhik,bhjk->bhij", q, k)).max()
    theta = fpa.eviction_threshold(U, 60, eps)
    evicting, full = FPADecodeCache(theta=theta, scale=scale), FPADecodeCache(scale=scale)
    o, exact = steps(evicting, q, k, v, f, lev), steps(full, q, k, v, f, lev)
    assert evicting.kept_fraction < 1.0
    assert np.abs(o - exact).max() <= 2 * eps * np.linalg.norm(v, axis=-1).max()


def test_bad_decode_input():
    cache = FPADecodeCache(theta=2.0)
    q, k, v = torch.randn(1, 2, 4), torch.randn(1, 2, 4), torch.randn(1, 2, 3)
    f = torch.zeros(1, 2)
    cache.step(q, k, v, f, f)
    with pytest.raises(ValueError, match=r"expected the .* of the first step"):
        cache.step(q[:, :1], k[:, :1], v[:, :1], f[:, :1], f[:, :1])
    with pytest.raises(ValueError, match="field: contains NaN"):
        cache.step(q, k, v, f + float("nan"), f)
    with pytest.raises(ValueError, match="level: expected shape"):
        cache.step(q, k, v, f, f[:, :1])
    with pytest.raises(ValueError, match="theta: expected a positive number"):
        FPADecodeCache(theta=0.0)


def test_half_precision_field_and_levels_are_widened_as_by_the_parallel_op():
    rng = np.random.default_rng(8)
    q, k, v, f, lev = (torch.from_numpy(x) for x in draw(rng, B=1, H=2, T=12))
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    f, lev = f.to(torch.bfloat16), lev.to(torch.bfloat16)
    half, wide = FPADecodeCache(), FPADecodeCache()
    for t in range(12):
        o = half.step(q[:, :, t], k[:, :, t], v[:, :, t], f[:, :, t], lev[:, :, t])
        want = wide.step(
            q[:, :, t], k[:, :, t], v[:, :, t], f[:, :, t].float(), lev[:, :, t].float()
        )
        assert o.dtype == torch.bfloat16 and torch.equal(o, want)


# Interdomain


def s4d_params(H=2, M=6, dtype=torch.complex128):
    gen = torch.Generator().manual_seed(0)
    modulus = torch.exp(-torch.rand(H, M, generator=gen, dtype=torch.float64))
    phase = torch.rand(H, M, generator=gen, dtype=torch.float64)
    lam = torch.polar(modulus, phase).to(dtype)
    b = torch.randn(H, M, generator=gen, dtype=dtype)
    c = torch.eye(M, dtype=dtype) + 0.1 * torch.randn(H, M, M, generator=gen, dtype=dtype)
    return lam, b, c


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_state_steps_equal_the_chunked_op_and_do_not_grow(readout):
    gen = torch.Generator().manual_seed(1)
    fq, kt = (torch.rand(2, 30, 2, 3, generator=gen, dtype=torch.float64) + 0.1 for _ in "ab")
    vt = torch.randn(2, 30, 2, 4, generator=gen, dtype=torch.float64)
    lam, b, c = s4d_params()
    parallel = interdomain_s4d(fq, kt, vt, lam, b, c, readout=readout)
    state = S4DDecodeState(lam, b, c, readout=readout)
    first = state.prefill(fq[:, :11], kt[:, :11], vt[:, :11])
    size = state.state_size
    rest = [state.step(fq[:, t], kt[:, t], vt[:, t]) for t in range(11, 30)]
    assert torch.allclose(torch.cat([first, torch.stack(rest, 1)], 1), parallel, rtol=1e-11)
    assert state.state_size == size == 2 * 6 * (3 + 4 + (readout == "ratio"))


def test_legs_state_steps_equal_the_chunked_op():
    gen = torch.Generator().manual_seed(2)
    fq, fk = (torch.rand(1, 70, 2, 3, generator=gen, dtype=torch.float64) + 0.1 for _ in "ab")
    v = torch.randn(1, 70, 2, 4, generator=gen, dtype=torch.float64)
    state = LegSDecodeState(8)
    o = torch.stack([state.step(fq[:, t], fk[:, t], v[:, t]) for t in range(70)], 1)
    assert torch.allclose(o, interdomain_legs(fq, fk, v, 8), rtol=1e-12, atol=1e-12)
    assert state.coefficients.shape == (1, 2, 8, 7)
