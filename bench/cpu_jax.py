"""CPU benchmark of the JAX backend (jit, float32) against the reference and the torch backend.

Prints one table measured in one process: forward and forward+backward times of FPA, FoX, LegS
and S4D at T = 512, 2048, 8192 for JAX under ``jax.jit`` (float32, the XLA implementation), the
NumPy reference (float64, where its O(T^2) or O(T M C) intermediates fit in memory) and the
torch backend's eager ops (float32) when that backend is installed; each row's ratio is the
row's time over JAX's (> 1: JAX is faster). Then the peak memory of FPA forward+backward at
T = 32768 (B = H = 1, D = 64) as the high-water RSS (VmHWM) of a child process, beside XLA's own
count of the compiled program's scratch memory.

Each time is the median of repeated runs after a warm-up run (which compiles, and builds the
LegS step products, cached per (T, M)); compilation is reported apart.

    python bench/cpu_jax.py [--lengths 512 2048 8192] [--skip-peak-memory]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from attnspec.backends.jax import fox_attention, fpa_attention, interdomain_legs, interdomain_s4d
from attnspec.reference import fpa, hippo
from attnspec.reference import interdomain as idm

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cpu_common import (
    REFERENCE_BUDGET,
    ROW,
    B,
    D,
    H,
    M,
    median_time,
    peak_memory,
    peak_rss,
    reference_bytes,
)

# Inputs in the JAX layout [B, T, H, D] and the timed functions


def inputs(op: str, T: int, rng: np.random.Generator) -> dict:
    x = {name: rng.standard_normal((B, T, H, D)).astype(np.float32) for name in ("q", "k", "v")}
    if op == "FPA":
        x["field"] = np.cumsum(rng.standard_normal((B, T, H)), axis=1).astype(np.float32)
        x["level"] = (x["field"] + rng.standard_normal((B, T, H))).astype(np.float32)
    elif op == "FoX":
        x["log_f"] = -np.log1p(np.exp(-(rng.standard_normal((B, T, H)) + 3.0)))
        x["log_f"] = x["log_f"].astype(np.float32)  # logsigmoid(N(3, 1))
    elif op == "LegS":
        x["q"], x["k"] = 1 / (1 + np.exp(-x["q"])), 1 / (1 + np.exp(-x["k"]))  # positive
    else:
        a_log, a_im = hippo.s4d_init(M)
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), (H, 1)))
        x["lam"] = np.exp(dt * (-np.exp(a_log) + 1j * a_im)).astype(np.complex64)
        x["b"] = np.ones((H, M), np.complex64)
        c = rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))
        x["c"] = (c / np.sqrt(2 * M)).astype(np.complex64)
    x["do"] = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return x


def jax_op(op: str):
    if op == "FPA":
        return lambda x: fpa_attention(x["q"], x["k"], x["v"], x["field"], x["level"])
    if op == "FoX":
        return lambda x: fox_attention(x["q"], x["k"], x["v"], x["log_f"])
    if op == "LegS":
        return lambda x: interdomain_legs(x["q"], x["k"], x["v"], M)
    return lambda x: interdomain_s4d(
        x["q"], x["k"], x["v"], x["lam"], x["b"], x["c"], validate=False
    )


def jax_pair(op: str, x: dict):
    """(forward, forward+backward, compile seconds) for the jitted JAX op."""
    arrays = {k: jnp.asarray(v) for k, v in x.items()}
    fn = jax_op(op)
    forward = jax.jit(fn)
    differentiable = [k for k in arrays if k not in ("do", "lam", "b", "c")]

    def loss(diff, rest):
        return jnp.vdot(fn({**rest, **diff}), rest["do"])

    backward = jax.jit(jax.grad(loss))
    diff = {k: arrays[k] for k in differentiable}
    rest = {k: v for k, v in arrays.items() if k not in diff}
    start = time.perf_counter()
    jax.block_until_ready(forward(arrays))
    jax.block_until_ready(backward(diff, rest))
    compile_seconds = time.perf_counter() - start
    return (
        lambda: jax.block_until_ready(forward(arrays)),
        lambda: jax.block_until_ready(backward(diff, rest)),
        compile_seconds,
    )


def to_reference(x: np.ndarray) -> np.ndarray:
    """[B, T, H, ...] -> (B, H, T, ...) float64."""
    return np.ascontiguousarray(np.swapaxes(x, 1, 2)).astype(np.float64)


def reference_pair(op: str, x: dict):
    r = {k: to_reference(v) for k, v in x.items() if k not in ("lam", "b", "c")}
    if op == "FPA":
        args = (r["q"], r["k"], r["v"], r["field"], r["level"])
        return (
            lambda: fpa.fpa_attention(*args),
            lambda: (fpa.fpa_attention(*args), fpa.fpa_attention_vjp(*args, r["do"])),
        )
    if op == "FoX":
        args = (r["q"], r["k"], r["v"], r["log_f"])
        return (
            lambda: fpa.fox_attention(*args),
            lambda: (fpa.fox_attention(*args), fpa.fox_attention_vjp(*args, r["do"])),
        )
    if op == "LegS":
        args = (r["q"], r["k"], r["v"], M)
        return (
            lambda: idm.interdomain_legs(*args),
            lambda: (idm.interdomain_legs(*args), idm.interdomain_legs_vjp(*args, r["do"])),
        )
    args = (r["q"], r["k"], r["v"], *(x[k].astype(np.complex128) for k in ("lam", "b", "c")))
    return (
        lambda: idm.interdomain_s4d(*args),
        lambda: (idm.interdomain_s4d(*args), idm.interdomain_s4d_vjp(*args, r["do"])),
    )


def torch_pair(op: str, x: dict):
    """The torch backend's eager op (float32, [B, T, H, D]) when it is installed, else None."""
    if importlib.util.find_spec("attnspec.backends.torch.ops") is None:
        return None
    import torch

    from attnspec.backends import torch as backend

    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    names = {
        "FPA": ("q", "k", "v", "field", "level"),
        "FoX": ("q", "k", "v", "log_f"),
        "LegS": ("q", "k", "v"),
        "S4D": ("q", "k", "v", "lam", "b", "c"),
    }[op]
    fn = {
        "FPA": backend.fpa_attention,
        "FoX": backend.fox_attention,
        "LegS": lambda a, b, c: backend.interdomain_legs(a, b, c, M),
        "S4D": backend.interdomain_s4d,
    }[op]
    args = [t[n] for n in names]
    leaves = [a.clone().requires_grad_(not a.is_complex()) for a in args]

    def forward():
        with torch.no_grad():
            fn(*args)

    def forward_backward():
        torch.autograd.backward(fn(*leaves), t["do"])
        for a in leaves:
            a.grad = None

    return forward, forward_backward


# Peak memory of FPA forward+backward at T = 32768, in a child process


def peak_memory_child(T: int) -> None:
    rng = np.random.default_rng(0)
    q, k, v, do = (jnp.asarray(rng.standard_normal((1, T, 1, 64)), jnp.float32) for _ in range(4))
    field = jnp.asarray(np.cumsum(rng.standard_normal((1, T, 1)), axis=1), jnp.float32)
    level = field + jnp.asarray(rng.standard_normal((1, T, 1)), jnp.float32)

    def loss(q, k, v, field, level):
        return jnp.vdot(fpa_attention(q, k, v, field, level, validate=False), do)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    compiled = step.lower(q, k, v, field, level).compile()
    scratch = compiled.memory_analysis().temp_size_in_bytes
    before = peak_rss()
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, field, level))
    seconds = time.perf_counter() - start
    peak = peak_rss()
    print(json.dumps({"before": before, "peak": peak, "scratch": scratch, "seconds": seconds}))


def header() -> list[str]:
    import jaxlib

    versions = f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, numpy {np.__version__}"
    if importlib.util.find_spec("torch") is not None:
        import torch

        versions += f", torch {torch.__version__} ({torch.get_num_threads()} threads)"
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    now = datetime.datetime.now().isoformat(timespec="minutes")
    return [
        f"CPU benchmark of the JAX backend, {now}",
        f"machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        f"versions: {versions}",
        f"load average before the run (1, 5, 15 min): {load}",
        f"shapes: B = {B}, H = {H}, D = K = V = R = {D}, M = {M} (LegS, S4D); JAX float32 "
        "under jax.jit (XLA), reference float64, torch eager float32",
        "ratio: the row's time over JAX's (> 1: JAX is faster)",
        "",
        ROW.format("op", "T", "implementation", "forward", "fwd+bwd", "fwd ratio", "fwd+bwd ratio"),
        ROW.format(*("-" * w for w in (4, 5, 22, 10, 12, 11, 15))),
    ]


def fmt(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--ops", nargs="+", default=["FPA", "FoX", "LegS", "S4D"])
    p.add_argument("--skip-peak-memory", action="store_true")
    p.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_memory_child:
        peak_memory_child(args.peak_memory_child)
        return 0
    for line in header():
        print(line, flush=True)
    rng = np.random.default_rng(0)
    compile_notes = []
    for op in args.ops:
        for T in args.lengths:
            x = inputs(op, T, rng)
            fwd, fwd_bwd, compile_seconds = jax_pair(op, x)
            compile_notes.append(f"{op} T={T}: {compile_seconds:.1f} s")
            base = (median_time(fwd), median_time(fwd_bwd))
            print(ROW.format(op, T, "jax jit (XLA)", *map(fmt, base), "1.00", "1.00"), flush=True)
            peers = [("torch eager", torch_pair(op, x))]
            if reference_bytes(op, T) <= REFERENCE_BUDGET:
                peers.append(("reference (NumPy f64)", reference_pair(op, x)))
            else:
                peers.append(("reference (NumPy f64)", None))
            for name, pair in peers:
                if pair is None:
                    cells = ["-", "-", "-", "-"]
                else:
                    times = (median_time(pair[0], 1, 0), median_time(pair[1], 1, 0))
                    ratios = [f"{t / b:.2f}" for t, b in zip(times, base, strict=True)]
                    cells = [*map(fmt, times), *ratios]
                print(ROW.format(op, T, name, *cells), flush=True)
    print()
    print("compilation (forward and forward+backward, once per shape): " + "; ".join(compile_notes))
    if not args.skip_peak_memory:
        T = 32768
        m = peak_memory(__file__, T)
        print(
            f"FPA forward+backward, T = {T}, B = H = 1, D = 64, float32: peak RSS "
            f"{m['peak'] / 2**30:.2f} GiB (process before the step {m['before'] / 2**30:.2f} GiB), "
            f"XLA scratch {m['scratch'] / 2**20:.0f} MiB, {m['seconds']:.1f} s"
        )
    print(f"load average after the run: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
