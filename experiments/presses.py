"""KV-cache compression on the experiments' models, as keep masks (E4).

A decoder with a compressed cache lets query i attend to a subset S_i of the keys j <= i. Every
method here is written as that subset, a boolean keep mask [B, H, T, T] per layer, and the
model is run layer by layer with each layer's attention restricted to its mask: the outputs are
those of decoding token by token with the compressed cache (a key, once dropped, stays dropped;
the mask of a later layer is computed from the outputs of the compressed earlier layers).

The methods (each cites the paper it follows; none is kvpress's code, whose releases need a
transformers older than the project's):

- :class:`FullCache`: every key (the causal mask).
- :class:`DepthEviction`: FPA's own rule (spec/fpa.md F7): key j is dropped at the first query
  where its descent depth pi_ij reaches theta; pi_ij is non-decreasing in i, so the mask is
  pi_ij < theta. FoX is FPA with field = level, so the rule applies to FoX models too.
- :class:`SinkWindow`: StreamingLLM (Xiao et al. 2024, "Efficient streaming language models
  with attention sinks"): the first ``sinks`` keys and the most recent ones, C in all.
- :class:`HeavyHitter`: H2O (Zhang et al. 2023, "H2O: heavy-hitter oracle for efficient
  generative inference"): half the budget for the most recent keys, half for the keys with the
  largest attention received so far; token by token, the key with the least accumulated
  attention outside the recent half is dropped when the cache exceeds C.
- :class:`KnormThreshold`: kvpress's DMSPress over its KnormPress scorer (Devoto et al.
  2024, "A simple and effective L2 norm-based strategy for KV cache compression"): a key that
  leaves a sliding window of ``window`` tokens is dropped when its score -||k_j|| is below a
  per-layer threshold. The thresholds are set on calibration sequences to a target fraction;
  the fraction each head keeps then varies with the input (an adaptive budget).
- :class:`SnapKV` (Li et al. 2024, "SnapKV: LLM knows what you are looking for before
  generation"): a prompt method. The prompt's first ``context`` tokens are prefilled with the
  full cache; then each head keeps its ``window`` last context keys and the C - window others
  with the most attention from the window's queries (average-pooled over neighbouring keys),
  and the tokens after the context attend to those and to each other.

A budget C = round(fraction * T) keys per (layer, head) for a sequence of T tokens. The kept
fraction of a run is each head's largest live-key count over the rows where the method is in
force (all rows; SnapKV: the rows after the context), divided by T, averaged over layers, heads
and sequences (the E2 measure); ``peak`` is the same over every row, what a server allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnspec.backends.torch import FirstPassageAttention
from attnspec.backends.torch.checks import scale as softmax_scale
from attnspec.backends.torch.modules import rope

from .layers import ForgettingAttention
from .models import SoftmaxAttention, TinyModel


@dataclass
class AttentionInputs:
    """One layer's attention, head-major: q, k [B, H, T, dk] (q scaled), v [B, H, T, dv]; the
    additive bias [B, H, T, T] of the mechanism (zero for softmax + RoPE; -pi for FPA; the
    decay sum for FoX), valid on j <= i; the descent depth pi [B, H, T, T] for models with a
    field (FPA, FoX), else None; the layer's output projection wo [H dv, d]."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Tensor
    depth: Tensor | None
    wo: Tensor


def descent_depth(field: Tensor, level: Tensor) -> Tensor:
    """(F1)-(F2) pi_ij = max(0, level_j - min_{j < t <= i} field_t), zero on and above the
    diagonal: field, level [..., T] -> [..., T, T]. Differentiable (the penalty of E4's
    ablation trains through it). Time and memory O(T^2) per leading index: row i holds
    field_t for t <= i, a suffix minimum along t gives min_{t >= j + 1} in one pass."""
    T = field.shape[-1]
    ahead = torch.ones(T, T, dtype=torch.bool, device=field.device).triu(1)  # t > i
    rows = field[..., None, :].expand(*field.shape[:-1], T, T).masked_fill(ahead, math.inf)
    suffix = rows.flip(-1).cummin(-1).values.flip(-1)  # [i, t]: min over t' >= t
    inf = torch.full_like(suffix[..., :1], math.inf)
    segment = torch.cat([suffix[..., 1:], inf], dim=-1)  # [i, j]: min over j < t <= i
    return torch.clamp(level[..., None, :] - segment, min=0.0)


def attention_inputs(mixer: torch.nn.Module, h: Tensor) -> AttentionInputs:
    """The attention of one of the experiments' mixers (FPA, FoX, softmax + RoPE) on its input
    h [B, T, d], computed from the layer's own projections."""
    B, T, _ = h.shape
    if isinstance(mixer, FirstPassageAttention):
        q, k, v, delta, offset = mixer._projections(h)
        field = torch.cumsum(delta, dim=1).transpose(1, 2)  # [B, H, T]
        level = field if offset is None else field + offset.transpose(1, 2)
        depth = descent_depth(field, level)
        s = softmax_scale(mixer.scale, mixer.head_dim)
        bias, wo = -depth, mixer.wo
    elif isinstance(mixer, ForgettingAttention):
        H, dk = mixer.n_heads, mixer.head_dim
        q, k, v = ((h @ w).view(B, T, H, dk) for w in (mixer.wq, mixer.wk, mixer.wv))
        wide = torch.promote_types(h.dtype, torch.float32)  # as the layer computes the gates
        log_f = F.logsigmoid((h @ mixer.w_f + mixer.b_f).to(wide))
        total = torch.cumsum(log_f, dim=1).transpose(1, 2)  # [B, H, T]
        bias = total[..., :, None] - total[..., None, :]  # sum_{l = j+1..i} log f_l
        depth = torch.clamp(-bias, min=0.0)  # (F6): field = level, pi_ij = -D_ij for j <= i
        s, wo = 1.0 / math.sqrt(dk), mixer.wo
    elif isinstance(mixer, SoftmaxAttention) and mixer.position == "rope":
        H, dk = mixer.n_heads, mixer.head_dim
        q, k, v = ((h @ w).view(B, T, H, dk) for w in (mixer.wq, mixer.wk, mixer.wv))
        positions = torch.arange(T, device=h.device)
        q, k = rope(q, positions), rope(k, positions)
        bias = torch.zeros(B, H, T, T, dtype=h.dtype, device=h.device)
        depth = None
        s, wo = 1.0 / math.sqrt(dk), mixer.wo
    else:
        raise ValueError(
            f"mixer: expected an FPA, FoX or softmax + RoPE layer, got {type(mixer).__name__}"
        )
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return AttentionInputs(q * s, k, v, bias, depth, wo)


def causal(T: int, device: torch.device | None = None) -> Tensor:
    """[T, T] boolean, True where j <= i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


def logits(inputs: AttentionInputs) -> Tensor:
    """s <q_i, k_j> + bias_ij, [B, H, T, T] (j > i not masked)."""
    return inputs.q @ inputs.k.transpose(-1, -2) + inputs.bias


def weights(scores: Tensor, keep: Tensor) -> Tensor:
    """Softmax of ``scores`` over the kept keys; every row keeps at least its own key."""
    return torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1)


def budget(fraction: float, T: int, least: int = 1) -> int:
    """C = round(fraction * T) keys, at least ``least`` and at most T."""
    return min(T, max(least, round(fraction * T)))


class Press:
    """A compression method: ``keep(inputs, layer)`` gives the keep mask [B, H, T, T] of one
    layer; ``first_row(T)`` is the first row where the method is in force (0: streaming)."""

    name = "press"
    streaming = True

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        raise NotImplementedError

    def first_row(self, T: int) -> int:
        return 0


class FullCache(Press):
    """Every key."""

    name = "full"

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        T = inputs.q.shape[-2]
        return causal(T, inputs.q.device).expand(*inputs.q.shape[:2], T, T)


class DepthEviction(Press):
    """FPA's rule (F7): keep key j at query i while pi_ij < theta (the key's own row always)."""

    name = "depth"

    def __init__(self, theta: float):
        if not theta > 0:
            raise ValueError(f"theta: expected a positive threshold, got {theta}")
        self.theta = theta

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        if inputs.depth is None:
            raise ValueError("model: depth eviction needs a field (FPA or FoX layers)")
        T = inputs.q.shape[-2]
        return causal(T, inputs.q.device) & (inputs.depth < self.theta)


class SinkWindow(Press):
    """StreamingLLM: the first ``sinks`` keys and the C - sinks most recent."""

    name = "streaming_llm"

    def __init__(self, fraction: float, sinks: int = 4):
        self.fraction, self.sinks = fraction, sinks

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        T = inputs.q.shape[-2]
        C = budget(self.fraction, T, least=self.sinks + 1)
        i = torch.arange(T, device=inputs.q.device)
        recent = (i[:, None] - i[None, :]) < C - self.sinks
        keep = causal(T, inputs.q.device) & (recent | (i[None, :] < self.sinks))
        return keep.expand(*inputs.q.shape[:2], T, T)


class HeavyHitter(Press):
    """H2O: the C // 2 most recent keys and, of the others, those with the most attention
    received so far (summed over the queries that saw them), C in all; token by token."""

    name = "h2o"

    def __init__(self, fraction: float):
        self.fraction = fraction

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        B, H, T, _ = inputs.q.shape
        C = budget(self.fraction, T, least=2)
        recent = C // 2
        scores = logits(inputs)
        device = inputs.q.device
        live = torch.zeros(B, H, T, dtype=torch.bool, device=device)
        received = torch.zeros(B, H, T, dtype=scores.dtype, device=device)
        rows = []
        j = torch.arange(T, device=device)
        for i in range(T):
            live[..., i] = True
            if i + 1 > C:  # one key too many: drop the lightest outside the recent window
                candidates = live & (j < i + 1 - recent)
                lightest = received.masked_fill(~candidates, math.inf).argmin(-1, keepdim=True)
                live = live.scatter(-1, lightest, False)
            rows.append(live.clone())
            received = received + weights(scores[..., i, :], live)
        return torch.stack(rows, dim=-2)


class KnormThreshold(Press):
    """kvpress's DMSPress(KnormPress): keys leaving the last ``window`` tokens are dropped
    when -||k_j|| < the layer's threshold (``thresholds[layer]``, from :func:`calibrate_knorm`)."""

    name = "knorm_threshold"

    def __init__(self, thresholds: list[float], window: int = 8):
        self.thresholds, self.window = thresholds, window

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        T = inputs.q.shape[-2]
        i = torch.arange(T, device=inputs.q.device)
        recent = (i[:, None] - i[None, :]) < self.window
        passes = -inputs.k.norm(dim=-1) >= self.thresholds[layer]  # [B, H, T]
        return causal(T, inputs.q.device) & (recent | passes[..., None, :])


class SnapKV(Press):
    """SnapKV on a prompt of ``context`` tokens: full cache while prefilling it; then each head
    keeps the context's last ``window`` keys and the C - window others with the most attention
    from those window queries (average-pooled over ``kernel`` neighbouring keys)."""

    name = "snapkv"
    streaming = False

    def __init__(self, fraction: float, context: int, window: int = 8, kernel: int = 5):
        self.fraction, self.context, self.window, self.kernel = fraction, context, window, kernel

    def first_row(self, T: int) -> int:
        return self.context

    def keep(self, inputs: AttentionInputs, layer: int) -> Tensor:
        B, H, T, _ = inputs.q.shape
        c = self.context
        if not 0 < c < T:
            raise ValueError(f"context: expected 0 < context < T = {T}, got {c}")
        C = budget(self.fraction, c, least=1)
        w = max(1, min(self.window, C // 2))
        full = causal(T, inputs.q.device)
        observed = weights(logits(inputs)[..., c - w : c, :c], full[c - w : c, :c])
        votes = observed.sum(-2)  # [B, H, c]
        votes = F.avg_pool1d(
            votes.reshape(B * H, 1, c), self.kernel, stride=1, padding=self.kernel // 2
        ).reshape(B, H, c)
        votes[..., c - w :] = math.inf  # the window is always kept
        chosen = votes.topk(C, dim=-1).indices
        kept = torch.zeros(B, H, c, dtype=torch.bool, device=inputs.q.device)
        kept = kept.scatter(-1, chosen, True)
        mask = full.expand(B, H, T, T).clone()
        mask[..., c:, :c] = kept[..., None, :]
        return mask


@dataclass
class Compressed:
    """A compressed run: logits [B, T, vocab]; live keys per row [layers, B, H, T]."""

    logits: Tensor
    live: Tensor


def compressed_forward(model: TinyModel, tokens: Tensor, press: Press) -> Compressed:
    """The model on tokens [B, T] with every layer's attention restricted to the press's keep
    mask (computed from that layer's inputs, which come from the compressed layers below)."""
    x = model.embed(tokens)
    live = []
    for index, block in enumerate(model.layers()):
        inputs = attention_inputs(block.mixer, block.norm1(x))
        keep = press.keep(inputs, index)
        a = weights(logits(inputs), keep)
        o = (a @ inputs.v).transpose(1, 2)  # [B, T, H, dv]
        x = x + o.reshape(*x.shape[:2], -1) @ inputs.wo
        if block.mlp is not None:
            x = x + block.mlp(block.norm2(x))
        live.append(keep.sum(-1))
    return Compressed(model.readout(model.norm(x)), torch.stack(live))


def kept_fractions(live: Tensor, first_row: int = 0) -> Tensor:
    """Per (layer, head): the largest live-key count over rows >= first_row, divided by T,
    averaged over the sequences; live [layers, B, H, T] -> [layers, H]."""
    T = live.shape[-1]
    return (live[..., first_row:].amax(-1).double() / T).mean(1)


def calibrate_knorm(model: TinyModel, tokens: Tensor, fraction: float) -> list[float]:
    """Per layer, the threshold on -||k|| that a fraction ``fraction`` of the keys pass in a
    full-cache run on ``tokens`` (the calibration sequences)."""
    thresholds: list[float] = []
    x = model.embed(tokens)
    with torch.no_grad():
        for block in model.layers():
            inputs = attention_inputs(block.mixer, block.norm1(x))
            scores = -inputs.k.norm(dim=-1).flatten().double()
            thresholds.append(float(torch.quantile(scores, 1.0 - fraction)))
            keep = FullCache().keep(inputs, 0)
            o = (weights(logits(inputs), keep) @ inputs.v).transpose(1, 2)
            x = x + o.reshape(*x.shape[:2], -1) @ inputs.wo
            if block.mlp is not None:
                x = x + block.mlp(block.norm2(x))
    return thresholds
