"""Configurations of the attnspec causal language models (Hugging Face transformers).

One configuration class per model kind, all of one shape: a stack of pre-norm residual blocks,
each a token mixer from ``layer_pattern`` and a SwiGLU MLP. The names are those of
flash-linear-attention's ``ForgettingTransformerConfig`` where they mean the same (hidden_size,
num_hidden_layers, num_heads, num_kv_heads, window_size, hidden_ratio, intermediate_size,
norm_eps, ...), so a FoX configuration carries over.

Layer kinds (``layer_pattern``, comma-separated, one per layer, or one kind for every layer):

- ``FPA``: First Passage Attention with signed field increments and learned key levels
  (spec/fpa.md section 3);
- ``FPA_FOX``: the FoX-initialised FPA layer of that section (logsigmoid increments, key offsets
  starting at 0);
- ``FOX``: the Forgetting Transformer's attention (F6), fla's ``ForgettingAttention``;
- ``ID``: Interdomain attention (spec/interdomain.md (I8)-(I14)).

The names other libraries read (transformers, PEFT, accelerate, serving engines):
``num_attention_heads`` and ``num_key_value_heads`` are aliases of ``num_heads`` and
``num_kv_heads`` (``attribute_map``: read, set and given to the constructor under either name,
stored once), and ``head_dim`` is always set.

Decoding: ``theta`` (the (F7) eviction threshold, inf keeps every key), ``window_size`` ((F3w),
None for none) and ``max_rollback`` (the W of (F9): how many tokens ``crop`` may undo) set the
FPA / FoX layers' decode sessions; ``generate(..., theta=...)`` overrides theta per call.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

from transformers import PretrainedConfig

from attnspec.reference.validation import nonnegative_int, positive_int, threshold

LAYER_KINDS = ("FPA", "FPA_FOX", "FOX", "ID")
FORGET_GATE_KINDS = ("FPA", "FPA_FOX", "FOX")


def parse_layer_pattern(pattern: str, num_hidden_layers: int) -> tuple[str, ...]:
    """The layer kinds of ``pattern`` ("FPA,ID,FPA,ID", or one kind for every layer).

    Raises ValueError naming ``layer_pattern`` for an unknown kind or a count that is not
    ``num_hidden_layers``."""
    if not isinstance(pattern, str) or not pattern.strip():
        raise ValueError(f"layer_pattern: expected a comma-separated string, got {pattern!r}")
    kinds = tuple(kind.strip().upper() for kind in pattern.split(","))
    unknown = sorted({kind for kind in kinds if kind not in LAYER_KINDS})
    if unknown:
        raise ValueError(f"layer_pattern: unknown layer kinds {unknown}; expected {LAYER_KINDS}")
    if len(kinds) == 1:
        kinds = kinds * num_hidden_layers
    if len(kinds) != num_hidden_layers:
        raise ValueError(
            f"layer_pattern: {len(kinds)} kinds for num_hidden_layers = {num_hidden_layers}"
        )
    return kinds


class Sizes(NamedTuple):
    """A configuration's sizes: width d, query heads, key/value heads, head dim, MLP width."""

    d: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int


class AttnSpecConfig(PretrainedConfig):
    """The configuration every attnspec model kind shares (see the module docstring).

    Fields:
        vocab_size, hidden_size, num_hidden_layers: the usual.
        layer_pattern: the mixer of each layer (``LAYER_KINDS``), comma-separated (default: the
            configuration class's kind).
        num_heads: query heads; ``num_kv_heads`` key/value heads of the FPA and FoX layers
            (GQA; default num_heads; must divide num_heads). ``head_dim`` default
            hidden_size // num_heads. Aliases: ``num_attention_heads``, ``num_key_value_heads``.
        window_size: (F3w) window of the FPA and FoX layers, None for none.
        theta, max_rollback: the decode sessions' eviction threshold (F7) and rollback depth (F9).
        id_modes, id_readout, id_use_rope, id_gate, id_output_norm: the Interdomain layers'
            mode count M, readout ("linear" or "ratio") and option flags (I8)-(I14).
        hidden_ratio, intermediate_size: the MLP's width (fla's rule: 2/3 of hidden_ratio times
            hidden_size, rounded up to a multiple of 256, unless intermediate_size is given).
        norm_eps, initializer_range, tie_word_embeddings: the usual.

    Bad values are a ValueError naming the field.
    """

    model_type = "attnspec"
    default_layer_pattern: ClassVar[str] = "FPA"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values", "cache"]
    # transformers' names -> ours (fla's), one stored field each
    attribute_map: ClassVar[dict[str, str]] = {
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
    }

    vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    layer_pattern: str | None = None
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    window_size: int | None = None
    theta: float = math.inf
    max_rollback: int = 0
    id_modes: int = 16
    id_readout: str = "linear"
    id_use_rope: bool = False
    id_gate: bool = True
    id_output_norm: bool = True
    hidden_ratio: int | None = 4
    intermediate_size: int | None = None
    norm_eps: float = 1e-6
    initializer_range: float = 0.02
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs: Any) -> None:
        for alias, name in self.attribute_map.items():  # before the checks, not after them
            if alias in kwargs:
                value, given = kwargs.pop(alias), getattr(self, name)
                if given not in (type(self).__dataclass_fields__[name].default, value):
                    raise ValueError(f"{alias}: {value!r}, but {name} (the same field) = {given!r}")
                setattr(self, name, value)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "id_modes"):
            positive_int(name, getattr(self, name))
        pattern = self.layer_pattern or self.default_layer_pattern
        parse_layer_pattern(pattern, self.num_hidden_layers)
        self.layer_pattern = pattern
        self.num_kv_heads = positive_int("num_kv_heads", self.num_kv_heads or self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} does not divide num_heads = {self.num_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads: {self.num_heads} does not divide hidden_size = {self.hidden_size}"
                " (or give head_dim)"
            )
        self.head_dim = positive_int(
            "head_dim", self.head_dim or self.hidden_size // self.num_heads
        )
        if self.window_size is not None:
            positive_int("window_size", self.window_size)
        self.theta = threshold("theta", self.theta)  # inf: none
        self.max_rollback = nonnegative_int("max_rollback", self.max_rollback)
        if self.id_readout not in ("linear", "ratio"):
            raise ValueError(f"id_readout: expected 'linear' or 'ratio', got {self.id_readout!r}")
        if self.intermediate_size is None:
            ratio = positive_int("hidden_ratio", self.hidden_ratio)
            self.intermediate_size = 256 * math.ceil(int(self.hidden_size * ratio * 2 / 3) / 256)
        positive_int("intermediate_size", self.intermediate_size)
        super().__post_init__(**kwargs)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The mixer kind of each layer."""
        return parse_layer_pattern(self.layer_pattern or "", self.num_hidden_layers)

    @property
    def sizes(self) -> Sizes:
        """The resolved sizes (the optional fields are set by ``__post_init__``)."""
        kv, dk, mlp = self.num_kv_heads, self.head_dim, self.intermediate_size
        assert kv is not None and dk is not None and mlp is not None
        return Sizes(self.hidden_size, self.num_heads, kv, dk, mlp)


class FPAConfig(AttnSpecConfig):
    """An FPA transformer (signed-field layers; ``layer_pattern="FPA_FOX"`` FoX-initialised)."""

    model_type = "attnspec_fpa"
    default_layer_pattern: ClassVar[str] = "FPA"


class FoXConfig(AttnSpecConfig):
    """A Forgetting Transformer: the counterpart of flash-linear-attention's."""

    model_type = "attnspec_fox"
    default_layer_pattern: ClassVar[str] = "FOX"


class InterdomainConfig(AttnSpecConfig):
    """An Interdomain-attention transformer."""

    model_type = "attnspec_interdomain"
    default_layer_pattern: ClassVar[str] = "ID"


class HybridConfig(AttnSpecConfig):
    """Layers of several kinds from ``layer_pattern`` (e.g. "FPA,ID,FPA,ID")."""

    model_type = "attnspec_hybrid"
    default_layer_pattern: ClassVar[str] = "FPA,ID"
    num_hidden_layers: int = 2
