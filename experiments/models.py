"""Tiny sequence models for the experiments: token embedding, layers of one token mixer each,
a readout. The mechanisms are the project's layers; only the softmax baselines are written here.

Mixers by name:

- ``"fpa"``: :class:`~attnspec.backends.torch.FirstPassageAttention`, signed field increments and
  learned key levels (spec/fpa.md section 3); ``"fpa_foxinit"``: the FoX-initialised layer of
  that section (:func:`~.layers.fox_initialised_fpa`).
- ``"fox"``: :class:`~.layers.ForgettingAttention`, the projections of that layer with
  logsigmoid forget gates and the project's ``fox_attention`` op (F6).
- ``"softmax_alibi"``, ``"softmax_rope"``: :class:`SoftmaxAttention`, causal softmax attention
  (torch SDPA) with an ALiBi bias or a rotary embedding: the baselines.
- ``"interdomain"``: :class:`~attnspec.backends.torch.InterdomainAttention` (I8)-(I13), the
  paper's default denominator-free readout; ``"interdomain_ratio"``: the same layer with the
  optional ratio readout of (I13).
- ``"interdomain_noquery"``: :class:`~.layers.QueryFreeInterdomain`, the paper's ablation: the
  query features xi(q_t) replaced by one learned vector per head, so the readout of the state
  no longer depends on the query.
- ``"s4d_only"``: :class:`~.layers.QueryFreeInterdomain` with the key path removed as well: the
  state holds the S4D filter of the values and a fixed readout reads it (an SSM token mixer).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention
from attnspec.backends.torch.modules import FPALayerCache, rope

from .layers import ForgettingAttention, QueryFreeInterdomain, fox_initialised_fpa, projection

MIXERS = (
    "fpa",
    "fpa_foxinit",
    "fox",
    "softmax_alibi",
    "softmax_rope",
    "interdomain",
    "interdomain_ratio",
    "interdomain_noquery",
    "s4d_only",
)


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's head slopes 2^(-8 h / H), h = 1..H (Press et al. 2022)."""
    return 2.0 ** (-8.0 * torch.arange(1, n_heads + 1) / n_heads)


class SoftmaxAttention(nn.Module):
    """Causal softmax attention with a positional scheme: x [B, T, d] -> y [B, T, d].

    ``position="alibi"`` adds -slope_h (i - j) to the logits; ``"rope"`` rotates q and k
    (halves rotated, base 10000). Time O(B H T^2 dk), memory O(B H T^2) for the ALiBi bias.
    """

    slopes: Tensor

    def __init__(self, d_model: int, n_heads: int, head_dim: int, position: str):
        super().__init__()
        if position not in ("alibi", "rope"):
            raise ValueError(f"position: expected 'alibi' or 'rope', got {position!r}")
        if position == "rope" and head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {head_dim}")
        d, H, dk = d_model, n_heads, head_dim
        self.n_heads, self.head_dim, self.position = H, dk, position
        self.wq, self.wk, self.wv = (projection(d, H * dk) for _ in range(3))
        self.wo = projection(H * dk, d)
        self.register_buffer("slopes", alibi_slopes(H), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, d] -> y [B, T, d]."""
        B, T, _ = x.shape
        H, dk = self.n_heads, self.head_dim
        q, k, v = ((x @ w).view(B, T, H, dk) for w in (self.wq, self.wk, self.wv))
        positions = torch.arange(T, device=x.device)
        if self.position == "rope":
            q, k = rope(q, positions), rope(k, positions)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
        else:
            distance = (positions[:, None] - positions[None, :]).to(x.dtype)  # i - j
            bias = -self.slopes.to(x.dtype)[:, None, None] * distance  # [H, T, T]
            bias = bias.masked_fill(distance < 0, float("-inf"))
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias
            )
        return o.transpose(1, 2).reshape(B, T, H * dk) @ self.wo


def make_mixer(name: str, d_model: int, n_heads: int, head_dim: int, n_modes: int) -> nn.Module:
    """The token mixer ``name`` (one of :data:`MIXERS`) at these sizes."""
    if name == "fpa":
        return FirstPassageAttention(d_model, n_heads, head_dim)
    if name == "fpa_foxinit":
        return fox_initialised_fpa(d_model, n_heads, head_dim)
    if name == "fox":
        return ForgettingAttention(d_model, n_heads, head_dim)
    if name in ("softmax_alibi", "softmax_rope"):
        return SoftmaxAttention(d_model, n_heads, head_dim, name.removeprefix("softmax_"))
    if name in ("interdomain", "interdomain_ratio"):
        readout = "ratio" if name == "interdomain_ratio" else "linear"
        return InterdomainAttention(d_model, n_heads, head_dim, n_modes=n_modes, readout=readout)
    if name in ("interdomain_noquery", "s4d_only"):
        return QueryFreeInterdomain(
            d_model, n_heads, head_dim, n_modes, keys=name == "interdomain_noquery"
        )
    raise ValueError(f"mixer: expected one of {MIXERS}, got {name!r}")


class Block(nn.Module):
    """Pre-norm residual layer: x + mixer(norm(x)), then x + MLP(norm(x)) when mlp_hidden > 0."""

    def __init__(self, mixer: nn.Module, d_model: int, mlp_hidden: int):
        super().__init__()
        self.mixer = mixer
        self.norm1 = nn.RMSNorm(d_model)
        self.mlp: nn.Sequential | None = None
        if mlp_hidden > 0:
            self.norm2 = nn.RMSNorm(d_model)
            self.mlp = nn.Sequential(
                nn.Linear(d_model, mlp_hidden, bias=False),
                nn.GELU(),
                nn.Linear(mlp_hidden, d_model, bias=False),
            )

    def forward(self, x: Tensor, cache: FPALayerCache | None = None) -> Tensor:
        """x [B, T, d] -> [B, T, d]; with ``cache`` the (FPA) mixer runs as a decode prefill."""
        h = self.norm1(x)
        if cache is None:
            x = x + self.mixer(h)
        else:
            x = x + self.fpa().prefill(h, cache)
        if self.mlp is not None:
            x = x + self.mlp(self.norm2(x))
        return x

    def fpa(self) -> FirstPassageAttention:
        """The mixer, which must be an FPA layer (ValueError otherwise)."""
        if not isinstance(self.mixer, FirstPassageAttention):
            raise ValueError(f"mixer: expected an FPA layer, got {type(self.mixer).__name__}")
        return self.mixer


class TinyModel(nn.Module):
    """tokens [B, T] (int64) -> logits [B, T, n_out]: embedding, ``n_layers`` blocks of one mixer
    each, a final norm and a readout (linear, or an MLP with ``readout_hidden`` units).
    No positional embedding: position enters only through the mixers."""

    def __init__(
        self,
        vocab: int,
        n_out: int,
        *,
        mixer: str,
        d_model: int,
        n_layers: int,
        n_heads: int,
        head_dim: int,
        mlp_hidden: int = 0,
        readout_hidden: int = 0,
        n_modes: int = 16,
    ):
        super().__init__()
        if mixer not in MIXERS:
            raise ValueError(f"mixer: expected one of {MIXERS}, got {mixer!r}")
        self.mixer_name = mixer
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(
            Block(make_mixer(mixer, d_model, n_heads, head_dim, n_modes), d_model, mlp_hidden)
            for _ in range(n_layers)
        )
        self.norm = nn.RMSNorm(d_model)
        self.readout: nn.Module
        if readout_hidden > 0:
            self.readout = nn.Sequential(
                nn.Linear(d_model, readout_hidden), nn.GELU(), nn.Linear(readout_hidden, n_out)
            )
        else:
            self.readout = nn.Linear(d_model, n_out)

    def layers(self) -> list[Block]:
        """The blocks, typed."""
        return [block for block in self.blocks if isinstance(block, Block)]

    def forward(self, tokens: Tensor, caches: list[FPALayerCache] | None = None) -> Tensor:
        """With ``caches`` (from :meth:`new_caches`) each FPA layer runs as a decode prefill with
        its cache, evicting keys at depth >= theta (F7)."""
        x = self.embed(tokens)
        for i, block in enumerate(self.layers()):
            x = block(x, None if caches is None else caches[i])
        return self.readout(self.norm(x))

    def new_caches(self, theta: float) -> list[FPALayerCache]:
        """One empty (F7) decode cache per FPA layer, evicting at depth >= ``theta``."""
        if not self.mixer_name.startswith("fpa"):
            raise ValueError(
                f"mixer: decode caches need 'fpa' layers, this model has {self.mixer_name!r}"
            )
        return [block.fpa().new_cache(theta=theta) for block in self.layers()]


def parameter_count(model: nn.Module) -> int:
    """Number of trainable numbers in ``model``."""
    return sum(p.numel() for p in model.parameters())


def matched_mlp_hidden(build: Callable[[int], nn.Module], target: int) -> int:
    """The MLP width h that brings ``build(h)``'s parameter count nearest ``target`` (the count
    is linear in h: 2 d_model weights per unit and layer)."""
    one, two = parameter_count(build(1)), parameter_count(build(2))
    return max(1, 1 + round((target - one) / (two - one)))
