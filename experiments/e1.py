"""E1: bracket scopes, one layer. Which symbols are visible at each token?

Sequences of "(", ")" and symbols s_0..s_{S-1}. A token belongs to the innermost scope open where
it stands ("(" to the scope it opens, ")" to the enclosing one); at position i the visible
symbols are those among tokens whose scopes are still open: lexical scoping, a closed block is
forgotten, the outer context stays. This key set is the live set of the stack theorem (T1) with
the field phi = bracket depth. The model predicts, at every position, the visible set as S
independent bits (binary cross-entropy).

Models: one attention layer of equal head dim (no MLP between embedding and attention), a
residual, an MLP readout: FPA (learned field and levels), FoX, softmax + ALiBi, softmax + RoPE,
several seeds each. Reported: test accuracy (a position counts when all S bits are right),
success rate (accuracy >= 0.99), final loss; and for FPA whether the learned live set
{j : pi_ij = 0} equals the scope set. The claim (spec/fpa.md section 8): FPA converges, softmax
with positional bias and FoX at the same dk fail on every seed.

Run: ``python -m attnspec.experiments.e1 [--quick]``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnspec.reference import fpa as reference

from . import harness
from .models import TinyModel, parameter_count
from .training import seed_everything, train

OPEN, CLOSE = 0, 1  # token ids; symbols are 2 .. 2 + S - 1
MODELS = ("fpa", "fox", "softmax_alibi", "softmax_rope")
SUCCESS_ACCURACY = 0.99

SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "T": 48,
        "n_symbols": 8,
        "p_open": 0.2,
        "p_close": 0.2,
        "max_depth": 5,
        "d_model": 32,
        "n_heads": 1,
        "head_dim": 8,
        "readout_hidden": 64,
        "batch": 32,
        "steps": 600,
        "lr": 1e-2,
        "test_sequences": 512,
        "seeds": [0, 1, 2, 3, 4],
    },
    "quick": {
        "T": 24,
        "n_symbols": 6,
        "p_open": 0.2,
        "p_close": 0.2,
        "max_depth": 4,
        "d_model": 16,
        "n_heads": 1,
        "head_dim": 8,
        "readout_hidden": 32,
        "batch": 16,
        "steps": 40,
        "lr": 1e-2,
        "test_sequences": 64,
        "seeds": [0, 1],
    },
}


def bracket_sequences(
    rng: np.random.Generator,
    n: int,
    T: int,
    n_symbols: int,
    p_open: float,
    p_close: float,
    max_depth: int,
) -> np.ndarray:
    """n random token sequences [n, T] (int64): "(" with probability p_open below max_depth,
    ")" with p_close when a scope is open, a uniform symbol otherwise."""
    r = rng.random((n, T))
    tokens = 2 + rng.integers(n_symbols, size=(n, T))
    depth = np.zeros(n, dtype=np.int64)
    for t in range(T):
        opens = (r[:, t] < p_open) & (depth < max_depth)
        closes = ~opens & (r[:, t] < p_open + p_close) & (depth > 0)
        tokens[opens, t], tokens[closes, t] = OPEN, CLOSE
        depth += opens.astype(np.int64) - closes
    return tokens


def scope_sets(tokens: np.ndarray) -> np.ndarray:
    """visible[i, j]: token j belongs to a scope still open at position i (j <= i), by a literal
    stack of scopes (not by the field): [n, T, T] bool."""
    n, T = tokens.shape
    visible = np.zeros((n, T, T), dtype=bool)
    for b in range(n):
        scopes: list[list[int]] = [[]]  # open scopes, outermost first, with their tokens
        for i, token in enumerate(tokens[b]):
            if token == OPEN:
                scopes.append([i])
            elif token == CLOSE:
                scopes.pop()
                scopes[-1].append(i)
            else:
                scopes[-1].append(i)
            visible[b, i, [j for scope in scopes for j in scope]] = True
    return visible


def bracket_depth(tokens: np.ndarray) -> np.ndarray:
    """The field of (T1) for brackets: +1 at "(", -1 at ")", 0 at symbols, summed: [n, T]."""
    return np.cumsum(np.where(tokens == OPEN, 1.0, np.where(tokens == CLOSE, -1.0, 0.0)), axis=1)


def visible_symbols(tokens: np.ndarray, visible: np.ndarray, n_symbols: int) -> np.ndarray:
    """targets[b, i, c] = 1 when symbol c is among the visible tokens at i: [n, T, S] float32."""
    onehot = tokens[..., None] == 2 + np.arange(n_symbols)  # [n, T, S]
    return (np.einsum("nij,njc->nic", visible, onehot) > 0).astype(np.float32)


def set_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of positions whose predicted set (logit > 0) equals the target set."""
    return float(((logits > 0) == (targets > 0.5)).all(dim=-1).float().mean())


def learned_live_sets(model: TinyModel, tokens: torch.Tensor, visible: np.ndarray) -> dict:
    """Compare FPA's learned live set with the scope set on ``tokens``.

    The layer's input depends on the token alone (one layer, no positional embedding), so its
    field increments delta and key offsets lam (spec/fpa.md section 3) are one number per token
    type; they are reported, then the field phi = cumsum(delta), the levels phi + lam, the
    descent depths pi_ij and the live sets {j : pi_ij = 0} come from the reference. The live set
    is compared with the scope set over all keys and over the symbol keys (the ones that carry
    an answer), and a row counts as separable when every visible key has a smaller depth than
    every hidden one.
    """
    block = model.layers()[0]
    layer = block.fpa()
    with torch.no_grad():
        h = block.norm1(model.embed.weight)  # every token type: [vocab, d]
        delta = (h @ layer.w_delta + layer.b_delta)[:, 0].double().numpy()  # head 0
        offset = (h @ layer.w_lam + layer.b_lam)[:, 0].double().numpy()
    field = np.cumsum(delta[tokens.numpy()], axis=1)  # [n, T]
    level = field + offset[tokens.numpy()]
    pi = reference.descent_depth(field, level)  # [n, T, T]
    live = reference.live_keys(field, level)
    causal = np.tril(np.ones(pi.shape[-2:], dtype=bool))
    symbol = (tokens.numpy() >= 2)[:, None, :]  # key j is a symbol
    in_scope = np.where(visible, pi, -np.inf).max(axis=-1)  # deepest penalty on a visible key
    out_scope = np.where(causal & ~visible, pi, np.inf).min(axis=-1)
    return {
        "delta": {"open": delta[OPEN], "close": delta[CLOSE], "symbols": delta[2:].tolist()},
        "lam": {"open": offset[OPEN], "close": offset[CLOSE], "symbols": offset[2:].tolist()},
        "live_equals_scope": float((live == visible).all(axis=-1).mean()),
        "live_equals_scope_on_symbols": float(((live == visible) | ~symbol).all(axis=-1).mean()),
        "separable_rows": float((in_scope < out_scope).mean()),
        "median_depth_visible": float(np.median(pi[visible])),
        "median_depth_hidden": float(np.median(pi[causal & ~visible])),
    }


def attention_map(model: TinyModel, tokens: torch.Tensor) -> np.ndarray:
    """FPA's attention weights p_ij (F4) for one sequence [1, T], from the reference op on the
    layer's own q, k, field and level (head 0): [T, T]."""
    block = model.layers()[0]
    layer = block.fpa()
    with torch.no_grad():
        h = block.norm1(model.embed(tokens))[0].double()  # [T, d]
        q = (h @ layer.wq.double())[:, : layer.head_dim].numpy()
        k = (h @ layer.wk.double())[:, : layer.head_dim].numpy()
        field = torch.cumsum(h @ layer.w_delta.double() + layer.b_delta.double(), 0)[:, 0]
        level = field + (h @ layer.w_lam.double() + layer.b_lam.double())[:, 0]
    eye = np.eye(len(q))  # values = one-hot positions: the outputs are the weights themselves
    return reference.fpa_attention(q, k, eye, field.numpy(), level.numpy())


def run(setting: str, progress: harness.Progress) -> dict:
    """Train every model of :data:`MODELS` on every seed of ``setting`` ("quick" or "full") and
    score it on held-out sequences; returns the config, seeds and results of the record.

    Time O(models x seeds x steps x batch x T^2 d); memory O(batch T^2) (the scope sets).
    """
    cfg = SETTINGS[setting]
    data_cfg = {k: cfg[k] for k in ("T", "n_symbols", "p_open", "p_close", "max_depth")}
    test_tokens = bracket_sequences(np.random.default_rng(12345), cfg["test_sequences"], **data_cfg)
    test_visible = scope_sets(test_tokens)
    test_targets = torch.from_numpy(visible_symbols(test_tokens, test_visible, cfg["n_symbols"]))
    test_x = torch.from_numpy(test_tokens)
    # what "every symbol seen so far" scores: the answer of a model that ignores the brackets
    seen = np.tril(np.ones((cfg["T"], cfg["T"]), dtype=bool))[None].repeat(len(test_tokens), 0)
    seen_targets = torch.from_numpy(visible_symbols(test_tokens, seen, cfg["n_symbols"]))
    ignore_brackets = set_accuracy(2 * seen_targets - 1, test_targets)

    results: dict = {"models": {}, "ignore_brackets_accuracy": ignore_brackets}
    for name in MODELS:
        runs = []
        for seed in cfg["seeds"]:
            data_rng = np.random.default_rng(seed)
            seed_everything(seed)
            model = TinyModel(
                2 + cfg["n_symbols"],
                cfg["n_symbols"],
                mixer=name,
                d_model=cfg["d_model"],
                n_layers=1,
                n_heads=cfg["n_heads"],
                head_dim=cfg["head_dim"],
                readout_hidden=cfg["readout_hidden"],
            )

            def batch_loss(
                model: nn.Module, step: int, data_rng: np.random.Generator = data_rng
            ) -> torch.Tensor:
                tokens = bracket_sequences(data_rng, cfg["batch"], **data_cfg)
                targets = visible_symbols(tokens, scope_sets(tokens), cfg["n_symbols"])
                logits = model(torch.from_numpy(tokens))
                return F.binary_cross_entropy_with_logits(logits, torch.from_numpy(targets))

            losses = train(
                model,
                batch_loss,
                steps=cfg["steps"],
                lr=cfg["lr"],
                progress=progress,
                label=f"e1 {name} seed {seed}",
            )
            with torch.no_grad():
                logits = model(test_x)
            entry = {
                "seed": seed,
                "parameters": parameter_count(model),
                "loss_curve": [round(x, 5) for x in losses],
                "final_train_loss": float(np.mean(losses[-max(1, cfg["steps"] // 20) :])),
                "test_loss": float(F.binary_cross_entropy_with_logits(logits, test_targets)),
                "test_accuracy": set_accuracy(logits, test_targets),
            }
            entry["success"] = entry["test_accuracy"] >= SUCCESS_ACCURACY
            if name == "fpa":
                entry["live_set"] = learned_live_sets(model, test_x, test_visible)
                if seed == cfg["seeds"][0]:  # a causal prefix: the first tokens of a test sequence
                    n = min(cfg["T"], 32)
                    results["example"] = {
                        "tokens": test_tokens[0, :n].tolist(),
                        "scope": test_visible[0, :n, :n].astype(int).tolist(),
                        "fpa_weights": np.round(attention_map(model, test_x[:1, :n]), 4).tolist(),
                    }
            runs.append(entry)
        results["models"][name] = {
            "runs": runs,
            "success_rate": float(np.mean([r["success"] for r in runs])),
            "mean_test_accuracy": float(np.mean([r["test_accuracy"] for r in runs])),
        }
    config = {**cfg, "models": list(MODELS), "success_accuracy": SUCCESS_ACCURACY}
    return {"config": config, "seeds": cfg["seeds"], "results": results}


LABELS = {
    "fpa": "FPA",
    "fox": "FoX",
    "softmax_alibi": "softmax + ALiBi",
    "softmax_rope": "softmax + RoPE",
}
COLOURS = {"fpa": "C3", "fox": "C0", "softmax_alibi": "C2", "softmax_rope": "C1"}


def plot(record: dict, path: Path) -> None:
    """Loss curves, test accuracy per seed, and one sequence: scope set vs FPA's weights."""
    plt = harness.pyplot()
    res, cfg = record["results"], record["config"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 9))
    ax = axes[0, 0]
    for name, entry in res["models"].items():
        curves = np.array([r["loss_curve"] for r in entry["runs"]])
        for curve in curves:
            ax.plot(curve, color=COLOURS[name], alpha=0.25, lw=0.7)
        ax.plot(curves.mean(0), color=COLOURS[name], lw=1.8, label=LABELS[name])
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("binary cross-entropy (train batch)")
    ax.set_title("Training loss (thin: seeds, thick: mean)")
    ax.legend()

    ax = axes[0, 1]
    for x, (name, entry) in enumerate(res["models"].items()):
        acc = [r["test_accuracy"] for r in entry["runs"]]
        ax.scatter(
            np.full(len(acc), x) + np.linspace(-0.15, 0.15, len(acc)),
            acc,
            color=COLOURS[name],
            zorder=3,
        )
        ax.text(
            x,
            1.02,
            f"{sum(r['success'] for r in entry['runs'])}/{len(acc)}",
            ha="center",
            va="bottom",
        )
    ax.axhline(
        record["config"]["success_accuracy"],
        color="k",
        ls="--",
        lw=0.8,
        label=f"success: {record['config']['success_accuracy']}",
    )
    ax.axhline(
        res["ignore_brackets_accuracy"],
        color="grey",
        ls=":",
        lw=1,
        label="every symbol seen so far",
    )
    ax.set_xticks(range(len(res["models"])), [LABELS[n] for n in res["models"]])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("test accuracy (whole visible set right)")
    ax.set_title(f"Test accuracy per seed; successes above the points (dk = {cfg['head_dim']})")
    ax.legend(loc="lower left")

    example = res["example"]
    names = {OPEN: "(", CLOSE: ")"}
    labels = [names.get(t, f"s{t - 2}") for t in example["tokens"]]
    fpa0 = res["models"]["fpa"]["runs"][0]["live_set"]
    delta = fpa0["delta"]
    learned = (
        f"learned field steps: '(' {delta['open']:+.1f}, ')' {delta['close']:+.1f}, "
        f"symbols {np.mean(delta['symbols']):+.2f}"
    )
    weights = np.array(example["fpa_weights"])
    for ax, image, title in (
        (axes[1, 0], np.array(example["scope"]), "Scope set: keys j visible at query i"),
        (
            axes[1, 1],
            weights / weights.max(axis=1, keepdims=True),
            f"FPA (seed {record['seeds'][0]}) weights p_ij / max_j p_ij\n{learned}",
        ),
    ):
        ax.imshow(image, cmap="Greys", vmin=0, vmax=1)
        ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=90)
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
        ax.set_title(title)
    fig.suptitle("E1: which symbols are in scope? One layer, several seeds")
    fig.tight_layout()
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnspec.experiments.e1 [--quick] [--out DIR] [--figures DIR] ...``"""
    return harness.main("e1", "E1: bracket-scope set selection, one layer.", run, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
