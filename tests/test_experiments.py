"""The experiments: their tasks and model pieces against independent computations, and each
experiment's --quick run writing a well-formed record and figure (the schema, not the scores)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnspec.experiments import e1, e2, e3, e4, harness
from attnspec.experiments.layers import (
    ForgettingAttention,
    QueryFreeInterdomain,
    fox_initialised_fpa,
)
from attnspec.experiments.models import (
    SoftmaxAttention,
    TinyModel,
    matched_mlp_hidden,
    parameter_count,
)
from attnspec.reference import fpa as ref_fpa
from attnspec.reference import interdomain as ref_idm


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


# Tasks


def test_scope_sets_are_the_stack_theorem_live_sets():
    """(T1): the literal scope stack of E1 equals FPA's live set with field = level = depth."""
    tokens = e1.bracket_sequences(np.random.default_rng(3), 64, 40, 5, 0.25, 0.2, 6)
    visible = e1.scope_sets(tokens)
    depth = e1.bracket_depth(tokens)
    assert (depth >= 0).all() and (depth <= 6).all()
    np.testing.assert_array_equal(visible, ref_fpa.stack_live_keys(depth))
    np.testing.assert_array_equal(visible, ref_fpa.live_keys(depth, depth))


def test_scope_sets_by_hand():
    s = [2, 3, 4]  # three symbols
    tokens = np.array([[s[0], e1.OPEN, s[1], e1.CLOSE, s[2]]])
    visible = e1.scope_sets(tokens)[0]
    # after ")" the inner block (its "(" and s1) is forgotten; s0 and ")" stay
    assert visible[4].tolist() == [True, False, False, True, True]
    assert visible[2].tolist() == [True, True, True, False, False]
    targets = e1.visible_symbols(tokens, e1.scope_sets(tokens), 3)[0]
    assert targets.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 0, 1]]


def test_passkey_sequences_layout():
    cfg = {**e2.SETTINGS["quick"], "n_digits": 3}
    vocab = e2.vocabulary(cfg)
    tokens, passkeys = e2.passkey_sequences(np.random.default_rng(0), 200, 30, cfg)
    for row, key in zip(tokens, passkeys, strict=True):
        (start,) = np.flatnonzero(row == vocab["key"])
        assert row[start + 1 : start + 4].tolist() == key.tolist()
        assert row[-4] == vocab["query"] and (row == vocab["query"]).sum() == 1
        assert row[-3:].tolist() == key.tolist()
    logits = torch.nn.functional.one_hot(torch.from_numpy(tokens), vocab["size"]).float()
    shifted = torch.roll(logits, -1, dims=1)  # "predict the next token" is right on the digits
    assert e2.retrieval_accuracy(shifted, torch.from_numpy(passkeys)) == 1.0
    assert e2.retrieval_accuracy(logits, torch.from_numpy(passkeys)) < 0.05


def test_loss_summary_bands():
    losses = np.tile(np.repeat([1.0, 2.0, 3.0, 3.0], 8), (5, 1))  # L = 8, windows of 4L
    summary = e3.summarise(losses, 8, 4)
    assert summary["1x"]["mean"] == 1.0 and summary["2x"]["mean"] == 1.5
    assert summary["band_1x_2x"]["mean"] == 2.0 and summary["band_2x_4x"]["mean"] == 3.0
    assert summary["4x"]["mean"] == 2.25 and summary["4x"]["stderr"] == 0.0


# Model pieces


def _softmax_rows(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("position", ["alibi", "rope"])
def test_softmax_baselines_against_a_literal_computation(position):
    torch.manual_seed(0)
    B, T, d, H, dk = 2, 9, 12, 2, 4
    layer = SoftmaxAttention(d, H, dk, position).double()
    x = torch.randn(B, T, d, dtype=torch.float64)
    X = _np(x)
    q, k, v = (
        np.swapaxes((X @ _np(w)).reshape(B, T, H, dk), 1, 2) for w in (layer.wq, layer.wk, layer.wv)
    )
    if position == "rope":
        q, k = ref_idm.rope(q), ref_idm.rope(k)
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(dk)  # (B, H, T, T)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    if position == "alibi":
        slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
        logits = logits - slopes[:, None, None] * (i - j)
    logits = np.where(j <= i, logits, -np.inf)
    o = np.swapaxes(_softmax_rows(logits) @ v, 1, 2).reshape(B, T, H * dk) @ _np(layer.wo)
    np.testing.assert_allclose(_np(layer(x)), o, rtol=1e-10, atol=1e-12)


def test_forgetting_attention_is_the_reference_fox_layer():
    """The FoX layer equals the reference FPA layer with logsigmoid increments and lam = 0 (F6)."""
    torch.manual_seed(1)
    B, T, d, H, dk = 2, 11, 8, 2, 4
    layer = ForgettingAttention(d, H, dk).double()
    with torch.no_grad():
        layer.b_f.copy_(torch.tensor([2.0, -1.0], dtype=torch.float64))
    x = torch.randn(B, T, d, dtype=torch.float64)
    params = {
        "wq": _np(layer.wq),
        "wk": _np(layer.wk),
        "wv": _np(layer.wv),
        "wo": _np(layer.wo),
        "w_delta": _np(layer.w_f),
        "b_delta": _np(layer.b_f),
        "w_lam": np.zeros((d, H)),
        "b_lam": np.zeros(H),
    }
    expected = ref_fpa.fpa_layer(_np(x), params, increments="logsigmoid")
    np.testing.assert_allclose(_np(layer(x)), expected, rtol=1e-9, atol=1e-10)


def test_fox_initialised_fpa_starts_as_fox():
    """At initialisation the layer is FoX: its output equals the reference's direct FoX form
    (logit s<q, k> + sum of log f) on the layer's own projections and gates."""
    torch.manual_seed(4)
    B, T, d, H, dk = 2, 13, 8, 2, 4
    layer = fox_initialised_fpa(d, H, dk).double()
    with torch.no_grad():
        layer.b_delta.copy_(torch.tensor([1.5, -0.5], dtype=torch.float64))
    x = torch.randn(B, T, d, dtype=torch.float64)
    X = _np(x)
    q, k, v = (
        np.swapaxes((X @ _np(w)).reshape(B, T, H, dk), 1, 2) for w in (layer.wq, layer.wk, layer.wv)
    )
    gate = X @ _np(layer.w_delta) + _np(layer.b_delta)  # (B, T, H)
    log_f = np.swapaxes(-np.logaddexp(0.0, -gate), 1, 2)  # logsigmoid, (B, H, T)
    o = ref_fpa.fox_attention_direct(q, k, v, log_f)
    expected = np.swapaxes(o, 1, 2).reshape(B, T, H * dk) @ _np(layer.wo)
    np.testing.assert_allclose(_np(layer(x)), expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("keys", [True, False])
def test_query_free_interdomain_against_the_reference(keys):
    """The ablated layers through the reference's pieces: (I8)-(I14) with xi(q_t) (and, for
    S4D-only, k~_t) built from one learned vector per head."""
    torch.manual_seed(2)
    B, T, d, H, R, M = 2, 10, 8, 2, 4, 3
    layer = QueryFreeInterdomain(d, H, R, M, keys=keys).double()
    assert not hasattr(layer, "wq") and hasattr(layer, "wk") == keys
    x = torch.randn(B, T, d, dtype=torch.float64)
    X = _np(x)
    P = {name: _np(p) for name, p in layer.named_parameters()}

    def heads(y):  # (B, T, H*D) -> (B, H, T, D)
        return np.swapaxes(y.reshape(B, T, H, -1), 1, 2)

    q = np.broadcast_to(P["query"], (B, T, H * R))
    k = ref_idm.short_conv(X @ P["wk"], P["conv_k"]) if keys else np.broadcast_to(P["key"], q.shape)
    fq, fk = ref_idm.feature_map(heads(q)), ref_idm.feature_map(heads(k))
    kt = ref_idm.rms_norm(fk, np.ones(R)) * P["norm_k_g"][:, None] + P["norm_k_b"][:, None]
    vt = ref_idm.rms_norm(heads(X @ P["wv"]), np.ones(R)) * P["norm_v_g"][:, None]
    vt = vt + P["norm_v_b"][:, None]
    lam = ref_idm.s4d_lambda(P["log_dt"], P["a_log"], P["a_im"])
    b_bar = ref_idm.s4d_b_bar(P["log_dt"], P["a_log"], P["a_im"], P["b_re"] + 1j * P["b_im"])
    o = ref_idm.interdomain_s4d(fq, kt, vt, lam, b_bar, P["c_re"] + 1j * P["c_im"])  # (I11)
    o = ref_idm.rms_norm(o, np.ones(R)) * P["norm_o_g"][:, None]  # (I14)
    expected = np.swapaxes(o, 1, 2).reshape(B, T, H * R) @ P["wo"]
    np.testing.assert_allclose(_np(layer(x)), expected, rtol=1e-7, atol=1e-9)


def test_fpa_model_with_unbounded_caches_equals_its_forward():
    """(F7) with theta = inf: decoding through the caches is the parallel model."""
    torch.manual_seed(3)
    model = TinyModel(
        12, 12, mixer="fpa", d_model=16, n_layers=2, n_heads=2, head_dim=8, mlp_hidden=16
    ).double()
    x = torch.randint(0, 12, (3, 20))
    with torch.no_grad():
        plain = model(x)
        caches = model.new_caches(float("inf"))
        cached = model(x, caches)
    torch.testing.assert_close(cached, plain, rtol=1e-10, atol=1e-10)
    assert [c.attention.kept_fraction for c in caches] == [1.0, 1.0]
    with torch.no_grad():
        evicting = model.new_caches(1e-6)  # keys at any positive depth go
        model(x, evicting)
    assert all(c.attention.kept_fraction < 1.0 for c in evicting)


def test_the_decode_benchmarks_weights_are_e4s_passkey_model():
    """bench/e4_passkey_fpa_foxinit.safetensors against E4's record: its final training loss,
    and at 8x L with eviction at theta 16 its retrieval and kept fractions per layer and head."""
    safetensors = pytest.importorskip("safetensors.torch")
    root = Path(__file__).resolve().parents[1]
    path = root / "bench" / "e4_passkey_fpa_foxinit.safetensors"
    record = json.loads((root / "experiments" / "results" / "e4.json").read_text())
    entry = record["results"]["passkey"]["models"]["fpa_foxinit"]
    with safetensors.safe_open(str(path), "pt") as f:
        assert float(f.metadata()["final_train_loss"]) == entry["final_train_loss"]
    cfg = record["config"]["passkey"]
    model = e4.passkey_model("fpa_foxinit", cfg)
    model.load_state_dict(safetensors.load_file(str(path)))
    T = 8 * cfg["L"]
    tokens, passkeys = e2.passkey_sequences(
        np.random.default_rng(777 + T), cfg["test_sequences"], T, cfg
    )
    press = e4.make_press("depth", 16.0, context=None, thresholds=None)
    logits, live = e4.compressed_run(model.eval(), tokens, press, 16)
    want = entry["passkey"]["depth 16"]
    assert e4.passkey_accuracy(logits, passkeys, 0) == want["accuracy"][-1]
    summary = e4.cache_summary(model, live, press, "depth")
    assert summary["kept_by_layer_head"] == want["kept_by_layer_head"][-1]


def test_mlp_width_matches_parameter_counts():
    cfg = e3.SETTINGS["quick"]
    target = parameter_count(e3.model_for("interdomain", cfg, 40))
    for name in e3.MODELS:
        h = matched_mlp_hidden(lambda h, name=name: e3.model_for(name, cfg, h), target)
        unit = 2 * cfg["d_model"] * cfg["n_layers"]  # parameters per hidden unit
        assert abs(parameter_count(e3.model_for(name, cfg, h)) - target) <= unit / 2


def test_bad_mixer_name_is_a_value_error():
    with pytest.raises(ValueError, match="mixer: expected one of"):
        TinyModel(4, 4, mixer="mamba", d_model=8, n_layers=1, n_heads=1, head_dim=4)
    model = TinyModel(4, 4, mixer="fox", d_model=8, n_layers=1, n_heads=1, head_dim=4)
    with pytest.raises(ValueError, match="decode caches need 'fpa'"):
        model.new_caches(1.0)


def test_progress_off_a_terminal_prints_each_tenth_once():
    stream = io.StringIO()
    progress = harness.Progress(stream)
    progress.begin("job", 50)
    for _ in range(50):
        progress.advance("x")
    progress.end()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("job") and "50/50" in lines[-1]


# The --quick runs: one record and one figure each


def _check_record(record: dict, name: str) -> None:
    assert list(record) == list(harness.RECORD_KEYS)
    assert record["experiment"] == name and record["setting"] == "quick"
    assert record["seeds"] == record["config"]["seeds"]
    assert {"python", "torch", "numpy", "attnspec"} <= set(record["versions"])
    assert record["seconds"] > 0 and len(record["load_average"]) == 2
    assert record["figure"] == f"{name}.png"


def _probability(x) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def _check_e1(record: dict) -> None:
    cfg, res = record["config"], record["results"]
    assert set(res["models"]) == set(e1.MODELS)
    for name, entry in res["models"].items():
        assert _probability(entry["success_rate"])
        assert [r["seed"] for r in entry["runs"]] == cfg["seeds"]
        for r in entry["runs"]:
            assert len(r["loss_curve"]) == cfg["steps"]
            assert _probability(r["test_accuracy"]) and isinstance(r["success"], bool)
            assert ("live_set" in r) == (name == "fpa")
    live = res["models"]["fpa"]["runs"][0]["live_set"]
    assert len(live["delta"]["symbols"]) == cfg["n_symbols"]
    assert _probability(live["live_equals_scope"]) and _probability(live["separable_rows"])
    example = res["example"]
    n = len(example["tokens"])
    assert np.shape(example["scope"]) == np.shape(example["fpa_weights"]) == (n, n)
    np.testing.assert_allclose(np.sum(example["fpa_weights"], axis=1), 1.0, atol=1e-3)


def _check_e2(record: dict) -> None:
    cfg, res = record["config"], record["results"]
    assert res["lengths"] == [m * cfg["L"] for m in cfg["multiples"]]
    assert set(res["models"]) == set(e2.MODELS)
    for name, runs in res["models"].items():
        (run,) = runs
        assert len(run["loss_curve"]) == cfg["steps"]
        assert len(run["accuracy"]) == len(cfg["multiples"])
        assert all(_probability(a) for a in run["accuracy"])
        assert ("eviction" in run) == (name == "fpa")
    eviction = res["models"]["fpa"][0]["eviction"]
    assert list(eviction) == [f"{t:g}" for t in cfg["thetas"]]
    for entry in eviction.values():
        assert all(0.0 < f <= 1.0 for f in entry["kept_fraction"])
        assert len(entry["accuracy"]) == len(cfg["multiples"])


def _check_e3(record: dict) -> None:
    cfg, res = record["config"], record["results"]
    assert set(res["models"]) == set(e3.MODELS)
    assert res["corpus"]["train_bytes"] > 0 and res["corpus"]["validation_bytes"] > 0
    unit = 2 * cfg["d_model"] * cfg["n_layers"]
    for runs in res["models"].values():
        (run,) = runs
        assert abs(run["parameters"] - res["target_parameters"]) <= unit
        assert len(run["loss_by_position"]) == cfg["L"] * cfg["eval_multiple"]
        assert set(run["validation"]) == {"1x", "2x", "band_1x_2x", "4x", "band_2x_4x"}
        assert all(v["mean"] > 0 for v in run["validation"].values())
    for name in ("interdomain", "interdomain_ratio", "interdomain_noquery", "s4d_only"):
        tau = np.array(res["models"][name][0]["time_constants"])
        assert (
            tau.shape == (cfg["n_layers"], cfg["n_heads"], 2) and (tau[..., 0] <= tau[..., 1]).all()
        )
    (fpa,) = res["models"]["fpa"]
    assert list(fpa["eviction"]) == [f"{t:g}" for t in cfg["thetas"]]
    for entry in fpa["eviction"].values():
        assert 0.0 < entry["kept_fraction"] <= 1.0 and entry["validation"]["4x"]["mean"] > 0
    assert list(res["comparisons"]) == [f"{a} - {b}" for a, b in e3.COMPARISONS]
    for (a, b), (diff,) in zip(e3.COMPARISONS, res["comparisons"].values(), strict=True):
        assert set(diff) == {"1x", "2x", "4x"}
        expected = res["models"][a][0]["validation"]["1x"]["mean"]
        expected -= res["models"][b][0]["validation"]["1x"]["mean"]
        assert diff["1x"]["mean"] == pytest.approx(expected, abs=1e-5)


def _check_e4(record: dict) -> None:
    cfg, res = record["config"], record["results"]
    n_lengths = len(cfg["passkey"]["multiples"])
    for setting in ("passkey", "lm"):
        assert set(res[setting]["models"]) == set(e4.MODELS)
        for name, entry in res[setting]["models"].items():
            frontier = entry["passkey"]
            methods = {e["method"] for e in frontier.values()}
            assert methods == {"full", *e4.BUDGET_METHODS} | (
                {"depth"} if name in e4.FIELD_MODELS else set()
            )
            for e in frontier.values():
                assert len(e["accuracy"]) == len(e["kept_fraction"]) == n_lengths
                assert all(_probability(a) for a in e["accuracy"] + e["kept_fraction"])
            assert frontier["full 1"]["kept_fraction"] == [1.0] * n_lengths
            for f in cfg["fractions"][1:]:  # a sink window keeps its budget exactly
                T = cfg["passkey"]["L"] * cfg["passkey"]["multiples"][-1]
                kept = frontier[f"streaming_llm {f:g}"]["kept_fraction"][-1]
                assert kept == pytest.approx(max(5, round(f * T)) / T)
    for entry in res["lm"]["models"].values():
        bands = entry["perplexity"]["full 1"]["perplexity"]
        assert list(bands)[-1] == res["budget_table"]["last_band"]
        assert "snapkv 0.5" not in entry["perplexity"]  # a prompt method, not streaming
    assert len(res["ablation"]["variants"]) == 5
    assert any(k.endswith(" 0.25") for k in res["budget_table"]["rows"])


@pytest.mark.parametrize(
    ("name", "module", "check"),
    [("e1", e1, _check_e1), ("e2", e2, _check_e2), ("e3", e3, _check_e3), ("e4", e4, _check_e4)],
)
def test_quick_run_writes_record_and_figure(tmp_path, name, module, check):
    threads = torch.get_num_threads()
    try:  # one thread, as the command's default: at these sizes more threads only contend
        assert module.main(["--quick", "--out", str(tmp_path), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((tmp_path / f"{name}.json").read_text())
    _check_record(record, name)
    check(record)
    assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_record_json_round_trips_with_number_lists_on_one_line():
    record = {"a": [1, 2.5, -3e-05, 1e300], "b": [[1, 2], [3, 4]], "c": ["x", 1], "d": []}
    text = harness.record_json(record)
    assert json.loads(text) == record
    assert '"a": [1, 2.5, -3e-05, 1e+300]' in text and '"d": []' in text
