"""Static Hopper gate of the paged FPA decode kernel (backends/torch/triton_decode.py), beside
flash-linear-attention's ``attn_decoding_one_step`` (fla/ops/attn/decoding.py).

Both compiled for sm_90 without a GPU (bench/sm90.py). Ours as the launcher launches it: the
launcher runs on CPU tensors of a session state (R = 1 row, HQ = 32 query heads, H = 8 kv heads
(GQA 4:1), dk = dv = 128 bf16, an 8K context in pages of 16, one query token) with its launches
captured instead of run (bench/launches.py), so arguments, constexprs, grid and alignment are
the launcher's. fla's ``attn_decoding_one_step`` at the same shapes with a gate (``USE_G``, the
FoX case), captured the same way at its Hopper tiles (BS = 64, BK = BV = 128); fla autotunes
num_warps in {1, 2, 4} and num_stages in {2..5} on the GPU, here 4 warps and 2 stages (the
config nearest to ``launches.FLA_CONFIG``).

Printed per kernel: shared memory, registers, stack, tensor-core instructions (HGMMA = wgmma,
HMMA = mma.sync), instructions and spills (STL + LDL) in the key loop, and bytes read per token
per kv head from the kernel's loads (:func:`bytes_per_token`): ours reads k and v once per kv
head (the G query heads share the tile) plus the per-entry state (position 8 B; per query head
level 4 B, minimum 4 B, eviction step 8 B); fla reads k and v once per query head (one program
per query head and V block) plus the gate. A one-token query is a matrix-vector product: ours
puts the G heads x n tokens (padded to 16 rows) on mma.sync (wgmma's smallest tile is 64 rows
per warpgroup); fla multiplies and sums on the FMA units (tl.sum). Budgets (asserted, exit 1):
ours compiles, within the shared-memory limit, no spill in its key loop, bf16 dots on tensor
cores, bytes per token per kv head no more than fla's.

    python -m bench.gpu_static_decode [--json build/gpu_static_decode.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, before triton is imported

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

R, HQ, H, D, T, PAGE = 1, 32, 8, 128, 8192, 16


def ours() -> list[Any]:
    """The decode and combine launches of ``paged_attention_triton`` on a full 8K state."""
    import torch

    from attnspec.backends.torch.triton_decode import paged_attention_triton
    from bench.launches import capture

    NT, S, bf = T // PAGE, T, torch.bfloat16
    table = torch.arange(R * H * NT).view(R, H, NT)
    pos = torch.arange(S).expand(R, H, S).contiguous()
    wide = torch.zeros(R, HQ, S)
    with capture() as launches:
        paged_attention_triton(
            torch.zeros(R, HQ, 1, D, dtype=bf),
            torch.zeros(R * H * NT, PAGE, D, dtype=bf),
            torch.zeros(R * H * NT, PAGE, D, dtype=bf),
            table,
            pos,
            wide,
            wide,
            torch.zeros(R, HQ, S, dtype=torch.int64),
            torch.full((R, 1), T - 1),
            torch.zeros(R, HQ, 1),
            D**-0.5,
        )
    return launches


def fla_launch() -> Any:
    """The decode launch of fla's ``attn_decoding_one_step`` at the same shapes with a gate,
    captured as on Hopper."""
    import torch

    from bench.launches import capture, fla_as_on_hopper

    fla_as_on_hopper()
    from fla.ops.attn.decoding import attn_decoding_one_step

    bf = torch.bfloat16
    with capture() as launches:
        attn_decoding_one_step(
            torch.zeros(1, R, HQ, D, dtype=bf),
            torch.zeros(1, R * T, H, D, dtype=bf),
            torch.zeros(1, R * T, H, D, dtype=bf),
            torch.zeros(1, R * T, HQ),
            D**-0.5,
            torch.arange(R + 1) * T,
        )
    return next(c for c in launches if c.name == "naive_attn_decoding_kernel")


def bytes_per_token(impl: str, G: int = HQ // H, elt: int = 2) -> float:
    """Bytes the kernel loads per context token per kv head (k, v and per-token state)."""
    if impl == "fla":
        return G * (2 * D * elt + 4)  # k, v per query head; g_cumsum (f32) per query head
    return 2 * D * elt + 8 + G * (4 + 4 + 8) + 8 / PAGE  # k, v; pos; level, min, step; table


def measure(name: str, launch: Any) -> dict[str, Any]:
    from bench import sm90

    row: dict[str, Any] = {"kernel": name}
    try:
        report = sm90.build(launch)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        return row
    top = [lp for lp in report.loops if lp.depth == 0]
    loop = max(top, key=lambda lp: lp.instructions) if top else None
    row |= {
        "shared": report.shared,
        "registers": report.registers,
        "stack": report.stack,
        "hgmma": report.hgmma,
        "hmma": report.hmma,
        "stl": report.spills[0],
        "ldl": report.spills[1],
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
    }
    if loop is not None:
        row["loop"] = {
            "instructions": loop.instructions,
            "spills": loop.opcodes["STL"] + loop.opcodes["LDL"],
            "mma": loop.mma,
            "ldg": loop.opcodes["LDG"],
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="build/gpu_static_decode.json")
    parser.add_argument("--no-fla", action="store_true")
    args = parser.parse_args(argv)
    from bench import sm90

    launches = ours()
    rows = []
    for c in launches:
        rows.append(measure(c.name, c.launch) | {"impl": "ours", "grid": list(c.grid)})
    if not args.no_fla:
        peer = fla_launch()
        rows.append(measure(peer.name, peer.launch) | {"impl": "fla"})
    ours_bytes, fla_bytes = bytes_per_token("ours"), bytes_per_token("fla")
    fails = []
    print(f"static sm_90 gate, decode: R={R} HQ={HQ} H={H} D={D} T={T} page {PAGE}, bf16, n=1")
    print(f"{'kernel':<28}{'shared':>8}{'reg':>5}{'stack':>6}{'HGMMA':>6}{'HMMA':>5}"
          f"{'loop ins':>9}{'loop spill':>11}{'warps':>6}")  # fmt: skip
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<28}  {r['error'][:90]}")
            if r["impl"] == "ours":
                fails.append(f"{r['kernel']}: {r['error']}")
            continue
        lp = r.get("loop", {"instructions": 0, "spills": 0})
        print(f"{r['kernel']:<28}{r['shared']:>8}{r['registers']:>5}{r['stack']:>6}"
              f"{r['hgmma']:>6}{r['hmma']:>5}{lp['instructions']:>9}{lp['spills']:>11}"
              f"{r['num_warps']:>6}")  # fmt: skip
        if r["impl"] != "ours":
            continue
        if r["shared"] > sm90.SHARED_LIMIT:
            fails.append(f"{r['kernel']}: {r['shared']} B shared > {sm90.SHARED_LIMIT}")
        if lp["spills"]:
            fails.append(f"{r['kernel']}: {lp['spills']} spill instructions in its loop")
        if r["kernel"] == "_paged_decode_kernel" and not r["hmma"] + r["hgmma"]:
            fails.append(f"{r['kernel']}: bf16 dots not on tensor cores")
    print(f"bytes read per token per kv head (G = {HQ // H}): ours {ours_bytes:.1f}, "
          f"fla {fla_bytes:.1f}: {ours_bytes / fla_bytes:.2f}x")  # fmt: skip
    if ours_bytes > fla_bytes:
        fails.append(f"bytes per token per kv head {ours_bytes:.1f} > fla's {fla_bytes:.1f}")
    print("\n".join(f"FAIL {f}" for f in fails) or "static sm_90 gate, decode: passed")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "rows": rows,
                    "bytes_per_token": {"ours": ours_bytes, "fla": fla_bytes},
                    "failures": fails,
                    "shape": [R, HQ, H, D, T, PAGE],
                },
                fh,
                indent=1,
            )
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
