"""Static gate of the envelope (backends/envelope.py): every Triton kernel compiled for sm_90 at
the corners of what the ops accept, without a GPU (bench/sm90.py, bench/launches.py).

Each corner runs a launcher on small CPU tensors with its launches captured instead of run, at
the corner's dtypes, head dims, GQA ratio, chunk length and number of packed sequences (the
sizes that decide constexprs, tiles and grids; the token count only scales tensors). A corner
the envelope routes to the eager twin on CUDA compiles nothing: the gate then asserts only that
the table routes it. For every captured launch of a corner served by a kernel, asserted:

- it compiles for sm_90 (``GPUTarget("cuda", 90, 32)``, the launcher's warps and stages);
- its dynamic shared memory is at most 232,448 B (an H100/H200 block);
- its grid is within CUDA's limits (x < 2^31, y and z <= 65,535);
- no pointer offset on a tensor that can exceed 2^31 elements is 32-bit, read from the TTIR:
  each ``tt.addptr`` applied to such a kernel argument takes a 64-bit offset (or a 32-bit one
  of constants and ranges only), and no 32-bit product of two runtime values (program ids,
  arguments, loaded values) feeds it.
  A tensor can exceed 2^31 elements when its elements per token, times the tokens of the
  largest call a 141 GB H200 holds at that corner (q, k, v and o resident:
  ``envelope.max_tokens``), exceed 2^31; the gap sums of the FPA backward (``mid_sums``,
  O(HQ (T / BT)^2)) always can.

Each distinct compile (kernel, specialisation, warps, stages) runs once per process.

    python -m bench.gpu_static_envelope            # the representative set (make test)
    python -m bench.gpu_static_envelope --full     # every corner (the Triton matrix legs)
    python -m bench.gpu_static_envelope --only paged_g16_d256_n16 --json build/envelope.json

``ATTNSPEC_ENVELOPE_FULL=1`` selects the full set as ``--full`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__":  # compile for the GPU: before triton is imported (not on import)
    os.environ.pop("TRITON_INTERPRET", None)

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GRID_X = 2**31 - 1
GRID_YZ = 65_535
INT32_ELEMENTS = 2**31

QUADRATIC = {"mid_sums"}  # O(HQ (T / BT)^2) per call: can exceed 2^31 at long T


@dataclass(frozen=True)
class Corner:
    """One corner of the envelope: ``family`` ("fpa", "fox", "s4d", "legs", "paged"), q/k/v
    dtype, per-token scalar dtype, head dim, query and kv heads, chunk positions (paged), packed
    sequences. ``ci``: in the representative set of make test, compiling there the kernels it
    names (every launch's grid is checked; None: in the full set only); ``defect``: the defect
    of issue 55 the corner shows (0: none)."""

    name: str
    family: str
    dtype: str
    scalars: str = "fp32"
    D: int = 128
    HQ: int = 16
    H: int = 16
    n: int = 1
    sequences: int = 1
    ci: tuple[str, ...] | None = None
    defect: int = 0


# the FPA backward's per-token passes: cheap to compile, and _delta_kernel reads o and dO,
# which pass 2^31 elements (defect 4)
PREPASSES = ("_delta_kernel", "_block_minima_kernel", "_dfield_kernel")
PAGED = ("_paged_decode_kernel",)
CORNERS = (
    # FPA / FoX: 16-bit q with float32 scalars at the Hopper tiles (D = 128), GQA 4:1
    Corner("fpa_bf16_d128_gqa4", "fpa", "bf16", HQ=32, H=8, ci=PREPASSES, defect=4),
    Corner("fox_bf16_d128_gqa4", "fox", "bf16", HQ=32, H=8),
    Corner("fpa_fp16_d64_mqa", "fpa", "fp16", D=64, HQ=32, H=1),
    Corner("fpa_bf16_d256", "fpa", "bf16", D=256),
    Corner("fpa_fp32_d128", "fpa", "fp32"),
    # float64 on CUDA (defect 2) and a float64 field with narrower q (defect 3)
    Corner("fpa_fp64_d64", "fpa", "fp64", "fp64", D=64, ci=("_bwd_dq_kernel",), defect=2),
    Corner("fox_fp64_d32", "fox", "fp64", "fp64", D=32, defect=2),
    Corner("fpa_bf16_fp64field", "fpa", "bf16", "fp64", ci=("_fwd_kernel",), defect=3),
    Corner("fpa_fp16_fp64field", "fpa", "fp16", "fp64", D=64, defect=3),
    Corner("fpa_fp32_fp64field", "fpa", "fp32", "fp64", D=64, defect=3),
    Corner("fox_bf16_fp64field", "fox", "bf16", "fp64", defect=3),
    # the paged decode kernel: one token, and a chunk of 16 positions at wide GQA (defect 5)
    Corner("paged_gqa4_d128_n1", "paged", "bf16", HQ=32, H=8),
    Corner(
        "paged_g16_d256_n16",
        "paged",
        "bf16",
        D=256,
        HQ=16,
        H=1,
        n=16,
        ci=PAGED,
        defect=5,
    ),
    Corner("paged_mqa32_d128_n16", "paged", "bf16", HQ=32, H=1, n=16, ci=PAGED, defect=5),
    Corner("paged_g8_d256_fp32_n16", "paged", "fp32", "fp32", D=256, HQ=8, H=1, n=16, defect=5),
    # Interdomain: 4,097 packed sequences x 16 heads (defect 6)
    Corner("s4d_bf16_4097seq", "s4d", "bf16", D=64, sequences=4097, ci=(), defect=6),
    Corner("legs_bf16_4097seq", "legs", "bf16", D=64, sequences=4097, ci=(), defect=6),
    Corner("s4d_fp32", "s4d", "fp32", D=64),
    # float64 beyond FPA/FoX
    Corner("paged_fp64_d128_n1", "paged", "fp64", "fp64", HQ=32, H=8),
    Corner("s4d_fp64", "s4d", "fp64", "fp64", D=64),
    Corner("legs_fp64", "legs", "fp64", "fp64", D=64),
)


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(
        name, torch.float64
    )


@dataclass
class Captures:
    """The launches of one corner and what they scale with: ``tokens`` (the count the
    per-token tensors have at capture) and ``bytes_per_token`` (q, k, v and o, resident)."""

    launches: list[Any]
    tokens: int
    bytes_per_token: int


def _capture_fpa(c: Corner, scale: int = 1) -> Captures:
    import torch

    from attnspec.backends.torch import triton_fpa as tf
    from attnspec.reference.packing import Packing
    from bench.launches import capture

    x, wide = _dtype(c.dtype), _dtype(c.scalars)
    T = 256 * scale
    hopper = [tf.tile_choice("hopper", backward=b, K=c.D, V=c.D, dtype=x) for b in (False, True)]
    q, o, do = (torch.empty(1, T, c.HQ, c.D, dtype=x) for _ in range(3))
    k, v = (torch.empty(1, T, c.H, c.D, dtype=x) for _ in range(2))
    field_, level, lse = (torch.empty(1, T, c.HQ, dtype=wide) for _ in range(3))
    packing = Packing((0, T // 2, T))
    with tf.forced_tiles(*hopper), capture() as launches:
        if c.family == "fox":
            tf.fox_fwd(q, k, v, field_, None, packing)
            tf.fox_bwd(q, k, v, field_, o, lse, do, None, None, packing)
        else:
            tf.fpa_fwd(q, k, v, field_, level, None, packing)
            tf.fpa_bwd(q, k, v, field_, level, o, lse, do, None, None, packing)
    per_token = (2 * c.HQ + 2 * c.H) * c.D * x.itemsize
    return Captures(launches, T, per_token)


def _capture_paged(c: Corner, scale: int = 1) -> Captures:
    import torch

    from attnspec.backends.torch.triton_decode import paged_attention_triton
    from bench.launches import capture

    x, wide = _dtype(c.dtype), _dtype(c.scalars)
    R, P, NT = 1, 16, 4 * scale
    S = NT * P
    table = torch.arange(R * c.H * NT).view(R, c.H, NT)
    pos = torch.arange(S).expand(R, c.H, S).contiguous()
    meta = torch.zeros(R, c.HQ, S, dtype=wide)
    with capture() as launches:
        paged_attention_triton(
            torch.zeros(R, c.HQ, c.n, c.D, dtype=x),
            torch.zeros(R * c.H * NT, P, c.D, dtype=x),
            torch.zeros(R * c.H * NT, P, c.D, dtype=x),
            table,
            pos,
            meta,
            meta,
            torch.zeros(R, c.HQ, S, dtype=torch.int64),
            torch.full((R, c.n), S - 1),
            torch.zeros(R, c.HQ, c.n, dtype=wide),
            c.D**-0.5,
        )
    # the cached tokens: k and v pages per kv head, and per query head level, minimum, step
    per_token = 2 * c.H * c.D * x.itemsize + c.HQ * (2 * wide.itemsize + 8)
    return Captures(launches, R * S, per_token)


def _capture_interdomain(c: Corner, scale: int = 1) -> Captures:
    import numpy as np
    import torch

    from attnspec.backends.torch import triton_chunks, triton_legs, triton_s4d, triton_s4d_bwd
    from attnspec.reference.packing import Packing
    from bench.launches import capture

    x = _dtype(c.dtype)
    N, R, M = c.sequences, 16, 16
    lengths = [max(1, 64 // N)] * N
    lengths[-1] += max(0, 64 - sum(lengths))
    lengths = [n * scale for n in lengths]
    T = sum(lengths)
    packing = Packing(tuple(int(s) for s in np.cumsum([0, *lengths])))
    fq, kt = (torch.zeros(1, T, c.H, R, dtype=x) for _ in range(2))
    vt, do = (torch.zeros(1, T, c.H, c.D, dtype=x) for _ in range(2))
    complex_type = torch.complex128 if c.dtype == "fp64" else torch.complex64
    lam = torch.view_as_real(torch.full((c.H, M), 0.9 + 0j, dtype=complex_type))
    b = torch.view_as_real(torch.ones(c.H, M, dtype=complex_type))
    cm = torch.view_as_real(torch.eye(M, dtype=complex_type)[None].repeat(c.H, 1, 1))
    hopper = triton_chunks.DEVICE_BLOCKS["hopper"]
    import dataclasses

    with triton_chunks.block_sizes(**dataclasses.asdict(hopper)), capture() as launches:
        if c.family == "s4d":
            args = (fq, kt, vt, lam, b, cm, "linear", packing, None)
            saved = triton_s4d.s4d_fwd(*args, return_saved=True)[2]
            triton_s4d_bwd.s4d_bwd(*args, do, None, saved)
        else:
            triton_legs.legs_fwd(fq, kt, vt, M, packing)
            triton_legs.legs_bwd(fq, kt, vt, M, packing, do)
    per_token = c.H * (3 * R + 2 * c.D) * x.itemsize
    return Captures(launches, T, per_token)


CAPTURE: dict[str, Callable[[Corner, int], Captures]] = {
    "fpa": _capture_fpa,
    "fox": _capture_fpa,
    "paged": _capture_paged,
    "s4d": _capture_interdomain,
    "legs": _capture_interdomain,
}


def routed(c: Corner) -> tuple[str, str]:
    """(impl, reason) the envelope gives this corner on CUDA."""
    from attnspec.backends import envelope

    return envelope.route(
        c.family, c.dtype, c.scalars, head_dim=c.D, sequences=c.sequences, heads=c.H
    )


# TTIR: pointer flow from the kernel's arguments to each tt.addptr


_HEAD = re.compile(r"tt\.func public @\w+\((.*)\)\s*attributes")
_ARG = re.compile(r"%(\w+): (!tt\.ptr|i32|i64)")
_OP = re.compile(r"^\s*(%[\w#:]+(?:\s*,\s*%[\w#]+)*)\s*=\s*\"?([\w.]+)\"?\s*(.*)$")
_VAL = re.compile(r"%[\w#]+")
_RUNTIME = {"tt.get_program_id", "tt.load", "tt.get_num_programs"}
_PASS_PTR = {"tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans"}
# the ops an offset's value flows through to a product that computes it
_THROUGH = {"arith.extsi", "arith.extui", "arith.addi", "arith.muli", "arith.subi", "arith.select"}
_THROUGH |= _PASS_PTR


def offsets_32bit(ttir: str, large: set[str]) -> list[str]:
    """The ``tt.addptr`` of the TTIR whose pointer is a bare kernel argument named in ``large``
    (the pointer arguments that can exceed 2^31 elements) and whose offset is a 32-bit runtime
    value, or 64-bit but computed from a 32-bit product of two runtime values: ``"name: what:
    line"`` each. A 32-bit offset of constants and ranges only (a tile's columns, which the
    compiler may add first) is not counted."""
    head = _HEAD.search(ttir)
    params = _ARG.findall(head.group(1)) if head else []
    root = {f"%{n}": n for n, kind in params if kind == "!tt.ptr"}  # pointers not yet offset
    runtime = {f"%{n}" for n, _ in params}  # kernel arguments are runtime values
    defs: dict[str, tuple[str, list[str], str]] = {}  # value -> (op, operands, type text)
    bad = []
    for line in ttir.splitlines():
        m = _OP.match(line)
        if not m:
            continue
        results = _VAL.findall(m.group(1))
        op, body = m.group(2), m.group(3).split(" loc(")[0]
        operands = _VAL.findall(body.split(":")[0])
        types = body.rsplit(":", 1)[-1] if ":" in body else ""
        for r in results:  # names repeat across regions (scf.if branches): the latest holds
            defs[r] = (op, operands, types)
            root.pop(r, None)
            runtime.discard(r)
        if op in _RUNTIME or any(o in runtime for o in operands):
            runtime.update(results)
        if op in _PASS_PTR and operands and operands[0] in root:
            root[results[0]] = root[operands[0]]
        if op == "tt.addptr" and operands and root.get(operands[0]) in large:
            name = root[operands[0]]
            offset_type = types.split(",")[-1].strip()
            if (offset_type.endswith("i32>") or offset_type == "i32") and operands[1] in runtime:
                bad.append(f"{name}: 32-bit offset: {line.strip()[:160]}")
            elif _narrow_product(operands[1], defs, runtime):
                bad.append(f"{name}: 64-bit offset of a 32-bit product: {line.strip()[:160]}")
    return bad


def _narrow_product(
    value: str, defs: dict[str, tuple[str, list[str], str]], runtime: set[str]
) -> bool:
    """Whether a 32-bit product of two runtime values (program ids, arguments, loaded values;
    not a constant) feeds ``value``, through sign extensions and 64-bit arithmetic. A runtime
    value times a constant (a tile index times the tile's rows) stays within a sequence's
    positions and is not counted."""
    seen: set[str] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v in seen or v not in defs:
            continue
        seen.add(v)
        op, operands, types = defs[v]
        narrow = re.search(r"\bi32\b|xi32>", types)
        if op == "arith.muli" and narrow and all(o in runtime for o in operands):
            return True
        if op in _THROUGH:
            stack.extend(operands)
    return False


# compile and judge


_COMPILED: dict[Any, dict[str, Any]] = {}


def _key(launch: Any) -> Any:
    from bench import sm90

    signature, constexprs, attrs = sm90.specialise(launch)
    fn = sm90._jit_function(launch.fn)
    return (
        fn.__module__,
        fn.__name__,
        tuple(signature.items()),
        tuple((k, str(v)) for k, v in constexprs.items()),
        tuple(sorted((k, str(v)) for k, v in attrs.items())),
        launch.num_warps,
        launch.num_stages,
    )


def compile_once(captured: Any) -> dict[str, Any]:
    """Compile a captured launch for sm_90 (once per distinct compile): shared bytes and TTIR,
    or the error."""
    from bench import sm90

    launch = captured.launch
    key = _key(launch)
    if key not in _COMPILED:
        try:
            compiled = sm90.compile_launch(launch)
            _COMPILED[key] = {"shared": int(compiled.metadata.shared), "ttir": compiled.asm["ttir"]}
        except Exception as exc:
            text = str(exc).strip().splitlines()
            _COMPILED[key] = {"error": f"{type(exc).__name__}: {(text or [''])[-1][:300]}"}
    return _COMPILED[key]


def large_arguments(captured: Any, twice: Any, caps: Captures, caps2: Captures) -> set[str]:
    """Names of the pointer arguments that can exceed 2^31 elements at this corner: their
    elements per token (what they grow by from the capture to the capture at twice the tokens,
    ``twice``) times the tokens of the largest call, over 2^31; and :data:`QUADRATIC`."""
    import torch

    from attnspec.backends import envelope
    from bench import sm90

    fn = sm90._jit_function(captured.fn)
    top = envelope.max_tokens(caps.bytes_per_token)  # tokens of the largest call
    out = set()
    for param in fn.params:
        value, grown = captured.args[param.name], twice.args[param.name]
        if not isinstance(value, torch.Tensor):
            continue
        per_token = (grown.numel() - value.numel()) / (caps2.tokens - caps.tokens)
        if param.name in QUADRATIC or per_token * top > INT32_ELEMENTS:
            out.add(param.name)
    return out


def judge(c: Corner, full: bool = True) -> dict[str, Any]:
    """One corner: its route, and per captured launch what fails. Without ``full`` only the
    kernels named in the corner's ``ci`` compile; every launch's grid is checked."""
    from bench import sm90

    start = time.perf_counter()
    impl, reason = routed(c)
    row: dict[str, Any] = {"corner": c.name, "defect": c.defect, "impl": impl, "reason": reason}
    if impl != "triton":
        row |= {"kernels": [], "failures": [], "seconds": 0.0}
        return row
    failures: list[str] = []
    kernels = []
    try:
        caps, caps2 = CAPTURE[c.family](c, 1), CAPTURE[c.family](c, 2)
        assert [x.name for x in caps.launches] == [x.name for x in caps2.launches]
    except Exception as exc:
        row |= {"kernels": [], "failures": [f"capture: {type(exc).__name__}: {exc}"[:300]]}
        return row
    for captured, twice in zip(caps.launches, caps2.launches, strict=True):
        entry: dict[str, Any] = {"kernel": captured.name, "grid": list(captured.grid)}
        kernels.append(entry)
        grid = list(captured.grid) + [1] * (3 - len(captured.grid))
        if grid[0] > GRID_X or grid[1] > GRID_YZ or grid[2] > GRID_YZ:
            failures.append(f"{captured.name}: grid {tuple(captured.grid)} over CUDA's limits")
        if not full and captured.name not in (c.ci or ()):
            continue
        got = compile_once(captured)
        if "error" in got:
            entry["error"] = got["error"]
            failures.append(f"{captured.name}: does not compile for sm_90: {got['error']}")
            continue
        entry["shared"] = got["shared"]
        if got["shared"] > sm90.SHARED_LIMIT:
            failures.append(f"{captured.name}: {got['shared']:,} B shared memory > 232,448")
        bad = offsets_32bit(got["ttir"], large_arguments(captured, twice, caps, caps2))
        entry["offsets_32bit"] = len(bad)
        failures += [f"{captured.name}: {b}" for b in dict.fromkeys(bad)]
    row |= {"kernels": kernels, "failures": failures}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every corner (default: make test's)")
    parser.add_argument("--only", nargs="+", help="corners by name")
    parser.add_argument("--json", default="", help="where the JSON report goes")
    args = parser.parse_args(argv)
    full = args.full or os.environ.get("ATTNSPEC_ENVELOPE_FULL", "") not in ("", "0")
    corners = [c for c in CORNERS if full or c.ci is not None]
    if args.only:
        corners = [c for c in CORNERS if c.name in args.only]
        full = True
    import triton

    start = time.perf_counter()
    rows = [judge(c, full) for c in corners]
    failed = [r for r in rows if r["failures"]]
    print(
        f"envelope gate (sm_90, Triton {triton.__version__}, {'full' if full else 'make test'} "
        f"set): {len(rows)} corners, "
        f"{len(_COMPILED)} compiles in {time.perf_counter() - start:.0f} s"
    )
    for r in rows:
        shared = max((k.get("shared", 0) for k in r["kernels"]), default=0)
        verdict = "FAIL" if r["failures"] else "ok"
        where = r["impl"] if r["impl"] != "triton" else f"{len(r['kernels'])} launches"
        print(
            f"{verdict:4} {r['corner']:<24} defect {r['defect']}  {where}, max shared {shared:,} B"
        )
        if r["impl"] != "triton":
            print(f"       routed: {r['reason']}")
        for f in r["failures"][:8]:
            print(f"       {f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            report = {"triton": triton.__version__, "full": full, "rows": rows}
            json.dump(report, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
