"""E3: tiny byte-level language models on the Python standard library's own sources.

The corpus is every ``.py`` file of the running Python's standard library (site-packages left
out), read from disk: available offline on every machine, different between Python versions
(its size and hash are recorded). Files are split into training and validation by a hash of
their path. Models are trained on windows of L bytes and evaluated on validation windows of
4L bytes: the loss at each position gives the curve at 1x, 2x and 4x the training length
(a causal model's loss at positions < nL is the loss it would have on windows of nL bytes).

Models, at equal parameter counts (the MLP width of each is set so its count matches the
largest): softmax + RoPE, Interdomain (S4D layer; also with the optional ratio readout),
Interdomain without the query-conditioned path (the paper's ablation), S4D-only (query and key
paths removed), FPA (signed field, and FoX-initialised), FoX. Differences between two models
are taken window by window (paired), so their standard errors are those of the difference.
The claims
(spec/interdomain.md section 4, spec/fpa.md section 8): Interdomain beats S4D-only, removing
the query path costs perplexity, Interdomain's loss stays flat beyond the training length where
softmax's rises; FPA's loss is on par with FoX's. The FPA model is also decoded with caches
evicting at depth >= theta (F7): kept fraction and loss for each theta.

Run: ``python -m attnspec.experiments.e3 [--quick]``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from attnspec.backends.torch import InterdomainAttention

from . import harness
from .models import TinyModel, matched_mlp_hidden, parameter_count
from .training import seed_everything, train

MODELS = (
    "softmax_rope",
    "interdomain",
    "interdomain_ratio",
    "interdomain_noquery",
    "s4d_only",
    "fpa",
    "fpa_foxinit",
    "fox",
)
# (A, B): the paired difference loss_A - loss_B over the same validation windows
COMPARISONS = (
    ("interdomain", "s4d_only"),
    ("interdomain", "interdomain_noquery"),
    ("interdomain", "softmax_rope"),
    ("interdomain_ratio", "interdomain"),
    ("fpa", "fox"),
    ("fpa_foxinit", "fox"),
)
VALIDATION_HASH_BYTE = 26  # a file whose path hash starts below this validates: ~10%

SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "L": 128,
        "eval_multiple": 4,
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "head_dim": 16,
        "n_modes": 16,
        "mlp_hidden_base": 128,
        "batch": 16,
        "steps": 400,
        "lr": 3e-3,
        "eval_windows": 128,
        "thetas": [16.0, 8.0, 4.0, 2.0],
        "max_corpus_bytes": None,
        "seeds": [0],
    },
    "quick": {
        "L": 32,
        "eval_multiple": 4,
        "d_model": 16,
        "n_layers": 1,
        "n_heads": 2,
        "head_dim": 8,
        "n_modes": 4,
        "mlp_hidden_base": 32,
        "batch": 8,
        "steps": 15,
        "lr": 3e-3,
        "eval_windows": 8,
        "thetas": [2.0],
        "max_corpus_bytes": 300_000,
        "seeds": [0],
    },
}


def stdlib_corpus(max_bytes: int | None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train bytes, validation bytes, description) from the standard library's ``.py`` files,
    in path order, split by path hash, each side cut at ``max_bytes`` (None: all), as uint8
    arrays."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    )
    if not files:
        raise ValueError(f"stdlib: expected .py files under {root}, found none")
    sides: dict[str, list[bytes]] = {"train": [], "validation": []}
    sizes = {"train": 0, "validation": 0}
    for path in files:
        name = path.relative_to(root).as_posix()
        side = (
            "validation"
            if hashlib.sha256(name.encode()).digest()[0] < VALIDATION_HASH_BYTE
            else "train"
        )
        if max_bytes is not None and sizes[side] >= max_bytes:
            continue
        text = path.read_bytes() + b"\n\n"
        sides[side].append(text)
        sizes[side] += len(text)
    train_bytes, val_bytes = (b"".join(sides[s])[:max_bytes] for s in ("train", "validation"))
    if min(len(train_bytes), len(val_bytes)) < 4096:
        raise ValueError(f"stdlib: expected at least 4 KiB on each side, got {sizes}")
    description = {
        "root": str(root),
        "python": sys.version.split()[0],
        "files": len(files),
        "train_bytes": len(train_bytes),
        "validation_bytes": len(val_bytes),
        "sha256": hashlib.sha256(train_bytes + val_bytes).hexdigest()[:16],
    }
    return (
        np.frombuffer(train_bytes, dtype=np.uint8),
        np.frombuffer(val_bytes, dtype=np.uint8),
        description,
    )


def windows(data: np.ndarray, starts: np.ndarray, length: int) -> torch.Tensor:
    """Byte windows data[s : s + length] for each start: [n, length] int64."""
    return torch.from_numpy(data[starts[:, None] + np.arange(length)].astype(np.int64))


def model_for(name: str, cfg: dict, mlp_hidden: int) -> TinyModel:
    """The byte-level model with mixer ``name`` at the sizes of ``cfg``: 256 tokens in and out."""
    return TinyModel(
        256,
        256,
        mixer=name,
        d_model=cfg["d_model"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        head_dim=cfg["head_dim"],
        mlp_hidden=mlp_hidden,
        n_modes=cfg["n_modes"],
    )


def loss_by_position(
    model: TinyModel, batch: torch.Tensor, theta: float | None = None, chunk: int = 16
) -> tuple[np.ndarray, float | None]:
    """Next-byte cross-entropy (nats) at every position of every window [n, T - 1], and with
    ``theta`` (FPA models) the loss when decoding with caches evicting at depth >= theta and
    their kept fraction (peak live keys / tokens, averaged over layers, heads and windows)."""
    out, kept = [], []
    with torch.no_grad():
        for i in range(0, len(batch), chunk):
            x = batch[i : i + chunk]
            caches = None if theta is None else model.new_caches(theta)
            logits = model(x[:, :-1], caches)
            out.append(F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none"))
            if caches is not None:
                kept += [c.attention.kept_fraction for c in caches] * len(x)
    return torch.cat(out).numpy(), (float(np.mean(kept)) if kept else None)


def summarise(losses: np.ndarray, L: int, multiple: int) -> dict:
    """Mean loss (and its standard error over windows) at 1x, 2x, ... the training length and
    in each band [nL/2, nL) beyond it."""
    summary = {}
    n = 1
    while n <= multiple:
        per_window = losses[:, : n * L].mean(axis=1)
        summary[f"{n}x"] = {
            "mean": float(per_window.mean()),
            "stderr": float(per_window.std(ddof=1) / np.sqrt(len(per_window))),
        }
        if n > 1:
            band = losses[:, n * L // 2 : n * L].mean(axis=1)
            summary[f"band_{n // 2}x_{n}x"] = {
                "mean": float(band.mean()),
                "stderr": float(band.std(ddof=1) / np.sqrt(len(band))),
            }
        n *= 2
    return summary


def paired_difference(a: np.ndarray, b: np.ndarray, L: int, multiple: int) -> dict:
    """loss_a - loss_b over the same windows [n, T] at 1x, 2x, ...: mean, standard error of the
    per-window difference, and the ratio of per-byte perplexities exp(mean)."""
    out = {}
    n = 1
    while n <= multiple:
        diff = a[:, : n * L].mean(axis=1) - b[:, : n * L].mean(axis=1)
        mean = float(diff.mean())
        out[f"{n}x"] = {
            "mean": mean,
            "stderr": float(diff.std(ddof=1) / np.sqrt(len(diff))),
            "perplexity_ratio": float(np.exp(mean)),
        }
        n *= 2
    return out


def time_constants(model: TinyModel) -> list[list[list[float]]]:
    """Per layer and head, the shortest and longest memory of the S4D modes in tokens,
    -1 / log|Lambda| = 1 / (dt exp(a_log)) (I11): [layers][heads][2]."""
    out = []
    with torch.no_grad():
        for block in model.layers():
            mixer = block.mixer
            if not isinstance(mixer, InterdomainAttention):
                raise ValueError(f"model: expected Interdomain layers, got {type(mixer).__name__}")
            tau = 1.0 / (torch.exp(mixer.log_dt)[:, None] * torch.exp(mixer.a_log))  # [H, M]
            out.append([[round(float(t.min()), 1), round(float(t.max()), 1)] for t in tau])
    return out


def eviction(model: TinyModel, batch: torch.Tensor, cfg: dict) -> dict:
    """FPA decoding the validation windows with caches evicting at depth >= theta, for each
    theta of the setting: kept fraction and the loss summary."""
    out = {}
    for theta in cfg["thetas"]:
        losses, kept = loss_by_position(model, batch, theta)
        summary = summarise(losses, cfg["L"], cfg["eval_multiple"])
        out[f"{theta:g}"] = {"kept_fraction": kept, "validation": summary}
    return out


def run(setting: str, progress: harness.Progress) -> dict:
    """Train each model of :data:`MODELS` at equal parameter counts on L-byte windows, evaluate
    the loss by position on 4L-byte validation windows, compare pairs window by window; returns
    the config, seeds and results of the record.

    Time O(steps x batch x L^2 d) per attention model (O(L) for the S4D ones) and seed, plus the
    evaluation at 4L; memory O(corpus) for the bytes and O(windows x 4L) for the losses.
    """
    cfg = SETTINGS[setting]
    train_data, val_data, corpus = stdlib_corpus(cfg["max_corpus_bytes"])
    L, T_eval = cfg["L"], cfg["L"] * cfg["eval_multiple"]
    eval_starts = np.random.default_rng(2024).integers(
        0, len(val_data) - T_eval - 1, size=cfg["eval_windows"]
    )
    eval_batch = windows(val_data, eval_starts, T_eval + 1)

    # equal parameter counts: every model's MLP width matched to the largest model's count
    base = {name: parameter_count(model_for(name, cfg, cfg["mlp_hidden_base"])) for name in MODELS}
    target = max(base.values())
    hidden = {
        name: matched_mlp_hidden(functools.partial(model_for, name, cfg), target) for name in MODELS
    }
    results: dict = {
        "corpus": corpus,
        "target_parameters": target,
        "models": {},
        "comparisons": {},
    }
    for seed in cfg["seeds"]:
        window_losses = {}
        for name in MODELS:
            data_rng = np.random.default_rng(seed)
            seed_everything(seed)
            model = model_for(name, cfg, hidden[name])

            def batch_loss(
                model: nn.Module, step: int, data_rng: np.random.Generator = data_rng
            ) -> torch.Tensor:
                starts = data_rng.integers(0, len(train_data) - L - 1, size=cfg["batch"])
                x = windows(train_data, starts, L + 1)
                logits = model(x[:, :-1])
                return F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))

            losses = train(
                model,
                batch_loss,
                steps=cfg["steps"],
                lr=cfg["lr"],
                progress=progress,
                label=f"e3 {name} seed {seed}",
            )
            by_position, _ = loss_by_position(model, eval_batch)
            window_losses[name] = by_position
            results["models"].setdefault(name, []).append(
                {
                    "seed": seed,
                    "parameters": parameter_count(model),
                    "mlp_hidden": hidden[name],
                    "loss_curve": [round(x, 4) for x in losses],
                    "final_train_loss": float(np.mean(losses[-max(1, cfg["steps"] // 20) :])),
                    "loss_by_position": np.round(by_position.mean(axis=0), 4).tolist(),
                    "validation": summarise(by_position, L, cfg["eval_multiple"]),
                }
            )
            if name == "fpa":
                results["models"][name][-1]["eviction"] = eviction(model, eval_batch, cfg)
            if name.startswith(("interdomain", "s4d")):
                results["models"][name][-1]["time_constants"] = time_constants(model)
        for a, b in COMPARISONS:
            diff = paired_difference(window_losses[a], window_losses[b], L, cfg["eval_multiple"])
            results["comparisons"].setdefault(f"{a} - {b}", []).append(diff)
    config = {**cfg, "models": list(MODELS), "comparisons": [list(p) for p in COMPARISONS]}
    return {"config": config, "seeds": cfg["seeds"], "results": results}


LABELS = {
    "softmax_rope": "softmax + RoPE",
    "interdomain": "Interdomain (S4D)",
    "interdomain_ratio": "Interdomain, ratio readout",
    "interdomain_noquery": "Interdomain, no query path",
    "s4d_only": "S4D-only",
    "fpa": "FPA",
    "fpa_foxinit": "FPA, FoX-initialised",
    "fox": "FoX",
}
COLOURS = {
    "softmax_rope": "C1",
    "interdomain": "C4",
    "interdomain_ratio": "C6",
    "interdomain_noquery": "C9",
    "s4d_only": "C7",
    "fpa": "C3",
    "fpa_foxinit": "C8",
    "fox": "C0",
}


def plot(record: dict, path: Path) -> None:
    """Validation loss by position (moving average over L/4 bytes) for the Interdomain family
    and for FPA vs FoX, the training length marked; softmax + RoPE in both for reference."""
    plt = harness.pyplot()
    res, cfg = record["results"], record["config"]
    L = cfg["L"]
    width = max(1, L // 4)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1, 1, 0.55]})
    axes[1].sharey(axes[0])
    groups = (
        ("softmax_rope", "interdomain", "interdomain_ratio", "interdomain_noquery", "s4d_only"),
        ("softmax_rope", "fpa", "fpa_foxinit", "fox"),
    )
    titles = ("Interdomain vs its ablations and softmax", "FPA vs FoX")
    for ax, group, title in zip(axes[:2], groups, titles, strict=True):
        for name in group:
            curve = np.mean([r["loss_by_position"] for r in res["models"][name]], axis=0)
            smooth = np.convolve(curve, np.ones(width) / width, mode="valid")
            x = np.arange(len(smooth)) + width
            at = {k: v["mean"] for k, v in res["models"][name][0]["validation"].items()}
            label = f"{LABELS[name]}: {at['1x']:.3f} / {at[str(cfg['eval_multiple']) + 'x']:.3f}"
            ax.plot(x, smooth, color=COLOURS[name], lw=1.5, label=label)
        n = 1
        while n < cfg["eval_multiple"]:
            ax.axvline(n * L, color="k", ls="--" if n == 1 else ":", lw=0.8)
            ax.text(
                n * L,
                0.98,
                " L (training)" if n == 1 else f" {n}L",
                transform=ax.get_xaxis_transform(),
                va="top",
                fontsize=8,
            )
            n *= 2
        ax.set_xlabel("position in the validation window (bytes)")
        ax.set_title(title)
        ax.legend(
            fontsize=8, title=f"mean loss at 1x / {cfg['eval_multiple']}x L", title_fontsize=8
        )
    axes[0].set_ylabel(f"next-byte loss, nats (moving average over {width})")
    ax = axes[2]
    fpa = res["models"]["fpa"][0]
    kept = [1.0] + [e["kept_fraction"] for e in fpa["eviction"].values()]
    labels = ["full"] + [f"theta = {t}" for t in fpa["eviction"]]
    summaries = [fpa["validation"]] + [e["validation"] for e in fpa["eviction"].values()]
    top = f"{cfg['eval_multiple']}x"
    losses = [(v["1x"]["mean"], v[top]["mean"]) for v in summaries]
    ax.plot(kept, [b for _, b in losses], color="0.7", lw=1, zorder=1)
    shades = plt.cm.viridis(np.linspace(0.0, 0.85, len(kept)))
    for x, (a, b), label, shade in zip(kept, losses, labels, shades, strict=True):
        ax.scatter(
            [x], [b], color=shade, s=40, zorder=2, label=f"{label}: {x:.0%} kept, {a:.3f} / {b:.3f}"
        )
    ax.set_xlabel("kept fraction of the KV cache (peak live keys / tokens)")
    ax.set_ylabel(f"mean next-byte loss at {top} L, nats")
    ax.set_title("FPA decoding with eviction at pi >= theta")
    ax.legend(fontsize=8, title=f"loss at 1x / {top} L", title_fontsize=8)
    corpus = res["corpus"]
    fig.suptitle(
        f"E3: byte-level LMs on the Python {corpus['python']} standard library "
        f"({corpus['train_bytes'] / 1e6:.1f} MB), {res['target_parameters']:,} parameters each"
    )
    fig.tight_layout()
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnspec.experiments.e3 [--quick] [--out DIR] [--figures DIR] ...``"""
    return harness.main("e3", "E3: tiny language models, loss by position.", run, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
