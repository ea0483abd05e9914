"""The attnspec causal language models for Hugging Face transformers.

A model is embeddings, ``num_hidden_layers`` pre-norm residual blocks (a token mixer of the
layer's kind, then a SwiGLU MLP), a final RMSNorm and the LM head, as flash-linear-attention's
Forgetting Transformer. The mixers are built from :mod:`attnspec.backends.torch` (Triton kernels
on CUDA, the eager ops elsewhere):

- :class:`ForgetGateAttention` for the ``FPA``, ``FPA_FOX`` and ``FOX`` kinds: projections q, k,
  v (GQA: ``num_kv_heads``), per query head a field increment and, for FPA, a key offset
  (spec/fpa.md section 3); the parallel path calls ``fpa_attention`` / ``fox_attention``.
- ``ID``: :class:`~attnspec.backends.torch.InterdomainAttention` (I8)-(I14).

The cache (:class:`~.cache.AttnSpecCache`) is given as ``cache=`` or ``past_key_values=`` (the
names of transformers from 5.24 and before it) and returned under the installed transformers'
name; generate() builds one by default (``_prepare_cache_for_generation``). A forward with the
cache that raises in a block leaves every layer of the cache as it was, and its ValueError
names the layer.

Padding: a 2-D ``attention_mask`` (1 = token, 0 = padding, left or right) packs the tokens of
every row into one sequence with ``cu_seqlens``, so padded positions are not tokens (F8 rows): no
key, no field update, output 0, exactly what the decode sessions do with absent positions.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnspec.backends.torch import InterdomainAttention, fox_attention, fpa_attention

from .cache import AttnSpecCache, ForgetGateSessionLayer, InterdomainSessionLayer
from .configuration import (
    AttnSpecConfig,
    FoXConfig,
    FPAConfig,
    HybridConfig,
    InterdomainConfig,
)
from .packing import Packing

# transformers 5.24 renamed the cache past_key_values -> cache, in generate()'s model inputs and
# in its output classes (the old name warns there): the models answer in the installed name.
CACHE_NAME = (
    "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
)


def one_cache(past_key_values: AttnSpecCache | None, cache: AttnSpecCache | None) -> Any:
    """The cache given under either name (the same object under both counts once)."""
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("cache: given twice, as cache and as past_key_values; give one")
    return cache if cache is not None else past_key_values


def draft_length(generation_config: GenerationConfig, mode: GenerationMode) -> int:
    """Positions one verification of speculative decoding may crop from the cache: the
    prompt-lookup draft, else the assistant's (its own cache too); 0 for other decoding."""
    if mode != GenerationMode.ASSISTED_GENERATION and not generation_config.is_assistant:
        return 0
    lookup = generation_config.prompt_lookup_num_tokens
    return int(lookup or generation_config.num_assistant_tokens or 0)


class ForgetGateAttention(nn.Module):
    """FPA / FoX attention of one layer: x [B, T, d] -> [B, T, d].

    Per query head h: field increments delta_t (``FPA``: signed, ``w x_t + b``; ``FPA_FOX`` and
    ``FOX``: logsigmoid of it, <= 0), phi = cumsum(delta) over the row's tokens in float32 (or
    wider), and for FPA key levels l_j = phi_j + lam_j with key offsets lam_j = w' x_j + b'
    (``FPA_FOX`` starts with lam = 0: the FoX-initialised layer). ``FOX`` is (F6): field = level =
    phi, computed by ``fox_attention``.
    """

    def __init__(self, config: AttnSpecConfig, kind: str):
        super().__init__()
        d, HQ, H, dk, _ = config.sizes
        self.kind, self.num_heads, self.num_kv_heads, self.head_dim = kind, HQ, H, dk
        self.window_size = config.window_size
        self.q_proj = nn.Linear(d, HQ * dk, bias=False)
        self.k_proj = nn.Linear(d, H * dk, bias=False)
        self.v_proj = nn.Linear(d, H * dk, bias=False)
        self.o_proj = nn.Linear(HQ * dk, d, bias=False)
        self.f_proj = nn.Linear(d, HQ, bias=True)  # field increments (fla's forget gate)
        self.lam_proj = nn.Linear(d, HQ, bias=True) if kind != "FOX" else None  # key offsets

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, T, HQ, dk], k and v [B, T, H, dk]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        return q, k, v

    def increments(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(delta, lam) [B, T, HQ] in float32 or wider: field increments and key offsets."""
        wide = torch.promote_types(x.dtype, torch.float32)
        delta = self.f_proj(x).to(wide)
        if self.kind != "FPA":
            delta = F.logsigmoid(delta)  # FoX's log forget gate, <= 0
        lam = torch.zeros_like(delta) if self.lam_proj is None else self.lam_proj(x).to(wide)
        return delta, lam

    def forward(self, x: Tensor, packing: Packing) -> Tensor:
        """The parallel layer; ``packing`` says which positions are tokens."""
        q, k, v = self.qkv(x)
        delta, lam = self.increments(x)
        window: dict[str, Any] = (
            {} if self.window_size is None else {"window_size": self.window_size}
        )
        if self.kind == "FOX":
            q, k, v, log_f = (packing.pack(t) for t in (q, k, v, delta))
            o = fox_attention(q, k, v, log_f, cu_seqlens=packing.cu_seqlens, **window)
        else:
            field = (delta * packing.present[..., None]).cumsum(dim=1)  # phi of each row
            q, k, v, field, level = (packing.pack(t) for t in (q, k, v, field, field + lam))
            o = fpa_attention(q, k, v, field, level, cu_seqlens=packing.cu_seqlens, **window)
        o = packing.unpack(o.flatten(-2))  # zeros at padding
        return self.o_proj(o)


class InterdomainMixer(nn.Module):
    """The Interdomain layer of one block: x [B, T, d] -> [B, T, d] (I8)-(I14)."""

    def __init__(self, config: AttnSpecConfig):
        super().__init__()
        self.layer = InterdomainAttention(
            config.hidden_size,
            config.num_heads,
            config.sizes.head_dim,
            n_modes=config.id_modes,
            readout=config.id_readout,
            gate=config.id_gate,
            use_rope=config.id_use_rope,
            output_norm=config.id_output_norm,
        )

    def forward(self, x: Tensor, packing: Packing) -> Tensor:
        y = self.layer(packing.pack(x), cu_seqlens=packing.cu_seqlens)
        return packing.unpack(y)


class SwiGLU(nn.Module):
    """The MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: AttnSpecConfig):
        super().__init__()
        d, m = config.hidden_size, config.sizes.mlp
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttnSpecBlock(nn.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: AttnSpecConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_kinds[layer_idx]
        self.layer_idx = layer_idx
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn: ForgetGateAttention | InterdomainMixer = (
            InterdomainMixer(config)
            if self.kind == "ID"
            else ForgetGateAttention(config, self.kind)
        )
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x: Tensor, packing: Packing, cache: AttnSpecCache | None = None) -> Tensor:
        h = self.attn_norm(x)
        if cache is None:
            h = self.attn(h, packing)
        else:
            layer = cache.sessions[self.layer_idx]
            if isinstance(layer, ForgetGateSessionLayer) and isinstance(
                self.attn, ForgetGateAttention
            ):
                h = layer.advance(self.attn, h, packing.present)
            elif isinstance(layer, InterdomainSessionLayer) and isinstance(
                self.attn, InterdomainMixer
            ):
                h = layer.advance(self.attn, h, packing.present)
            else:  # check_model makes this unreachable
                raise ValueError(f"cache: layer {self.layer_idx} is of another kind")
        x = x + h
        return x + self.mlp(self.mlp_norm(x))


class AttnSpecPreTrainedModel(PreTrainedModel):
    """The shared base: configuration class, weight initialisation, cache support."""

    config_class = AttnSpecConfig
    config: AttnSpecConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AttnSpecBlock"]  # noqa: RUF012 (transformers' convention)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        if isinstance(module, ForgetGateAttention) and module.kind == "FPA_FOX":
            assert module.lam_proj is not None
            nn.init.zeros_(module.lam_proj.weight)  # levels start on the field: FoX
            nn.init.zeros_(module.lam_proj.bias)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model's own cache (AttnSpecCache), never a DynamicCache


class AttnSpecModel(AttnSpecPreTrainedModel):
    """Embeddings, the blocks and the final norm: input_ids [B, T] -> hidden [B, T, d]."""

    def __init__(self, config: AttnSpecConfig):
        super().__init__(config)
        self.embeddings: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            AttnSpecBlock(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embeddings = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: AttnSpecCache | None = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        theta: float | None = None,
        cache: AttnSpecCache | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """hidden [B, T, d]; a new cache (``use_cache`` without a cache given) evicts at depth
        >= ``theta`` (default: the configuration's; generate(..., theta=...) passes it)."""
        cache = one_cache(past_key_values, cache)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("input_ids: give exactly one of input_ids and inputs_embeds")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        use_cache = use_cache and not self.training
        if cache is not None and not isinstance(cache, AttnSpecCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"cache: expected an AttnSpecCache, got {type(cache).__name__}")
            cache = None  # an empty cache made by another library: ours instead
        if use_cache and cache is None:
            cache = AttnSpecCache(self.config, theta=theta)
        if cache is not None:
            cache.check_model(self.config)
            if theta is not None and theta != cache.theta:
                raise ValueError(
                    f"theta: {theta!r}, but the cache given evicts at theta = {cache.theta}"
                    " (set it when making the cache: AttnSpecCache(config, theta=...))"
                )
        packing = Packing.from_mask(attention_mask, B, T, x.device)
        hidden = [x] if output_hidden_states else None
        cache = cache if use_cache else None
        advanced: list[tuple[Any, dict[str, Any]]] = []  # (cache layer, its state before)
        for i, block in enumerate(self.layers):
            layer = None if cache is None else cache.sessions[i]
            # a block advances its layer only when it succeeds: the last needs no snapshot
            last = i == len(self.layers) - 1
            before = None if layer is None or last else layer.snapshot(packing.present)
            try:
                x = block(x, packing, cache)
            except BaseException as error:
                for done, state in advanced:
                    done.restore(state)
                if isinstance(error, ValueError):
                    raise ValueError(f"layer {i} ({block.kind}): {error}") from error
                raise
            if before is not None:
                advanced.append((layer, before))
            if hidden is not None:
                hidden.append(x)
        x = self.norm(x)
        named: dict[str, Any] = {CACHE_NAME: cache}
        return BaseModelOutputWithPast(
            last_hidden_state=x,
            hidden_states=tuple(hidden) if hidden is not None else None,
            **named,
        )


class AttnSpecForCausalLM(AttnSpecPreTrainedModel, GenerationMixin):
    """The language model: logits [B, T, vocab]; ``labels`` give the shifted cross-entropy."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}  # noqa: RUF012

    def __init__(self, config: AttnSpecConfig):
        super().__init__(config)
        self.model = AttnSpecModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        past_key_values: AttnSpecCache | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int = 0,
        theta: float | None = None,
        cache: AttnSpecCache | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=one_cache(past_key_values, cache),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            theta=theta,
        )
        hidden = outputs.last_hidden_state
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )

    def _prepare_cache_for_generation(
        self,
        generation_config: GenerationConfig,
        model_kwargs: dict[str, Any],
        generation_mode: GenerationMode,
        batch_size: int,
        max_cache_length: int,
    ) -> bool:
        """transformers' hook for the cache generate() decodes with (5.23 to 5.25): a new
        :class:`AttnSpecCache` (``theta`` from generate's keywords) unless the call gives one
        (under either name) or turns the cache off; for speculative decoding the cache can
        undo a whole draft (docs/decisions.md). Returns whether there is a cache."""
        other = "past_key_values" if CACHE_NAME == "cache" else "cache"
        if other in model_kwargs:
            model_kwargs[CACHE_NAME] = one_cache(
                model_kwargs.pop(other), model_kwargs.get(CACHE_NAME)
            )
        if model_kwargs.get(CACHE_NAME) is None and generation_config.use_cache is not False:
            if generation_config.cache_implementation is not None:
                raise ValueError(
                    "cache_implementation: the attnspec models decode with their own cache"
                    f" (AttnSpecCache), got {generation_config.cache_implementation!r}"
                )
            theta = model_kwargs.get("theta")
            model_kwargs[CACHE_NAME] = AttnSpecCache(self.config, theta=theta)
        else:
            GenerationMixin._prepare_cache_for_generation(
                cast(Any, self),
                generation_config,
                model_kwargs,
                generation_mode,
                batch_size,
                max_cache_length,
            )
        cache = model_kwargs.get(CACHE_NAME)
        draft = draft_length(generation_config, generation_mode)
        if isinstance(cache, AttnSpecCache) and draft:
            cache.reserve_rollback(draft)
        return cache is not None


class FPAModel(AttnSpecModel):
    config_class = FPAConfig


class FPAForCausalLM(AttnSpecForCausalLM):
    config_class = FPAConfig


class FoXModel(AttnSpecModel):
    config_class = FoXConfig


class FoXForCausalLM(AttnSpecForCausalLM):
    config_class = FoXConfig


class InterdomainModel(AttnSpecModel):
    config_class = InterdomainConfig


class InterdomainForCausalLM(AttnSpecForCausalLM):
    config_class = InterdomainConfig


class HybridModel(AttnSpecModel):
    config_class = HybridConfig


class HybridForCausalLM(AttnSpecForCausalLM):
    config_class = HybridConfig
