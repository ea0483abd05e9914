"""The decode cache of the attnspec models: transformers' cache-layer API over decode sessions.

One layer object per model layer (transformers v5's ``Cache`` of ``CacheLayerMixin`` layers):

- :class:`ForgetGateSessionLayer` (FPA, FPA_FOX, FOX layers): a paged FPA decode session
  (:class:`~attnspec.backends.torch.paged.PagedFPASession`, spec/fpa.md (F7), (F8), (F9), (F3w));
  FoX decodes as FPA with field = level = cumsum(log f) (F6). The layer keeps each row's running
  field phi for the last ``max_rollback`` positions, so ``crop`` can return it.
- :class:`InterdomainSessionLayer` (ID layers): the Interdomain layer's state session (I15).

``get_seq_length`` counts positions seen (padding included, as generate()'s masks do);
``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` are the session's
select (beam search without copying pages); ``crop(n)`` is the (F9) rollback of the last n
positions of every row, a ValueError naming max_rollback past it. After a generation,
:meth:`AttnSpecCache.fractions` reads the live and stored fractions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from attnspec.backends.torch.paged import PagedFPASession
from attnspec.backends.torch.state_sessions import InterdomainLayerStep, StateSession

from .configuration import AttnSpecConfig

if TYPE_CHECKING:
    from .modeling import ForgetGateAttention, InterdomainMixer


class SessionLayer(CacheLayerMixin):
    """What the two session layers share: positions seen, the presence history for crop, and
    the select calls of beam search."""

    is_compileable = False
    is_croppable = True

    def __init__(self, max_rollback: int):
        super().__init__()
        self.max_rollback = max_rollback
        self.positions = 0
        self.session: Any = None
        self.history: Tensor | None = None  # [R, max_rollback] presence of the last positions

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise NotImplementedError("attnspec layers advance their sessions, not key/value states")

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("attnspec layers advance their sessions, not key/value states")

    def get_seq_length(self) -> int:
        return self.positions

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.positions + query_length, 0

    def remember(self, present: Tensor) -> None:
        """Record the presence of a chunk's positions (for crop)."""
        self.positions += present.shape[1]
        if self.max_rollback:
            before = (
                present.new_zeros(present.shape[0], 0) if self.history is None else self.history
            )
            self.history = torch.cat([before, present], dim=1)[:, -self.max_rollback :]

    def select(self, rows: list[int]) -> None:
        if self.session is None:
            return
        self.session.select(rows)
        if self.history is not None:
            self.history = self.history[rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.history is not None:
            rows = self.history.shape[0]
        elif self.session is not None:
            rows = int(self.session.counts()["tokens"].shape[0])
        else:
            return
        self.select([r for r in range(rows) for _ in range(repeats)])

    def crop(self, max_length: int) -> None:
        """transformers' crop: keep the first ``max_length`` positions (a negative value removes
        that many from the end): the (F9) rollback of each row's tokens among them."""
        remove = self.positions - max_length if max_length >= 0 else -max_length
        if remove <= 0:
            return
        if remove > self.max_rollback:
            raise ValueError(
                f"crop: removing {remove} positions needs max_rollback >= {remove} (the W of"
                f" spec/fpa.md F9); this cache has max_rollback = {self.max_rollback}"
            )
        if self.session is not None:
            assert self.history is not None
            tokens = self.history[:, -remove:].sum(dim=1)
            for r, n in enumerate(tokens.tolist()):
                self.rollback(r, int(n))
            self.history = self.history[:, :-remove]
        self.positions -= remove

    def rollback(self, row: int, n: int) -> None:
        self.session.rollback(row, n)

    def reset(self) -> None:
        self.session, self.history, self.positions = None, None, 0


class ForgetGateSessionLayer(SessionLayer):
    """The decode state of an FPA / FoX layer: a paged FPA session and each row's running field."""

    def __init__(self, config: AttnSpecConfig, *, theta: float):
        super().__init__(config.max_rollback)
        self.theta, self.window = theta, config.window_size
        self.phi: Tensor | None = None  # [R, HQ, max_rollback + 1]: phi after recent tokens

    @torch.no_grad()
    def advance(self, mixer: ForgetGateAttention, x: Tensor, present: Tensor) -> Tensor:
        """A chunk x [R, n, d] with ``present`` [R, n] -> the mixer's output [R, n, d].
        Decoding is not differentiated (the sessions keep no autograd graph)."""
        R = x.shape[0]
        q, k, v = mixer.qkv(x)  # [R, n, heads, dk]
        delta, lam = mixer.increments(x)  # [R, n, HQ]
        if self.session is None:
            self.session = PagedFPASession(
                rows=R,
                heads=mixer.num_heads,
                kv_heads=mixer.num_kv_heads,
                dk=mixer.head_dim,
                dv=mixer.head_dim,
                dtype=q.dtype,
                scale=mixer.head_dim**-0.5,
                theta=self.theta,
                window=self.window,
                max_rollback=self.max_rollback,
                device=x.device,
            )
            self.phi = delta.new_zeros(R, mixer.num_heads, self.max_rollback + 1)
        assert self.phi is not None
        if self.session.rows != R:
            raise ValueError(f"x: expected {self.session.rows} rows (the cache's), got {R}")
        delta = delta * present[..., None]  # padding does not move the field
        field = self.phi[:, None, :, -1] + delta.cumsum(dim=1)  # [R, n, HQ] phi
        inputs = {
            "q": q.transpose(1, 2),
            "k": k.transpose(1, 2),
            "v": v.transpose(1, 2),
            "field": field.transpose(1, 2),
            "level": (field + lam).transpose(1, 2),
        }
        o = self.session.advance(inputs, present)["o"]  # [R, HQ, n, dk]
        # phi after each of the row's tokens, the most recent max_rollback + 1 kept
        tokens = [field[r, present[r]].transpose(0, 1) for r in range(R)]  # [HQ, n_r]
        width = self.max_rollback + 1
        self.phi = torch.stack(
            [torch.cat([self.phi[r], t], dim=1)[:, -width:] for r, t in enumerate(tokens)]
        )
        self.remember(present)
        return mixer.o_proj(o.transpose(1, 2).flatten(-2))

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        if self.phi is not None:
            self.phi = self.phi[rows]

    def rollback(self, row: int, n: int) -> None:
        super().rollback(row, n)
        if n and self.phi is not None:
            self.phi[row] = torch.cat(
                [self.phi[row, :, :1].expand(-1, n), self.phi[row, :, :-n]], 1
            )

    def reset(self) -> None:
        super().reset()
        self.phi = None

    def fractions(self) -> dict[str, float]:
        """Live keys per query head and entries stored per kv head, over the tokens seen."""
        counts = self.session.counts()
        tokens = counts["tokens"].clamp_min(1).to(torch.float64)
        return {
            "live": float((counts["live"] / tokens[:, None]).mean()),
            "stored": float((counts["stored"] / tokens[:, None]).mean()),
        }


class AttnSpecCache(Cache):
    """The cache of an attnspec model: one session layer per model layer (see the module
    docstring). ``theta`` overrides the configuration's eviction threshold."""

    def __init__(self, config: AttnSpecConfig, *, theta: float | None = None):
        theta = config.theta if theta is None else theta
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"theta: expected a positive number (or inf), got {theta!r}")
        self.sessions: list[ForgetGateSessionLayer | InterdomainSessionLayer] = [
            InterdomainSessionLayer(config)
            if kind == "ID"
            else ForgetGateSessionLayer(config, theta=float(theta))
            for kind in config.layer_kinds
        ]
        super().__init__(layers=list(self.sessions))
        self.kinds = config.layer_kinds
        self.theta = float(theta)

    def check_model(self, config: AttnSpecConfig) -> None:
        """ValueError naming past_key_values if the cache was made for another model."""
        if config.layer_kinds != self.kinds:
            raise ValueError(
                f"past_key_values: a cache for layers {self.kinds}, the model has"
                f" {config.layer_kinds}"
            )

    def fractions(self) -> list[dict[str, float] | None]:
        """Per layer, the live and stored fractions of the FPA / FoX sessions (None for ID)."""
        return [
            layer.fractions() if isinstance(layer, ForgetGateSessionLayer) else None
            for layer in self.sessions
        ]


class InterdomainSessionLayer(SessionLayer):
    """The decode state of an Interdomain layer (I15): the layer's state session (the
    short-convolution windows and the S4D state of every row)."""

    def __init__(self, config: AttnSpecConfig):
        super().__init__(config.max_rollback)

    @torch.no_grad()
    def advance(self, mixer: InterdomainMixer, x: Tensor, present: Tensor) -> Tensor:
        """A chunk x [R, n, d] with ``present`` [R, n] -> the layer's output [R, n, d]
        (not differentiated, as the FPA layers')."""
        if self.session is None:
            step = InterdomainLayerStep(mixer.layer, x.dtype, x.device)
            self.session = StateSession(step, rows=x.shape[0], max_rollback=self.max_rollback)
        if self.session.R != x.shape[0]:
            raise ValueError(f"x: expected {self.session.R} rows (the cache's), got {x.shape[0]}")
        y = self.session.advance({"x": x}, present)["y"]
        self.remember(present)
        return y
