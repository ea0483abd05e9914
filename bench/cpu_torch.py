"""CPU benchmark of the torch backend's eager kernels against the reference and FoX's peers.

Prints one table measured in one process: forward and forward+backward times of FPA, FoX, LegS
and S4D at T = 512, 2048, 8192 for torch eager (float32) and the NumPy reference (float64, where
its O(T^2) or O(T M C) intermediates fit in memory), with the ratio of each row to torch eager
(> 1: torch is faster); for FPA and FoX also torch SDPA with a plain causal mask (no decay: the
floor of softmax attention here), and for FoX flash-linear-attention's naive torch form and
torch SDPA with the FoX decay as a float mask. Then the peak memory of FPA forward+backward at
T = 32768 (B = H = 1, K = V = 64), measured as the high-water RSS of a child process.

``--threads-table`` prints instead the table of a CPU user's first step: the aten calls of one
FoX and one FPA forward+backward at small T (counted by a TorchDispatchMode) and their times with
torch's default threads and with 1 thread, the two settings interleaved run by run so that the
machine's load falls on both alike.

Each time is the median of repeated runs after one warm-up run (which also builds the LegS step
products, cached per (T, M); their one-time build is reported separately).

    python bench/cpu_torch.py [--lengths 512 2048 8192] [--skip-peak-memory]
    python bench/cpu_torch.py --threads-table [--lengths 128 512]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
import scipy
import torch

from attnspec.backends.tile_sizes import EAGER_CHUNK
from attnspec.backends.torch import (
    eager_interdomain,
    fox_attention,
    fpa_attention,
    interdomain_legs,
    interdomain_s4d,
)
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

# Inputs and the timed functions of each implementation


def attention_inputs(T: int, gen: torch.Generator):
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    field = torch.cumsum(torch.randn(B, T, H, generator=gen), dim=1)
    level = field + torch.randn(B, T, H, generator=gen)
    log_f = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    return q, k, v, field, level, log_f


def torch_pair(fn, inputs, cotangent):
    """(forward, forward+backward) closures for a torch function of ``inputs``."""
    leaves = [x.clone().requires_grad_() for x in inputs]

    def forward():
        with torch.no_grad():
            fn(*inputs)

    def forward_backward():
        torch.autograd.backward(fn(*leaves), cotangent)
        for x in leaves:
            x.grad = None

    return forward, forward_backward


def ref_layout(x: torch.Tensor) -> np.ndarray:
    """[B, T, H, ...] float32 -> (B, H, T, ...) float64 for the reference."""
    return np.ascontiguousarray(np.swapaxes(x.double().numpy(), 1, 2))


def causal_sdpa(q, k, v):
    """Softmax attention with a causal mask and no decay: torch SDPA's own causal path."""
    o = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), is_causal=True
    )
    return o.transpose(1, 2)


def fox_sdpa(q, k, v, log_f):
    """FoX with torch SDPA: the decay c_i - c_j as a float mask, -inf above the diagonal."""
    c = torch.cumsum(log_f, dim=1).transpose(1, 2)  # [B, H, T]
    T = c.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    bias = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf"))
    o = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=bias
    )
    return o.transpose(1, 2)


def attention_rows(op: str, T: int, gen: torch.Generator, peers: bool):
    q, k, v, field, level, log_f = attention_inputs(T, gen)
    do = torch.randn(B, T, H, D, generator=gen)
    rows = []
    if op == "FPA":
        rows.append(("torch eager", *torch_pair(fpa_attention, (q, k, v, field, level), do)))
        if peers:
            rows.append(("SDPA causal (no decay)", *torch_pair(causal_sdpa, (q, k, v), do)))
        args = [ref_layout(x) for x in (q, k, v, field, level)]
        ref_fwd = lambda: fpa.fpa_attention(*args)  # noqa: E731
        ref_bwd = lambda: fpa.fpa_attention_vjp(*args, ref_layout(do))  # noqa: E731
    else:
        rows.append(("torch eager", *torch_pair(fox_attention, (q, k, v, log_f), do)))
        args = [ref_layout(x) for x in (q, k, v, log_f)]
        ref_fwd = lambda: fpa.fox_attention(*args)  # noqa: E731
        ref_bwd = lambda: fpa.fox_attention_vjp(*args, ref_layout(do))  # noqa: E731
        if peers:
            from fla.ops.forgetting_attn.naive import naive_forgetting_attn

            rows.append(("fla naive FoX", *torch_pair(naive_forgetting_attn, (q, k, v, log_f), do)))
            rows.append(("torch SDPA + FoX mask", *torch_pair(fox_sdpa, (q, k, v, log_f), do)))
            rows.append(("SDPA causal (no decay)", *torch_pair(causal_sdpa, (q, k, v), do)))
    if reference_bytes(op, T) <= REFERENCE_BUDGET:
        rows.append(("reference (NumPy f64)", ref_fwd, lambda: (ref_fwd(), ref_bwd())))
    return rows


def s4d_inputs(T: int, gen: torch.Generator):
    a_log, a_im = (torch.from_numpy(x) for x in hippo.s4d_init(M))
    dt = torch.exp(torch.empty(H, 1).uniform_(np.log(1e-3), np.log(1e-1), generator=gen))
    a = torch.complex(-torch.exp(a_log), a_im)  # S4D-Inv (I11)
    lam = torch.exp(dt.double() * a).to(torch.complex64)
    b = torch.ones(H, M, dtype=torch.complex64)
    c = torch.randn(H, M, M, dtype=torch.complex64, generator=gen) / np.sqrt(M)
    fq, kt, vt = (torch.randn(B, T, H, D, generator=gen) for _ in range(3))
    return fq, kt, vt, lam, b, c


def interdomain_rows(op: str, T: int, gen: torch.Generator):
    fq, kt, vt, lam, b, c = s4d_inputs(T, gen)
    do = torch.randn(B, T, H, D, generator=gen)
    rows = []
    if op == "S4D":
        rows.append(("torch eager", *torch_pair(interdomain_s4d, (fq, kt, vt, lam, b, c), do)))
        args = [ref_layout(x) for x in (fq, kt, vt)] + [
            x.to(torch.complex128).numpy() for x in (lam, b, c)
        ]
        ref_fwd = lambda: idm.interdomain_s4d(*args)  # noqa: E731
        ref_bwd = lambda: idm.interdomain_s4d_vjp(*args, ref_layout(do))  # noqa: E731
    else:
        fq, fk = torch.sigmoid(fq), torch.sigmoid(kt)  # positive features: denominators > 0
        legs = lambda a, b_, c_: interdomain_legs(a, b_, c_, M)  # noqa: E731
        rows.append(("torch eager", *torch_pair(legs, (fq, fk, vt), do)))
        args = [ref_layout(x) for x in (fq, fk, vt)]
        ref_fwd = lambda: idm.interdomain_legs(*args, M)  # noqa: E731
        ref_bwd = lambda: idm.interdomain_legs_vjp(*args, M, ref_layout(do))  # noqa: E731
    if reference_bytes(op, T) <= REFERENCE_BUDGET:
        rows.append(("reference (NumPy f64)", ref_fwd, lambda: (ref_fwd(), ref_bwd())))
    return rows


def aten_calls(fn) -> int:
    """The aten calls of one run of ``fn`` (forward+backward), after a warm-up run: every
    ``aten::`` event of torch.profiler, nested ones included (the ops inside attnspec's custom
    ops and inside composite aten ops: each pays the dispatcher and, when it parallelises, a
    wake-up of torch's threads)."""
    fn()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("aten::") for e in prof.events())


def interleaved_times(fn, threads: list[int], runs: int = 7) -> list[float]:
    """Median wall time of ``fn`` at each thread count, the counts alternating run by run."""
    times: list[list[float]] = [[] for _ in threads]
    default = torch.get_num_threads()
    try:
        for n in threads:  # one warm-up each
            torch.set_num_threads(n)
            fn()
        for _ in range(runs):
            for slot, n in enumerate(threads):
                torch.set_num_threads(n)
                start = time.perf_counter()
                fn()
                times[slot].append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(default)
    return [sorted(t)[len(t) // 2] for t in times]


def threads_table(lengths: list[int]) -> None:
    """The aten calls and fwd+bwd times (default threads, 1 thread) of FoX and FPA, with fla's
    naive FoX as the peer where it is installed."""
    gen = torch.Generator().manual_seed(0)
    default = torch.get_num_threads()
    row = "| {:<4} | {:>5} | {:<14} | {:>10} | {:>16} | {:>13} |"
    print(
        row.format(
            "op", "T", "implementation", "aten calls", f"ms, {default} threads", "ms, 1 thread"
        )
    )
    print(row.format(*(("-" * w) for w in (4, 5, 14, 10, 16, 13))).replace(" ", "-"))
    for T in lengths:
        q, k, v, field, level, log_f = attention_inputs(T, gen)
        do = torch.randn(B, T, H, D, generator=gen)
        runs = [
            ("FoX", "torch eager", fox_attention, (q, k, v, log_f)),
            ("FPA", "torch eager", fpa_attention, (q, k, v, field, level)),
        ]
        try:
            from fla.ops.forgetting_attn.naive import naive_forgetting_attn

            runs.insert(1, ("FoX", "fla naive FoX", naive_forgetting_attn, (q, k, v, log_f)))
        except ImportError:
            pass
        for op, name, fn, inputs in runs:
            _, forward_backward = torch_pair(fn, inputs, do)
            calls = aten_calls(forward_backward)
            many, one = interleaved_times(forward_backward, [default, 1])
            print(row.format(op, T, name, calls, f"{1e3 * many:.1f}", f"{1e3 * one:.1f}"))


# Peak memory of FPA forward+backward at T = 32768, in a child process


def peak_memory_child(T: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 1, 64, generator=gen).requires_grad_() for _ in range(3))
    field = torch.cumsum(torch.randn(1, T, 1, generator=gen), dim=1).requires_grad_()
    level = (field.detach() + torch.randn(1, T, 1, generator=gen)).requires_grad_()
    do = torch.randn(1, T, 1, 64, generator=gen)
    before = peak_rss()
    start = time.perf_counter()
    fpa_attention(q, k, v, field, level).backward(do)
    seconds = time.perf_counter() - start
    print(json.dumps({"before": before, "peak": peak_rss(), "seconds": seconds}))


def header() -> str:
    try:
        import fla

        fla_version = fla.__version__
    except ImportError:
        fla_version = "not installed"
    cpu = platform.processor() or "?"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = f"{names[0]} x {len(names)}" if names else cpu
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return "\n".join(
        [
            f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"machine: {cpu}; torch threads: {torch.get_num_threads()}; OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', '-')}, OPENBLAS_NUM_THREADS="
            f"{os.environ.get('OPENBLAS_NUM_THREADS', '-')}; load average: {load}",
            f"versions: python {platform.python_version()}, torch {torch.__version__}, numpy "
            f"{np.__version__}, scipy {scipy.__version__}, fla-core {fla_version}",
            f"shapes: B = {B}, H = {H}, K = V = R = {D}, M = {M}; torch float32, reference float64",
        ]
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192])
    p.add_argument("--ops", nargs="*", default=["FPA", "FoX", "LegS", "S4D"])
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--skip-peak-memory", action="store_true")
    p.add_argument("--threads-table", action="store_true", help="aten calls, default vs 1 thread")
    p.add_argument("--peak-memory-child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peak_memory_child:
        peak_memory_child(args.peak_memory_child)
        return 0

    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    if args.threads_table:
        threads_table(args.lengths if args.lengths != [512, 2048, 8192] else [128, 512])
        return 0
    gen = torch.Generator().manual_seed(0)
    build = {}
    lines = []
    results = {}
    for op in args.ops:
        for T in args.lengths:
            if op == "LegS":  # the step products are built once per (T, M): time that apart
                start = time.perf_counter()
                for index in range(-(-T // EAGER_CHUNK["legs"])):
                    eager_interdomain.legs_constants(
                        M, EAGER_CHUNK["legs"], index, torch.float32, "cpu"
                    )
                build[T] = time.perf_counter() - start
            if op in ("FPA", "FoX"):
                rows = attention_rows(op, T, gen, peers=True)
            else:
                rows = interdomain_rows(op, T, gen)
            for name, forward, forward_backward in rows:
                print(f"  timing {op} T={T} {name} ...", file=sys.stderr, flush=True)
                fwd = median_time(forward, min_runs=3 if "reference" not in name else 2)
                both = median_time(forward_backward, min_runs=3 if "reference" not in name else 2)
                results[op, T, name] = (fwd, both)
            base = results[op, T, "torch eager"]
            for name, *_ in rows:
                fwd, both = results[op, T, name]
                cells = (op, T, name, f"{1e3 * fwd:.1f}", f"{1e3 * both:.1f}")
                lines.append(ROW.format(*cells, f"{fwd / base[0]:.2f}", f"{both / base[1]:.2f}"))
    print()
    print(
        ROW.format(
            "op", "T", "implementation", "fwd ms", "fwd+bwd ms", "fwd / torch", "fwd+bwd / torch"
        )
    )
    print(ROW.format(*(("-" * w) for w in (4, 5, 22, 10, 12, 11, 15))).replace(" ", "-"))
    print("\n".join(lines))
    if build:
        built = ", ".join(f"T = {T}: {s:.1f} s" for T, s in build.items())
        print(f"\nLegS step products (one-time, cached per (T, M)): {built}")

    print("\ngoals at T = 2048 (forward+backward):")
    for op in args.ops:
        key = (op, 2048, "reference (NumPy f64)")
        if key in results:
            speedup = results[key][1] / results[op, 2048, "torch eager"][1]
            print(
                f"  {op}: torch eager {speedup:.1f}x faster than the reference (goal >= 5x): "
                f"{'met' if speedup >= 5 else 'missed'}"
            )
    key = ("FoX", 2048, "fla naive FoX")
    if key in results:
        ratio = results[key][1] / results["FoX", 2048, "torch eager"][1]
        print(
            f"  FoX: fla naive / torch eager = {ratio:.2f} (goal >= 1, no slower than the peer): "
            f"{'met' if ratio >= 1 else 'missed'}"
        )

    if not args.skip_peak_memory:
        print("\n  measuring peak memory at T = 32768 ...", file=sys.stderr, flush=True)
        mem = peak_memory(__file__, 32768)
        gib = 2**30
        print(
            f"\nFPA forward+backward, T = 32768, B = H = 1, K = V = 64, float32: peak RSS "
            f"{mem['peak'] / gib:.2f} GiB (process before the op: {mem['before'] / gib:.2f} GiB, "
            f"{mem['seconds']:.1f} s); goal < 2 GiB: "
            f"{'met' if mem['peak'] < 2 * gib else 'missed'}. A dense (T, T) float32 array alone "
            f"is {32768**2 * 4 / gib:.0f} GiB."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
