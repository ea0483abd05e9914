"""Generation with the decode caches: prefill a prompt once, then one step per new token.

A tiny byte-level model (embedding, FPA layer, Interdomain layer, each with a residual, output
head), untrained, so the text is noise; what the example shows is the decode path. Greedy
decoding with the caches gives the same tokens as the parallel forward: on the prompt and the
generated tokens, one call of the whole model predicts at every position the token that
followed (causality), which is what recomputing the sequence for each new token would give.

- torch: ``layer.new_cache()``, ``layer.prefill(prompt, cache)``, ``layer.step(x_t, cache)``
  for both layers (FPA's KV cache with optional eviction, the Interdomain layer's fixed-size
  state);
- JAX: the same layers as pure functions of the parameter dicts of ``init_fpa_params`` and
  ``init_interdomain_params``, with ``*_layer_state``, ``*_layer_prefill`` and
  ``*_layer_step`` (explicit state pytrees). The per-token step is jitted, as a server would;
  under jit a full FPA cache cannot raise, so the loop reads ``cache.overflowed`` after each
  step and stops with a ValueError naming the capacity (eager calls raise it themselves).

Run: ``python docs/examples/generation.py`` (needs the torch and jax extras).
"""

from __future__ import annotations

PROMPT = b"def first_passage("
NEW_TOKENS = 12


# torch


def torch_model(d: int = 32, seed: int = 0):  # -> an nn.Module
    import torch
    from torch import nn

    from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention

    torch.manual_seed(seed)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, d)
            self.mixers = nn.ModuleList(
                [FirstPassageAttention(d, 2, 8), InterdomainAttention(d, 2, 8, n_modes=8)]
            )
            self.head = nn.Linear(d, 256)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            """tokens [B, T] -> logits [B, T, 256], the whole sequence at once."""
            x = self.embed(tokens)
            for mixer in self.mixers:
                x = x + mixer(x)
            return self.head(x)

        def prefill(self, tokens: torch.Tensor, caches: list) -> torch.Tensor:
            """The prompt [B, T] into fresh caches; logits of its last token [B, 256]."""
            x = self.embed(tokens)
            for mixer, cache in zip(self.mixers, caches, strict=True):
                x = x + mixer.prefill(x, cache)
            return self.head(x[:, -1])

        def step(self, token: torch.Tensor, caches: list) -> torch.Tensor:
            """One token [B] -> logits [B, 256]; each cache advances by one token."""
            x = self.embed(token)
            for mixer, cache in zip(self.mixers, caches, strict=True):
                x = x + mixer.step(x, cache)
            return self.head(x)

    return TinyLM().eval()


def generate_torch(prompt: bytes = PROMPT, n: int = NEW_TOKENS) -> tuple[bytes, bytes]:
    """Greedy continuation of ``prompt`` by n tokens: (with the caches, by the parallel
    forward over the prompt and the generated tokens)."""
    import torch

    model = torch_model()
    tokens = torch.tensor([list(prompt)])
    with torch.no_grad():
        caches = [mixer.new_cache() for mixer in model.mixers]
        logits = model.prefill(tokens, caches)  # the prompt once
        cached = []
        for _ in range(n):
            token = logits.argmax(-1)  # [B]
            cached.append(int(token))
            logits = model.step(token, caches)  # one token, fixed cost per step
        sequence = torch.tensor([list(prompt) + cached[:-1]])
        parallel = model(sequence)[0, len(prompt) - 1 :].argmax(-1)  # the next token at each
    return bytes(cached), bytes(parallel.tolist())


# JAX


def generate_jax(
    prompt: bytes = PROMPT, n: int = NEW_TOKENS, capacity: int | None = None
) -> tuple[bytes, bytes]:
    """The same model in JAX, as pure functions of parameter dicts: (with the decode states, by
    the parallel layers). ``capacity``: the FPA cache's slots per head (default: prompt + n,
    never full); a cache that fills up is a ValueError, read from the ``overflowed`` flag."""
    import jax
    import jax.numpy as jnp

    from attnspec.backends import jax as attn

    d, H, R = 32, 2, 8
    key_embed, key_head, key_fpa, key_idm = jax.random.split(jax.random.key(0), 4)
    fpa_params = attn.init_fpa_params(key_fpa, d, H, R, R)
    idm_params = attn.init_interdomain_params(key_idm, d, H, R, R, 8)
    embed = jax.random.normal(key_embed, (256, d))
    head = jax.random.normal(key_head, (d, 256)) / jnp.sqrt(d)

    def forward(tokens: jax.Array) -> jax.Array:
        """tokens [B, T] -> logits [B, T, 256], the whole sequence at once."""
        x = embed[tokens]
        x = x + attn.fpa_layer(x, fpa_params)
        x = x + attn.interdomain_layer(x, idm_params)
        return x @ head

    capacity = len(prompt) + n if capacity is None else capacity
    states = (
        attn.fpa_layer_state(fpa_params, 1, capacity),  # (F7) cache of up to `capacity` keys
        attn.interdomain_layer_state(idm_params, 1),  # fixed size (H6)
    )

    @jax.jit
    def step(token: jax.Array, fpa_state, idm_state):  # -> (logits [B, 256], the states)
        x = embed[token]  # [B, d]: one token, fixed cost per step
        y, fpa_state = attn.fpa_layer_step(x, fpa_params, fpa_state)
        x = x + y
        y, idm_state = attn.interdomain_layer_step(x, idm_params, idm_state)
        return (x + y) @ head, fpa_state, idm_state

    x = embed[jnp.array([list(prompt)])]  # the prompt once
    y, fpa_state = attn.fpa_layer_prefill(x, fpa_params, states[0])
    x = x + y
    y, idm_state = attn.interdomain_layer_prefill(x, idm_params, states[1])
    logits = (x + y)[:, -1] @ head
    cached = []
    for _ in range(n):
        token = int(jnp.argmax(logits[0]))
        cached.append(token)
        logits, fpa_state, idm_state = step(jnp.array([token]), fpa_state, idm_state)
        if bool(jnp.any(fpa_state.cache.overflowed)):  # under jit the flag is the report
            raise ValueError(
                f"capacity: the FPA cache of {capacity} slots per head filled up after "
                f"{len(cached)} generated tokens; its outputs would not be the model's"
            )
    parallel = jnp.argmax(
        forward(jnp.array([list(prompt) + cached[:-1]]))[0, len(prompt) - 1 :], -1
    )
    return bytes(cached), bytes(parallel.tolist())


if __name__ == "__main__":
    for name, generate in (("torch", generate_torch), ("jax", generate_jax)):
        cached, recomputed = generate()
        print(f"{name}: {PROMPT + cached!r}; equal to the parallel forward: {cached == recomputed}")
