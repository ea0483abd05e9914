"""Triton helpers shared by the kernel modules (as flash-linear-attention's
``fla/ops/utils/op.py``): the dtype of ``tl.dot``'s operands and its input precision for an
input dtype, and the interpreter's bfloat16 rounding.

Importing this module imports triton (``TRITON_INTERPRET=1`` must be set before, for the
interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WIDE = (torch.float32, torch.float64)  # inputs whose dots run in "ieee" precision


@triton.jit
def bf16_nearest(x: tl.tensor) -> tl.tensor:
    """float32 x rounded to the nearest bfloat16 (ties to even), kept in float32: what a GPU
    makes of a bfloat16 tl.dot operand. Used only under the interpreter, whose bfloat16
    arithmetic is wrong (so its dots run in float32) and whose conversion truncates. The sum is
    formed in 64 bits: the interpreter checks every narrower integer sum for overflow, which
    made this rounding the costliest step of the bf16 kernels there (3.7x slower)."""
    bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.uint32).to(tl.float32, bitcast=True)


def dot_dtype(dtype: torch.dtype, interpret: bool) -> tl.dtype:
    """Operand dtype of tl.dot: the input's, but float32 for bfloat16 under the interpreter,
    which stores bfloat16 as raw integers (arithmetic on them is wrong); computed operands are
    then rounded to bfloat16 first (ROUND_BF16), so the interpreter sees a GPU's rounding."""
    if dtype == torch.bfloat16:
        return tl.float32 if interpret else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32, torch.float64: tl.float64}[dtype]


def precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: "ieee" for float32 and float64 operands, whose tolerances TF32
    (10-bit mantissa) would break; 16-bit operands ignore it."""
    return "ieee" if dtype in WIDE else "tf32"
