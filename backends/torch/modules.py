"""The two layers as ``nn.Module``s, with the parameter names and shapes of the reference layers.

:class:`FirstPassageAttention` is ``attnspec.reference.fpa.fpa_layer`` (spec/fpa.md section 3)
and :class:`InterdomainAttention` is ``attnspec.reference.interdomain.interdomain_layer``
((I8)-(I14)). ``from_reference_params`` takes the reference's parameter dicts
(``init_fpa_params``, ``init_interdomain_params``); weights multiply from the right
(``x @ wq``), as there. Both take ``cu_seqlens`` for packed sequences (B = 1) and decode one
token at a time with a cache (``new_cache``, ``step``, ``prefill``); the FPA layer also takes
padded rows (``padding``, :class:`.padding.Padding`) and opens batched decode sessions (F8, F9).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnspec.reference import hippo
from attnspec.reference.fpa import FPA_PARAMETER_SCHEMA, fpa_parameter_shapes
from attnspec.reference.interdomain import PARAMETER_SCHEMA as INTERDOMAIN_PARAMETER_SCHEMA
from attnspec.reference.interdomain import interdomain_parameter_shapes
from attnspec.reference.validation import positive_int

from . import checks
from .decode import FPADecodeCache, S4DDecodeState
from .ops import fox_attention, fpa_attention, s4d_pairs
from .padding import Padding
from .paged import Attention, PagedFPASession, paged_attention_eager

Device = torch.device | str | None


def _tensors(params: Mapping[str, object], names: Iterable[str]) -> dict[str, Tensor]:
    """The named entries of a reference parameter dict (NumPy arrays or tensors) as tensors."""
    out = {}
    for name in names:
        x = params[name]
        t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
        if not t.is_floating_point():
            raise ValueError(f"params[{name!r}]: expected a real floating array, got {t.dtype}")
        out[name] = t
    return out


def _load(
    layer: nn.Module,
    tensors: dict[str, Tensor],
    shapes: dict[str, tuple[int, ...]],
    device: Device,
    dtype: torch.dtype | None,
) -> None:
    """Copy ``tensors`` into the layer's parameters, checking each shape against the schema."""
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"params[{name!r}]: expected shape {shape}, got {tuple(t.shape)}")
        value = t.detach().to(device=device, dtype=dtype or t.dtype).clone()
        setattr(layer, name, nn.Parameter(value))


def _positions(cu_seqlens: Tensor | None, T: int, device: Device) -> Tensor:
    """Each token's position in its own sequence: [T] (packed sequences restart at 0)."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    return t - starts[torch.searchsorted(starts, t, right=True) - 1]


def _check_x(
    x: Tensor, layer: FirstPassageAttention | InterdomainAttention, ndim: int = 3
) -> Tensor:
    """x [B, T, d_model] (or [B, d_model] for a step): the layer's width, its dtype (unless
    autocast is on, which casts the projections), finite values."""
    meaning = "[B, T, d_model]" if ndim == 3 else "[B, d_model]"
    x = checks.tensor("x", x, ndim, checks.QKV_DTYPES, meaning)
    d = layer.d_model
    if x.shape[-1] != d:
        raise ValueError(f"x: expected d_model = {d} features, got shape {tuple(x.shape)}")
    if ndim == 3 and x.shape[1] < 1:
        raise ValueError(f"x: expected T >= 1, got shape {tuple(x.shape)}")
    dtype = next(layer.parameters()).dtype
    if x.dtype != dtype and not _autocast_casts(x, dtype):
        raise ValueError(
            f"x: expected the layer's dtype {dtype}, got {x.dtype} (cast x or the layer)"
        )
    # meta tensors carry no values; under torch.compile the check would be a graph break (a
    # host read of the values), so compiled code skips it, as a CUDA graph capture does
    # (checks.values_checked)
    if x.device.type != "meta" and checks.values_checked():
        checks.finite("x", x)
    return x


def _autocast_casts(x: Tensor, dtype: torch.dtype) -> bool:
    """Whether autocast is on for x's device (meta: never) and casts a layer of ``dtype``."""
    if x.device.type == "meta" or dtype == torch.float64:
        return False
    return torch.is_autocast_enabled(x.device.type)


def _check_sizes(**sizes: int | None) -> None:
    """The layer's sizes (d_model, n_heads, head_dim, ...): integers >= 1 (None: a default)."""
    for name, value in sizes.items():
        if value is not None:
            positive_int(name, value)


def _check_padding(padding: Padding | None, cu_seqlens: Tensor | None, x: Tensor) -> None:
    """``padding`` (a :class:`.padding.Padding` of x's rows and positions) or ``cu_seqlens``."""
    if padding is None:
        return
    if cu_seqlens is not None:
        raise ValueError("padding: give padding (padded rows) or cu_seqlens (packed), not both")
    if not isinstance(padding, Padding) or tuple(padding.present.shape) != tuple(x.shape[:2]):
        got = tuple(padding.present.shape) if isinstance(padding, Padding) else type(padding)
        raise ValueError(
            f"padding: expected a Padding of x's [B, T] = {tuple(x.shape[:2])}, got {got}"
        )


def _check_batch(x: Tensor, cached: Tensor | None) -> None:
    """A decode step's x [B, d] against the batch its cache or state holds."""
    if cached is not None and cached.shape[0] != x.shape[0]:
        raise ValueError(
            f"x: expected the batch of the decode cache, B = {cached.shape[0]}, got "
            f"{x.shape[0]} (a new batch needs new_cache())"
        )


# First Passage Attention


@dataclass
class FPALayerCache:
    """Decode state of :class:`FirstPassageAttention`: the (F7) cache and the running field."""

    attention: FPADecodeCache
    field: Tensor | None = None  # [B, H] phi of the last token


class FirstPassageAttention(nn.Module):
    """Multi-head FPA layer, spec/fpa.md section 3: x [B, T, d] -> y [B, T, d].

    Per query head: field increments delta_t = x_t w_delta + b_delta (``increments=
    "logsigmoid"``: logsigmoid of that, <= 0), phi = cumsum(delta) in float32 (float64 for
    float64 weights), levels l_j = phi_j + x_j w_lam + b_lam (``key_offsets=False``: l = phi,
    no w_lam and b_lam), then (F1)-(F5) within the (F3w) window and the output projection.
    Logsigmoid increments with key offsets at 0 are the FoX-initialised layer; without key
    offsets the layer is the Forgetting Transformer's (F6), computed by ``fox_attention``.

    Args:
        d_model, n_heads, head_dim: width d, query heads HQ, query/key dim dk.
        value_dim: dv (default head_dim).
        n_kv_heads: key/value heads H, a divisor of n_heads (GQA: wk, wv are (d, H dk) and
            (d, H dv); default n_heads).
        increments: "signed" or "logsigmoid".
        key_offsets: whether levels have learned offsets (w_lam, b_lam) from the field.
        window: (F3w) each query sees its last ``window`` tokens (None: all).
        scale: softmax scale (default 1/sqrt(dk)).
    """

    # the reference's parameters (FPA_PARAMETER_SCHEMA), registered in __init__
    wq: nn.Parameter
    wk: nn.Parameter
    wv: nn.Parameter
    wo: nn.Parameter
    w_delta: nn.Parameter
    b_delta: nn.Parameter
    w_lam: nn.Parameter  # with key offsets
    b_lam: nn.Parameter

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        *,
        n_kv_heads: int | None = None,
        increments: str = "signed",
        key_offsets: bool = True,
        window: int | None = None,
        scale: float | None = None,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if increments not in ("signed", "logsigmoid"):
            raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
        if not isinstance(key_offsets, bool):
            raise ValueError(f"key_offsets: expected True or False, got {key_offsets!r}")
        _check_sizes(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            n_kv_heads=n_kv_heads,
            window=window,
        )
        H = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads % H:
            raise ValueError(f"n_kv_heads: expected a divisor of n_heads = {n_heads}, got {H}")
        dv = head_dim if value_dim is None else value_dim
        self.d_model, self.n_heads, self.head_dim, self.value_dim = d_model, n_heads, head_dim, dv
        self.n_kv_heads, self.window = H, window
        self.increments, self.key_offsets, self.scale = increments, key_offsets, scale
        self._make_parameters(device, dtype)

    def _make_parameters(self, device: Device, dtype: torch.dtype | None) -> None:
        """The parameters of :meth:`parameter_shapes`: normal / sqrt(fan-in), as
        init_fpa_params, and zero biases."""
        fan_in = {"wo": self.n_heads * self.value_dim}
        for name, shape in self.parameter_shapes().items():
            if name.startswith("b_"):
                init = torch.zeros(shape)
            else:
                init = torch.randn(shape) / math.sqrt(fan_in.get(name, self.d_model))
            self.register_parameter(name, nn.Parameter(init.to(device=device, dtype=dtype)))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The reference's shapes (``fpa_parameter_shapes``) for this layer's sizes, wk and wv
        with n_kv_heads heads, no w_lam and b_lam without key offsets."""
        d, H, dk, dv = self.d_model, self.n_kv_heads, self.head_dim, self.value_dim
        shapes = fpa_parameter_shapes(d, self.n_heads, dk, dv) | {
            "wk": (d, H * dk),
            "wv": (d, H * dv),
        }
        if not self.key_offsets:
            del shapes["w_lam"], shapes["b_lam"]
        return shapes

    @classmethod
    def from_reference_params(
        cls,
        params: Mapping[str, object],
        *,
        n_kv_heads: int | None = None,
        increments: str = "signed",
        key_offsets: bool = True,
        window: int | None = None,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> FirstPassageAttention:
        """A layer holding ``params`` (the dict of ``init_fpa_params``: NumPy arrays or tensors;
        w_lam and b_lam only with key offsets, wk and wv of n_kv_heads heads)."""
        names = [n for n in FPA_PARAMETER_SCHEMA if key_offsets or n not in ("w_lam", "b_lam")]
        missing = sorted(set(names) - set(params))
        if missing:
            raise ValueError(f"params: missing {missing}; see FPA_PARAMETER_SCHEMA")
        tensors = _tensors(params, names)
        H = tensors["b_delta"].shape[0]
        d, width = tensors["wq"].shape
        dv = tensors["wv"].shape[1] // (H if n_kv_heads is None else max(n_kv_heads, 1))
        layer = cls(
            d,
            H,
            width // H,
            dv,
            n_kv_heads=n_kv_heads,
            increments=increments,
            key_offsets=key_offsets,
            window=window,
            device="meta",
        )
        _load(layer, tensors, layer.parameter_shapes(), device, dtype)
        return layer

    @property
    def fox(self) -> bool:
        """Whether the layer is FoX (F6): logsigmoid increments, levels on the field."""
        return self.increments == "logsigmoid" and not self.key_offsets

    def _product(self, x: Tensor, name: str) -> Tensor:
        """x times the projection ``name`` of FPA_PARAMETER_SCHEMA (wq, wk, wv, wo; w_delta and
        w_lam plus their biases), in x's dtype: the one place the weights are multiplied."""
        if name in ("w_delta", "w_lam"):
            bias = getattr(self, "b" + name[1:])
            return x @ getattr(self, name).to(x.dtype) + bias.to(x.dtype)
        return x @ getattr(self, name)

    def _projections(
        self, x: Tensor, wide_field: bool = False
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """q [B, T, HQ, dk], k and v [B, T, H, .] in x's dtype; the field increments and key
        offsets [B, T, HQ] (None without key offsets) in float32 (float64 for float64 x), from
        x's dtype or (``wide_field``: the kit's decode sessions, whose evictions it counts
        exactly) from x and the weights widened first."""
        B, T, _ = x.shape
        HQ, H, dk, dv = self.n_heads, self.n_kv_heads, self.head_dim, self.value_dim
        q = self._product(x, "wq").view(B, T, HQ, dk)
        k = self._product(x, "wk").view(B, T, H, dk)
        v = self._product(x, "wv").view(B, T, H, dv)
        wide = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(wide) if wide_field else x
        delta = self._product(xf, "w_delta").to(wide)
        if self.increments == "logsigmoid":
            delta = F.logsigmoid(delta)
        # lam_j: levels relative to the field
        offset = self._product(xf, "w_lam").to(wide) if self.key_offsets else None
        return q, k, v, delta, offset

    def forward(
        self,
        x: Tensor,
        *,
        cu_seqlens: Tensor | None = None,
        padding: Padding | None = None,
        impl: str | None = None,
    ) -> Tensor:
        """x [B, T, d] -> y [B, T, d]; packed sequences by ``cu_seqlens`` (B = 1), or padded
        rows by ``padding`` (the positions it marks absent are not tokens: no key, no field
        increment, output 0).

        Time O(B H T^2 (dk + dv) + B T d H (dk + dv)); memory O(T * block) in the attention.
        """
        x = _check_x(x, self)
        _check_padding(padding, cu_seqlens, x)
        q, k, v, delta, offset = self._projections(x)
        if padding is not None:  # padding does not move the field
            delta = delta * padding.present[..., None]
            cu_seqlens = padding.cu_seqlens
            pack = padding.pack
        else:
            pack = _same
        if self.fox:  # (F6), the field from segment-local sums
            q, k, v, log_f = (pack(t) for t in (q, k, v, delta))
            o = fox_attention(
                q, k, v, log_f, self.scale, cu_seqlens=cu_seqlens, window_size=self.window,
                impl=impl,
            )  # fmt: skip
        else:
            field = torch.cumsum(delta, dim=1)  # phi
            if cu_seqlens is not None and padding is None:  # each sequence's field starts
                # afresh (precision only: (F2) is invariant to shifting field and level together)
                start = torch.arange(x.shape[1], device=x.device) - _positions(
                    cu_seqlens, x.shape[1], x.device
                )
                before = torch.cat([torch.zeros_like(field[:, :1]), field[:, :-1]], dim=1)
                field = field - before[:, start]
            level = field if offset is None else field + offset
            q, k, v, field, level = (pack(t) for t in (q, k, v, field, level))
            o = fpa_attention(
                q, k, v, field, level, self.scale, cu_seqlens=cu_seqlens,
                window_size=self.window, impl=impl,
            )  # fmt: skip
        o = o.flatten(-2)
        return self._product(o if padding is None else padding.unpack(o), "wo")

    def new_cache(self, *, theta: float = float("inf")) -> FPALayerCache:
        """An empty decode cache evicting keys at depth >= theta (spec/fpa.md F7, T3); a layer
        with a window decodes with :meth:`open_session`."""
        if self.window is not None:
            raise ValueError(
                f"window: the single-stream cache has no (F3w) window, the layer's is"
                f" {self.window}; decode with open_session(rows)"
            )
        return FPALayerCache(FPADecodeCache(theta=theta, scale=self.scale))

    def open_session(
        self,
        rows: int,
        *,
        theta: float = math.inf,
        window: int | None = None,
        max_rollback: int = 0,
        page_size: int = 16,
        max_pages: int | None = None,
        attention: Attention = paged_attention_eager,
        wide_field: bool = True,
    ) -> FPALayerSession:
        """A batched decode session (spec/fpa.md F8, F9): ragged and padded rows, select and
        rollback, over the paged cache of :mod:`.paged` (k and v once per kv head, F8 gqa).
        ``window``: (F3w), None for the layer's. ``wide_field``: the field increments from x
        and the weights widened to float32 first (the kit counts evictions exactly against the
        reference), or (False) in the weights' dtype, as the parallel forward computes them."""
        p = next(self.parameters())
        session = PagedFPASession(
            rows=rows, heads=self.n_heads, kv_heads=self.n_kv_heads, dk=self.head_dim,
            dv=self.value_dim, dtype=p.dtype, scale=checks.scale(self.scale, self.head_dim),
            theta=theta, window=self.window if window is None else window,
            max_rollback=max_rollback, page_size=page_size, max_pages=max_pages,
            device=p.device, attention=attention,
        )  # fmt: skip
        return FPALayerSession(self, session, wide_field=wide_field)

    def step(self, x: Tensor, cache: FPALayerCache) -> Tensor:
        """One token: x [B, d] -> y [B, d], updating ``cache``."""
        x = _check_x(x, self, ndim=2)
        _check_batch(x, cache.field)
        q, k, v, delta, offset = self._projections(x[:, None])
        phi = delta[:, 0] if cache.field is None else cache.field + delta[:, 0]
        cache.field = phi
        level = phi if offset is None else phi + offset[:, 0]
        o = cache.attention.step(q[:, 0], k[:, 0], v[:, 0], phi, level)
        return self._product(o.reshape(x.shape[0], self.n_heads * self.value_dim), "wo")

    def prefill(self, x: Tensor, cache: FPALayerCache) -> Tensor:
        """A whole prompt x [B, T, d] into an empty ``cache``; equals T calls of :meth:`step`."""
        x = _check_x(x, self)
        q, k, v, delta, offset = self._projections(x)
        field = torch.cumsum(delta, dim=1)
        o = cache.attention.prefill(q, k, v, field, field if offset is None else field + offset)
        cache.field = field[:, -1]
        return self._product(o.reshape(*x.shape[:2], self.n_heads * self.value_dim), "wo")


def _same(x: Tensor) -> Tensor:
    return x


class FPALayerSession:
    """The decode session of :class:`FirstPassageAttention` (contract: advance / select /
    rollback / counts with x (R, n, d) -> y (R, n, d)): the paged attention session plus each
    row's running field phi and the fields of its last W tokens (to restore phi on rollback).
    ``wide_field``: as :meth:`FirstPassageAttention.open_session`. A deep copy copies the
    decode state and keeps the layer (its weights are the layer's, not the session's)."""

    def __init__(
        self, layer: FirstPassageAttention, attention: PagedFPASession, *, wide_field: bool = True
    ):
        self.layer, self.attention, self.wide_field = layer, attention, wide_field
        R, H, W = attention.rows, layer.n_heads, attention.W
        p = next(layer.parameters())
        wide = torch.float64 if p.dtype == torch.float64 else torch.float32
        # phi after token u of each row at u % (W + 1), for the last W + 1 tokens
        self.fields = torch.zeros(R, W + 1, H, dtype=wide, device=p.device)

    def __deepcopy__(self, memo: dict[int, Any]) -> FPALayerSession:
        memo[id(self.layer)] = self.layer
        copied = object.__new__(FPALayerSession)
        copied.__dict__.update(deepcopy(self.__dict__, memo))
        return copied

    def _last_field(self) -> Tensor:
        tokens = self.attention.state.tokens
        at = ((tokens - 1) % self.fields.shape[1])[:, None, None].expand(
            -1, 1, self.fields.shape[2]
        )
        return torch.where((tokens > 0)[:, None], self.fields.gather(1, at)[:, 0], 0.0)

    @torch.no_grad()
    def advance(self, inputs: dict[str, Tensor], present: Tensor) -> dict[str, Tensor]:
        """x (R, n, d) with present (R, n) bool -> {"y": (R, n, d)}, 0 at absent positions."""
        layer, R = self.layer, self.attention.rows
        if not isinstance(inputs, dict) or "x" not in inputs:
            raise ValueError("inputs: expected {'x': tensor (R, n, d)}")
        x = checks.tensor("x", inputs["x"], 3, checks.QKV_DTYPES, "(R, n, d)")
        checks.shape("x", x, (R, x.shape[1], layer.d_model), "(rows, n, d_model)")
        checks.tensor("present", present, 2, (torch.bool,), "(R, n) bool")
        checks.shape("present", present, tuple(x.shape[:2]), "(rows, n of x)")
        q, k, v, delta, offset = layer._projections(x, wide_field=self.wide_field)
        delta = delta.masked_fill(~present[..., None], 0.0)
        field = self._last_field()[:, None] + torch.cumsum(delta, dim=1)  # [R, n, H]
        level = field if offset is None else field + offset
        chunk = {
            "q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2),
            "field": field.transpose(1, 2), "level": level.transpose(1, 2),
        }  # fmt: skip
        tokens = self.attention.state.tokens.clone()
        o = self.attention.advance(chunk, present)["o"]  # [R, H, n, dv]
        rank = torch.cumsum(present.to(torch.int64), dim=1) - 1
        at = (tokens[:, None] + rank) % self.fields.shape[1]
        r, p = torch.nonzero(present, as_tuple=True)
        self.fields[r, at[r, p]] = field[r, p]
        y = layer._product(o.transpose(1, 2).reshape(R, -1, layer.n_heads * layer.value_dim), "wo")
        return {"y": y.masked_fill(~present[..., None], 0.0)}

    def select(self, rows: Sequence[int]) -> None:
        self.attention.select(rows)
        self.fields = self.fields[torch.tensor([int(i) for i in rows], device=self.fields.device)]

    def rollback(self, row: int, n: int) -> None:
        self.attention.rollback(row, n)  # the field ring needs nothing: phi is read by tokens

    def counts(self) -> dict[str, Tensor]:
        return self.attention.counts()


# Interdomain Attention


def short_conv(x: Tensor, w: Tensor, positions: Tensor) -> Tensor:
    """(I8) causal depthwise convolution sum_s w_s x_{t-s}, zero before each sequence's start.

    Args:
        x: [B, T, C]; w: [S, C]; positions: [T], each token's position in its sequence.
    """
    out = w[0] * x
    for s in range(1, w.shape[0]):
        shifted = F.pad(x, (0, 0, s, 0))[:, : x.shape[1]]  # x_{t-s}
        out = out + w[s] * shifted * (positions >= s)[None, :, None]
    return out


def feature_map(y: Tensor, eps: float = 1e-6) -> Tensor:
    """(I9) xi(y) = SiLU(y) / sqrt(||y||^2 + eps) over the last axis, computed in float32+."""
    wide = y.to(torch.promote_types(y.dtype, torch.float32))
    return F.silu(wide) / torch.sqrt(wide.square().sum(-1, keepdim=True) + eps)


def rms_norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last axis, computed in float32 or wider."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return wide * torch.rsqrt(wide.square().mean(-1, keepdim=True) + eps)


def rope(x: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding on the last axis of x [B, T, H, R] (R even, base 10000), as the
    reference's ``rope`` (halves rotated, not interleaved pairs)."""
    R = x.shape[-1]
    freq = 10000.0 ** (-torch.arange(R // 2, device=x.device, dtype=torch.float64) / (R // 2))
    angle = (positions.to(torch.float64)[:, None] * freq).to(x.dtype)[None, :, None]  # [1,T,1,R/2]
    x1, x2 = x[..., : R // 2], x[..., R // 2 :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass
class InterdomainLayerState:
    """Decode state of :class:`InterdomainAttention`: the short-conv windows of the projected
    queries and keys (the last S - 1 tokens), the S4D state, and the position."""

    ssm: S4DDecodeState
    conv_q: Tensor | None = None  # [B, S - 1, H R]
    conv_k: Tensor | None = None
    position: int = 0


class InterdomainAttention(nn.Module):
    """The Interdomain layer (I8)-(I14): x [B, T, d] -> y [B, T, d].

    Projections, short conv on q and k (I8), optional RoPE, feature map (I9), norms and biases
    (I10), b discretised by zero-order hold and the chunked S4D core (I11)-(I13), the
    readout's per-head RMSNorm (I14), optional output gate, output projection.
    Feature maps and norms are computed in float32 (or wider) and cast back to the weights'
    dtype before the S4D op.

    Args:
        d_model, n_heads, head_dim: width d, heads H, feature size R.
        value_dim: dv (default head_dim). n_modes: M.
        readout: "linear" (I13) or "ratio". gate: SiLU output gate. use_rope: RoPE on q, k.
        output_norm: the RMSNorm of (I14), on by default; False gives the paper-literal layer,
            whose output at initialisation grows with T.
    """

    # the reference's parameters (PARAMETER_SCHEMA; wg only with the gate), registered in __init__
    wq: nn.Parameter
    wk: nn.Parameter
    wv: nn.Parameter
    wo: nn.Parameter
    conv_q: nn.Parameter
    conv_k: nn.Parameter
    norm_k_g: nn.Parameter
    norm_k_b: nn.Parameter
    norm_v_g: nn.Parameter
    norm_v_b: nn.Parameter
    log_dt: nn.Parameter
    a_log: nn.Parameter
    a_im: nn.Parameter
    b_re: nn.Parameter
    b_im: nn.Parameter
    c_re: nn.Parameter
    c_im: nn.Parameter
    norm_o_g: nn.Parameter
    wg: nn.Parameter

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        head_dim: int,
        value_dim: int | None = None,
        n_modes: int = 64,
        *,
        readout: str = "linear",
        gate: bool = False,
        use_rope: bool = False,
        output_norm: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        checks.readout(readout)
        _check_sizes(
            d_model=d_model,
            n_heads=n_heads,
            head_dim=head_dim,
            value_dim=value_dim,
            n_modes=n_modes,
        )
        if use_rope and head_dim % 2:
            raise ValueError(f"head_dim: RoPE needs an even head dim, got {head_dim}")
        dv = head_dim if value_dim is None else value_dim
        self.d_model, self.n_heads, self.head_dim, self.value_dim = d_model, n_heads, head_dim, dv
        self.n_modes, self.readout, self.gate, self.use_rope = n_modes, readout, gate, use_rope
        self.output_norm = output_norm
        for name, value in self._initial_values().items():
            self.register_parameter(name, nn.Parameter(value.to(device=device, dtype=dtype)))

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The reference's shapes (``interdomain_parameter_shapes``) for these sizes and flags."""
        return interdomain_parameter_shapes(
            self.d_model,
            self.n_heads,
            self.head_dim,
            self.value_dim,
            self.n_modes,
            output_norm=self.output_norm,
            gate=self.gate,
        )

    def _initial_values(self) -> dict[str, Tensor]:
        """S4D-Inv, as init_interdomain_params: a_log = log(1/2), log_dt ~ U[log 1e-3, log 1e-1],
        b = 1, C ~ complex normal / sqrt(M); projections normal / sqrt(fan-in); conv normal / 2;
        the norm scales 1 and biases 0."""
        shapes = self.parameter_shapes()
        H, M = self.n_heads, self.n_modes
        a_log, a_im = (torch.from_numpy(x).float() for x in hippo.s4d_init(M, "inv"))
        fan_in = {"wo": H * self.value_dim}
        values = {}
        for name, shape in shapes.items():
            if name.startswith("w"):
                values[name] = torch.randn(shape) / math.sqrt(fan_in.get(name, self.d_model))
            elif name.startswith("conv"):
                values[name] = torch.randn(shape) / 2
            elif name.startswith("c_"):
                values[name] = torch.randn(shape) / math.sqrt(2 * M)
            elif name in ("norm_k_g", "norm_v_g", "norm_o_g", "b_re"):
                values[name] = torch.ones(shape)
            elif name == "log_dt":
                values[name] = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1))
            elif name == "a_log":
                values[name] = a_log.expand(H, M).clone()
            elif name == "a_im":
                values[name] = a_im.expand(H, M).clone()
            else:
                values[name] = torch.zeros(shape)
        return values

    @classmethod
    def from_reference_params(
        cls,
        params: Mapping[str, object],
        *,
        readout: str = "linear",
        use_rope: bool = False,
        output_norm: bool = True,
        device: Device = None,
        dtype: torch.dtype | None = None,
    ) -> InterdomainAttention:
        """A layer holding ``params`` (the dict of ``init_interdomain_params``; with "wg" the
        output gate is on; "norm_o_g" is needed with ``output_norm``, as the reference layer)."""
        optional = {"wg"} | (set() if output_norm else {"norm_o_g"})
        missing = sorted(set(INTERDOMAIN_PARAMETER_SCHEMA) - optional - set(params))
        if missing:
            raise ValueError(
                f"params: missing {missing}; see PARAMETER_SCHEMA (norm_o_g: output_norm=True)"
            )
        tensors = _tensors(params, [n for n in INTERDOMAIN_PARAMETER_SCHEMA if n in params])
        H, R = tensors["norm_k_g"].shape
        dv, M = tensors["norm_v_g"].shape[1], tensors["a_log"].shape[1]
        layer = cls(
            tensors["wq"].shape[0],
            H,
            R,
            dv,
            M,
            readout=readout,
            gate="wg" in params,
            use_rope=use_rope,
            output_norm=output_norm,
            device="meta",
        )
        _load(layer, tensors, layer.parameter_shapes(), device, dtype)
        return layer

    def ssm_parameters(self) -> tuple[Tensor, Tensor, Tensor]:
        """(I11) Lambda = exp(dt a), a = -exp(a_log) + i a_im, dt = exp(log_dt); the zero-order
        hold b_bar = (Lambda - 1) / a (.) b; and C; as (re, im) pairs [H, M, 2], [H, M, 2],
        [H, M, M, 2] in float32 (or wider): the operator's lam, b, c."""
        wide = torch.promote_types(self.a_log.dtype, torch.float32)
        dt = torch.exp(self.log_dt.to(wide))[:, None]
        a_re, a_im = -torch.exp(self.a_log.to(wide)), self.a_im.to(wide)
        decay, phase = dt * a_re, dt * a_im  # dt a
        modulus = torch.exp(decay)
        lam = torch.stack([modulus * torch.cos(phase), modulus * torch.sin(phase)], dim=-1)
        # Lambda - 1 without cancellation for small |dt a|: expm1, and cos - 1 = -2 sin^2(/2)
        minus_re = torch.expm1(decay) * torch.cos(phase) - 2 * torch.sin(phase / 2) ** 2
        minus_im = modulus * torch.sin(phase)
        norm = a_re.square() + a_im.square()
        hold_re = (minus_re * a_re + minus_im * a_im) / norm  # (Lambda - 1) / a
        hold_im = (minus_im * a_re - minus_re * a_im) / norm
        b_re, b_im = self.b_re.to(wide), self.b_im.to(wide)
        b = torch.stack([hold_re * b_re - hold_im * b_im, hold_re * b_im + hold_im * b_re], -1)
        c = torch.stack([self.c_re, self.c_im], dim=-1).to(wide)
        return lam, b, c  # (I11) b_bar as the operator's b

    def _features(
        self, x: Tensor, q: Tensor, k: Tensor, positions: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(I9), (I10) from the convolved projections q, k [B, T, H R]: fq, kt, vt [B, T, H, .]."""
        B, T, _ = x.shape
        H, R, dv = self.n_heads, self.head_dim, self.value_dim
        q, k = q.view(B, T, H, R), k.view(B, T, H, R)
        v = (x @ self.wv).view(B, T, H, dv)  # values are not convolved
        if self.use_rope:
            q, k = rope(q, positions), rope(k, positions)
        fq, fk = feature_map(q), feature_map(k)  # (I9)
        kt = rms_norm(fk) * self.norm_k_g + self.norm_k_b  # (I10)
        vt = rms_norm(v) * self.norm_v_g + self.norm_v_b
        return fq.to(x.dtype), kt.to(x.dtype), vt.to(x.dtype)

    def _output(self, x: Tensor, o: Tensor) -> Tensor:
        """The readout o [..., H, dv]: (I14) RMSNorm per head, heads concatenated, the gate
        and the output projection."""
        if self.output_norm:
            o = (rms_norm(o) * self.norm_o_g).to(o.dtype)  # (I14)
        o = o.reshape(*o.shape[:-2], self.n_heads * self.value_dim)  # concatenate heads
        if self.gate:
            o = F.silu(x @ self.wg) * o
        return o @ self.wo

    def forward(
        self, x: Tensor, *, cu_seqlens: Tensor | None = None, impl: str | None = None
    ) -> Tensor:
        """x [B, T, d] -> y [B, T, d]; packed sequences by ``cu_seqlens`` (B = 1), each with
        its own conv window, positions and zero initial state. Time O(B T (d H (R + dv) +
        H (L M + M (R + dv + M)))) with S4D chunks of L; state size independent of T."""
        x = _check_x(x, self)
        positions = _positions(cu_seqlens, x.shape[1], x.device)
        q = short_conv(x @ self.wq, self.conv_q, positions)  # (I8)
        k = short_conv(x @ self.wk, self.conv_k, positions)
        fq, kt, vt = self._features(x, q, k, positions)
        o, _ = s4d_pairs(
            fq,
            kt,
            vt,
            *self.ssm_parameters(),
            readout=self.readout,
            cu_seqlens=cu_seqlens,
            impl=impl,
        )
        return self._output(x, o)

    def new_cache(self) -> InterdomainLayerState:
        """An empty decode state."""
        lam, b, c = (torch.view_as_complex(p.detach().contiguous()) for p in self.ssm_parameters())
        return InterdomainLayerState(S4DDecodeState(lam, b, c, readout=self.readout))

    def step(self, x: Tensor, state: InterdomainLayerState) -> Tensor:
        """One token: x [B, d] -> y [B, d], updating ``state`` (whose size does not grow)."""
        x = _check_x(x, self, ndim=2)[:, None]
        _check_batch(x, state.conv_q)
        positions = torch.tensor([state.position], device=x.device)
        qk = []
        for name in ("q", "k"):
            new = x @ getattr(self, f"w{name}")  # [B, 1, H R]
            window = getattr(state, f"conv_{name}")
            S = getattr(self, f"conv_{name}").shape[0]
            if window is None:
                window = new.new_zeros(new.shape[0], S - 1, new.shape[2])
            window = torch.cat([window, new], dim=1)  # the last S tokens, oldest first
            weights = getattr(self, f"conv_{name}").flip(0)  # w_s multiplies x_{t-s}
            qk.append((window * weights).sum(dim=1, keepdim=True))  # (I8)
            setattr(state, f"conv_{name}", window[:, 1:])
        fq, kt, vt = self._features(x, qk[0], qk[1], positions)
        o = state.ssm.step(fq[:, 0], kt[:, 0], vt[:, 0])
        state.position += 1
        return self._output(x[:, 0], o)

    def prefill(self, x: Tensor, state: InterdomainLayerState) -> Tensor:
        """A prompt x [B, T, d] into a fresh ``state``; equals T calls of :meth:`step`."""
        if state.position:
            raise ValueError(f"prefill: expected a fresh state, at position {state.position}")
        x = _check_x(x, self)
        T = x.shape[1]
        positions = torch.arange(T, device=x.device)
        projected = {name: x @ getattr(self, f"w{name}") for name in ("q", "k")}
        q = short_conv(projected["q"], self.conv_q, positions)
        k = short_conv(projected["k"], self.conv_k, positions)
        fq, kt, vt = self._features(x, q, k, positions)
        o = state.ssm.prefill(fq, kt, vt)
        for name, p in projected.items():
            S = getattr(self, f"conv_{name}").shape[0]
            window = F.pad(p, (0, 0, S - 1, 0))[:, -(S - 1) :]  # zeros before the prompt
            setattr(state, f"conv_{name}", window)
        state.position = T
        return self._output(x, o)
