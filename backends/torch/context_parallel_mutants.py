"""Wrong sharded implementations the context-parallel capability must catch.

Each is a :class:`attnspec.backends.torch.context_parallel.Sharding` that gets one identity of
docs/context_parallel.md wrong; everything else (the kernels, the collectives) is the correct
implementation, so the kit's verdict depends only on that identity. ``CAUGHT_BY`` names the ops
whose cases must fail, and the world size that exposes the mistake (an intermediate shard needs
at least three).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnspec.backends.torch.context_parallel import Sharding


class NoGapMinimum(Sharding):
    """(CP1) without the minima of the shards strictly between the key and the query shard."""

    def gap(self, mu: Tensor, argmu: Tensor, key: int, query: int) -> tuple[Tensor, Tensor]:
        return torch.full_like(mu[:, 0], float("inf")), torch.zeros_like(argmu[:, 0])


class FoXScanOffByOne(Sharding):
    """(CP3) the inclusive scan of the chunk totals: every chunk's walk starts one chunk late."""

    def scan(self, totals: Tensor) -> Tensor:
        return torch.cumsum(totals, dim=-1)


class StateNotCarried(Sharding):
    """(CP4) each shard starts from its left neighbour's final state only: the state is not
    carried through the shards before it."""

    def carry(self, decays: list[Any], finals: list[Tensor], keep: list[bool]) -> list[Tensor]:
        return [torch.zeros_like(finals[0]), *finals[:-1]]


MUTANTS: dict[str, Sharding] = {
    "no-gap-minimum": NoGapMinimum(),
    "fox-scan-off-by-one": FoXScanOffByOne(),
    "s4d-state-not-carried": StateNotCarried(),
}

CAUGHT_BY: dict[str, tuple[str, int]] = {
    "no-gap-minimum": ("fpa_attention", 4),
    "fox-scan-off-by-one": ("fox_attention", 2),
    "s4d-state-not-carried": ("interdomain_s4d", 4),
}
