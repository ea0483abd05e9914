"""The Pallas kernels of FPA and FoX (interpreted on CPU) against the reference and their XLA twin.

Small shapes with 16-position tiles, so every sweep crosses several tiles (the kernels run one
program per tile in the interpreter).
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drawers import gated
from jax_support import canonical, draw, reference_fpa, x64  # noqa: F401  (x64: autouse fixture)

from attnspec.backends.jax import fox_attention, fpa_attention, fpa_mosaic, fpa_pallas
from attnspec.conformance.metrics import relative_error as rel
from attnspec.conformance.tolerances import tolerance
from attnspec.reference import fpa as ref


def grads_of(fn, args, cotangent):
    out, pullback = jax.vjp(fn, *(jnp.asarray(a) for a in args))
    return out, pullback(cotangent)


@pytest.mark.parametrize(
    "B, T, N, K, kind, cu",
    [
        (2, 45, 4, 2, "walk", None),  # GQA, ragged T over three tiles
        (1, 40, 2, 2, "brackets", None),  # ties across tile borders (section 6)
        (1, 45, 2, 1, "walk", (0, 1, 20, 45)),  # packed sequences, a length-1 segment
    ],
)
def test_fpa_kernels_match_the_reference(B, T, N, K, kind, cu):
    args = draw(B, T, N, K, 8, 5, seed=T + N, field_kind=kind)
    rng = np.random.default_rng(0)
    do, dlse = rng.standard_normal((B, T, N, 5)), rng.standard_normal((B, T, N))

    def fn(*a):
        return fpa_attention(
            *a, return_lse=True, implementation="pallas", block_size=16, cu_seqlens=cu
        )

    (o, lse), grads = grads_of(fn, args, (jnp.asarray(do), jnp.asarray(dlse)))
    o_ref, lse_ref, g_ref = reference_fpa(*args, do, dlse, cu_seqlens=cu)
    for start, stop in itertools.pairwise(cu or (0, T)):  # each sequence on its own scale
        w = slice(start, stop)
        assert rel(canonical(o[:, w]), o_ref[:, :, w]) <= 1e-12
        assert rel(canonical(lse[:, w]), lse_ref[:, :, w]) <= 1e-12
        for g, r in zip(grads, g_ref, strict=True):
            assert rel(canonical(g[:, w]), r[:, :, w]) <= 1e-12


def test_fox_kernels_match_the_reference_with_unit_gates():
    B, T, N, H = 1, 40, 2, 8
    rng = np.random.default_rng(1)
    args = gated(rng, B, T, N, N, H, H, unit=0.4)  # f = 1: ties of (F6); the reference layout
    do = rng.standard_normal((B, T, N, H))
    fn = lambda *a: fox_attention(*a, implementation="pallas", block_size=16)  # noqa: E731
    o, grads = grads_of(fn, [np.swapaxes(a, 1, 2) for a in args], jnp.asarray(do))
    assert rel(canonical(o), ref.fox_attention_direct(*args)) <= 1e-12
    for g, r in zip(grads, ref.fox_attention_vjp(*args, canonical(do)), strict=True):
        assert rel(canonical(g), r) <= 1e-12


def _pallas_and_xla(dtype):
    """Outputs, lse and gradients of the kernels and of the XLA loop on the same inputs."""
    args = draw(1, 40, 2, 1, 16, 8, seed=2)
    typed = [jnp.asarray(a, dtype if i < 3 else "float32") for i, a in enumerate(args)]
    rng = np.random.default_rng(3)
    do = jnp.asarray(rng.standard_normal((1, 40, 2, 8)), dtype)
    dlse = jnp.asarray(rng.standard_normal((1, 40, 2)), jnp.float32)
    results = {}
    for impl in ("pallas", "xla"):
        fn = lambda *a, impl=impl: fpa_attention(  # noqa: E731
            *a, return_lse=True, implementation=impl, block_size=16
        )
        (o, lse), pullback = jax.vjp(fn, *typed)
        results[impl] = [o, lse, *pullback((do, dlse))]
    return typed, do, dlse, results["pallas"], results["xla"]


def test_kernels_equal_their_xla_twin_in_float32():
    """float32 inputs keep float32 products (no TF32): the kernels and the XLA loop produce the
    same partial sums, so outputs, lse and every gradient agree to float32 rounding."""
    typed, _, _, pallas, xla = _pallas_and_xla("float32")
    for got, twin, x in zip(pallas[2:], xla[2:], typed, strict=True):
        assert got.dtype == twin.dtype == x.dtype
    for got, twin in zip(pallas, xla, strict=True):
        assert rel(got, np.asarray(twin, np.float64)) <= 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernels_round_the_second_products_operands_in_low_precision(dtype):
    """16-bit inputs: the kernels multiply 16-bit operands (tensor cores) and round p and G to
    the input dtype before p v, G k, G^T q and p^T do, as the torch Triton kernels do; the XLA
    loop keeps them in float32. So the kernels differ from their twin by at most one rounding of
    those operands and one of the result (2u, u the unit roundoff of the dtype; lse not at all),
    and both stay within the kit's tolerance of the float64 reference on the inputs as rounded."""
    typed, do, dlse, pallas, xla = _pallas_and_xla(dtype)
    u = float(jnp.finfo(dtype).eps) / 2
    seen = [np.asarray(a, np.float64) for a in typed]
    expected = reference_fpa(*seen, np.asarray(do, np.float64), np.asarray(dlse, np.float64))
    for got, twin, x in zip(pallas[2:], xla[2:], typed, strict=True):
        assert got.dtype == twin.dtype == x.dtype
    o_err = rel(canonical(pallas[0]), expected[0])
    for got, twin in zip(pallas, xla, strict=True):
        assert rel(got, np.asarray(twin, np.float64)) <= 2 * u
    assert o_err <= tolerance("fpa_attention", dtype, "output")
    assert rel(canonical(pallas[1]), expected[1]) <= 1e-5
    for g, r in zip(pallas[2:], expected[2], strict=True):
        assert rel(canonical(g), r) <= tolerance("fpa_attention", dtype, "gradient")


def test_vmap_of_grad_through_the_kernels():
    """The kernels batch under vmap (the pallas_call batching rule) inside the custom VJP."""
    E, T, N, H = 2, 20, 2, 8
    args = draw(E, T, N, N, H, H, seed=4)
    args = [a[:, None] for a in args]  # an extra leading axis over examples, B = 1
    w = np.random.default_rng(5).standard_normal((E, 1, T, N, H))

    def loss(q, k, v, field, level, w):
        o = fpa_attention(q, k, v, field, level, implementation="pallas", block_size=16)
        return jnp.vdot(o, w)

    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*map(jnp.asarray, (*args, w)))
    for e in range(E):
        x = [canonical(a[e]) for a in args]
        expected = ref.fpa_attention_vjp(*x, canonical(w[e]))
        for got, want in zip(grads, expected, strict=True):
            assert rel(canonical(got[e]), want) < 1e-12


def custom_calls(lowered, target=""):
    """Every stablehlo.custom_call of a lowering whose call target name contains ``target``."""
    calls = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    op_ = inner.operation
                    if op_.name == "stablehlo.custom_call" and target in str(
                        op_.attributes["call_target_name"]
                    ):
                        calls.append(op_)
                    walk(op_)

    walk(lowered.compiler_ir("stablehlo").operation)
    return calls


def triton_dots(lowered):
    """(lhs, rhs, result, inputPrecision) of every tt.dot in the Triton modules of a lowering:
    each Pallas kernel is a custom call whose backend config holds its Triton IR as bytecode."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as triton_dialect

    calls = custom_calls(lowered)
    dots = []
    for call in calls:
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with ir.Context() as ctx:
            triton_dialect.register_dialect(ctx)
            text = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes))
        # the printer leaves out inputPrecision at its default, IEEE
        pattern = (
            r"tt\.dot [^:]*?(?:inputPrecision = (\w+) )?"
            r": tensor<(\S+)> \* tensor<(\S+)> -> tensor<(\S+)>"
        )
        for precision, lhs, rhs, out in re.findall(pattern, text):
            types = (lhs.split("x")[-1], rhs.split("x")[-1], out.split("x")[-1])
            dots.append((*types, precision or "ieee"))
    return len(calls), dots


triton_only = pytest.mark.skipif(
    not fpa_pallas.triton_lowering_available(),
    reason="Pallas' Triton lowering is deprecated on this JAX (>= 0.11)",
)


@triton_only
@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_kernels_lower_through_the_gpu_triton_path(kind):
    """Cross-platform lowering for CUDA on this CPU machine: the three kernels (forward, dq, dkv)
    pass Pallas' Triton lowering (supported ops, block shapes) for bfloat16 inputs, GQA,
    packed sequences and a ragged T. Compiling and running them needs the GPU check."""
    q = jax.ShapeDtypeStruct((1, 300, 4, 96), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 96), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1, 300, 4), jnp.float32)
    op = fpa_attention if kind == "fpa" else fox_attention
    scalars = (s, s) if kind == "fpa" else (s,)

    def loss(*a):
        o = op(*a, implementation="pallas", interpret=False, cu_seqlens=(0, 100, 300))
        return jnp.sum(o.astype(jnp.float32))

    step = jax.grad(loss, argnums=tuple(range(3 + len(scalars))))
    lowered = jax.jit(step).trace(q, kv, kv, *scalars).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") == 3
    # bfloat16 operands and float32 accumulators in every product: tensor cores. Forward: q k^T
    # and p v; dq: q k^T, do v^T, G k; dkv: the same two and G^T q, p^T do; each on the
    # diagonal tile and in the loop.
    calls, dots = triton_dots(lowered)
    assert calls == 3 and len(dots) == 2 * (2 + 3 + 4)
    assert set(dots) == {("bf16", "bf16", "f32", "tf32")}


@triton_only
def test_float32_products_stay_float32_in_the_gpu_lowering():
    """float32 inputs: float32 operands at IEEE precision (no TF32) in every product."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.float32)
    s = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)

    def loss(*a):
        return jnp.sum(fox_attention(*a, implementation="pallas", interpret=False))

    step = jax.grad(loss, argnums=(0, 1, 2, 3))
    lowered = jax.jit(step).trace(q, q, q, s).lower(lowering_platforms=("cuda",))
    calls, dots = triton_dots(lowered)
    assert calls == 3 and len(dots) == 18
    assert set(dots) == {("f32", "f32", "f32", "ieee")}


# Mosaic GPU kernels


def mosaic_modules(lowered):
    """The text of every Mosaic GPU kernel of a lowering: each kernel is a custom call whose
    backend config holds its module as serialized bytecode, read back with Mosaic GPU's own
    pass."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import core as mosaic_core
    from jax.experimental.mosaic.gpu import dialect as mosaic_dialect

    texts = []
    for call in custom_calls(lowered, "mosaic_gpu"):
        config = ir.DictAttr(call.attributes["mhlo.backend_config"])
        with mlir.make_ir_context() as ctx:
            mosaic_dialect.register_dialect(ctx)
            ctx.allow_unregistered_dialects = True
            module = ir.Module.parse(ir.StringAttr(config["module"]).value_bytes)
            texts.append(str(mosaic_core._run_serde_pass(module, serialize=False)))
    return texts


# A TMA copy into shared memory: an nvvm op (JAX 0.10, 0.11) or inline PTX (JAX 0.12).
TMA_LOAD = (
    r"nvvm\.cp\.async\.bulk\.tensor\.shared\.cluster\.global"
    r"|cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global"
)


def mosaic_wgmmas(lowered):
    """The number of Mosaic GPU kernels in a lowering, their wgmma instructions (e.g.
    "m64n64k16.f32.bf16.bf16") and their count of TMA copies into shared memory."""
    texts = mosaic_modules(lowered)
    wgmmas, copies = [], 0
    for text in texts:
        wgmmas += re.findall(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)", text)
        copies += len(re.findall(TMA_LOAD, text))
    return len(texts), wgmmas, copies


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mosaic_kernels_lower_for_cuda_with_16bit_wgmma(dtype):
    """Cross-platform lowering of the Mosaic GPU forward for CUDA on this CPU machine (layouts,
    TMA and wgmma are resolved by Mosaic GPU at this stage): 16-bit operands and float32
    accumulators in every warpgroup matmul, operands brought in by TMA. Head dim 96 is padded
    to 128: q k^T is 8 k-steps of m64n64k16 and p v 4 of m64n128k16, on the diagonal tile and
    in the loop. Compiling and running them needs the GPU check."""
    q = jax.ShapeDtypeStruct((1, 300, 4, 96), dtype)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 96), dtype)
    s = jax.ShapeDtypeStruct((1, 300, 4), jnp.float32)

    def forward(*a):
        return fpa_attention(*a, implementation="mosaic", interpret=False, cu_seqlens=(0, 99, 300))

    lowered = jax.jit(forward).trace(q, kv, kv, s, s).lower(lowering_platforms=("cuda",))
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype]
    calls, wgmmas, copies = mosaic_wgmmas(lowered)
    # q once; k^T and v of the diagonal, then of the next tile from the diagonal's step and
    # from the loop's (double buffering)
    assert calls == 1 and copies == 1 + 2 + 2 * 2
    assert sorted(wgmmas) == sorted(
        [f"m64n64k16.f32.{short}.{short}"] * 16 + [f"m64n128k16.f32.{short}.{short}"] * 8
    )


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_mosaic_gradient_lowers_for_cuda_with_bf16_wgmma(kind):
    """The gradient on implementation="mosaic": forward, dq and dkv kernels, all three
    Mosaic GPU, every product on bfloat16 operands with float32 accumulators. Head dim 96 is
    padded to 128. Per tile, forward: q k^T (8 k-steps, n64) and p v (4, n128); dq: q k^T and
    do v^T (8 + 8, n64) and G k (4, n128); dkv: k q^T and v do^T (8 + 8, n64), p^T do and G^T q
    (4 + 4, n128); each on the diagonal tile and in the loop. TMA (each kernel double-buffers
    its per-tile copies): q once, k^T and v of the diagonal and of the next tile, issued from
    the diagonal's step and from the loop's (forward); q, do once, k^T, v^T, k likewise (dq);
    k, v once, q^T, q, do^T, do likewise (dkv)."""
    q = jax.ShapeDtypeStruct((1, 300, 4, 96), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 300, 2, 96), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1, 300, 4), jnp.float32)

    op, scalars = (fpa_attention, (s, s)) if kind == "fpa" else (fox_attention, (s,))

    def loss(*a):
        o = op(*a, implementation="mosaic", interpret=False, cu_seqlens=(0, 99, 300))
        return jnp.sum(o.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(scalars)))))
    lowered = step.trace(q, kv, kv, *scalars).lower(lowering_platforms=("cuda",))
    calls, wgmmas, copies = mosaic_wgmmas(lowered)
    assert calls == 3 and copies == (1 + 3 * 2) + (2 + 3 * 3) + (2 + 3 * 4)
    n64, n128 = "m64n64k16.f32.bf16.bf16", "m64n128k16.f32.bf16.bf16"
    assert sorted(wgmmas) == sorted([n64] * 2 * (8 + 16 + 16) + [n128] * 2 * (4 + 4 + 8))
    assert "xla.gpu.triton" not in lowered.as_text()


@pytest.mark.parametrize(
    "kind, cu", [("fpa", (0, 37, 100)), ("fox", None)], ids=["fpa-packed", "fox"]
)
def test_mosaic_kernels_match_the_reference(kind, cu):
    """The Mosaic GPU forward under Mosaic GPU's interpreter (shared memory, TMA, barriers and
    wgmma simulated): bfloat16, GQA, head dims padded to 64, a ragged T over two tiles, packed
    sequences and a field with ties in every segment minimum for fpa. Output and lse against
    the float64 reference on the inputs as rounded; the output against the Pallas kernels,
    which round p the same way (at most one rounding of p apart, u); the gradients (the
    Mosaic GPU backward) against the reference; no race found by the interpreter."""
    B, T, N, K, H, Hv, dtype = 1, 100, 2, 1, 32, 16, "bfloat16"
    q, k, v, field, level = draw(B, T, N, K, H, Hv, seed=6, field_kind="brackets")  # ties
    if kind == "fpa":
        args = [jnp.asarray(a, dtype) for a in (q, k, v)] + [
            jnp.asarray(a, jnp.float32) for a in (field, level)
        ]
        op = fpa_attention
    else:
        log_f = -np.random.default_rng(7).exponential(0.3, (B, T, N))
        args = [jnp.asarray(a, dtype) for a in (q, k, v)] + [jnp.asarray(log_f, jnp.float32)]
        op = fox_attention
    do = jnp.asarray(np.random.default_rng(8).standard_normal((B, T, N, Hv)), dtype)
    u = float(jnp.finfo(dtype).eps) / 2

    def run(impl):
        fn = lambda *a: op(*a, return_lse=True, implementation=impl, cu_seqlens=cu)  # noqa: E731
        (o, lse), pullback = jax.vjp(fn, *args)
        return o, lse, pullback((do, jnp.zeros_like(lse)))

    o, lse, grads = run("mosaic")
    o_pallas, _, _ = run("pallas")
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

    assert not interpret_pallas_call.get_races().races_found  # the interpreter's race detector
    assert rel(o, np.asarray(o_pallas, np.float64)) <= u
    seen = [np.asarray(a, np.float64) for a in args]
    cot = np.asarray(do, np.float64)
    for start, stop in [(0, T)] if cu is None else list(itertools.pairwise(cu)):
        w = slice(start, stop)
        x = [canonical(a[:, w]) for a in seen[:3]] + [np.swapaxes(a[:, w], 1, 2) for a in seen[3:]]
        x[1], x[2] = np.repeat(x[1], N // K, axis=1), np.repeat(x[2], N // K, axis=1)
        if kind == "fpa":
            o_ref, lse_ref = ref.fpa_attention(*x, return_lse=True)
            g = ref.fpa_attention_vjp(*x, canonical(cot[:, w]))
            expected = [g.dq, g.dk, g.dv, g.dfield, g.dlevel]
        else:
            o_ref = ref.fox_attention_direct(*x)
            lse_ref = None
            expected = list(ref.fox_attention_vjp(*x, canonical(cot[:, w])))
        assert rel(canonical(o[:, w]), o_ref) <= tolerance(f"{kind}_attention", dtype, "output")
        if lse_ref is not None:
            assert rel(np.swapaxes(lse[:, w], 1, 2), lse_ref) <= 1e-5
        fold = lambda y: y.reshape(y.shape[0], K, N // K, *y.shape[2:]).sum(2)  # noqa: E731
        expected[1], expected[2] = fold(expected[1]), fold(expected[2])
        for got, want in zip(grads, expected, strict=True):
            assert rel(canonical(got[:, w]), want) <= tolerance(
                f"{kind}_attention", dtype, "gradient"
            )


def test_mosaic_kernels_fit_in_hoppers_shared_memory():
    """Static budget, at the timed shape (D = 128, T = 32K): the shared memory each kernel
    (forward, dq, dkv) asks for at launch, as Mosaic GPU lowered it, fits in Hopper's 227 KiB
    per block and within fpa_mosaic's own estimate plus its margin, so the estimate that
    rejects larger head dims never lets through a kernel that would fail to launch. D = 192
    is rejected (its dq kernel would need about 264 KiB)."""
    q = jax.ShapeDtypeStruct((1, 32768, 2, 128), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1, 32768, 2), jnp.float32)

    def loss(*a):
        return jnp.sum(fpa_attention(*a, implementation="mosaic", interpret=False))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    lowered = step.trace(q, q, q, s, s).lower(lowering_platforms=("cuda",))
    sizes = [
        int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", text).group(1))
        for text in mosaic_modules(lowered)
    ]
    assert len(sizes) == 3
    estimate = fpa_mosaic.shared_bytes(128, 128, 32768 // 64)
    assert max(sizes) <= min(227 * 1024, estimate + 227 * 1024 - fpa_mosaic.SHARED_BYTES)
    assert "shared memory" in fpa_mosaic.supports(jnp.bfloat16, jnp.float32, 64, 192, 192)


def test_mosaic_rejects_what_its_kernels_do_not_take():
    q = jnp.zeros((1, 64, 2, 64), jnp.float32)
    s = jnp.zeros((1, 64, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"implementation='mosaic'.*bfloat16 or float16"):
        fox_attention(q, q, q, s, implementation="mosaic")
    q = q.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="block_size"):
        fox_attention(q, q, q, s, implementation="mosaic", block_size=128)
    wide = jnp.zeros((1, 64, 2, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"implementation='mosaic'.*shared memory"):
        fox_attention(wide, wide, wide, s, implementation="mosaic")


def test_on_jax_011_the_gpu_paths_avoid_the_triton_lowering(monkeypatch):
    """With the Triton lowering deprecated (JAX >= 0.11, simulated): implementation="pallas"
    refuses to compile for a GPU, naming the alternatives, and "mosaic" differentiates with
    no Triton kernel in the lowering."""
    monkeypatch.setattr(fpa_pallas, "_jax_version", lambda: (0, 11))
    q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)

    def loss(impl):
        def f(*a):
            o = fox_attention(*a, implementation=impl, interpret=False)
            return jnp.sum(o.astype(jnp.float32))

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))

    with pytest.raises(NotImplementedError, match="mosaic"):
        loss("pallas").trace(q, q, q, s).lower(lowering_platforms=("cuda",))
    text = loss("mosaic").trace(q, q, q, s).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 1 and "xla.gpu.triton" not in text


def test_the_gpu_paths_import_and_lower_without_warnings():
    """No deprecation (or other) warning from importing the JAX backend and lowering its GPU
    kernels for CUDA: the Pallas kernels where this JAX lowers them through Triton, and the
    Mosaic GPU kernels; a fresh process with warnings as errors."""
    import subprocess
    import sys

    script = """
import jax, jax.numpy as jnp
from attnspec.backends.jax import fox_attention, fpa_pallas
q = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
s = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)
impls = ["mosaic"] + (["pallas"] if fpa_pallas.triton_lowering_available() else [])
for impl in impls:
    f = lambda *a: jnp.sum(fox_attention(*a, implementation=impl, interpret=False))
    step = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))
    step.trace(q, q, q, s).lower(lowering_platforms=("cuda",))
print("lowered", impls)
"""
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lowered" in done.stdout
