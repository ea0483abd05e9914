"""The torch Interdomain ops (chunked S4D core, LegS by exact steps) against the reference:
outputs, every gradient (complex parameters as dL/dRe + i dL/dIm), states, packed sequences."""

import itertools

import numpy as np
import pytest
from drawers import positive, to_ref, to_torch
from drawers import s4d as s4d_draw

torch = pytest.importorskip("torch")

from attnspec.backends.torch import eager_interdomain, interdomain_legs, interdomain_s4d  # noqa: E402
from attnspec.conformance.metrics import relative_error  # noqa: E402
from attnspec.reference import hippo  # noqa: E402
from attnspec.reference import interdomain as idm  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def pairs(z):
    return torch.from_numpy(np.stack([z.real, z.imag], axis=-1))


# (B, H, T, R, V, M), readout, chunk, |Lambda| range via dt
S4D = [
    ((2, 3, 37, 4, 5, 8), "linear", 64, (0.01, 0.3)),  # one chunk
    ((2, 3, 37, 4, 5, 8), "linear", 8, (0.01, 0.3)),  # several chunks, a partial last one
    ((1, 2, 40, 3, 2, 1), "ratio", 5, (0.01, 0.3)),  # M = 1
    ((1, 2, 65, 4, 4, 16), "ratio", 16, (1e-3, 2e-3)),  # |Lambda| near 1: long memory
    ((1, 2, 30, 4, 3, 6), "linear", 1, (1.0, 2.0)),  # |Lambda| <= 0.61, one token per chunk
]


@pytest.mark.parametrize(("shape", "readout", "chunk", "dt"), S4D)
def test_s4d_kernels_match_the_reference(shape, readout, chunk, dt):
    B, H, T, R, V, M = shape
    rng = np.random.default_rng(T + chunk)
    fq, kt, vt, lam, b, c = s4d_draw(rng, B, H, T, R, V, M, readout, dt)
    do = rng.standard_normal((B, H, T, V))
    o_ref = idm.interdomain_s4d(fq, kt, vt, lam, b, c, readout=readout)
    g_ref = idm.interdomain_s4d_vjp(fq, kt, vt, lam, b, c, do, readout=readout)
    args = [to_torch(x) for x in (fq, kt, vt)] + [pairs(p) for p in (lam, b, c)]
    o, final = eager_interdomain.s4d_fwd(*args, readout, None, None, chunk=chunk)
    grads = eager_interdomain.s4d_bwd(*args, readout, None, None, to_torch(do), None, chunk=chunk)
    assert relative_error(to_ref(o), o_ref) < 1e-12
    states = idm.s4d_states(idm._ssm_inputs(kt, vt, readout), lam, b)[..., -1, :, :]
    assert relative_error(torch.view_as_complex(final).numpy(), states) < 1e-12
    # a gradient that vanishes (db with M = 1 under "ratio": H5 scale invariance) is compared
    # on the scale of the others
    floor = 1e-3 * max(np.linalg.norm(g) for g in g_ref)
    for name, got, want in zip(("dfq", "dkt", "dvt"), grads[:3], g_ref[:3], strict=True):
        assert relative_error(to_ref(got), want, floor=floor) < 1e-11, name
    for name, got, want in zip(("dlam", "db", "dc"), grads[3:6], g_ref[3:], strict=True):
        assert relative_error(torch.view_as_complex(got).numpy(), want, floor=floor) < 1e-11, name
    assert grads[6] is None


def test_s4d_states_continue_and_their_cotangents_flow():
    rng = np.random.default_rng(1)
    fq, kt, vt, lam, b, c = (torch.from_numpy(x) for x in s4d_draw(rng, 1, 2, 12, 2, 2, 3, "ratio"))
    fq, kt, vt = (x.transpose(1, 2).contiguous() for x in (fq, kt, vt))
    whole, end = interdomain_s4d(fq, kt, vt, lam, b, c, readout="ratio", output_final_state=True)
    first, middle = interdomain_s4d(
        fq[:, :5], kt[:, :5], vt[:, :5], lam, b, c, readout="ratio", output_final_state=True
    )
    second, last = interdomain_s4d(
        fq[:, 5:],
        kt[:, 5:],
        vt[:, 5:],
        lam,
        b,
        c,
        readout="ratio",
        initial_state=middle,
        output_final_state=True,
    )
    assert torch.allclose(torch.cat([first, second], 1), whole, rtol=1e-12, atol=1e-12)
    assert torch.allclose(last, end, rtol=1e-12, atol=1e-12)
    # d(output, final state) / d(inputs, parameters, initial state) by finite differences
    leaves = [x[:, 5:].clone().requires_grad_() for x in (fq, kt, vt)]
    params = [p.clone().requires_grad_() for p in (lam, b, c)]

    def run(*xs):
        o, end = interdomain_s4d(
            *xs[:6], readout="ratio", initial_state=xs[6], output_final_state=True
        )
        return o, torch.view_as_real(end)

    assert torch.autograd.gradcheck(run, (*leaves, *params, middle.detach().requires_grad_()))


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_packed_sequences_each_start_from_their_own_state(readout):
    rng = np.random.default_rng(2)
    fq, kt, vt, lam, b, c = (torch.from_numpy(x) for x in s4d_draw(rng, 1, 2, 40, 3, 4, 6, readout))
    fq, kt, vt = (x.transpose(1, 2).contiguous() for x in (fq, kt, vt))
    cu = [0, 15, 16, 40]
    init = torch.randn(3, 2, 6, 3 + 4 + (readout == "ratio"), dtype=torch.complex128)
    o, final = interdomain_s4d(
        fq,
        kt,
        vt,
        lam,
        b,
        c,
        readout=readout,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        initial_state=init,
        output_final_state=True,
    )
    for n, (a, e) in enumerate(itertools.pairwise(cu)):
        part, end = interdomain_s4d(
            fq[:, a:e],
            kt[:, a:e],
            vt[:, a:e],
            lam,
            b,
            c,
            readout=readout,
            initial_state=init[n : n + 1],
            output_final_state=True,
        )
        assert torch.allclose(o[:, a:e], part, rtol=1e-12, atol=1e-12)
        assert torch.allclose(final[n], end[0], rtol=1e-12, atol=1e-12)


def test_long_memory_over_many_chunks_does_not_drift():
    # |Lambda| = 0.9995, T = 2048: 32 chunks of state passing, float32 against float64
    rng = np.random.default_rng(3)
    fq, kt, vt, lam, b, c = s4d_draw(rng, 1, 1, 2048, 4, 4, 8, "ratio", dt=(1e-3, 1e-3))
    o_ref = idm.interdomain_s4d(fq, kt, vt, lam, b, c, readout="ratio")
    args = [to_torch(x).float() for x in (fq, kt, vt)]
    o = interdomain_s4d(
        *args, *(torch.from_numpy(p).to(torch.complex64) for p in (lam, b, c)), readout="ratio"
    )
    assert relative_error(to_ref(o), o_ref) < 1e-5


# LegS


@pytest.mark.parametrize(
    ("shape", "chunk", "cu"),
    [
        ((2, 3, 37, 4, 5, 8), 64, None),
        ((1, 2, 45, 3, 2, 16), 8, None),
        ((1, 2, 30, 3, 4, 1), 7, None),
        ((1, 2, 40, 3, 4, 6), 6, (0, 15, 16, 40)),  # each sequence restarts at n = 1
    ],
)
def test_legs_matches_the_reference(shape, chunk, cu):
    B, H, T, R, V, M = shape
    rng = np.random.default_rng(T + chunk)
    fq, fk = positive(rng, (2, B, H, T, R))
    v, do = rng.standard_normal((2, B, H, T, V))
    segments = [(0, T)] if cu is None else list(itertools.pairwise(cu))
    o_ref = np.zeros(v.shape)
    g_ref = [np.zeros(x.shape) for x in (fq, fk, v)]
    for a, e in segments:
        s = (slice(None), slice(None), slice(a, e))
        o_ref[s] = idm.interdomain_legs(fq[s], fk[s], v[s], M)
        parts = idm.interdomain_legs_vjp(fq[s], fk[s], v[s], M, do[s])
        for out, part in zip(g_ref, parts, strict=True):
            out[s] = part
    args = [to_torch(x) for x in (fq, fk, v)]
    offsets = None if cu is None else Packing(tuple(cu))
    o = eager_interdomain.legs_fwd(*args, M, offsets, chunk=chunk)
    grads = eager_interdomain.legs_bwd(*args, M, offsets, to_torch(do), chunk=chunk)
    assert relative_error(to_ref(o), o_ref) < 1e-12
    floor = 1e-3 * max(np.linalg.norm(g) for g in g_ref)  # with M = 1, dfq = dfk = 0
    for name, got, want in zip(("dfq", "dfk", "dv"), grads, g_ref, strict=True):
        assert relative_error(to_ref(got), want, floor=floor) < 1e-12, name


def test_legs_chunk_products_are_products_of_the_exact_steps():
    P, K = eager_interdomain.legs_constants(4, 5, 1, torch.float64, "cpu")  # tokens 6..10
    E = [hippo.legs_step(n, 4)[0] for n in range(6, 11)]
    F = [hippo.legs_step(n, 4)[1] for n in range(6, 11)]
    np.testing.assert_allclose(P[2].numpy(), E[2] @ E[1] @ E[0], rtol=1e-14, atol=1e-14)
    np.testing.assert_allclose(K[3, 1].numpy(), E[3] @ E[2] @ F[1], rtol=1e-14, atol=1e-14)
    assert not K[1, 3].any()  # causal: a later token never reaches an earlier coefficient


def test_public_ops_in_half_precision_return_their_dtypes():
    rng = np.random.default_rng(4)
    fq, kt, vt, lam, b, c = s4d_draw(rng, 1, 2, 20, 3, 4, 5, "linear")
    params = [torch.from_numpy(p).to(torch.complex64).requires_grad_() for p in (lam, b, c)]
    for dtype in (torch.float16, torch.bfloat16):
        leaves = [to_torch(x).to(dtype).requires_grad_() for x in (fq, kt, vt)]
        o = interdomain_s4d(*leaves, *params)
        assert o.dtype == dtype
        o.float().sum().backward()
        assert [x.grad.dtype for x in leaves + params] == [dtype] * 3 + [torch.complex64] * 3
        legs = interdomain_legs(*(x.abs() + 0.1 for x in leaves[:2]), leaves[2], 4)
        assert legs.dtype == dtype


def s4d_inputs():
    rng = np.random.default_rng(5)
    fq, kt, vt, lam, b, c = s4d_draw(rng, 1, 2, 10, 3, 4, 5, "linear")
    return dict(
        fq=to_torch(fq).float(),
        kt=to_torch(kt).float(),
        vt=to_torch(vt).float(),
        lam=torch.from_numpy(lam).to(torch.complex64),
        b=torch.from_numpy(b).to(torch.complex64),
        c=torch.from_numpy(c).to(torch.complex64),
    )


def s4d_changed(**changes):
    x = s4d_inputs()
    x.update({name: fn(x[name]) for name, fn in changes.items()})
    return x


BAD_S4D = [
    (s4d_changed(kt=lambda x: x[..., :2]), {}, "kt: expected shape"),
    (s4d_changed(vt=lambda x: x.double()), {}, "vt: expected the dtype of fq"),
    (s4d_changed(lam=lambda x: x.real), {}, "lam: expected dtype complex64"),
    (s4d_changed(lam=lambda x: x[:1]), {}, r"lam: expected shape \(2, 5\) \(\[H, M\] complex"),
    (s4d_changed(c=lambda x: x[..., :4]), {}, "c: expected shape"),
    (s4d_changed(b=lambda x: x.to(torch.complex128)), {}, "b: expected the dtype of lam"),
    (s4d_changed(lam=lambda x: 1.5 * x / x.abs()), {}, r"lam: expected \|Lambda\| <= 1"),
    (s4d_changed(b=lambda x: x * float("nan")), {}, "b: contains NaN"),
    (s4d_inputs(), {"readout": "softmax"}, "readout: expected 'linear' or 'ratio'"),
    (s4d_inputs(), {"initial_state": torch.zeros(1, 2, 5, 7)}, "initial_state: expected dtype"),
    (
        s4d_inputs(),
        {"initial_state": torch.zeros(2, 2, 5, 7, dtype=torch.complex64)},
        "initial_state: expected shape",
    ),
    (s4d_inputs(), {"cu_seqlens": torch.tensor([0, 3, 2, 10])}, "non-decreasing"),
]


@pytest.mark.parametrize(("inputs", "kwargs", "message"), BAD_S4D)
def test_bad_s4d_input_is_a_value_error_naming_the_argument(inputs, kwargs, message):
    with pytest.raises(ValueError, match=message):
        interdomain_s4d(**inputs, **kwargs)


def test_bad_legs_input():
    x = s4d_inputs()
    with pytest.raises(ValueError, match="M: expected an integer >= 1"):
        interdomain_legs(x["fq"], x["kt"], x["vt"], 0)
    with pytest.raises(ValueError, match="fk: expected shape"):
        interdomain_legs(x["fq"], x["kt"][:, :5], x["vt"], 3)


def test_a_zero_ratio_denominator_is_a_value_error_as_in_the_reference():
    fq = torch.ones(1, 5, 1, 2, dtype=torch.float64)
    fk = fq.clone()
    fq[0, 3, 0] = torch.tensor([1.0, -1.0])  # xi(q) . u_0 = 0 at token 3: fk is constant
    message = "fq, fk: the ratio readout's denominator is 0 at batch 0, head 0, token 3"
    with pytest.raises(ValueError, match=message):
        interdomain_legs(fq, fk, torch.randn(1, 5, 1, 3, dtype=torch.float64), 4)
    with pytest.raises(ValueError, match="denominator is 0"):
        idm.interdomain_legs(*(np.swapaxes(x.numpy(), 1, 2) for x in (fq, fk, fk)), 4)


def test_a_mode_without_memory_lambda_zero_keeps_exact_gradients():
    # powers by cumulative products: Lambda = 0 needs no log, and d Lambda^1 / d Lambda = 1
    rng = np.random.default_rng(6)
    lam = np.array([[0.0, 0.5, 0.3 + 0.4j]])
    b = rng.standard_normal((1, 3)) + 1j * rng.standard_normal((1, 3))
    c = rng.standard_normal((1, 3, 3)) + 0j
    fq, kt, vt, do = rng.standard_normal((4, 1, 1, 9, 2))
    want = idm.interdomain_s4d_vjp(fq, kt, vt, lam, b, c, do)
    args = [to_torch(x) for x in (fq, kt, vt)] + [pairs(p) for p in (lam, b, c)]
    got = eager_interdomain.s4d_bwd(*args, "linear", None, None, to_torch(do), None, chunk=4)
    assert relative_error(torch.view_as_complex(got[3]).numpy(), want.dlam) < 1e-12


# empty batches and zero-length sequences


@pytest.mark.parametrize("impl", ["eager", "triton"])
def test_a_zero_length_packed_sequence_contributes_nothing_and_keeps_its_state(impl):
    # [decision, as FlashAttention's varlen]: offsets (0, 8, 8, 16); the empty sequence's
    # final state is its initial state, and the cotangent passes through unchanged.
    if impl == "triton":
        pytest.importorskip("triton")
    rng = np.random.default_rng(40)
    fq, kt, vt, lam, b, c = s4d_draw(rng, 1, 2, 16, 3, 2, 4, "linear")
    M, C = 4, 5
    x0 = rng.standard_normal((3, 2, M, C)) + 1j * rng.standard_normal((3, 2, M, C))
    args = [to_torch(x).requires_grad_() for x in (fq, kt, vt)]
    init = torch.from_numpy(x0).requires_grad_()
    cu = torch.tensor([0, 8, 8, 16])
    params = (torch.from_numpy(p) for p in (lam, b, c))
    o, final = interdomain_s4d(
        *args, *params, cu_seqlens=cu, initial_state=init, output_final_state=True, impl=impl
    )
    for n, (a, e) in zip((0, 2), [(0, 8), (8, 16)], strict=True):  # (I11) from x0, 8 steps
        z = idm._ssm_inputs(kt[..., a:e, :], vt[..., a:e, :], "linear")
        want = idm.s4d_states(z, lam, b)[0, :, -1] + lam[:, :, None] ** 8 * x0[n]
        assert relative_error(final[n].detach().numpy(), want) < 1e-12
    assert torch.equal(final[1], init[1])
    d_final = torch.randn(final.shape, dtype=final.dtype)
    torch.autograd.backward([o, final], [torch.zeros_like(o), d_final])
    assert torch.equal(init.grad[1], d_final[1])


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_an_empty_batch_gives_empty_outputs_and_gradients(device):
    rng = np.random.default_rng(41)
    fq, kt, vt, lam, b, c = s4d_draw(rng, 1, 2, 6, 3, 2, 4, "linear")
    args = [to_torch(x)[:0].to(device).requires_grad_() for x in (fq, kt, vt)]
    params = [torch.from_numpy(p).to(device).requires_grad_() for p in (lam, b, c)]
    o, final = interdomain_s4d(*args, *params, output_final_state=True)
    assert (o.shape, final.shape) == ((0, 6, 2, 2), (0, 2, 4, 5))
    legs = interdomain_legs(args[0].abs(), args[1].abs(), args[2], 3)
    assert legs.shape == (0, 6, 2, 2)
    if device == "cpu":
        (o.sum() + legs.sum()).backward()
        assert [x.grad.shape for x in args] == [x.shape for x in args]
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in params)
