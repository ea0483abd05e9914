"""Per-rank peak memory and time of the torch context-parallel ops on CPU (gloo), P = 1, 2, 4 at a
fixed total T.

    python bench/cpu_context_parallel.py [--T 4096] [--ops FPA FoX S4D] [--worlds 1 2 4]

Every (op, P) runs in a fresh launch of P processes. Each rank builds the whole inputs from one
seed, keeps its shard, resets its peak resident set size (``/proc/self/clear_refs``), runs one
forward and backward, and reports the peak growth over its resident size before the call; then
the median time of a few forward+backward calls (a barrier before and after each). The table
gives the largest value over the ranks and, for the memory, what the design predicts: the
query side (this rank's q, o, lse and their gradients, the tiles) falls as 1/P, the gathered
keys, values, field and levels and their gradient buffers stay O(T).

Float32, B = 1, H = 2, K = V = R = 64, M = 64; one thread per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from attnspec.backends.torch import context_parallel as cp
from attnspec.backends.torch.context_parallel_launch import spawn

B, H, D, M = 1, 2, 64, 64


def _rss(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _inputs(op: str, T: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "FPA":
        field = r(B, T, H).cumsum(1) * 0.1
        return [r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), field, field + 0.5]
    if op == "FoX":
        return [r(B, T, H, D), r(B, T, H, D), r(B, T, H, D), -torch.rand(B, T, H, generator=g)]
    return [r(B, T, H, D) / 8, r(B, T, H, D) / 8, r(B, T, H, D)]


def _call(op: str, xs: list[torch.Tensor], params: list[torch.Tensor]) -> torch.Tensor:
    if op == "FPA":
        return cp.fpa_attention(*xs, impl="eager")
    if op == "FoX":
        return cp.fox_attention(*xs, impl="eager")
    return cp.interdomain_s4d(*xs, *params, impl="eager")


def _worker(rank: int, world: int, op: str, T: int, path: str) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    lam = torch.exp(
        torch.complex(-torch.rand(H, M, generator=g) * 0.1, torch.rand(H, M, generator=g))
    )
    params = [
        lam,
        torch.ones(H, M, dtype=torch.complex64),
        torch.eye(M, dtype=torch.complex64).expand(H, M, M).contiguous(),
    ]
    # warm-up on a short sequence: code paths loaded before the measured call
    small = [cp.shard_sequence(x, rank, world).requires_grad_() for x in _inputs(op, 8 * world)]
    _call(op, small, params).sum().backward()
    xs = [cp.shard_sequence(x, rank, world).contiguous().requires_grad_() for x in _inputs(op, T)]
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident size
    before = _rss("VmRSS")
    _call(op, xs, params).sum().backward()
    peak = _rss("VmHWM") - before
    times = []
    for _ in range(3):
        for x in xs:
            x.grad = None
        dist.barrier()
        start = time.perf_counter()
        _call(op, xs, params).sum().backward()
        dist.barrier()
        times.append(time.perf_counter() - start)
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, {"peak": peak, "time": statistics.median(times)})
    if rank == 0:
        with open(path, "w") as fh:
            json.dump(rows, fh)


def predicted(op: str, T: int, world: int) -> tuple[float, float]:
    """(query side, key/value side) bytes per rank predicted by the design, float32."""
    Tl = T // world
    if op == "S4D":  # fq, kt, vt, o and gradients; the states [M, C] per step of a chunk
        return 8 * Tl * H * D * 4 * 2, 0.0
    block = min(128, Tl)
    query = (4 * Tl * H * D + 3 * Tl * H) * 4 * 2 + 4 * H * block * Tl * 4  # q, o, do, dq; tiles
    keys = 4 * T * H * (2 * D + 2) * 4  # gathered k, v, field, level and their gradient buffers
    return float(query), float(keys)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--ops", nargs="+", default=["FPA", "FoX", "S4D"])
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    args = parser.parse_args(argv)
    print(
        f"python bench/cpu_context_parallel.py, {time.strftime('%Y-%m-%d')}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}; Python {platform.python_version()}, torch "
        f"{torch.__version__}; T = {args.T}, B = {B}, H = {H}, K = V = R = {D}, M = {M}, float32"
    )
    print()
    print(
        "| op | P | T/P | peak MiB / rank | predicted q-side MiB | predicted k/v-side MiB | "
        "fwd+bwd ms (slowest rank) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for op in args.ops:
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "rows.json")
                spawn(_worker, world, op, args.T, path, timeout=1800.0)
                with open(path) as fh:
                    rows = json.load(fh)
            peak = max(r["peak"] for r in rows) / 2**20
            ms = max(r["time"] for r in rows) * 1e3
            q_side, kv_side = (x / 2**20 for x in predicted(op, args.T, world))
            print(
                f"| {op} | {world} | {args.T // world} | {peak:.1f} | {q_side:.1f} | "
                f"{kv_side:.1f} | {ms:.0f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
