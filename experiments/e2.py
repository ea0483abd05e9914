"""E2: passkey retrieval beyond the training length, with and without KV-cache eviction.

A sequence of filler (random words and digits), with the passkey somewhere in it: a marker
token followed by ``n_digits`` digits; at the end a query marker after which the model must
repeat the passkey's digits (teacher-forced: the loss and the accuracy are on those digits
only). Models are trained at length L and tested at 1x, 2x, 4x, 8x L with the passkey at a
uniformly random depth. A sequence counts as retrieved when every digit is right.

Models: two layers of FPA (learned field and levels), FoX, softmax + RoPE. FPA is also run as a
decoder with the (F7) cache evicting keys at depth pi >= theta for several thresholds; the kept
fraction of the cache (largest live count over the tokens, divided by the tokens, averaged over
layers, heads and sequences) is reported beside the accuracy. The claim (spec/fpa.md section 8):
perfect retrieval at 8x the training length, also with the cache compressed to about 25%.

Run: ``python -m attnspec.experiments.e2 [--quick]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnspec.backends.torch import FPADecodeCache

from . import harness
from .models import TinyModel, parameter_count
from .training import seed_everything, train

N_DIGITS_VOCAB = 10  # tokens 0..9 are digits
MODELS = ("fpa", "fox", "softmax_rope")

SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "L": 64,
        "multiples": [1, 2, 4, 8],
        "n_digits": 2,
        "n_words": 16,
        "digit_filler": 0.2,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 2,
        "head_dim": 32,
        "mlp_hidden": 128,
        "batch": 32,
        "steps": 1000,
        "lr": 3e-3,
        "test_sequences": 128,
        "thetas": [16.0, 8.0, 4.0, 2.0, 1.0],
        "seeds": [0],
    },
    "quick": {
        "L": 24,
        "multiples": [1, 2],
        "n_digits": 1,
        "n_words": 8,
        "digit_filler": 0.2,
        "d_model": 16,
        "n_layers": 2,
        "n_heads": 2,
        "head_dim": 8,
        "mlp_hidden": 32,
        "batch": 16,
        "steps": 30,
        "lr": 3e-3,
        "test_sequences": 32,
        "thetas": [4.0, 1.0],
        "seeds": [0],
    },
}


def vocabulary(cfg: dict) -> dict[str, int]:
    """Token ids: digits 0..9, then the filler words, the passkey marker, the query marker."""
    words = N_DIGITS_VOCAB + cfg["n_words"]
    return {"first_word": N_DIGITS_VOCAB, "key": words, "query": words + 1, "size": words + 2}


def passkey_sequences(
    rng: np.random.Generator, n: int, length: int, cfg: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """n sequences [n, length] and their passkeys [n, n_digits].

    Layout: filler with "KEY d_1 .. d_k" at a uniform random position, then "QUERY d_1 .. d_k"
    as the last k + 1 tokens. Filler tokens are digits with probability ``digit_filler``, words
    otherwise, so a digit is the passkey only by its place after the marker.
    """
    vocab, k = vocabulary(cfg), cfg["n_digits"]
    words = vocab["first_word"] + rng.integers(cfg["n_words"], size=(n, length))
    digits = rng.integers(N_DIGITS_VOCAB, size=(n, length))
    tokens = np.where(rng.random((n, length)) < cfg["digit_filler"], digits, words)
    passkeys = rng.integers(N_DIGITS_VOCAB, size=(n, k))
    start = rng.integers(0, length - 2 * k - 2 + 1, size=n)  # KEY at start, digits after
    rows = np.arange(n)
    tokens[rows, start] = vocab["key"]
    for i in range(k):
        tokens[rows, start + 1 + i] = passkeys[:, i]
    tokens[:, length - k - 1] = vocab["query"]
    tokens[:, length - k :] = passkeys
    return tokens, passkeys


def answer_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The predictions of the k passkey digits: at the query marker and the first k - 1 answer
    digits, [n, k, vocab]."""
    return logits[:, -k - 1 : -1]


def retrieval_accuracy(logits: torch.Tensor, passkeys: torch.Tensor) -> float:
    """Fraction of sequences whose every passkey digit is predicted (argmax) right:
    logits [n, T, vocab], passkeys [n, k] int64."""
    predicted = answer_logits(logits, passkeys.shape[1]).argmax(-1)
    return float((predicted == passkeys).all(dim=1).float().mean())


def kept_by_head(cache: FPADecodeCache, batch: int) -> list[float]:
    """Each head's largest live-key count over the tokens, divided by the tokens, averaged over
    the ``batch`` sequences of an (F7) cache: [heads]."""
    if cache.peak is None:
        raise ValueError("cache: expected a cache that has seen tokens, it is empty")
    return (cache.peak.reshape(batch, -1).double().mean(0) / cache.steps).tolist()


def evaluate(
    model: TinyModel, tokens: np.ndarray, passkeys: np.ndarray, theta: float | None, chunk: int = 64
) -> tuple[float, np.ndarray | None]:
    """(accuracy, kept fractions [layers, heads]): the plain forward for theta None, else the
    decode prefill of every FPA layer with a cache evicting at depth >= theta. A head's kept
    fraction is its largest live-key count over the tokens, divided by the tokens, averaged
    over the sequences (the caches' ``kept_fraction`` per head). Sequences in chunks."""
    correct, kept, sizes = [], [], []
    with torch.no_grad():
        for i in range(0, len(tokens), chunk):
            x = torch.from_numpy(tokens[i : i + chunk])
            caches = None if theta is None else model.new_caches(theta)
            logits = model(x, caches)
            correct.append(retrieval_accuracy(logits, torch.from_numpy(passkeys[i : i + chunk])))
            sizes.append(len(x))
            if caches is not None:
                kept.append([kept_by_head(c.attention, len(x)) for c in caches])
    accuracy = float(np.average(correct, weights=sizes))
    return accuracy, (np.average(kept, axis=0, weights=sizes) if kept else None)


def run(setting: str, progress: harness.Progress) -> dict:
    """Train each model of :data:`MODELS` at length L, test it at every multiple of L (FPA also
    with evicting caches at every theta); returns the config, seeds and results of the record.

    Time O(steps x batch x L^2 d + thetas x sequences x (8 L)^2 d) per model and seed; memory
    O(chunk x heads x (8 L)^2) for the eviction counts.
    """
    cfg = SETTINGS[setting]
    vocab = vocabulary(cfg)
    k = cfg["n_digits"]
    lengths = [m * cfg["L"] for m in cfg["multiples"]]
    tests = {
        n: passkey_sequences(np.random.default_rng(777 + n), cfg["test_sequences"], n, cfg)
        for n in lengths
    }
    results: dict = {"models": {}, "lengths": lengths}
    for seed in cfg["seeds"]:
        for name in MODELS:
            data_rng = np.random.default_rng(seed)
            seed_everything(seed)
            model = TinyModel(
                vocab["size"],
                vocab["size"],
                mixer=name,
                d_model=cfg["d_model"],
                n_layers=cfg["n_layers"],
                n_heads=cfg["n_heads"],
                head_dim=cfg["head_dim"],
                mlp_hidden=cfg["mlp_hidden"],
            )

            def batch_loss(
                model: nn.Module, step: int, data_rng: np.random.Generator = data_rng
            ) -> torch.Tensor:
                tokens, passkeys = passkey_sequences(data_rng, cfg["batch"], cfg["L"], cfg)
                logits = answer_logits(model(torch.from_numpy(tokens)), k)
                return F.cross_entropy(
                    logits.reshape(-1, vocab["size"]), torch.from_numpy(passkeys).reshape(-1)
                )

            losses = train(
                model,
                batch_loss,
                steps=cfg["steps"],
                lr=cfg["lr"],
                progress=progress,
                label=f"e2 {name} seed {seed}",
            )
            evaluations = [(None, n) for n in lengths]
            if name == "fpa":
                evaluations += [(theta, n) for theta in cfg["thetas"] for n in lengths]
            progress.begin(f"e2 {name} evaluation", len(evaluations))
            accuracy: dict = {}
            kept: dict = {}
            for theta, n in evaluations:
                key = "none" if theta is None else f"{theta:g}"
                tokens, passkeys = tests[n]
                acc, by_head = evaluate(model, tokens, passkeys, theta)
                accuracy.setdefault(key, []).append(acc)
                if by_head is not None:
                    kept.setdefault(key, []).append(by_head)
                progress.advance(f"theta {key} T {n}: {acc:.2f}")
            progress.end()
            entry = {
                "seed": seed,
                "parameters": parameter_count(model),
                "loss_curve": [round(x, 5) for x in losses],
                "final_train_loss": float(np.mean(losses[-max(1, cfg["steps"] // 20) :])),
                "accuracy": accuracy["none"],
            }
            if name == "fpa":
                entry["eviction"] = {
                    key: {
                        "accuracy": accuracy[key],
                        "kept_fraction": [float(h.mean()) for h in kept[key]],
                        "kept_fraction_by_layer_head": [np.round(h, 4).tolist() for h in kept[key]],
                    }
                    for key in kept
                }
            results["models"].setdefault(name, []).append(entry)
    return {"config": {**cfg, "models": list(MODELS)}, "seeds": cfg["seeds"], "results": results}


LABELS = {"fpa": "FPA (full cache)", "fox": "FoX", "softmax_rope": "softmax + RoPE"}
STYLES = {
    "fpa": {"color": "C3", "marker": "o", "ms": 9, "lw": 3},
    "fox": {"color": "C0", "marker": "s", "ms": 5, "lw": 1.5, "ls": "--"},
    "softmax_rope": {"color": "C1", "marker": "^", "ms": 6, "lw": 1.5},
}


def plot(record: dict, path: Path) -> None:
    """Accuracy against test length for the three models; FPA's accuracy with eviction at each
    threshold; the kept fraction of each layer's cache (per head) at the longest length."""
    plt = harness.pyplot()
    res, cfg = record["results"], record["config"]
    multiples = cfg["multiples"]
    ticks = [f"{m}x\n({m * cfg['L']})" for m in multiples]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for name, runs in res["models"].items():
        acc = np.mean([r["accuracy"] for r in runs], axis=0)
        ax.plot(multiples, acc, label=LABELS[name], **STYLES[name])
    ax.set_title(f"Full cache: retrieval beyond the training length L = {cfg['L']}")

    fpa_runs = res["models"]["fpa"]
    thetas = list(fpa_runs[0]["eviction"])
    shades = plt.cm.viridis(np.linspace(0.0, 0.85, len(thetas)))
    ax = axes[1]
    for i, (theta, shade) in enumerate(zip(thetas, shades, strict=True)):
        acc = np.mean([r["eviction"][theta]["accuracy"] for r in fpa_runs], axis=0)
        kept = np.mean([r["eviction"][theta]["kept_fraction"] for r in fpa_runs], axis=0)
        ax.plot(
            multiples,
            acc,
            "s-",
            color=shade,
            ms=max(3, 10 - 1.5 * i),  # overlaps visible
            label=f"theta = {theta}: {kept[-1]:.0%} of the cache kept at {multiples[-1]}x",
        )
    ax.set_title("FPA decoding with eviction at depth pi >= theta")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(multiples, ticks)
        ax.minorticks_off()
        ax.set_xlabel("test length / training length (tokens)")
        ax.set_ylabel("passkey retrieved (all digits right)")
        ax.set_ylim(-0.03, 1.45)  # room for the legend above the curves
        ax.set_yticks(np.linspace(0, 1, 6))
        ax.legend(fontsize=8, loc="upper left")

    ax = axes[2]
    by_head = np.array(
        [fpa_runs[0]["eviction"][t]["kept_fraction_by_layer_head"][-1] for t in thetas]
    )
    n_layers, n_heads = by_head.shape[1:]
    width = 0.8 / (n_layers * n_heads)
    for layer in range(n_layers):
        for head in range(n_heads):
            offset = (layer * n_heads + head) * width - 0.4 + width / 2
            ax.bar(
                np.arange(len(thetas)) + offset,
                by_head[:, layer, head],
                width,
                color=f"C{layer}",
                alpha=1.0 - 0.4 * head,
                label=f"layer {layer + 1}, head {head + 1}",
            )
    ax.set_xticks(range(len(thetas)), [f"theta = {t}" for t in thetas])
    ax.set_ylabel(f"kept fraction of the cache at {multiples[-1]}x (peak live keys / tokens)")
    ax.set_ylim(0, 1.3)
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_title(f"Where the cache goes (FPA, seed {fpa_runs[0]['seed']}, {multiples[-1]}x)")
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.suptitle("E2: passkey retrieval, two layers, trained at one length, tested at several")
    fig.tight_layout()
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnspec.experiments.e2 [--quick] [--out DIR] [--figures DIR] ...``"""
    return harness.main("e2", "E2: passkey retrieval beyond the training length.", run, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
