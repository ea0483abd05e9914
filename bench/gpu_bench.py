"""GPU check, FPA section: the Triton FPA and FoX kernels (backends/torch/triton_fpa.py).

Steps, run by bench/gpu_check.sh as ``python -m bench.gpu_bench STEP [--dry-run]``:

- ``kit``: the conformance kit on the triton backend (every op and dtype it declares) in
  parallel processes, merged into one report. A fresh GPU machine has an empty Triton cache and
  compiled one after the other the kit's head-dim x dtype menu would take minutes, so cases that
  launch the same compiled kernels (same op and shapes) share a process, and the same queue
  compiles the kernels of the timings.
- ``timings`` (the first section of the check): every kernel variant it launches compiled in
  parallel processes (a compile that fails is a failure), a long-sequence check against the
  float64 reference (float32, T = 2048: many query tiles, key tiles and gap tiles; FPA with GQA
  and FoX, outputs and all gradients, the kit's tolerances), then bf16 timings with
  ``triton.testing.do_bench`` (warm-up 25 ms, the median of quantiles 0.5/0.2/0.8 over 100 ms;
  inputs prepared outside the timed region), forward and forward+backward, B*H = 16, D in
  {128, 64}, T in {2048, 8192, 16384}: our FPA, our FoX path, flash-linear-attention's
  ``parallel_forgetting_attn`` and torch SDPA (causal, no gate). TFLOP/s in the FlashAttention
  convention: forward 4 B H T^2 D x 0.5 (causal), backward 2.5x the forward. A measured bf16
  matmul peak. Each row is written to ``--out`` (JSON) as soon as it is measured; a failing
  (impl, mode, shape) is recorded and the run goes on; rows after a time budget of
  TIME_BUDGET_S seconds are recorded as skipped.
- ``summary``: the short table of the whole check, from the files in a results folder
  (``sections.txt``, ``kit.json``, ``fpa.json``); also written there as ``gpu_check.json`` and
  ``gpu_check.md``.

``--dry-run``: the same steps on CPU under the Triton interpreter at tiny shapes, one timing
repetition (wall clock), fla's naive torch FoX standing in for its GPU kernel.
Goals (issue 10), judged at D = 128, T >= 8192 only: FPA forward within 1.20x and
forward+backward within 1.25x of parallel_forgetting_attn; our FoX path within 1.05x of it; FPA
forward at least 30% of the measured bf16 matmul peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import textwrap
import time

GPU_SHAPES = {"B": 1, "H": 16, "Ts": (2048, 8192, 16384), "Ds": (128, 64)}  # goals' D first
GOAL_D, GOAL_MIN_T = 128, 8192  # goals are judged at D = 128, T >= 8192 only
TIME_BUDGET_S = 170.0  # the timing rows after this many seconds are recorded as skipped
DRY_SHAPES = {"B": 1, "H": 2, "Ts": (48,), "Ds": (16,)}
DRY_KIT = {  # the kit's subset in a dry run
    "ops": ["fpa_attention", "fox_attention"],
    "cases": ["fpa/shapes/1", "fpa/ragged/0", "fox/shapes/1"],
    "dtypes": ["float32"],
}
CHECK_T = {False: 2048, True: 40}  # the long check's length (GPU, dry run)
LONG_CHECK_HEADS = (2, 1, 64, 64)  # HQ, H (GQA), K, V
IMPLS = ("FPA", "FoX", "fla", "SDPA")
GOALS = {  # issue 10, ratios of times to fla's parallel_forgetting_attn
    ("FPA", "fwd"): 1.20,
    ("FPA", "fwd+bwd"): 1.25,
    ("FoX", "fwd"): 1.05,
    ("FoX", "fwd+bwd"): 1.05,
}
PEAK_FRACTION = 0.30  # FPA forward vs the measured bf16 matmul peak, D = 128, T >= 8192
# Candidate tiles (own, visit, warps), timed at one shape: the table in triton_fpa.py is
# flash-linear-attention's choice for its FoX kernel, not yet measured for FPA.
SWEEP = {
    "forward": ((128, 64, 8), (128, 64, 4), (64, 64, 4), (128, 32, 4)),
    "backward": ((128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4)),
}
SWEEP_SHAPE = {False: (128, 8192), True: (16, 48)}  # (D, T) on the GPU, in a dry run
DRY_SWEEP = ((32, 16, 4), (16, 16, 4))


def _torch(dry: bool):
    if dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    return torch


def _versions(torch) -> dict:
    import triton

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": str(torch.version.cuda),
    }
    try:
        import fla

        versions["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        versions["fla"] = "not installed"
    return versions


def _device_name(torch, dry: bool) -> str:
    return "CPU (Triton interpreter)" if dry else torch.cuda.get_device_name()


# kit


def timing_variants() -> list[tuple]:
    """(fox, dtype, HQ, H, K, V, tiles) of every launch of the long check, the timings and the
    tile sweep; tiles (forward, backward) as (own, visit, warps), None for the device table."""
    variants = [(fox, "float32", *LONG_CHECK_HEADS, None) for fox in (False, True)]
    H = GPU_SHAPES["H"]
    for D in GPU_SHAPES["Ds"]:
        variants += [(fox, "bfloat16", H, H, D, D, None) for fox in (False, True)]
    D = SWEEP_SHAPE[False][0]
    for forward in SWEEP["forward"]:
        backwards = SWEEP["backward"] if forward == SWEEP["forward"][0] else SWEEP["backward"][:1]
        variants += [(False, "bfloat16", H, H, D, D, (forward, b)) for b in backwards]
    return variants


def compile_variant(variant: tuple) -> None:
    """Run forward and backward (with and without an lse cotangent) of one variant once, which
    compiles its kernels into the Triton cache."""
    torch = _torch(dry=False)
    from attnspec.backends.torch import triton_fpa as tf

    fox, dtype, HQ, H, K, V, tiles = variant
    if tiles is not None:
        with tf.forced_tiles(*(tf.Tiles(*t) for t in tiles)):
            return compile_variant((*variant[:-1], None))
    dt = getattr(torch, dtype)
    own = tf.tiles_for(torch.device("cuda"), backward=True, K=K, V=V, dtype=dt).own
    T = 3 * own  # crosses the gap tiles
    q = torch.randn(1, T, HQ, K, device="cuda", dtype=dt)
    k = torch.randn(1, T, H, K, device="cuda", dtype=dt)
    v = torch.randn(1, T, H, V, device="cuda", dtype=dt)
    do = torch.randn(1, T, HQ, V, device="cuda", dtype=dt)
    log_f = -torch.rand(1, T, HQ, device="cuda")
    field = log_f.cumsum(1)
    for dlse in (None, torch.zeros_like(field)):
        if fox:
            o, lse = tf.fox_fwd(q, k, v, log_f, None, None)
            tf.fox_bwd(q, k, v, log_f, o, lse, do, dlse, None, None)
        else:
            o, lse = tf.fpa_fwd(q, k, v, field, field, None, None)
            tf.fpa_bwd(q, k, v, field, field, o, lse, do, dlse, None, None)
    torch.cuda.synchronize()


def kit_parts(cases, workers: int) -> list[list[str]]:
    """Case ids in at most ``workers`` parts. Cases with the same op and shapes launch the same
    compiled kernels, so each such group stays in one part (compiled once); the groups are
    dealt largest first (cost ~ cases x T^2) to the least loaded part."""
    groups: dict[tuple, list] = {}
    for case in cases:
        groups.setdefault((case.op, tuple(sorted(case.shapes().items()))), []).append(case)
    parts, loads = [[] for _ in range(workers)], [0.0] * workers

    def cost(group):
        return sum(1 + max((s[-2] for s in c.shapes().values() if len(s) > 1), default=1) ** 2
                   for c in group)  # fmt: skip

    for group in sorted(groups.values(), key=cost, reverse=True):
        lightest = loads.index(min(loads))
        parts[lightest] += [c.id for c in group]
        loads[lightest] += cost(group)
    return [p for p in parts if p]


def run_jobs(jobs: list[tuple[str, list[str]]], workers: int, folder: str) -> dict[str, int]:
    """Run (name, command) jobs, at most ``workers`` at a time, output to folder/name.log;
    return the exit status by name, printing one line per finished job."""
    import subprocess

    queue, running, status, start = list(jobs), {}, {}, time.perf_counter()
    while queue or running:
        while queue and len(running) < workers:
            name, command = queue.pop(0)
            log = open(os.path.join(folder, f"{name}.log"), "w")
            running[name] = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), log)
        time.sleep(0.2)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                status[name] = proc.returncode
                del running[name]
                took = time.perf_counter() - start
                print(f"  {name}: exit {proc.returncode} at {took:.0f} s", flush=True)
    return status


def kit(dry: bool, out: str, workers: int | None) -> int:
    """The conformance kit on the triton backend in parallel processes (all ops and dtypes it
    declares; a dry run: a small FPA/FoX subset in float32 on CPU), merged into one report."""
    import tempfile

    from attnspec.conformance.cases import generate_cases
    from attnspec.conformance.report import format_report, write_json
    from attnspec.conformance.runner import CaseResult, RunReport

    ops, prefixes = (DRY_KIT["ops"], DRY_KIT["cases"]) if dry else (None, None)
    cases = generate_cases(ops, prefixes)
    workers = workers or (2 if dry else max(1, min(16, os.cpu_count() or 1)))
    parts = kit_parts(cases, workers)
    folder = tempfile.mkdtemp(prefix="gpu_kit_")
    common = [sys.executable, "-m", "attnspec.conformance", "--backend", "triton"]
    common += ["--device", "cpu", "--dtypes", *DRY_KIT["dtypes"]] if dry else ["--device", "cuda"]
    jobs = [
        (f"kit-{n}", [*common, "--cases", *ids, "--json", os.path.join(folder, f"kit-{n}.json")])
        for n, ids in enumerate(parts)
    ]
    print(f"kit: {len(cases)} cases in {len(parts)} parts, {len(jobs)} jobs on {workers} processes")
    start = time.perf_counter()
    status = run_jobs(jobs, workers, folder)
    results, seen, first = [], set(), None
    for name, _ in jobs:
        path = os.path.join(folder, f"{name}.json")
        if status[name] not in (0, 1) or not os.path.exists(path):  # 1: some cases failed
            with open(os.path.join(folder, f"{name}.log")) as fh:
                print(f"{name} failed (exit {status[name]}):\n" + fh.read()[-3000:])
            continue
        with open(path) as fh:
            part = json.load(fh)
        first = first or part
        for row in part["cases"]:
            key = (row["case_id"], row["dtype"], row["kind"])  # prefixes may overlap
            if key not in seen:
                seen.add(key)
                results.append(CaseResult(**row))
    if first is None:
        return 2
    report = RunReport(
        first["backend"],
        first["device"],
        results,
        first["unmatched_skips"],
        first["versions"],
        time.perf_counter() - start,
        first.get("notes", []),
    )
    print(format_report(report))
    write_json(report, out)
    if any(code not in (0, 1) for code in status.values()):
        return 2
    return 0 if report.ok else 1


# long check


def long_check(torch, device: str, T: int) -> bool:
    """FPA (GQA 2/1) and FoX at length T in float32 against the float64 reference."""
    import numpy as np

    from attnspec.backends.torch import triton_fpa as tf
    from attnspec.conformance.metrics import compare
    from attnspec.conformance.tolerances import round_to, tolerance
    from attnspec.reference import fpa as ref

    rng = np.random.default_rng(0)
    HQ, H, D, _ = LONG_CHECK_HEADS
    x = {n: round_to(rng.standard_normal(s), "float32") for n, s in [
        ("q", (1, T, HQ, D)), ("k", (1, T, H, D)), ("v", (1, T, H, D)), ("do", (1, T, HQ, D))
    ]}  # fmt: skip
    walk = np.cumsum(rng.standard_normal((1, T, HQ)), axis=1)
    x |= {"field": walk, "level": walk + rng.standard_normal(walk.shape)}
    x["log_f"] = -rng.uniform(0.0, 1.0, (1, T, HQ))
    x = {n: round_to(a, "float32") for n, a in x.items()}
    t = {n: torch.tensor(a, dtype=torch.float32, device=device) for n, a in x.items()}
    heads = {n: np.moveaxis(a, 2, 1) for n, a in x.items()}  # [B, H, T, ...]
    kk, vv = (np.repeat(heads[n], HQ // H, axis=1) for n in ("k", "v"))
    ok = True
    for op in ("fpa_attention", "fox_attention"):
        start = time.perf_counter()
        if op == "fpa_attention":
            args = (t["q"], t["k"], t["v"], t["field"], t["level"])
            o, lse = tf.fpa_fwd(*args, None, None)
            grads = tf.fpa_bwd(*args, o, lse, t["do"], None, None, None)
            got = dict(zip(("dq", "dk", "dv", "dfield", "dlevel"), grads, strict=True))
            rargs = (heads["q"], kk, vv, heads["field"], heads["level"])
            want_o, want_lse = ref.fpa_attention(*rargs, return_lse=True)
            g = ref.fpa_attention_vjp(*rargs, heads["do"])
            want = {"dfield": g.dfield, "dlevel": g.dlevel}
        else:
            args = (t["q"], t["k"], t["v"], t["log_f"])
            o, lse = tf.fox_fwd(*args, None, None)
            grads = tf.fox_bwd(*args, o, lse, t["do"], None, None, None)
            got = dict(zip(("dq", "dk", "dv", "dlog_f"), grads, strict=True))
            want_o, want_lse = ref.fox_attention(
                heads["q"], kk, vv, heads["log_f"], return_lse=True
            )
            g = ref.fox_attention_vjp(heads["q"], kk, vv, heads["log_f"], heads["do"])
            want = {"dlog_f": g.dlog_f}
        want |= {"o": want_o, "lse": want_lse, "dq": g.dq}
        want |= {n: getattr(g, n).reshape(1, H, HQ // H, T, D).sum(2) for n in ("dk", "dv")}
        got |= {"o": o, "lse": lse}
        errors, passed = {}, True
        for name, value in want.items():
            quantity = {"o": "output", "lse": "lse"}.get(name, "gradient")
            mine = np.moveaxis(got[name].double().cpu().numpy(), 2, 1)
            c = compare(mine, value, tolerance(op, "float32", quantity))
            errors[name], passed = c.rel, passed and c.passed
        ok &= passed
        errs = ", ".join(f"{n} {e:.1e}" for n, e in errors.items())
        verdict = "pass" if passed else "FAIL"
        took = time.perf_counter() - start
        print(f"  check {op} float32 T={T} HQ={HQ} H={H} D={D}: {verdict} ({errs}) {took:.0f} s")
    return ok


# timings


def _timer(torch, dry: bool):
    """fn -> milliseconds: one wall-clock call in a dry run, else do_bench's median."""
    if dry:

        def once(fn, grad_to_none=None):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3

        return once
    from triton.testing import do_bench

    def bench(fn, grad_to_none=None):
        return do_bench(
            fn, warmup=25, rep=100, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8]
        )[0]

    return bench


def matmul_peak(torch, bench, dry: bool) -> float:
    """Measured bf16 matmul TFLOP/s (N^3 with N = 8192; 256 in a dry run)."""
    n = 256 if dry else 8192
    dtype = torch.float32 if dry else torch.bfloat16
    device = "cpu" if dry else "cuda"
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (bench(lambda: a @ b) * 1e-3) / 1e12


def _fla_peer(dry: bool):
    """(name, fn(q, k, v, g) -> o) or (reason, None) when flash-linear-attention is absent."""
    try:
        if dry:
            from fla.ops.forgetting_attn.naive import naive_forgetting_attn

            return "naive_forgetting_attn (dry-run stand-in)", naive_forgetting_attn
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        return "parallel_forgetting_attn", parallel_forgetting_attn
    except ImportError as exc:
        return f"not installed ({exc})", None


def flops(B: int, H: int, T: int, D: int, mode: str) -> float:
    """FlashAttention convention: causal forward 4 B H T^2 D / 2; backward 2.5x the forward."""
    forward = 4 * B * H * T * T * D * 0.5
    return forward * (3.5 if mode == "fwd+bwd" else 1.0)


def shape_calls(torch, tf, peer, B, H, T, D, dtype, device) -> dict:
    """{(impl, mode): (fn, grad_to_none)} for one shape, inputs prepared outside the timings."""
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(T + D)
    q, k, v, do = (torch.randn(B, T, H, D, generator=g).to(device, dtype) for _ in range(4))
    log_f = F.logsigmoid(torch.randn(B, T, H, generator=g) + 4).to(device)  # FoX-like gates
    field = torch.cumsum(torch.randn(B, T, H, generator=g), 1).to(device)
    level = (field + torch.randn(B, T, H, generator=g).to(device)).contiguous()
    qh, kh, vh, doh = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))  # SDPA layout

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()

        return call

    def fpa_fwd():
        return tf.fpa_fwd(q, k, v, field, level, None, None)

    def fpa_fwdbwd():
        o, lse = fpa_fwd()
        tf.fpa_bwd(q, k, v, field, level, o, lse, do, None, None, None)

    def fox_fwd():
        return tf.fox_fwd(q, k, v, log_f, None, None)

    def fox_fwdbwd():
        o, lse = fox_fwd()
        tf.fox_bwd(q, k, v, log_f, o, lse, do, None, None, None)

    calls = {
        ("FPA", "fwd"): (no_grad(fpa_fwd), None),
        ("FoX", "fwd"): (no_grad(fox_fwd), None),
        ("SDPA", "fwd"): (
            no_grad(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)),
            None,
        ),
        ("FPA", "fwd+bwd"): (fpa_fwdbwd, None),
        ("FoX", "fwd+bwd"): (fox_fwdbwd, None),
    }
    leaves = [x.clone().requires_grad_() for x in (qh, kh, vh)]
    calls["SDPA", "fwd+bwd"] = (
        lambda: F.scaled_dot_product_attention(*leaves, is_causal=True).backward(doh),
        leaves,
    )
    if peer is not None:
        calls["fla", "fwd"] = (no_grad(lambda: peer(q, k, v, log_f)), None)
        fla_leaves = [x.clone().requires_grad_() for x in (q, k, v, log_f)]
        calls["fla", "fwd+bwd"] = (lambda: peer(*fla_leaves).backward(do), fla_leaves)

        def agreement() -> float:
            with torch.no_grad():
                mine, theirs = fox_fwd()[0].float(), peer(q, k, v, log_f).float()
            return float((mine - theirs).norm() / theirs.norm())

        calls["agreement"] = (agreement, None)
    return calls


def tile_sweep(torch, tf, bench, dtype, device, dry: bool) -> list[dict]:
    """FPA forward per candidate forward tiles, forward+backward per candidate backward tiles
    (forward on the table's), at one shape; the table in triton_fpa.py is retuned from this."""
    D, T = SWEEP_SHAPE[dry]
    B, H = (DRY_SHAPES if dry else GPU_SHAPES)["B"], (DRY_SHAPES if dry else GPU_SHAPES)["H"]
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, do = (torch.randn(B, T, H, D, generator=g).to(device, dtype) for _ in range(4))
    field = torch.cumsum(torch.randn(B, T, H, generator=g), 1).to(device)
    level = (field + 1.0).contiguous()
    table = tf.tiles_for(torch.device(device), backward=False)
    rows = []
    for mode, candidates in (("fwd", SWEEP["forward"]), ("fwd+bwd", SWEEP["backward"])):
        for own, visit, warps in DRY_SWEEP if dry else candidates:
            tiles = tf.Tiles(own, visit, warps)
            forced = (tiles, table) if mode == "fwd" else (table, tiles)

            def run(mode=mode):
                o, lse = tf.fpa_fwd(q, k, v, field, level, None, None)
                if mode == "fwd+bwd":
                    tf.fpa_bwd(q, k, v, field, level, o, lse, do, None, None, None)

            with tf.forced_tiles(*forced):
                ms = bench(run)
            rows.append({"D": D, "T": T, "mode": mode, "tiles": [own, visit, warps], "ms": ms})
            print(f"  sweep D={D} T={T} {mode:<8} tiles {own}x{visit}, {warps} warps: {ms:.3f} ms")
    return rows


def precompile(workers: int | None = None) -> list[dict]:
    """Compile every variant of the timings in parallel processes (a fresh machine has an empty
    Triton cache); a variant whose process does not exit 0 is a failure, returned."""
    import tempfile

    variants = timing_variants()
    workers = workers or max(1, min(16, os.cpu_count() or 1))
    folder = tempfile.mkdtemp(prefix="gpu_compile_")
    jobs = [
        (f"compile-{n}", [sys.executable, "-m", "bench.gpu_bench", "compile", json.dumps(v)])
        for n, v in enumerate(variants)
    ]
    print(f"compile: {len(jobs)} variants on {workers} processes")
    status = run_jobs(jobs, workers, folder)
    failures = []
    for (name, _), variant in zip(jobs, variants, strict=True):
        if status[name] != 0:
            with open(os.path.join(folder, f"{name}.log")) as fh:
                log = fh.read()[-2000:]
            print(f"{name} {variant} FAILED (exit {status[name]}):\n{log}")
            failures.append({"variant": list(variant), "exit": status[name], "log": log})
    return failures


def timings(dry: bool, out: str | None, budget: float = TIME_BUDGET_S) -> int:
    torch = _torch(dry)
    from attnspec.backends.torch import triton_fpa as tf

    if not dry and not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    versions = _versions(torch)
    print(
        f"FPA section: {_device_name(torch, dry)}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    failed_compiles = [] if dry else precompile()
    print("long check (float64 reference, the kit's float32 tolerances):")
    try:
        checked = long_check(torch, device, CHECK_T[dry])
    except Exception as exc:  # recorded as a failed check; the timings still run
        print(f"  long check FAILED: {type(exc).__name__}: {exc}")
        checked = False
    bench = _timer(torch, dry)
    peak = matmul_peak(torch, bench, dry)
    peer_name, peer = _fla_peer(dry)
    shapes = DRY_SHAPES if dry else GPU_SHAPES
    dtype = torch.float32 if dry else torch.bfloat16
    B, H = shapes["B"], shapes["H"]
    print(f"matmul peak {peak:.3g} TFLOP/s; fla peer: {peer_name}; {dtype}, B = {B}, H = {H}")
    report = {
        "section": "fpa",
        "device": _device_name(torch, dry),
        "versions": versions,
        "dry_run": dry,
        "dtype": str(dtype).removeprefix("torch."),
        "B": B,
        "H": H,
        "peer": peer_name,
        "matmul_peak_tflops": peak,
        "long_check_passed": checked,
        "compile_failures": failed_compiles,
        "rows": [],
        "failures": [],
        "skipped": [],
        "sweep": [],
    }
    save(report, out)
    start = time.perf_counter()
    for D in shapes["Ds"]:
        for T in shapes["Ts"]:
            try:
                calls = shape_calls(torch, tf, peer, B, H, T, D, dtype, device)
            except Exception as exc:  # inputs of this shape could not be made: all rows fail
                report["failures"].append({"D": D, "T": T, "impl": "*", "error": repr(exc)})
                save(report, out)
                continue
            agreement = calls.pop("agreement", None)
            shown = []
            for (impl, mode), (fn, leaves) in calls.items():
                where = {"D": D, "T": T, "impl": impl, "mode": mode}
                if not dry and time.perf_counter() - start > budget:
                    report["skipped"].append(where)
                    continue
                try:
                    ms = bench(fn, grad_to_none=leaves)
                except Exception as exc:  # recorded; the run goes on
                    report["failures"].append(where | {"error": f"{type(exc).__name__}: {exc}"})
                    shown.append(f"{impl}/{mode} FAILED")
                    save(report, out)
                    continue
                tflops = flops(B, H, T, D, mode) / (ms * 1e-3) / 1e12
                report["rows"].append(where | {"ms": ms, "tflops": tflops})
                shown.append(f"{impl}/{mode} {ms:.3f}")
                save(report, out)  # every row as soon as it is measured
            if agreement is not None:
                try:
                    report.setdefault("fox_vs_fla", []).append(
                        {"D": D, "T": T, "rel_diff": agreement[0]()}
                    )
                except Exception as exc:
                    report["failures"].append({"D": D, "T": T, "impl": "agreement",
                                               "error": repr(exc)})  # fmt: skip
            print(f"  D={D:>3} T={T:>6}: {' '.join(shown)} ms")
    print("tile sweep (FPA; the forward+backward rows vary the backward tiles):")
    try:
        report["sweep"] = tile_sweep(torch, tf, bench, dtype, device, dry)
    except Exception as exc:
        report["failures"].append({"impl": "sweep", "error": f"{type(exc).__name__}: {exc}"})
    save(report, out)
    print()
    print("\n".join(fpa_table(report)))
    ok = checked and not report["failures"] and not failed_compiles
    return 0 if ok else 1


def save(report: dict, out: str | None) -> None:
    """Write the report (again) now: a crash later loses nothing measured."""
    if out:
        with open(out + ".tmp", "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(out + ".tmp", out)


# summary


def fpa_table(report: dict, compact: bool = False) -> list[str]:
    """The FPA/FoX lines of the short table: ms, TFLOP/s, ratios to fla, goals (``compact``:
    the FPA ms alone beside the ratios, for the summary)."""
    rows = report["rows"]
    by = {(r["D"], r["T"], r["impl"], r["mode"]): r for r in rows}
    shown = IMPLS[:1] if compact else IMPLS
    width = 9 if compact else 17
    lines = [
        f"FPA / FoX timings: {report['dtype']}, B = {report['B']}, H = {report['H']}; "
        f"ms{'' if compact else ' (TFLOP/s)'}; peer {report['peer']}; "
        f"matmul peak {report['matmul_peak_tflops']:.3g}",
        f"{'D':>4} {'T':>6} {'mode':<8}" + "".join(f"{i:>{width}}" for i in shown)
        + f"{'FPA/fla':>9}{'FoX/fla':>9}{'FPA/FoX':>9}",
    ]  # fmt: skip
    misses, worst = [], {}
    for D, T, mode in sorted({(r["D"], r["T"], r["mode"]) for r in rows}):
        cells, ms = "", {}
        for impl in IMPLS:
            r = by.get((D, T, impl, mode))
            ms[impl] = r and r["ms"]
            if impl not in shown:
                continue
            if r is None:
                cells += f"{'-':>{width}}"
            else:
                cells += f"{r['ms']:>9.3f}" + ("" if compact else f" ({r['tflops']:>4.0f})")
        ratios = ""
        for a, b in (("FPA", "fla"), ("FoX", "fla"), ("FPA", "FoX")):
            ratio = ms[a] / ms[b] if ms[a] and ms[b] else None
            ratios += f"{'-':>9}" if ratio is None else f"{ratio:>9.2f}"
            goal = GOALS.get((a, mode)) if b == "fla" else None
            judged = D == GOAL_D and T >= GOAL_MIN_T
            if ratio is not None and goal is not None and judged:
                worst[a, mode] = max(worst.get((a, mode), 0.0), ratio)
                if ratio > goal:
                    misses.append(f"{a} {mode} D={D} T={T}: {ratio:.2f} > {goal}")
        lines.append(f"{D:>4} {T:>6} {mode:<8}{cells}{ratios}")
    failures = report.get("failures", [])
    for f in failures[:3] if compact else failures:
        lines.append(f"  FAILED {f.get('impl')} {f.get('mode', '')} D={f.get('D')} "
                     f"T={f.get('T')}: {f['error'][:100 if compact else 160]}")  # fmt: skip
    if compact and len(failures) > 3:
        lines.append(f"  ... {len(failures) - 3} more failures in fpa.json")
    for f in report.get("compile_failures", []):
        lines.append(f"  compile FAILED {f['variant']} (exit {f['exit']})")
    if report.get("skipped"):
        lines.append(f"  skipped after the time budget: {len(report['skipped'])} rows")
    if report["dry_run"]:
        return [*lines, "goals: judged on the GPU only (a dry run times the interpreter)"]
    for (impl, mode), goal in GOALS.items():
        if (impl, mode) in worst:
            met = "met" if worst[impl, mode] <= goal else "MISSED"
            lines.append(
                f"goal {impl} {mode} <= {goal}x fla: {met} (worst {worst[impl, mode]:.2f})"
            )
        else:
            lines.append(f"goal {impl} {mode} <= {goal}x fla: not measured (D={GOAL_D}, T>=8K)")
    peak = report["matmul_peak_tflops"]
    big = [r for r in rows if r["impl"] == "FPA" and r["mode"] == "fwd" and r["D"] == 128]
    big = [r for r in big if r["T"] >= 8192]
    if big:
        low = min(r["tflops"] for r in big) / peak
        met = "met" if low >= PEAK_FRACTION else "MISSED"
        goal = f"goal FPA fwd >= {PEAK_FRACTION:.0%} of the matmul peak (D=128, T>=8192)"
        lines.append(f"{goal}: {met} ({low:.0%})")
    lines += [f"  missed: {m}" for m in misses]
    for mode in ("fwd", "fwd+bwd"):
        runs = [r for r in report.get("sweep", []) if r["mode"] == mode]
        if runs:
            best = min(runs, key=lambda r: r["ms"])
            own, visit, warps = best["tiles"]
            what = "forward" if mode == "fwd" else "backward"
            lines.append(
                f"fastest {what} tiles at D={best['D']} T={best['T']}: {own}x{visit}, {warps} "
                f"warps ({best['ms']:.3f} ms; table {runs[0]['ms']:.3f} ms)"
            )
    return lines


def _kit_lines(kit: dict) -> list[str]:
    """The kit's totals in one line, then the (op, dtype) pairs with failures."""
    totals: dict[tuple, list[int]] = {}
    for row in kit["summary"]:
        t = totals.setdefault((row["op"], row["dtype"]), [0, 0, 0])
        t[0] += row["passed"]
        t[1] += row["failed"]
        t[2] += row["not implemented"]
    p, f, n = (sum(t[i] for t in totals.values()) for i in range(3))
    lines = [
        f"kit on {kit['backend']} ({kit['device']}), {kit['seconds']:.0f} s: {p} passed, "
        f"{f} failed, {n} not implemented"
    ]
    failed = [f"{op} {dtype} ({t[1]})" for (op, dtype), t in sorted(totals.items()) if t[1]]
    if failed:
        lines.append(textwrap.shorten("  failed: " + ", ".join(failed), 200, placeholder=" ..."))
    return lines


DECODE_PEERS = ("sdpa", "fla one-step", "flash_attn kvcache")
SUMMARY_CHARS = 3900  # the summary printed last: a run's output cut to its tail keeps it


def decode_lines(report: dict) -> list[str]:
    """The decode section: per configuration, tokens/s of the session (theta = inf) over each
    peer's, of the compiled step over SDPA's and of theta = 1 keeping a quarter over SDPA's;
    the trained layers' median over SDPA's."""
    speed: dict[tuple, dict[str, float]] = {}
    for r in report["rows"]:
        key = (r["B"], r["T"], r["HQ"], r["H"], r["dtype"])
        speed.setdefault(key, {})[r["variant"]] = r["speed_vs_sdpa"]
    lines = [
        f"decode ({report['attention']} kernel, {report['device']}): tokens/s of FPA theta=inf "
        "over each peer's; compiled step, kept 0.25 (theta=1) and trained layers over SDPA's",
        f"{'B':>3} {'T':>6} {'HQ:H':>6} {'dtype':<5}{'sdpa':>7}{'fla':>7}{'fa':>7}"
        f"{'compiled':>9}{'kept':>7}",
    ]
    trained: dict[str, list[float]] = {}
    for (B, T, HQ, H, dtype), v in speed.items():
        for name, x in v.items():
            if name.startswith("fpa trained"):
                trained.setdefault(name, []).append(x)
        if "fpa kept=0.25 indep" not in v:
            continue  # a trained layer's group
        fpa = v.get("fpa inf")
        cells = [fpa / v[p] if fpa and v.get(p) else None for p in DECODE_PEERS]
        cells += [v.get("fpa inf compiled"), v.get("fpa kept=0.25 indep")]
        text = "".join(
            f"{'-' if c is None else f'{c:.2f}':>{w}}"
            for c, w in zip(cells, (7, 7, 7, 9, 7), strict=True)
        )
        short = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(dtype, dtype)
        lines.append(f"{B:>3} {T:>6} {f'{HQ}:{H}':>6} {short:<5}{text}")
    if trained:
        lines.append("  " + "; ".join(
            f"{n.removeprefix('fpa trained ')} {statistics.median(x):.2f}"
            for n, x in trained.items()
        ))  # fmt: skip
    for name, why in report.get("peers_skipped", {}).items():
        lines.append(f"  peer {name}: skipped, {why}"[:160])
    failures = report.get("failures", [])
    for f in failures[:3]:
        lines.append(f"  FAILED {f['variant']} B={f['B']} T={f['T']}: {f['error'][:100]}")
    if len(failures) > 3:
        lines.append(f"  ... {len(failures) - 3} more failures in decode.json")
    if report.get("skipped"):
        lines.append(f"  skipped after the time budget: {len(report['skipped'])} configurations")
    return lines


def ratios(data: dict) -> list[dict]:
    """Every ratio to a peer the check measured, one record each: FPA and FoX time over fla's
    parallel_forgetting_attn (fwd, fwd+bwd); the decode session's tokens/s over SDPA's, fla's
    one-step decode's and FlashAttention's kvcache decode's (and the compiled step's over
    SDPA's); S4D time over fla's chunk_gla."""
    out: list[dict] = []
    fpa = data.get("fpa", {}).get("rows", [])
    ms = {(r["D"], r["T"], r["impl"], r["mode"]): r["ms"] for r in fpa}
    for (D, T, impl, mode), t in ms.items():
        peer = ms.get((D, T, "fla", mode))
        if impl in ("FPA", "FoX") and peer:
            out.append({"section": "fpa", "ours": impl, "peer": "fla parallel", "mode": mode,
                        "D": D, "T": T, "time_ratio": t / peer})  # fmt: skip
    speed: dict[tuple, dict[str, float]] = {}
    for r in data.get("decode", {}).get("rows", []):
        key = (r["B"], r["T"], r["HQ"], r["H"], r["dtype"])
        speed.setdefault(key, {})[r["variant"]] = r["speed_vs_sdpa"]
    for (B, T, HQ, H, dtype), v in speed.items():
        where = {"B": B, "T": T, "HQ": HQ, "H": H, "dtype": dtype}
        for ours in ("fpa inf", "fpa inf compiled"):
            for peer in DECODE_PEERS if ours == "fpa inf" else DECODE_PEERS[:1]:
                if v.get(ours) and v.get(peer):
                    out.append({"section": "decode", "ours": ours, "peer": peer, **where,
                                "speed_ratio": v[ours] / v[peer]})  # fmt: skip
    for r in data.get("s4d", {}).get("rows", []):
        if r["peer_ms"] == r["peer_ms"]:  # not NaN: a peer ran
            where = {"mode": r["mode"], "dv": r["dv"], "T": r["T"]}
            out.append({"section": "s4d", "ours": "S4D", "peer": "chunk_gla", **where,
                        "time_ratio": r["ms"] / r["peer_ms"]})  # fmt: skip
    return out


def _pallas_lines(pallas: dict) -> list[str]:
    checks = pallas.get("checks", [])
    passed = sum(bool(c.get("passed")) for c in checks)
    return [f"pallas: {passed} of {len(checks)} checks passed, "
            f"{len(pallas.get('timings', []))} timing rows (pallas.json)"]  # fmt: skip


def summary(folder: str) -> int:
    """Print the summary of the check from the files of ``folder`` (under 4,000 characters);
    write it there as gpu_check.json (with every ratio, :func:`ratios`) and gpu_check.md."""
    data: dict = {}
    for name in ("kit", "fpa", "s4d", "decode", "pallas"):
        path = os.path.join(folder, f"{name}.json")
        if os.path.exists(path):
            with open(path) as fh:
                data[name] = json.load(fh)
    lines, status = ["GPU check summary"], 0
    sections = os.path.join(folder, "sections.txt")
    if os.path.exists(sections):
        with open(sections) as fh:
            entries = [line.split() for line in fh if line.strip()]
        data["sections"] = [{"name": n, "exit": int(e), "seconds": int(s)} for n, e, s in entries]
        lines.append("sections (exit, seconds): " + ", ".join(
            f"{e['name']} {e['exit']} {e['seconds']} s" for e in data["sections"]
        ))  # fmt: skip
        status = next((e["exit"] for e in data["sections"] if e["exit"]), 0)
    if "fpa" in data:
        report = data["fpa"]
        lines.append(
            f"device: {report['device']}; "
            + ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        )
    if "kit" in data:
        lines += _kit_lines(data["kit"])
    if "fpa" in data:
        verdict = "pass" if report["long_check_passed"] else "FAIL"
        lines.append(f"long check at T = {CHECK_T[report['dry_run']]}: {verdict}")
        lines += fpa_table(report, compact=True)
    if "s4d" in data:
        s4d = data["s4d"]
        lines += s4d["summary"] or [f"S4D: check {'pass' if s4d['check_passed'] else 'FAILED'}"]
    if "pallas" in data:
        lines += _pallas_lines(data["pallas"])
    if "decode" in data:
        lines += decode_lines(data["decode"])
    data["ratios"] = ratios(data)
    last = f"{len(data['ratios'])} ratios to peers in gpu_check.json, results in {folder}"
    while len("\n".join([*lines, last])) > SUMMARY_CHARS:  # (a run with many failures)
        lines[-2:] = ["  ... (cut: the sections' files hold the rest)"]
    lines.append(last)
    print("\n".join(lines))
    with open(os.path.join(folder, "gpu_check.json"), "w") as fh:
        json.dump(data | {"summary": lines}, fh, indent=1)
    with open(os.path.join(folder, "gpu_check.md"), "w") as fh:
        fh.write("```\n" + "\n".join(lines) + "\n```\n")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("kit", "timings", "summary", "compile"))
    parser.add_argument("variant", nargs="?", help="compile: a variant as JSON (internal)")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes"
    )
    parser.add_argument("--out", help="kit, timings: write the JSON report to this file")
    parser.add_argument("--workers", type=int, help="kit: processes (default: cores, <= 16)")
    parser.add_argument(
        "--budget", type=float, default=TIME_BUDGET_S, help="timings: seconds of timing rows"
    )
    parser.add_argument("--results", help="summary: the folder of the check's result files")
    args = parser.parse_args(argv)
    if args.step == "kit":
        return kit(args.dry_run, args.out, args.workers)
    if args.step == "compile":
        compile_variant(tuple(json.loads(args.variant)))
        return 0
    if args.step == "timings":
        return timings(args.dry_run, args.out, args.budget)
    if not args.results:
        parser.error("summary needs --results FOLDER")
    return summary(args.results)


if __name__ == "__main__":
    sys.exit(main())
