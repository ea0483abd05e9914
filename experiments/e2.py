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

import numpy as np
import torch
import torch.nn.functional as F

from . import harness
from .models import TinyModel, parameter_count
from .training import seed_everything, train

N_DIGITS_VOCAB = 10  # tokens 0..9 are digits
MODELS = ("fpa", "fox", "softmax_rope")

SETTINGS = {
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
        "steps": 1500,
        "lr": 3e-3,
        "test_sequences": 256,
        "thetas": [16.0, 8.0, 4.0, 2.0, 1.0, 0.5],
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


def passkey_sequences(rng: np.random.Generator, n: int, length: int, cfg: dict):
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
    predicted = answer_logits(logits, passkeys.shape[1]).argmax(-1)
    return float((predicted == passkeys).all(dim=1).float().mean())


def evaluate(
    model: TinyModel, tokens: np.ndarray, passkeys: np.ndarray, theta: float | None, chunk: int = 64
) -> tuple[float, float | None]:
    """(accuracy, kept fraction): the plain forward for theta None, else the decode prefill of
    every FPA layer with a cache evicting at depth >= theta; sequences in chunks of ``chunk``."""
    correct, kept = [], []
    with torch.no_grad():
        for i in range(0, len(tokens), chunk):
            x = torch.from_numpy(tokens[i : i + chunk])
            caches = None if theta is None else model.new_caches(theta)
            logits = model(x, caches)
            correct.append(retrieval_accuracy(logits, torch.from_numpy(passkeys[i : i + chunk])))
            if caches is not None:
                kept.append(np.mean([c.attention.kept_fraction for c in caches]))
    sizes = [len(tokens[i : i + chunk]) for i in range(0, len(tokens), chunk)]
    accuracy = float(np.average(correct, weights=sizes))
    return accuracy, (float(np.average(kept, weights=sizes)) if kept else None)


def run(setting: str, progress: harness.Progress) -> dict:
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

            def batch_loss(model, step, data_rng=data_rng):
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
                acc, frac = evaluate(model, *tests[n], theta)
                accuracy.setdefault(key, []).append(acc)
                kept.setdefault(key, []).append(1.0 if frac is None else frac)
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
                    key: {"accuracy": accuracy[key], "kept_fraction": kept[key]}
                    for key in accuracy
                    if key != "none"
                }
            results["models"].setdefault(name, []).append(entry)
    return {"config": {**cfg, "models": list(MODELS)}, "seeds": cfg["seeds"], "results": results}


LABELS = {"fpa": "FPA (full cache)", "fox": "FoX", "softmax_rope": "softmax + RoPE"}
COLOURS = {"fpa": "C3", "fox": "C0", "softmax_rope": "C1"}


def plot(record: dict, path: Path) -> None:
    """Accuracy against test length (all models, FPA per eviction threshold) and, for FPA,
    accuracy against the kept fraction of the cache at each length."""
    plt = harness.pyplot()
    res, cfg = record["results"], record["config"]
    multiples = cfg["multiples"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, runs in res["models"].items():
        acc = np.mean([r["accuracy"] for r in runs], axis=0)
        left.plot(multiples, acc, "o-", color=COLOURS[name], lw=2, label=LABELS[name])
    fpa_runs = res["models"]["fpa"]
    thetas = list(fpa_runs[0]["eviction"])
    shades = plt.cm.Reds(np.linspace(0.35, 0.85, len(thetas)))
    for theta, shade in zip(thetas, shades, strict=True):
        acc = np.mean([r["eviction"][theta]["accuracy"] for r in fpa_runs], axis=0)
        kept = np.mean([r["eviction"][theta]["kept_fraction"] for r in fpa_runs], axis=0)
        left.plot(
            multiples,
            acc,
            "s--",
            color=shade,
            lw=1,
            label=f"FPA, evict at pi >= {theta} (kept {kept[-1]:.0%} at {multiples[-1]}x)",
        )
        right.plot(kept, acc, "s-", color=shade, lw=1, label=f"theta = {theta}")
        for m, x, y in zip(multiples, kept, acc, strict=True):
            right.annotate(f"{m}x", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=7)
    left.set_xscale("log", base=2)
    left.set_xticks(multiples, [f"{m}x\n({m * cfg['L']})" for m in multiples])
    left.set_xlabel("test length / training length (tokens)")
    left.set_ylabel("passkey retrieved (all digits right)")
    left.set_ylim(-0.03, 1.05)
    left.set_title(f"Retrieval beyond the training length L = {cfg['L']}")
    left.legend(fontsize=7, loc="lower left")
    right.set_xlabel("kept fraction of the KV cache (peak live keys / tokens)")
    right.set_ylabel("passkey retrieved")
    right.set_xlim(0, 1.05)
    right.set_ylim(-0.03, 1.05)
    right.set_title("FPA with eviction: accuracy vs cache kept (labels: test length)")
    right.legend(fontsize=7, loc="lower right")
    fig.suptitle("E2: passkey retrieval, two layers")
    fig.tight_layout()
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    return harness.main("e2", "E2: passkey retrieval beyond the training length.", run, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
