"""Padded batches as packed sequences: the tokens of every row, one after the other.

A 2-D attention mask [B, T] (1 = token, 0 = padding, on either side: transformers' form)
becomes ``cu_seqlens`` offsets of B packed sequences (B = 1, FlashAttention's convention), so
padded positions are not tokens for the parallel ops, as absent positions are not for the
decode sessions (F8 rows). The layers take it as ``padding=`` (:mod:`.modules`); made once per
forward, it reads the mask back to the host once, not once per layer.
"""

from __future__ import annotations

import torch
from torch import Tensor


class Padding:
    """The tokens of a padded batch, ``present`` [B, T] bool.

    Without padding nothing is packed (``cu_seqlens`` None, pack and unpack are the identity).
    """

    def __init__(self, present: Tensor, *, padded: bool | None = None):
        self.present = present  # [B, T] bool
        self.B, self.T = present.shape
        # whether any position is padding (a host sync; known without a mask)
        self.padded = not bool(present.all()) if padded is None else padded
        if self.padded:
            lengths = present.sum(dim=1)
            zero = lengths.new_zeros(1)
            self.cu_seqlens: Tensor | None = torch.cat([zero, lengths.cumsum(0)])
            self.index = present.flatten().nonzero().squeeze(1)  # the tokens, row-major
        else:
            self.cu_seqlens = None

    @classmethod
    def from_mask(cls, mask: Tensor | None, B: int, T: int, device: torch.device) -> Padding:
        """The tokens of a chunk of T positions: the last T columns of a 2-D mask
        ([B, T_total] of 0 / 1, generate()'s form), or all positions without one (then
        nothing is read back to the host: the forward compiles without graph breaks)."""
        if mask is None:
            return cls(torch.ones(B, T, dtype=torch.bool, device=device), padded=False)
        if mask.ndim != 2 or mask.shape[0] != B or mask.shape[1] < T:
            raise ValueError(
                f"attention_mask: expected a 2-D [batch, positions >= {T}] mask of 0 and 1 for"
                f" a batch of {B}, got shape {tuple(mask.shape)}"
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask: expected 0 (padding) and 1 (token) only")
        return cls(mask[:, -T:].to(device=device, dtype=torch.bool))

    def pack(self, x: Tensor) -> Tensor:
        """x [B, T, ...] -> [1, N, ...] (the N tokens), or x itself without padding."""
        if not self.padded:
            return x
        return x.flatten(0, 1)[self.index][None]

    def unpack(self, x: Tensor) -> Tensor:
        """[1, N, ...] -> [B, T, ...] with zeros at padding; the identity without padding."""
        if not self.padded:
            return x
        out = x.new_zeros(self.B * self.T, *x.shape[2:])
        out[self.index] = x[0]
        return out.view(self.B, self.T, *x.shape[2:])
