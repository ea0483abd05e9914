"""Triton kernels for Interdomain Attention against the reference, a literal torch loop and fla.

The kernels run under the Triton interpreter here (TRITON_INTERPRET=1, tests/conftest.py) and
compiled on a GPU. References are float64: attnspec.reference.interdomain (outputs and the
hand-written VJPs), a literal complex128 recurrence with torch autograd (initial and final
states), and flash-linear-attention's naive GLA (the two-stage real reformulation).
Tolerances are the kit's table, keyed by dtype.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from drawers import to_ref  # noqa: E402

from attnspec.backends.torch import dispatch, interdomain_legs  # noqa: E402
from attnspec.backends.torch import triton_chunks as chunks  # noqa: E402
from attnspec.backends.torch import triton_legs as legs  # noqa: E402
from attnspec.backends.torch import triton_s4d as s4d  # noqa: E402
from attnspec.backends.torch import triton_s4d_bwd as s4d_grad  # noqa: E402
from attnspec.backends.torch.ops import s4d_pairs  # noqa: E402
from attnspec.conformance.metrics import relative_error as rel_err  # noqa: E402
from attnspec.conformance.tolerances import round_to, tolerance  # noqa: E402
from attnspec.reference import hippo  # noqa: E402
from attnspec.reference import interdomain as ref  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

DEVICE = (
    "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
)
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def to_torch(x: np.ndarray, dtype: str = "float64") -> torch.Tensor:
    """Reference layout (B, H, T, D) -> torch layout [B, T, H, D]."""
    return torch.tensor(np.swapaxes(x, 1, 2), dtype=DTYPES[dtype], device=DEVICE).contiguous()


def pair(z: np.ndarray, dtype: str = "float64") -> torch.Tensor:
    """Complex array -> real tensor with (re, im) last."""
    wide = "float64" if dtype == "float64" else "float32"
    return torch.view_as_real(torch.tensor(z, dtype=torch.complex128)).to(DTYPES[wide]).to(DEVICE)


def unpair(x: torch.Tensor) -> np.ndarray:
    return torch.view_as_complex(x.detach().double().cpu().contiguous()).numpy()


def s4d_case(seed, B=1, H=2, T=20, R=5, V=3, M=4, mag=0.9, readout="linear", zero_mode=False):
    """S4D inputs in the reference layout with |Lambda| = mag and random phases."""
    rng = np.random.default_rng(seed)
    lam = mag * np.exp(1j * rng.uniform(0, np.pi, (H, M)))
    if zero_mode:
        lam[:, 0] = 0.0
    b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
    c = (rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))) / np.sqrt(2 * M)
    if readout == "ratio":  # positive features and C near I keep the denominator from 0
        fq, kt = np.exp(0.5 * rng.standard_normal((2, B, H, T, R)))
        b, c = np.abs(b), np.eye(M) + 0.1 * c
    else:
        fq, kt = rng.standard_normal((2, B, H, T, R))
    vt = rng.standard_normal((B, H, T, V))
    do = rng.standard_normal((B, H, T, V))
    return dict(fq=fq, kt=kt, vt=vt, lam=lam, b=b, c=c), do


def rounded(case: dict, dtype: str) -> dict:
    """Inputs as the kernel sees them: features in dtype, parameters in float32 or wider."""
    wide = "float64" if dtype == "float64" else "float32"
    out = {k: round_to(case[k], dtype) for k in ("fq", "kt", "vt")}
    for k in ("lam", "b", "c"):
        out[k] = round_to(case[k].real, wide) + 1j * round_to(case[k].imag, wide)
    return out


def run_s4d(case, do, readout, dtype="float64", blocks=None, backward=True):
    args = (
        *(to_torch(case[k], dtype) for k in ("fq", "kt", "vt")),
        *(pair(case[k], dtype) for k in ("lam", "b", "c")),
        readout,
        None,
        None,
    )
    with chunks.block_sizes(*blocks) if blocks else contextlib.nullcontext():
        o, final, saved = s4d.s4d_fwd(*args, return_saved=True)  # as the autograd op runs
        grads = s4d_grad.s4d_bwd(*args, to_torch(do, dtype), None, saved) if backward else None
    return o, final, grads


def check_s4d(case, do, readout, dtype="float64", blocks=None):
    """Forward and every gradient of the kernels against the reference on the same inputs."""
    o, _, g = run_s4d(case, do, readout, dtype, blocks)
    assert o.dtype == DTYPES[dtype] and g[0].dtype == DTYPES[dtype]
    r = rounded(case, dtype)
    want = ref.interdomain_s4d(**r, readout=readout)
    assert rel_err(to_ref(o), want) < tolerance("interdomain_s4d", dtype, "output")
    do_r = round_to(do, dtype)
    gw = ref.interdomain_s4d_vjp(*r.values(), do_r, readout=readout)
    tol = tolerance("interdomain_s4d", dtype, "gradient")
    got = {"dfq": g[0], "dkt": g[1], "dvt": g[2]}
    for name, x in got.items():
        assert rel_err(to_ref(x), getattr(gw, name)) < tol, name
    for name, x in zip(("dlam", "db", "dc"), g[3:6], strict=True):
        assert rel_err(unpair(x), getattr(gw, name)) < tol, name


# S4D against the reference


DIAGONALS = chunks.DIAGONALS  # the forms of a diagonal block: "loop", "lag"


def forced(tiles: tuple[int, ...] | None, diagonal: str) -> tuple | None:
    """block_sizes arguments: tiles (chunk, sub_chunk[, diag_block[, columns]]) with the given
    diagonal form, 4 warps and 64 channels; None keeps the device's blocks."""
    if tiles is None:
        return None
    chunk, sub, *rest = tiles
    block, columns = (*rest, None, None)[:2]
    return (chunk, sub, diagonal, 4, 64, block, columns or 0)


S4D_TABLE = [
    # (T, M, |Lambda|, R, V, readout, tiles (chunk, sub_chunk[, diag_block]) or None, B, H)
    (1, 2, 0.5, 3, 5, "linear", None, 2, 1),
    (15, 1, 0.99, 5, 3, "linear", (16, 16), 1, 2),  # ratio with M = 1 ignores b, C
    (16, 2, 0.05, 4, 6, "ratio", (16, 16), 1, 2),
    (17, 16, 0.9995, 5, 3, "linear", (16, 16), 2, 1),
    (63, 64, 0.5, 3, 4, "ratio", None, 1, 1),
    (64, 16, 0.05, 6, 3, "ratio", None, 1, 1),
    (65, 2, 0.99, 3, 5, "linear", None, 1, 2),
    (129, 16, 0.9995, 4, 3, "ratio", None, 1, 1),
    # The 16-row GPU tiling: sub-chunks of 16 in chunks of 32.
    (37, 16, 0.5, 5, 3, "ratio", (32, 16), 1, 1),
    (50, 8, 0.99, 4, 6, "linear", (32, 16), 1, 2),
    # Programs of several diagonal blocks: the chunk-wide tiling, two programs per chunk with
    # blocks inside each, and a whole chunk as one diagonal block (the chunk-wide lag tiling).
    (37, 16, 0.5, 5, 3, "ratio", (32, 32, 16), 1, 1),
    (70, 8, 0.05, 4, 6, "linear", (64, 32, 8), 1, 2),
    (70, 8, 0.9995, 4, 6, "ratio", (64, 64, 16), 1, 1),
    (70, 8, 0.9, 4, 6, "linear", (64, 64, 64), 1, 2),
    # The forward's tokens as columns (the chunk-wide lag tiling): two slices (the devices')
    # and a whole chunk as one; the backward keeps its rows.
    (70, 8, 0.9, 4, 6, "ratio", (64, 64, 64, 32), 1, 2),
    (100, 16, 0.99, 5, 3, "linear", (64, 64, 64, 64), 1, 1),
    (40, 4, 0.5, 3, 5, "ratio", (32, 32, 32, 32), 2, 1),
]


@pytest.mark.parametrize("T, M, mag, R, V, readout, tiles, B, H", S4D_TABLE)
@pytest.mark.parametrize("diagonal", DIAGONALS)
def test_s4d_matches_reference(T, M, mag, R, V, readout, tiles, B, H, diagonal):
    """Each form of the diagonal blocks on the same cases (the device's blocks: once)."""
    if tiles is None and diagonal != chunks.blocks_for(torch.device(DEVICE)).diagonal:
        pytest.skip("the device's blocks run once, in their form")
    if diagonal == "loop" and tiles is not None and (tiles[2:] or tiles[1:])[0] > 16:
        pytest.skip("the token loop is the GPU form of blocks of 16 (slow in the interpreter)")
    case, do = s4d_case(T + M, B, H, T, R, V, M, mag, readout)
    check_s4d(case, do, readout, "float64", forced(tiles, diagonal))


@pytest.mark.parametrize(
    "tiles, diagonal",
    [((32, 16), "loop"), ((32, 16), "lag"), ((64, 64), "lag")],
)
def test_s4d_lambda_zero_mode_stays_finite(tiles, diagonal):
    """Lambda = 0 in one mode: 0^0 = 1 and no power with a negative exponent (no NaN)."""
    case, do = s4d_case(3, T=40, M=4, mag=0.05, zero_mode=True)
    check_s4d(case, do, "linear", "float64", forced(tiles, diagonal))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("readout", ["linear", "ratio"])
@pytest.mark.parametrize("diagonal", DIAGONALS)
def test_s4d_dtypes(dtype, readout, diagonal):
    if diagonal == "loop" and dtype != "bfloat16":
        pytest.skip("the token loop: bfloat16, the GPU's dtype (slow in the interpreter)")
    case, do = s4d_case(7, T=40, M=8, R=4, V=5, mag=0.9, readout=readout)
    check_s4d(case, do, readout, dtype, forced((32, 16), diagonal))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_columns_dtypes(dtype, readout):
    """The forward with the tokens as columns (Hopper's tiling) in each input dtype."""
    case, do = s4d_case(7, T=80, M=8, R=4, V=5, mag=0.9, readout=readout)
    check_s4d(case, do, readout, dtype, forced((64, 64, 64, 32), "lag"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"columns": 16}, "columns: expected 0, chunk / 2 or chunk = 64, got 16"),
        ({"columns": 128}, "columns: expected 0, chunk / 2 or chunk = 64, got 128"),
        ({"diagonal": "tile"}, "diagonal: expected one of"),
        ({"diag_block": 128}, "diag_block: expected at most sub_chunk = 64"),
    ],
)
def test_block_sizes_rejects_tiles_a_launch_cannot_take(kwargs, match):
    """Column slices of chunk / 4 would reach 48 lags (tl.arange takes powers of two)."""
    with pytest.raises(ValueError, match=re.escape(match)):
        with chunks.block_sizes(**{"chunk": 64, "sub_chunk": 64, **kwargs}):
            pass


def test_s4d_long_memory_does_not_drift():
    """T = 1000 with |Lambda| = 0.9995 in float32: outputs and the final state stay within the
    float32 tolerance of the float64 reference (chunk states carried over 16 chunks)."""
    case, do = s4d_case(11, B=1, H=1, T=1000, R=4, V=4, M=16, mag=0.9995)
    o, final, _ = run_s4d(case, do, "linear", "float32", backward=False)
    r = rounded(case, "float32")
    assert rel_err(to_ref(o), ref.interdomain_s4d(**r)) < 1e-5
    z = np.concatenate([r["kt"], r["vt"]], axis=-1)
    x_last = ref.s4d_states(z, r["lam"], r["b"])[:, :, -1]  # (B, H, M, C)
    assert rel_err(unpair(final), x_last) < 1e-5


@pytest.mark.parametrize("diagonal", DIAGONALS)
def test_s4d_varlen_with_a_length_one_segment(diagonal):
    """cu_seqlens: each segment is an independent sequence (the reference run per segment),
    the chunks of each with ragged tails."""
    cu = [0, 1, 19, 45, 46]
    case, do = s4d_case(5, B=1, H=1, T=cu[-1], R=4, V=3, M=8, mag=0.9, readout="ratio")
    args = (
        *(to_torch(case[k]) for k in ("fq", "kt", "vt")),
        *(pair(case[k]) for k in ("lam", "b", "c")),
        "ratio",
        Packing(tuple(cu)),
        None,
    )
    with chunks.block_sizes(*forced((16, 16), diagonal)):
        o, final, saved = s4d.s4d_fwd(*args, return_saved=True)
        g = s4d_grad.s4d_bwd(*args, to_torch(do), None, saved)
    want = {k: [] for k in ("o", "final", "dfq", "dkt", "dvt", "dlam", "db", "dc")}
    for a, e in itertools.pairwise(cu):
        seg = {k: (v[:, :, a:e] if v.ndim == 4 else v) for k, v in case.items()}
        want["o"].append(ref.interdomain_s4d(**seg, readout="ratio"))
        z = np.concatenate([seg["kt"], seg["vt"], np.ones((1, 1, e - a, 1))], axis=-1)
        want["final"].append(ref.s4d_states(z, seg["lam"], seg["b"])[:, :, -1])
        gw = ref.interdomain_s4d_vjp(*seg.values(), do[:, :, a:e], readout="ratio")
        for name in ("dfq", "dkt", "dvt", "dlam", "db", "dc"):
            want[name].append(getattr(gw, name))
    assert rel_err(to_ref(o), np.concatenate(want["o"], axis=2)) < 1e-12
    assert rel_err(unpair(final), np.concatenate(want["final"])) < 1e-12
    for name, x in zip(("dfq", "dkt", "dvt"), g[:3], strict=True):
        assert rel_err(to_ref(x), np.concatenate(want[name], axis=2)) < 1e-12, name
    for name, x in zip(("dlam", "db", "dc"), g[3:6], strict=True):
        assert rel_err(unpair(x), sum(want[name])) < 1e-12, name


def literal_s4d(fq, kt, vt, lam, b, c, h0, readout):
    """(I11)-(I13) token by token in complex128 torch ([B, T, H, D] inputs, h0 [B, H, M, C])."""
    x, outs = h0, []
    for t in range(fq.shape[1]):
        z = torch.cat([kt[:, t], vt[:, t]], -1)  # (B, H, R + V)
        if readout == "ratio":
            z = torch.cat([z, torch.ones_like(z[..., :1])], -1)
        x = lam[..., None] * x + b[..., None] * z[:, :, None, :]  # (I11)
        Y = c @ x  # (I12)
        R, V = kt.shape[-1], vt.shape[-1]
        a = (Y[..., :R] * fq[:, t, :, None, :]).sum(-1)  # U_t fq_t
        o = (a.conj()[..., None] * Y[..., R : R + V]).sum(-2).real  # (I13)
        if readout == "ratio":
            o = o / (a.conj() * Y[..., R + V]).sum(-1).real[..., None]
        outs.append(o)
    return torch.stack(outs, 1), x


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_initial_and_final_state_against_a_literal_loop(readout):
    """initial_state in, final state out, and their gradients (with a final-state cotangent),
    against autograd through a literal complex128 recurrence."""
    case, do = s4d_case(13, B=2, H=2, T=18, R=3, V=4, M=5, mag=0.9, readout=readout)
    rng = np.random.default_rng(14)
    C = 3 + 4 + (readout == "ratio")
    h0 = 0.3 * (rng.standard_normal((2, 2, 5, C)) + 1j * rng.standard_normal((2, 2, 5, C)))
    dht = rng.standard_normal((2, 2, 5, C)) + 1j * rng.standard_normal((2, 2, 5, C))
    feats = [to_torch(case[k]) for k in ("fq", "kt", "vt")]
    params = [pair(case[k]) for k in ("lam", "b", "c")]
    args = (*feats, *params, readout, None, pair(h0))
    with chunks.block_sizes(16, 16, "loop"):
        o, final, saved = s4d.s4d_fwd(*args, return_saved=True)
        g = s4d_grad.s4d_bwd(*args, to_torch(do), pair(dht), saved)

    leaves = [x.clone().requires_grad_() for x in feats]
    cplx = [
        torch.tensor(case[k], dtype=torch.complex128, device=DEVICE).requires_grad_()
        for k in ("lam", "b", "c")
    ]
    h0_t = torch.tensor(h0, device=DEVICE).requires_grad_()
    o_ref, x_ref = literal_s4d(*leaves, *cplx, h0_t, readout)
    assert rel_err(o.cpu(), o_ref.detach().cpu()) < 1e-12
    assert rel_err(unpair(final), x_ref.detach().cpu()) < 1e-12
    # L = <do, o> + Re <dht, x_T> (real pairing of the (re, im) components)
    loss = (o_ref * to_torch(do)).sum() + (
        torch.tensor(dht, device=DEVICE).conj() * x_ref
    ).sum().real
    loss.backward()
    for x, leaf in zip(g[:3], leaves, strict=True):
        assert rel_err(x.cpu(), leaf.grad.cpu()) < 1e-12
    # torch's gradient of a real loss w.r.t. complex z is dL/dRe z + i dL/dIm z, as ours
    for x, leaf in zip(g[3:6], cplx, strict=True):
        assert rel_err(unpair(x), leaf.grad.cpu()) < 1e-12
    assert rel_err(unpair(g[6]), h0_t.grad.cpu()) < 1e-12


def test_s4d_two_stage_form_against_fla_naive_gla():
    """With real Lambda, b and C the core is two gated linear attentions (the reformulation the
    kernels use): p_t[m] = b_m sum_s Lambda_m^(t-s) (fq_t . kt_s) (one GLA per mode, value 1),
    qe = C^T C p, o_t = sum_s (qe_t . b Lambda^(t-s)) vt_s (a GLA with key b, gate log Lambda).
    flash-linear-attention's naive GLA computes both stages; the kernels must agree."""
    naive = pytest.importorskip("fla.ops.gla.naive")
    B, H, T, R, V, M = 1, 2, 33, 4, 3, 6
    rng = np.random.default_rng(21)
    lam = rng.uniform(0.3, 0.98, (H, M)).astype(complex)
    b = rng.standard_normal((H, M)).astype(complex)
    c = rng.standard_normal((H, M, M)).astype(complex) / np.sqrt(M)
    fq, kt = rng.standard_normal((2, B, H, T, R))
    vt = rng.standard_normal((B, H, T, V))
    o, _, _ = run_s4d(dict(fq=fq, kt=kt, vt=vt, lam=lam, b=b, c=c), None, "linear", backward=False)

    t = lambda x: torch.tensor(np.swapaxes(x, 1, 2))  # noqa: E731  (B, T, H, D), float64
    gate = np.log(lam.real)  # (H, M)
    # stage 1: heads (h, m); q = fq, k = kt (scale K^-0.5 undone), v = 1, gate log Lambda_m
    q1 = np.repeat(fq, M, axis=1) * np.sqrt(R)  # (B, H*M, T, R)
    k1 = np.repeat(kt, M, axis=1)
    g1 = np.broadcast_to(gate.reshape(H * M, 1, 1), (B, H * M, T, R)).copy()
    s1, _ = naive.naive_recurrent_gla(
        t(q1).float(), t(k1).float(), torch.ones(B, T, H * M, 1), t(g1).float()
    )
    p = s1[..., 0].double().numpy().reshape(B, T, H, M) * b.real  # (B, T, H, M)
    qe = np.einsum("hmn,bthn->bthm", np.einsum("hkm,hkn->hmn", c.real, c.real), p)
    # stage 2: q = qe, k = b, v = vt, gate log Lambda per key dimension
    k2 = np.broadcast_to(b.real[None, None], (B, T, H, M)).copy()
    g2 = np.broadcast_to(gate[None, None], (B, T, H, M)).copy()
    o2, _ = naive.naive_recurrent_gla(
        torch.tensor(qe * np.sqrt(M)).float(),
        torch.tensor(k2).float(),
        t(vt).float(),
        torch.tensor(g2).float(),
    )
    assert rel_err(o.cpu(), o2.double()) < 1e-5  # fla's naive GLA runs in float32


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_s4d_decode_steps_equal_the_chunked_kernel(readout):
    """H6: token-by-token decode with a fixed-size state equals the chunked forward."""
    case, do = s4d_case(17, B=2, H=2, T=9, R=3, V=4, M=5, mag=0.9, readout=readout)
    o, final, _ = run_s4d(case, do, readout, backward=False)
    params = [pair(case[k]) for k in ("lam", "b", "c")]
    feats = [to_torch(case[k]) for k in ("fq", "kt", "vt")]
    state, outs = None, []
    for t in range(9):
        step, state = s4d.s4d_step(*(x[:, t] for x in feats), *params, readout, state)
        assert state.shape == final.shape  # the state does not grow
        outs.append(step)
    assert rel_err(torch.stack(outs, 1).cpu(), o.cpu()) < 1e-13
    assert rel_err(unpair(state), unpair(final)) < 1e-13


def test_s4d_is_registered_under_the_dispatch_names():
    assert dispatch.lookup("s4d_fwd", "triton").__wrapped__ is s4d.s4d_fwd
    assert dispatch.lookup("s4d_bwd", "triton").__wrapped__ is s4d_grad.s4d_bwd
    assert dispatch.lookup("legs_fwd", "triton").__wrapped__ is legs.legs_fwd
    assert dispatch.lookup("legs_bwd", "triton").__wrapped__ is legs.legs_bwd


def s4d_args(T=5, H=2, M=3, R=4, V=3):
    case, _ = s4d_case(0, B=1, H=H, T=T, R=R, V=V, M=M)
    return [
        *(to_torch(case[k]) for k in ("fq", "kt", "vt")),
        *(pair(case[k]) for k in ("lam", "b", "c")),
    ]


# Bad input is checked once, by the public ops (backends/torch/checks.py), before the kernels;
# the launchers assert only their invariants.


def s4d_op(args):
    """The public pairs op on [fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state]."""
    fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state = args
    return s4d_pairs(
        fq, kt, vt, lam, b, c,
        readout=readout, cu_seqlens=cu_seqlens, initial_state=initial_state, impl="triton",
    )  # fmt: skip


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.__setitem__(1, a[1][..., :2]), r"kt: expected shape \(1, 5, 2, 4\)"),
        (lambda a: a.__setitem__(2, a[2].float()), r"vt: expected the dtype of fq \(float64\)"),
        (lambda a: a.__setitem__(4, a[4][:, :2]), r"b: expected shape \(2, 3, 2\)"),
        (lambda a: a.__setitem__(5, a[5][..., :1]), r"c: expected shape \(2, 3, 3, 2\)"),
        (lambda a: a[3].__setitem__((0, 0, 0), float("nan")), "lam: contains NaN"),
        (lambda a: a.__setitem__(6, "softmax"), "readout: expected 'linear' or 'ratio'"),
        (lambda a: a.__setitem__(7, torch.tensor([0, 3], device=DEVICE)), "cu_seqlens: expected"),
        (lambda a: a.__setitem__(7, torch.tensor([1, 5], device=DEVICE)), "cu_seqlens: expected"),
        (lambda a: a.__setitem__(8, torch.zeros(1, 2, 3, 8, 2)), r"initial_state: expected shape"),
        (
            lambda a: a.__setitem__(8, torch.full((1, 2, 3, 7, 2), float("nan"), dtype=a[3].dtype)),
            "initial_state: contains NaN",
        ),
    ],
)
def test_s4d_bad_input_names_the_argument(change, match):
    args = [*s4d_args(), "linear", None, None]
    change(args)
    with pytest.raises(ValueError, match=match):
        s4d_op(args)


def test_s4d_bwd_rejects_saved_of_other_inputs():
    """saved must be what the forward returned for the same inputs: a forward over other
    lengths, or no list at all, is a ValueError naming saved, not a wrong gradient."""
    fq, kt, vt, lam, b, c = s4d_args()
    args = (fq, kt, vt, lam, b, c, "ratio", None, None)
    do = torch.zeros_like(vt)
    _, _, saved = s4d.s4d_fwd(*args, return_saved=True)
    shorter = (fq[:, :3], kt[:, :3], vt[:, :3], lam, b, c, "ratio", None, None)
    _, _, other = s4d.s4d_fwd(*shorter, return_saved=True)
    for bad in (other, saved[:1], [saved[0], saved[1].float()]):
        with pytest.raises(ValueError, match="saved: expected what s4d_fwd"):
            s4d_grad.s4d_bwd(*args, do, None, bad)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 2, 5]], ids=["batch", "varlen"])
def test_s4d_op_fake_shapes_its_saved_tensors(cu_seqlens):
    """The op's fake returns saved shaped as the Triton forward does (the chunk count of
    packed sequences as a dynamic size): opcheck runs both and compares."""
    fq, kt, vt, lam, b, c = s4d_args()
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    op = torch.ops.attnspec.s4d_fwd.default
    torch.library.opcheck(op, (fq, kt, vt, lam, b, c, "ratio", cu, None, "triton"))


def test_s4d_varlen_needs_batch_one():
    case, _ = s4d_case(0, B=2, H=1, T=4, M=2)
    args = [
        *(to_torch(case[k]) for k in ("fq", "kt", "vt")),
        *(pair(case[k]) for k in ("lam", "b", "c")),
    ]
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need B = 1"):
        s4d_op([*args, "linear", torch.tensor([0, 2, 4], device=DEVICE), None])


# LegS


def legs_case(seed, B=1, H=2, T=20, R=4, V=3):
    rng = np.random.default_rng(seed)
    fq, fk = np.exp(0.5 * rng.standard_normal((2, B, H, T, R)))  # ratio readout: fq . u_0 > 0
    return dict(fq=fq, fk=fk, v=rng.standard_normal((B, H, T, V))), rng.standard_normal(
        (B, H, T, V)
    )


def check_legs(case, do, M, dtype="float64", blocks=None, cu=None):
    args = (*(to_torch(case[k], dtype) for k in ("fq", "fk", "v")), M, cu)
    with chunks.block_sizes(*blocks) if blocks else contextlib.nullcontext():
        o = legs.legs_fwd(*args)
        g = legs.legs_bwd(*args, to_torch(do, dtype))
    assert o.dtype == DTYPES[dtype] and all(x.dtype == DTYPES[dtype] for x in g)
    r = {k: round_to(v, dtype) for k, v in case.items()}
    do_r = round_to(do, dtype)
    cu = [0, case["fq"].shape[2]] if cu is None else cu.offsets
    for a, e in itertools.pairwise(cu):
        seg = {k: v[:, :, a:e] for k, v in r.items()}
        want = ref.interdomain_legs(seg["fq"], seg["fk"], seg["v"], M)
        assert rel_err(to_ref(o)[:, :, a:e], want) < tolerance("interdomain_legs", dtype, "output")
        gw = ref.interdomain_legs_vjp(seg["fq"], seg["fk"], seg["v"], M, do_r[:, :, a:e])
        for name, x in zip(("dfq", "dfk", "dv"), g, strict=True):
            got, exp = to_ref(x)[:, :, a:e], getattr(gw, name)
            if np.linalg.norm(exp) < 1e-12:  # M = 1 or T = 1: this gradient vanishes
                assert np.abs(got).max() < 1e-10, name
            else:
                assert rel_err(got, exp) < tolerance("interdomain_legs", dtype, "gradient"), name


LEGS_TABLE = [
    # (T, M, R, V, blocks, B, H)
    (1, 4, 3, 5, None, 2, 1),
    (17, 16, 5, 3, (16, 16, "loop"), 1, 2),
    (65, 64, 3, 4, None, 1, 1),
    (80, 1, 4, 4, None, 1, 1),
    (129, 8, 4, 6, None, 1, 2),
    (40, 16, 5, 3, (32, 16, "loop"), 1, 1),  # chunks of 32 (LegS takes no sub-chunk)
    (70, 8, 3, 4, (32, 16, "loop"), 2, 3),  # three heads as the tables' columns, two sequences
    (20, 4, 3, 2, (16, 16, "loop"), 4, 17),  # 68 (sequence, head) columns: two programs of 64
]


@pytest.mark.parametrize("T, M, R, V, blocks, B, H", LEGS_TABLE)
def test_legs_matches_reference(T, M, R, V, blocks, B, H):
    case, do = legs_case(T + M, B, H, T, R, V)
    check_legs(case, do, M, "float64", blocks)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_legs_dtypes(dtype):
    case, do = legs_case(3, T=40, R=4, V=5)
    check_legs(case, do, 16, dtype)


def test_legs_varlen_with_a_length_one_segment():
    cu = Packing((0, 19, 20, 45))
    case, do = legs_case(4, T=45, R=3, V=4)
    check_legs(case, do, 8, "float64", (16, 16, "loop"), cu)


def test_legs_chunk_tables_are_the_closed_form_transitions():
    """Products of the cached steps equal expm(-A log(n/j)) and A^{-1}(Phi(n,j) - Phi(n,j-1)) B,
    the LegS transition over log time (I5), for positions across a chunk border."""
    from scipy.linalg import expm

    M, chunk = 6, 8
    phi, weights = legs.legs_chunk_tables(M, chunk, 24)
    A, Bv = hippo.legs_transition(M)
    transition = lambda n, j: expm(-A * np.log(n / j)) if j > 0 else np.zeros((M, M))  # noqa: E731
    for p in (0, 3, 7, 8, 13, 23):
        n, n0 = p + 1, (p // chunk) * chunk + 1
        np.testing.assert_allclose(phi[p], transition(n, n0 - 1), atol=1e-12)
        for j in range(n0, n + 1):
            K = np.linalg.solve(A, (transition(n, j) - transition(n, j - 1)) @ Bv)
            np.testing.assert_allclose(weights[p, j - n0], K, atol=1e-12)
        assert not weights[p, n - n0 + 1 :].any()  # inputs after n do not enter


def legs_eigenvector_condition(M: int, digits: int = 80) -> float:
    """Exact 2-norm condition number of the (unit-column) eigenvector matrix of the LegS A."""
    mp = pytest.importorskip("mpmath")
    with mp.workdps(digits):
        r = [mp.sqrt(2 * i + 1) for i in range(M)]
        V = mp.zeros(M, M)
        for k in range(M):  # A lower triangular, eigenvalues k + 1: forward substitution
            V[k, k] = 1
            for i in range(k + 1, M):
                s = sum(r[i] * r[j] * V[j, k] for j in range(k, i))
                V[i, k] = -s / (i - k)
            norm = mp.sqrt(sum(V[i, k] ** 2 for i in range(M)))
            for i in range(M):
                V[i, k] /= norm
        sv = mp.svd_r(V, compute_uv=False)
        return float(max(sv) / min(sv))


def test_legs_diagonal_basis_is_too_ill_conditioned():
    """Why the kernels use products of steps: diagonalising A needs a change of basis with
    condition number 8e10 at M = 16 and 1e23 at M = 32 (3e47 at M = 64)."""
    assert 5e10 < legs_eigenvector_condition(16) < 2e11
    assert legs_eigenvector_condition(32) > 1e22


def test_legs_decode_steps_equal_the_chunked_kernel():
    case, _ = legs_case(8, B=2, H=2, T=11, R=3, V=4)
    feats = [to_torch(case[k]) for k in ("fq", "fk", "v")]
    o = legs.legs_fwd(*feats, 6, None)
    state, outs = None, []
    for t in range(11):
        step, state = legs.legs_step(*(x[:, t] for x in feats), 6, state)
        assert state.c.shape == (2, 2, 6, 7) and state.n == t + 1
        outs.append(step)
    assert rel_err(torch.stack(outs, 1).cpu(), o.cpu()) < 1e-13


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: a.__setitem__(1, a[1][:, :3]), r"fk: expected shape \(1, 6, 2, 4\)"),
        (lambda a: a.__setitem__(2, a[2].half()), r"v: expected the dtype of fq \(float64\)"),
        (lambda a: a.__setitem__(3, 0), "M: expected an integer >= 1"),
        (lambda a: a.__setitem__(4, torch.tensor([0, 4, 3, 6], device=DEVICE)), "non-decreasing"),
    ],
)
def test_legs_bad_input_names_the_argument(change, match):
    case, _ = legs_case(0, T=6)
    args = [*(to_torch(case[k]) for k in ("fq", "fk", "v")), 4, None]
    change(args)
    with pytest.raises(ValueError, match=match):
        interdomain_legs(*args[:4], cu_seqlens=args[4], impl="triton")


# Against the eager twins (backends/torch/eager_interdomain.py), through the registry

# Importing attnspec.backends.torch (above) registers the eager twins.


@pytest.mark.parametrize("readout", ["linear", "ratio"])
@pytest.mark.parametrize("diagonal", DIAGONALS)
def test_s4d_matches_the_eager_twin(readout, diagonal):
    """varlen with a length-1 segment, initial states and a final-state cotangent: the kernels
    (each form of the diagonal blocks, in chunks of two programs of two blocks) and the eager
    chunked form agree on every output and gradient."""
    cu = [0, 1, 30, 50]
    case, do = s4d_case(31, B=1, H=1, T=50, R=3, V=4, M=6, mag=0.95, readout=readout)
    rng = np.random.default_rng(32)
    C = 3 + 4 + (readout == "ratio")
    h0, dht = (
        pair(rng.standard_normal((3, 1, 6, C)) + 1j * rng.standard_normal((3, 1, 6, C)))
        for _ in range(2)
    )
    args = (
        *(to_torch(case[k]) for k in ("fq", "kt", "vt")),
        *(pair(case[k]) for k in ("lam", "b", "c")),
        readout,
        Packing(tuple(cu)),
        h0,
    )
    twin_fwd, twin_bwd = dispatch.lookup("s4d_fwd", "eager"), dispatch.lookup("s4d_bwd", "eager")
    with chunks.block_sizes(*forced((32, 16, 8), diagonal)):
        *fwd, saved = s4d.s4d_fwd(*args, return_saved=True)
        # the backward with the forward's chunk states and qe, and recomputing them
        got = [s4d_grad.s4d_bwd(*args, to_torch(do), dht, kept) for kept in (saved, None)]
    for x, want in zip(fwd, twin_fwd(*args), strict=True):
        assert rel_err(x.cpu(), want.cpu()) < 1e-12
    want = twin_bwd(*args, to_torch(do), dht)
    for grads in got:
        for x, y in zip(grads, want, strict=True):
            assert rel_err(x.cpu(), y.cpu()) < 1e-12


def test_legs_matches_the_eager_twin():
    cu = Packing((0, 33, 34, 60))
    case, do = legs_case(33, B=1, H=1, T=60, R=3, V=5)
    args = (*(to_torch(case[k]) for k in ("fq", "fk", "v")), 12, cu)
    o = legs.legs_fwd(*args)
    assert rel_err(o.cpu(), dispatch.lookup("legs_fwd", "eager")(*args).cpu()) < 1e-12
    got = legs.legs_bwd(*args, to_torch(do))
    for x, y in zip(got, dispatch.lookup("legs_bwd", "eager")(*args, to_torch(do)), strict=True):
        assert rel_err(x.cpu(), y.cpu()) < 1e-12


# The GPU check's S4D section, dry run


def test_gpu_s4d_dry_run(tmp_path):
    """``python -m bench.gpu_s4d --dry-run``: the reference check passes, the table prints and
    the rows and the ratios are in its file (CPU, interpreter, tiny shapes; the GPU check runs
    the same code at full size)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run(
        [sys.executable, "-m", "bench.gpu_s4d", "--dry-run", "--out", str(tmp_path / "s4d.json")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(": pass (") == 4 and "FAIL" not in run.stdout
    assert "S4D vs chunk_gla" in run.stdout and "fwd+bwd" in run.stdout
    report = json.loads((tmp_path / "s4d.json").read_text())
    assert report["check_passed"] and report["summary"][0].startswith("S4D vs chunk_gla")
    assert {(r["dv"], r["mode"]) for r in report["rows"]} == {(16, "fwd"), (16, "fwd+bwd")}
    assert all(r["ms"] > 0 and r["peer_ms"] > 0 for r in report["rows"])
