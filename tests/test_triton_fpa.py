"""The Triton FPA and FoX kernels (backends/torch/triton_fpa.py) under the Triton interpreter.

Every kernel result is compared with the float64 reference (attnspec.reference.fpa), run per
query head and per packed sequence on the same rounded inputs, by normwise relative error against
the kit's tolerance table; FoX also with flash-linear-attention's naive torch FoX. Shapes are tiny;
tiles are forced small where a test is about crossing them, large elsewhere (interpreter cost
grows with programs x ops).
"""

import itertools
import os
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import drawers  # noqa: E402

from attnspec.backends.torch import dispatch, fox_attention, fpa_attention  # noqa: E402
from attnspec.backends.torch import triton_fpa as tf  # noqa: E402
from attnspec.backends.torch.triton_helpers import bf16_nearest  # noqa: E402
from attnspec.conformance.metrics import compare  # noqa: E402
from attnspec.conformance.tolerances import round_to, tolerance  # noqa: E402
from attnspec.reference import fpa as ref  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

# Triton 3.6's and 3.7's tl.dot assert that a given accumulator has its out_dtype (float32): the
# FPA/FoX kernels' float64 path (float64 inputs or per-token scalars) runs from Triton 3.8 (the
# interpreter and the compiler share that check; docs/decisions.md, "Supported versions").
OLD_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1" and tuple(
    int(part) for part in triton.__version__.split(".")[:2]
) < (3, 8)


def skip_float64_on_an_old_interpreter():
    """Skip a test of the kernels' float64 path (float64 inputs or per-token scalars) under
    an interpreter that cannot run it (OLD_INTERPRETER)."""
    if OLD_INTERPRETER:
        pytest.skip(f"Triton {triton.__version__}'s interpreter takes no float64 tl.dot")


DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
NARROW = ("q", "k", "v", "do")  # in the tested dtype; the per-token scalars stay wide
SMALL = tf.Tiles(32, 16)  # BT = 2 BS: both the diagonal split and the gap cross tiles
TINY = tf.Tiles(16, 16)
LARGE = tf.Tiles(64, 64)


# inputs


def walk_field(rng, kind: str, shape) -> np.ndarray:
    """(B, T, HQ) fields: the kit's kinds (tests/drawers.py: walk, monotone, brackets, constant,
    huge, cliff), and a sawtooth that ties the minima of every 16-row tile."""
    if kind == "sawtooth":  # period 16: every 16-row tile has the same minimum, at offset 8
        return np.broadcast_to(np.abs(np.arange(shape[1]) % 16 - 8.0)[:, None], shape).copy()
    B, T, HQ = shape
    return np.ascontiguousarray(np.swapaxes(drawers.field(rng, kind, (B, HQ, T)), 1, 2))


def levels(rng, kind: str, field: np.ndarray) -> np.ndarray:
    """The kit's level kinds (one_walk, offset, extreme)."""
    return drawers.level(rng, kind, field)


def draw(seed, B, T, HQ, H, K, V, *, field="walk", level="offset", log_f=None):
    """Float64 inputs in the torch layout; ``log_f`` (a callable of rng and shape) makes FoX."""
    rng = np.random.default_rng(seed)
    x = {
        "q": rng.standard_normal((B, T, HQ, K)),
        "k": rng.standard_normal((B, T, H, K)),
        "v": rng.standard_normal((B, T, H, V)),
        "do": rng.standard_normal((B, T, HQ, V)),
        "dlse": rng.standard_normal((B, T, HQ)),
    }
    if log_f is not None:
        x["log_f"] = log_f(rng, (B, T, HQ))
    else:
        x["field"] = walk_field(rng, field, (B, T, HQ))
        x["level"] = levels(rng, level, x["field"])
    return x


def rounded(x: dict, dtype: str) -> dict:
    """Inputs as the kernels receive them: q, k, v, do in ``dtype``, the rest float32 or wider."""
    wide = "float64" if dtype == "float64" else "float32"
    return {n: round_to(a, dtype if n in NARROW else wide) for n, a in x.items()}


# both sides


def heads_first(a: np.ndarray) -> np.ndarray:
    return np.moveaxis(a, 2, 1)  # [B, T, H, ...] -> [B, H, T, ...]


def reference(x: dict, cu_seqlens=None, scale=None) -> dict:
    """The float64 reference per packed sequence, k and v repeated over each GQA group."""
    B, T, HQ, _ = x["q"].shape
    G = HQ // x["k"].shape[2]
    bounds = [0, T] if cu_seqlens is None else list(cu_seqlens)
    out = {"o": np.zeros_like(x["do"]), "lse": np.zeros((B, T, HQ))} | {
        "d" + n: np.zeros_like(a) for n, a in x.items() if n not in ("do", "dlse")
    }
    for a, b in itertools.pairwise(bounds):
        seg = {n: heads_first(v[:, a:b]) for n, v in x.items()}
        kk, vv = (np.repeat(seg[n], G, axis=1) for n in ("k", "v"))
        if "log_f" in x:
            o, lse = ref.fox_attention(seg["q"], kk, vv, seg["log_f"], scale=scale, return_lse=True)
            g = ref.fox_attention_vjp(seg["q"], kk, vv, seg["log_f"], seg["do"], scale=scale)
            grads = {"dlog_f": g.dlog_f}
        else:
            args = (seg["q"], kk, vv, seg["field"], seg["level"])
            o, lse = ref.fpa_attention(*args, scale=scale, return_lse=True)
            g = ref.fpa_attention_vjp(*args, seg["do"], scale=scale, d_lse=seg["dlse"])
            grads = {"dfield": g.dfield, "dlevel": g.dlevel}
        grads |= {"dq": g.dq, "dk": g.dk, "dv": g.dv}
        for n in ("dk", "dv"):  # sum over the query heads of each group
            grads[n] = grads[n].reshape(B, -1, G, *grads[n].shape[2:]).sum(2)
        for n, value in {"o": o, "lse": lse, **grads}.items():
            out[n][:, a:b] = np.moveaxis(value, 1, 2)
    return out


def kernels(x: dict, dtype: str, cu_seqlens=None, scale=None, tiles=None) -> dict:
    """The Triton kernels on ``x`` (already rounded), results as float64 NumPy arrays."""
    if dtype == "float64":
        skip_float64_on_an_old_interpreter()
    wide = torch.float64 if dtype == "float64" else torch.float32
    t = {n: torch.tensor(a, dtype=DTYPES[dtype] if n in NARROW else wide) for n, a in x.items()}
    cu = None if cu_seqlens is None else Packing(tuple(cu_seqlens))
    with tf.forced_tiles(*(tiles or (LARGE, LARGE))):
        if "log_f" in x:
            o, lse = tf.fox_fwd(t["q"], t["k"], t["v"], t["log_f"], scale, cu)
            grads = tf.fox_bwd(t["q"], t["k"], t["v"], t["log_f"], o, lse, t["do"], None, scale, cu)
            names = ("dq", "dk", "dv", "dlog_f")
        else:
            args = (t["q"], t["k"], t["v"], t["field"], t["level"])
            o, lse = tf.fpa_fwd(*args, scale, cu)
            grads = tf.fpa_bwd(*args, o, lse, t["do"], t["dlse"], scale, cu)
            names = ("dq", "dk", "dv", "dfield", "dlevel")
    out = {"o": o, "lse": lse, **dict(zip(names, grads, strict=True))}
    for n, value in out.items():
        expected = t[n[1:]] if n.startswith("d") else None
        if expected is not None:  # a gradient has the dtype and shape of its input
            assert value.dtype == expected.dtype and value.shape == expected.shape, n
    assert o.dtype == t["q"].dtype and lse.dtype == wide
    return {n: v.double().numpy() for n, v in out.items()}


def assert_close(got: dict, want: dict, dtype: str, op: str = "fpa_attention"):
    failures = []
    for name, value in want.items():
        quantity = {"o": "output", "lse": "lse"}.get(name, "gradient")
        c = compare(got[name], value, tolerance(op, dtype, quantity))
        if not c.passed:
            failures.append(f"{name}: {c.describe()}")
    assert not failures, "; ".join(failures)


def check(seed, dtype="float64", cu_seqlens=None, tiles=None, scale=None, **shape):
    x = rounded(draw(seed, **shape), dtype)
    op = "fox_attention" if "log_f" in x else "fpa_attention"
    assert_close(
        kernels(x, dtype, cu_seqlens, scale, tiles), reference(x, cu_seqlens, scale), dtype, op
    )


def gates(low: float, high: float, unit: float = 0.0):
    """log f ~ -U(low, high), a fraction ``unit`` exactly 0 (gates f = 1: ties)."""

    def draw_gates(rng, shape):
        log_f = -rng.uniform(low, high, shape)
        log_f[rng.random(shape) < unit] = 0.0
        return log_f

    return draw_gates


# FPA


def test_registered_as_triton():
    for name in ("fpa_fwd", "fpa_bwd", "fox_fwd", "fox_bwd"):
        # launched with the tensors' device current (dispatch's device guard) around the kernel
        assert dispatch.lookup(name, "triton").__wrapped__ is getattr(tf, name)  # type: ignore[attr-defined]


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 300])
def test_lengths_across_tiles(T):
    tiles = (SMALL, SMALL) if T < 127 else (LARGE, tf.Tiles(64, 32))
    check(T, tiles=tiles, B=1, T=T, HQ=1, H=1, K=16, V=16)


@pytest.mark.parametrize(
    ("field", "level", "tiles"),
    [
        ("walk", "offset", SMALL),
        ("walk", "one_walk", SMALL),
        ("monotone", "one_walk", SMALL),  # FoX-like
        # Integer and constant fields: argmin ties inside tiles, between A, the gap and B, and
        # between gap tiles (16-row tiles: up to 3 tiles in the gap).
        ("brackets", "one_walk", TINY),
        ("constant", "offset", TINY),
        ("sawtooth", "one_walk", TINY),  # equal minima in A, in every gap tile and in B
        ("huge", "offset", SMALL),  # |phi| ~ 1e4 with O(1) level offsets
        ("cliff", "offset", SMALL),  # a 1e30 descent
        ("walk", "extreme", SMALL),  # levels +-1e4
    ],
)
def test_fields_and_levels(field, level, tiles):
    check(7, tiles=(tiles, tiles), B=2, T=70, HQ=1, H=1, K=16, V=16, field=field, level=level)


@pytest.mark.parametrize(("field", "level"), [("walk", "offset"), ("brackets", "one_walk")])
def test_backward_diagonal_in_steps_narrower_than_the_visited_tiles(field, level):
    """dq and dk/dv step through their diagonal tile ``diagonal`` rows at a time (the Hopper
    tiles: 32 of 64); T = 70 ends inside a step."""
    steps = tf.Tiles(32, 32, diagonal=16)
    check(8, tiles=(SMALL, steps), B=2, T=70, HQ=1, H=1, K=16, V=16, field=field, level=level)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dtypes(dtype):
    check(3, dtype, tiles=(SMALL, SMALL), B=1, T=100, HQ=2, H=1, K=32, V=16)


def test_gqa_8_2():
    check(4, tiles=(SMALL, SMALL), B=1, T=40, HQ=8, H=2, K=16, V=16)


@pytest.mark.parametrize(("K", "V"), [(60, 100), (100, 60)])
def test_head_dims_not_powers_of_two(K, V):
    check(5, B=1, T=65, HQ=1, H=1, K=K, V=V, scale=0.3)


def test_varlen_with_a_length_one_segment():
    cu = [0, 15, 16, 100, 300]
    check(6, cu_seqlens=cu, tiles=(SMALL, SMALL), B=1, T=300, HQ=1, H=1, K=16, V=16)


@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 80),
    tiles=st.sampled_from([(TINY, TINY), (SMALL, SMALL), (SMALL, TINY), (LARGE, SMALL)]),
    heads=st.sampled_from([(1, 1), (2, 1), (2, 2)]),
    kinds=st.sampled_from([("walk", "offset"), ("brackets", "one_walk"), ("constant", "offset")]),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_tiles_fields(T, tiles, heads, kinds, seed):
    check(
        seed,
        tiles=tiles,
        B=1,
        T=T,
        HQ=heads[0],
        H=heads[1],
        K=16,
        V=8,
        field=kinds[0],
        level=kinds[1],
    )


@triton.jit
def _round_trip(x, y, N: tl.constexpr):
    r = tl.arange(0, N)
    tl.store(y + r, bf16_nearest(tl.load(x + r)))


def test_interpreter_rounds_bf16_operands_like_a_gpu():
    """Under the interpreter the kernels round computed bf16 dot operands themselves (its own
    conversion truncates): nearest, ties to even, as torch and the GPU do."""
    x = torch.randn(256) * torch.logspace(-6, 6, 256)
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-9])  # ties
    x[4:9] = torch.tensor([float("inf"), -float("inf"), 3.4028235e38, -0.0, 1e-40])  # max -> inf
    y = torch.empty_like(x)
    _round_trip[(1,)](x, y, N=256)
    assert torch.equal(y, x.bfloat16().float())


@triton.jit
def _rounded_sum(x, y, N: tl.constexpr, STEPS: tl.constexpr):
    r = tl.arange(0, N)
    acc = tl.zeros([N], tl.float32)
    for _ in tl.static_range(STEPS):
        acc += bf16_nearest(tl.load(x + r))  # a helper call per step
    tl.store(y + r, acc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's patch")
def test_the_interpreter_patches_the_language_once_per_launch(monkeypatch):
    """tests/conftest.py makes the interpreter swap in its language once per launch, not on every
    helper call (the cost of a third of an interpreted S4D case): 8 helper calls, and
    ``triton.language`` is swapped in for the kernel and at most once more (for the library's
    own helpers, here ``tl.zeros``, once their globals hold it), not 9 times; the result of each
    step's helper call is still there."""
    from triton.runtime import interpreter

    swaps = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(
        interpreter, "_patch_builtin", lambda *a: swaps.append(a[0]) or patch_builtin(*a)
    )
    x = torch.randn(16)
    y = torch.empty_like(x)
    for _ in range(2):  # the second launch runs the rewritten helpers
        swaps.clear()
        _rounded_sum[(1,)](x, y, N=16, STEPS=8)
        assert torch.equal(y, x.bfloat16().float() * 8)
        patched = sum(1 for pkg in swaps if pkg is tl)  # each swap patches triton.language once
        assert patched <= 2, f"triton.language patched {patched} times in one launch"


# FoX


@pytest.mark.parametrize(
    "log_f",
    [gates(0.0, 20.0), gates(0.01, 1.0, unit=0.4), gates(0.0, 0.0, unit=1.0)],
    ids=["strong_decay_to_-20", "unit_gates_40%", "all_gates_one"],
)
def test_fox_matches_reference(log_f):
    check(8, tiles=(SMALL, SMALL), B=2, T=70, HQ=2, H=1, K=16, V=16, log_f=log_f)


def test_fox_backward_diagonal_in_steps_narrower_than_the_visited_tiles():
    """As for FPA: dk/dv steps 16 rows of its 32-row diagonal tile (dq steps 32)."""
    steps = tf.Tiles(32, 32, diagonal=16)
    check(8, tiles=(SMALL, steps), B=2, T=70, HQ=2, H=1, K=16, V=16, log_f=gates(0.01, 1.0))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fox_dtypes_gqa_varlen(dtype):
    cu = [0, 15, 16, 100, 150]
    check(9, dtype, cu, (SMALL, SMALL), B=1, T=150, HQ=4, H=2, K=32, V=16, log_f=gates(0, 1))


def test_fox_path_equals_fpa_with_one_walk_unit_gates():
    """(F6) with gates f = 1 in places: FPA on field = level = cumsum(log f), its gradients
    chained through the cumsum, equals the FoX fast path (spec section 6: ties included)."""
    x = draw(10, 1, 70, 2, 2, 16, 16, log_f=gates(0.01, 2.0, unit=0.5))
    fox = kernels(x, "float64", tiles=(SMALL, SMALL))
    c = np.cumsum(x["log_f"], axis=1)
    one_walk = {n: x[n] for n in NARROW} | {"field": c, "level": c, "dlse": 0 * c}
    fpa = kernels(one_walk, "float64")
    chained = np.flip(np.cumsum(np.flip(fpa.pop("dfield") + fpa.pop("dlevel"), 1), 1), 1)
    assert_close(fpa | {"dlog_f": chained}, fox, "float64")


def test_fox_matches_fla_naive():
    """flash-linear-attention's naive torch FoX (its own test regime: weak decay, GQA 8/2,
    D = 60), in float32 with autograd for the gradients."""
    naive = pytest.importorskip("fla.ops.forgetting_attn.naive")
    x = rounded(draw(11, 1, 48, 8, 2, 60, 60, log_f=gates(0.01, 0.1)), "float32")
    t = {n: torch.tensor(a, dtype=torch.float32, requires_grad=n != "do") for n, a in x.items()}
    o = naive.naive_forgetting_attn(t["q"], t["k"], t["v"], t["log_f"])
    o.backward(t["do"])
    want = {"o": o.detach().double().numpy()}
    want |= {"d" + n: t[n].grad.double().numpy() for n in ("q", "k", "v", "log_f")}
    got = kernels(x, "float32")
    assert_close({n: got[n] for n in want}, want, "float32", "fox_attention")


@pytest.mark.parametrize("op", ["fpa", "fox"])
def test_matches_eager_twin(op):
    """The eager torch twin (an independent blockwise implementation, the CPU path and the
    fallback) on the same float64 inputs: GQA 4/2, varlen with a length-1 segment, ties."""
    pytest.importorskip("attnspec.backends.torch.eager_fpa")  # registers impl "eager"
    cu = [0, 15, 16, 100, 150]
    extra = {"log_f": gates(0.01, 2.0, unit=0.3)} if op == "fox" else {"field": "brackets"}
    x = draw(13, 1, 150, 4, 2, 16, 24, level="one_walk", **extra)
    t = {n: torch.tensor(a) for n, a in x.items()}
    mine = kernels(x, "float64", cu, scale=0.3, tiles=(SMALL, SMALL))
    args = (t["q"], t["k"], t["v"], *((t["log_f"],) if op == "fox" else (t["field"], t["level"])))
    cu_t = Packing(tuple(cu))
    o, lse = dispatch.lookup(f"{op}_fwd", "eager")(*args, 0.3, cu_t)
    dlse = None if op == "fox" else t["dlse"]
    grads = dispatch.lookup(f"{op}_bwd", "eager")(*args, o, lse, t["do"], dlse, 0.3, cu_t)
    names = ("dq", "dk", "dv", "dlog_f") if op == "fox" else ("dq", "dk", "dv", "dfield", "dlevel")
    twin = {"o": o, "lse": lse} | dict(zip(names, grads, strict=True))
    assert_close(mine, {n: v.numpy() for n, v in twin.items()}, "float64", f"{op}_attention")


@pytest.mark.parametrize("op", ["fpa", "fox"])
def test_float64_scalars_with_float32_q_match_eager_twin(op):
    """float32 q, k, v with float64 field and level (or log f), which the launcher accepts: the
    products accumulate in float32 (a float64 accumulator of float32 products gave dv ~1e37)."""
    skip_float64_on_an_old_interpreter()
    pytest.importorskip("attnspec.backends.torch.eager_fpa")
    extra = {"log_f": gates(0.01, 2.0, unit=0.3)} if op == "fox" else {"field": "brackets"}
    x = draw(17, 1, 40, 2, 2, 16, 16, level="one_walk", **extra)
    t = {n: torch.tensor(a) for n, a in x.items()}
    for n in NARROW:
        t[n] = t[n].float()
    scalars = (t["log_f"],) if op == "fox" else (t["field"], t["level"])
    args = (t["q"], t["k"], t["v"], *scalars)
    dlse = None if op == "fox" else t["dlse"]
    got, want = {}, {}
    for impl, out in (("triton", got), ("eager", want)):
        o, lse = dispatch.lookup(f"{op}_fwd", impl)(*args, 0.3, None)
        grads = dispatch.lookup(f"{op}_bwd", impl)(*args, o, lse, t["do"], dlse, 0.3, None)
        out.update({"o": o} | dict(zip(("dq", "dk", "dv"), grads, strict=False)))
    for n in want:
        err = (got[n] - want[n]).norm() / want[n].norm()
        assert err < 1e-5, f"{n}: relative error {err:.3g}"


# theta


def test_tile_skipping_is_the_reference_without_the_skipped_tiles():
    """Section 7: with theta, key tiles whose every descent depth is >= theta are dropped for
    the query tile; everything else is exact. Without theta nothing is dropped."""
    skip_float64_on_an_old_interpreter()
    B, T, HQ = 1, 96, 1
    x = rounded(draw(12, B, T, HQ, 1, 16, 16, field="monotone", level="one_walk"), "float64")
    theta, bt, bs = 4.0, 32, 16
    t = {n: torch.tensor(a) for n, a in x.items()}
    args = (t["q"], t["k"], t["v"], t["field"], t["level"], None, None)
    with tf.forced_tiles(tf.Tiles(bt, bs)):
        o, lse = tf.fpa_fwd(*args, theta=theta)
    q, k, v, field, level = (heads_first(x[n])[0, 0] for n in ("q", "k", "v", "field", "level"))
    logits = q @ k.T / 4.0 - ref.descent_depth(field, level)
    skipped = np.zeros((T, T), dtype=bool)
    for i0 in range(bt, T, bt):
        for j0 in range(0, i0, bs):
            if ref.tile_skippable(field, level, (j0, j0 + bs - 1), i0, theta):
                skipped[i0 : i0 + bt, j0 : j0 + bs] = True
    assert skipped.any()
    logits = np.where(np.tril(np.ones((T, T), dtype=bool)) & ~skipped, logits, -np.inf)
    lse_want = np.logaddexp.reduce(logits, axis=1)
    o_want = np.exp(logits - lse_want[:, None]) @ v
    assert_close(
        {"o": o[0, :, 0].numpy(), "lse": lse[0, :, 0].numpy()},
        {"o": o_want, "lse": lse_want},
        "float64",
    )
    exact = ref.fpa_attention(q, k, v, field, level, scale=0.25)
    assert compare(o[0, :, 0].numpy(), exact, 1e-12).rel > 1e-9  # the skipping is real


# bad input
# Checked once, by the public op (backends/torch/checks.py), before the Triton kernel is reached;
# the launchers assert only their invariants.


def _args(**change):
    a = {
        "q": torch.zeros(1, 8, 2, 16),
        "k": torch.zeros(1, 8, 1, 16),
        "v": torch.zeros(1, 8, 1, 16),
        "field": torch.zeros(1, 8, 2),
        "level": torch.zeros(1, 8, 2),
        "scale": None,
        "cu_seqlens": None,
    }
    return a | change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"k": torch.zeros(1, 8, 3, 16)}, "k: expected H heads dividing the 2 query heads of q"),
        ({"v": torch.zeros(1, 8, 1, 16, dtype=torch.float64)}, "v: expected the dtype of q"),
        ({"field": torch.zeros(1, 8, 2, dtype=torch.int32)}, "field: expected dtype"),
        ({"level": torch.zeros(1, 9, 2)}, "level: expected shape (1, 8, 2)"),
        ({"q": torch.zeros(1, 8, 2, 300), "k": torch.zeros(1, 8, 1, 300)}, "q: head dim K = 300"),
        ({"cu_seqlens": torch.tensor([0, 3, 2, 8])}, "cu_seqlens: expected non-decreasing"),
        ({"cu_seqlens": torch.tensor([0, 3, 7])}, "cu_seqlens: expected offsets from 0 to T = 8"),
        ({"scale": float("nan")}, "scale: expected a finite number"),
    ],
)
def test_bad_input_names_the_argument(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        fpa_attention(**_args(**change), impl="triton")


def test_varlen_needs_batch_one():
    a = _args(q=torch.zeros(2, 8, 2, 16), k=torch.zeros(2, 8, 1, 16), v=torch.zeros(2, 8, 1, 16))
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences need B = 1"):
        fox_attention(
            a["q"], a["k"], a["v"], torch.zeros(2, 8, 2), cu_seqlens=torch.tensor([0, 8]),
            impl="triton",
        )  # fmt: skip


def test_impl_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    message = "impl: Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on cpu"
    with pytest.raises(ValueError, match=message):
        fpa_attention(**_args(), impl="triton")


def test_the_op_hands_the_kernel_contiguous_inputs():
    """The launchers assert contiguity; the op makes a transposed q contiguous first."""
    skip_float64_on_an_old_interpreter()
    rng = np.random.default_rng(3)
    q = torch.tensor(rng.standard_normal((1, 8, 16, 2))).transpose(2, 3)
    k, v = (torch.tensor(rng.standard_normal((1, 8, 1, 16))) for _ in range(2))
    field = torch.tensor(rng.standard_normal((1, 8, 2)))
    got = fpa_attention(q, k, v, field, field, impl="triton")
    assert not q.is_contiguous()
    assert torch.equal(got, fpa_attention(q.contiguous(), k, v, field, field, impl="triton"))


def test_tiles_must_nest():
    with pytest.raises(ValueError, match="must be a multiple of visit"):
        tf.Tiles(16, 32)
    with pytest.raises(ValueError, match="power of two >= 16"):
        tf.Tiles(24, 8)
    with pytest.raises(ValueError, match=r"Tiles\.diagonal"):
        tf.Tiles(64, 64, diagonal=24)


# GPU compiler

SM90_COMPILE = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnspec.backends.torch import triton_fpa as tf

ptr = {n: "*bf16" for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
ptr |= {"links": "*i32", "cu_seqlens": "*i64", "tiles": "*i32", "tile_start": "*i32"}
ints = {n: "i32" for n in ("N_TOK", "NTILES", "NT_MAX", "G", "WS")}
def build(kernel, constexprs):
    types = {n: "constexpr" if n in constexprs else ptr.get(n) or ints.get(n, "*fp32")
             for n in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
sizes = dict(HQ=2, K=16, V=16, BT=32, BS=16, BK=16, BV=16, LOG_BT=5, DOT=tl.bfloat16,
             PRECISION="tf32", ROUND_BF16=False, WINDOW=True)  # the (F3w) path; none: gpu_static
for fox in (False, True):
    unused = dict(level=None, links=None) if fox else {}
    build(tf._fwd_kernel, sizes | dict(FOX=fox, SKIP=not fox) | ({"level": None} if fox else {}))
    for sums in ("tf32x3", "bf16x2"):
        extra = dict(FOX=fox, SUM_PRECISION=sums, INTERPRET=False, BDQ=16)
        build(tf._bwd_dq_kernel, sizes | unused | extra)
    build(tf._bwd_dkv_kernel, sizes | unused | dict(FOX=fox, BDK=16))
build(tf._block_minima_kernel, dict(HQ=2, BT=32, LOG_BT=5, WITH_LINKS=True))
build(tf._block_sums_kernel, dict(HQ=2, BT=32))
build(tf._delta_kernel, dict(HQ=2, V=16, BLOCK=64, BV=16, HAS_DLSE=True))
build(tf._dfield_kernel, dict(HQ=2, BT=32, BN=64))
build(tf._segment_sums_kernel, dict(HQ=2, BLOCK=64))
"""


def test_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts code a GPU compiler rejects: compile every kernel, FPA and FoX
    paths, to sm90 (H200) machine code with this triton, small tiles (legality, not speed; the
    launcher's Hopper tiles are compiled by the static gate, tests/test_gpu_static.py)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run(
        [sys.executable, "-c", SM90_COMPILE], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]


def test_one_device_class_for_every_triton_family(monkeypatch):
    """Both Triton families pick their tiles from the one table (backends/tile_sizes.py) by
    devices.device_class: the interpreter (or a CPU tensor) gets the interpreter row, a CUDA
    device its class's row; every class has a row in both tables."""
    from attnspec.backends import tile_sizes
    from attnspec.backends.torch import devices, triton_chunks

    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert devices.device_class(cpu) == "interpreter"
    assert triton_chunks.blocks_for(cpu) == tile_sizes.DEVICE_BLOCKS["interpreter"]
    assert tf.tiles_for(cpu, backward=True) == tile_sizes.TILE_TABLE["interpreter"][1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert devices.device_class(cpu) == "interpreter"  # only the interpreter runs CPU tensors
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert devices.device_class(torch.device("cuda")) == "hopper"
    assert triton_chunks.blocks_for(torch.device("cuda")) == tile_sizes.DEVICE_BLOCKS["hopper"]
    assert tf.tiles_for(torch.device("cuda"), backward=False) == tile_sizes.TILE_TABLE["hopper"][0]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert devices.device_class(torch.device("cuda")) == "gpu"
    for kind in {*tile_sizes.DEVICE_CLASSES.values(), "gpu", "interpreter"}:
        assert kind in tile_sizes.TILE_TABLE


def test_bfloat16_stores_round_to_nearest_as_a_gpu_does():
    """The interpreter's float32 -> bfloat16 conversion truncates; a GPU's rounds to nearest,
    ties to even. With two keys of equal logits (q = 0) and no decay, o = (v0 + v1) / 2 and
    dv_0 = do_0 + do_1 / 2, dv_1 = do_1 / 2 are exact in float32 from bfloat16 inputs, so the
    kernels' bfloat16 results must be torch's round-to-nearest of them (truncation is off by one
    unit in the last place for about half of the elements; fox/covering/0 in bfloat16 failed
    the kit on it: q's gradient 2.97e-2 against 2e-2, from delta = <dO, o> on a truncated o)."""
    gen = torch.Generator().manual_seed(0)
    V = 64
    q = torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 2, 1, V, generator=gen).to(torch.bfloat16)
    do = torch.randn(1, 2, 1, V, generator=gen).to(torch.bfloat16)
    log_f = torch.zeros(1, 2, 1)
    o, lse = tf.fox_fwd(q, k, v, log_f, 1.0, None)
    v32, do32 = v.float(), do.float()
    np.testing.assert_array_equal(
        o[0, 1].float(), ((v32[0, 0] + v32[0, 1]) / 2).to(torch.bfloat16).float()
    )
    _, _, dv, _ = tf.fox_bwd(q, k, v, log_f, o, lse, do, None, 1.0, None)
    expected = torch.stack([do32[0, 0] + do32[0, 1] / 2, do32[0, 1] / 2]).to(torch.bfloat16)
    np.testing.assert_array_equal(dv[0].float(), expected.float())
