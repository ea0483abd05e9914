"""Serving decode benchmark: the paged FPA session against a plain full cache with torch SDPA.

For rows B, context T, GQA HQ:H and dtype, one row of the table per (config, variant):
- ``sdpa``: a preallocated [B, H, T_max, d] cache, each token written in place and attended by
  ``scaled_dot_product_attention`` (enable_gqa), the peer: it holds every token;
- ``fpa inf``: the paged session (backends/torch/paged.py) at theta = inf (nothing evicted);
- ``fpa kept=k (indep|shared)``: the session at theta = 1 on a field with a known kept fraction:
  a flat field (phi = 0) and levels l_j in {0, 2 theta}, l_j = 0 with probability k, so a key
  is kept for good or evicted at the next token (depth l_j). ``indep``: drawn per query head, so
  a kv head stores the union over its G heads (1 - (1 - k)^G of the tokens); ``shared``: one
  draw per kv head (the union is k);
- ``fpa inf compiled``: the session at theta = inf decoding by :meth:`decode` with its device
  step compiled (``torch.compile(decode_step, fullgraph=True)``; on CUDA the compiled step is
  also captured in a CUDA graph and replayed), value checks off, the whole run in one
  reservation: no host read a step (at the ``compiled`` shapes of the grid);
- the peers beside SDPA, where installed (a line says which are not): flash-linear-attention's
  ``attn_decoding_one_step`` (``fla one-step``: the caches of all rows in one packed buffer,
  each row's slots and a gap as sequences of its offsets) and FlashAttention's
  ``flash_attn_with_kvcache`` (``flash_attn kvcache``: the new token written into the cache by
  the call), each with the full cache;
- ``fpa trained Ln theta=16``: the session on the q, k, v, field and levels of layer n of a
  trained model, E4's passkey FPA with the FoX initialisation (2 layers, 2 heads of 32; weights
  in ``TRAINED``, made by ``--train-field``), on passkey sequences of T + steps + 1 tokens (the
  layer below decoding with eviction), at E4's theta for that model; beside it ``sdpa`` and
  ``fpa inf`` at its shapes (HQ:H = 2:2, d = 32).
Columns: tokens/s of decode (B tokens per step, the median step over ``--steps`` after a
warm-up) and its ratio to the peer's: each variant's steps alternate with steps of the peer
(peer, variant, peer, ...), the ratio is the median over those pairs of the peer's seconds over
the variant's, so a machine whose speed drifts moves both sides of a pair alike (the peer's own
row: its median step over all pairs); bytes of k and v held, and per query head the kept
fraction (live / T), per kv head the stored fraction (stored / T) and the pages held
(pages * page_size / T): the gaps are the cost of GQA's union and of paging. The context is
built by ``prefill_state`` (not timed).

    python -m bench.decode                 # CPU subset (a few minutes; 2 cores)
    python -m bench.decode --grid full --device cuda --attention triton   # GPU: the full grid
    python -m bench.decode --dry-run       # tiny shapes, the Triton kernel interpreted
    python -m bench.decode --train-field   # E4's model trained again into TRAINED (a minute)

With ``--budget S`` the configurations after S seconds are recorded as skipped; with ``--out``
the rows are written after every configuration (a crash later loses nothing measured).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# "compiled": the (B, T) of the compiled variant (at the grid's first GQA ratio and dtype: one
# compilation each)
GRIDS: dict[str, dict[str, Any]] = {
    # the CPU subset: what runs in a few minutes on two shared cores
    "cpu": {
        "B": (1, 8),
        "T": (1024, 8192),
        "gqa": ((8, 2), (8, 8)),
        "dtype": ("float32",),
        "compiled": ((1, 1024), (1, 8192), (8, 1024), (8, 8192)),
    },
    # the GPU check's default: the full grid in bf16 (bench/gpu_check.sh)
    "gpu": {
        "B": (1, 8, 32),
        "T": (1024, 8192, 32768),
        "gqa": ((32, 8), (32, 32)),
        "dtype": ("bfloat16",),
        "compiled": ((1, 1024), (1, 8192), (8, 1024), (8, 8192)),
    },
    "full": {
        "B": (1, 8, 32),
        "T": (1024, 8192, 32768),
        "gqa": ((32, 8), (32, 32)),
        "dtype": ("bfloat16", "float32"),
        "compiled": ((1, 1024), (1, 8192), (8, 1024), (8, 8192)),
    },
    "dry": {"B": (2,), "T": (40,), "gqa": ((4, 2),), "dtype": ("float32",), "compiled": ((2, 40),)},
}
PEERS = ("fla one-step", "flash_attn kvcache")
KEPT = 0.25
THETA = 1.0
VARIANTS = ("synthetic", "trained")
TRAINED = Path(__file__).with_name("e4_passkey_fpa_foxinit.safetensors")
TRAINED_MODEL = "fpa_foxinit"  # E4's passkey setting, seed 0
TRAINED_THETA = 16.0  # E4's theta for it at 25%: 27.2% kept at 8x L, every passkey retrieved


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
    q: bool = True,
) -> dict[str, torch.Tensor]:
    """Random q (unless ``q`` is False: a context needs none), k, v, drawn by ``gen`` on its
    device (the CPU's for the CPU grids, the GPU's there: a 32K context of 32 rows is 10^9
    numbers)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=gen.device).to(dev, dtype)

    out = {"q": rand(B, HQ, n, d)} if q else {}
    return out | {"k": rand(B, H, n, d), "v": rand(B, H, n, d)}


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


def _time_pair(
    peer: Any, step: Any, steps: int, device: torch.device
) -> tuple[list[float], list[float]]:
    """Seconds of ``steps`` steps of the peer and of ``step``, in turn (peer, step, peer, ...)
    after one warm-up of each, so that a machine whose speed drifts moves both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(steps + 1):
        for fn, out in ((peer, times[0]), (step, times[1])):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            if i:
                out.append(time.perf_counter() - t0)
    return times


class SDPAPeer:
    """The peer: a preallocated [B, H, T + steps + 1, d] cache, each token written in place and
    attended by ``scaled_dot_product_attention`` (enable_gqa); :meth:`restart` returns it to
    the context of T tokens, so each variant is paired with the same steps of it."""

    def __init__(
        self,
        B: int,
        T: int,
        HQ: int,
        H: int,
        d: int,
        dtype: torch.dtype,
        steps: int,
        device: torch.device,
        gen: torch.Generator,
    ):
        ctx = _tokens(B, HQ, H, T, d, dtype, device, gen, q=False)
        self.K = torch.zeros(B, H, T + steps + 1, d, dtype=dtype, device=device)
        self.V = torch.zeros_like(self.K)
        self.K[:, :, :T], self.V[:, :, :T] = ctx["k"], ctx["v"]
        self.B, self.T, self.HQ, self.H, self.d = B, T, HQ, H, d
        self.dtype, self.device, self.gen, self.steps = dtype, device, gen, steps
        self.t = T
        self.times: list[float] = []  # every paired step's seconds

    def restart(self) -> SDPAPeer:
        self.t = self.T
        return self

    def __call__(self) -> None:
        x = _tokens(self.B, self.HQ, self.H, 1, self.d, self.dtype, self.device, self.gen)
        self.K[:, :, self.t], self.V[:, :, self.t] = x["k"][:, :, 0], x["v"][:, :, 0]
        self.t += 1
        F.scaled_dot_product_attention(
            x["q"], self.K[:, :, : self.t], self.V[:, :, : self.t], enable_gqa=self.HQ != self.H
        )

    def row(self) -> dict[str, Any]:
        return {
            "variant": "sdpa",
            "tokens_per_s": self.B / statistics.median(self.times) if self.times else math.nan,
            "speed_vs_sdpa": 1.0,
        } | self.full_cache()

    def full_cache(self) -> dict[str, Any]:
        """Bytes and fractions of a cache holding every token (at the end of the steps)."""
        held = self.B * self.H * self.K.shape[2] * 2 * self.d * self.K.element_size()
        return {"bytes": held, "kept": 1.0, "stored": 1.0, "paged": 1.0}


def _fla_decoding(dry: bool) -> Any:
    """flash-linear-attention's ``attn_decoding_one_step`` (under the Triton interpreter in a
    dry run, its autotuner cut to one configuration: tuning needs a GPU)."""
    from fla.ops.attn import decoding

    if dry:
        kernel = decoding.naive_attn_decoding_kernel
        tuner = getattr(kernel, "fn", kernel)  # the autotuner under the heuristics
        tuner.configs = tuner.configs[:1]
    return decoding.attn_decoding_one_step


class FlaDecodePeer:
    """fla's one-step decode over the peer's context: the caches of the B rows in one buffer
    [1, B * T_max, H, d], each row at its own offset; the offsets (2B + 1, on the device, moved
    in place) make row i's tokens sequence 2i and the rest of its room sequence 2i + 1 (its
    output unused), so a step writes one token per row and reads nothing back."""

    name = "fla one-step"

    def __init__(self, peer: SDPAPeer, decoding: Any):
        B, Tm, dev = peer.B, peer.K.shape[2], peer.device
        self.peer, self.decoding = peer, decoding
        self.K = peer.K.transpose(1, 2).contiguous()  # [B, T_max, H, d]
        self.V = peer.V.transpose(1, 2).contiguous()
        self.rows = torch.arange(B, device=dev) * Tm
        self.q = torch.zeros(1, 2 * B, peer.HQ, peer.d, dtype=peer.dtype, device=dev)
        self.restart()

    def restart(self) -> None:
        peer = self.peer
        B, Tm = peer.B, self.K.shape[1]
        ends = torch.arange(B + 1, device=peer.device) * Tm
        self.cu = torch.stack([ends[:-1] + peer.T, ends[1:]], 1).flatten()
        self.cu = torch.cat([ends[:1], self.cu])  # 0, T, Tm, Tm + T, 2 Tm, ...
        self.t = torch.full((B,), peer.T, device=peer.device)

    def __call__(self) -> None:
        peer = self.peer
        x = _tokens(peer.B, peer.HQ, peer.H, 1, peer.d, peer.dtype, peer.device, peer.gen)
        at = self.rows + self.t
        self.K.view(-1, peer.H, peer.d)[at] = x["k"][:, :, 0]
        self.V.view(-1, peer.H, peer.d)[at] = x["v"][:, :, 0]
        self.t += 1
        self.cu[1::2] += 1
        self.q[0, ::2] = x["q"][:, :, 0]
        Tm = self.K.shape[1]
        flat = (1, peer.B * Tm, peer.H, peer.d)
        self.decoding(self.q, self.K.view(flat), self.V.view(flat), cu_seqlens=self.cu)


class FlashKVCachePeer:
    """FlashAttention's ``flash_attn_with_kvcache`` over the peer's context: [B, T_max, H, d]
    caches, the new token written in place by the call at ``cache_seqlens``."""

    name = "flash_attn kvcache"

    def __init__(self, peer: SDPAPeer, kvcache: Any):
        self.peer, self.kvcache = peer, kvcache
        self.K = peer.K.transpose(1, 2).contiguous()
        self.V = peer.V.transpose(1, 2).contiguous()
        self.restart()

    def restart(self) -> None:
        peer = self.peer
        self.lens = torch.full((peer.B,), peer.T, dtype=torch.int32, device=peer.device)

    def __call__(self) -> None:
        peer = self.peer
        x = _tokens(peer.B, peer.HQ, peer.H, 1, peer.d, peer.dtype, peer.device, peer.gen)
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))  # [B, 1, heads, d]
        self.kvcache(q, self.K, self.V, k=k, v=v, cache_seqlens=self.lens, causal=True)
        self.lens += 1


def decode_peers(device: torch.device, dry: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """{name: a function peer -> the peer's step} of the peers installed, and {name: why not}
    of the others."""
    found, missing = {}, {}
    try:
        decoding = _fla_decoding(dry)
        if device.type == "cuda" or dry:
            found["fla one-step"] = lambda peer: FlaDecodePeer(peer, decoding)
        else:  # (a Triton kernel: a GPU, or the dry run's interpreter)
            missing["fla one-step"] = f"a Triton GPU kernel, not run on {device}"
    except ImportError as exc:
        missing["fla one-step"] = f"flash-linear-attention not installed ({exc})"
    try:
        from flash_attn import flash_attn_with_kvcache

        if device.type != "cuda":
            missing["flash_attn kvcache"] = f"needs a CUDA device, not {device}"
        else:
            found["flash_attn kvcache"] = lambda peer: FlashKVCachePeer(
                peer, flash_attn_with_kvcache
            )
    except ImportError as exc:
        missing["flash_attn kvcache"] = f"flash-attn not installed ({exc})"
    return found, missing


def bench_peer(peer: SDPAPeer, make: Any) -> dict[str, Any]:
    """A peer's step paired with SDPA's (its own copy of the context, the same draws)."""
    other = make(peer)
    return {"variant": other.name} | _paired(peer, other) | peer.full_cache()


def _paired(peer: SDPAPeer, step: Any) -> dict[str, float]:
    """tokens/s of ``step`` (its median step) and its speed relative to the peer: the median
    over the pairs of (peer's seconds / its seconds)."""
    theirs, ours = _time_pair(peer.restart(), step, peer.steps, peer.device)
    peer.times += theirs
    ratio = statistics.median(a / b for a, b in zip(theirs, ours, strict=True))
    return {"tokens_per_s": peer.B / statistics.median(ours), "speed_vs_sdpa": ratio}


def bench_session(peer: SDPAPeer, mode: str, attention: Any) -> dict[str, Any]:
    """The session at the peer's shapes on the synthetic field ``mode`` (inf, indep, shared)."""
    from attnspec.backends.torch.paged import PagedFPASession

    B, T, HQ, H, d = peer.B, peer.T, peer.HQ, peer.H, peer.d
    dtype, device, gen = peer.dtype, peer.device, peer.gen
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

    name = "fpa inf" if mode == "inf" else f"fpa kept={KEPT} {mode}"
    return {"variant": name} | _paired(peer, step) | _counts(s)


def bench_compiled(peer: SDPAPeer, attention: Any, dry: bool) -> dict[str, Any]:
    """The session at theta = inf decoding with its device step compiled (fullgraph; in a dry
    run by AOT autograd without code generation, to stay quick) and, on CUDA, captured in a
    CUDA graph: value checks off, one reservation for the whole run, so no step reads the host."""
    from attnspec.backends.torch import value_checks
    from attnspec.backends.torch.paged import PagedFPASession

    B, T, HQ, H, d = peer.B, peer.T, peer.HQ, peer.H, peer.d
    dtype, device, gen = peer.dtype, peer.device, peer.gen
    s = PagedFPASession(rows=B, heads=HQ, kv_heads=H, dk=d, dv=d, dtype=dtype, scale=d**-0.5,
                        device=device, attention=attention)  # fmt: skip
    ctx = _tokens(B, HQ, H, T, d, dtype, device, gen, q=False)
    zeros = torch.zeros(B, HQ, T, device=device)
    s.prefill_state(ctx | {"field": zeros, "level": zeros})
    s.decode_step = torch.compile(  # type: ignore[method-assign]
        s.decode_step, fullgraph=True, dynamic=False, **({"backend": "aot_eager"} if dry else {})
    )
    warm = 2
    s.reserve(peer.steps + warm + 1)  # the run's tokens: one shape, one compilation

    def token() -> dict[str, torch.Tensor]:
        x = _tokens(B, HQ, H, 1, d, dtype, device, gen)
        return x | {"field": torch.zeros(B, HQ, 1, device=device), "level": x["q"][..., 0] * 0}

    with value_checks(enabled=False):
        x = token() | {"level": torch.zeros(B, HQ, 1, device=device)}
        side = torch.cuda.Stream() if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for _ in range(warm):  # the compilation, and (CUDA) the warm-up before a capture
                s.decode(x)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                s.decode_step(x["q"], x["k"], x["v"], x["field"], x["level"])

            def step() -> None:
                new = token()
                for name in ("q", "k", "v"):
                    x[name].copy_(new[name])
                graph.replay()
                s._reserved -= 1  # (decode keeps this count; the replay bypasses it)
        else:

            def step() -> None:
                s.decode(token() | {"level": torch.zeros(B, HQ, 1, device=device)})

        row = {"variant": "fpa inf compiled"} | _paired(peer, step)
    s.reserve(0)  # the reserved pages not used, given back before counting
    return row | _counts(s)


def _counts(s: Any) -> dict[str, Any]:
    """The session's kept (per query head, also head by head), stored and paged fractions."""
    counts = s.counts()
    tokens = float(counts["tokens"][0])
    return {
        "bytes": s.bytes_held(),
        "kept": float(counts["live"].double().mean()) / tokens,
        "kept_by_head": (counts["live"].double().mean(0) / tokens).tolist(),
        "stored": float(counts["stored"].double().mean()) / tokens,
        "paged": float(s.pages_held().double().mean()) * s.P / tokens,
    }


def _passkey_config() -> dict[str, Any]:
    from attnspec.experiments import e4

    return dict(e4.SETTINGS["full"]["passkey"])


def train_field(path: Path) -> None:
    """Train E4's passkey model ``TRAINED_MODEL`` (seed 0, its steps) and save its weights, with
    the training's seconds and final loss in the file's metadata."""
    from safetensors.torch import save_file

    from attnspec.experiments import e4, harness

    cfg = _passkey_config()
    wall, cpu = time.perf_counter(), time.process_time()
    model, losses = e4.train_passkey(TRAINED_MODEL, cfg, 0, harness.Progress(), label="e4 model")
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    meta = {
        "model": TRAINED_MODEL,
        "setting": "e4 full passkey",
        "seed": "0",
        "steps": str(cfg["steps"]),
        "final_train_loss": repr(statistics.fmean(losses[-max(1, cfg["steps"] // 20) :])),
        "train_seconds": f"{wall:.1f}",
        "train_cpu_seconds": f"{cpu:.1f}",
        "torch": torch.__version__,
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata=meta)
    print(f"decode bench: {TRAINED_MODEL} trained in {wall:.0f} s ({cpu:.0f} s CPU), {path}")


def trained_model(device: torch.device) -> Any:
    """E4's trained passkey model from ``TRAINED`` (float32, eval mode)."""
    from safetensors.torch import load_file

    from attnspec.experiments import e4

    if not TRAINED.is_file():
        raise ValueError(f"--variants: trained rows need {TRAINED.name}; make it by --train-field")
    model = e4.passkey_model(TRAINED_MODEL, _passkey_config())
    model.load_state_dict(load_file(str(TRAINED)))
    return model.to(device).eval()


@torch.no_grad()
def trained_stream(model: Any, layer: int, B: int, n: int, seed: int) -> dict[str, torch.Tensor]:
    """q, k, v [B, H, n, d] and field, level [B, H, n] (float32) of block ``layer`` of the
    trained model on B passkey sequences of n tokens, the blocks below it decoding with caches
    evicting at TRAINED_THETA (F7), the projections as the layer's session computes them."""
    from attnspec.experiments import e2

    tokens, _ = e2.passkey_sequences(np.random.default_rng(seed), B, n, _passkey_config())
    blocks = model.layers()
    x = model.embed(torch.from_numpy(tokens).to(model.embed.weight.device))
    for block in blocks[:layer]:
        x = block(x, block.fpa().new_cache(theta=TRAINED_THETA))
    mixer = blocks[layer].fpa()
    q, k, v, delta, offset = mixer._projections(blocks[layer].norm1(x), wide_field=True)
    field = torch.cumsum(delta, dim=1)
    out = {"q": q, "k": k, "v": v, "field": field, "level": field + offset}
    return {name: t.transpose(1, 2).contiguous() for name, t in out.items()}


def bench_trained(peer: SDPAPeer, model: Any, layer: int, attention: Any) -> dict[str, Any]:
    """The session on layer ``layer`` of the trained model, at the peer's B, T and dtype."""
    from attnspec.backends.torch.paged import PagedFPASession

    B, T, steps, dtype, device = peer.B, peer.T, peer.steps, peer.dtype, peer.device
    stream = trained_stream(model, layer, B, T + steps + 1, seed=T)
    stream |= {name: stream[name].to(dtype) for name in ("q", "k", "v")}
    _, HQ, _, d = stream["q"].shape
    s = PagedFPASession(
        rows=B,
        heads=HQ,
        kv_heads=stream["k"].shape[1],
        dk=d,
        dv=stream["v"].shape[3],
        dtype=dtype,
        scale=d**-0.5,
        theta=TRAINED_THETA,
        device=device,
        attention=attention,
    )
    s.prefill_state({name: x[:, :, :T] for name, x in stream.items()})
    present = torch.ones(B, 1, dtype=torch.bool, device=device)
    t = [T]

    def step() -> None:
        s.advance({name: x[:, :, t[0] : t[0] + 1] for name, x in stream.items()}, present)
        t[0] += 1

    name = f"fpa trained L{layer + 1} theta={TRAINED_THETA:g}"
    return {"variant": name} | _paired(peer, step) | _counts(s)


def _configs(grid: str, variants: str, device: torch.device) -> list[tuple[dict[str, Any], Any]]:
    """(config, trained model or None) per table group: the synthetic GQA shapes of the grid,
    then the trained layer's shapes."""
    g, d = GRIDS[grid], 64 if grid != "dry" else 16
    out: list[tuple[dict[str, Any], Any]] = []
    for B, T, (HQ, H), dname in itertools.product(g["B"], g["T"], g["gqa"], g["dtype"]):
        if variants in ("all", "synthetic"):
            out.append(({"B": B, "T": T, "HQ": HQ, "H": H, "dtype": dname, "d": d}, None))
    if variants in ("all", "trained"):
        model = trained_model(device)
        mixer = model.layers()[0].fpa()
        HQ, dk = mixer.n_heads, mixer.head_dim
        for B, T, dname in itertools.product(g["B"], g["T"], g["dtype"]):
            out.append(({"B": B, "T": T, "HQ": HQ, "H": HQ, "dtype": dname, "d": dk}, model))
    return out


def run(
    grid: str,
    steps: int,
    device: torch.device,
    attention_name: str,
    variants: str = "all",
    report: dict[str, Any] | None = None,
    out: str | None = None,
    budget: float | None = None,
) -> list[dict[str, Any]]:
    """The rows of every configuration; into ``report`` ("rows", "failures", "skipped"), saved
    to ``out`` after each configuration. A variant that raises is recorded as a failure and
    the run goes on; configurations after ``budget`` seconds are recorded as skipped."""
    if attention_name == "triton":
        from attnspec.backends.torch.triton_decode import paged_attention_triton as attention
    else:
        from attnspec.backends.torch.paged import paged_attention_eager as attention
    report = {"rows": [], "failures": [], "skipped": []} if report is None else report
    dry = grid == "dry"
    peers, missing = decode_peers(device, dry)
    for name, why in missing.items():
        print(f"decode peer {name}: skipped, {why}", flush=True)
    report["peers_skipped"] = missing
    g = GRIDS[grid]
    start = time.perf_counter()
    for config, model in _configs(grid, variants, device):
        if budget is not None and time.perf_counter() - start > budget:
            report["skipped"].append(config)
            continue
        B, T, HQ, H, d = (config[n] for n in ("B", "T", "HQ", "H", "d"))
        dtype = getattr(torch, config["dtype"])
        gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(0)
        peer = SDPAPeer(B, T, HQ, H, d, dtype, steps, device, gen)
        jobs: list[tuple[str, Any]] = []
        for mode in ("inf", "indep", "shared") if model is None else ("inf",):
            if mode == "shared" and HQ == H:
                continue  # the same as indep
            jobs.append((mode, functools.partial(bench_session, peer, mode, attention)))
        first = (HQ, H) == g["gqa"][0] and config["dtype"] == g["dtype"][0]
        if model is None and first and (B, T) in g["compiled"]:
            jobs.append(("compiled", functools.partial(bench_compiled, peer, attention, dry)))
        if model is None:
            jobs += [
                (name, functools.partial(bench_peer, peer, make)) for name, make in peers.items()
            ]
        for layer in range(len(model.layers()) if model is not None else 0):
            job = functools.partial(bench_trained, peer, model, layer, attention)
            jobs.append((f"L{layer + 1}", job))
        results = []
        for name, job in jobs:
            try:
                results.append(job())
            except Exception as exc:  # recorded; the run goes on
                error = f"{type(exc).__name__}: {exc}"[:500]
                report["failures"].append(config | {"variant": name, "error": error})
                print(f"  {name} FAILED: {error}", flush=True)
        results.insert(0, peer.row())
        for r in results:
            r |= config | {"bytes_vs_sdpa": r["bytes"] / results[0]["bytes"]}
            report["rows"].append(r)
            print(_line(r), flush=True)
        _save(report, out)
    return report["rows"]


def _save(report: dict[str, Any], out: str | None) -> None:
    if out:
        with open(out + ".tmp", "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(out + ".tmp", out)


HEADER = (
    f"{'B':>3} {'T':>6} {'HQ:H':>6} {'dtype':>8} {'variant':<24} {'tok/s':>9} "
    f"{'x sdpa':>7} {'MiB':>8} {'x sdpa':>7} {'kept':>6} {'stored':>6} {'paged':>6}"
)


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['B']:>3} {r['T']:>6} {r['HQ']:>3}:{r['H']:<2} {r['dtype']:>8} "
        f"{r['variant']:<24} {r['tokens_per_s']:>9.1f} {r['speed_vs_sdpa']:>7.2f} "
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
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(variants), fontsize=7)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # the legend below, clear of the bars
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention", choices=("eager", "triton"), default="eager")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, Triton interpreted")
    parser.add_argument(
        "--variants", choices=("all", *VARIANTS), default="all", help="which table groups"
    )
    parser.add_argument(
        "--train-field", action="store_true", help=f"train E4's model into {TRAINED.name}"
    )
    parser.add_argument("--out", help="JSON file of the rows")
    parser.add_argument("--budget", type=float, help="seconds; later configurations skipped")
    parser.add_argument("--figure", help="PNG of bytes and speed relative to SDPA")
    args = parser.parse_args(argv)
    if args.train_field:
        torch.set_num_threads(1)  # as the experiments train
        train_field(TRAINED)
        return 0
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.grid, args.steps, args.attention = "dry", 1, "triton"
    device = torch.device(args.device)
    print(
        f"decode bench: grid {args.grid}, {args.attention} attention, device {device}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(HEADER)
    report: dict[str, Any] = {
        "section": "decode",
        "grid": args.grid,
        "attention": args.attention,
        "variants": args.variants,
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "rows": [],
        "failures": [],
        "skipped": [],
    }
    rows = run(
        args.grid, args.steps, device, args.attention, args.variants, report, args.out,
        args.budget,
    )  # fmt: skip
    bad = [
        r
        for r in rows
        if r["variant"].startswith("fpa")
        and r["paged"] * r["T"] > r["stored"] * r["T"] + 16 * (1 + 1e-9)
    ]
    if args.figure:
        figure(rows, args.figure)
    if bad:
        print(f"decode bench: pages above one page of stored entries in {len(bad)} rows")
        return 1
    if report["failures"]:
        print(f"decode bench: {len(report['failures'])} variants failed")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
