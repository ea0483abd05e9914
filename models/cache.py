"""The decode cache of the attnspec models: transformers' cache-layer API over decode sessions.

One layer object per model layer (transformers v5's ``Cache`` of ``CacheLayerMixin`` layers):

- :class:`ForgetGateSessionLayer` (FPA, FPA_FOX, FOX layers): a paged FPA decode session
  (:class:`~attnspec.backends.torch.paged.PagedFPASession`, spec/fpa.md (F7), (F8), (F9), (F3w));
  FoX decodes as FPA with field = level = cumsum(log f) (F6). The layer keeps each row's running
  field phi for the last ``max_rollback`` positions, so ``crop`` can return it.
- :class:`InterdomainSessionLayer` (ID layers): the Interdomain layer's state session (I15).

``get_seq_length`` counts positions seen (padding included, as generate()'s masks do);
``reorder_cache`` / ``batch_select_indices`` / ``batch_repeat_interleave`` are the session's
select (beam search without copying pages); ``crop`` is the (F9) rollback of the last positions
of every row with transformers' semantics (``crop(-n)`` removes n, ``crop(0)`` none), a
ValueError naming max_rollback past it; ``activate_past_recording`` (transformers' call before a
decoding that crops) reserves the rollback on layers not started yet. After a generation,
:meth:`AttnSpecCache.fractions` reads the live and stored fractions and
:meth:`AttnSpecCache.bytes_held` / :meth:`AttnSpecCache.bytes_full` the memory.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from attnspec.backends.torch.paged import PagedFPASession
from attnspec.backends.torch.state_sessions import InterdomainLayerStep, StateSession

from .configuration import AttnSpecConfig

if TYPE_CHECKING:
    from .modeling import ForgetGateAttention, InterdomainMixer

UNDO = 1  # tokens per row the FPA sessions can roll back beyond max_rollback (a decode step)


class SessionLayer(CacheLayerMixin):
    """What the two session layers share: positions seen, the presence history for crop, and
    the select calls of beam search."""

    is_compileable = False

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

    @property
    def is_croppable(self) -> bool:  # type: ignore[override]  # as transformers' linear layers
        """Whether ``crop`` can undo positions (transformers asks before speculative decoding)."""
        return self.max_rollback > 0

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
        """transformers' crop: ``crop(-n)`` removes the last n positions, ``crop(0)`` removes
        none (as transformers' own layers read it), ``crop(m)`` with m > 0 keeps the first m
        (the older form, which transformers' own layers now refuse): the (F9) rollback of each
        row's tokens among the removed positions. Past what the layer can undo (at most
        ``max_rollback`` positions): a ValueError naming max_rollback, the layer unchanged."""
        remove = -max_length if max_length <= 0 else self.positions - max_length
        if remove <= 0:
            return
        if remove > self.max_rollback:
            raise ValueError(
                f"crop: removing {remove} positions needs max_rollback >= {remove} (the W of"
                f" spec/fpa.md F9); this cache has max_rollback = {self.max_rollback}"
            )
        undoable = 0 if self.history is None else self.history.shape[1]
        if remove > undoable:
            raise ValueError(
                f"crop: removing {remove} positions, but the cache can undo {undoable} now"
                f" (max_rollback = {self.max_rollback}, less the positions cropped already)"
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

    def reserve_rollback(self, n: int) -> None:
        """max_rollback >= n (a layer not started yet; one holding tokens already keeps its
        own, and a smaller one is a ValueError naming max_rollback)."""
        if n <= self.max_rollback:
            return
        if self.session is not None:
            raise ValueError(
                f"max_rollback: a decoding that crops up to {n} positions needs max_rollback >="
                f" {n}; this cache holds tokens already with max_rollback = {self.max_rollback}"
                f" (make it with AttnSpecCache(config, max_rollback={n}))"
            )
        self.max_rollback = n

    def snapshot(self, present: Tensor) -> dict[str, Any]:
        """What :meth:`restore` needs to undo an ``advance`` of the chunk ``present`` [R, n]:
        here a copy of the layer (the session layers do it cheaper)."""
        return copy.deepcopy(dict(vars(self)))

    def restore(self, saved: dict[str, Any]) -> None:
        """The layer as it was at :meth:`snapshot` (after the chunk went in)."""
        vars(self).update(saved)


class ForgetGateSessionLayer(SessionLayer):
    """The decode state of an FPA / FoX layer: a paged FPA session and each row's running field.

    The session can roll back ``max_rollback + UNDO`` tokens: the reserved one lets a forward
    that fails in a later layer undo a decode step by (F9) rollback, with no copy."""

    def __init__(self, config: AttnSpecConfig, *, theta: float, max_rollback: int):
        super().__init__(max_rollback)
        self.theta, self.window = theta, config.window_size
        self.phi: Tensor | None = None  # [R, HQ, max_rollback + 1]: phi after recent tokens

    @torch.no_grad()
    def advance(self, mixer: ForgetGateAttention, x: Tensor, present: Tensor) -> Tensor:
        """A chunk x [R, n, d] with ``present`` [R, n] -> the mixer's output [R, n, d].
        Decoding is not differentiated (the sessions keep no autograd graph)."""
        R = x.shape[0]
        q, k, v = mixer.qkv(x)  # [R, n, heads, dk]
        delta, lam = mixer.increments(x)  # [R, n, HQ]
        session, phi = self.session, self.phi  # assigned once the chunk is in: a call that
        if session is None:  # raises leaves the layer as it was
            session = PagedFPASession(
                rows=R,
                heads=mixer.num_heads,
                kv_heads=mixer.num_kv_heads,
                dk=mixer.head_dim,
                dv=mixer.head_dim,
                dtype=q.dtype,
                scale=mixer.head_dim**-0.5,
                theta=self.theta,
                window=self.window,
                max_rollback=self.max_rollback + UNDO,
                device=x.device,
            )
            phi = delta.new_zeros(R, mixer.num_heads, self.max_rollback + 1)
        assert phi is not None
        if session.rows != R:
            raise ValueError(f"x: expected {session.rows} rows (the cache's), got {R}")
        delta = delta * present[..., None]  # padding does not move the field
        field = phi[:, None, :, -1] + delta.cumsum(dim=1)  # [R, n, HQ] phi
        inputs = {
            "q": q.transpose(1, 2),
            "k": k.transpose(1, 2),
            "v": v.transpose(1, 2),
            "field": field.transpose(1, 2),
            "level": (field + lam).transpose(1, 2),
        }
        o = session.advance(inputs, present)["o"]  # [R, HQ, n, dk]
        # phi after each of the row's tokens, the most recent max_rollback + 1 kept
        tokens = [field[r, present[r]].transpose(0, 1) for r in range(R)]  # [HQ, n_r]
        width = self.max_rollback + 1
        self.session = session
        self.phi = torch.stack(
            [torch.cat([phi[r], t], dim=1)[:, -width:] for r, t in enumerate(tokens)]
        )
        self.remember(present)
        return mixer.o_proj(o.transpose(1, 2).flatten(-2))

    def select(self, rows: list[int]) -> None:
        super().select(rows)
        if self.phi is not None:
            self.phi = self.phi[rows]

    def snapshot(self, present: Tensor) -> dict[str, Any]:
        """A chunk of at most UNDO tokens per row is undone by the session's (F9) rollback
        (positions, history and phi are replaced by advance, never written: kept as they are);
        a longer chunk on a started layer by a copy."""
        state = dict(vars(self))
        if self.session is None:
            return state
        tokens = present.sum(dim=1).tolist()
        if max(tokens) <= UNDO:
            return state | {"undo": tokens}
        return super().snapshot(present)

    def restore(self, saved: dict[str, Any]) -> None:
        saved = dict(saved)
        for r, n in enumerate(saved.pop("undo", [])):
            self.session.rollback(r, int(n))
        super().restore(saved)

    def rollback(self, row: int, n: int) -> None:
        super().rollback(row, n)
        if n and self.phi is not None:
            self.phi[row] = torch.cat(
                [self.phi[row, :, :1].expand(-1, n), self.phi[row, :, :-n]], 1
            )

    def reset(self) -> None:
        super().reset()
        self.phi = None

    def bytes_held(self) -> int:
        """Bytes of k and v in the pages the session holds (the paged session's count)."""
        return 0 if self.session is None else self.session.bytes_held()

    def bytes_full(self) -> int:
        """Bytes of k and v a full cache holds for the tokens seen: every token once per kv
        head, as a cache that never evicts and does not page (bench/decode.py's SDPA peer)."""
        if self.session is None:
            return 0
        s = self.session
        tokens = int(s.counts()["tokens"].sum())
        return tokens * s.H * (s.dk + s.dv) * s.k_pool.element_size()

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
    docstring). ``theta`` and ``max_rollback`` override the configuration's eviction threshold
    (F7) and rollback depth (F9)."""

    def __init__(
        self,
        config: AttnSpecConfig,
        *,
        theta: float | None = None,
        max_rollback: int | None = None,
    ):
        theta = config.theta if theta is None else theta
        if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
            raise ValueError(f"theta: expected a positive number (or inf), got {theta!r}")
        W = config.max_rollback if max_rollback is None else max_rollback
        if isinstance(W, bool) or not isinstance(W, int) or W < 0:
            raise ValueError(f"max_rollback: expected an integer >= 0, got {W!r}")
        self.sessions: list[ForgetGateSessionLayer | InterdomainSessionLayer] = [
            InterdomainSessionLayer(W)
            if kind == "ID"
            else ForgetGateSessionLayer(config, theta=float(theta), max_rollback=W)
            for kind in config.layer_kinds
        ]
        super().__init__(layers=list(self.sessions))
        self.kinds = config.layer_kinds
        self.theta = float(theta)

    def check_model(self, config: AttnSpecConfig) -> None:
        """ValueError naming the cache if it was made for another model."""
        if config.layer_kinds != self.kinds:
            raise ValueError(
                f"cache: a cache for layers {self.kinds}, the model has {config.layer_kinds}"
            )

    def fractions(self) -> list[dict[str, float] | None]:
        """Per layer, the live and stored fractions of the FPA / FoX sessions (None for ID)."""
        return [
            layer.fractions() if isinstance(layer, ForgetGateSessionLayer) else None
            for layer in self.sessions
        ]

    def bytes_held(self) -> int:
        """Bytes the cache holds now: the k and v pages of the FPA / FoX layers and the states
        of the Interdomain layers (the pools may have allocated more: they grow by doubling)."""
        return sum(layer.bytes_held() for layer in self.sessions)

    def bytes_full(self) -> int:
        """Bytes a full cache would hold for the same tokens: k and v of every token seen, once
        per kv head, in the FPA / FoX layers (no eviction, no paging); the Interdomain layers'
        states as they are (they have nothing to evict)."""
        return sum(layer.bytes_full() for layer in self.sessions)

    def activate_past_recording(
        self, recurrent_states_to_keep: int | None = None, **kwargs: Any
    ) -> None:
        """transformers' call before a decoding that crops (assisted and prompt-lookup
        decoding); from transformers 5.25 it says how many drafted positions a crop may remove:
        the layers take max_rollback >= that (see :meth:`SessionLayer.reserve_rollback`)."""
        if recurrent_states_to_keep:
            self.reserve_rollback(int(recurrent_states_to_keep))

    def reserve_rollback(self, n: int) -> None:
        """Every layer can undo n positions (a ValueError naming max_rollback where a layer
        holding tokens cannot; the cache unchanged)."""
        held = [s for s in self.sessions if s.session is not None and n > s.max_rollback]
        if held:
            held[0].reserve_rollback(n)  # its ValueError, before any layer changes
        for layer in self.sessions:
            layer.reserve_rollback(n)


class InterdomainSessionLayer(SessionLayer):
    """The decode state of an Interdomain layer (I15): the layer's state session (the
    short-convolution windows and the S4D state of every row)."""

    @torch.no_grad()
    def advance(self, mixer: InterdomainMixer, x: Tensor, present: Tensor) -> Tensor:
        """A chunk x [R, n, d] with ``present`` [R, n] -> the layer's output [R, n, d]
        (not differentiated, as the FPA layers')."""
        session = self.session  # assigned once the chunk is in, as the FPA layers'
        if session is None:
            step = InterdomainLayerStep(mixer.layer, x.dtype, x.device)
            session = StateSession(step, rows=x.shape[0], max_rollback=self.max_rollback)
        if session.R != x.shape[0]:
            raise ValueError(f"x: expected {session.R} rows (the cache's), got {x.shape[0]}")
        y = session.advance({"x": x}, present)["y"]
        self.session = session
        self.remember(present)
        return y

    def snapshot(self, present: Tensor) -> dict[str, Any]:
        """The layer with a shallow copy of its session: a StateSession commits by replacing
        its tensors at the end of advance, never writing into them."""
        return dict(vars(self)) | {"session": copy.copy(self.session)}

    def bytes_held(self) -> int:
        """Bytes of the session's tensors: the states (now and, for rollback, W tokens back)
        and the inputs kept for rollback."""
        if self.session is None:
            return 0
        s = self.session
        kept = [x for row in s.rows.kept for token in row for x in token.values()]
        tensors = [*(s.state or {}).values(), *(s.snapshot or {}).values(), *kept]
        return sum({(x.data_ptr(), x.nbytes): x.nbytes for x in tensors}.values())

    def bytes_full(self) -> int:
        """An Interdomain layer evicts nothing: its state is its full cache."""
        return self.bytes_held()
