"""A tiny byte-level language model from the Flax NNX modules, trained with optax.

Embedding, an FPA layer and an Interdomain layer (each with a residual), output head; trained
for a few steps under ``nnx.jit`` on one short text (the loss falls), then: generation with
the decode caches, the model through ``nnx.split`` / ``nnx.merge`` into a pure ``jax.jit``
function, and an ensemble of models created and run under ``nnx.vmap``.

Run: ``python docs/examples/nnx_lm.py`` (needs the flax extra).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnspec.backends.jax.nnx import FirstPassageAttention, InterdomainAttention

TEXT = b"first passage attention: a key is forgotten once the field falls below its level. " * 2


# --8<-- [start:model]
class TinyLM(nnx.Module):
    """tokens [B, T] (bytes) -> logits [B, T, 256]."""

    def __init__(self, d: int = 32, *, sharding: str | None = None, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(256, d, rngs=rngs)
        self.fpa = FirstPassageAttention(d, 2, 8, sharding=sharding, rngs=rngs)
        self.idm = InterdomainAttention(d, 2, 8, n_modes=8, sharding=sharding, rngs=rngs)
        self.head = nnx.Linear(d, 256, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, decode: bool = False) -> jax.Array:
        x = self.embed(tokens)
        x = x + self.fpa(x, decode=decode)
        x = x + self.idm(x, decode=decode)
        return self.head(x)

    def init_cache(self, batch: int, max_len: int) -> None:
        self.fpa.init_cache(batch, max_len)
        self.idm.init_cache(batch, max_len)


def loss_fn(model: TinyLM, tokens: jax.Array) -> jax.Array:
    """Next-byte cross-entropy (nats per byte)."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(
    model: TinyLM, optimizer: nnx.Optimizer, tokens: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One Adam step; the loss before it and the gradients' global norm."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss, optax.tree.norm(grads)


# --8<-- [end:model]


def batch() -> jax.Array:
    """The text as one sequence of bytes [1, T]."""
    return jnp.asarray(list(TEXT), jnp.int32)[None]


def train(steps: int = 8, seed: int = 0) -> tuple[TinyLM, list[float], list[float]]:
    """A model trained for ``steps`` Adam steps; the loss and gradient norm of each step."""
    model = TinyLM(rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
    tokens = batch()
    losses, norms = [], []
    for _ in range(steps):
        loss, norm = train_step(model, optimizer, tokens)
        losses.append(float(loss))
        norms.append(float(norm))
    return model, losses, norms


# --8<-- [start:generate]
def generate(model: TinyLM, prompt: bytes, new_tokens: int) -> bytes:
    """Greedy decoding: the prompt into fresh caches at once, then one token per call."""
    tokens = jnp.asarray(list(prompt), jnp.int32)[None]
    model.init_cache(1, len(prompt) + new_tokens)
    logits = model(tokens, decode=True)[:, -1]
    out = []
    for _ in range(new_tokens):
        token = jnp.argmax(logits, axis=-1)
        out.append(int(token[0]))
        logits = model(token[:, None], decode=True)[:, -1]
    return bytes(out)


# --8<-- [end:generate]


# --8<-- [start:transforms]
def pure_forward(model: TinyLM) -> tuple[nnx.GraphDef, nnx.State, jax.stages.Wrapped]:
    """The model as a graph definition, its state and a pure jit-compiled function of them."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(tokens)

    return graphdef, state, forward


def ensemble(keys: jax.Array, tokens: jax.Array) -> tuple[TinyLM, jax.Array]:
    """One model per key (of ``jax.random.split``), created by ``nnx.vmap`` (the parameters
    get a leading axis), and every member's logits on the same tokens [E, B, T, 256]."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def create(key: jax.Array) -> TinyLM:
        return TinyLM(rngs=nnx.Rngs(key))

    models = create(keys)

    @nnx.vmap(in_axes=(0, None), out_axes=0)
    def run(model: TinyLM, tokens: jax.Array) -> jax.Array:
        return model(tokens)

    return models, run(models, tokens)


# --8<-- [end:transforms]


if __name__ == "__main__":
    model, losses, _ = train(steps=30)
    print("loss per step:", " ".join(f"{loss:.3f}" for loss in losses))
    print("generated:", generate(model, b"first passage", 24))
