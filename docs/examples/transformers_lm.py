"""attnspec models in Hugging Face transformers: build, train a few steps, generate, save, load.

A tiny hybrid byte-level model (FPA and Interdomain layers) trained for a few steps on the
project's own FPA spec text with transformers' ``Trainer``, then ``generate()`` with FPA's KV
eviction (theta) and the live / stored fractions and bytes read from the cache, then a save /
load round trip. Run: ``python docs/examples/transformers_lm.py`` (needs the hf extra: ``pip install
".[hf]"``); no hub access (HF_HUB_OFFLINE=1 works).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import attnspec.models  # registers the attnspec kinds with the Auto classes  # noqa: F401
from attnspec.models import AttnSpecCache, HybridConfig

TEXT = Path(__file__).resolve().parents[1] / "spec" / "fpa.md"


def train(steps: int = 20, seed: int = 0) -> tuple[AutoModelForCausalLM, list[float]]:
    """A small hybrid model trained ``steps`` steps on 64-byte windows; returns it and the
    losses."""
    # --8<-- [start:build]
    config = HybridConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        layer_pattern="FPA,ID",
        num_heads=4,
        intermediate_size=128,
        id_modes=16,
        max_rollback=4,  # crop() may undo up to 4 positions (F9)
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # --8<-- [end:build]
    data = torch.tensor(list(TEXT.read_bytes()[:8192]), dtype=torch.long)
    windows = data[: len(data) // 64 * 64].view(-1, 64)

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(windows)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": windows[i], "labels": windows[i]}

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=16,
            learning_rate=3e-3,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Windows())
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model.eval(), losses


def generate(
    model: AutoModelForCausalLM, theta: float = math.inf
) -> tuple[list[bytes], list, tuple[int, int]]:
    """Greedy continuations of two prompts of different lengths (left padding), evicting FPA
    keys at depth >= theta; returns the texts, the cache's per-layer fractions and its bytes
    (held, and what a full cache would hold)."""
    # --8<-- [start:generate]
    prompts = [b"The segment minimum", b"FoX is"]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding
        ids[r, width - len(p) :] = torch.tensor(list(p))
        mask[r, width - len(p) :] = 1
    cache = AttnSpecCache(model.config, theta=theta)  # (F7) eviction threshold
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=24,
        do_sample=False,
        pad_token_id=0,
        cache=cache,  # generate() decodes with it (or makes one; theta= also works)
    )
    fractions = cache.fractions()  # per layer: live and stored fractions
    memory = cache.bytes_held(), cache.bytes_full()  # bytes held, and held without eviction
    # --8<-- [end:generate]
    texts = [bytes(row[width:].tolist()) for row in out]
    return texts, fractions, memory


def save_and_load(model: AutoModelForCausalLM) -> AutoModelForCausalLM:
    """The safetensors round trip: save_pretrained, then from_pretrained through the Auto class."""
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path).eval()


if __name__ == "__main__":
    torch.set_num_threads(1)  # small CPU models: one thread is fastest (README)
    model, losses = train()
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
    for theta in (math.inf, 2.0):
        texts, fractions, (held, full) = generate(model, theta)
        live, stored = fractions[0]["live"], fractions[0]["stored"]
        print(f"theta = {theta}: {texts}")
        print(f"  FPA layer: live {live:.2f}, stored {stored:.2f}")
        print(f"  cache: {held} bytes held, {full} without eviction (pages round up)")
    loaded = save_and_load(model)
    print("reloaded model generates the same:", generate(loaded)[0] == generate(model)[0])
