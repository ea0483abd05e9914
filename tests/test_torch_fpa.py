"""The torch FPA and FoX ops against the reference, flash-linear-attention's naive FoX, and the
conventions of spec/fpa.md section 6; tiles forced small so several are crossed."""

import itertools

import numpy as np
import pytest
from drawers import attention, gated, to_ref, to_torch

torch = pytest.importorskip("torch")

from attnspec.backends.torch import dispatch, eager_fpa, fox_attention, fpa_attention, ops  # noqa: E402
from attnspec.conformance.metrics import relative_error  # noqa: E402
from attnspec.conformance.numpy_backend import NumpyBackend  # noqa: E402
from attnspec.reference import fpa  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUMPY = NumpyBackend()  # the reference as the kit runs it: per packed sequence, GQA by repeats


def reference(q, k, v, f, lev, do, dlse, scale, cu_seqlens):
    """o, lse and the gradients of q, k, v, field, level by the reference."""
    inputs = {"q": q, "k": k, "v": v, "field": f, "level": lev}
    o, lse = NUMPY.fpa_attention(**inputs, scale=scale, cu_seqlens=cu_seqlens, return_lse=True)
    params = {"scale": scale, "cu_seqlens": cu_seqlens}
    grads = NUMPY.vjp("fpa_attention", inputs, params, {"o": do, "lse": dlse})
    return o, lse, [grads[name] for name in inputs]


WALK = {"field": "walk", "level": "offset"}
TIES = {"field": "brackets", "level": "one_walk"}  # integer walk, level = field: ties (T1)
NEAR_1E4 = {**WALK, "centre": 1e4}  # penalties O(1) differences of numbers near 1e4
# (B, T, HQ, H, K, V), the kinds of field and level (drawers.attention), block, key_block,
# cu_seqlens
TILED = [
    ((2, 37, 3, 3, 8, 5), WALK, 128, None, None),  # one tile: the dense form
    ((2, 37, 3, 3, 8, 5), WALK, 8, None, None),  # query tiles, keys left of them at once
    ((2, 37, 3, 3, 8, 5), WALK, 8, 5, None),  # key blocks too: A, mid, B all in play
    ((1, 41, 4, 2, 6, 7), TIES, 6, 4, None),  # ties across tile borders, GQA 4/2
    ((1, 41, 2, 2, 6, 7), {"field": "constant", "level": "one_walk"}, 5, 3, None),  # all tied
    ((1, 40, 2, 1, 5, 4), NEAR_1E4, 7, 6, None),
    ((1, 40, 4, 2, 5, 4), TIES, 4, 3, (0, 15, 16, 40)),  # varlen, length-1 segment
    ((1, 23, 1, 1, 3, 2), WALK, 1, 1, None),  # one token per tile
]


@pytest.mark.parametrize(("shape", "kinds", "block", "key_block", "cu"), TILED)
def test_tiled_kernels_match_the_reference(shape, kinds, block, key_block, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + block)
    q, k, v, f, lev = attention(rng, B, T, HQ, H, K, V, **kinds)
    do, dlse = rng.standard_normal((B, HQ, T, V)), rng.standard_normal((B, HQ, T))
    o_ref, lse_ref, g_ref = reference(q, k, v, f, lev, do, dlse, 0.7, cu)
    args = [to_torch(x) for x in (q, k, v, f, lev)]
    offsets = None if cu is None else Packing(tuple(cu))
    tiles = dict(block=block, key_block=key_block)
    o, lse = eager_fpa.fpa_fwd(*args, 0.7, offsets, **tiles)
    grads = eager_fpa.fpa_bwd(*args, o, lse, to_torch(do), to_torch(dlse), 0.7, offsets, **tiles)
    assert relative_error(to_ref(o), o_ref) < 1e-13
    assert relative_error(to_ref(lse), lse_ref) < 1e-13
    for name, got, want in zip(("dq", "dk", "dv", "dfield", "dlevel"), grads, g_ref, strict=True):
        assert relative_error(to_ref(got), want) < 1e-12, name


def test_block_minima_and_latest_argmins_against_literal_loops():
    rng = np.random.default_rng(0)
    field = torch.from_numpy(rng.integers(-2, 3, size=(3, 12)).astype(np.float64))  # many ties
    m = eager_fpa.segment_min_block(field)
    np.testing.assert_array_equal(m.numpy(), fpa.segment_min(field.numpy()))
    tstar = eager_fpa.latest_argmin_block(field, m)
    np.testing.assert_array_equal(tstar.numpy(), fpa.segment_argmin(field.numpy()))
    B, argB = eager_fpa.prefix_min(field)
    S, argS = eager_fpa.suffix_min(field)
    for n, row in enumerate(field.tolist()):
        for t in range(len(row)):
            prefix, suffix = row[: t + 1], row[t:]
            assert B[n, t] == min(prefix) and S[n, t] == min(suffix)
            assert argB[n, t] == max(i for i in range(t + 1) if row[i] == min(prefix))
            assert argS[n, t] == max(i for i in range(t, len(row)) if row[i] == min(suffix))


def test_public_op_gradients_by_autograd_match_the_reference_in_float32():
    rng = np.random.default_rng(3)
    q, k, v, f, lev = attention(rng, 1, 50, 4, 2, 16, 8)
    do = rng.standard_normal((1, 4, 50, 8))
    _, _, g_ref = reference(q, k, v, f, lev, do, np.zeros((1, 4, 50)), None, None)
    leaves = [to_torch(x).float().requires_grad_() for x in (q, k, v, f, lev)]
    o = fpa_attention(*leaves, impl="eager")
    assert o.dtype == torch.float32 and o.shape == (1, 50, 4, 8)
    o.backward(to_torch(do).float())
    for name, leaf, want in zip(("q", "k", "v", "field", "level"), leaves, g_ref, strict=True):
        assert leaf.grad.dtype == torch.float32
        assert relative_error(to_ref(leaf.grad), want) < 2e-5, name


# FoX


@pytest.mark.parametrize(
    ("shape", "unit", "decay", "block", "key_block", "cu"),
    [
        ((2, 33, 2, 2, 8, 6), 0.0, 0.5, 8, 5, None),
        ((1, 33, 4, 2, 8, 6), 0.4, 0.5, 6, None, None),
        ((1, 33, 2, 2, 8, 6), 0.0, 20.0, 7, 7, None),  # strong decay: weights underflow
        ((1, 40, 2, 1, 5, 4), 0.3, 1.0, 4, 3, (0, 15, 16, 40)),
    ],
)
def test_fox_matches_its_own_formula_and_vjp(shape, unit, decay, block, key_block, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + block)
    q, k, v, log_f = gated(rng, B, T, HQ, H, K, V, unit=unit, decay=decay)
    do = rng.standard_normal((B, HQ, T, V))
    inputs = {"q": q, "k": k, "v": v, "log_f": log_f}
    g_ref = NUMPY.vjp("fox_attention", inputs, {"cu_seqlens": cu}, {"o": do})
    kr, vr = (np.repeat(x, HQ // H, axis=1) for x in (k, v))
    o_ref = np.zeros((B, HQ, T, V))
    for a, b in itertools.pairwise(cu or (0, T)):  # the direct formula, not through (F6)
        s = np.s_[:, :, a:b]
        o_ref[s] = fpa.fox_attention_direct(q[s], kr[s], vr[s], log_f[s])
    args = [to_torch(x) for x in (q, k, v, log_f)]
    offsets = None if cu is None else Packing(tuple(cu))
    tiles = dict(block=block, key_block=key_block)
    o, lse = eager_fpa.fox_fwd(*args, K**-0.5, offsets, **tiles)
    grads = eager_fpa.fox_bwd(*args, o, lse, to_torch(do), None, K**-0.5, offsets, **tiles)
    assert relative_error(to_ref(o), o_ref) < 1e-13
    for name, got in zip(inputs, grads, strict=True):
        assert relative_error(to_ref(got), g_ref[name]) < 1e-12, name


def test_fox_equals_fpa_through_f6_gradients_included_with_unit_gates():
    rng = np.random.default_rng(5)
    q, k, v, log_f = (to_torch(x) for x in gated(rng, 1, 30, 2, 2, 4, 3, unit=0.5))
    g1 = log_f.clone().requires_grad_()
    g2 = log_f.clone().requires_grad_()
    c = torch.cumsum(g2, dim=1)
    cot = torch.randn(1, 30, 2, 3, dtype=torch.float64)
    torch.autograd.backward(fox_attention(q, k, v, g1), cot)
    torch.autograd.backward(fpa_attention(q, k, v, c, c), cot)
    assert torch.allclose(g1.grad, g2.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fox_agrees_with_flash_linear_attention_naive(dtype):
    naive = pytest.importorskip("fla.ops.forgetting_attn.naive").naive_forgetting_attn
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 65, 4, 16, dtype=dtype, generator=gen)
    k, v = (torch.randn(2, 65, 2, 16, dtype=dtype, generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(2, 65, 4, dtype=dtype, generator=gen))
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    ours = fox_attention(*leaves, scale=0.3)
    theirs = naive(*(x.clone().requires_grad_() for x in (q, k, v, g)), scale=0.3)
    # the naive form computes in float32 whatever it is given
    assert relative_error(to_ref(ours), to_ref(theirs)) < 2e-6
    cot = torch.randn(ours.shape, dtype=dtype, generator=gen)
    ours_g = torch.autograd.grad(ours, leaves, cot)
    theirs_leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    theirs_g = torch.autograd.grad(naive(*theirs_leaves, scale=0.3), theirs_leaves, cot.float())
    for a, b in zip(ours_g, theirs_g, strict=True):
        assert relative_error(to_ref(a), to_ref(b)) < 1e-5


def test_fox_long_sequence_keeps_float32_logits_precise():
    # With a global float32 cumulative sum (|c| ~ 400 at T = 2048) the logits lose ~5e-6;
    # tile-local sums keep the float32 result near its rounding error (3e-7 measured).
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2048, 1, 16, dtype=torch.float64, generator=gen) for _ in range(3))
    log_f = -0.4 * torch.rand(1, 2048, 1, dtype=torch.float64, generator=gen)
    exact = fox_attention(q, k, v, log_f)
    single = fox_attention(q.float(), k.float(), v.float(), log_f.float())
    c = torch.cumsum(log_f.float(), dim=1)
    global_sum = fpa_attention(q.float(), k.float(), v.float(), c, c)
    error = relative_error(to_ref(single), to_ref(exact))
    global_error = relative_error(to_ref(global_sum), to_ref(exact))
    assert error < 6e-7 < 2e-6 < global_error


# dtypes


def test_half_precision_inputs_keep_wide_statistics_and_gradients():
    rng = np.random.default_rng(2)
    q, k, v, f, lev = (to_torch(x) for x in attention(rng, 1, 20, 2, 2, 8, 8))
    for dtype in (torch.float16, torch.bfloat16):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        wide = [x.float().requires_grad_() for x in (f, lev)]
        o, lse = fpa_attention(*leaves, *wide, return_lse=True)
        assert (o.dtype, lse.dtype) == (dtype, torch.float32)
        o.float().sum().backward()
        assert [x.grad.dtype for x in leaves + wide] == [dtype] * 3 + [torch.float32] * 2


def test_float64_queries_promote_a_float32_field():
    rng = np.random.default_rng(4)
    q, k, v, f, lev = (to_torch(x) for x in attention(rng, 1, 20, 2, 2, 4, 4))
    wide = [f.float().requires_grad_(), lev.float().requires_grad_()]
    o, lse = fpa_attention(q, k, v, *wide, return_lse=True)
    assert (o.dtype, lse.dtype) == (torch.float64, torch.float64)
    expected = fpa_attention(q, k, v, wide[0].double(), wide[1].double())
    assert torch.equal(o, expected)
    o.sum().backward()
    assert wide[0].grad.dtype == torch.float32


def test_autocast_behaves_as_for_sdpa():
    rng = np.random.default_rng(6)
    q, k, v, f, lev = (to_torch(x) for x in attention(rng, 1, 20, 2, 2, 8, 8))
    single = [x.float() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o = fpa_attention(*single, f.float(), lev.float())
        o64 = fpa_attention(q, k, v, f, lev)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2) for x in single)
        )
    assert o.dtype == sdpa.dtype == torch.bfloat16
    assert o64.dtype == torch.float64  # no silent change of float64, as autocast does
    bf16 = fpa_attention(*(x.bfloat16() for x in single), f.float(), lev.float())
    assert torch.equal(o, bf16)


# dispatch and bad input


def test_a_registered_kernel_is_used_by_the_custom_op_and_its_backward(monkeypatch):
    calls = []

    def traced(kernel):
        def run(*args):
            calls.append(kernel)
            return dispatch.lookup(kernel, "eager")(*args)

        return run

    # Only the eager twins: the Triton modules register their kernels when first loaded, so load
    # them now (not inside the patched registry) and leave their entries out.
    ops.load_triton_kernels()
    registry = {
        name: {impl: fn for impl, fn in impls.items() if impl == "eager"}
        for name, impls in dispatch._REGISTRY.items()
    }
    registry["fpa_fwd"]["triton"] = traced("fpa_fwd")  # a forward kernel, no backward one
    monkeypatch.setattr(dispatch, "_REGISTRY", registry)
    rng = np.random.default_rng(7)
    q, k, v, f, lev = (to_torch(x).requires_grad_() for x in attention(rng, 1, 9, 2, 2, 4, 4))
    fpa_attention(q, k, v, f, lev, impl="triton").sum().backward()
    assert calls == ["fpa_fwd"]  # the backward fell back to the eager twin
    fpa_attention(q, k, v, f, lev).sum()  # on CPU, None means eager
    assert calls == ["fpa_fwd"]
    with pytest.raises(ValueError, match="impl: no 'triton' implementation of 'fox_fwd'"):
        fox_attention(q, k, v, -f.detach().abs(), impl="triton")


def good_inputs():
    rng = np.random.default_rng(8)
    q, k, v, f, lev = (to_torch(x).float() for x in attention(rng, 1, 10, 4, 2, 4, 3))
    return dict(q=q, k=k, v=v, field=f, level=lev)


def changed(**changes):
    x = good_inputs()
    for name, fn in changes.items():
        x[name] = fn(x[name]) if callable(fn) else fn
    return x


def _set(x, index, value):
    x = x.clone()
    x[index] = value
    return x


BAD = [
    (changed(q=lambda x: x[0]), {}, "q: expected 4 dimensions"),
    (changed(k=lambda x: x.double()), {}, "k: expected the dtype of q"),
    (changed(k=lambda x: x[:, :, :1].repeat(1, 1, 3, 1)), {}, "k: expected H heads dividing"),
    (changed(v=lambda x: x[:, :9]), {}, "v: expected shape"),
    (changed(q=lambda x: x[:, :0]), {}, "T >= 1"),
    (changed(q=lambda x: x.int()), {}, "q: expected dtype"),
    (changed(field=lambda x: x.int()), {}, "field: expected dtype float64, float32, float16"),
    (changed(level=lambda x: x[..., :2]), {}, "level: expected shape"),
    (changed(level=lambda x: x.double()), {}, "level: expected the dtype of field"),
    (changed(field=lambda x: _set(x, (0, 3, 1), float("nan"))), {}, "field: contains NaN"),
    (changed(level=lambda x: _set(x, (0, 2, 0), float("inf"))), {}, "level: contains NaN or Inf"),
    (changed(field=lambda x: x.to("meta")), {}, "field: expected device cpu"),
    (good_inputs(), {"scale": "0.5"}, "scale: expected a real number"),
    (good_inputs(), {"scale": float("nan")}, "scale: expected a finite number"),
    (good_inputs(), {"impl": "cuda"}, "impl: no 'cuda' implementation"),
    (good_inputs(), {"cu_seqlens": torch.tensor([0, 4, 10.0])}, "cu_seqlens: expected dtype"),
    (good_inputs(), {"cu_seqlens": torch.tensor([1, 10])}, "cu_seqlens: expected offsets from 0"),
    (good_inputs(), {"cu_seqlens": torch.tensor([0, 9])}, "to T = 10"),
    (good_inputs(), {"cu_seqlens": torch.tensor([0, 6, 5, 10])}, "non-decreasing offsets"),
    (good_inputs(), {"cu_seqlens": torch.tensor([[0, 10]])}, "cu_seqlens: expected 1 dim"),
]


@pytest.mark.parametrize(("inputs", "kwargs", "message"), BAD)
def test_bad_input_is_a_value_error_naming_the_argument(inputs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fpa_attention(**inputs, **kwargs)


def test_bad_fox_and_packed_input():
    x = good_inputs()
    q, k, v = x["q"], x["k"], x["v"]
    gates = -x["field"].abs()
    with pytest.raises(ValueError, match=r"log_f: expected log forget gates <= 0, got 0\.5"):
        fox_attention(q, k, v, _set(gates, (0, 1, 1), 0.5))
    with pytest.raises(ValueError, match="log_f: contains NaN"):
        fox_attention(q, k, v, _set(gates, (0, 1, 1), float("-inf")))
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need B = 1"):
        two = [torch.cat([t, t]) for t in (q, k, v, gates)]
        fox_attention(*two, cu_seqlens=torch.tensor([0, 10]))


# drop-in gates, empty batches and sequences


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_gates_are_widened_to_float32(dtype):
    # parallel_forgetting_attn(q, k, v, g) takes g in the input dtype: the drop-in call works
    # and equals the call with the gates widened first (they carry no more precision).
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 24, 2, 8, generator=gen).to(dtype) for _ in range(3))
    g = torch.nn.functional.logsigmoid(torch.randn(1, 24, 2, generator=gen)).to(dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o = fox_attention(*leaves)
    wide = [x.clone().requires_grad_() for x in (q, k, v, g.float())]
    assert torch.equal(o, fox_attention(*wide))
    o.float().sum().backward()
    fox_attention(*wide).float().sum().backward()
    assert leaves[3].grad.dtype == dtype
    assert torch.equal(leaves[3].grad, wide[3].grad.to(dtype))
    field = torch.cumsum(g.float(), 1)
    half_field = fpa_attention(q, k, v, field.to(dtype), field.to(dtype))
    assert torch.equal(
        half_field, fpa_attention(q, k, v, field.to(dtype).float(), field.to(dtype).float())
    )
    naive = pytest.importorskip("fla.ops.forgetting_attn.naive").naive_forgetting_attn
    theirs = naive(q, k, v, g)  # float32 inside, whatever it is given
    assert relative_error(to_ref(o), to_ref(theirs)) < 1e-2


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_empty_batch_gives_empty_outputs_and_gradients_as_sdpa(device):
    q, k, v = (torch.randn(0, 7, 4, 8, device=device, requires_grad=True) for _ in range(3))
    field, level = (torch.randn(0, 7, 4, device=device, requires_grad=True) for _ in range(2))
    o, lse = fpa_attention(q, k, v, field, level, return_lse=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (o.shape, lse.shape, o.dtype) == (sdpa.shape, (0, 7, 4), sdpa.dtype)
    assert fox_attention(q, k, v, -field.abs()).shape == (0, 7, 4, 8)
    if device == "cpu":
        (o.sum() + lse.sum()).backward()
        assert [x.grad.shape for x in (q, k, v, field, level)] == [
            x.shape for x in (q, k, v, field, level)
        ]
    with pytest.raises(ValueError, match="k: expected shape"):
        fpa_attention(q, k[:, :3], v, field, level)


def test_the_meta_device_infers_shapes():
    q, k = torch.empty(2, 9, 4, 8, device="meta"), torch.empty(2, 9, 2, 8, device="meta")
    v, field = torch.empty(2, 9, 2, 5, device="meta"), torch.empty(2, 9, 4, device="meta")
    o, lse = fpa_attention(q, k, v, field, field, return_lse=True)
    assert (o.shape, o.device.type, lse.shape) == ((2, 9, 4, 5), "meta", (2, 9, 4))
    assert fox_attention(q.half(), k.half(), v.half(), field.half()).dtype == torch.float16


@pytest.mark.parametrize("impl", ["eager", "triton"])
@pytest.mark.parametrize("op", ["fpa", "fox"])
def test_a_zero_length_packed_sequence_contributes_nothing(op, impl):
    # [decision, as FlashAttention's varlen]: offsets (0, 8, 8, 16) are the sequences (0, 8)
    # and (8, 16) and an empty one; outputs and gradients are those of the reference per
    # non-empty sequence.
    if impl == "triton":
        pytest.importorskip("triton")
    rng = np.random.default_rng(6)
    q, k, v, f, lev = attention(rng, 1, 16, 2, 2, 8, 4)
    if op == "fox":
        log_f = -np.abs(rng.standard_normal((1, 2, 16)))
        f = lev = np.cumsum(log_f, axis=-1)
    do = rng.standard_normal((1, 2, 16, 4))
    o_ref, _, g_ref = reference(q, k, v, f, lev, do, np.zeros((1, 2, 16)), None, (0, 8, 16))
    leaves = [to_torch(x).float().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, 8, 8, 16], dtype=torch.int32)
    if op == "fpa":
        wide = [to_torch(x).float().requires_grad_() for x in (f, lev)]
        o = fpa_attention(*leaves, *wide, cu_seqlens=cu, impl=impl)
    else:
        wide = [to_torch(log_f).float().requires_grad_()]
        o = fox_attention(*leaves, *wide, cu_seqlens=cu, impl=impl)
    o.backward(to_torch(do).float())
    assert relative_error(to_ref(o), o_ref) < 1e-5
    for leaf, want in zip(leaves, g_ref[:3], strict=True):
        assert relative_error(to_ref(leaf.grad), want) < 1e-5
    if op == "fpa":
        for leaf, want in zip(wide, g_ref[3:], strict=True):
            assert relative_error(to_ref(leaf.grad), want) < 1e-5
