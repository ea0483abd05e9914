"""The JAX section of the GPU check (``bench/gpu_check.sh``): correctness first, then timings.

The GPU paths of the JAX backend are the Pallas kernels (Triton lowering, JAX < 0.11) and the
Mosaic GPU kernels (``implementation="mosaic"``, 16-bit inputs, both passes); each one the
installed JAX supports is checked.

1. Correctness: each path's FPA and FoX, compiled for the GPU, forward and backward on shapes
   that cross tile borders (GQA, head dims 64 and 128, packed sequences), against the float64
   reference on the host and the XLA path on the device, with the kit's tolerances.
2. Timings: each path, the XLA loop and ``jax.nn.dot_product_attention`` (cuDNN, causal, no
   decay: the floor) in bfloat16, forward and forward+backward, D = 128, T in {8K, 32K} with
   B * T = 32K tokens and H * D = 2048; milliseconds and TFLOP/s by the FlashAttention
   convention (4 B H T^2 D / 2 forward, 3.5x that forward+backward). Each row is printed (and
   written to $OUT/pallas.json) as it is measured; a row that fails records its error.

    python -m bench.gpu_pallas            # on the GPU machine, about two minutes
    python -m bench.gpu_pallas --dry-run  # the same steps on CPU: interpreters, tiny shapes

Without a GPU and without --dry-run it measures nothing (the interpreters are for tiny shapes
only) and exits 0. Exit status 1 when a correctness check fails. With $OUT set, the results also
go to $OUT/pallas.json.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from attnspec.backends.jax import fox_attention, fpa_attention, fpa_pallas
from attnspec.conformance.metrics import relative_error as rel
from attnspec.conformance.tolerances import tolerance
from attnspec.reference import fpa as ref

CHECKS = [
    # (B, T, N, K, D, block, dtype, cu_seqlens)
    (2, 300, 4, 2, 64, 64, "float32", None),
    (1, 257, 2, 2, 128, 64, "bfloat16", None),
    (1, 300, 2, 1, 64, 64, "float32", (0, 1, 100, 300)),
]
DRY_CHECKS = [(1, 40, 2, 1, 16, 16, "float32", None), (1, 40, 2, 2, 16, 16, "float32", (0, 9, 40))]
# The Mosaic GPU kernels take 16-bit inputs and tiles of 64 positions.
MOSAIC_CHECKS = [
    (1, 257, 2, 2, 128, 64, "bfloat16", None),
    (2, 300, 4, 2, 64, 64, "float16", (0, 1, 100, 300)),
]
# One op in the dry run: Mosaic GPU's interpreter takes about 30 CPU-seconds for a gradient.
DRY_MOSAIC_CHECKS = [(1, 70, 2, 1, 16, 64, "bfloat16", None)]
DRY_MOSAIC_KINDS = ("fox",)


def paths() -> list[str]:
    """The GPU paths of the JAX backend on the installed JAX."""
    return (["pallas"] if fpa_pallas.triton_lowering_available() else []) + ["mosaic"]


def canonical(x):
    return np.swapaxes(np.asarray(x, dtype=np.float64), 1, 2)


def check(kind: str, impl: str, B, T, N, K, D, block, dtype, cu, interpret) -> tuple[bool, str]:
    """One forward+backward of a path against the reference, segment by segment."""
    rng = np.random.default_rng(T + N + D)
    q = rng.standard_normal((B, T, N, D))
    k, v = rng.standard_normal((2, B, T, K, D))
    if kind == "fpa":
        field = np.cumsum(rng.standard_normal((B, T, N)), axis=1)
        scalars = [field, field + rng.standard_normal((B, T, N))]
    else:
        scalars = [-rng.exponential(0.3, (B, T, N))]
    do = rng.standard_normal((B, T, N, D))
    wide = "float32"
    x = [jnp.asarray(a, dtype) for a in (q, k, v)] + [jnp.asarray(s, wide) for s in scalars]
    fn = fpa_attention if kind == "fpa" else fox_attention

    def run(impl):
        out, pullback = jax.vjp(
            lambda *a: fn(
                *a, implementation=impl, block_size=block, cu_seqlens=cu, interpret=interpret
            ),
            *x,
        )
        return out, pullback(jnp.asarray(do, dtype))

    (o, grads), (o_xla, grads_xla) = run(impl), run("xla")
    seen = [np.asarray(a, np.float64) for a in x]  # the inputs as rounded on the device
    parts = [(0, T)] if cu is None else list(itertools.pairwise(cu))
    worst, G = 0.0, N // K
    for start, stop in parts:
        s = slice(start, stop)
        a = [
            canonical(arr[:, s]) if arr.ndim == 4 else np.swapaxes(arr[:, s], 1, 2) for arr in seen
        ]
        a[1], a[2] = np.repeat(a[1], G, axis=1), np.repeat(a[2], G, axis=1)
        cot = canonical(np.asarray(jnp.asarray(do, dtype), np.float64)[:, s])
        if kind == "fpa":
            expected_o = ref.fpa_attention(*a)
            g = ref.fpa_attention_vjp(*a, cot)
            expected = [g.dq, g.dk, g.dv, g.dfield, g.dlevel]
        else:
            expected_o = ref.fox_attention(*a)
            g = ref.fox_attention_vjp(*a, cot)
            expected = [g.dq, g.dk, g.dv, g.dlog_f]
        fold = lambda y: y.reshape(y.shape[0], K, G, *y.shape[2:]).sum(2)  # noqa: E731
        expected[1], expected[2] = fold(expected[1]), fold(expected[2])
        got = [o[:, s], *(gr[:, s] for gr in grads)]
        ratios = [
            rel(canonical(got[0]), expected_o) / tolerance(f"{kind}_attention", dtype, "output")
        ]
        for gr, want in zip(got[1:], expected, strict=True):
            gr = np.asarray(gr, np.float64)
            gr = canonical(gr) if gr.ndim == 4 else np.swapaxes(gr, 1, 2)
            ratios.append(rel(gr, want) / tolerance(f"{kind}_attention", dtype, "gradient"))
        worst = max(worst, *ratios)
    twin = max(
        rel(a, np.asarray(b, np.float64))
        for a, b in zip([o, *grads], [o_xla, *grads_xla], strict=True)
    )
    ok = worst <= 1.0
    shape = f"B={B} T={T} N={N} K={K} D={D} block={block} {dtype}" + (f" cu={cu}" if cu else "")
    return (
        ok,
        f"{kind:<3} {impl:<6} {shape:<58} worst error/tolerance {worst:.2f}, "
        f"vs XLA path {twin:.1e}" + ("" if ok else "  FAILED"),
    )


def timed(fn, args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` after a warm-up (compiling) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def implementations(field, level, log_f, interpret: bool, dry: bool) -> dict:
    """The timed functions of (q, k, v): each path, the XLA loop, and attention without decay
    (cuDNN's on the GPU). The dry run leaves out the Mosaic GPU interpreter (seconds a call)."""
    common = {"interpret": interpret, "validate": False}
    timed_paths = [p for p in paths() if not (dry and p == "mosaic")] + ["xla"]
    fns = {}
    for kind in ("fpa", "fox"):
        for impl in timed_paths:
            if kind == "fpa":
                fns[f"fpa {impl}"] = functools.partial(
                    _fpa, field=field, level=level, implementation=impl, **common
                )
            else:
                fns[f"fox {impl}"] = functools.partial(
                    _fox, log_f=log_f, implementation=impl, **common
                )
    cudnn = None if dry else "cudnn"
    fns["dot_product_attention"] = functools.partial(
        jax.nn.dot_product_attention, is_causal=True, implementation=cudnn
    )
    return fns


def _fpa(q, k, v, *, field, level, **kwargs):
    return fpa_attention(q, k, v, field, level, **kwargs)


def _fox(q, k, v, *, log_f, **kwargs):
    return fox_attention(q, k, v, log_f, **kwargs)


def forward_and_backward(fn, do):
    """Jitted forward, and forward+backward through a fixed cotangent."""

    def loss(q, k, v):
        return jnp.vdot(fn(q, k, v).astype(jnp.float32), do.astype(jnp.float32))

    return jax.jit(fn), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def timings(dry: bool, interpret: bool, results: dict) -> None:
    """Appends one row per (shape, implementation) to results["timings"], saving as it goes."""
    if dry:
        grid, tokens, width, repeats = [(16, 64)], 64, 32, 1
    else:
        grid = [(128, T) for T in (8192, 32768)]
        tokens, width, repeats = 32768, 2048, 5
    for D, T in grid:
        B, H = max(1, tokens // T), max(1, width // D)
        rng = np.random.default_rng(0)
        shape = (B, T, H, D)
        q, k, v, do = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(4))
        field = jnp.asarray(np.cumsum(rng.standard_normal((B, T, H)), axis=1), jnp.float32)
        level, log_f = field + 0.5, -jnp.abs(field) / T
        flops = 4 * B * H * T * T * D / 2
        for name, fn in implementations(field, level, log_f, interpret, dry).items():
            row = {"impl": name, "B": B, "H": H, "T": T, "D": D}
            try:
                forward, both = forward_and_backward(fn, do)
                t_fwd, t_both = (timed(f, (q, k, v), repeats) for f in (forward, both))
            except Exception as exc:  # recorded, and the next row still runs
                row["error"] = f"{type(exc).__name__}: {exc}"[:400]
                print(f"{name:<22} B={B:<3} H={H:<3} T={T:<6} D={D:<4} {row['error']}", flush=True)
            else:
                row |= {"fwd_ms": t_fwd * 1e3, "fwd_bwd_ms": t_both * 1e3}
                row |= {
                    "fwd_tflops": flops / t_fwd / 1e12,
                    "fwd_bwd_tflops": 3.5 * flops / t_both / 1e12,
                }
                print(
                    f"{name:<22} B={B:<3} H={H:<3} T={T:<6} D={D:<4} "
                    f"fwd {row['fwd_ms']:9.2f} ms ({row['fwd_tflops']:6.1f} TFLOP/s)   "
                    f"fwd+bwd {row['fwd_bwd_ms']:9.2f} ms ({row['fwd_bwd_tflops']:6.1f} TFLOP/s)",
                    flush=True,
                )
            results["timings"].append(row)
            save(results)


def save(results: dict) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "pallas.json"), "w") as fh:
            json.dump(results, fh, indent=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="The JAX backend's GPU paths (Pallas, Mosaic GPU) for FPA and FoX: check, "
        "then time."
    )
    p.add_argument("--dry-run", action="store_true", help="CPU: interpreters, tiny shapes")
    args = p.parse_args(argv)
    import jaxlib

    results: dict = {"checks": [], "timings": [], "paths": paths()}
    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"pallas section: skipped, jax sees no GPU ({jax.devices()})", flush=True)
        results["skipped"] = "no GPU"
        save(results)
        return 0
    interpret = args.dry_run
    mode = "interpreters" if interpret else "compiled"
    print(
        f"pallas section: jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
        f"devices {jax.devices()}, paths {paths()}, {mode}",
        flush=True,
    )
    ok = True
    cases = {
        "pallas": DRY_CHECKS if args.dry_run else CHECKS,
        "mosaic": DRY_MOSAIC_CHECKS if args.dry_run else MOSAIC_CHECKS,
    }
    with jax.enable_x64(True):  # float64 reference inputs; the kernels run in the tested dtype
        for impl in paths():
            dry_mosaic = args.dry_run and impl == "mosaic"
            for kind in DRY_MOSAIC_KINDS if dry_mosaic else ("fpa", "fox"):
                for case in cases[impl]:
                    try:
                        passed, line = check(kind, impl, *case, interpret=interpret)
                    except Exception as exc:  # a kernel that fails to lower is a failed check
                        passed = False
                        line = f"{kind} {impl} {case}: {type(exc).__name__}: {exc}"[:400]
                    ok &= passed
                    results["checks"].append({"passed": passed, "line": line})
                    print(line, flush=True)
                    save(results)
    if ok:
        timings(args.dry_run, interpret, results)
    else:
        print("pallas: correctness failed, timings skipped", flush=True)
    save(results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
