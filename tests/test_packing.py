"""Packed sequences (reference/packing.py): the one rule, its plan, and every backend keeping to
it. That every backend computes the same values on zero-length sequences is the kit's
``*/empty_segment`` families (run on every backend by its kit test)."""

from __future__ import annotations

import importlib.util
from itertools import pairwise

import numpy as np
import pytest

from attnspec.conformance import cases
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.reference import fpa
from attnspec.reference.packing import packing

GOOD = [(0, 9), (0, 0, 9), (0, 3, 3, 3, 9), (0, 9, 9), (0, 1, 2, 9)]
# (offsets, T, words of the message)
BAD = [
    ((0, 4, 3, 9), 9, "non-decreasing"),
    ((1, 9), 9, "from 0 to T = 9"),
    ((0, 8), 9, "from 0 to T = 9"),
    ((0,), 9, "at least 2 offsets"),
    ((0.0, 9.0), 9, "integer offsets"),
]


@pytest.mark.parametrize("offsets", GOOD)
def test_the_plan_against_a_literal_walk(offsets):
    T = offsets[-1]
    plan = packing(np.asarray(offsets, dtype=np.int32), T)
    assert plan is not None and plan.offsets == offsets
    bounds = [(a, b) for a, b in pairwise(offsets) if b > a]
    assert list(plan.bounds) == bounds
    assert plan.has_empty == (len(bounds) < len(offsets) - 1)
    assert plan.kept == tuple(n for n in range(len(offsets) - 1) if offsets[n + 1] > offsets[n])
    assert list(pairwise(plan.nonempty_offsets)) == bounds
    ids = [n for n in range(len(offsets) - 1) for _ in range(offsets[n], offsets[n + 1])]
    np.testing.assert_array_equal(plan.segment_ids(), ids)
    for size in (1, 2, 4, 64):
        rows = []
        for n in range(len(offsets) - 1):
            t = offsets[n]
            while t < offsets[n + 1]:
                rows.append((n, t, min(t + size, offsets[n + 1])))
                t += size
        np.testing.assert_array_equal(plan.chunks(size), np.asarray(rows).reshape(-1, 3))


@pytest.mark.parametrize(("offsets", "T", "words"), BAD)
def test_offsets_against_the_rule_are_refused_by_name(offsets, T, words):
    with pytest.raises(ValueError, match="cu_seqlens: .*" + words):
        packing(offsets, T)


def test_packing_needs_one_batch_row_and_none_is_no_packing():
    assert packing(None, 9) is None
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need B = 1, got B = 2"):
        packing((0, 9), 9, batch=2)


def _draw(T: int):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, T, 8)) for _ in range(3))
    field = np.cumsum(rng.standard_normal((1, 2, T)), axis=-1)
    return q, k, v, field, field.copy()


def _numpy_call(offsets, T):
    q, k, v, field, level = _draw(T)
    return NumpyBackend().fpa_attention(q, k, v, field, level, cu_seqlens=offsets)


def _torch_call(offsets, T):
    import torch

    from attnspec.backends.torch import fpa_attention

    q, k, v, field, level = (torch.from_numpy(x) for x in _draw(T))
    tq, tk, tv = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    fl, lv = field.transpose(1, 2).contiguous(), level.transpose(1, 2).contiguous()
    return fpa_attention(tq, tk, tv, fl, lv, cu_seqlens=torch.tensor(offsets))


def _jax_call(offsets, T):
    from attnspec.backends.jax import fpa_attention

    q, k, v, field, level = (np.swapaxes(x, 1, 2) for x in _draw(T))
    return fpa_attention(q, k, v, field, level, cu_seqlens=offsets)


CALLS = {"numpy": (_numpy_call, None), "torch": (_torch_call, "torch"), "jax": (_jax_call, "jax")}


@pytest.mark.parametrize("backend", sorted(CALLS))
@pytest.mark.parametrize(("offsets", "T", "words"), BAD[:3])
def test_every_backend_refuses_with_the_same_words(backend, offsets, T, words):
    call, framework = CALLS[backend]
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    with pytest.raises(ValueError, match="cu_seqlens: .*" + words):
        call(offsets, T)


@pytest.mark.parametrize("backend", sorted(CALLS))
def test_every_backend_takes_a_zero_length_sequence(backend):
    call, framework = CALLS[backend]
    if framework and importlib.util.find_spec(framework) is None:
        pytest.skip(f"{framework} is not installed")
    with_empty = np.asarray(call((0, 4, 4, 9), 9))
    without = np.asarray(_numpy_call((0, 4, 9), 9))
    if backend != "numpy":
        with_empty = np.swapaxes(with_empty, 1, 2)
    # JAX without x64 computes the float64 inputs in float32
    tol = 1e-12 if with_empty.dtype == np.float64 else 2e-6
    np.testing.assert_allclose(with_empty, without, rtol=tol, atol=tol)


def test_a_padded_fox_batch_is_each_row_alone_and_zero_at_padding():
    # the reference adapter's padding (fox/padded) against a literal loop over rows: FoX on
    # the row's present positions alone, 0 at the others; the VJP likewise
    case = cases.build_case("fox/padded/1")
    x, present = case.inputs, case.params["present"]
    backend = NumpyBackend()
    o = backend.fox_attention(**x, present=present)
    d_o = np.random.default_rng(0).standard_normal(o.shape)
    grads = backend.vjp("fox_attention", x, case.params, {"o": d_o})
    for b in range(present.shape[0]):
        idx = np.flatnonzero(present[b])
        row = {n: np.take(a[b], idx, axis=-1 if n == "log_f" else -2) for n, a in x.items()}
        row["k"], row["v"] = np.repeat(row["k"], 2, axis=0), np.repeat(row["v"], 2, axis=0)
        expected = fpa.fox_attention(**row)
        np.testing.assert_allclose(o[b][:, idx], expected, rtol=1e-12, atol=1e-12)
        assert not np.delete(o[b], idx, axis=-2).any()
        g = fpa.fox_attention_vjp(**row, d_out=d_o[b][:, idx])
        np.testing.assert_allclose(grads["q"][b][:, idx], g.dq, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads["log_f"][b][:, idx], g.dlog_f, rtol=1e-10, atol=1e-12)
        summed = g.dk.reshape(2, 2, *g.dk.shape[1:]).sum(axis=1)  # GQA: 4 query heads, 2 kv
        np.testing.assert_allclose(grads["k"][b][:, idx], summed, rtol=1e-10, atol=1e-12)
        for name in ("q", "k", "v"):
            assert not np.delete(grads[name][b], idx, axis=-2).any()
