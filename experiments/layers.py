"""Layers the torch backend does not ship, built from its modules and ops (nothing here
reimplements a mechanism):

- :class:`ForgettingAttention`: a FoX layer, the projections of
  :class:`~attnspec.backends.torch.FirstPassageAttention` with logsigmoid forget gates and no
  key offsets, computed by the project's ``fox_attention`` op (F6).
- :class:`QueryFreeInterdomain`: :class:`~attnspec.backends.torch.InterdomainAttention` with its
  query-conditioned path removed (the paper's ablation), and optionally its key path too.
- :func:`fox_initialised_fpa`: the FoX-initialised FPA layer of spec/fpa.md section 3
  (logsigmoid increments and lam = 0), which the module offers only with random key offsets.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention, fox_attention
from attnspec.backends.torch.modules import short_conv
from attnspec.backends.torch.ops import s4d_pairs


def projection(d_in: int, d_out: int) -> nn.Parameter:
    """normal / sqrt(fan-in), as the project's layers initialise their projections."""
    return nn.Parameter(torch.randn(d_in, d_out) / math.sqrt(d_in))


class ForgettingAttention(nn.Module):
    """FoX: x [B, T, d] -> y [B, T, d]; per head log f_t = logsigmoid(x_t w_f + b_f) and the
    project's :func:`~attnspec.backends.torch.fox_attention` (F6). Parameters as
    FirstPassageAttention's, less the key offsets. Time O(B H T^2 dk), memory O(T * block)."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int):
        super().__init__()
        d, H, dk = d_model, n_heads, head_dim
        self.n_heads, self.head_dim = H, dk
        self.wq, self.wk, self.wv = (projection(d, H * dk) for _ in range(3))
        self.wo = projection(H * dk, d)
        self.w_f = projection(d, H)
        self.b_f = nn.Parameter(torch.zeros(H))

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, d] -> y [B, T, d]."""
        B, T, _ = x.shape
        H, dk = self.n_heads, self.head_dim
        q, k, v = ((x @ w).view(B, T, H, dk) for w in (self.wq, self.wk, self.wv))
        wide = torch.promote_types(x.dtype, torch.float32)  # gates in float32 or wider
        log_f = F.logsigmoid((x @ self.w_f + self.b_f).to(wide))  # [B, T, H]
        o = fox_attention(q, k, v, log_f)
        return o.reshape(B, T, H * dk) @ self.wo


class QueryFreeInterdomain(InterdomainAttention):
    """The Interdomain layer with its query-conditioned path removed (the paper's ablation):
    xi(q_t) -> xi(w_h), one learned vector per head, so every token reads the state alike.

    With ``keys=False`` the key path goes too (k~_t from one learned vector per head): the state
    then carries the S4D filter of the values, read by a fixed readout, an SSM token mixer
    ("S4D-only"). The state size stays that of the full layer. Time O(B T H M (R + dv + M)).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, n_modes: int, *, keys: bool):
        super().__init__(d_model, n_heads, head_dim, n_modes=n_modes)
        self.keys = keys
        del self.wq, self.conv_q  # no query projection, no query conv
        self.query = nn.Parameter(torch.randn(n_heads * head_dim))
        if not keys:
            del self.wk, self.conv_k
            self.key = nn.Parameter(torch.randn(n_heads * head_dim))

    def forward(
        self, x: Tensor, *, cu_seqlens: Tensor | None = None, impl: str | None = None
    ) -> Tensor:
        """x [B, T, d] -> y [B, T, d]; ``impl`` as the parent's (packed sequences are not
        supported: ``cu_seqlens`` must be None)."""
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens: expected None, the query-free layer has no packed form")
        B, T, _ = x.shape
        positions = torch.arange(T, device=x.device)
        q = self.query.expand(B, T, -1)  # the same "query" at every token
        if self.keys:
            k = short_conv(x @ self.wk, self.conv_k, positions)  # (I8)
        else:
            k = self.key.expand(B, T, -1)
        fq, kt, vt = self._features(x, q, k, positions)  # (I9), (I10)
        lam, b, c = self.ssm_parameters()
        o, _ = s4d_pairs(fq, kt, vt, lam, b, c, readout=self.readout, impl=impl)  # (I11)-(I13)
        return self._output(x, o)


def fox_initialised_fpa(d_model: int, n_heads: int, head_dim: int) -> FirstPassageAttention:
    """spec/fpa.md section 3: delta = logsigmoid(x w_delta + b_delta) and lam = 0 at
    initialisation (w_lam = b_lam = 0, both learned afterwards), so the layer starts as FoX (F6).
    The field cannot rise: phi is non-increasing, and pi_ij = max(0, phi_j + lam_j - phi_i)."""
    layer = FirstPassageAttention(d_model, n_heads, head_dim, increments="logsigmoid")
    with torch.no_grad():
        layer.w_lam.zero_()
        layer.b_lam.zero_()
    return layer
