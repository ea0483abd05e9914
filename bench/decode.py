"""Serving decode benchmark: the paged FPA session against a plain full cache with torch SDPA.

For rows B, context T, GQA HQ:H and dtype, one row of the table per (config, variant):
- ``sdpa``: a preallocated [B, H, T_max, d] cache, each token written in place and attended by
  ``scaled_dot_product_attention`` (enable_gqa), the peer: it holds every token;
- ``fpa inf``: the paged session (backends/torch/paged.py) at theta = inf (nothing evicted);
- ``fpa kept=k (indep|shared)``: the session at theta = 1 on a field with a known kept fraction:
  a flat field (phi = 0) and levels l_j in {0, 2 theta}, l_j = 0 with probability k, so a key
  is kept for good or evicted at the next token (depth l_j). ``indep``: drawn per query head, so
  a kv head stores the union over its G heads (1 - (1 - k)^G of the tokens); ``shared``: one
  draw per kv head (the union is k).
Columns: tokens/s of decode (B tokens per step, the median step over ``--steps`` after a
warm-up), bytes of k and v held, and per query head the kept fraction (live / T), per kv head
the stored fraction (stored / T) and the pages held (pages * page_size / T): the gaps are the
cost of GQA's union and of paging. The context is built by ``prefill_state`` (not timed).

    python -m bench.decode                 # CPU subset (a few minutes; 2 cores)
    python -m bench.decode --grid full --device cuda --attention triton   # GPU: the full grid
    python -m bench.decode --dry-run       # tiny shapes, the Triton kernel interpreted
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

GRIDS: dict[str, dict[str, Any]] = {
    # the CPU subset: what runs in a few minutes on two shared cores
    "cpu": {"B": (1, 8), "T": (1024, 8192), "gqa": ((8, 2), (8, 8)), "dtype": ("float32",)},
    "full": {
        "B": (1, 8, 32),
        "T": (1024, 8192, 32768),
        "gqa": ((32, 8), (32, 32)),
        "dtype": ("bfloat16", "float32"),
    },
    "dry": {"B": (2,), "T": (40,), "gqa": ((4, 2),), "dtype": ("float32",)},
}
KEPT = 0.25
THETA = 1.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens(
    B: int,
    HQ: int,
    H: int,
    n: int,
    d: int,
    dtype: torch.dtype,
    dev: torch.device,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cpu").to(dev, dtype)

    return {"q": rand(B, HQ, n, d), "k": rand(B, H, n, d), "v": rand(B, H, n, d)}


def _levels(
    B: int, HQ: int, H: int, n: int, mode: str, gen: torch.Generator, dev: torch.device
) -> torch.Tensor:
    """[B, HQ, n] levels: 0 (kept) with probability KEPT, else 2 theta; none for theta = inf."""
    if mode == "inf":
        return torch.zeros(B, HQ, n, device=dev)
    heads = HQ if mode == "indep" else H
    keep = torch.rand(B, heads, n, generator=gen) < KEPT
    lv = torch.where(keep, 0.0, 2 * THETA).to(dev)
    return lv if mode == "indep" else lv.repeat_interleave(HQ // H, dim=1)


def _time(step: Any, steps: int, device: torch.device) -> float:
    """Median seconds of one step over ``steps`` runs after one warm-up."""
    step()
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_sdpa(
    B: int,
    T: int,
    HQ: int,
    H: int,
    d: int,
    dtype: torch.dtype,
    steps: int,
    device: torch.device,
    gen: torch.Generator,
) -> dict[str, Any]:
    ctx = _tokens(B, HQ, H, T, d, dtype, device, gen)
    K = torch.zeros(B, H, T + steps + 1, d, dtype=dtype, device=device)
    Vc = torch.zeros_like(K)
    K[:, :, :T], Vc[:, :, :T] = ctx["k"], ctx["v"]
    t = [T]

    def step() -> None:
        x = _tokens(B, HQ, H, 1, d, dtype, device, gen)
        K[:, :, t[0]], Vc[:, :, t[0]] = x["k"][:, :, 0], x["v"][:, :, 0]
        t[0] += 1
        F.scaled_dot_product_attention(
            x["q"], K[:, :, : t[0]], Vc[:, :, : t[0]], enable_gqa=HQ != H
        )

    sec = _time(step, steps, device)
    held = B * H * t[0] * 2 * d * K.element_size()  # the tokens it holds at the end
    return {
        "variant": "sdpa",
        "tokens_per_s": B / sec,
        "bytes": held,
        "kept": 1.0,
        "stored": 1.0,
        "paged": 1.0,
    }


def bench_session(
    B: int,
    T: int,
    HQ: int,
    H: int,
    d: int,
    dtype: torch.dtype,
    steps: int,
    device: torch.device,
    gen: torch.Generator,
    mode: str,
    attention: Any,
) -> dict[str, Any]:
    from attnspec.backends.torch.paged import PagedFPASession

    theta = math.inf if mode == "inf" else THETA
    s = PagedFPASession(
        rows=B,
        heads=HQ,
        kv_heads=H,
        dk=d,
        dv=d,
        dtype=dtype,
        scale=d**-0.5,
        theta=theta,
        device=device,
        attention=attention,
    )
    ctx = _tokens(B, HQ, H, T, d, dtype, device, gen)
    field = torch.zeros(B, HQ, T, device=device)
    s.prefill_state(ctx | {"field": field, "level": _levels(B, HQ, H, T, mode, gen, device)})
    present = torch.ones(B, 1, dtype=torch.bool, device=device)

    def step() -> None:
        x = _tokens(B, HQ, H, 1, d, dtype, device, gen)
        lv = _levels(B, HQ, H, 1, mode, gen, device)
        s.advance(x | {"field": torch.zeros(B, HQ, 1, device=device), "level": lv}, present)

    sec = _time(step, steps, device)
    counts = s.counts()
    tokens = float(counts["tokens"][0])
    name = "fpa inf" if mode == "inf" else f"fpa kept={KEPT} {mode}"
    return {
        "variant": name,
        "tokens_per_s": B / sec,
        "bytes": s.bytes_held(),
        "kept": float(counts["live"].double().mean()) / tokens,
        "stored": float(counts["stored"].double().mean()) / tokens,
        "paged": float(s.pages_held().double().mean()) * s.P / tokens,
    }


def run(grid: str, steps: int, device: torch.device, attention_name: str) -> list[dict[str, Any]]:
    if attention_name == "triton":
        from attnspec.backends.torch.triton_decode import paged_attention_triton as attention
    else:
        from attnspec.backends.torch.paged import paged_attention_eager as attention
    g, d, rows = GRIDS[grid], 64 if grid != "dry" else 16, []
    for B, T, (HQ, H), dname in itertools.product(g["B"], g["T"], g["gqa"], g["dtype"]):
        dtype = getattr(torch, dname)
        gen = torch.Generator().manual_seed(0)
        config = {"B": B, "T": T, "HQ": HQ, "H": H, "dtype": dname, "d": d}
        results = [bench_sdpa(B, T, HQ, H, d, dtype, steps, device, gen)]
        for mode in ("inf", "indep", "shared"):
            if mode == "shared" and HQ == H:
                continue  # the same as indep
            results.append(
                bench_session(B, T, HQ, H, d, dtype, steps, device, gen, mode, attention)
            )
        peer = results[0]
        for r in results:
            r |= config | {
                "speed_vs_sdpa": r["tokens_per_s"] / peer["tokens_per_s"],
                "bytes_vs_sdpa": r["bytes"] / peer["bytes"],
            }
            rows.append(r)
            print(_line(r), flush=True)
    return rows


HEADER = (
    f"{'B':>3} {'T':>6} {'HQ:H':>6} {'dtype':>8} {'variant':<22} {'tok/s':>9} "
    f"{'x sdpa':>7} {'MiB':>8} {'x sdpa':>7} {'kept':>6} {'stored':>6} {'paged':>6}"
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['B']:>3} {r['T']:>6} {r['HQ']:>3}:{r['H']:<2} {r['dtype']:>8} "
        f"{r['variant']:<22} {r['tokens_per_s']:>9.1f} {r['speed_vs_sdpa']:>7.2f} "
        f"{r['bytes'] / 2**20:>8.2f} {r['bytes_vs_sdpa']:>7.3f} {r['kept']:>6.3f} "
        f"{r['stored']:>6.3f} {r['paged']:>6.3f}"
    )


def figure(rows: list[dict[str, Any]], path: str) -> None:
    """Bytes held and tokens/s relative to the SDPA peer, one group of bars per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["B"], r["T"], r["HQ"], r["H"], r["dtype"]) for r in rows})
    variants = [v for v in dict.fromkeys(r["variant"] for r in rows) if v != "sdpa"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(variants)
    for i, v in enumerate(variants):
        for ax, key in zip(axes, ("bytes_vs_sdpa", "speed_vs_sdpa"), strict=True):
            ys = [
                next(
                    (
                        r[key]
                        for r in rows
                        if r["variant"] == v and (r["B"], r["T"], r["HQ"], r["H"], r["dtype"]) == c
                    ),
                    math.nan,
                )
                for c in configs
            ]
            ax.bar([x + i * width for x in range(len(configs))], ys, width, label=v)
    labels = [f"B{b} T{t // 1024}K {hq}:{h}" for b, t, hq, h, _ in configs]
    for ax, title in zip(axes, ("bytes held / SDPA's full cache", "tokens/s / SDPA"), strict=True):
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(
            [x + 0.4 - width / 2 for x in range(len(configs))],
            labels,
            rotation=45,
            ha="right",
            fontsize=7,
        )
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", choices=("eager", "triton"), default="eager")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreted")
    parser.add_argument("--out", help="JSON file of the rows")
    parser.add_argument("--figure", help="PNG of bytes and speed relative to SDPA")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.grid, args.steps, args.attention = "dry", 1, "triton"
    device = torch.device(args.device)
    print(
        f"decode bench: grid {args.grid}, {args.attention} attention, device {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(HEADER)
    rows = run(args.grid, args.steps, device, args.attention)
    bad = [
        r
        for r in rows
        if r["variant"] != "sdpa" and r["paged"] * r["T"] > r["stored"] * r["T"] + 16 * (1 + 1e-9)
    ]
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"grid": args.grid, "attention": args.attention, "rows": rows}, fh, indent=1)
    if args.figure:
        figure(rows, args.figure)
    if bad:
        print(f"decode bench: pages above one page of stored entries in {len(bad)} rows")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
