"""E4: quality at a KV budget: FPA's learned eviction against the compression methods people use.

Two settings, four models each (FPA with a signed field, FPA FoX-initialised, FoX, softmax +
RoPE), trained here:

- ``passkey``: E2's task (filler with a passkey, repeated after a query marker), trained at L.
- ``lm``: E3's byte-level language model on the standard library's sources, with a passkey
  probe (a marker byte, digits; at the end a second marker and the digits again) inserted into
  half the training windows (their loss adds the answer digits' cross-entropy) and into
  held-out text for the test.

Every model is then decoded with its cache compressed by each method of :mod:`.presses` at
matched budgets (kept fractions of about 100, 75, 50, 25 and 10%): FPA's own eviction at depth
>= theta for the models with a field (FPA and FoX; theta swept, the kept fraction measured),
StreamingLLM's sinks + window, H2O's heavy hitters, kvpress's DMSPress over key norms
(thresholds calibrated to the fraction) and SnapKV (a prompt method: the context is prefilled
with the full cache, then compressed once). Metrics: passkey accuracy at 1x, 2x, 4x, 8x L
(the budget a fraction of each length); per-byte perplexity of held-out text over [0, L),
[L, 2L), [2L, 4L) with the streaming methods (budget a fraction of 4L); the bytes a sequence's
cache holds at its peak.

An ablation (ours, not the paper's) asks what makes FPA's fields descend so that heads let keys
go: training on 2L, the LM setting, a per-head theta calibrated to a fraction, and a small
penalty on keys at depth zero during training (lambda * mean_ij exp(-pi_ij)).

Run: ``python -m attnspec.experiments.e4 [--quick]``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import e2, e3, harness, presses
from .models import TinyModel, parameter_count
from .training import seed_everything, train

MODELS = ("fpa", "fpa_foxinit", "fox", "softmax_rope")
FIELD_MODELS = ("fpa", "fpa_foxinit", "fox")  # a field, hence FPA's depth eviction (F6, F7)
BUDGET_METHODS = ("streaming_llm", "h2o", "knorm_threshold", "snapkv")
STREAMING_METHODS = ("streaming_llm", "h2o", "knorm_threshold")  # defined token by token
KEY_MARKER, QUERY_MARKER = 1, 2  # bytes absent from the standard library's sources
DIGIT_BYTE = ord("0")

SETTINGS: dict[str, dict[str, Any]] = {
    "full": {
        "passkey": {
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
            "test_sequences": 64,
        },
        "lm": {
            "L": 64,
            "multiples": [1, 2, 4, 8],
            "ppl_multiple": 4,
            "n_digits": 3,
            "probe_rate": 0.5,
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "head_dim": 16,
            "mlp_hidden": 128,
            "batch": 16,
            "steps": 600,
            "lr": 3e-3,
            "test_sequences": 64,
            "eval_windows": 64,
            "max_corpus_bytes": None,
        },
        "fractions": [1.0, 0.75, 0.5, 0.25, 0.1],
        "thetas": [16.0, 8.0, 4.0, 2.0, 1.0, 0.5, 0.25],
        "ablation": {"train_multiple": 2, "penalty": 0.05, "per_head_fractions": [0.25, 0.1]},
        "chunk": 16,
        "seeds": [0],
    },
    "quick": {
        "passkey": {
            "L": 16,
            "multiples": [1, 2],
            "n_digits": 1,
            "n_words": 8,
            "digit_filler": 0.2,
            "d_model": 16,
            "n_layers": 2,
            "n_heads": 2,
            "head_dim": 8,
            "mlp_hidden": 16,
            "batch": 8,
            "steps": 4,
            "lr": 3e-3,
            "test_sequences": 8,
        },
        "lm": {
            "L": 16,
            "multiples": [1, 2],
            "ppl_multiple": 2,
            "n_digits": 1,
            "probe_rate": 0.5,
            "d_model": 16,
            "n_layers": 1,
            "n_heads": 2,
            "head_dim": 8,
            "mlp_hidden": 16,
            "batch": 4,
            "steps": 4,
            "lr": 3e-3,
            "test_sequences": 8,
            "eval_windows": 8,
            "max_corpus_bytes": 200_000,
        },
        "fractions": [1.0, 0.5, 0.25],
        "thetas": [2.0, 0.5],
        "ablation": {"train_multiple": 2, "penalty": 0.05, "per_head_fractions": [0.25]},
        "chunk": 8,
        "seeds": [0],
    },
}


# The tasks


def probe(
    rng: np.random.Generator, text: np.ndarray, n_digits: int
) -> tuple[np.ndarray, np.ndarray]:
    """Byte windows text [n, T] (int64) with a passkey probe: KEY d_1..d_k at a uniform random
    position and QUERY d_1..d_k as the last k + 1 bytes (digits as ASCII); (tokens, passkeys
    [n, k] as digit values)."""
    tokens = text.copy()
    n, length = tokens.shape
    k = n_digits
    passkeys = rng.integers(10, size=(n, k))
    start = rng.integers(0, length - 2 * k - 2 + 1, size=n)
    rows = np.arange(n)
    tokens[rows, start] = KEY_MARKER
    for i in range(k):
        tokens[rows, start + 1 + i] = DIGIT_BYTE + passkeys[:, i]
    tokens[:, length - k - 1] = QUERY_MARKER
    tokens[:, length - k :] = DIGIT_BYTE + passkeys
    return tokens, passkeys


def passkey_accuracy(logits: torch.Tensor, passkeys: np.ndarray, offset: int) -> float:
    """Fraction of sequences whose every answer digit is predicted right; digits are the tokens
    ``offset + value`` (0 for the passkey task's digit tokens, ord('0') for bytes)."""
    answer = torch.from_numpy(passkeys) + offset
    return e2.retrieval_accuracy(logits, answer)


def depth_penalty(model: TinyModel, tokens: torch.Tensor) -> torch.Tensor:
    """mean over FPA layers, heads and causal pairs j < i of exp(-pi_ij): the soft share of keys
    at depth zero, which the ablation's penalty lowers (so fields learn to descend)."""
    x = model.embed(tokens)
    out = []
    for block in model.layers():
        h = block.norm1(x)
        inputs = presses.attention_inputs(block.mixer, h)
        assert inputs.depth is not None
        T = tokens.shape[1]
        below = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril(-1)
        out.append(torch.exp(-inputs.depth)[..., below].mean())
        x = block(x)
    return torch.stack(out).mean()


# Evaluation


def methods(model_name: str, cfg: dict, T: int, context: int | None) -> list[tuple[str, float]]:
    """(method, knob) pairs for a model at length T: the full cache, FPA's depth eviction at
    each theta (models with a field), each budget method at each fraction below 1 (SnapKV only
    with a prompt ``context``)."""
    out: list[tuple[str, float]] = [("full", 1.0)]
    if model_name in FIELD_MODELS:
        out += [("depth", theta) for theta in cfg["thetas"]]
    names = BUDGET_METHODS if context is not None else STREAMING_METHODS
    out += [(m, f) for m in names for f in cfg["fractions"] if f < 1.0]
    return out


def make_press(
    method: str, knob: float, *, context: int | None, thresholds: list[float] | None
) -> presses.Press:
    """The press of (method, knob): theta for depth eviction, the kept fraction otherwise."""
    if method == "full":
        return presses.FullCache()
    if method == "depth":
        return presses.DepthEviction(knob)
    if method == "streaming_llm":
        return presses.SinkWindow(knob)
    if method == "h2o":
        return presses.HeavyHitter(knob)
    if method == "knorm_threshold":
        assert thresholds is not None
        return presses.KnormThreshold(thresholds)
    if method == "snapkv":
        assert context is not None
        return presses.SnapKV(knob, context)
    raise ValueError(
        f"method: expected one of {('full', 'depth', *BUDGET_METHODS)}, got {method!r}"
    )


def entry_bytes(model: TinyModel, method: str) -> int:
    """Bytes one cache entry holds per (layer, head): k and v in bfloat16, and for FPA's depth
    eviction the level and the running minimum (F7) in float32."""
    mixer = model.layers()[0].mixer
    dk = int(getattr(mixer, "head_dim"))  # noqa: B009 (every mixer here has one; mypy: Module)
    dv = int(getattr(mixer, "value_dim", dk))
    return 2 * (dk + dv) + (8 if method == "depth" else 0)


def compressed_run(
    model: TinyModel, tokens: np.ndarray, press: presses.Press, chunk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, T, vocab], live [layers, n, H, T]) of the compressed model, in chunks."""
    logits, live = [], []
    with torch.no_grad():
        for i in range(0, len(tokens), chunk):
            run = presses.compressed_forward(model, torch.from_numpy(tokens[i : i + chunk]), press)
            logits.append(run.logits)
            live.append(run.live)
    return torch.cat(logits), torch.cat(live, dim=1)


def cache_summary(model: TinyModel, live: torch.Tensor, press: presses.Press, method: str) -> dict:
    """Kept fraction (rows where the method is in force) and peak fraction (every row), each
    averaged over layers and heads, the per-(layer, head) kept fractions and the bytes a
    sequence's cache holds at its peak."""
    T = live.shape[-1]
    kept = presses.kept_fractions(live, press.first_row(T))
    peak = presses.kept_fractions(live)
    held = live.amax(-1).double().mean(1).sum()  # entries at each head's peak, per sequence
    return {
        "kept_fraction": float(kept.mean()),
        "peak_fraction": float(peak.mean()),
        "kept_by_layer_head": np.round(kept.numpy(), 4).tolist(),
        "bytes": round(float(held) * entry_bytes(model, method)),
    }


def per_head_thetas(model: TinyModel, tokens: np.ndarray, fraction: float) -> list[list[float]]:
    """Per layer and head, the theta at which the last row keeps ``fraction`` of the keys on the
    calibration sequences in a full-cache run: the (1 - fraction) quantile of pi_{T-1, j}
    (a head whose quantile is 0 cannot evict that many; it gets the smallest positive theta
    among its depths, or inf when every depth is 0)."""
    thetas = []
    x = model.embed(torch.from_numpy(tokens))
    with torch.no_grad():
        for block in model.layers():
            inputs = presses.attention_inputs(block.mixer, block.norm1(x))
            assert inputs.depth is not None
            last = inputs.depth[..., -1, :].transpose(0, 1).flatten(1)  # [H, n T]
            row = []
            for depths in last:
                q = float(torch.quantile(depths.double(), 1.0 - fraction))
                positive = depths[depths > 0]
                if q > 0:
                    row.append(q)
                else:
                    row.append(float(positive.min()) if len(positive) else math.inf)
            thetas.append(row)
            x = block(x)
    return thetas


class PerHeadDepth(presses.Press):
    """Depth eviction with its own theta per layer and head (the ablation)."""

    name = "depth_per_head"

    def __init__(self, thetas: list[list[float]]):
        self.thetas = thetas

    def keep(self, inputs: presses.AttentionInputs, layer: int) -> torch.Tensor:
        assert inputs.depth is not None
        T = inputs.q.shape[-2]
        theta = torch.tensor(self.thetas[layer], dtype=inputs.depth.dtype)[:, None, None]
        return presses.causal(T) & (inputs.depth < theta)


def passkey_frontier(
    model: TinyModel,
    model_name: str,
    tests: dict[int, tuple[np.ndarray, np.ndarray]],
    calibration: dict[int, np.ndarray],
    cfg: dict,
    n_digits: int,
    offset: int,
    progress: harness.Progress,
    label: str,
    only: tuple[str, ...] | None = None,
) -> dict:
    """Accuracy and cache summary per (method, knob) at every test length: {"method knob":
    {"accuracy": [per length], "kept_fraction": [...], ...}}; ``only``: those methods."""
    out: dict = {}
    lengths = sorted(tests)
    plan = [
        (m, knob, T)
        for T in lengths
        for m, knob in methods(model_name, cfg, T, context=0)
        if only is None or m in only
    ]
    progress.begin(label, len(plan))
    thresholds: dict[tuple[int, float], list[float]] = {}
    for method, knob, T in plan:
        tokens, passkeys = tests[T]
        context = T - n_digits - 1  # the prompt before the query marker
        if method == "knorm_threshold" and (T, knob) not in thresholds:
            thresholds[T, knob] = presses.calibrate_knorm(
                model, torch.from_numpy(calibration[T]), knob
            )
        press = make_press(method, knob, context=context, thresholds=thresholds.get((T, knob)))
        logits, live = compressed_run(model, tokens, press, cfg["chunk"])
        acc = passkey_accuracy(logits, passkeys, offset)
        summary = cache_summary(model, live, press, method)
        slot = out.setdefault(f"{method} {knob:g}", {"method": method, "knob": knob})
        slot.setdefault("accuracy", []).append(acc)
        for key, value in summary.items():
            slot.setdefault(key, []).append(value)
        progress.advance(f"{method} {knob:g} T {T}: {acc:.2f}")
    progress.end()
    return out


def perplexity_frontier(
    model: TinyModel,
    model_name: str,
    windows: np.ndarray,
    calibration: np.ndarray,
    cfg: dict,
    progress: harness.Progress,
    label: str,
) -> dict:
    """Per (method, knob), streaming over held-out windows of ppl_multiple * L + 1 bytes: the
    per-byte perplexity over [0, L), [L, 2L), [2L, 4L) (bands up to ppl_multiple) and the cache
    summary."""
    L, M = cfg["lm"]["L"], cfg["lm"]["ppl_multiple"]
    T = L * M
    bands = [(0, L)] + [(L * 2**i // 2, L * 2**i) for i in range(1, int(math.log2(M)) + 1)]
    out: dict = {}
    plan = methods(model_name, cfg, T, context=None)
    progress.begin(label, len(plan))
    for method, knob in plan:
        thresholds = None
        if method == "knorm_threshold":
            thresholds = presses.calibrate_knorm(model, torch.from_numpy(calibration[:, :T]), knob)
        press = make_press(method, knob, context=None, thresholds=thresholds)
        logits, live = compressed_run(model, windows[:, :T], press, cfg["chunk"])
        target = torch.from_numpy(windows[:, 1 : T + 1])
        losses = F.cross_entropy(logits.transpose(1, 2), target, reduction="none").numpy()
        entry: dict[str, Any] = {"method": method, "knob": knob}
        entry["perplexity"] = {f"{a}-{b}": float(np.exp(losses[:, a:b].mean())) for a, b in bands}
        entry.update(cache_summary(model, live, press, method))
        out[f"{method} {knob:g}"] = entry
        progress.advance(f"{method} {knob:g}: {entry['perplexity'][f'{bands[-1][0]}-{T}']:.3f}")
    progress.end()
    return out


# Training


def passkey_model(name: str, cfg: dict) -> TinyModel:
    vocab = e2.vocabulary(cfg)
    return TinyModel(
        vocab["size"],
        vocab["size"],
        mixer=name,
        d_model=cfg["d_model"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        head_dim=cfg["head_dim"],
        mlp_hidden=cfg["mlp_hidden"],
    )


def train_passkey(
    name: str,
    cfg: dict,
    seed: int,
    progress: harness.Progress,
    *,
    length: int | None = None,
    penalty: float = 0.0,
    label: str = "",
) -> tuple[TinyModel, list[float]]:
    """An E2 model trained on sequences of ``length`` (default L), with the depth penalty
    ``penalty`` added to the loss (FPA models)."""
    k, length = cfg["n_digits"], length or cfg["L"]
    vocab = e2.vocabulary(cfg)
    data_rng = np.random.default_rng(seed)
    seed_everything(seed)
    model = passkey_model(name, cfg)

    def batch_loss(model: nn.Module, step: int) -> torch.Tensor:
        tokens, passkeys = e2.passkey_sequences(data_rng, cfg["batch"], length, cfg)
        x = torch.from_numpy(tokens)
        logits = e2.answer_logits(model(x), k)
        loss = F.cross_entropy(
            logits.reshape(-1, vocab["size"]), torch.from_numpy(passkeys).reshape(-1)
        )
        if penalty:
            assert isinstance(model, TinyModel)
            loss = loss + penalty * depth_penalty(model, x)
        return loss

    losses = train(
        model, batch_loss, steps=cfg["steps"], lr=cfg["lr"], progress=progress, label=label
    )
    return model, losses


def lm_model(name: str, cfg: dict) -> TinyModel:
    return TinyModel(
        256,
        256,
        mixer=name,
        d_model=cfg["d_model"],
        n_layers=cfg["n_layers"],
        n_heads=cfg["n_heads"],
        head_dim=cfg["head_dim"],
        mlp_hidden=cfg["mlp_hidden"],
    )


def train_lm(
    name: str, cfg: dict, data: np.ndarray, seed: int, progress: harness.Progress, label: str
) -> tuple[TinyModel, list[float]]:
    """A byte model trained on L-byte windows; a share ``probe_rate`` of them carry a probe,
    whose answer digits' cross-entropy is added to the next-byte loss."""
    L, k = cfg["L"], cfg["n_digits"]
    data_rng = np.random.default_rng(seed)
    seed_everything(seed)
    model = lm_model(name, cfg)

    def batch_loss(model: nn.Module, step: int) -> torch.Tensor:
        starts = data_rng.integers(0, len(data) - L - 1, size=cfg["batch"])
        text = e3.windows(data, starts, L).numpy()
        n_probed = round(cfg["probe_rate"] * len(text))
        probed, passkeys = probe(data_rng, text[:n_probed], k)
        x = torch.from_numpy(np.concatenate([probed, text[n_probed:]]))
        logits = model(x[:, :-1])  # position t predicts byte t + 1
        loss = F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
        if n_probed:  # the last k predictions are the answer digits
            answer = logits[:n_probed, -k:]
            target = torch.from_numpy(passkeys + DIGIT_BYTE)
            loss = loss + F.cross_entropy(answer.reshape(-1, 256), target.reshape(-1))
        return loss

    losses = train(
        model, batch_loss, steps=cfg["steps"], lr=cfg["lr"], progress=progress, label=label
    )
    return model, losses


def trained_entry(model: TinyModel, losses: list[float], steps: int, seed: int) -> dict:
    return {
        "seed": seed,
        "parameters": parameter_count(model),
        "loss_curve": [round(x, 4) for x in losses],
        "final_train_loss": float(np.mean(losses[-max(1, steps // 20) :])),
    }


# The run


def at_budget(frontier: dict, method: str, fraction: float, quality: Any) -> dict | None:
    """The entry of ``method`` at about ``fraction`` kept: a budget method's entry at that
    fraction; for depth eviction the theta whose kept fraction is the largest at most
    fraction + 0.025 (None when no theta gets there). ``quality(entry)`` reads the number."""
    if method == "depth":
        fits = [
            e for e in frontier.values() if e["method"] == "depth" and _kept(e) <= fraction + 0.025
        ]
        if not fits:
            return None
        best = max(fits, key=lambda e: (_kept(e), quality(e)))
    else:
        best = frontier.get(f"{method} {fraction:g}")
        if best is None:
            return None
    return {"knob": best["knob"], "kept_fraction": _kept(best), "quality": quality(best)}


def _kept(entry: dict) -> float:
    kept = entry["kept_fraction"]
    return kept[-1] if isinstance(kept, list) else kept


def last_band(cfg: dict) -> str:
    """The name of the perplexity's last band, [ML/2, ML) for M = ppl_multiple ("0-L" if 1)."""
    L, M = cfg["lm"]["L"], cfg["lm"]["ppl_multiple"]
    return f"{L * M // 2 if M > 1 else 0}-{L * M}"


def budget_table(results: dict, cfg: dict) -> dict:
    """Quality at 25% and 10% kept per (setting, model, method): passkey accuracy at the longest
    length (both settings) and the perplexity over the last band (LM)."""
    band = last_band(cfg)

    def accuracy(e: dict) -> float:
        return e["accuracy"][-1]

    def perplexity(e: dict) -> float:
        return e["perplexity"][band]

    table: dict = {}
    for setting in ("passkey", "lm"):
        for name, entry in results[setting]["models"].items():
            for method in ("depth", *BUDGET_METHODS):
                for fraction in (0.25, 0.1):
                    key = f"{setting} {name} {method} {fraction:g}"
                    row = at_budget(entry["passkey"], method, fraction, accuracy)
                    if row is not None:
                        table.setdefault(key, {})["passkey_longest"] = row
                    if setting == "lm":
                        row = at_budget(entry["perplexity"], method, fraction, perplexity)
                        if row is not None:
                            table.setdefault(key, {})["perplexity_last_band"] = row
    return {"last_band": band, "rows": table}


def run(setting: str, progress: harness.Progress) -> dict:
    """Train the models of both settings, trace each (model, method) frontier, run the ablation;
    returns the config, seeds and results of the record.

    Time O(steps x batch x L^2 d) per model, plus O(methods x sequences x (8L)^2 d) for the
    frontiers (H2O steps token by token: O(8L) small steps per layer); memory O(chunk x heads
    x (8L)^2) for the masks.
    """
    cfg = SETTINGS[setting]
    pk, lm = cfg["passkey"], cfg["lm"]
    results: dict = {"passkey": {"models": {}}, "lm": {"models": {}}, "ablation": {}}
    seed = cfg["seeds"][0]

    # the passkey task
    lengths = [m * pk["L"] for m in pk["multiples"]]
    tests = {
        T: e2.passkey_sequences(np.random.default_rng(777 + T), pk["test_sequences"], T, pk)
        for T in lengths
    }
    calibration = {
        T: e2.passkey_sequences(np.random.default_rng(555 + T), pk["test_sequences"], T, pk)[0]
        for T in lengths
    }
    passkey_models: dict[str, TinyModel] = {}
    for name in MODELS:
        model, losses = train_passkey(name, pk, seed, progress, label=f"e4 passkey {name}")
        passkey_models[name] = model
        entry = trained_entry(model, losses, pk["steps"], seed)
        entry["passkey"] = passkey_frontier(
            model, name, tests, calibration, cfg, pk["n_digits"], 0, progress,
            f"e4 passkey {name} frontier",
        )  # fmt: skip
        results["passkey"]["models"][name] = entry

    # the language model with a probe
    train_data, val_data, corpus = e3.stdlib_corpus(lm["max_corpus_bytes"])
    results["lm"]["corpus"] = corpus
    lm_lengths = [m * lm["L"] for m in lm["multiples"]]
    T_ppl = lm["L"] * lm["ppl_multiple"]

    def held_out(seed_: int, n: int, length: int, data: np.ndarray) -> np.ndarray:
        starts = np.random.default_rng(seed_).integers(0, len(data) - length - 1, size=n)
        return e3.windows(data, starts, length).numpy()

    lm_tests = {
        T: probe(
            np.random.default_rng(900 + T),
            held_out(2024 + T, lm["test_sequences"], T, val_data),
            lm["n_digits"],
        )
        for T in lm_lengths
    }
    lm_calibration = {
        T: probe(
            np.random.default_rng(300 + T),
            held_out(3030 + T, lm["test_sequences"], T, train_data),
            lm["n_digits"],
        )[0]
        for T in lm_lengths
    }
    ppl_windows = held_out(2024, lm["eval_windows"], T_ppl + 1, val_data)
    ppl_calibration = held_out(4040, lm["eval_windows"], T_ppl, train_data)
    lm_models: dict[str, TinyModel] = {}
    for name in MODELS:
        model, losses = train_lm(name, lm, train_data, seed, progress, f"e4 lm {name}")
        lm_models[name] = model
        entry = trained_entry(model, losses, lm["steps"], seed)
        entry["passkey"] = passkey_frontier(
            model, name, lm_tests, lm_calibration, cfg, lm["n_digits"], DIGIT_BYTE, progress,
            f"e4 lm {name} probe frontier",
        )  # fmt: skip
        entry["perplexity"] = perplexity_frontier(
            model, name, ppl_windows, ppl_calibration, cfg, progress, f"e4 lm {name} perplexity"
        )
        results["lm"]["models"][name] = entry

    # the ablation: what makes FPA's fields descend (the signed-field FPA on the passkey task)
    ab = cfg["ablation"]
    longest = max(lengths)
    last = {T: v for T, v in tests.items() if T == longest}
    variants: dict[str, dict] = {}

    def depth_rows(frontier: dict) -> dict:
        return {
            key: {
                "theta": e["knob"],
                "accuracy": e["accuracy"][-1],
                "kept_fraction": e["kept_fraction"][-1],
            }
            for key, e in frontier.items()
            if e["method"] in ("full", "depth", "depth_per_head")
        }

    variants["E2 as trained (length L)"] = depth_rows(
        results["passkey"]["models"]["fpa"]["passkey"]
    )
    longer, losses = train_passkey(
        "fpa", pk, seed, progress, length=ab["train_multiple"] * pk["L"],
        label=f"e4 ablation fpa trained at {ab['train_multiple']}L",
    )  # fmt: skip
    frontier = passkey_frontier(
        longer, "fpa", last, calibration, cfg, pk["n_digits"], 0, progress, "e4 ablation longer",
        only=("full", "depth"),
    )  # fmt: skip
    variants[f"trained at {ab['train_multiple']}L"] = depth_rows(frontier)
    variants["LM setting (probe)"] = depth_rows(results["lm"]["models"]["fpa"]["passkey"])
    penalised, losses = train_passkey(
        "fpa", pk, seed, progress, penalty=ab["penalty"],
        label=f"e4 ablation fpa with depth penalty {ab['penalty']:g}",
    )  # fmt: skip
    frontier = passkey_frontier(
        penalised, "fpa", last, calibration, cfg, pk["n_digits"], 0, progress,
        "e4 ablation penalty", only=("full", "depth"),
    )  # fmt: skip
    variants[f"depth penalty {ab['penalty']:g}"] = depth_rows(frontier)
    per_head: dict = {}
    base = passkey_models["fpa"]
    tokens, passkeys = last[longest]
    for fraction in ab["per_head_fractions"]:
        thetas = per_head_thetas(base, calibration[longest], fraction)
        press = PerHeadDepth(thetas)
        logits, live = compressed_run(base, tokens, press, cfg["chunk"])
        summary = cache_summary(base, live, press, "depth")
        per_head[f"target {fraction:g}"] = {
            "theta": "per head",
            "thetas": [[round(t, 4) for t in row] for row in thetas],
            "accuracy": passkey_accuracy(logits, passkeys, 0),
            "kept_fraction": summary["kept_fraction"],
            "kept_by_layer_head": summary["kept_by_layer_head"],
        }
    variants["per-head theta (E2 model)"] = per_head
    results["ablation"] = {
        "variants": variants,
        "penalty_final_train_loss": float(np.mean(losses[-max(1, pk["steps"] // 20) :])),
        "test_length": longest,
    }
    results["budget_table"] = budget_table(results, cfg)
    config = {**cfg, "models": list(MODELS), "methods": ["depth", *BUDGET_METHODS]}
    return {"config": config, "seeds": cfg["seeds"], "results": results}


# The figure

LABELS = {
    "fpa": "FPA",
    "fpa_foxinit": "FPA, FoX-init",
    "fox": "FoX",
    "softmax_rope": "softmax + RoPE",
}
METHOD_COLOURS = {
    "depth": "C3",
    "streaming_llm": "C0",
    "h2o": "C2",
    "knorm_threshold": "C4",
    "snapkv": "C1",
}
METHOD_STYLES = {
    "depth": {"ls": "-", "marker": "o", "lw": 2.5},
    "streaming_llm": {"ls": "--", "marker": "s", "lw": 1.2},
    "h2o": {"ls": ":", "marker": "^", "lw": 1.5},
    "knorm_threshold": {"ls": "-.", "marker": "v", "lw": 1.2},
    "snapkv": {"ls": (0, (1, 1, 4, 1)), "marker": "D", "lw": 1.2},
}
METHOD_LABELS = {
    "depth": "FPA eviction (theta swept)",
    "streaming_llm": "StreamingLLM",
    "h2o": "H2O",
    "knorm_threshold": "threshold (K-norm)",
    "snapkv": "SnapKV",
}


def _frontier_points(frontier: dict, method: str, read: Any) -> tuple[list, list]:
    rows = [e for e in frontier.values() if e["method"] in (method, "full")]
    points = sorted((_kept(e), read(e)) for e in rows)
    return [p[0] for p in points], [p[1] for p in points]


def plot(record: dict, path: Path) -> None:
    """Quality against kept fraction: a row per measure (passkey accuracy at the longest length
    in both settings, perplexity of the LM's last band), a column per model, a line per method;
    in the last column the ablation's kept fractions and accuracies."""
    plt = harness.pyplot()
    res, cfg = record["results"], record["config"]
    last_band = res["budget_table"]["last_band"]
    rows = [
        ("passkey", "passkey", lambda e: e["accuracy"][-1],
         f"passkey task: retrieved at {cfg['passkey']['multiples'][-1]}x L"),
        ("lm", "passkey", lambda e: e["accuracy"][-1],
         f"byte LM: probe retrieved at {cfg['lm']['multiples'][-1]}x L"),
        ("lm", "perplexity", lambda e: e["perplexity"][last_band],
         f"byte LM: per-byte perplexity, bytes {last_band}"),
    ]  # fmt: skip
    names = list(res["passkey"]["models"])
    fig, axes = plt.subplots(
        len(rows), len(names) + 1, figsize=(4.2 * (len(names) + 1), 3.4 * len(rows))
    )
    for r, (setting, kind, read, ylabel) in enumerate(rows):
        for c, name in enumerate(names):
            ax = axes[r, c]
            frontier = res[setting]["models"][name][kind]
            for method in ("depth", *BUDGET_METHODS):
                if not any(e["method"] == method for e in frontier.values()):
                    continue
                x, y = _frontier_points(frontier, method, read)
                ax.plot(x, y, color=METHOD_COLOURS[method], ms=4, label=METHOD_LABELS[method],
                        **METHOD_STYLES[method])  # fmt: skip
            ax.axvline(0.25, color="0.6", lw=0.8)
            ax.axvline(0.10, color="0.8", lw=0.8)
            ax.set_xlim(0, 1.05)
            ax.grid(alpha=0.3)
            if r == 0:
                ax.set_title(LABELS[name])
            if r == len(rows) - 1:
                ax.set_xlabel("kept fraction (peak live keys / tokens)")
            if c == 0:
                ax.set_ylabel(ylabel, fontsize=9)
            if kind == "passkey":
                ax.set_ylim(-0.03, 1.03)
        axes[r, 0].legend(fontsize=7, loc="best")

    ax = axes[0, -1]
    variants = res["ablation"]["variants"]
    for i, (label, entries) in enumerate(variants.items()):
        points = sorted((e["kept_fraction"], e["accuracy"]) for e in entries.values())
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=f"C{i}",
                label=label)  # fmt: skip
    ax.set_xlabel("kept fraction")
    ax.set_ylabel(f"passkey retrieved at {res['ablation']['test_length']} tokens", fontsize=9)
    ax.set_xlim(0, 1.05)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.set_title("Ablation (ours): FPA variants")
    ax.legend(fontsize=7, loc="best")
    for ax in axes[1:, -1]:
        ax.axis("off")
    fig.suptitle("E4: quality against the kept fraction of the KV cache, at matched budgets")
    fig.tight_layout()
    harness.save(fig, path)


def main(argv: list[str] | None = None) -> int:
    """``python -m attnspec.experiments.e4 [--quick] [--out DIR] [--figures DIR] ...``"""
    return harness.main("e4", "E4: quality at a KV budget.", run, plot, argv)


if __name__ == "__main__":
    sys.exit(main())
