"""Triton kernels for Interdomain Attention: the chunked S4D core and the chunked LegS projection.

Both variants are two-pass linear-time kernels in the layout ``[B, T, H, D]`` (varlen: B = 1 and
``cu_seqlens``), registered in :mod:`attnspec.backends.torch.dispatch` as impl ``"triton"``:

1. a state pass, sequential over chunks of ``chunk`` tokens (64 on a GPU), one program per
   (sequence, head, channel block), storing the state before every chunk;
2. an output pass, one program per sub-chunk of ``sub_chunk`` tokens (16), that reads the state
   before its chunk and adds the interactions with the earlier tokens of the chunk.

S4D (spec/interdomain.md (I11)-(I13)). With p_t = x^K_t fq_t (M modes) the readout is
o_t = Re(p_t^H C^H C x^V_t), so C is folded into the query side once per token:
qe_t = G p_t with G = C^H C (M x M per head), and o_t = Re(qe_t^H x^V_t). Both p_t and o_t are
then gated linear attentions with the per-mode gate Lambda and key b, computed as in a GLA
kernel: inside a chunk the decay Lambda^(t-u) of a pair in different sub-chunks is split at the
start n of the query sub-chunk, Lambda^(t-n) Lambda^(n-u), both exponents >= 0; pairs inside one
sub-chunk take Lambda^(t-u) directly. Every power comes from a per-head table Lambda^k,
k = 0..chunk, built on the host in complex128, so nothing overflows for |Lambda| near 0 or 1.
Complex products Re(a^H b) are real matmuls [a_re, a_im] . [b_re, b_im].

The backward runs the same two passes in reverse. For a real loss and complex z write
g(z) = dL/dRe z + i dL/dIm z; with gx_t the adjoint of x_t (gx_t = gd_t + conj(Lambda) gx_{t+1}):
g(qe_t) = x^V_t do_t and g(p_t) = G g(qe_t) are again chunked gated sums; g(G) = sum g(qe) p^H,
g(C) = C (g(G) + g(G)^H); g(b) = sum_t gx_t z_t and g(Lambda) = sum_t <x_{t-1}, gx_t> split
into the parts inside a chunk (output pass, with the derivative table k Lambda^(k-1)) and the
parts that cross a chunk border (reverse state pass).

LegS ((I4)-(I6)). The exact steps c_n = E_n c_{n-1} + F_n f_n are time-varying, so the kernels
read products of the cached steps per chunk from position tables (float64 on the host):
Phi_n = E_n ... E_{n0} (the transition from the state before the chunk starting at n0) and
K(n, j) = E_n ... E_{j+1} F_j for n0 <= j <= n. The readout is the ratio (I3) with eta = e_0
exactly (I6): den_n = p_n[0]. Diagonalising A is no alternative: the condition number of its
eigenvector matrix is 8e10 at M = 16, 1e23 at M = 32 and 3e47 at M = 64 (computed exactly in
the tests).

Decode: :func:`s4d_step` and :func:`legs_step` advance a fixed-size state by one token (the
LegS state carries the token count n, since E_n depends on it).

Precision: inputs in their dtype (bf16 / fp16 / fp32 / fp64), converted right after loading;
states, tables and accumulation in float32 (float64 for float64 inputs); tl.dot in 3xTF32 for
float32 inputs, TF32 for half inputs. Deterministic: no atomics; per-program partial sums are
reduced by the launcher in a fixed order. Tile sizes: :class:`Blocks`, per device, overridable
with :func:`block_sizes`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from attnspec.reference import hippo

from . import dispatch

__all__ = [
    "Blocks",
    "LegsState",
    "block_sizes",
    "legs_bwd",
    "legs_chunk_tables",
    "legs_fwd",
    "legs_step",
    "s4d_bwd",
    "s4d_fwd",
    "s4d_step",
]

# --------------------------------------------------------------------------------------------
# Block sizes


@dataclass(frozen=True)
class Blocks:
    """Tile sizes: ``chunk`` tokens per state-pass step, ``sub_chunk`` tokens per output program
    (both powers of two, sub_chunk <= chunk; at least 16 on a GPU, where tl.dot needs it).

    ``diag_loop`` walks the pairs inside a sub-chunk token by token with [BS, M] tiles, as
    on a GPU; the interpreter default uses whole-chunk sub-chunks and [BS, BS, M] tiles, which
    cost it far fewer operations. ``channels``: state channels per state-pass program (at most;
    a power of two >= 16). On sm_90 (compiled on CPU for a GPUTarget, M = 64, R = 64, dv = 128,
    bf16) 8 warps keep the output-pass kernels free of register spills but for ~800 bytes per
    thread in the backward, and 32 channels keep the state passes free of them."""

    chunk: int = 64
    sub_chunk: int = 16
    num_warps: int = 8
    diag_loop: bool = True  # pairs inside a sub-chunk token by token (else as [BS, BS, M] tiles)
    channels: int = 32


# Per device capability; anything else takes the default. The interpreter counts operations,
# not registers: whole chunks per program and wide channel blocks run fastest there.
DEVICE_BLOCKS = {(9, 0): Blocks(), (8, 0): Blocks()}
INTERPRETER_BLOCKS = Blocks(64, 64, 4, diag_loop=False, channels=64)
_override: list[Blocks] = []


@contextmanager
def block_sizes(
    chunk: int, sub_chunk: int, diag_loop: bool = True, num_warps: int = 4, channels: int = 64
) -> Iterator[None]:
    """Force the tile sizes inside the block (tests use small chunks in the interpreter)."""
    for name, value in (("chunk", chunk), ("sub_chunk", sub_chunk)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value}")
    if sub_chunk > chunk:
        raise ValueError(f"sub_chunk: expected at most chunk = {chunk}, got {sub_chunk}")
    _override.append(Blocks(chunk, sub_chunk, num_warps, diag_loop, channels))
    try:
        yield
    finally:
        _override.pop()


def _blocks(device: torch.device) -> Blocks:
    if _override:
        return _override[-1]
    if device.type == "cuda":
        return DEVICE_BLOCKS.get(torch.cuda.get_device_capability(device), Blocks())
    return INTERPRETER_BLOCKS


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _acc(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype, str]:
    """Accumulation dtype (torch, triton) and tl.dot precision for inputs of ``dtype``."""
    if dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    # fp32 inputs: 3xTF32 keeps fp32 accuracy on tensor cores; half inputs: one TF32 pass.
    return torch.float32, tl.float32, "tf32x3" if dtype == torch.float32 else "tf32"


# --------------------------------------------------------------------------------------------
# Sequences, chunks and sub-chunks (host side)


class Layout(NamedTuple):
    """Flat token axis split into sequences, chunks and sub-chunks.

    cu: (N + 1,) int32 sequence offsets; chunk_offsets: (N + 1,) int32 first global chunk of each
    sequence; chunk_info: (n_chunks, 2) int32 (start token, end token) of every chunk;
    sub_info: (NS, 5) int32 rows (chunk start token, chunk end token, global chunk, sub-chunk
    index, position of the chunk start in its sequence) for every output program.
    """

    cu: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_info: torch.Tensor
    sub_info: torch.Tensor
    N: int
    n_chunks: int
    n_sub: int
    max_len: int


_LAYOUTS: dict[tuple[tuple[int, ...], int, int, str], Layout] = {}


def _layout(cu_list: list[int], chunk: int, sub_chunk: int, device: torch.device) -> Layout:
    """The :class:`Layout` of sequences with offsets ``cu_list`` (cached: the host loop and the
    copies to the device run once per shape)."""
    key = (tuple(cu_list), chunk, sub_chunk, str(device))
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = _build_layout(cu_list, chunk, sub_chunk, device)
    return _LAYOUTS[key]


def _build_layout(cu_list: list[int], chunk: int, sub_chunk: int, device: torch.device) -> Layout:
    offsets: list[int] = [0]
    chunks: list[tuple[int, int]] = []
    info: list[tuple[int, int, int, int, int]] = []
    for n in range(len(cu_list) - 1):
        bos, eos = cu_list[n], cu_list[n + 1]
        for k in range(-(-(eos - bos) // chunk)):
            t0 = bos + k * chunk
            t1 = min(t0 + chunk, eos)
            g = offsets[-1] + k
            chunks.append((t0, t1))
            info.extend((t0, t1, g, i, t0 - bos) for i in range(-(-(t1 - t0) // sub_chunk)))
        offsets.append(offsets[-1] + -(-(eos - bos) // chunk))
    to = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    lengths = [b - a for a, b in itertools.pairwise(cu_list)]
    return Layout(
        to(cu_list),
        to(offsets),
        to(chunks).reshape(-1, 2),
        to(info).reshape(-1, 5),
        len(cu_list) - 1,
        offsets[-1],
        len(info),
        max(lengths),
    )


def _sequences(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> list[int]:
    """Sequence offsets on the flat token axis of x [B, T, ...] as a Python list."""
    B, T = x.shape[:2]
    if cu_seqlens is None:
        return [i * T for i in range(B + 1)]
    if B != 1:
        raise ValueError(f"{name}: with cu_seqlens expected batch size B = 1, got B = {B}")
    if cu_seqlens.ndim != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"cu_seqlens: expected a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
            f"of shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.device != x.device:
        raise ValueError(f"cu_seqlens: expected device {x.device}, got {cu_seqlens.device}")
    cu = cu_seqlens.tolist()
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b <= a for a, b in itertools.pairwise(cu)):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing offsets from 0 to T = {T}, got {cu}"
        )
    return cu


def _check_inputs(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    widths: Sequence[int | None] | None = None,
) -> None:
    """Same device, a floating dtype shared by all, [B, T, H, *] with matching B, T, H."""
    ref = tensors[0]
    if ref.ndim != 4:
        raise ValueError(f"{names[0]}: expected [B, T, H, D], got shape {tuple(ref.shape)}")
    if ref.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ValueError(f"{names[0]}: expected a floating dtype, got {ref.dtype}")
    if ref.shape[1] < 1:
        raise ValueError(f"{names[0]}: expected T >= 1, got shape {tuple(ref.shape)}")
    for name, x, width in zip(names, tensors, widths or [None] * len(names), strict=True):
        if x.device != ref.device:
            raise ValueError(
                f"{name}: expected device {ref.device} (as {names[0]}), got {x.device}"
            )
        if x.dtype != ref.dtype:
            raise ValueError(f"{name}: expected dtype {ref.dtype} (as {names[0]}), got {x.dtype}")
        expected = (*ref.shape[:3], width if width is not None else x.shape[-1])
        if x.ndim != 4 or tuple(x.shape) != expected:
            raise ValueError(f"{name}: expected shape {expected}, got {tuple(x.shape)}")


def _check_param(name: str, x: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (re, im last), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device}, got {x.device}")
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name}: expected float32 or float64, got {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name}: contains NaN or Inf")


# --------------------------------------------------------------------------------------------
# S4D: tables of powers and the Gram matrix (host side)


def _power_tables(
    lam: torch.Tensor, chunk: int, BM: int, acc: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lambda^k and k Lambda^(k-1) for k = 0..chunk, as [H, 2, chunk + 2, BM] (re, im planes).

    Built by a complex128 running product, so Lambda = 0 gives exact zeros (0^0 = 1) and no
    power is ever formed with a negative exponent. Row chunk + 1 and the modes beyond M are
    zero: kernels send masked pairs there.
    """
    lam_c = torch.view_as_complex(lam.to(torch.float64).contiguous())  # (H, M)
    H, M = lam_c.shape
    pw = torch.ones(H, chunk + 1, M, dtype=torch.complex128, device=lam.device)
    pw[:, 1:] = torch.cumprod(lam_c[:, None, :].expand(H, chunk, M), dim=1)
    k = torch.arange(1, chunk + 1, device=lam.device, dtype=torch.float64)
    dpw = torch.zeros_like(pw)
    dpw[:, 1:] = k[None, :, None] * pw[:, :-1]  # d/dLambda Lambda^k
    tables = []
    for x in (pw, dpw):
        t = torch.zeros(H, 2, chunk + 2, BM, dtype=acc, device=lam.device)
        t[:, 0, : chunk + 1, :M] = x.real.to(acc)
        t[:, 1, : chunk + 1, :M] = x.imag.to(acc)
        tables.append(t)
    return tables[0], tables[1]


def _gram(c: torch.Tensor, BM: int, acc: torch.dtype) -> torch.Tensor:
    """G = C^H C per head as [H, 2, BM, BM] (re, im planes, zero-padded)."""
    c_c = torch.view_as_complex(c.to(torch.float64).contiguous())
    G = c_c.conj().transpose(-1, -2) @ c_c
    H, M = G.shape[:2]
    out = torch.zeros(H, 2, BM, BM, dtype=acc, device=c.device)
    out[:, 0, :M, :M] = G.real.to(acc)
    out[:, 1, :M, :M] = G.imag.to(acc)
    return out


# --------------------------------------------------------------------------------------------
# S4D: kernels


@triton.jit
def _channel_block(
    i_c: tl.tensor, NKB: tl.tensor, R: tl.tensor, V: tl.tensor, BC: tl.constexpr
) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The state columns of channel block i_c: the first NKB blocks hold the R key-path channels,
    the next ones the V value channels. Returns (index within its input, column of the state
    [R + V], mask)."""
    o_c = tl.arange(0, BC)
    if i_c < NKB:
        c_loc = i_c * BC + o_c
        c_st = c_loc
        m_c = c_loc < R
    else:
        c_loc = (i_c - NKB) * BC + o_c
        c_st = R + c_loc
        m_c = c_loc < V
    return c_loc, c_st, m_c


@triton.jit
def _pow_at(
    tab: tl.tensor, k: tl.tensor, o_m: tl.tensor, TAB: tl.constexpr, BM: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """(re, im) of the table entry Lambda^k of each mode (k broadcast against o_m)."""
    off = k * BM + o_m
    return tl.load(tab + off), tl.load(tab + TAB + off)


@triton.jit
def _rows(
    src: tl.tensor,
    tok: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    W: tl.tensor,
    o_d: tl.tensor,
    m_t: tl.tensor,
    ACC: tl.constexpr,
) -> tl.tensor:
    """Rows tok of a [T, H, W] tensor, head i_h, columns o_d (zero outside), in ACC."""
    ptr = src + (tok.to(tl.int64)[:, None] * H + i_h) * W + o_d[None, :]
    return tl.load(ptr, mask=m_t[:, None] & (o_d < W)[None, :], other=0.0).to(ACC)


@triton.jit
def _store_rows(
    dst: tl.tensor,
    x: tl.tensor,
    tok: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    W: tl.tensor,
    o_d: tl.tensor,
    m_t: tl.tensor,
) -> None:
    """Store x into rows tok of a [T, H, W] tensor, head i_h, columns o_d (the mirror of
    ``_rows``), in the tensor's dtype."""
    ptr = dst + (tok.to(tl.int64)[:, None] * H + i_h) * W + o_d[None, :]
    tl.store(ptr, x.to(dst.dtype.element_ty), mask=m_t[:, None] & (o_d < W)[None, :])


@triton.jit
def _modes_rows(
    buf: tl.tensor, tok: tl.tensor, i_h: tl.tensor, H: tl.tensor, m_t: tl.tensor, BM: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """Rows tok of a per-token mode buffer [T, H, 2, BM]: (re, im) [BS, BM]."""
    ptr = buf + (tok.to(tl.int64)[:, None] * H + i_h) * 2 * BM + tl.arange(0, BM)[None, :]
    return (
        tl.load(ptr, mask=m_t[:, None], other=0.0),
        tl.load(ptr + BM, mask=m_t[:, None], other=0.0),
    )


@triton.jit
def _store_modes(
    buf: tl.tensor,
    re: tl.tensor,
    im: tl.tensor,
    tok: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    m_t: tl.tensor,
    BM: tl.constexpr,
) -> None:
    ptr = buf + (tok.to(tl.int64)[:, None] * H + i_h) * 2 * BM + tl.arange(0, BM)[None, :]
    tl.store(ptr, re, mask=m_t[:, None])
    tl.store(ptr + BM, im, mask=m_t[:, None])


@triton.jit
def _state_tile(
    s0: tl.tensor,
    c_off: tl.tensor,
    W: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TRANS: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Channels c_off..c_off+W of a state [M, C, 2]: (re, im) [BM, BD], or [BD, BM] if TRANS."""
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    if TRANS:
        ptr = s0 + (o_m[None, :] * C + c_off + o_d[:, None]) * 2
        mask = (o_d < W)[:, None] & (o_m < M)[None, :]
    else:
        ptr = s0 + (o_m[:, None] * C + c_off + o_d[None, :]) * 2
        mask = (o_m < M)[:, None] & (o_d < W)[None, :]
    return tl.load(ptr, mask=mask, other=0.0), tl.load(ptr + 1, mask=mask, other=0.0)


@triton.jit
def _ones_state(
    s0: tl.tensor,
    c_one: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BM: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The ones channel x^1 of a state [M, C, 2] (zeros without the ratio readout)."""
    o_m = tl.arange(0, BM)
    s1_re = tl.zeros([BM], dtype=ACC)
    s1_im = tl.zeros([BM], dtype=ACC)
    if RATIO:
        s1_re = tl.load(s0 + (o_m * C + c_one) * 2, mask=o_m < M, other=0.0).to(ACC)
        s1_im = tl.load(s0 + (o_m * C + c_one) * 2 + 1, mask=o_m < M, other=0.0).to(ACC)
    return s1_re, s1_im


@triton.jit
def _s4d_mix(
    p_re: tl.tensor, p_im: tl.tensor, g_h: tl.tensor, BM: tl.constexpr, PREC: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """qe_t = G p_t for every row t, i.e. P G^T, G = C^H C of this head ([2, BM, BM] planes)."""
    o_m = tl.arange(0, BM)
    ptr = g_h + o_m[None, :] * BM + o_m[:, None]  # [n, m] holds G[m, n]
    gt_re = tl.load(ptr)
    gt_im = tl.load(ptr + BM * BM)
    re = tl.dot(p_re, gt_re, input_precision=PREC) - tl.dot(p_im, gt_im, input_precision=PREC)
    im = tl.dot(p_re, gt_im, input_precision=PREC) + tl.dot(p_im, gt_re, input_precision=PREC)
    return re, im


@triton.jit
def _s4d_modes(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    b_re: tl.tensor,
    b_im: tl.tensor,
    fi_re: tl.tensor,
    fi_im: tl.tensor,
    fs_re: tl.tensor,
    fs_im: tl.tensor,
    fd_re: tl.tensor,
    fd_im: tl.tensor,
    dfi_re: tl.tensor,
    dfi_im: tl.tensor,
    dfs_re: tl.tensor,
    dfs_im: tl.tensor,
    dfd_re: tl.tensor,
    dfd_im: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    n_i: tl.tensor,
    i_s: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    dden: tl.tensor,
    s1_re: tl.tensor,
    s1_im: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DERIV: tl.constexpr,
    ONES: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """p_t = x_t q_t over the channels [c_off, c_off + W) of the state, for the rows of one
    sub-chunk: p_t = Lambda^(t-t0+1) (S0 q_t) + b sum_{t0<=u<=t} Lambda^(t-u) (q_t . z_u).

    b_q: [BS, BD] rows q_t; src: the inputs z_u ([T, H, W]); s0: the state before the chunk;
    fi = Lambda^(t-t0+1), fs = Lambda^(t-n) (n the sub-chunk start) [BS, BM]; fd =
    Lambda^(t-u) for the pairs of the sub-chunk [BS, BS, BM] (zero unless t >= u and u is a
    token; unused with DIAG_LOOP); df* their derivatives. ONES appends the constant-ones
    channel (state column c_off + W, cotangent dden per row).
    Returns p, the chunk sum without b, and with DERIV the derivative dp/dLambda at fixed S0
    (zeros otherwise), each (re, im) [BS, BM].
    """
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    s_re, s_im = _state_tile(s0, c_off, W, C, M, BD, BM, True)
    y_re = tl.dot(b_q, s_re.to(ACC), input_precision=PREC)  # S0 q_t [BS, BM]
    y_im = tl.dot(b_q, s_im.to(ACC), input_precision=PREC)
    if ONES:
        y_re += dden[:, None] * s1_re[None, :]
        y_im += dden[:, None] * s1_im[None, :]
    # Earlier sub-chunks: Lambda^(t-u) = Lambda^(t-n) Lambda^(n-u), both exponents >= 0.
    a0_re = tl.zeros([BS, BM], dtype=ACC)
    a0_im = tl.zeros([BS, BM], dtype=ACC)
    a1_re = tl.zeros([BS, BM], dtype=ACC)
    a1_im = tl.zeros([BS, BM], dtype=ACC)
    for j in range(0, i_s):
        tok_u = t0 + j * BS + o_s
        b_k = _rows(src, tok_u, i_h, H, W, o_d, tok_u < n_i, ACC)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # q_t . z_u [BS, BS]
        if ONES:
            a += dden[:, None]
        wk_re, wk_im = _pow_at(pw, (n_i - tok_u)[:, None], o_m[None, :], TAB, BM)
        a0_re += tl.dot(a, wk_re, input_precision=PREC)
        a0_im += tl.dot(a, wk_im, input_precision=PREC)
        if DERIV:
            wk_re, wk_im = _pow_at(dpw, (n_i - tok_u)[:, None], o_m[None, :], TAB, BM)
            a1_re += tl.dot(a, wk_re, input_precision=PREC)
            a1_im += tl.dot(a, wk_im, input_precision=PREC)
    t_re = fs_re * a0_re - fs_im * a0_im
    t_im = fs_re * a0_im + fs_im * a0_re
    d_re = fs_re * a1_re - fs_im * a1_im + dfs_re * a0_re - dfs_im * a0_im
    d_im = fs_re * a1_im + fs_im * a1_re + dfs_re * a0_im + dfs_im * a0_re
    # This sub-chunk, pair by pair.
    if DIAG_LOOP:
        for u in range(0, BS):
            tok_u = n_i + u
            m_u = o_d < tl.where(tok_u < t1, W, 0)
            z_u = tl.load(src + (tok_u.to(tl.int64) * H + i_h) * W + o_d, mask=m_u, other=0.0)
            a_u = tl.sum(b_q * z_u.to(ACC)[None, :], axis=1)  # q_t . z_u [BS]
            if ONES:
                a_u += tl.where(tok_u < t1, dden, 0.0)
            k_u = tl.where(o_s >= u, o_s - u, BT + 1)[:, None]
            w_re, w_im = _pow_at(pw, k_u, o_m[None, :], TAB, BM)
            t_re += a_u[:, None] * w_re
            t_im += a_u[:, None] * w_im
            if DERIV:
                w_re, w_im = _pow_at(dpw, k_u, o_m[None, :], TAB, BM)
                d_re += a_u[:, None] * w_re
                d_im += a_u[:, None] * w_im
    else:
        b_k = _rows(src, n_i + o_s, i_h, H, W, o_d, m_t, ACC)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        if ONES:
            a += dden[:, None]
        t_re += tl.sum(a[:, :, None] * fd_re, axis=1)
        t_im += tl.sum(a[:, :, None] * fd_im, axis=1)
        if DERIV:
            d_re += tl.sum(a[:, :, None] * dfd_re, axis=1)
            d_im += tl.sum(a[:, :, None] * dfd_im, axis=1)
    p_re = fi_re * y_re - fi_im * y_im + b_re[None, :] * t_re - b_im[None, :] * t_im
    p_im = fi_re * y_im + fi_im * y_re + b_re[None, :] * t_im + b_im[None, :] * t_re
    if DERIV:
        d_re, d_im = (
            dfi_re * y_re - dfi_im * y_im + b_re[None, :] * d_re - b_im[None, :] * d_im,
            dfi_re * y_im + dfi_im * y_re + b_re[None, :] * d_im + b_im[None, :] * d_re,
        )
    return p_re, p_im, t_re, t_im, d_re, d_im


@triton.jit
def _s4d_readout(
    q_re: tl.tensor,
    q_im: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    pw: tl.tensor,
    b_re: tl.tensor,
    b_im: tl.tensor,
    fi_re: tl.tensor,
    fi_im: tl.tensor,
    fs_re: tl.tensor,
    fs_im: tl.tensor,
    bd_re: tl.tensor,
    bd_im: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    n_i: tl.tensor,
    i_s: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    s1_re: tl.tensor,
    s1_im: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    ONES: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """out_t[c] = Re(q_t^H x_t[:, c]) over the channels [c_off, c_off + W) of the state, for the
    rows of one sub-chunk; with ONES also den_t = Re(q_t^H x^1_t) of the ones channel.

    x_t = Lambda^(t-t0+1) S0 + sum_{t0<=u<=t} b Lambda^(t-u) z_u, so the chunk part is a gated
    attention with scores S[t, u] = Re(sum_m conj(q_t[m]) b_m Lambda_m^(t-u)); bd = b fd
    (unused with DIAG_LOOP). Returns out [BS, BD], den [BS].
    """
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    qd_re = q_re * fi_re + q_im * fi_im  # q conj(Lambda^(t-t0+1))
    qd_im = q_im * fi_re - q_re * fi_im
    s_re, s_im = _state_tile(s0, c_off, W, C, M, BD, BM, False)
    out = tl.dot(qd_re, s_re.to(ACC), input_precision=PREC)
    out += tl.dot(qd_im, s_im.to(ACC), input_precision=PREC)
    den = tl.zeros([BS], dtype=ACC)
    if ONES:
        den = tl.sum(qd_re * s1_re[None, :] + qd_im * s1_im[None, :], axis=1)
    qf_re = q_re * fs_re + q_im * fs_im
    qf_im = q_im * fs_re - q_re * fs_im
    for j in range(0, i_s):
        tok_u = t0 + j * BS + o_s
        w_re, w_im = _pow_at(pw, (n_i - tok_u)[:, None], o_m[None, :], TAB, BM)
        wk_re = b_re[None, :] * w_re - b_im[None, :] * w_im
        wk_im = b_re[None, :] * w_im + b_im[None, :] * w_re
        s = tl.dot(qf_re, tl.trans(wk_re), input_precision=PREC)
        s += tl.dot(qf_im, tl.trans(wk_im), input_precision=PREC)  # [BS, BS]
        out += tl.dot(s, _rows(src, tok_u, i_h, H, W, o_d, tok_u < n_i, ACC), input_precision=PREC)
        if ONES:
            den += tl.sum(s, axis=1)
    if DIAG_LOOP:
        for u in range(0, BS):
            tok_u = n_i + u
            m_u = o_d < tl.where(tok_u < t1, W, 0)
            z_u = tl.load(src + (tok_u.to(tl.int64) * H + i_h) * W + o_d, mask=m_u, other=0.0)
            k_u = tl.where(o_s >= tl.where(tok_u < t1, u, BS), o_s - u, BT + 1)[:, None]
            w_re, w_im = _pow_at(pw, k_u, o_m[None, :], TAB, BM)
            wk_re = b_re[None, :] * w_re - b_im[None, :] * w_im
            wk_im = b_re[None, :] * w_im + b_im[None, :] * w_re
            s_u = tl.sum(q_re * wk_re + q_im * wk_im, axis=1)  # S[:, u]
            out += s_u[:, None] * z_u.to(ACC)[None, :]
            if ONES:
                den += s_u
    else:
        s = tl.sum(q_re[:, None, :] * bd_re + q_im[:, None, :] * bd_im, axis=2)
        out += tl.dot(s, _rows(src, n_i + o_s, i_h, H, W, o_d, m_t, ACC), input_precision=PREC)
        if ONES:
            den += tl.sum(s, axis=1)
    return out, den


@triton.jit
def _s4d_adjoint_inputs(
    q_buf: tl.tensor,
    zsrc: tl.tensor,
    W: tl.tensor,
    d_st: tl.tensor,
    c_off: tl.tensor,
    pw: tl.tensor,
    b_re: tl.tensor,
    b_im: tl.tensor,
    fe_re: tl.tensor,
    fe_im: tl.tensor,
    bu_re: tl.tensor,
    bu_im: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    j_s: tl.tensor,
    tok: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """dz_t[c] = Re(sum_m conj(b_m) gx_t[m, c]) for the rows t of one sub-chunk, with the
    adjoint gx_t = conj(Lambda)^(e-t) D + sum_{t<=s<=e} conj(Lambda)^(s-t) q_s zq_s^T.

    q_buf: [T, H, 2, BM] rows q_s; zsrc: [T, H, W] rows zq_s; d_st: D, the adjoint entering the
    chunk's last token e = t1 - 1 from later tokens; fe = b Lambda^(e-t) [BS, BM];
    bu[t, s] = b Lambda^(s-t) for s >= t in this sub-chunk [BS, BS, BM] (unused with
    DIAG_LOOP). Returns dz [BS, BD].
    """
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    d_re, d_im = _state_tile(d_st, c_off, W, C, M, BD, BM, False)
    dz = tl.dot(fe_re, d_re.to(ACC), input_precision=PREC)
    dz += tl.dot(fe_im, d_im.to(ACC), input_precision=PREC)
    # Later sub-chunks i: Lambda^(s-t) = Lambda^(s-n) Lambda^(n-t), n the start of sub-chunk i.
    for i in range(j_s + 1, tl.cdiv(t1 - t0, BS)):
        n_i = t0 + i * BS
        tok_s = n_i + o_s
        m_s = tok_s < t1
        q_re, q_im = _modes_rows(q_buf, tok_s, i_h, H, m_s, BM)
        w_re, w_im = _pow_at(pw, o_s[:, None], o_m[None, :], TAB, BM)
        qf_re = q_re * w_re + q_im * w_im
        qf_im = q_im * w_re - q_re * w_im
        w_re, w_im = _pow_at(pw, (n_i - tok)[:, None], o_m[None, :], TAB, BM)
        wk_re = b_re[None, :] * w_re - b_im[None, :] * w_im
        wk_im = b_re[None, :] * w_im + b_im[None, :] * w_re
        st = tl.dot(wk_re, tl.trans(qf_re), input_precision=PREC)
        st += tl.dot(wk_im, tl.trans(qf_im), input_precision=PREC)  # [BS (t), BS (s)]
        dz += tl.dot(st, _rows(zsrc, tok_s, i_h, H, W, o_d, m_s, ACC), input_precision=PREC)
    if DIAG_LOOP:
        n_j = t0 + j_s * BS
        for s in range(0, BS):
            tok_s = n_j + s
            m_s = tok_s < t1
            p_q = q_buf + (tok_s.to(tl.int64) * H + i_h) * 2 * BM + o_m
            q_re = tl.load(p_q, mask=o_m < tl.where(m_s, BM, 0), other=0.0)
            q_im = tl.load(p_q + BM, mask=o_m < tl.where(m_s, BM, 0), other=0.0)
            k_s = tl.where(o_s <= tl.where(m_s, s, -1), s - o_s, BT + 1)[:, None]
            w_re, w_im = _pow_at(pw, k_s, o_m[None, :], TAB, BM)
            wk_re = b_re[None, :] * w_re - b_im[None, :] * w_im
            wk_im = b_re[None, :] * w_im + b_im[None, :] * w_re
            st_s = tl.sum(q_re[None, :] * wk_re + q_im[None, :] * wk_im, axis=1)  # [BS (t)]
            p_z = zsrc + (tok_s.to(tl.int64) * H + i_h) * W + o_d
            z_s = tl.load(p_z, mask=o_d < tl.where(m_s, W, 0), other=0.0)
            dz += st_s[:, None] * z_s.to(ACC)[None, :]
    else:
        q_re, q_im = _modes_rows(q_buf, tok, i_h, H, m_t, BM)
        st = tl.sum(q_re[None, :, :] * bu_re + q_im[None, :, :] * bu_im, axis=2)
        dz += tl.dot(st, _rows(zsrc, tok, i_h, H, W, o_d, m_t, ACC), input_precision=PREC)
    return dz


@triton.jit
def _s4d_state_pass(
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    h0: tl.tensor,
    states: tl.tensor,
    ht: tl.tensor,
    cu: tl.tensor,
    chunk_offsets: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    CV: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    USE_H0: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I11) chunk by chunk: store the state before each chunk, then
    x_e = Lambda^L x_{t0-1} + sum_u b Lambda^(e-u) z_u (one [BM, BT] x [BT, BC] matmul pair).
    Grid (channel blocks, N * H); blocks < NKB hold key channels, the rest value channels
    (and the ones channel of the ratio readout)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = _channel_block(i_c, NKB, R, CV, BC)
    p_hm = (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = m_m[:, None] & m_c[None, :]
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=m_m, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=m_m, other=0.0).to(ACC)
    pw_h = pw + i_h * 2 * TAB
    s_re = tl.zeros([BM, BC], dtype=ACC)
    s_im = tl.zeros([BM, BC], dtype=ACC)
    if USE_H0:
        p_h0 = h0 + i_nh.to(tl.int64) * M * C * 2 + p_hm
        s_re = tl.load(p_h0, mask=m_hm, other=0.0).to(ACC)
        s_im = tl.load(p_h0 + 1, mask=m_hm, other=0.0).to(ACC)
    for k in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        p_st = states + ((g0 + k) * H + i_h).to(tl.int64) * M * C * 2 + p_hm
        tl.store(p_st, s_re, mask=m_hm)
        tl.store(p_st + 1, s_im, mask=m_hm)
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            z = _rows(kt, tok, i_h, H, R, c_loc, m_t, ACC)
        else:
            z = _rows(vt, tok, i_h, H, V, c_loc, m_t, ACC)
            if RATIO:
                z = tl.where(m_t[:, None] & (c_loc == V)[None, :], 1.0, z)
        w_re, w_im = _pow_at(pw_h, tl.maximum(L - 1 - o_t, 0)[None, :], o_m[:, None], TAB, BM)
        wb_re = b_re[:, None] * w_re - b_im[:, None] * w_im  # b Lambda^(e-u)
        wb_im = b_re[:, None] * w_im + b_im[:, None] * w_re
        d_re, d_im = _pow_at(pw_h, L, o_m, TAB, BM)  # Lambda^L
        s_re, s_im = (
            d_re[:, None] * s_re - d_im[:, None] * s_im,
            d_re[:, None] * s_im + d_im[:, None] * s_re,
        )
        s_re += tl.dot(wb_re, z, input_precision=PREC)
        s_im += tl.dot(wb_im, z, input_precision=PREC)
    p_ht = ht + i_nh.to(tl.int64) * M * C * 2 + p_hm
    tl.store(p_ht, s_re, mask=m_hm)
    tl.store(p_ht + 1, s_im, mask=m_hm)


@triton.jit
def _s4d_output(
    fq: tl.tensor,
    kt: tl.tensor,
    vt: tl.tensor,
    o: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    sub_info: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I12)-(I13) for the rows of one sub-chunk: p_t = x^K_t fq_t, qe_t = G p_t,
    o_t = Re(qe_t^H x^V_t), divided by Re(qe_t^H x^1_t) for the ratio readout.
    Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    i_s = tl.load(sub_info + i_p * 5 + 3)
    n_i = t0 + i_s * BS
    o_s = tl.arange(0, BS)
    tok = n_i + o_s
    m_t = tok < t1
    o_m = tl.arange(0, BM)
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=o_m < M, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=o_m < M, other=0.0).to(ACC)
    pw_h = pw + i_h * 2 * TAB
    s0 = states + (g * H + i_h).to(tl.int64) * M * C * 2
    # Decays of this sub-chunk, shared by both stages; masked pairs read the zero row BT + 1.
    fi_re, fi_im = _pow_at(pw_h, (tok - t0 + 1)[:, None], o_m[None, :], TAB, BM)
    fs_re, fs_im = _pow_at(pw_h, o_s[:, None], o_m[None, :], TAB, BM)
    fd_re, fd_im, bd_re, bd_im = fi_re, fi_im, fi_re, fi_im  # only read as [BS, BS, BM] tiles
    if not DIAG_LOOP:
        lag = o_s[:, None] - o_s[None, :]
        k_d = tl.where((lag >= 0) & m_t[None, :], lag, BT + 1)
        fd_re, fd_im = _pow_at(pw_h, k_d[:, :, None], o_m[None, None, :], TAB, BM)
        bd_re = b_re[None, None, :] * fd_re - b_im[None, None, :] * fd_im
        bd_im = b_re[None, None, :] * fd_im + b_im[None, None, :] * fd_re
    b_q = _rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p_re, p_im, _, _, _, _ = _s4d_modes(
        b_q, kt, R, s0, 0, pw_h, pw_h, b_re, b_im,
        fi_re, fi_im, fs_re, fs_im, fd_re, fd_im, fi_re, fi_im, fs_re, fs_im, fd_re, fd_im,
        t0, t1, n_i, i_s, m_t, i_h, H, C, M, b_re, b_re, b_re,
        BT, BS, BR, BM, TAB, False, False, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    qe_re, qe_im = _s4d_mix(p_re, p_im, gmat + i_h * 2 * BM * BM, BM, PREC)  # (I12) C folded in
    s1_re, s1_im = _ones_state(s0, R + V, C, M, BM, RATIO, ACC)
    out, den = _s4d_readout(
        qe_re, qe_im, vt, V, s0, R, pw_h, b_re, b_im, fi_re, fi_im, fs_re, fs_im, bd_re, bd_im,
        t0, t1, n_i, i_s, m_t, i_h, H, C, M, s1_re, s1_im,
        BT, BS, BV, BM, TAB, RATIO, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    if RATIO:
        out = out / tl.where(m_t, den, 1.0)[:, None]  # (I13) ratio readout
    o_v = tl.arange(0, BV)
    _store_rows(o, out, tok, i_h, H, V, o_v, m_t)


@triton.jit
def _s4d_bwd_modes(
    fq: tl.tensor,
    kt: tl.tensor,
    vt: tl.tensor,
    do: tl.tensor,
    states: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    b: tl.tensor,
    gmat: tl.tensor,
    sub_info: tl.tensor,
    p_buf: tl.tensor,
    qe_buf: tl.tensor,
    gq_buf: tl.tensor,
    gp_buf: tl.tensor,
    dnum_buf: tl.tensor,
    dden_buf: tl.tensor,
    dfq: tl.tensor,
    glam_part: tl.tensor,
    gb_part: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """Backward through the readout for the rows of one sub-chunk. Recomputes p, qe (and num,
    den for the ratio readout: dnum = do / den, dden = -<do, o> / den), then
    g(qe_t) = x^V_t dnum_t (+ x^1_t dden_t), g(p_t) = G g(qe_t), dfq_t = Re(x^K_t^H g(p_t)),
    and the chunk-internal parts of g(Lambda) and g(b) summed over the rows."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    i_s = tl.load(sub_info + i_p * 5 + 3)
    n_i = t0 + i_s * BS
    o_s = tl.arange(0, BS)
    tok = n_i + o_s
    m_t = tok < t1
    o_m = tl.arange(0, BM)
    o_v = tl.arange(0, BV)
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=o_m < M, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=o_m < M, other=0.0).to(ACC)
    pw_h = pw + i_h * 2 * TAB
    dpw_h = dpw + i_h * 2 * TAB
    g_h = gmat + i_h * 2 * BM * BM
    s0 = states + (g * H + i_h).to(tl.int64) * M * C * 2
    k_i = (tok - t0 + 1)[:, None]
    fi_re, fi_im = _pow_at(pw_h, k_i, o_m[None, :], TAB, BM)
    fs_re, fs_im = _pow_at(pw_h, o_s[:, None], o_m[None, :], TAB, BM)
    dfi_re, dfi_im = _pow_at(dpw_h, k_i, o_m[None, :], TAB, BM)
    dfs_re, dfs_im = _pow_at(dpw_h, o_s[:, None], o_m[None, :], TAB, BM)
    fd_re, fd_im, dfd_re, dfd_im, bd_re, bd_im = fi_re, fi_im, fi_re, fi_im, fi_re, fi_im
    if not DIAG_LOOP:
        lag = o_s[:, None] - o_s[None, :]
        k_d = tl.where((lag >= 0) & m_t[None, :], lag, BT + 1)[:, :, None]
        fd_re, fd_im = _pow_at(pw_h, k_d, o_m[None, None, :], TAB, BM)
        dfd_re, dfd_im = _pow_at(dpw_h, k_d, o_m[None, None, :], TAB, BM)
        bd_re = b_re[None, None, :] * fd_re - b_im[None, None, :] * fd_im
        bd_im = b_re[None, None, :] * fd_im + b_im[None, None, :] * fd_re
    b_q = _rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p_re, p_im, pt_re, pt_im, pd_re, pd_im = _s4d_modes(
        b_q, kt, R, s0, 0, pw_h, dpw_h, b_re, b_im,
        fi_re, fi_im, fs_re, fs_im, fd_re, fd_im, dfi_re, dfi_im, dfs_re, dfs_im, dfd_re, dfd_im,
        t0, t1, n_i, i_s, m_t, i_h, H, C, M, b_re, b_re, b_re,
        BT, BS, BR, BM, TAB, True, False, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    qe_re, qe_im = _s4d_mix(p_re, p_im, g_h, BM, PREC)
    s1_re, s1_im = _ones_state(s0, R + V, C, M, BM, RATIO, ACC)
    dnum = _rows(do, tok, i_h, H, V, o_v, m_t, ACC)
    dden = tl.zeros([BS], dtype=ACC)
    if RATIO:
        num, den = _s4d_readout(
            qe_re, qe_im, vt, V, s0, R, pw_h, b_re, b_im, fi_re, fi_im, fs_re, fs_im, bd_re,
            bd_im, t0, t1, n_i, i_s, m_t, i_h, H, C, M, s1_re, s1_im,
            BT, BS, BV, BM, TAB, True, DIAG_LOOP, ACC, PREC,
        )  # fmt: skip
        den = tl.where(m_t, den, 1.0)
        dnum = dnum / den[:, None]
        dden = -tl.sum(dnum * num, axis=1) / den  # -<do, o> / den
        _store_rows(dnum_buf, dnum, tok, i_h, H, V, o_v, m_t)
        tl.store(dden_buf + tok.to(tl.int64) * H + i_h, dden, mask=m_t)
    gq_re, gq_im, gqt_re, gqt_im, gqd_re, gqd_im = _s4d_modes(
        dnum, vt, V, s0, R, pw_h, dpw_h, b_re, b_im,
        fi_re, fi_im, fs_re, fs_im, fd_re, fd_im, dfi_re, dfi_im, dfs_re, dfs_im, dfd_re, dfd_im,
        t0, t1, n_i, i_s, m_t, i_h, H, C, M, dden, s1_re, s1_im,
        BT, BS, BV, BM, TAB, True, RATIO, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    gp_re, gp_im = _s4d_mix(gq_re, gq_im, g_h, BM, PREC)  # G^H = G
    dq, _ = _s4d_readout(
        gp_re, gp_im, kt, R, s0, 0, pw_h, b_re, b_im, fi_re, fi_im, fs_re, fs_im, bd_re, bd_im,
        t0, t1, n_i, i_s, m_t, i_h, H, C, M, s1_re, s1_im,
        BT, BS, BR, BM, TAB, False, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    o_r = tl.arange(0, BR)
    _store_rows(dfq, dq, tok, i_h, H, R, o_r, m_t)
    _store_modes(p_buf, p_re, p_im, tok, i_h, H, m_t, BM)
    _store_modes(qe_buf, qe_re, qe_im, tok, i_h, H, m_t, BM)
    _store_modes(gq_buf, gq_re, gq_im, tok, i_h, H, m_t, BM)
    _store_modes(gp_buf, gp_re, gp_im, tok, i_h, H, m_t, BM)
    # g(Lambda) += g(p) conj(dp/dLambda) + qe conj(d g(qe)/dLambda); g(b) += the same with the
    # chunk sums without b (rows outside the sequence are zero throughout).
    gl_re = tl.sum(gp_re * pd_re + gp_im * pd_im + qe_re * gqd_re + qe_im * gqd_im, axis=0)
    gl_im = tl.sum(gp_im * pd_re - gp_re * pd_im + qe_im * gqd_re - qe_re * gqd_im, axis=0)
    gb_re = tl.sum(gp_re * pt_re + gp_im * pt_im + qe_re * gqt_re + qe_im * gqt_im, axis=0)
    gb_im = tl.sum(gp_im * pt_re - gp_re * pt_im + qe_im * gqt_re - qe_re * gqt_im, axis=0)
    p_part = (i_p * H + i_h).to(tl.int64) * 2 * BM + o_m
    tl.store(glam_part + p_part, gl_re)
    tl.store(glam_part + p_part + BM, gl_im)
    tl.store(gb_part + p_part, gb_re)
    tl.store(gb_part + p_part + BM, gb_im)


@triton.jit
def _s4d_reverse_state_pass(
    fq: tl.tensor,
    dnum: tl.tensor,
    dden: tl.tensor,
    qe_buf: tl.tensor,
    gp_buf: tl.tensor,
    pw: tl.tensor,
    dht: tl.tensor,
    dstates: tl.tensor,
    dh0: tl.tensor,
    cu: tl.tensor,
    chunk_offsets: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    CV: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    USE_DHT: tl.constexpr,
    STORE_DH0: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The adjoint state, chunk by chunk from the last: store D_k (the adjoint entering the
    last token of chunk k from later tokens), then D_{k-1} = conj(Lambda)^L D_k +
    sum_s conj(Lambda)^(s-t0+1) q_s zq_s^T, with (q, zq) = (g(p), fq) on key channels and
    (qe, [dnum, dden]) on value channels; D_{-1} is the gradient of the initial state.
    Grid as the forward state pass."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = _channel_block(i_c, NKB, R, CV, BC)
    p_hm = (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    pw_h = pw + i_h * 2 * TAB
    d_re = tl.zeros([BM, BC], dtype=ACC)
    d_im = tl.zeros([BM, BC], dtype=ACC)
    if USE_DHT:
        p_dht = dht + i_nh.to(tl.int64) * M * C * 2 + p_hm
        d_re = tl.load(p_dht, mask=m_hm, other=0.0).to(ACC)
        d_im = tl.load(p_dht + 1, mask=m_hm, other=0.0).to(ACC)
    NT = tl.cdiv(eos - bos, BT)
    for kk in range(0, NT):
        k = NT - 1 - kk
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        off = ((g0 + k) * H + i_h).to(tl.int64) * M * C * 2 + p_hm
        tl.store(dstates + off, d_re, mask=m_hm)
        tl.store(dstates + off + 1, d_im, mask=m_hm)
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            zq = _rows(fq, tok, i_h, H, R, c_loc, m_t, ACC)
            q_re, q_im = _modes_rows(gp_buf, tok, i_h, H, m_t, BM)
        else:
            zq = _rows(dnum, tok, i_h, H, V, c_loc, m_t, ACC)
            if RATIO:
                zd = tl.load(dden + tok.to(tl.int64) * H + i_h, mask=m_t, other=0.0)
                zq = tl.where(m_t[:, None] & (c_loc == V)[None, :], zd[:, None], zq)
            q_re, q_im = _modes_rows(qe_buf, tok, i_h, H, m_t, BM)
        w_re, w_im = _pow_at(pw_h, (o_t + 1)[:, None], o_m[None, :], TAB, BM)
        qw_re = q_re * w_re + q_im * w_im  # q_s conj(Lambda^(s-t0+1)) [BT, BM]
        qw_im = q_im * w_re - q_re * w_im
        e_re, e_im = _pow_at(pw_h, L, o_m, TAB, BM)
        d_re, d_im = (
            e_re[:, None] * d_re + e_im[:, None] * d_im,
            e_re[:, None] * d_im - e_im[:, None] * d_re,
        )  # conj(Lambda)^L D
        d_re += tl.dot(tl.trans(qw_re), zq, input_precision=PREC)
        d_im += tl.dot(tl.trans(qw_im), zq, input_precision=PREC)
    if STORE_DH0:
        p_dh0 = dh0 + i_nh.to(tl.int64) * M * C * 2 + p_hm
        tl.store(p_dh0, d_re, mask=m_hm)
        tl.store(p_dh0 + 1, d_im, mask=m_hm)


@triton.jit
def _s4d_chunk_grads(
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    dpw: tl.tensor,
    states: tl.tensor,
    dstates: tl.tensor,
    chunk_info: tl.tensor,
    glam_part: tl.tensor,
    gb_part: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    CV: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The parts of g(b) = sum_t gx_t z_t and g(Lambda) = sum_t <x_{t-1}, gx_t> that pair a
    chunk with its start state S0 or with D (the adjoint entering its last token e):
    g(Lambda) += conj(L Lambda^(L-1)) <S0, D> + <b sum_u (e-u) Lambda^(e-u-1) z_u, D>,
    g(b) += <sum_u Lambda^(e-u) z_u, D> (<x, y> = sum_c conj(x) y). Grid (chunks, channel
    blocks, H), independent programs."""
    i_g, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(chunk_info + i_g * 2)
    L = tl.load(chunk_info + i_g * 2 + 1) - t0
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = _channel_block(i_c, NKB, R, CV, BC)
    off = (i_g * H + i_h).to(tl.int64) * M * C * 2 + (o_m[:, None] * C + c_st[None, :]) * 2
    m_hm = m_m[:, None] & m_c[None, :]
    s_re = tl.load(states + off, mask=m_hm, other=0.0)
    s_im = tl.load(states + off + 1, mask=m_hm, other=0.0)
    d_re = tl.load(dstates + off, mask=m_hm, other=0.0)
    d_im = tl.load(dstates + off + 1, mask=m_hm, other=0.0)
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=m_m, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=m_m, other=0.0).to(ACC)
    pw_h = pw + i_h * 2 * TAB
    dpw_h = dpw + i_h * 2 * TAB
    w_re, w_im = _pow_at(dpw_h, L, o_m, TAB, BM)  # L Lambda^(L-1)
    c_re = tl.sum(s_re * d_re + s_im * d_im, axis=1)  # <S0, D>
    c_im = tl.sum(s_re * d_im - s_im * d_re, axis=1)
    gl_re = w_re * c_re + w_im * c_im
    gl_im = w_re * c_im - w_im * c_re
    tok = t0 + o_t
    m_t = o_t < L
    if i_c < NKB:
        z = _rows(kt, tok, i_h, H, R, c_loc, m_t, ACC)
    else:
        z = _rows(vt, tok, i_h, H, V, c_loc, m_t, ACC)
        if RATIO:
            z = tl.where(m_t[:, None] & (c_loc == V)[None, :], 1.0, z)
    k_u = tl.maximum(L - 1 - o_t, 0)[None, :]
    w_re, w_im = _pow_at(pw_h, k_u, o_m[:, None], TAB, BM)
    x_re = tl.dot(w_re, z, input_precision=PREC)  # sum_u Lambda^(e-u) z_u [BM, BC]
    x_im = tl.dot(w_im, z, input_precision=PREC)
    gb_re = tl.sum(d_re * x_re + d_im * x_im, axis=1)
    gb_im = tl.sum(d_im * x_re - d_re * x_im, axis=1)
    w_re, w_im = _pow_at(dpw_h, k_u, o_m[:, None], TAB, BM)
    x_re = tl.dot(w_re, z, input_precision=PREC)  # sum_u (e-u) Lambda^(e-u-1) z_u
    x_im = tl.dot(w_im, z, input_precision=PREC)
    x_re, x_im = (
        b_re[:, None] * x_re - b_im[:, None] * x_im,
        b_re[:, None] * x_im + b_im[:, None] * x_re,
    )
    gl_re += tl.sum(d_re * x_re + d_im * x_im, axis=1)
    gl_im += tl.sum(d_im * x_re - d_re * x_im, axis=1)
    p_part = ((i_g * tl.num_programs(1) + i_c) * H + i_h).to(tl.int64) * 2 * BM + o_m
    tl.store(glam_part + p_part, gl_re)
    tl.store(glam_part + p_part + BM, gl_im)
    tl.store(gb_part + p_part, gb_re)
    tl.store(gb_part + p_part + BM, gb_im)


@triton.jit
def _s4d_bwd_inputs(
    fq: tl.tensor,
    dnum: tl.tensor,
    qe_buf: tl.tensor,
    gp_buf: tl.tensor,
    dstates: tl.tensor,
    pw: tl.tensor,
    b: tl.tensor,
    sub_info: tl.tensor,
    dkt: tl.tensor,
    dvt: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    DIAG_LOOP: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dz_t = Re(conj(b)^T gx_t) for the rows of one sub-chunk: dkt from (g(p), fq, D^K) and
    dvt from (qe, dnum, D^V). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    j_s = tl.load(sub_info + i_p * 5 + 3)
    o_s = tl.arange(0, BS)
    tok = t0 + j_s * BS + o_s
    m_t = tok < t1
    o_m = tl.arange(0, BM)
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=o_m < M, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=o_m < M, other=0.0).to(ACC)
    pw_h = pw + i_h * 2 * TAB
    d_st = dstates + (g * H + i_h).to(tl.int64) * M * C * 2
    w_re, w_im = _pow_at(pw_h, tl.maximum(t1 - 1 - tok, 0)[:, None], o_m[None, :], TAB, BM)
    fe_re = b_re[None, :] * w_re - b_im[None, :] * w_im  # b Lambda^(e-t)
    fe_im = b_re[None, :] * w_im + b_im[None, :] * w_re
    bu_re, bu_im = fe_re, fe_im  # only read as [BS, BS, BM] tiles
    if not DIAG_LOOP:
        lag = o_s[None, :] - o_s[:, None]  # s - t
        k_u = tl.where((lag >= 0) & m_t[None, :], lag, BT + 1)[:, :, None]
        w_re, w_im = _pow_at(pw_h, k_u, o_m[None, None, :], TAB, BM)
        bu_re = b_re[None, None, :] * w_re - b_im[None, None, :] * w_im
        bu_im = b_re[None, None, :] * w_im + b_im[None, None, :] * w_re
    dk = _s4d_adjoint_inputs(
        gp_buf, fq, R, d_st, 0, pw_h, b_re, b_im, fe_re, fe_im, bu_re, bu_im,
        t0, t1, j_s, tok, m_t, i_h, H, C, M, BT, BS, BR, BM, TAB, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    o_r = tl.arange(0, BR)
    _store_rows(dkt, dk, tok, i_h, H, R, o_r, m_t)
    dv = _s4d_adjoint_inputs(
        qe_buf, dnum, V, d_st, R, pw_h, b_re, b_im, fe_re, fe_im, bu_re, bu_im,
        t0, t1, j_s, tok, m_t, i_h, H, C, M, BT, BS, BV, BM, TAB, DIAG_LOOP, ACC, PREC,
    )  # fmt: skip
    o_v = tl.arange(0, BV)
    _store_rows(dvt, dv, tok, i_h, H, V, o_v, m_t)


# --------------------------------------------------------------------------------------------
# S4D: launchers


class _S4DPlan(NamedTuple):
    """Everything a S4D launch needs besides the data: sizes, tiles, layout, tables."""

    H: int
    R: int
    V: int
    M: int
    C: int
    CV: int
    ratio: bool
    acc: torch.dtype
    layout: Layout
    grid_states: tuple[int, int]
    grid_sub: tuple[int, int]
    NKB: int
    pw: torch.Tensor
    dpw: torch.Tensor
    b: torch.Tensor
    gmat: torch.Tensor
    tiles: dict[str, Any]  # constexpr tile sizes shared by the output-pass kernels
    state_tiles: dict[str, Any]  # ... and by the state-pass kernels


def _s4d_plan(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> _S4DPlan:
    _check_inputs(("fq", "kt", "vt"), (fq, kt, vt), (None, fq.shape[-1] if fq.ndim else 0, None))
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    _, _, H, R = fq.shape
    V = vt.shape[-1]
    if lam.ndim != 3:
        raise ValueError(f"lam: expected shape (H, M, 2) (re, im last), got {tuple(lam.shape)}")
    M = lam.shape[1]
    _check_param("lam", lam, (H, M, 2), fq.device)
    _check_param("b", b, (H, M, 2), fq.device)
    _check_param("c", c, (H, M, M, 2), fq.device)
    cu = _sequences("fq", fq, cu_seqlens)
    ratio = readout == "ratio"
    CV = V + int(ratio)
    C = R + CV
    if initial_state is not None:
        _check_param("initial_state", initial_state, (len(cu) - 1, H, M, C, 2), fq.device)
    acc, ACC, PREC = _acc(fq.dtype)
    blocks = _blocks(fq.device)
    layout = _layout(cu, blocks.chunk, blocks.sub_chunk, fq.device)
    BM = _pow2(M)
    BC = _pow2(min(max(R, CV), blocks.channels))
    NKB = triton.cdiv(R, BC)
    pw, dpw = _power_tables(lam, blocks.chunk, BM, acc)
    common = dict(BT=blocks.chunk, BM=BM, TAB=(blocks.chunk + 2) * BM, ACC=ACC, PREC=PREC)
    common["num_warps"] = blocks.num_warps
    sub = dict(BS=blocks.sub_chunk, BR=_pow2(R), BV=_pow2(V), DIAG_LOOP=blocks.diag_loop)
    return _S4DPlan(
        H, R, V, M, C, CV, ratio, acc, layout,
        (NKB + triton.cdiv(CV, BC), layout.N * H), (layout.n_sub, H), NKB,
        pw, dpw, b.to(acc).contiguous(), _gram(c, BM, acc),
        dict(**sub, **common), dict(BC=BC, RATIO=ratio, **common),
    )  # fmt: skip


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B * T, H, D] on the flat token axis, contiguous."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


def _s4d_state_pass_launch(
    plan: _S4DPlan, kt: torch.Tensor, vt: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    lay = plan.layout
    shape = (plan.H, plan.M, plan.C, 2)
    states = torch.empty(lay.n_chunks, *shape, dtype=plan.acc, device=kt.device)
    final = torch.empty(lay.N, *shape, dtype=plan.acc, device=kt.device)
    h0 = initial_state.to(plan.acc).contiguous() if initial_state is not None else final
    _s4d_state_pass[plan.grid_states](
        kt, vt, plan.b, plan.pw, h0, states, final, lay.cu, lay.chunk_offsets,
        plan.H, plan.R, plan.V, plan.CV, plan.M, plan.C, plan.NKB,
        USE_H0=initial_state is not None, **plan.state_tiles,
    )  # fmt: skip
    return states, final


@dispatch.register("s4d_fwd", "triton")
def s4d_fwd(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The S4D core (I11)-(I13), chunked: o and the state after the last token.

    Args:
        fq, kt: [B, T, H, R]; vt: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        lam, b: [H, M, 2]; c: [H, M, M, 2] (re, im last), float32 or float64.
        readout: "linear" (I13) or "ratio" (divided by Re(fq^T conj(U)^T eta)).
        cu_seqlens: None, or (N + 1,) int offsets with B = 1; the state restarts at each.
        initial_state: None or [N, H, M, C, 2], C = R + V (+ 1 for "ratio"): x before token 0.

    Returns:
        o [B, T, H, V] in the dtype of fq; the final state [N, H, M, C, 2] in float32
        (float64 for float64 inputs). Time O(T (M (R + V + M) + chunk (R + V + M))) per head;
        memory O(T / chunk * M (R + V)) for the chunk states.
    """
    plan = _s4d_plan(fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state)
    fq_, kt_, vt_ = _flat(fq), _flat(kt), _flat(vt)
    states, final = _s4d_state_pass_launch(plan, kt_, vt_, initial_state)
    o = torch.empty_like(vt_)
    _s4d_output[plan.grid_sub](
        fq_, kt_, vt_, o, states, plan.pw, plan.b, plan.gmat, plan.layout.sub_info,
        plan.H, plan.R, plan.V, plan.M, plan.C, RATIO=plan.ratio, **plan.tiles,
    )  # fmt: skip
    return o.reshape(vt.shape), final


def _complex_modes(buf: torch.Tensor, M: int) -> torch.Tensor:
    """[T, H, 2, BM] mode buffer -> complex [T, H, M] (complex64 for float32 buffers)."""
    return torch.complex(buf[:, :, 0, :M], buf[:, :, 1, :M])


@dispatch.register("s4d_bwd", "triton")
def s4d_bwd(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    cu_seqlens: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    do: torch.Tensor,
    dfinal_state: torch.Tensor | None,
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of :func:`s4d_fwd` for the cotangents do [B, T, H, V] and dfinal_state.

    Complex gradients are (dL/dRe, dL/dIm) pairs, the convention of
    ``attnspec.reference.interdomain.interdomain_s4d_vjp``.

    Returns:
        (dfq, dkt, dvt, dlam, db, dc, dinitial_state), each in the dtype of its input;
        dinitial_state is None without initial_state. Time about 3x the forward; memory
        O(T M) for four per-token mode buffers plus two sets of chunk states.
    """
    plan = _s4d_plan(fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state)
    if tuple(do.shape) != tuple(vt.shape) or do.device != vt.device or do.dtype != vt.dtype:
        raise ValueError(
            f"do: expected shape {tuple(vt.shape)}, dtype {vt.dtype} on {vt.device}, got "
            f"{tuple(do.shape)}, {do.dtype} on {do.device}"
        )
    lay = plan.layout
    if dfinal_state is not None:
        _check_param("dfinal_state", dfinal_state, (lay.N, plan.H, plan.M, plan.C, 2), fq.device)
    fq_, kt_, vt_, do_ = _flat(fq), _flat(kt), _flat(vt), _flat(do)
    dev, acc, BM = fq.device, plan.acc, plan.tiles["BM"]
    states, _ = _s4d_state_pass_launch(plan, kt_, vt_, initial_state)
    p_buf, qe_buf, gq_buf, gp_buf = (
        torch.empty(fq_.shape[0], plan.H, 2, BM, dtype=acc, device=dev) for _ in range(4)
    )
    if plan.ratio:
        dnum = torch.empty(do_.shape, dtype=acc, device=dev)
        dden = torch.empty(do_.shape[:2], dtype=acc, device=dev)
    else:
        dnum, dden = do_, p_buf  # dden is not read without the ratio readout
    dfq = torch.empty_like(fq_)
    glam1 = torch.empty(lay.n_sub, plan.H, 2, BM, dtype=acc, device=dev)
    gb1 = torch.empty_like(glam1)
    _s4d_bwd_modes[plan.grid_sub](
        fq_, kt_, vt_, do_, states, plan.pw, plan.dpw, plan.b, plan.gmat, lay.sub_info,
        p_buf, qe_buf, gq_buf, gp_buf, dnum, dden, dfq, glam1, gb1,
        plan.H, plan.R, plan.V, plan.M, plan.C, RATIO=plan.ratio, **plan.tiles,
    )  # fmt: skip
    dstates = torch.empty_like(states)
    dh0 = torch.empty_like(states[: lay.N]) if initial_state is not None else None
    dht = dfinal_state.to(acc).contiguous() if dfinal_state is not None else dstates
    _s4d_reverse_state_pass[plan.grid_states](
        fq_, dnum, dden, qe_buf, gp_buf, plan.pw, dht, dstates,
        dh0 if dh0 is not None else dstates, lay.cu, lay.chunk_offsets,
        plan.H, plan.R, plan.V, plan.CV, plan.M, plan.C, plan.NKB,
        USE_DHT=dfinal_state is not None, STORE_DH0=dh0 is not None, **plan.state_tiles,
    )  # fmt: skip
    glam2 = torch.empty(lay.n_chunks, plan.grid_states[0], plan.H, 2, BM, dtype=acc, device=dev)
    gb2 = torch.empty_like(glam2)
    _s4d_chunk_grads[(lay.n_chunks, plan.grid_states[0], plan.H)](
        kt_, vt_, plan.b, plan.pw, plan.dpw, states, dstates, lay.chunk_info, glam2, gb2,
        plan.H, plan.R, plan.V, plan.CV, plan.M, plan.C, plan.NKB, **plan.state_tiles,
    )  # fmt: skip
    dkt, dvt = torch.empty_like(kt_), torch.empty_like(vt_)
    _s4d_bwd_inputs[plan.grid_sub](
        fq_, dnum, qe_buf, gp_buf, dstates, plan.pw, plan.b, lay.sub_info, dkt, dvt,
        plan.H, plan.R, plan.V, plan.M, plan.C, **plan.tiles,
    )  # fmt: skip
    # g(G) = sum_t g(qe_t) p_t^H; G = C^H C gives g(C) = C (g(G) + g(G)^H).
    M = plan.M
    g_gram = torch.einsum(
        "thm,thn->hmn", _complex_modes(gq_buf, M), _complex_modes(p_buf, M).conj()
    )
    c_c = torch.view_as_complex(c.to(torch.float64).contiguous())
    g_gram = g_gram.to(torch.complex128)
    dc = torch.view_as_real(c_c @ (g_gram + g_gram.conj().transpose(-1, -2)))
    part = lambda x: x[..., :M].double().sum(dim=tuple(range(x.ndim - 3)))  # noqa: E731
    dlam = (part(glam1) + part(glam2)).transpose(-1, -2)  # (H, M, 2)
    db = (part(gb1) + part(gb2)).transpose(-1, -2)
    return (
        dfq.reshape(fq.shape),
        dkt.reshape(kt.shape),
        dvt.reshape(vt.shape),
        dlam.to(lam.dtype).contiguous(),
        db.to(b.dtype).contiguous(),
        dc.to(c.dtype).contiguous(),
        dh0.to(initial_state.dtype) if dh0 is not None and initial_state is not None else None,
    )


# --------------------------------------------------------------------------------------------
# LegS: position tables (host side)


@functools.lru_cache(maxsize=8)
def legs_chunk_tables(M: int, chunk: int, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """Products of the exact LegS steps (I5) within chunks of ``chunk`` positions, float64.

    For the token at 0-based position p, with n0 the first position of its chunk:
    Phi[p] = E_{p+1} ... E_{n0+1} (M, M), the transition from the state before the chunk, and
    K[p, j] = E_{p+1} ... E_{n0+j+2} F_{n0+j+1} (M,), the weight of the input at n0 + j
    (zero when n0 + j > p). So c_p = Phi[p] c_{n0-1} + sum_j K[p, j] f_{n0+j}.

    Returns:
        Phi (n_max, M, M), K (n_max, chunk, M). Time O(n_max M^2 (M + chunk)), once per
        (M, chunk, n_max).
    """
    phi = np.zeros((n_max, M, M))
    weights = np.zeros((n_max, chunk, M))
    for start in range(0, n_max, chunk):
        P, K = np.eye(M), np.zeros((M, chunk))
        for p in range(start, min(start + chunk, n_max)):
            E, F = hippo.legs_step(p + 1, M)  # (I5) token n = p + 1
            P, K = E @ P, E @ K
            K[:, p - start] = F
            phi[p], weights[p] = P, K.T
    return phi, weights


_LEGS_DEVICE_TABLES: dict[
    tuple[int, int, int, int, torch.dtype, str], tuple[torch.Tensor, torch.Tensor]
] = {}


def _legs_tables(
    M: int, chunk: int, max_len: int, BM: int, acc: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables of :func:`legs_chunk_tables` on ``device`` as [n_max, BM, BM] and
    [n_max, chunk, BM] (zero-padded), n_max a power-of-two number of chunks >= max_len."""
    n_max = chunk * triton.next_power_of_2(-(-max_len // chunk))
    key = (M, chunk, n_max, BM, acc, str(device))
    if key not in _LEGS_DEVICE_TABLES:
        phi, weights = legs_chunk_tables(M, chunk, n_max)
        phi_t = torch.zeros(n_max, BM, BM, dtype=acc)
        phi_t[:, :M, :M] = torch.from_numpy(phi).to(acc)
        k_t = torch.zeros(n_max, chunk, BM, dtype=acc)
        k_t[:, :, :M] = torch.from_numpy(weights).to(acc)
        if len(_LEGS_DEVICE_TABLES) >= 8:
            _LEGS_DEVICE_TABLES.pop(next(iter(_LEGS_DEVICE_TABLES)))
        _LEGS_DEVICE_TABLES[key] = (phi_t.to(device), k_t.to(device))
    return _LEGS_DEVICE_TABLES[key]


# --------------------------------------------------------------------------------------------
# LegS: kernels


@triton.jit
def _legs_modes(
    b_q: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    n_i: tl.tensor,
    i_s: tl.tensor,
    pos: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """p_t = c_t q_t over the channels [c_off, c_off + W) of the state, for the rows of one
    sub-chunk: p_t = Phi_t (S0 q_t) + sum_{t0<=u<=t} K(t, u) (q_t . z_u).

    b_q: [BS, BD] rows q_t; src: [T, H, W] inputs z_u; s0: the state [M, C] before the chunk;
    pos: [BS] table positions of the rows. Returns p [BS, BM].
    """
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_b = tl.arange(0, BMB)
    p = tl.zeros([BS, BM], dtype=ACC)
    for mb in range(0, BM, BMB):  # Phi_t y_t, contracted in blocks of BMB modes
        m_b = mb + o_b
        p_s = s0 + m_b[None, :] * C + c_off + o_d[:, None]
        s_blk = tl.load(p_s, mask=(o_d < W)[:, None] & (m_b < M)[None, :], other=0.0)
        y = tl.dot(b_q, s_blk.to(ACC), input_precision=PREC)  # (S0 q_t)[m_b] [BS, BMB]
        ph = tl.load(phi + (pos[:, None, None] * BM + o_m[None, :, None]) * BM + m_b[None, None, :])
        p += tl.sum(ph * y[:, None, :], axis=2)
    for j in range(0, i_s + 1):
        tok_u = t0 + j * BS + o_s
        b_k = _rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, ACC)
        a = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)  # q_t . z_u [BS, BS]
        kg = tl.load(
            ktab + (pos[:, None, None] * BT + j * BS + o_s[None, :, None]) * BM + o_m[None, None, :]
        )
        p += tl.sum(a[:, :, None] * kg, axis=1)
    return p


@triton.jit
def _legs_readout(
    p: tl.tensor,
    src: tl.tensor,
    W: tl.tensor,
    s0: tl.tensor,
    c_off: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    hat_buf: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    i_s: tl.tensor,
    tok: tl.tensor,
    pos: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    STORE_HAT: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """out_t = c_t[:, channels]^T p_t = (Phi_t^T p_t)^T S0 + sum_{t0<=u<=t} (K(t, u) . p_t) z_u
    for the rows of one sub-chunk; STORE_HAT keeps Phi_t^T p_t in hat_buf [T, H, BM].
    Returns out [BS, BD]."""
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_b = tl.arange(0, BMB)
    out = tl.zeros([BS, BD], dtype=ACC)
    for mb in range(0, BM, BMB):
        m_b = mb + o_b
        ph = tl.load(phi + (pos[:, None, None] * BM + o_m[None, :, None]) * BM + m_b[None, None, :])
        hat = tl.sum(ph * p[:, :, None], axis=1)  # (Phi_t^T p_t)[m_b] [BS, BMB]
        p_s = s0 + m_b[:, None] * C + c_off + o_d[None, :]
        s_blk = tl.load(p_s, mask=(m_b < M)[:, None] & (o_d < W)[None, :], other=0.0)
        out += tl.dot(hat, s_blk.to(ACC), input_precision=PREC)
        if STORE_HAT:
            p_h = hat_buf + (tok.to(tl.int64)[:, None] * H + i_h) * BM + m_b[None, :]
            tl.store(p_h, hat, mask=m_t[:, None])
    for j in range(0, i_s + 1):
        tok_u = t0 + j * BS + o_s
        kg = tl.load(
            ktab + (pos[:, None, None] * BT + j * BS + o_s[None, :, None]) * BM + o_m[None, None, :]
        )
        s = tl.sum(kg * p[:, None, :], axis=2)  # K(t, u) . p_t [BS, BS]
        out += tl.dot(s, _rows(src, tok_u, i_h, H, W, o_d, tok_u < t1, ACC), input_precision=PREC)
    return out


@triton.jit
def _legs_adjoint_inputs(
    q_buf: tl.tensor,
    zsrc: tl.tensor,
    W: tl.tensor,
    d_st: tl.tensor,
    c_off: tl.tensor,
    ktab: tl.tensor,
    t0: tl.tensor,
    t1: tl.tensor,
    j_s: tl.tensor,
    tok: tl.tensor,
    pos0: tl.tensor,
    m_t: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> tl.tensor:
    """dz_t = F_t^T gc_t = K(e, t)^T D + sum_{t<=s<=e} (K(s, t) . q_s) zq_s for the rows of one
    sub-chunk; D is the adjoint entering c_e (e = t1 - 1) from later tokens, q_buf [T, H, BM].
    Returns dz [BS, BD]."""
    o_s = tl.arange(0, BS)
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    p_e = pos0 + t1 - 1 - t0
    k_e = tl.load(ktab + (p_e * BT + (tok - t0)[:, None]) * BM + o_m[None, :])  # K(e, t)
    p_d = d_st + o_m[:, None] * C + c_off + o_d[None, :]
    d_blk = tl.load(p_d, mask=(o_m < M)[:, None] & (o_d < W)[None, :], other=0.0)
    dz = tl.dot(k_e, d_blk.to(ACC), input_precision=PREC)
    for i in range(j_s, tl.cdiv(t1 - t0, BS)):
        tok_s = t0 + i * BS + o_s
        m_s = tok_s < t1
        p_q = q_buf + (tok_s.to(tl.int64)[:, None] * H + i_h) * BM + o_m[None, :]
        q = tl.load(p_q, mask=m_s[:, None], other=0.0)
        pos_s = pos0 + i * BS + o_s
        kg = tl.load(
            ktab + (pos_s[None, :, None] * BT + (tok - t0)[:, None, None]) * BM + o_m[None, None, :]
        )
        st = tl.sum(kg * q[None, :, :], axis=2)  # K(s, t) . q_s [BS (t), BS (s)]
        dz += tl.dot(st, _rows(zsrc, tok_s, i_h, H, W, o_d, m_s, ACC), input_precision=PREC)
    return dz


@triton.jit
def _legs_state_pass(
    fk: tl.tensor,
    v: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    states: tl.tensor,
    cu: tl.tensor,
    chunk_offsets: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I5) chunk by chunk: store the state before each chunk, then
    c_e = Phi_e c_{t0-1} + sum_u K(e, u) f_u. Grid (channel blocks, N * H)."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = _channel_block(i_c, NKB, R, V, BC)
    p_hm = o_m[:, None] * C + c_st[None, :]
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    s = tl.zeros([BM, BC], dtype=ACC)
    for k in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        tl.store(states + ((g0 + k) * H + i_h).to(tl.int64) * M * C + p_hm, s, mask=m_hm)
        tok = t0 + o_t
        if i_c < NKB:
            z = _rows(fk, tok, i_h, H, R, c_loc, o_t < L, ACC)
        else:
            z = _rows(v, tok, i_h, H, V, c_loc, o_t < L, ACC)
        p_e = k * BT + L - 1
        ph = tl.load(phi + (p_e * BM + o_m[:, None]) * BM + o_m[None, :])  # [BM, BM]
        kw = tl.load(ktab + (p_e * BT + o_t[None, :]) * BM + o_m[:, None])  # K(e, u) [BM, BT]
        s = tl.dot(ph, s, input_precision=PREC) + tl.dot(kw, z, input_precision=PREC)


@triton.jit
def _legs_output(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    o: tl.tensor,
    states: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """(I3) for the rows of one sub-chunk: p_t = U_t fq_t, o_t = Gamma_t^T p_t / p_t[0]
    (eta = e_0 exactly, (I6)). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    i_s = tl.load(sub_info + i_p * 5 + 3)
    pos0 = tl.load(sub_info + i_p * 5 + 4)
    n_i = t0 + i_s * BS
    o_s = tl.arange(0, BS)
    tok = n_i + o_s
    m_t = tok < t1
    pos = pos0 + i_s * BS + o_s
    s0 = states + (g * H + i_h).to(tl.int64) * M * C
    b_q = _rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p = _legs_modes(
        b_q, fk, R, s0, 0, phi, ktab, t0, t1, n_i, i_s, pos, i_h, H, C, M,
        BT, BS, BR, BM, BMB, ACC, PREC,
    )  # fmt: skip
    den = tl.sum(tl.where(tl.arange(0, BM)[None, :] == 0, p, 0.0), axis=1)  # (I6) eta = e_0
    num = _legs_readout(
        p, v, V, s0, R, phi, ktab, o, t0, t1, i_s, tok, pos, m_t, i_h, H, C, M,
        BT, BS, BV, BM, BMB, False, ACC, PREC,
    )  # fmt: skip
    out = num / tl.where(m_t, den, 1.0)[:, None]  # (I3)
    o_v = tl.arange(0, BV)
    _store_rows(o, out, tok, i_h, H, V, o_v, m_t)


@triton.jit
def _legs_bwd_modes(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    do: tl.tensor,
    states: tl.tensor,
    phi: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    p_buf: tl.tensor,
    phat_buf: tl.tensor,
    gp_buf: tl.tensor,
    ghat_buf: tl.tensor,
    dnum_buf: tl.tensor,
    dfq: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    BMB: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """Backward through (I3) for the rows of one sub-chunk: recompute p, den, num;
    dnum = do / den, dden = -<do, o> / den, g(p_t) = Gamma_t dnum_t + e_0 dden_t,
    dfq_t = U_t^T g(p_t). Keeps p, Phi^T p, g(p), Phi^T g(p) and dnum for the adjoint pass."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    i_s = tl.load(sub_info + i_p * 5 + 3)
    pos0 = tl.load(sub_info + i_p * 5 + 4)
    n_i = t0 + i_s * BS
    o_s = tl.arange(0, BS)
    o_m = tl.arange(0, BM)
    o_v = tl.arange(0, BV)
    tok = n_i + o_s
    m_t = tok < t1
    pos = pos0 + i_s * BS + o_s
    s0 = states + (g * H + i_h).to(tl.int64) * M * C
    b_q = _rows(fq, tok, i_h, H, R, tl.arange(0, BR), m_t, ACC)
    p = _legs_modes(
        b_q, fk, R, s0, 0, phi, ktab, t0, t1, n_i, i_s, pos, i_h, H, C, M,
        BT, BS, BR, BM, BMB, ACC, PREC,
    )  # fmt: skip
    den = tl.sum(tl.where(o_m[None, :] == 0, p, 0.0), axis=1)
    den = tl.where(m_t, den, 1.0)
    num = _legs_readout(
        p, v, V, s0, R, phi, ktab, phat_buf, t0, t1, i_s, tok, pos, m_t, i_h, H, C, M,
        BT, BS, BV, BM, BMB, True, ACC, PREC,
    )  # fmt: skip
    dnum = _rows(do, tok, i_h, H, V, o_v, m_t, ACC) / den[:, None]
    dden = -tl.sum(dnum * num, axis=1) / den  # -<do, o> / den
    gp = _legs_modes(
        dnum, v, V, s0, R, phi, ktab, t0, t1, n_i, i_s, pos, i_h, H, C, M,
        BT, BS, BV, BM, BMB, ACC, PREC,
    )  # fmt: skip
    gp += tl.where(o_m[None, :] == 0, dden[:, None], 0.0)  # + e_0 dden
    dq = _legs_readout(
        gp, fk, R, s0, 0, phi, ktab, ghat_buf, t0, t1, i_s, tok, pos, m_t, i_h, H, C, M,
        BT, BS, BR, BM, BMB, True, ACC, PREC,
    )  # fmt: skip
    o_r = tl.arange(0, BR)
    _store_rows(dfq, dq, tok, i_h, H, R, o_r, m_t)
    p_m = (tok.to(tl.int64)[:, None] * H + i_h) * BM + o_m[None, :]
    tl.store(p_buf + p_m, p, mask=m_t[:, None])
    tl.store(gp_buf + p_m, gp, mask=m_t[:, None])
    _store_rows(dnum_buf, dnum, tok, i_h, H, V, o_v, m_t)


@triton.jit
def _legs_reverse_state_pass(
    fq: tl.tensor,
    dnum: tl.tensor,
    phat_buf: tl.tensor,
    ghat_buf: tl.tensor,
    phi: tl.tensor,
    dstates: tl.tensor,
    cu: tl.tensor,
    chunk_offsets: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    NKB: tl.tensor,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """The adjoint state, chunk by chunk from the last: store D_k (the adjoint entering c_e
    from later tokens), then D_{k-1} = Phi_e^T D_k + sum_s (Phi_s^T q_s) zq_s^T with
    (q, zq) = (g(p), fq) on key channels and (p, dnum) on value channels."""
    i_c, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    g0 = tl.load(chunk_offsets + i_n)
    o_m = tl.arange(0, BM)
    o_t = tl.arange(0, BT)
    c_loc, c_st, m_c = _channel_block(i_c, NKB, R, V, BC)
    p_hm = o_m[:, None] * C + c_st[None, :]
    m_hm = (o_m < M)[:, None] & m_c[None, :]
    d = tl.zeros([BM, BC], dtype=ACC)
    NT = tl.cdiv(eos - bos, BT)
    for kk in range(0, NT):
        k = NT - 1 - kk
        t0 = bos + k * BT
        L = tl.minimum(BT, eos - t0)
        tl.store(dstates + ((g0 + k) * H + i_h).to(tl.int64) * M * C + p_hm, d, mask=m_hm)
        tok = t0 + o_t
        m_t = o_t < L
        if i_c < NKB:
            zq = _rows(fq, tok, i_h, H, R, c_loc, m_t, ACC)
            p_q = ghat_buf + (tok.to(tl.int64)[None, :] * H + i_h) * BM + o_m[:, None]
        else:
            zq = _rows(dnum, tok, i_h, H, V, c_loc, m_t, ACC)
            p_q = phat_buf + (tok.to(tl.int64)[None, :] * H + i_h) * BM + o_m[:, None]
        q_hat = tl.load(p_q, mask=m_t[None, :], other=0.0)  # (Phi_s^T q_s)^T [BM, BT]
        p_e = k * BT + L - 1
        ph_t = tl.load(phi + (p_e * BM + o_m[None, :]) * BM + o_m[:, None])  # Phi_e^T
        d = tl.dot(ph_t, d, input_precision=PREC) + tl.dot(q_hat, zq, input_precision=PREC)


@triton.jit
def _legs_bwd_inputs(
    fq: tl.tensor,
    dnum: tl.tensor,
    p_buf: tl.tensor,
    gp_buf: tl.tensor,
    dstates: tl.tensor,
    ktab: tl.tensor,
    sub_info: tl.tensor,
    dfk: tl.tensor,
    dv: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """dz_t = F_t^T gc_t for the rows of one sub-chunk: dfk from (g(p), fq, D^K) and dv from
    (p, dnum, D^V). Grid (sub-chunks, H)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(sub_info + i_p * 5)
    t1 = tl.load(sub_info + i_p * 5 + 1)
    g = tl.load(sub_info + i_p * 5 + 2)
    j_s = tl.load(sub_info + i_p * 5 + 3)
    pos0 = tl.load(sub_info + i_p * 5 + 4)
    tok = t0 + j_s * BS + tl.arange(0, BS)
    m_t = tok < t1
    d_st = dstates + (g * H + i_h).to(tl.int64) * M * C
    dk = _legs_adjoint_inputs(
        gp_buf, fq, R, d_st, 0, ktab, t0, t1, j_s, tok, pos0, m_t, i_h, H, C, M,
        BT, BS, BR, BM, ACC, PREC,
    )  # fmt: skip
    o_r = tl.arange(0, BR)
    _store_rows(dfk, dk, tok, i_h, H, R, o_r, m_t)
    dz = _legs_adjoint_inputs(
        p_buf, dnum, V, d_st, R, ktab, t0, t1, j_s, tok, pos0, m_t, i_h, H, C, M,
        BT, BS, BV, BM, ACC, PREC,
    )  # fmt: skip
    o_v = tl.arange(0, BV)
    _store_rows(dv, dz, tok, i_h, H, V, o_v, m_t)


# --------------------------------------------------------------------------------------------
# LegS: launchers


class _LegsPlan(NamedTuple):
    H: int
    R: int
    V: int
    M: int
    C: int
    acc: torch.dtype
    layout: Layout
    grid_states: tuple[int, int]
    grid_sub: tuple[int, int]
    NKB: int
    phi: torch.Tensor
    ktab: torch.Tensor
    tiles: dict[str, Any]
    state_tiles: dict[str, Any]


def _legs_plan(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
) -> _LegsPlan:
    _check_inputs(("fq", "fk", "v"), (fq, fk, v), (None, fq.shape[-1] if fq.ndim else 0, None))
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"M: expected a positive int, got {M!r}")
    _, _, H, R = fq.shape
    V = v.shape[-1]
    cu = _sequences("fq", fq, cu_seqlens)
    acc, ACC, PREC = _acc(fq.dtype)
    blocks = _blocks(fq.device)
    layout = _layout(cu, blocks.chunk, blocks.sub_chunk, fq.device)
    BM = _pow2(M)
    BC = _pow2(min(max(R, V), blocks.channels))
    NKB = triton.cdiv(R, BC)
    phi, ktab = _legs_tables(M, blocks.chunk, layout.max_len, BM, acc, fq.device)
    common = dict(BT=blocks.chunk, BM=BM, ACC=ACC, PREC=PREC, num_warps=blocks.num_warps)
    return _LegsPlan(
        H, R, V, M, R + V, acc, layout,
        (NKB + triton.cdiv(V, BC), layout.N * H), (layout.n_sub, H), NKB, phi, ktab,
        dict(BS=blocks.sub_chunk, BR=_pow2(R), BV=_pow2(V), **common), dict(BC=BC, **common),
    )  # fmt: skip


def _legs_state_pass_launch(plan: _LegsPlan, fk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    lay = plan.layout
    states = torch.empty(lay.n_chunks, plan.H, plan.M, plan.C, dtype=plan.acc, device=fk.device)
    _legs_state_pass[plan.grid_states](
        fk, v, plan.phi, plan.ktab, states, lay.cu, lay.chunk_offsets,
        plan.H, plan.R, plan.V, plan.M, plan.C, plan.NKB, **plan.state_tiles,
    )  # fmt: skip
    return states


@dispatch.register("legs_fwd", "triton")
def legs_fwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """Interdomain attention with the LegS basis, (I2)-(I6), chunked over the exact steps.

    Args:
        fq, fk: [B, T, H, R] features; v: [B, T, H, V]; one dtype (bf16, fp16, fp32, fp64).
        M: the number of basis functions.
        cu_seqlens: None, or (N + 1,) int offsets with B = 1; each segment starts at n = 1.

    Returns:
        o [B, T, H, V] in the dtype of fq (ratio readout (I3), eta = e_0 (I6)). Time
        O(T (M^2 + chunk M + M (R + V))) per head; memory O(T / chunk M (R + V)) for the chunk
        states plus the position tables O(T M (M + chunk)), shared by all heads and calls.
    """
    plan = _legs_plan(fq, fk, v, M, cu_seqlens)
    fq_, fk_, v_ = _flat(fq), _flat(fk), _flat(v)
    states = _legs_state_pass_launch(plan, fk_, v_)
    o = torch.empty_like(v_)
    _legs_output[plan.grid_sub](
        fq_, fk_, v_, o, states, plan.phi, plan.ktab, plan.layout.sub_info,
        plan.H, plan.R, plan.V, plan.M, plan.C, BMB=16, **plan.tiles,
    )  # fmt: skip
    return o.reshape(v.shape)


@dispatch.register("legs_bwd", "triton")
def legs_bwd(
    fq: torch.Tensor,
    fk: torch.Tensor,
    v: torch.Tensor,
    M: int,
    cu_seqlens: torch.Tensor | None,
    do: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`legs_fwd` for the cotangent do [B, T, H, V] (the adjoint of (I5)
    run backwards, as ``attnspec.reference.interdomain.interdomain_legs_vjp``).

    Returns:
        (dfq, dfk, dv) in the dtype of their inputs. Time about 3x the forward; memory O(T M)
        for four per-token mode buffers plus two sets of chunk states.
    """
    plan = _legs_plan(fq, fk, v, M, cu_seqlens)
    if tuple(do.shape) != tuple(v.shape) or do.device != v.device or do.dtype != v.dtype:
        raise ValueError(
            f"do: expected shape {tuple(v.shape)}, dtype {v.dtype} on {v.device}, got "
            f"{tuple(do.shape)}, {do.dtype} on {do.device}"
        )
    lay = plan.layout
    fq_, fk_, v_, do_ = _flat(fq), _flat(fk), _flat(v), _flat(do)
    dev, acc, BM = fq.device, plan.acc, plan.tiles["BM"]
    states = _legs_state_pass_launch(plan, fk_, v_)
    p_buf, phat, gp_buf, ghat = (
        torch.empty(fq_.shape[0], plan.H, BM, dtype=acc, device=dev) for _ in range(4)
    )
    dnum = torch.empty(do_.shape, dtype=acc, device=dev)
    dfq = torch.empty_like(fq_)
    _legs_bwd_modes[plan.grid_sub](
        fq_, fk_, v_, do_, states, plan.phi, plan.ktab, lay.sub_info, p_buf, phat, gp_buf,
        ghat, dnum, dfq, plan.H, plan.R, plan.V, plan.M, plan.C, BMB=16, **plan.tiles,
    )  # fmt: skip
    dstates = torch.empty_like(states)
    _legs_reverse_state_pass[plan.grid_states](
        fq_, dnum, phat, ghat, plan.phi, dstates, lay.cu, lay.chunk_offsets,
        plan.H, plan.R, plan.V, plan.M, plan.C, plan.NKB, **plan.state_tiles,
    )  # fmt: skip
    dfk, dv = torch.empty_like(fk_), torch.empty_like(v_)
    _legs_bwd_inputs[plan.grid_sub](
        fq_, dnum, p_buf, gp_buf, dstates, plan.ktab, lay.sub_info, dfk, dv,
        plan.H, plan.R, plan.V, plan.M, plan.C, **plan.tiles,
    )  # fmt: skip
    return dfq.reshape(fq.shape), dfk.reshape(fk.shape), dv.reshape(v.shape)


# --------------------------------------------------------------------------------------------
# Decode: one token, fixed-size state (H6)


@triton.jit
def _s4d_step(
    fq: tl.tensor,
    kt: tl.tensor,
    vt: tl.tensor,
    b: tl.tensor,
    pw: tl.tensor,
    gmat: tl.tensor,
    state: tl.tensor,
    new_state: tl.tensor,
    o: tl.tensor,
    H: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    CV: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    TAB: tl.constexpr,
    RATIO: tl.constexpr,
    ACC: tl.constexpr,
) -> None:
    """One token of (I11)-(I13) for one (sequence, head): x <- Lambda x + b z,
    p = x^K fq, qe = G p, o = Re(qe^H x^V) (/ Re(qe^H x^1)). Grid (B * H,)."""
    i_bh = tl.program_id(0)
    i_h = i_bh % H
    o_m = tl.arange(0, BM)
    m_m = o_m < M
    o_r = tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    b_re = tl.load(b + (i_h * M + o_m) * 2, mask=m_m, other=0.0).to(ACC)
    b_im = tl.load(b + (i_h * M + o_m) * 2 + 1, mask=m_m, other=0.0).to(ACC)
    l_re = tl.load(pw + i_h * 2 * TAB + BM + o_m)  # Lambda^1
    l_im = tl.load(pw + i_h * 2 * TAB + TAB + BM + o_m)
    base = i_bh.to(tl.int64) * M * C * 2
    # key channels: (I11) update, then p = x^K fq
    z = tl.load(kt + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    q = tl.load(fq + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p_x = (o_m[:, None] * C + o_r[None, :]) * 2
    m_x = m_m[:, None] & (o_r < R)[None, :]
    x_re = tl.load(state + base + p_x, mask=m_x, other=0.0).to(ACC)
    x_im = tl.load(state + base + p_x + 1, mask=m_x, other=0.0).to(ACC)
    x_re, x_im = (
        l_re[:, None] * x_re - l_im[:, None] * x_im + b_re[:, None] * z[None, :],
        l_re[:, None] * x_im + l_im[:, None] * x_re + b_im[:, None] * z[None, :],
    )
    tl.store(new_state + base + p_x, x_re, mask=m_x)
    tl.store(new_state + base + p_x + 1, x_im, mask=m_x)
    p_re = tl.sum(x_re * q[None, :], axis=1)
    p_im = tl.sum(x_im * q[None, :], axis=1)
    # (I12) qe = G p, G = C^H C
    g_h = gmat + i_h * 2 * BM * BM + o_m[:, None] * BM + o_m[None, :]
    g_re = tl.load(g_h)
    g_im = tl.load(g_h + BM * BM)
    qe_re = tl.sum(g_re * p_re[None, :] - g_im * p_im[None, :], axis=1)
    qe_im = tl.sum(g_re * p_im[None, :] + g_im * p_re[None, :], axis=1)
    # value channels (+ the ones channel): update, then (I13) o = Re(qe^H x^V)
    z = tl.load(vt + i_bh * V + o_v, mask=o_v < V, other=0.0).to(ACC)
    if RATIO:
        z = tl.where(o_v == V, 1.0, z)
    p_x = (o_m[:, None] * C + R + o_v[None, :]) * 2
    m_x = m_m[:, None] & (o_v < CV)[None, :]
    x_re = tl.load(state + base + p_x, mask=m_x, other=0.0).to(ACC)
    x_im = tl.load(state + base + p_x + 1, mask=m_x, other=0.0).to(ACC)
    x_re, x_im = (
        l_re[:, None] * x_re - l_im[:, None] * x_im + b_re[:, None] * z[None, :],
        l_re[:, None] * x_im + l_im[:, None] * x_re + b_im[:, None] * z[None, :],
    )
    tl.store(new_state + base + p_x, x_re, mask=m_x)
    tl.store(new_state + base + p_x + 1, x_im, mask=m_x)
    out = tl.sum(qe_re[:, None] * x_re + qe_im[:, None] * x_im, axis=0)  # [BV]
    if RATIO:
        out = out / tl.sum(tl.where(o_v == V, out, 0.0), axis=0)
    tl.store(o + i_bh * V + o_v, out.to(o.dtype.element_ty), mask=o_v < V)


def s4d_step(
    fq: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    lam: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    readout: str,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the S4D core (I11)-(I13) (H6: the state never grows).

    Args:
        fq, kt: [B, H, R]; vt: [B, H, V] (this token); lam, b: [H, M, 2]; c: [H, M, M, 2].
        readout: "linear" or "ratio".
        state: [B, H, M, C, 2] (C = R + V, + 1 for "ratio"), float32 (float64 for float64
            inputs), the state after the previous token; None before the first token.

    Returns:
        o [B, H, V] in the dtype of fq and the new state (a new tensor; ``state`` is not
        modified). Time O(M (R + V + M)) per (sequence, head); memory O(M (R + V)).
    """
    for name, x in (("fq", fq), ("kt", kt), ("vt", vt)):
        if x.ndim != 3:
            raise ValueError(f"{name}: expected [B, H, D] (one token), got {tuple(x.shape)}")
    B, H, R = fq.shape
    plan = _s4d_plan(fq[:, None], kt[:, None], vt[:, None], lam, b, c, readout, None, None)
    shape = (B, H, plan.M, plan.C, 2)
    if state is None:
        state = torch.zeros(shape, dtype=plan.acc, device=fq.device)
    elif tuple(state.shape) != shape or state.dtype != plan.acc or state.device != fq.device:
        raise ValueError(
            f"state: expected {shape} {plan.acc} on {fq.device}, got {tuple(state.shape)} "
            f"{state.dtype} on {state.device}"
        )
    state = state.contiguous()
    new_state = torch.empty_like(state)
    o = torch.empty(B, H, plan.V, dtype=vt.dtype, device=fq.device)
    tiles = plan.tiles
    _s4d_step[(B * H,)](
        fq.contiguous(), kt.contiguous(), vt.contiguous(), plan.b, plan.pw, plan.gmat, state,
        new_state, o, H, R, plan.V, plan.CV, plan.M, plan.C, BR=tiles["BR"], BV=_pow2(plan.CV),
        BM=tiles["BM"], TAB=tiles["TAB"], RATIO=plan.ratio, ACC=tiles["ACC"],
    )  # fmt: skip
    return o, new_state


class LegsState(NamedTuple):
    """The LegS decode state: coefficients c [B, H, M, R + V] after ``n`` tokens."""

    c: torch.Tensor
    n: int


@triton.jit
def _legs_step(
    fq: tl.tensor,
    fk: tl.tensor,
    v: tl.tensor,
    E: tl.tensor,
    F: tl.tensor,
    state: tl.tensor,
    new_state: tl.tensor,
    o: tl.tensor,
    R: tl.tensor,
    V: tl.tensor,
    M: tl.tensor,
    C: tl.tensor,
    BR: tl.constexpr,
    BV: tl.constexpr,
    BM: tl.constexpr,
    FIRST: tl.constexpr,
    ACC: tl.constexpr,
    PREC: tl.constexpr,
) -> None:
    """One token of (I5) and (I3) for one (sequence, head): c <- E_n c + F_n f,
    p = U fq, o = Gamma^T p / p[0]. Grid (B * H,)."""
    i_bh = tl.program_id(0)
    o_m = tl.arange(0, BM)
    o_r = tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    e = tl.load(E + o_m[:, None] * BM + o_m[None, :])
    f = tl.load(F + o_m)
    base = i_bh.to(tl.int64) * M * C
    z = tl.load(fk + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p_c = o_m[:, None] * C + o_r[None, :]
    m_c = (o_m < M)[:, None] & (o_r < R)[None, :]
    u = f[:, None] * z[None, :]
    if not FIRST:
        c_k = tl.load(state + base + p_c, mask=m_c, other=0.0).to(ACC)
        u += tl.dot(e, c_k, input_precision=PREC)  # (I5)
    tl.store(new_state + base + p_c, u, mask=m_c)
    q = tl.load(fq + i_bh * R + o_r, mask=o_r < R, other=0.0).to(ACC)
    p = tl.sum(u * q[None, :], axis=1)  # U fq
    z = tl.load(v + i_bh * V + o_v, mask=o_v < V, other=0.0).to(ACC)
    p_c = o_m[:, None] * C + R + o_v[None, :]
    m_c = (o_m < M)[:, None] & (o_v < V)[None, :]
    g = f[:, None] * z[None, :]
    if not FIRST:
        c_v = tl.load(state + base + p_c, mask=m_c, other=0.0).to(ACC)
        g += tl.dot(e, c_v, input_precision=PREC)
    tl.store(new_state + base + p_c, g, mask=m_c)
    den = tl.sum(tl.where(o_m == 0, p, 0.0), axis=0)  # (I6) eta = e_0
    out = tl.sum(p[:, None] * g, axis=0) / den  # (I3)
    tl.store(o + i_bh * V + o_v, out.to(o.dtype.element_ty), mask=o_v < V)


def legs_step(
    fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor, M: int, state: LegsState | None
) -> tuple[torch.Tensor, LegsState]:
    """One decode step of Interdomain attention with the LegS basis (I5), (I3) (H6).

    The step E_n depends on the token index n, so the state carries a counter; every
    sequence of the batch is at the same n.

    Args:
        fq, fk: [B, H, R]; v: [B, H, V] (this token); M: basis size.
        state: the :class:`LegsState` after the previous tokens, or None before the first.

    Returns:
        o [B, H, V] in the dtype of fq and the new state (float32, float64 for float64
        inputs; the old one is not modified). Time O(M^2 (R + V)) per (sequence, head);
        memory O(M (R + V)).
    """
    for name, x in (("fq", fq), ("fk", fk), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name}: expected [B, H, D] (one token), got {tuple(x.shape)}")
    _check_inputs(
        ("fq", "fk", "v"), (fq[:, None], fk[:, None], v[:, None]), (None, fq.shape[-1], None)
    )
    if isinstance(M, bool) or not isinstance(M, int) or M < 1:
        raise ValueError(f"M: expected a positive int, got {M!r}")
    B, H, R = fq.shape
    V = v.shape[-1]
    acc, ACC, PREC = _acc(fq.dtype)
    shape = (B, H, M, R + V)
    n = 1 if state is None else state.n + 1
    if state is not None and (
        tuple(state.c.shape) != shape or state.c.dtype != acc or state.c.device != fq.device
    ):
        raise ValueError(
            f"state: expected c {shape} {acc} on {fq.device}, got {tuple(state.c.shape)} "
            f"{state.c.dtype} on {state.c.device}"
        )
    BM = _pow2(M)
    E, F = hippo.legs_step(n, M)
    e_t = torch.zeros(BM, BM, dtype=acc)
    e_t[:M, :M] = torch.from_numpy(E).to(acc)
    f_t = torch.zeros(BM, dtype=acc)
    f_t[:M] = torch.from_numpy(F).to(acc)
    new_c = torch.empty(shape, dtype=acc, device=fq.device)
    o = torch.empty(B, H, V, dtype=v.dtype, device=fq.device)
    old = state.c.contiguous() if state is not None else new_c
    _legs_step[(B * H,)](
        fq.contiguous(), fk.contiguous(), v.contiguous(), e_t.to(fq.device), f_t.to(fq.device),
        old, new_c, o, R, V, M, R + V, BR=_pow2(R), BV=_pow2(V), BM=BM, FIRST=state is None,
        ACC=ACC, PREC=PREC,
    )  # fmt: skip
    return o, LegsState(new_c, n)
