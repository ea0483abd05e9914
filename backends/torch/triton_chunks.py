"""The chunk layer shared by the Interdomain Triton kernels (S4D and LegS).

Host side: the tile sizes of a launch (:func:`blocks_for`: a row of ``DEVICE_BLOCKS`` in
``backends/tile_sizes.py``, or the :func:`block_sizes` override), the flat token axis split into
sequences, chunks and sub-chunks (:class:`Layout`, the varlen tables), the launchers' asserts
(user input is checked once, by the public ops in :mod:`.checks`).
Device side (``@triton.jit`` helpers): rows of ``[T, H, W]`` tensors, per-token mode buffers,
tiles of a chunk state ``[M, C(, 2)]`` and the channel blocks of a state pass.

Both variants run the same launch plan (derivations: docs/kernels-interdomain.md):

1. a state pass, sequential over chunks of ``chunk`` tokens, one program per
   (channel block, sequence, head), storing the state before every chunk;
2. an output pass, one program per sub-chunk of ``sub_chunk`` tokens, reading the state
   before its chunk and adding the interactions with the earlier tokens of the chunk.

Precision: inputs in their dtype (bf16 / fp16 / fp32 / fp64), converted right after loading;
states, tables and accumulation in float32 (float64 for float64 inputs); tl.dot in 3xTF32 for
float32 inputs, TF32 for half inputs but the forward S4D state pass, which multiplies in the
inputs' 16-bit type (:func:`operand_type`). Deterministic: no atomics; per-program partial sums are
reduced by the launcher in a fixed order.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from attnspec.reference.packing import Packing

from ..tile_sizes import DEVICE_BLOCKS, DIAGONALS, Blocks
from .devices import device_class, interpreting

__all__ = ["Blocks", "Layout", "block_sizes", "blocks_for"]


_override: list[Blocks] = []


@contextmanager
def block_sizes(
    chunk: int,
    sub_chunk: int,
    diagonal: str = "loop",
    num_warps: int = 4,
    channels: int = 64,
    diag_block: int | None = None,
    columns: int = 0,
) -> Iterator[None]:
    """Force the tile sizes inside the block (tests use small chunks in the interpreter)."""
    if diagonal not in DIAGONALS:
        raise ValueError(f"diagonal: expected one of {DIAGONALS}, got {diagonal!r}")
    sizes = {"chunk": chunk, "sub_chunk": sub_chunk, "diag_block": diag_block or sub_chunk}
    for name, value in sizes.items():
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value}")
    if sub_chunk > chunk:
        raise ValueError(f"sub_chunk: expected at most chunk = {chunk}, got {sub_chunk}")
    if sizes["diag_block"] > sub_chunk:
        raise ValueError(f"diag_block: expected at most sub_chunk = {sub_chunk}, got {diag_block}")
    if columns not in (0, chunk // 2, chunk):  # slices of a power-of-two reach (tl.arange)
        raise ValueError(f"columns: expected 0, chunk / 2 or chunk = {chunk}, got {columns}")
    _override.append(Blocks(chunk, sub_chunk, num_warps, diagonal, channels, diag_block, columns))
    try:
        yield
    finally:
        _override.pop()


def blocks_for(device: torch.device) -> Blocks:
    """The tile sizes a launch on ``device`` uses (an active :func:`block_sizes` first)."""
    if _override:
        return _override[-1]
    return DEVICE_BLOCKS.get(device_class(device), Blocks())


def pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def acc_types(dtype: torch.dtype) -> tuple[torch.dtype, tl.dtype, str]:
    """Accumulation dtype (torch, triton) and tl.dot precision for inputs of ``dtype``."""
    if dtype == torch.float64:
        return torch.float64, tl.float64, "ieee"
    # fp32 inputs: 3xTF32 keeps fp32 accuracy on tensor cores; half inputs: one TF32 pass.
    return torch.float32, tl.float32, "tf32x3" if dtype == torch.float32 else "tf32"


def operand_type(dtype: torch.dtype) -> tuple[tl.dtype, bool]:
    """Operand type of the forward state pass's products, and whether the interpreter must
    emulate bf16 rounding: 16-bit inputs give 16-bit tensor-core products with float32
    accumulation; under the interpreter, whose bfloat16 arithmetic is wrong, bfloat16 products
    run in float32 on operands rounded to bfloat16 (as the FPA kernels do)."""
    if dtype == torch.float16:
        return tl.float16, False
    if dtype == torch.bfloat16:
        return (tl.float32, True) if interpreting() else (tl.bfloat16, False)
    return acc_types(dtype)[1], False


def stored_type(dtype: torch.dtype, acc: torch.dtype) -> torch.dtype:
    """dtype of the chunk states (and adjoint states) the state passes store and the chunk
    programs read: bfloat16 for bfloat16 inputs (chunk_gla stores its states in the inputs'
    dtype; bfloat16 has float32's range), else the accumulation dtype. The passes carry the
    states in float32 from chunk to chunk; only the stored copies are rounded."""
    return torch.bfloat16 if dtype == torch.bfloat16 else acc


def flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B * T, H, D] on the flat token axis, contiguous."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()


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


def layout(cu_list: list[int], chunk: int, sub_chunk: int, device: torch.device) -> Layout:
    """The :class:`Layout` of sequences with offsets ``cu_list`` (cached: the host loop and the
    copies to the device run once per shape)."""
    key = (tuple(cu_list), chunk, sub_chunk, str(device))
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        _LAYOUTS[key] = _build_layout(cu_list, chunk, sub_chunk, device)
    return _LAYOUTS[key]


def _build_layout(cu_list: list[int], chunk: int, sub_chunk: int, device: torch.device) -> Layout:
    rows = Packing(tuple(cu_list)).chunks(chunk)  # (sequence, t0, t1) of every chunk, in order
    counts = [int(c) for c in np.bincount(rows[:, 0], minlength=len(cu_list) - 1)]
    offsets = [0, *itertools.accumulate(counts)]
    info = [
        (int(t0), int(t1), g, i, int(t0) - cu_list[n])
        for g, (n, t0, t1) in enumerate(rows)
        for i in range(-(-(t1 - t0) // sub_chunk))
    ]
    to = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    lengths = [b - a for a, b in itertools.pairwise(cu_list)]
    return Layout(
        to(cu_list),
        to(offsets),
        to(rows[:, 1:].tolist()).reshape(-1, 2),
        to(info).reshape(-1, 5),
        len(cu_list) - 1,
        offsets[-1],
        len(info),
        max(lengths),
    )


def sequences(name: str, x: torch.Tensor, packing: Packing | None) -> list[int]:
    """Sequence offsets on the flat token axis of x [B, T, ...] as a Python list.

    The public ops check the offsets (``checks.read_values``, the one rule of
    :mod:`attnspec.reference.packing`) and drop zero-length sequences before the kernels, so the
    launchers only assert what they rely on: offsets from 0 to T, strictly increasing, B = 1."""
    B, T = x.shape[:2]
    if packing is None:
        return [i * T for i in range(B + 1)]
    offsets = list(packing.offsets)
    assert B == 1 and offsets[0] == 0 and offsets[-1] == T, f"{name}: offsets {offsets}"
    assert all(a < b for a, b in itertools.pairwise(offsets)), "zero-length sequences dropped"
    return offsets


def check_inputs(
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    widths: Sequence[int | None] | None = None,
) -> None:
    """Assert the launchers' invariants: [B, T, H, *] with matching B, T, H (and the given last
    widths), one dtype, one device. User input is checked once, by the public ops
    (:mod:`.checks`); these asserts guard direct calls of the kernels."""
    ref = tensors[0]
    assert ref.ndim == 4 and ref.shape[1] >= 1, f"{names[0]}: {tuple(ref.shape)}"
    for name, x, width in zip(names, tensors, widths or [None] * len(names), strict=True):
        expected = (*ref.shape[:3], width if width is not None else x.shape[-1])
        assert tuple(x.shape) == expected, f"{name}: {tuple(x.shape)}, expected {expected}"
        assert x.dtype == ref.dtype and x.device == ref.device, f"{name}: {x.dtype}, {x.device}"


def check_param(name: str, x: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    """Assert an SSM parameter or state's shape (re, im last), device and float32-or-wider
    dtype (its values are checked by the ops)."""
    assert tuple(x.shape) == shape, f"{name}: {tuple(x.shape)}, expected {shape}"
    assert x.device == device and x.dtype in (torch.float32, torch.float64), f"{name}: {x.dtype}"


def check_cotangent(name: str, x: torch.Tensor, like: torch.Tensor) -> None:
    """Assert a cotangent has the shape, dtype and device of the output it belongs to."""
    assert (x.shape, x.dtype, x.device) == (like.shape, like.dtype, like.device), name


# Device side


@triton.jit
def sub_chunk(sub_info: tl.tensor, i_p: tl.tensor) -> tuple[tl.tensor, ...]:
    """Row i_p of the sub-chunk table: (chunk start t0, chunk end t1, global chunk g,
    sub-chunk index i_s, position of t0 in its sequence)."""
    row = sub_info + i_p * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def channel_block(
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
def load_rows(
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
def store_rows(
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
    :func:`load_rows`), in the tensor's dtype."""
    ptr = dst + (tok.to(tl.int64)[:, None] * H + i_h) * W + o_d[None, :]
    tl.store(ptr, x.to(dst.dtype.element_ty), mask=m_t[:, None] & (o_d < W)[None, :])


@triton.jit
def load_modes(
    buf: tl.tensor, tok: tl.tensor, i_h: tl.tensor, H: tl.tensor, m_t: tl.tensor, BM: tl.constexpr
) -> tuple[tl.tensor, tl.tensor]:
    """Rows tok of a per-token mode buffer [T, H, 2, BM]: (re, im) [BS, BM]."""
    ptr = buf + (tok.to(tl.int64)[:, None] * H + i_h) * 2 * BM + tl.arange(0, BM)[None, :]
    return (
        tl.load(ptr, mask=m_t[:, None], other=0.0),
        tl.load(ptr + BM, mask=m_t[:, None], other=0.0),
    )


@triton.jit
def store_modes(
    buf: tl.tensor,
    re: tl.tensor,
    im: tl.tensor,
    tok: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    m_t: tl.tensor,
    BM: tl.constexpr,
) -> None:
    """The mirror of :func:`load_modes`."""
    ptr = buf + (tok.to(tl.int64)[:, None] * H + i_h) * 2 * BM + tl.arange(0, BM)[None, :]
    tl.store(ptr, re, mask=m_t[:, None])
    tl.store(ptr + BM, im, mask=m_t[:, None])


@triton.jit
def store_reload(
    buf: tl.tensor,
    x: tl.tuple,
    tok: tl.tensor,
    i_h: tl.tensor,
    H: tl.tensor,
    m_t: tl.tensor,
    BM: tl.constexpr,
) -> tl.tuple:
    """x = (re, im) [BS, BM] stored (:func:`store_modes`) and read back after a block barrier:
    the same values, but the products that computed x no longer feed a later tl.dot, so Triton
    lays their accumulators out over both warpgroups of a 64-row program (a chained wgmma gets
    every warp along its rows: twice the registers at 8 warps; docs/kernels-interdomain.md)."""
    store_modes(buf, x[0], x[1], tok, i_h, H, m_t, BM)
    tl.debug_barrier()  # every thread's stores visible to the whole block
    return load_modes(buf, tok, i_h, H, m_t, BM)


@triton.jit
def state_pairs(
    s0: tl.tensor,
    c_off: tl.tensor,
    W: tl.tensor,
    C: tl.tensor,
    M: tl.tensor,
    BD: tl.constexpr,
    BM: tl.constexpr,
    TRANS: tl.constexpr,
) -> tl.tuple:
    """Channels c_off..c_off+W of a complex state [M, C, 2]: (re, im) [BM, BD], or [BD, BM]
    if TRANS, loaded as one tile of (re, im) pairs and split: contiguous pairs, wider loads,
    fewer addresses."""
    o_d = tl.arange(0, BD)
    o_m = tl.arange(0, BM)
    o_2 = tl.arange(0, 2)[None, None, :]
    if TRANS:
        ptr = s0 + ((o_m[None, :] * C + c_off + o_d[:, None]) * 2)[:, :, None] + o_2
        mask = ((o_d < W)[:, None] & (o_m < M)[None, :])[:, :, None]
    else:
        ptr = s0 + ((o_m[:, None] * C + c_off + o_d[None, :]) * 2)[:, :, None] + o_2
        mask = ((o_m < M)[:, None] & (o_d < W)[None, :])[:, :, None]
    return tl.split(tl.load(ptr, mask=mask, other=0.0))
