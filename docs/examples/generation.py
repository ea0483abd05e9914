"""Generation with the decode caches: prefill a prompt once, then one step per new token.

A tiny byte-level model (embedding, FPA layer, Interdomain layer, each with a residual, output
head), untrained, so the text is noise; what the example shows is the decode path. Greedy
decoding with the caches gives the same tokens as the parallel forward: on the prompt and the
generated tokens, one call of the whole model predicts at every position the token that
followed (causality), which is what recomputing the sequence for each new token would give.

- torch: ``layer.new_cache()``, ``layer.prefill(prompt, cache)``, ``layer.step(x_t, cache)``
  for both layers (FPA's KV cache with optional eviction, the Interdomain layer's fixed-size
  state);
- JAX: the FPA layer written per token over ``fpa_decode`` (prefill) and ``fpa_decode_step``,
  with the parameter dict of ``init_fpa_params``, checked against ``fpa_layer``.

Run: ``python docs/examples/generation.py`` (needs the torch and jax extras).
"""

from __future__ import annotations

PROMPT = b"def first_passage("
NEW_TOKENS = 12


# --------------------------------------------------------------------------------- torch


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


# --------------------------------------------------------------------------------- JAX


def generate_jax(prompt: bytes = PROMPT, n: int = NEW_TOKENS) -> tuple[bytes, bytes]:
    """The same with one FPA layer in JAX: (with the cache, by the parallel ``fpa_layer``)."""
    import jax
    import jax.numpy as jnp

    from attnspec.backends.jax import fpa_decode, fpa_decode_step, fpa_layer, init_fpa_params

    d, H, dk = 32, 2, 8
    key_embed, key_head = jax.random.split(jax.random.key(0))
    params = init_fpa_params(jax.random.key(1), d, H, dk, dk)
    embed = jax.random.normal(key_embed, (256, d)) / 4
    head = jax.random.normal(key_head, (d, 256)) / jnp.sqrt(d)

    def projections(x: jax.Array):  # x [B, T, d] -> q, k, v [B, T, H, dk]; delta, lam [B, T, H]
        B, T, _ = x.shape
        q, k, v = (x @ params[w] for w in ("wq", "wk", "wv"))
        delta = x @ params["w_delta"] + params["b_delta"]  # field increments [B, T, H]
        lam = x @ params["w_lam"] + params["b_lam"]  # levels relative to the field
        return (*(y.reshape(B, T, H, dk) for y in (q, k, v)), delta, lam)

    def logits_of(x: jax.Array, o: jax.Array) -> jax.Array:
        return (x + o.reshape(*o.shape[:-2], H * dk) @ params["wo"]) @ head

    total = len(prompt) + n
    x = embed[jnp.array([list(prompt)])]  # [1, T, d]
    q, k, v, delta, lam = projections(x)
    field = jnp.cumsum(delta, axis=1)  # phi
    o, cache = fpa_decode(q, k, v, field, field + lam, capacity=total)  # prefill
    logits, phi = logits_of(x[:, -1], o[:, -1]), field[:, -1]
    cached = []
    for _ in range(n):
        token = int(jnp.argmax(logits[0]))
        cached.append(token)
        x = embed[jnp.array([[token]])]
        q, k, v, delta, lam = projections(x)
        phi = phi + delta[:, 0]  # the running field
        o, cache = fpa_decode_step(cache, q[:, 0], k[:, 0], v[:, 0], phi, phi + lam[:, 0])
        logits = logits_of(x[:, 0], o)
    x = embed[jnp.array([list(prompt) + cached[:-1]])]
    y = x + fpa_layer(x, params)  # the parallel layer on the whole sequence
    parallel = jnp.argmax((y @ head)[0, len(prompt) - 1 :], axis=-1)
    return bytes(cached), bytes(parallel.tolist())


if __name__ == "__main__":
    for name, generate in (("torch", generate_torch), ("jax", generate_jax)):
        cached, recomputed = generate()
        print(f"{name}: {PROMPT + cached!r}; equal to the parallel forward: {cached == recomputed}")
