"""The decode cache of the attnspec models: transformers' cache-layer API over the decode
sessions of the torch backend's layers.

One layer object per model layer (transformers v5's ``Cache`` of ``CacheLayerMixin`` layers),
each owning its model layer's decode session as transformers' layers own their key and value
states. The attention module calls its layer (:meth:`SessionLayer.advance`, in the place of
transformers' ``update``), handing it the mixer's ``open_session`` for the first chunk; the
cache never calls into the model:

- :class:`FPASessionLayer` (FPA, FPA_FOX, FOX layers): the session of
  :class:`~attnspec.backends.torch.FirstPassageAttention` (``FPALayerSession``: the paged cache
  of spec/fpa.md (F7), (F8), (F9), (F3w) and each row's running field); FoX decodes as FPA with
  field = level = cumsum(log f) (F6).
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
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from attnspec.reference.validation import nonnegative_int, threshold

from .configuration import AttnSpecConfig

UNDO = 1  # tokens per row the FPA sessions can roll back beyond max_rollback (a decode step)


class SessionLayer(CacheLayerMixin):
    """What the two session layers share: the session, positions seen, the presence history
    for crop, and the select calls of beam search."""

    is_compileable = False

    def __init__(self, max_rollback: int):
        super().__init__()
        self.max_rollback = max_rollback
        self.positions = 0
        self.rows = 0
        self.session: Any = None
        self.history: Tensor | None = None  # [R, max_rollback] presence of the last positions

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        raise NotImplementedError("attnspec layers advance their sessions, not key/value states")

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("attnspec layers advance their sessions, not key/value states")

    def session_options(self) -> dict[str, Any]:
        """The keywords ``open_session`` takes from the cache (beside the rows)."""
        return {"max_rollback": self.max_rollback}

    @torch.no_grad()
    def advance(
        self, inputs: dict[str, Tensor], present: Tensor, open_session: Callable[..., Any]
    ) -> dict[str, Tensor]:
        """A chunk through the session: ``inputs`` [R, n, ...] with ``present`` [R, n] -> the
        session's outputs. The first chunk opens the session, ``open_session(R,
        **self.session_options())`` (the attention module's). The session and the positions
        are the layer's once the chunk is in: a call that raises leaves the layer as it was.
        Decoding is not differentiated (the sessions keep no autograd graph)."""
        R = present.shape[0]
        session = self.session
        if session is None:
            session = open_session(R, **self.session_options())
        elif R != self.rows:
            raise ValueError(f"x: expected {self.rows} rows (the cache's), got {R}")
        out: dict[str, Tensor] = session.advance(inputs, present)
        self.session, self.rows = session, R
        self.remember(present)
        return out

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
        self.rows = len(rows)
        if self.history is not None:
            self.history = self.history[rows]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select([int(i) for i in beam_idx.tolist()])

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select([int(i) for i in indices.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.select([r for r in range(self.rows) for _ in range(repeats)])

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
                self.session.rollback(r, int(n))
            self.history = self.history[:, :-remove]
        self.positions -= remove

    def reset(self) -> None:
        self.session, self.history, self.positions, self.rows = None, None, 0, 0

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
        the layer's attributes (``advance`` replaces them, never writes into them) and a copy
        of the session a started layer's chunk changes (the session layers do it cheaper)."""
        return dict(vars(self)) | {"session": copy.deepcopy(self.session)}

    def restore(self, saved: dict[str, Any]) -> None:
        """The layer as it was at :meth:`snapshot` (after the chunk went in)."""
        vars(self).update(saved)


class FPASessionLayer(SessionLayer):
    """The decode state of an FPA / FoX layer: the layer's ``FPALayerSession`` (paged k and v,
    the (F7) entries, each row's running field), evicting at depth >= ``theta``.

    The session can roll back ``max_rollback + UNDO`` tokens: the reserved one lets a forward
    that fails in a later layer undo a decode step by (F9) rollback, with no copy."""

    def __init__(self, *, theta: float, max_rollback: int):
        super().__init__(max_rollback)
        self.theta = theta

    def session_options(self) -> dict[str, Any]:
        return {"theta": self.theta, "max_rollback": self.max_rollback + UNDO}

    def snapshot(self, present: Tensor) -> dict[str, Any]:
        """A chunk of at most UNDO tokens per row on a started layer is undone by the session's
        (F9) rollback; a new layer needs nothing (its session is made by advance); a longer
        chunk on a started layer is undone from a copy of the session."""
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

    def bytes_held(self) -> int:
        """Bytes of k and v in the pages the session holds (the paged session's count)."""
        return 0 if self.session is None else int(self.session.attention.bytes_held())

    def bytes_full(self) -> int:
        """Bytes of k and v a full cache holds for the tokens seen: every token once per kv
        head, as a cache that never evicts and does not page (bench/decode.py's SDPA peer)."""
        if self.session is None:
            return 0
        s = self.session.attention
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


class InterdomainSessionLayer(SessionLayer):
    """The decode state of an Interdomain layer (I15): the layer's state session (the
    short-convolution windows and the S4D state of every row)."""

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
        theta = threshold("theta", theta)  # inf: no eviction
        W = config.max_rollback if max_rollback is None else max_rollback
        W = nonnegative_int("max_rollback", W)
        self.session_layers: list[FPASessionLayer | InterdomainSessionLayer] = [
            InterdomainSessionLayer(W)
            if kind == "ID"
            else FPASessionLayer(theta=theta, max_rollback=W)
            for kind in config.layer_kinds
        ]
        super().__init__(layers=list(self.session_layers))
        self.kinds = config.layer_kinds
        self.theta = theta

    def check_model(self, config: AttnSpecConfig) -> None:
        """ValueError naming the cache if it was made for another model."""
        if config.layer_kinds != self.kinds:
            raise ValueError(
                f"cache: a cache for layers {self.kinds}, the model has {config.layer_kinds}"
            )

    def fractions(self) -> list[dict[str, float] | None]:
        """Per layer, the live and stored fractions of the FPA / FoX sessions (None for ID)."""
        return [
            layer.fractions() if isinstance(layer, FPASessionLayer) else None
            for layer in self.session_layers
        ]

    def bytes_held(self) -> int:
        """Bytes the cache holds now: the k and v pages of the FPA / FoX layers and the states
        of the Interdomain layers (the pools may have allocated more: they grow by doubling)."""
        return sum(layer.bytes_held() for layer in self.session_layers)

    def bytes_full(self) -> int:
        """Bytes a full cache would hold for the same tokens: k and v of every token seen, once
        per kv head, in the FPA / FoX layers (no eviction, no paging); the Interdomain layers'
        states as they are (they have nothing to evict)."""
        return sum(layer.bytes_full() for layer in self.session_layers)

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
        held = [s for s in self.session_layers if s.session is not None and n > s.max_rollback]
        if held:
            held[0].reserve_rollback(n)  # its ValueError, before any layer changes
        for layer in self.session_layers:
            layer.reserve_rollback(n)
