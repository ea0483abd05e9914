"""The attnspec causal language models for Hugging Face transformers.

A model is embeddings, ``num_hidden_layers`` pre-norm residual blocks (a token mixer of the
layer's kind, then a SwiGLU MLP), a final RMSNorm and the LM head, as flash-linear-attention's
Forgetting Transformer. The mixers are the layers of :mod:`attnspec.backends.torch` (Triton
kernels on CUDA, the eager ops elsewhere):

- ``FPA``, ``FPA_FOX``, ``FOX``: :class:`ForgetGateAttention`, the torch backend's
  :class:`~attnspec.backends.torch.FirstPassageAttention` (GQA: ``num_kv_heads``; the window;
  FOX without key offsets: (F6)) with its weights under transformers' names (see the class).
- ``ID``: :class:`~attnspec.backends.torch.InterdomainAttention` (I8)-(I14).

The cache (:class:`~.cache.AttnSpecCache`) is given as ``cache=`` or ``past_key_values=`` (the
names of transformers from 5.24 and before it) and returned under the installed transformers'
name; generate() builds one by default (``_prepare_cache_for_generation``). Each block calls its
cache layer (``advance``, as transformers' attention modules call ``update``), handing it the
mixer's ``open_session`` for the first chunk; the cache never calls the model. A forward with
the cache that raises in a block leaves every layer of the cache as it was, and its ValueError
names the layer.

Padding: a 2-D ``attention_mask`` (1 = token, 0 = padding, left or right) becomes a
:class:`~attnspec.backends.torch.padding.Padding`: the layers pack the tokens of every row into
one sequence with ``cu_seqlens``, so padded positions are not tokens (F8 rows): no key, no field
update, output 0, exactly what the decode sessions do with absent positions.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention
from attnspec.backends.torch.modules import Device, FPALayerSession
from attnspec.backends.torch.padding import Padding
from attnspec.backends.torch.state_sessions import InterdomainLayerStep, StateSession

from .cache import AttnSpecCache
from .configuration import (
    AttnSpecConfig,
    FoXConfig,
    FPAConfig,
    HybridConfig,
    InterdomainConfig,
)

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


# the reference's weight -> the nn.Linear holding it (transformers' and fla's names)
LINEAR = {
    "wq": "q_proj",
    "wk": "k_proj",
    "wv": "v_proj",
    "wo": "o_proj",
    "w_delta": "f_proj",  # field increments (fla's forget gate), with its bias b_delta
    "w_lam": "lam_proj",  # key offsets, with b_lam
}


class ForgetGateAttention(FirstPassageAttention):
    """The ``FPA``, ``FPA_FOX`` and ``FOX`` layers: the torch backend's
    :class:`~attnspec.backends.torch.FirstPassageAttention` (its forward, padding, GQA, window,
    FoX kind and decode session) with its weights as ``nn.Linear`` modules under the names of
    transformers and flash-linear-attention (``LINEAR``: q_proj, k_proj, v_proj, o_proj,
    f_proj and, but for FOX, lam_proj; weights [out, in]): the checkpoints keep those names and
    the products are ``nn.Linear``'s (x @ W.T of a transposed copy rounds differently, and
    PEFT's adapters replace the modules). ``FPA``: signed increments; ``FPA_FOX``: logsigmoid
    increments, key offsets starting at 0; ``FOX``: logsigmoid increments, no key offsets (F6).
    """

    def __init__(self, config: AttnSpecConfig, kind: str):
        d, HQ, H, dk, _ = config.sizes
        super().__init__(
            d,
            HQ,
            dk,
            n_kv_heads=H,
            increments="signed" if kind == "FPA" else "logsigmoid",
            key_offsets=kind != "FOX",
            window=config.window_size,
        )
        self.kind = kind

    def _make_parameters(self, device: Device, dtype: torch.dtype | None) -> None:
        for name, shape in self.parameter_shapes().items():
            if name in LINEAR:  # weight (d_in, d_out); b_delta and b_lam are the biases
                d_in, d_out = shape
                bias = name in ("w_delta", "w_lam")
                linear = nn.Linear(d_in, d_out, bias=bias, device=device, dtype=dtype)
                self.add_module(LINEAR[name], linear)

    def _product(self, x: Tensor, name: str) -> Tensor:
        linear = cast(nn.Linear, getattr(self, LINEAR[name]))
        if x.dtype == linear.weight.dtype:
            return cast(Tensor, linear(x))
        bias = None if linear.bias is None else linear.bias.to(x.dtype)
        return F.linear(x, linear.weight.to(x.dtype), bias)

    def open_session(self, rows: int, **options: Any) -> FPALayerSession:
        """The layer's decode session (the cache layer opens it at the first chunk) with the
        field increments in the weights' dtype, as the forward computes them, and the softmax
        scale head_dim ** -0.5 the models decode with (the ops' 1/sqrt(head_dim) differs from
        it by an ulp at some head dims; docs/decisions.md)."""
        session = super().open_session(rows, wide_field=False, **options)
        session.attention.scale = self.head_dim**-0.5
        return session


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

    def forward(self, x: Tensor, padding: Padding) -> Tensor:
        y = self.layer(padding.pack(x), cu_seqlens=padding.cu_seqlens)
        return padding.unpack(y)

    def open_session(self, rows: int, *, max_rollback: int) -> StateSession:
        """The layer's state session (I15), in the weights' dtype, on their device."""
        p = self.layer.wq
        return StateSession(InterdomainLayerStep(self.layer, p.dtype, p.device), rows, max_rollback)


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

    def forward(self, x: Tensor, padding: Padding, cache: AttnSpecCache | None = None) -> Tensor:
        h = self.attn_norm(x)
        if cache is None:
            h = self.attn(h, padding=padding)
        else:  # the cache layer's session (opened by the mixer at the first chunk)
            layer = cache.session_layers[self.layer_idx]
            h = layer.advance({"x": h}, padding.present, self.attn.open_session)["y"]
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
            lam = cast(nn.Linear, module.lam_proj)
            nn.init.zeros_(lam.weight)  # levels start on the field: FoX
            nn.init.zeros_(lam.bias)

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
        padding = Padding.from_mask(attention_mask, B, T, x.device)
        hidden = [x] if output_hidden_states else None
        cache = cache if use_cache else None
        advanced: list[tuple[Any, dict[str, Any]]] = []  # (cache layer, its state before)
        for i, block in enumerate(self.layers):
            layer = None if cache is None else cache.session_layers[i]
            # a block advances its layer only when it succeeds: the last needs no snapshot
            last = i == len(self.layers) - 1
            before = None if layer is None or last else layer.snapshot(padding.present)
            try:
                x = block(x, padding, cache)
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
