"""What the CPU benchmarks (cpu_torch.py, cpu_jax.py) share: the shapes, the timing rule, the
reference's memory estimate and the peak-memory measurement in a child process."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

B, H, D, M = 1, 2, 64, 64  # batch, heads, head dim (K = V = R), LegS/S4D modes
REFERENCE_BUDGET = 4 * 2**30  # bytes the reference's intermediates may take
ROW = "| {:<4} | {:>5} | {:<22} | {:>10} | {:>12} | {:>11} | {:>15} |"


def median_time(fn: Callable[[], Any], min_runs: int = 3, min_seconds: float = 1.0) -> float:
    """Median wall time of ``fn()`` (which blocks until its results exist) after a warm-up."""
    fn()
    times: list[float] = []
    while len(times) < min_runs or (sum(times) < min_seconds and len(times) < 20):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def reference_bytes(op: str, T: int) -> int:
    """What the reference allocates at its peak, roughly (float64 / complex128)."""
    if op in ("FPA", "FoX"):
        return 12 * B * H * T * T * 8  # (T, T) arrays of the VJP: m, p, G, masks, t*
    C = B * H * (2 * D + 1)
    if op == "LegS":
        return 5 * T * M * C * 8  # coefficients (T, M, C), readout and their cotangents
    return 6 * T * M * C * 16  # complex states (T, M, C), C x, and their cotangents


def peak_rss() -> int:
    """This process's peak resident set size in bytes: VmHWM of /proc/self/status (reset by
    exec, unlike ru_maxrss, which a child started from a large parent inherits on Linux)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_memory(script: str, T: int) -> dict[str, Any]:
    """Run ``script --peak-memory-child T`` in a fresh process; its last stdout line is JSON."""
    done = subprocess.run(
        [sys.executable, script, "--peak-memory-child", str(T)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
