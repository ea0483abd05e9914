"""Static Hopper gate of the Triton FPA/FoX kernels: compiled for sm_90 as an H100/H200 launch
would compile them, without a GPU (bench/sm90.py).

Every Triton kernel of backends/torch/triton_fpa.py (FPA and FoX forward, dq, dk/dv, the per-token
passes) is compiled as its launch on an H100/H200 compiles it: the FPA and FoX ops run on CPU
tensors at B = 1, T = 8192, HQ = H = 16 with the tiles the launcher picks on Hopper
(``triton_fpa.tile_choice("hopper", ...)``, forced) and every launch captured instead of run
(bench/launches.py), so arguments, constexprs, warps, stages and alignment are the launcher's.
flash-linear-attention's ``parallel_attn`` forward and backward with a gate (the FoX case,
``USE_G``), captured the same way at the same shapes and fla's own Hopper tiles, are the peer
(its forward, dq and dk/dv kernels). One table:
dynamic shared memory, registers, stack bytes, tensor-core instructions (HGMMA = wgmma, HMMA =
mma.sync), SASS instructions per iteration of the off-diagonal and diagonal loops, spill
instructions (STL + LDL) in each loop, and the ratios to fla per visited row (our dq and dk/dv
step through their diagonal tile BD rows at a time, fla BS; "128x64d32" in the table).

Fails (exit 1) when a kernel of ours does not compile, asks for more shared memory than an
H100/H200 block may have (232,448 B), has a bf16/fp16 dot not on wgmma, or exceeds an asserted
budget at D = 128 bf16 (:data:`BUDGETS`: instructions per off-diagonal iteration over fla's;
:data:`SPILLS_ASSERTED`: spill instructions per visited row of each loop no more than in fla's
matching loop).

    python -m bench.gpu_static            # the D = 128 bf16 set (tests/test_gpu_static.py)
    python -m bench.gpu_static --full     # bf16, fp16 at D = 64, 128, 256 and fp32
    python -m bench.gpu_static --json build/gpu_static.json --jobs 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.launches import Captured

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, before triton is imported

B, T, HEADS = 1, 8192, 16
FULL_DIMS = (64, 128, 256)
FULL_DTYPES = ("bf16", "fp16", "fp32")
CI_SET = (("bf16", 128),)
# Budgets at D = 128 bf16: SASS instructions per off-diagonal iteration, ours / fla's matching
# kernel. Only the ones in ASSERTED fail the gate; the others are printed with their ratio.
BUDGETS = {
    ("FPA", "fwd"): 1.12,
    ("FPA", "dq"): 1.30,
    ("FPA", "dkv"): 1.30,
    ("FoX", "fwd"): 1.05,
    ("FoX", "dq"): 1.05,
    ("FoX", "dkv"): 1.05,
}
ASSERTED: set[tuple[str, str]] = set(BUDGETS)
ROLES = ("fwd", "dq", "dkv")
LOOPS = ("off", "diag")
# (impl, kernel, loop) whose spill instructions (STL + LDL) per iteration are asserted to be no
# more than those of fla's matching loop: every loop of every FPA/FoX kernel.
SPILLS_ASSERTED: set[tuple[str, str, str]] = {
    (impl, role, loop) for impl in ("FPA", "FoX") for role in ROLES for loop in LOOPS
}
BUDGET_AT = ("bf16", 128)


# Our rows in table order: (impl, role, the pass that launches it, kernel, its tensor-core loops
# in address order). The per-token passes as the backward launches them (at its tiles: the
# forward's BT is the same or smaller); delta's launch is the same in FPA's and FoX's backward.
OURS = (
    ("FPA", "fwd", "FPA fwd", "_fwd_kernel", ("diag", "off")),
    ("FoX", "fwd", "FoX fwd", "_fwd_kernel", ("diag", "off")),
    ("FPA", "dq", "FPA bwd", "_bwd_dq_kernel", ("diag", "off")),
    ("FPA", "dkv", "FPA bwd", "_bwd_dkv_kernel", ("diag", "off")),
    ("FoX", "dq", "FoX bwd", "_bwd_dq_kernel", ("diag", "off")),
    ("FoX", "dkv", "FoX bwd", "_bwd_dkv_kernel", ("diag", "off")),
    ("FPA", "minima", "FPA bwd", "_block_minima_kernel", ()),
    ("FoX", "sums", "FoX bwd", "_block_sums_kernel", ()),
    ("both", "delta", "FPA bwd", "_delta_kernel", ()),
    ("FPA", "dfield", "FPA bwd", "_dfield_kernel", ()),
    ("FoX", "segsums", "FoX bwd", "_segment_sums_kernel", ()),
)
FLA = (
    ("fla", "fwd", "fla fwd", "parallel_attn_fwd_kernel", ("off", "diag")),
    ("fla", "dq", "fla bwd", "parallel_attn_bwd_kernel_dq", ("off", "diag")),
    ("fla", "dkv", "fla bwd", "parallel_attn_bwd_kernel_dkv", ("diag", "off")),
)


@dataclass(frozen=True)
class Spec:
    """One kernel to compile: ``impl`` FPA, FoX or fla; ``role`` fwd, dq, dkv or a prepass name;
    the launch of ``kernel`` in ``launched_in`` (``"FPA bwd"``); ``order`` names the mma loops
    in address order (``diag``/``off``)."""

    impl: str
    role: str
    dtype: str
    D: int
    launched_in: str
    kernel: str
    order: tuple[str, ...] = ()


def _torch_dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


@functools.lru_cache(maxsize=1)
def ours(dtype: str, D: int) -> dict[tuple[str, str], Captured]:
    """Every launch of the FPA and FoX forward and backward (triton_fpa's ops) at this dtype and
    head dim, captured at the tiles the launcher picks on Hopper
    (``triton_fpa.tile_choice("hopper", ...)``), by (pass, kernel): ("FoX bwd", "_delta_kernel")."""
    import torch

    from attnspec.backends.torch import triton_fpa as tf
    from bench.launches import capture

    x = _torch_dtype(dtype)
    hopper = [tf.tile_choice("hopper", backward=b, K=D, V=D, dtype=x) for b in (False, True)]
    q, k, v, o, do = (torch.empty(B, T, HEADS, D, dtype=x) for _ in range(5))
    field, level, lse = (torch.empty(B, T, HEADS) for _ in range(3))
    calls = (
        ("FPA", tf.fpa_fwd, tf.fpa_bwd, (field, level)),
        ("FoX", tf.fox_fwd, tf.fox_bwd, (field,)),
    )
    out: dict[tuple[str, str], Captured] = {}
    with tf.forced_tiles(*hopper), capture() as launches:
        for impl, forward, backward, scalars in calls:
            n = len(launches)
            forward(q, k, v, *scalars, None, None)
            out |= _by_kernel(launches[n:], f"{impl} fwd")
            n = len(launches)
            backward(q, k, v, *scalars, o, lse, do, None, None, None)
            out |= _by_kernel(launches[n:], f"{impl} bwd")
    return out


@functools.lru_cache(maxsize=1)
def fla(dtype: str, D: int) -> dict[tuple[str, str], Captured]:
    """flash-linear-attention's parallel_attn forward and backward with a gate (FoX), captured
    as on Hopper (fla/ops/attn/parallel.py: BT = 128, BS = 64, BK = BV = next power of two,
    8 warps), by (pass, kernel) as :func:`ours`."""
    import torch

    from bench.launches import capture, fla_as_on_hopper

    fla_as_on_hopper()
    from fla.ops.attn.parallel import parallel_attn_bwd, parallel_attn_fwd

    x = _torch_dtype(dtype)
    q, k, v, o, do = (torch.empty(B, T, HEADS, D, dtype=x) for _ in range(5))
    g_cumsum, lse = (torch.empty(B, T, HEADS) for _ in range(2))
    out: dict[tuple[str, str], Captured] = {}
    with capture() as launches:
        parallel_attn_fwd(q, k, v, g_cumsum, None, D**-0.5)
        out |= _by_kernel(launches, "fla fwd")
        n = len(launches)
        parallel_attn_bwd(q, k, v, o, g_cumsum, lse, do, None, D**-0.5)
        out |= _by_kernel(launches[n:], "fla bwd")
    return out


def _by_kernel(launches: list[Captured], where: str) -> dict[tuple[str, str], Captured]:
    """The launches of one pass by (pass, kernel): each kernel once, or which one a row
    compiles would be ambiguous."""
    out = {(where, c.name): c for c in launches}
    assert len(out) == len(launches), [c.name for c in launches]
    return out


def specs_at(dtype: str, D: int, peer: bool) -> list[Spec]:
    """The rows of one dtype and head dim: ours, then fla's with ``peer``."""
    return [Spec(impl, role, dtype, D, *rest) for impl, role, *rest in OURS + (FLA if peer else ())]


def measure(spec: Spec) -> dict[str, Any]:
    """Compile one spec and read its binary; a compile error is recorded, not raised."""
    from bench import sm90

    start = time.perf_counter()
    row: dict[str, Any] = {
        "impl": spec.impl, "role": spec.role, "dtype": spec.dtype, "D": spec.D,
        "kernel": spec.kernel,
    }  # fmt: skip
    try:
        captured = (fla if spec.impl == "fla" else ours)(spec.dtype, spec.D)
        launch = captured[spec.launched_in, spec.kernel]
        row |= {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        for name in ("BT", "BS", "BK", "BV"):
            if isinstance(launch.args.get(name), int):
                row[name] = launch.args[name]
        for name in ("BDQ", "BDK"):  # dq's and dk/dv's diagonal step
            if isinstance(launch.args.get(name), int):
                row["BD"] = launch.args[name]
        report = sm90.build(launch.launch)
    except Exception as exc:  # every kernel is reported; the gate then fails
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        return row
    row |= {
        "shared": report.shared,
        "registers": report.registers,
        "stack": report.stack,
        "hgmma": report.hgmma,
        "hmma": report.hmma,
        "stl": report.spills[0],
        "ldl": report.spills[1],
        "seconds": round(time.perf_counter() - start, 1),
    }
    loops = sm90.mma_loops(report)
    if spec.order and len(loops) == len(spec.order):
        for name, loop in zip(spec.order, loops, strict=True):
            row[name] = {
                "instructions": loop.instructions,
                "hgmma": loop.opcodes["HGMMA"],
                "hmma": loop.opcodes["HMMA"],
                "stl": loop.opcodes["STL"],
                "ldl": loop.opcodes["LDL"],
                "ldg": loop.opcodes["LDG"],
                "bar": loop.opcodes["BAR"],
                "shfl": loop.opcodes["SHFL"],
            }
    elif spec.order and spec.dtype in ("bf16", "fp16"):
        row["error"] = f"expected {len(spec.order)} tensor-core loops, found {len(loops)}"
    # float32 inputs: "ieee" dots on FMA units (no tensor-core loops to name); resources only
    return row


def run(specs: list[Spec], jobs: int) -> list[dict[str, Any]]:
    if jobs <= 1:
        return [measure(s) for s in specs]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(measure, specs))


def judge(rows: list[dict[str, Any]], assert_budgets: bool = True) -> tuple[list[str], list[str]]:
    """(failures, notes): the limit, wgmma and asserted budgets; ratios of every budget. With
    ``assert_budgets`` False (another Triton than the CI pin) the budgets are printed only."""
    from bench.sm90 import SHARED_LIMIT

    fails, notes = [], []
    peers = {(r["role"], r["dtype"], r["D"]): r for r in rows if r["impl"] == "fla"}
    for r in rows:
        key = f"{r['impl']} {r['role']} {r['dtype']} D={r['D']}"
        if "error" in r:
            (notes if r["impl"] == "fla" else fails).append(f"{key}: {r['error']}")
            continue
        if r["impl"] == "fla":
            if r["shared"] > SHARED_LIMIT:
                notes.append(f"{key}: fla asks {r['shared']:,} B shared > {SHARED_LIMIT:,}")
            continue
        if r["shared"] > SHARED_LIMIT:
            fails.append(f"{key}: {r['shared']:,} B shared memory > {SHARED_LIMIT:,}")
        if r["dtype"] in ("bf16", "fp16") and r["role"] in ROLES and (r["hmma"] or not r["hgmma"]):
            fails.append(f"{key}: dots not on wgmma (HGMMA {r['hgmma']}, HMMA {r['hmma']})")
        peer = peers.get((r["role"], r["dtype"], r["D"]))
        if r["role"] not in ROLES or peer is None or "error" in peer or "off" not in r:
            continue
        if (r["dtype"], r["D"]) != BUDGET_AT or "off" not in peer:
            continue
        ratio = per_row_ratio(r, peer, "off", "instructions")
        budget = BUDGETS[r["impl"], r["role"]]
        asserted = assert_budgets and (r["impl"], r["role"]) in ASSERTED
        verdict = "met" if ratio <= budget else "MISSED"
        notes.append(
            f"budget {r['impl']} {r['role']} off-diagonal instructions <= {budget}x fla: "
            f"{ratio:.2f}x {verdict}{' (asserted)' if asserted else ' (not asserted)'}"
        )
        if asserted and ratio > budget:
            fails.append(f"{key}: {ratio:.2f}x fla's instructions per iteration > {budget}")
        for loop in LOOPS:
            if loop not in peer or loop not in r:
                continue
            # per visited row: the diagonal of dq and dk/dv steps BD rows, fla's BS
            mine = spills(r, loop) * visited(peer, loop)
            theirs = spills(peer, loop) * visited(r, loop)
            spilled = assert_budgets and (r["impl"], r["role"], loop) in SPILLS_ASSERTED
            verdict = "met" if mine <= theirs else "MISSED"
            notes.append(
                f"spills {r['impl']} {r['role']} {loop} loop: {spills(r, loop)} STL+LDL per "
                f"{visited(r, loop)} rows, fla's {spills(peer, loop)} per {visited(peer, loop)}: "
                f"{verdict}{' (asserted)' if spilled else ' (not asserted)'}"
            )
            if spilled and mine > theirs:
                fails.append(
                    f"{key}: {spills(r, loop)} spill instructions per {visited(r, loop)} rows in "
                    f"its {loop} loop > fla's {spills(peer, loop)} per {visited(peer, loop)}"
                )
    return fails, notes


def visited(row: dict[str, Any], loop: str) -> int:
    """Rows of the other side one iteration of ``loop`` visits: BS, or BD on the diagonal of
    our dq and dk/dv kernels."""
    return int(row.get("BD", row["BS"]) if loop == "diag" else row["BS"])


def spills(row: dict[str, Any], loop: str) -> int:
    return int(row[loop]["stl"] + row[loop]["ldl"])


def per_row_ratio(row: dict[str, Any], peer: dict[str, Any], loop: str, what: str) -> float:
    """row's ``what`` per visited row of ``loop`` over the peer's (per iteration at equal
    tiles)."""
    return (row[loop][what] / visited(row, loop)) / (peer[loop][what] / visited(peer, loop))


def table(rows: list[dict[str, Any]]) -> list[str]:
    """One line per kernel: resources, tensor cores, per-iteration instructions and spills."""
    peers = {(r["role"], r["dtype"], r["D"]): r for r in rows if r["impl"] == "fla"}
    head = (
        f"{'kernel':<17}{'dtype':>5}{'D':>4}{'tiles':>14}{'shared B':>9}{'reg':>5}{'stack':>6}"
        f"{'HGMMA':>6}{'HMMA':>5}{'off/it':>7}{'diag/it':>8}{'off spill':>10}{'diag spill':>11}"
        f"{'off/fla':>8}{'diag/fla':>9}"
    )
    lines = [head]
    for r in rows:
        name = f"{r['impl']} {r['role']}"
        tiles = "x".join(str(r[n]) for n in ("BT", "BS") if n in r)
        if r.get("BD", r.get("BS")) != r.get("BS"):
            tiles += f"d{r['BD']}"  # the diagonal's rows per step
        tiles += f"/{r['num_warps']}w" if "num_warps" in r else ""  # none: not captured
        if "error" in r:
            lines.append(f"{name:<17}{r['dtype']:>5}{r['D']:>4}{tiles:>14}  {r['error'][:90]}")
            continue
        cells = ""
        for loop in ("off", "diag"):
            cells += f"{r[loop]['instructions']:>{7 if loop == 'off' else 8}}" if loop in r else (
                f"{'-':>{7 if loop == 'off' else 8}}")  # fmt: skip
        for loop, width in (("off", 10), ("diag", 11)):
            cell = f"{r[loop]['stl']}+{r[loop]['ldl']}" if loop in r else "-"
            cells += f"{cell:>{width}}"
        peer = peers.get((r["role"], r["dtype"], r["D"]))
        for loop, width in (("off", 8), ("diag", 9)):
            if r["impl"] != "fla" and peer and loop in r and loop in peer:
                cells += f"{per_row_ratio(r, peer, loop, 'instructions'):>{width}.2f}"
            else:
                cells += f"{'-':>{width}}"
        lines.append(
            f"{name:<17}{r['dtype']:>5}{r['D']:>4}{tiles:>14}{r['shared']:>9}{r['registers']:>5}"
            f"{r['stack']:>6}{r['hgmma']:>6}{r['hmma']:>5}{cells}"
        )
    return lines


def versions() -> dict[str, str]:
    import torch
    import triton

    try:
        from importlib.metadata import version

        fla_version = version("fla-core")
    except Exception:
        fla_version = "not installed"
    return {"triton": triton.__version__, "torch": torch.__version__, "fla-core": fla_version}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="bf16, fp16, fp32 at D = 64, 128, 256")
    parser.add_argument("--json", default="build/gpu_static.json", help="where the JSON goes")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--no-fla", action="store_true", help="ours only (no peer columns)")
    parser.add_argument("--only", nargs="+", help="kernels by 'impl role' (e.g. 'FPA dq')")
    parser.add_argument("--dtypes", nargs="+", choices=FULL_DTYPES, help="instead of the set")
    parser.add_argument("--dims", nargs="+", type=int, help="head dims instead of the set's")
    parser.add_argument(
        "--report-budgets",
        action="store_true",
        help="print the budgets without asserting them (a Triton other than the CI pin: the "
        "compile, the shared-memory limit and wgmma still fail the gate)",
    )
    args = parser.parse_args(argv)
    sets = [(t, d) for t in FULL_DTYPES for d in FULL_DIMS] if args.full else list(CI_SET)
    if args.dtypes or args.dims:
        dtypes = args.dtypes or sorted({t for t, _ in sets})
        sets = [(t, d) for t in dtypes for d in args.dims or sorted({d for _, d in sets})]
    specs = [s for dtype, D in sets for s in specs_at(dtype, D, peer=not args.no_fla)]
    if args.only:
        specs = [s for s in specs if f"{s.impl} {s.role}" in args.only or s.impl == "fla"]
    start = time.perf_counter()
    rows = run(specs, args.jobs)
    took = time.perf_counter() - start
    fails, notes = judge(rows, not args.report_budgets)
    info = versions()
    print(
        f"static sm_90 gate: {len(rows)} kernels compiled in {took:.0f} s; B={B} T={T} "
        f"HQ=H={HEADS}; " + ", ".join(f"{k} {v}" for k, v in info.items())
    )
    print("\n".join(table(rows)))
    print("\n".join(notes))
    print("\n".join(f"FAIL {f}" for f in fails) or "static sm_90 gate: passed")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            report = {
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "versions": info,
                "shape": {"B": B, "T": T, "HQ": HEADS, "H": HEADS},
                "shared_limit": 232_448,
                "asserted": [] if args.report_budgets else sorted(f"{i} {k}" for i, k in ASSERTED),
                "spills_asserted": []
                if args.report_budgets
                else sorted(" ".join(x) for x in SPILLS_ASSERTED),
                "rows": rows,
                "notes": notes,
                "failures": fails,
            }
            json.dump(report, fh, indent=1)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
