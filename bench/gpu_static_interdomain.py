"""Static Hopper gate of the Interdomain Triton kernels, beside flash-linear-attention's chunk_gla.

Every Triton kernel of backends/torch/triton_s4d.py, triton_s4d_bwd.py and triton_legs.py (the
passes of the forward and the backward, and the decode steps) is compiled for sm_90 without a
GPU (bench/sm90.py) exactly as a launch on an H100/H200 compiles it: the launchers themselves
run on CPU tensors at the Hopper blocks (``triton_chunks.DEVICE_BLOCKS["hopper"]``: S4D one
program per 64-token chunk, the chunk one diagonal block in the lag form, the forward's tokens
as columns in slices of 32; LegS programs per 64-token chunk and per position; 8 warps) with
every kernel launch captured instead of run, so the arguments, constexprs, grids and alignment
are the launcher's; the S4D backward takes the forward's saved chunk states and qe, as the
autograd op runs it. The shapes: B = 1, T = 512, H = 16,
M = R = 64, dv = 128, bf16 features, the denominator-free readout; beside the default, the S4D
tilings of :func:`VARIANTS` (chunk-wide loop form, the 16-row programs in the loop form, the
Hopper default before the chunk-wide lag tiling, and in the lag form) and the default with the
ratio readout (:data:`RATIO`; its budgets met are asserted too). The peer is
fla's chunk_gla forward (chunk_gla_fwd) and backward (chunk_gla_bwd, recomputing the states as
its autograd Function does) at the same real state size: GLA key dim K = 2M = 128, V = dv, chunk
64, its launches captured the same way. fla autotunes on the GPU; here each of its autotuned
kernels takes the config nearest to BK = BV = 64, 4 warps, 2 stages (``launches.FLA_CONFIG``).

Printed per kernel: dynamic shared memory, registers, stack bytes per thread, spill instructions
(STL + LDL), tensor-core instruction kinds (wgmma = HGMMA, mma.sync = HMMA, with operand type).
Per token and head, from the captured launch plan (:func:`plan_costs`): tensor-core FLOPs
(2 m n k of every tl.dot a launch executes) and bytes of chunk states moved (stored by the state
passes, read back by the chunk programs), forward and forward + backward, ours against
chunk_gla's; and the bytes per token the backward keeps from the forward besides the inputs
(:func:`kept_per_token`). Budgets (issue's goals): no mma.sync and no spill in any Interdomain
kernel, FLOPs and state bytes per token <= 2x chunk_gla's; only those in :data:`ASSERTED` fail
the gate (exit 1), the others are printed with their measured values.

    python -m bench.gpu_static_interdomain                 # the table (CI: tests/test_gpu_static_*)
    python -m bench.gpu_static_interdomain --json build/gpu_static_interdomain.json
    python -m bench.gpu_static_interdomain --plan-only     # the FLOP / byte model, no compile
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.launches import Captured

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

B, T, H = 1, 512, 16  # per-token costs are per chunk: T = 512 (8 chunks) gives them exactly
M, R, DV = 64, 64, 128
BUDGET_RATIO = 2.0
CHUNK_WIDE = "S4D chunk-wide"  # one program per 64-token chunk, diagonal blocks of 16, loop form
ROWS16 = "S4D 16-row"  # programs of 16 tokens, loop form (the Hopper default before)
ROWS16_LAG = "S4D 16-row lag"  # ... in the lag form
RATIO = "S4D ratio"  # the Hopper default with the ratio readout (a ones channel, den)


def CHUNK_WIDE_BLOCKS() -> Any:
    """The S4D tiling with one program per 64-token chunk and diagonal blocks of 16 tokens
    walked token by token (the loop form); reported beside the default."""
    import dataclasses

    return dataclasses.replace(_hopper(), diagonal="loop", diag_block=16)


def VARIANTS() -> dict[str, Any]:
    """The S4D tilings reported beside the Hopper default (each compiled and modelled): the
    chunk-wide program with diagonal blocks of 16 walked token by token (the loop form), and
    programs of 16 tokens (16-row products, mma.sync) in the loop and lag forms."""
    import dataclasses

    from attnspec.backends.torch.triton_chunks import Blocks

    rows16 = Blocks(64, 16, 8, diagonal="loop", channels=32)
    return {
        CHUNK_WIDE: CHUNK_WIDE_BLOCKS(),
        ROWS16: rows16,
        ROWS16_LAG: dataclasses.replace(rows16, diagonal="lag"),
    }


def _hopper() -> Any:
    from attnspec.backends.torch import triton_chunks

    return triton_chunks.DEVICE_BLOCKS["hopper"]


# Budgets that fail the gate; the rest are reported. (kind, kernel or pass): kinds "no_mma_sync",
# "no_spill" per kernel, "flops" / "state_bytes" per pass ("fwd", "fwd+bwd"). Asserted: those met.
_STATE_PASSES = (
    "_s4d_state_pass",
    "_s4d_reverse_state_pass",
    "_s4d_chunk_grads",
    "_legs_state_pass",
    "_legs_reverse_state_pass",
)
_S4D_CHUNK = (
    "_s4d_query",
    "_s4d_output",
    "_s4d_bwd_query",
    "_s4d_bwd_values",
    "_s4d_bwd_readout",
    "_s4d_bwd_inputs",
)
# LegS's chunk programs, one row per binary (the constexprs that differ between launches)
LEGS_CHUNK = (
    "_legs_front[BD=64]",
    "_legs_front[BD=128]",
    "_legs_positions[ADD0=False]",
    "_legs_positions[ADD0=True]",
    "_legs_back[BD=128, MODE=0]",
    "_legs_back[BD=128, MODE=1]",
    "_legs_back[BD=64, MODE=2]",
    "_legs_bwd_inputs",
)
ASSERTED: set[tuple[str, str]] = (
    # the Hopper default: S4D and LegS wgmma throughout, no spill, state bytes, FLOPs (the S4D
    # forward's tokens as columns; its backward with the forward's saved chunk states and qe)
    {("no_mma_sync", k) for k in (*_STATE_PASSES, *_S4D_CHUNK, *LEGS_CHUNK, "_s4d_step")}
    | {("no_mma_sync", "_legs_step")}
    | {("no_spill", k) for k in (*_STATE_PASSES, *_S4D_CHUNK, *LEGS_CHUNK, "_s4d_step")}
    | {("no_spill", "_legs_step")}
    | {("state_bytes", f"S4D {p}") for p in ("fwd", "fwd+bwd")}
    | {("flops", f"S4D {p}") for p in ("fwd", "fwd+bwd")}
    | {(k, f"LegS {p}") for k in ("flops", "state_bytes") for p in ("fwd", "fwd+bwd")}
    # the ratio readout: wgmma throughout, no spill but in the backward's value side,
    # state bytes, FLOPs (its ones channel takes no product in the state passes)
    | {("flops", f"{RATIO} {p}") for p in ("fwd", "fwd+bwd")}
    | {("no_mma_sync", f"{RATIO}: {k}") for k in (*_STATE_PASSES[:3], *_S4D_CHUNK)}
    | {
        ("no_spill", f"{RATIO}: {k}")
        for k in (*_STATE_PASSES[:3], *_S4D_CHUNK)
        if k != "_s4d_bwd_values"
    }
    | {("state_bytes", f"{RATIO} {p}") for p in ("fwd", "fwd+bwd")}
    # the chunk-wide loop form: wgmma throughout, its forward without spill, forward FLOPs and
    # state bytes
    | {("no_mma_sync", f"{CHUNK_WIDE}: {k}") for k in (*_STATE_PASSES[:3], *_S4D_CHUNK)}
    | {("no_spill", f"{CHUNK_WIDE}: {k}") for k in (*_STATE_PASSES[:3], "_s4d_query")}
    | {("no_spill", f"{CHUNK_WIDE}: _s4d_output"), ("flops", f"{CHUNK_WIDE} fwd")}
    | {("state_bytes", f"{CHUNK_WIDE} {p}") for p in ("fwd", "fwd+bwd")}
    # the 16-row loop form: no spill, FLOPs; the lag form: no spill but in its readout of g(p),
    # FLOPs
    | {("no_spill", f"{ROWS16}: {k}") for k in (*_STATE_PASSES[:3], *_S4D_CHUNK)}
    | {("flops", f"{ROWS16} {p}") for p in ("fwd", "fwd+bwd")}
    | {
        ("no_spill", f"{ROWS16_LAG}: {k}")
        for k in (*_STATE_PASSES[:3], *_S4D_CHUNK)
        if k != "_s4d_bwd_readout"
    }
    | {("flops", f"{ROWS16_LAG} {p}") for p in ("fwd", "fwd+bwd")}
)


def _inputs(dtype: Any, widths: tuple[int, ...], seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, w, generator=g).to(dtype) for w in widths]


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def _s4d_inputs(dtype: str = "bf16") -> tuple[Any, ...]:
    """fq, kt, vt, do [B, T, H, .] in dtype and the S4D parameters [lam, b, c] as (re, im)
    pairs: |Lambda| = 0.9, b = 1, C = I."""
    import numpy as np
    import torch

    fq, kt, vt, do = _inputs(getattr(torch, DTYPES[dtype]), (R, R, DV, DV))
    complex_type = torch.complex128 if dtype == "fp64" else torch.complex64
    lam = 0.9 * np.exp(1j * np.random.default_rng(0).uniform(0, np.pi, (H, M)))
    pair = lambda z: torch.view_as_real(torch.tensor(z, dtype=complex_type))  # noqa: E731
    params = [pair(lam), pair(np.ones((H, M))), pair(np.eye(M)[None].repeat(H, 0))]
    return fq, kt, vt, do, params


def _gla_inputs() -> tuple[Any, ...]:
    """chunk_gla's q, k, v, do (bf16, K = 2M, V = dv) and log-gates g (float32)."""
    import torch
    import torch.nn.functional as F

    q, k, v, do = _inputs(torch.bfloat16, (2 * M, 2 * M, DV, DV))
    g = F.logsigmoid(_inputs(torch.float32, (2 * M,), seed=1)[0]) / 16
    return q, k, v, do, g


def ours(
    blocks: Any = None, variant: str = "", readout: str = "linear", dtype: str = "bf16"
) -> list[Captured]:
    """The launches of the Interdomain launchers at the Hopper blocks (role: fwd, bwd, step),
    or, for a ``variant``, the S4D forward and backward at ``blocks`` with ``readout``."""
    import dataclasses

    from attnspec.backends.torch import triton_chunks, triton_legs, triton_s4d, triton_s4d_bwd
    from bench.launches import capture

    hopper = blocks or triton_chunks.DEVICE_BLOCKS["hopper"]
    fq, kt, vt, do, params = _s4d_inputs(dtype)
    s4d = (fq, kt, vt, *params, readout, None, None)
    legs = (fq, kt, vt, M, None)
    out = []
    kept: list[Any] = []  # the backward takes the forward's saved tensors, as the op runs it
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("fwd", lambda: kept.extend(triton_s4d.s4d_fwd(*s4d, return_saved=True)[2])),
        ("bwd", lambda: triton_s4d_bwd.s4d_bwd(*s4d, do, None, kept)),
        ("fwd", lambda: triton_legs.legs_fwd(*legs)),
        ("bwd", lambda: triton_legs.legs_bwd(*legs, do)),
    ]
    with (
        triton_chunks.block_sizes(**dataclasses.asdict(hopper)),
        capture() as launches,
    ):
        for role, call in calls[:2] if variant else calls:
            n = len(launches)
            call()
            out += [_with_role(c, role, variant) for c in launches[n:]]
        if variant:
            return out
        tok = [x[:, 0] for x in (fq, kt, vt)]
        _, state = triton_s4d.s4d_step(*tok, *params, "linear", None)
        _, legs_state = triton_legs.legs_step(*tok, M, None)
        n = len(launches)
        triton_s4d.s4d_step(*tok, *params, "linear", state)
        triton_legs.legs_step(*tok, M, legs_state)  # a step after the first (FIRST = False)
        out += [_with_role(c, "step") for c in launches[n:]]
    return out


def fla_chunk_gla() -> list[Captured]:
    """The launches of fla's chunk_gla forward and backward at K = 2M, V = dv, chunk 64."""
    from bench.launches import capture, fla_as_on_hopper

    fla_as_on_hopper()
    from fla.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd

    q, k, v, do, g = _gla_inputs()
    scale = (2 * M) ** -0.5
    out = []
    with capture() as launches:
        _, A, _, _, _ = chunk_gla_fwd(q, k, v, g, None, scale, None, False, chunk_size=64)
        out += [_with_role(c, "fwd") for c in launches]
        n = len(launches)
        chunk_gla_bwd(q, k, v, g, None, scale, None, None, A, do, None, chunk_size=64)
        out += [_with_role(c, "bwd") for c in launches[n:]]
    return out


def kept_per_token() -> dict[str, float]:
    """Bytes per token and head that the backward takes from the forward besides the inputs
    (what the autograd op keeps alive between them), at the Hopper blocks, bf16: S4D's saved
    (chunk states, qe), LegS nothing, chunk_gla its attention matrix A (its autograd Function
    saves A and recomputes the states)."""
    import dataclasses

    from attnspec.backends.torch import triton_chunks, triton_s4d
    from bench.launches import capture, fla_as_on_hopper

    fla_as_on_hopper()
    from fla.ops.gla.chunk import chunk_gla_fwd

    fq, kt, vt, _, params = _s4d_inputs()
    q, k, v, _, g = _gla_inputs()
    out = {}
    hopper = triton_chunks.DEVICE_BLOCKS["hopper"]
    with triton_chunks.block_sizes(**dataclasses.asdict(hopper)), capture():
        for name, readout in (("S4D", "linear"), (RATIO, "ratio")):
            saved = triton_s4d.s4d_fwd(fq, kt, vt, *params, readout, None, None, return_saved=True)[
                2
            ]
            out[name] = sum(_size(x) for x in saved) / (B * T * H)
        out["LegS"] = 0.0
        _, A, _, _, _ = chunk_gla_fwd(q, k, v, g, None, (2 * M) ** -0.5, None, False, chunk_size=64)
        out["chunk_gla"] = _size(A) / (B * T * H)
    return out


def _with_role(c: Captured, role: str, impl: str = "") -> Captured:
    c.role = role
    c.impl = impl or _impl(c.name)
    return c


# FLOPs and state bytes from the launch plan


def _size(x: Any) -> int:
    return int(x.numel() * x.element_size()) if hasattr(x, "numel") else 0


def plan_costs(c: Captured) -> tuple[float, float]:
    """(tensor-core FLOPs, chunk-state bytes moved) of one launch, summed over its programs.

    A model of the kernel's code, each term a tl.dot (2 m n k) or a state tile: loops over the
    earlier (or later) sub-chunks of a chunk run (NS - 1) / 2 times on average (NS sub-chunks
    per chunk), the LegS loops over j <= i_s one more; the diagonal's token loop ("loop") runs
    on CUDA cores and is not counted, its "lag" form is matmuls. State bytes: the
    chunk-state tensors a state pass writes (ours ``states``/``dstates``, fla ``h``/``dh``) and
    the tiles of them each chunk program reads. Kernels without tensor-core products or state
    traffic count zero."""
    a, n, name = c.args, c.programs, c.name
    if name.startswith("_s4d") or name.startswith("_legs"):
        return _ours_costs(name, a, c.grid, n)
    return _fla_costs(name, a, c.grid, n)


def _ours_costs(name: str, a: dict[str, Any], grid: tuple[int, ...], n: int) -> tuple[float, float]:
    if name.endswith("_step"):
        return 0.0, 0.0
    if name in ("_legs_front", "_legs_positions", "_legs_back", "_legs_bwd_inputs"):
        return _legs_costs(name, a, n)
    BT, BM = a["BT"], a["BM"]
    if "BS" not in a:  # state passes: grid (N * H, channel blocks), or (chunks, blocks, H)
        BC = a["BC"]
        st = a["states"] if a.get("states") is not None else a["dstates"]  # [chunks, H, ...]
        blocks = n if len(grid) == 3 else st.shape[0] * grid[1] * st.shape[1]  # chunk x block
        step = 4 * BM * BT * BC  # two [BM, BT] x [BT, BC] products (re, im)
        if name == "_s4d_state_pass":
            return blocks * step, _size(a["states"])
        if name == "_s4d_reverse_state_pass":
            return blocks * step, _size(a["dstates"])
        if name == "_s4d_chunk_grads":  # D z^T (re, im); reads S0 and D
            return blocks * step, _size(a["states"]) + _size(a["dstates"])
        legs_step = 2 * BM * BM * BC + 2 * BM * BT * BC  # Phi_e S + K(e, .) z
        if name == "_legs_state_pass":
            return blocks * legs_step, _size(a["states"])
        if name == "_legs_reverse_state_pass":
            return blocks * legs_step, _size(a["dstates"])
        raise NotImplementedError(name)
    BS, BR, BV = a["BS"], a.get("BR", 0), a.get("BV", 0)
    BB = a.get("BB", BS)  # S4D: tokens per diagonal block
    NB, NS = BS // BB, BT // BS
    e_off = NB * (NS - 1) / 2 + NB - 1  # earlier blocks of the chunk per program, on average
    e_adj = BT // BB - 1 - NB * (NS - 1) / 2  # later blocks of the chunk per program
    form = a.get("DIAG", "loop")  # the form of the diagonal blocks (Blocks.diagonal)
    # S0 (or D) tiles read per program: keys M x R, values M x V, the ones column M; complex
    # (two planes) for S4D, real for LegS, in the stored states' dtype
    st = a["states"] if a.get("states") is not None else a["dstates"]
    width = st.element_size() * (2 if name.startswith("_s4d") else 1)
    key, value, ones = (a["M"] * x * width for x in (a["R"], a.get("V", 0), 1))
    ratio = a.get("RATIO", False)
    sq = BS * BS

    def s4d_state(D: int) -> float:  # q S0, q^H S0 or fe D (re, im)
        return 4 * BS * D * BM

    def chunk_sum(D: int, dlam: bool = False) -> float:  # per earlier block: scores, then two
        # [BS, BB] x [BB, BM] (four with the derivative table). The diagonal ("lag"): the scores
        # once and two [BS, BB] x [BB, BM] per table
        off = e_off * (2 * BS * D * BB + (8 if dlam else 4) * BS * BB * BM)
        if form == "lag":
            return off + 2 * sq * D + (1 + dlam) * 4 * BS * BB * BM
        return off

    def readout(D: int, blocks: float) -> float:  # the state part; per block scores and S z;
        # the diagonal's S z with its scores by lag ("lag", two [BS, BM] x [BM, BB])
        base = s4d_state(D) + blocks * (4 * BS * BM * BB + 2 * BS * BB * D)
        if form == "lag":
            return base + 4 * BS * BM * BB + 2 * sq * D
        return base

    mix = 6 * BS * BM * BM  # qe = G p: three [BS, BM] x [BM, BM] (the 3M method)
    cols = a.get("COLS", 0)  # tokens as columns, in slices of cols: slice i reaches the
    reach = cols * cols * (BS // cols) * (BS // cols + 1) // 2 if cols else 0  # (i + 1) cols lags

    if name == "_s4d_query" and cols:  # the scores, then [BM, lags] x [lags, cols] per plane
        per, tile = s4d_state(BR) + 2 * sq * BR + 4 * BM * reach + mix, key
    elif name == "_s4d_query":  # p (keys), qe, den (ones)
        per, tile = s4d_state(BR) + chunk_sum(BR) + mix, key + ratio * ones
    elif name == "_s4d_output" and cols:  # scores by lag, then [BV, keys] x [keys, cols]
        per = s4d_state(BV) + 4 * BS * BM * BS + 2 * BV * reach  # (+ den, no product)
        tile = value + ratio * ones
    elif name == "_s4d_output":  # o (values)
        per, tile = readout(BV, e_off), value
    elif name == "_s4d_bwd_query":  # p, its chunk sum and derivative (, qe: MIX) (, den)
        per, tile = s4d_state(BR) + chunk_sum(BR, dlam=True) + a["MIX"] * mix, key + ratio * ones
    elif name == "_s4d_bwd_values":  # g(qe), its chunk sum and derivative, g(p) (+ x^1)
        per, tile = s4d_state(BV) + chunk_sum(BV, dlam=True) + mix, value + ratio * ones
    elif name == "_s4d_bwd_readout":  # dfq, the readout of g(p) (+ x^1 twice)
        per, tile = readout(BR, e_off), key + ratio * 2 * ones
    elif name == "_s4d_bwd_inputs":  # the transposed gated attention over the later blocks;
        n //= 2  # grid (sub-chunks, H, 2): a key-side and a value-side program per sub-chunk
        per, tile = readout(BR, e_adj) + readout(BV, e_adj), key + value
    else:
        raise NotImplementedError(name)
    return n * per, n * tile


def _legs_costs(name: str, a: dict[str, Any], n: int) -> tuple[float, float]:
    """LegS's chunk programs: per (chunk, head) program with the chunk's BT tokens as rows, or
    per position with the BH heads as columns (_legs_positions)."""
    BT, BM = a["BT"], a["BM"]
    st = a["dstates"] if name == "_legs_bwd_inputs" else a.get("states")
    tile = lambda width: a["M"] * width * st.element_size() if st is not None else 0  # noqa: E731
    if name == "_legs_front":  # y = x S0^T, a = x z^T
        BD = a["BD"]
        return n * (2 * BT * BD * BM + 2 * BT * BT * BD), n * tile(a["W"])
    if name == "_legs_positions":  # Phi y + K a, then Phi^T p and K^T p
        return n * 2 * a["BH"] * (2 * BM * BM + 2 * BM * BT), 0.0
    if name == "_legs_back":  # hat S0 + c z
        BD = a["BD"]
        return n * (2 * BT * BM * BD + 2 * BT * BT * BD), n * tile(a["W"])
    if name == "_legs_bwd_inputs":  # K(e, .) D + c^T zq, keys and values
        width = a["BR"] + a["BV"]
        return n * (2 * BT * BM * width + 2 * BT * BT * width), n * tile(a["R"] + a["V"])
    raise NotImplementedError(name)


def _fla_costs(name: str, a: dict[str, Any], grid: tuple[int, ...], n: int) -> tuple[float, float]:
    """fla's chunk_gla kernels (fla/ops/gla/chunk.py, fla/ops/common/chunk_h.py), per chunk of
    BT tokens and head, times the chunks: the same counting as :func:`_ours_costs`."""
    if "cumsum" in name or name.endswith("_sub_intra"):
        return 0.0, 0.0  # cumulative sums; the token loop of the diagonal sub-blocks
    BT, K = a["BT"], a.get("K", 0)
    V = a.get("V", DV)
    chunks = a["B"] if "B" in a else 1
    chunks *= -(-a["T"] // BT) * a["H"]
    NC = BT // a.get("BC", 16)
    pairs = NC * (NC - 1) // 2  # sub-block pairs below the diagonal
    BC = BT // NC
    h = lambda x: K * V * x.element_size() if x is not None else 0  # noqa: E731  one state
    kv = 2 * BT * K * V  # one [BT, K] x [K, V]-sized product
    if name == "chunk_fwd_kernel_h":  # h += k^T v, stored before every chunk
        per, moved = kv, h(a["h"])
    elif name == "chunk_bwd_kernel_dh":  # dh += q^T do
        per, moved = kv, h(a["dh"])
    elif name == "chunk_gla_fwd_A_kernel_intra_sub_inter":  # q k^T of the sub-block pairs
        per, moved = pairs * 2 * BC * BC * K, 0
    elif name == "chunk_gla_fwd_kernel_o":  # q h + A v
        per, moved = kv + 2 * BT * BT * V, h(a["h"])
    elif name == "chunk_gla_bwd_kernel_dv":  # A^T do + k dh
        per, moved = 2 * BT * BT * V + kv, h(a["dh"])
    elif name == "chunk_gla_bwd_kernel_dA":  # do v^T
        per, moved = 2 * BT * BT * V, 0
    elif name == "chunk_gla_bwd_kernel_intra":  # dq and dk over the sub-block pairs
        per, moved = 2 * pairs * 2 * BC * BC * K, 0
    elif name == "chunk_gla_bwd_kernel_inter":  # do h^T and v dh^T
        per, moved = 2 * kv, h(a["h"]) + h(a["dh"])
    else:
        raise NotImplementedError(name)
    return chunks * per, chunks * moved


# Compile, tabulate, check


_MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync)\.\S*?\.(f16|bf16|tf32|f64|e4m3|e5m2|s8)\b")


def mma_kinds(ptx: str) -> list[str]:
    """Tensor-core instruction kinds in the PTX: "wgmma bf16", "mma.sync tf32", ..."""
    kinds = {f"{'wgmma' if m.group(1).startswith('wgmma') else 'mma.sync'} {m.group(2)}"
             for m in _MMA.finditer(ptx)}  # fmt: skip
    return sorted(kinds)


@dataclass
class Row:
    impl: str  # "S4D", "LegS" or "chunk_gla"
    kernel: str
    roles: list[str]
    warps: int
    stages: int
    shared: int = -1
    registers: int = -1
    stack: int = -1
    spills: int = -1  # STL + LDL instructions
    mma: list[str] = field(default_factory=list)
    hgmma: int = 0
    hmma: int = 0
    seconds: float = 0.0
    error: str = ""


def _impl(name: str) -> str:
    return "S4D" if name.startswith("_s4d") else "LegS" if name.startswith("_legs") else "chunk_gla"


def _constexprs(c: Captured) -> dict[str, Any]:
    return {p.name: c.args.get(p.name) for p in c.fn.params if p.is_constexpr}


def binary_names(launches: list[Captured]) -> list[str]:
    """The row name of each launch: the kernel's name, followed by the constexprs that differ
    between its launches when it is launched with more than one set (one binary each):
    ``_legs_back[BD=128, MODE=0]``."""
    sets: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in launches:
        sets.setdefault((c.impl, c.name), []).append(_constexprs(c))
    out = []
    for c in launches:
        seen = sets[c.impl, c.name]
        differ = sorted(k for k in seen[0] if len({repr(x[k]) for x in seen}) > 1)
        tag = ", ".join(f"{k}={_constexprs(c)[k]}" for k in differ)
        out.append(f"{c.name}[{tag}]" if tag else c.name)
    return out


def compile_rows(launches: list[Captured]) -> list[Row]:
    """One row per binary: the first launch of each kernel and set of constexprs (the state
    passes run in the forward and again in the backward with the same constexprs)."""
    from bench import sm90

    rows: dict[tuple[str, str], Row] = {}
    names = binary_names(launches)
    for c, name in zip(launches, names, strict=True):
        if (c.impl, name) in rows:
            if c.role not in rows[c.impl, name].roles:
                rows[c.impl, name].roles.append(c.role)
            continue
        row = Row(c.impl, name, [c.role], c.num_warps, c.num_stages)
        rows[c.impl, name] = row
        if "cumsum" in c.name:
            row.error = "skipped (no products)"
            continue
        t0 = time.perf_counter()
        try:
            compiled = sm90.compile_launch(c.launch)
            rep = sm90.analyse(compiled, c.name)
        except Exception as exc:  # report every kernel, then fail
            row.error = str(exc).strip().splitlines()[-1][:160]
            continue
        row.seconds = time.perf_counter() - t0
        row.shared, row.registers, row.stack = rep.shared, rep.registers, rep.stack
        row.spills = sum(rep.spills)
        row.hgmma, row.hmma = rep.hgmma, rep.hmma
        row.mma = mma_kinds(compiled.asm["ptx"])
    return list(rows.values())


def pass_costs(launches: list[Captured], tokens: int) -> dict[str, dict[str, float]]:
    """{"fwd" | "fwd+bwd": {"flops": ..., "state_bytes": ...}} per token and head."""
    out = {p: {"flops": 0.0, "state_bytes": 0.0} for p in ("fwd", "fwd+bwd")}
    for c in launches:
        if c.role == "step":
            continue
        flops, moved = plan_costs(c)
        for p in ("fwd", "fwd+bwd") if c.role == "fwd" else ("fwd+bwd",):
            out[p]["flops"] += flops / tokens
            out[p]["state_bytes"] += moved / tokens
    return out


def report(
    rows: list[Row],
    costs: dict[str, dict[str, dict[str, float]]],
    asserted: set[tuple[str, str]] = ASSERTED,
) -> list[str]:
    """Print the table and the budgets; returns the failed asserted budgets."""
    from bench import sm90

    print(f"{'kernel':<48} {'pass':<7} {'w/s':>4} {'shared B':>9} {'reg':>4} {'stack':>5} "
          f"{'spill':>5}  tensor cores")  # fmt: skip
    for r in rows:
        head = f"{r.impl + ' ' + r.kernel:<48} {'/'.join(r.roles):<7} {r.warps}/{r.stages:<2}"
        if r.error:
            print(f"{head} {r.error}")
            continue
        kinds = ", ".join(r.mma) or "none"
        print(f"{head} {r.shared:>9} {r.registers:>4} {r.stack:>5} {r.spills:>5}  {kinds} "
              f"(HGMMA {r.hgmma}, HMMA {r.hmma})")  # fmt: skip
    print(f"\nper token and head, from the launch plan (B = {B}, T = {T}, H = {H}, M = R = {M}, "
          f"dv = {DV}; chunk_gla K = {2 * M}):")  # fmt: skip
    print(f"{'':<18} {'pass':<8} {'tensor-core FLOPs':>18} {'state bytes':>12}")
    for impl, per_pass in costs.items():
        for p, c in per_pass.items():
            print(f"{impl:<18} {p:<8} {c['flops']:>18,.0f} {c['state_bytes']:>12,.0f}")
    failed = []
    checks = budgets(rows, costs)
    print(f"\nbudgets (asserted: {sorted(asserted) or 'none'}):")
    for (kind, what), (ok, text) in checks.items():
        mark = "ok" if ok else ("FAIL" if (kind, what) in asserted else "not met")
        print(f"  {kind:<12} {what:<28} {text:<40} {mark}")
        if not ok and (kind, what) in asserted:
            failed.append(f"{kind} {what}")
    for r in rows:
        if r.error and not r.error.startswith("skipped"):
            failed.append(f"compile {r.kernel}")
        elif r.shared > sm90.SHARED_LIMIT:
            failed.append(f"shared memory {r.kernel}")
    return failed


def budgets(
    rows: list[Row], costs: dict[str, dict[str, dict[str, float]]]
) -> dict[tuple[str, str], tuple[bool, str]]:
    """Every budget of the issue with its measured value: (met, description)."""
    out = {}
    for r in rows:
        if r.impl == "chunk_gla" or r.error:
            continue
        what = r.kernel if r.impl in ("S4D", "LegS") else f"{r.impl}: {r.kernel}"
        out[("no_mma_sync", what)] = (r.hmma == 0, f"HMMA {r.hmma}")
        out[("no_spill", what)] = (r.spills == 0 and r.stack == 0,
                                   f"STL+LDL {r.spills}, stack {r.stack} B")  # fmt: skip
    for impl in (i for i in costs if i != "chunk_gla"):
        for p in ("fwd", "fwd+bwd"):
            peer = costs["chunk_gla"][p]
            for key in ("flops", "state_bytes"):
                ratio = costs[impl][p][key] / peer[key]
                out[(key, f"{impl} {p}")] = (ratio <= BUDGET_RATIO, f"{ratio:.2f}x chunk_gla")
    return out


def interpreter_counts() -> list[tuple[Captured, float, float]]:
    """Our launchers run under Triton's interpreter at the Hopper blocks and the chunk-wide S4D
    tiling (B = H = 1, T = 128, M = R = 64, dv = 128, both readouts), counting what each launch
    executes: 2 m n k per tl.dot and the bytes of ``states``/``dstates`` its masked loads and
    stores touch.
    Returns (launch, FLOPs, state bytes) per launch, to check :func:`plan_costs` against."""
    import dataclasses
    import inspect

    import numpy as np
    import torch
    from triton.runtime import interpreter

    from attnspec.backends.torch import triton_chunks, triton_legs, triton_s4d, triton_s4d_bwd
    from bench.launches import Captured

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreter_counts: set TRITON_INTERPRET=1 before triton is imported")
    builder, grid_executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved = (builder.create_dot, builder.create_masked_load, builder.create_masked_store)
    saved_call = grid_executor.__call__
    now = {"flops": 0.0, "bytes": 0.0, "ranges": []}
    out: list[tuple[Captured, float, float]] = []

    def state_bytes(ptrs: Any, mask: Any) -> float:
        addr = np.broadcast_to(ptrs.data, np.shape(mask.data)).astype(np.uint64)
        hit = np.zeros(addr.shape, dtype=bool)
        for lo, hi in now["ranges"]:
            hit |= (addr >= lo) & (addr < hi)
        return float((hit & mask.data).sum() * (ptrs.get_element_ty().primitive_bitwidth // 8))

    def dot(self: Any, a: Any, b: Any, *rest: Any) -> Any:
        now["flops"] += 2.0 * a.data.shape[-2] * a.data.shape[-1] * b.data.shape[-1]
        return saved[0](self, a, b, *rest)

    def load(self: Any, ptrs: Any, mask: Any, *rest: Any) -> Any:
        now["bytes"] += state_bytes(ptrs, mask)
        return saved[1](self, ptrs, mask, *rest)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *rest: Any) -> Any:
        now["bytes"] += state_bytes(ptrs, mask)
        return saved[2](self, ptrs, value, mask, *rest)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        names = inspect.getfullargspec(self.fn).args
        bound = dict(zip(names, args, strict=False)) | {
            k: v for k, v in kwargs.items() if k in names
        }
        grid = self.grid(bound) if callable(self.grid) else self.grid
        now["flops"], now["bytes"] = 0.0, 0.0
        now["ranges"] = [
            (x.data_ptr(), x.data_ptr() + _size(x))
            for k in ("states", "dstates") if isinstance(x := bound.get(k), torch.Tensor)
        ]  # fmt: skip
        result = saved_call(self, *args, **kwargs)
        launch = Captured(self.fn, bound, tuple(int(g) for g in grid), 0, 0)
        out.append((launch, now["flops"], now["bytes"]))
        return result

    builder.create_dot, builder.create_masked_load, builder.create_masked_store = dot, load, store
    grid_executor.__call__ = call
    try:
        hopper = triton_chunks.DEVICE_BLOCKS["hopper"]
        g = torch.Generator().manual_seed(0)
        fq, kt, vt, do = (torch.randn(1, 128, 1, w, generator=g) for w in (R, R, DV, DV))
        lam = torch.view_as_real(0.9 * torch.exp(1j * torch.rand(1, M, generator=g)))
        b = torch.view_as_real(torch.ones(1, M, dtype=torch.complex64))
        c = torch.view_as_real(torch.eye(M, dtype=torch.complex64)[None])
        for blocks in (hopper, *(b for b in VARIANTS().values() if b != hopper)):
            with triton_chunks.block_sizes(**dataclasses.asdict(blocks)):
                for readout in ("linear", "ratio"):
                    args = (fq.abs(), kt.abs(), vt, lam, b, c, readout, None, None)
                    kept = triton_s4d.s4d_fwd(*args, return_saved=True)[2]
                    triton_s4d_bwd.s4d_bwd(*args, do, None, kept)
                    triton_s4d_bwd.s4d_bwd(*args, do, None)  # recomputing what saved holds
                if blocks is hopper:
                    triton_legs.legs_fwd(fq.abs(), kt.abs(), vt, M, None)
                    triton_legs.legs_bwd(fq.abs(), kt.abs(), vt, M, None, do)
    finally:
        builder.create_dot, builder.create_masked_load, builder.create_masked_store = saved
        grid_executor.__call__ = saved_call
    return out


def check_plan() -> int:
    """:func:`plan_costs` against :func:`interpreter_counts`, launch by launch (exact)."""
    bad = 0
    print(
        f"{'launch':<28} {'FLOPs model':>14} {'counted':>14} {'state B model':>14} {'counted':>10}"
    )
    for launch, flops, moved in interpreter_counts():
        want = plan_costs(launch)
        ok = want == (flops, moved)
        bad += not ok
        print(f"{launch.name:<28} {want[0]:>14,.0f} {flops:>14,.0f} {want[1]:>14,.0f} "
              f"{moved:>10,.0f} {'ok' if ok else 'DIFFERS'}")  # fmt: skip
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write rows and per-token costs to this file")
    parser.add_argument("--plan-only", action="store_true", help="the FLOP/byte model only")
    parser.add_argument("--no-peer", action="store_true", help="skip compiling chunk_gla")
    parser.add_argument(
        "--no-variant", action="store_true", help="skip the S4D tilings beside the default"
    )
    parser.add_argument("--kernels", default="", help="compile only kernels matching this regex")
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="input dtype (the budgets are asserted at bf16; other dtypes: compile and shared "
        "memory only, our kernels at the Hopper blocks, both readouts)",
    )
    parser.add_argument(
        "--report-budgets",
        action="store_true",
        help="print the spill budgets without asserting them (a Triton other than the CI pin: "
        "the compile, the shared-memory limit, wgmma and the FLOP/byte model still fail)",
    )
    parser.add_argument(
        "--check-plan",
        action="store_true",
        help="check the FLOP/byte model against counts under the interpreter (TRITON_INTERPRET=1)",
    )
    args = parser.parse_args(argv)
    if args.check_plan:
        return check_plan()
    os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, before triton is imported
    t0 = time.perf_counter()
    variants = {k: (b, "linear") for k, b in VARIANTS().items() if b != _hopper()}
    if args.dtype != "bf16":  # the default and the ratio readout, no peer
        variants, args.no_peer = {}, True
    variants[RATIO] = (_hopper(), "ratio")  # beside the default
    mine = ours(dtype=args.dtype) + [
        c for name, (b, ro) in variants.items() for c in ours(b, name, ro, args.dtype)
    ]
    peer = fla_chunk_gla()
    tokens = B * T * H
    costs = {
        impl: pass_costs([c for c in mine + peer if c.impl == impl], tokens)
        for impl in ("S4D", *variants, "LegS", "chunk_gla")
    }
    chosen = [
        c
        for c in mine + ([] if args.no_peer else peer)
        if re.search(args.kernels, c.name) and not (args.no_variant and c.impl in variants)
    ]
    rows = [] if args.plan_only else compile_rows(chosen)
    print(f"== Interdomain static Hopper gate (sm_90, {args.dtype}; launches captured in "
          f"{time.perf_counter() - t0:.0f} s)")  # fmt: skip
    asserted = ASSERTED if args.dtype == "bf16" else set()
    if args.report_budgets:
        asserted = {a for a in asserted if a[0] != "no_spill"}
    failed = report(rows, costs, asserted)
    kept = kept_per_token()
    print("\nkept from the forward for the backward besides the inputs, B per token and head: "
          + ", ".join(f"{k} {v:,.0f}" for k, v in kept.items()))  # fmt: skip
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"rows": [r.__dict__ for r in rows], "per_token": costs, "kept": kept,
                       "budgets": {f"{k[0]} {k[1]}": v for k, v in budgets(rows, costs).items()}},
                      f, indent=1)  # fmt: skip
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
