"""Device classes of the Triton kernels: one test for the interpreter, one name per GPU kind.

Every Triton kernel family picks its row of the one tile table (``backends/tile_sizes.py``:
``TILE_TABLE``, ``DEVICE_BLOCKS``) by these names and has one override for tests
(``triton_fpa.forced_tiles``, ``triton_chunks.block_sizes``). The static Hopper gates compile at
the ``"hopper"`` rows.
"""

from __future__ import annotations

import os

import torch

from ..tile_sizes import DEVICE_CLASSES

__all__ = ["DEVICE_CLASSES", "device_class", "interpreting"]


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
