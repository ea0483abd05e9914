"""Device classes of the Triton kernels: one test for the interpreter, one name per GPU kind;
and the device guard of every Triton launch.

Every Triton kernel family picks its row of the one tile table (``backends/tile_sizes.py``:
``TILE_TABLE``, ``DEVICE_BLOCKS``) by these names and has one override for tests
(``triton_fpa.forced_tiles``, ``triton_chunks.block_sizes``). The static Hopper gates compile at
the ``"hopper"`` rows.

A Triton launch runs on the current CUDA device and its current stream, not on the device of
the tensors it is given: tensors on cuda:1 launched while cuda:0 is current would run on the
wrong GPU. :func:`guard` makes the tensors' device current around a launch (as torch's own ops
and FlashAttention's do); :mod:`.dispatch` enters it around every registered Triton kernel and
the paged session around its decode kernel.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ..tile_sizes import DEVICE_CLASSES

__all__ = ["DEVICE_CLASSES", "device_class", "guard", "interpreting"]


def guard(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)`` for a CUDA device (current for the block, the previous one
    restored after it), nothing for any other device."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def device_class(device: torch.device) -> str:
    """ "interpreter" (TRITON_INTERPRET set, or a CPU tensor, which only the interpreter runs),
    "hopper", "ampere" or "gpu": the row of a kernel family's tile table for ``device``."""
    if interpreting() or device.type != "cuda":
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return DEVICE_CLASSES.get(major, "gpu")
