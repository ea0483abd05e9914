"""E4's cache compression (experiments/presses.py) against independent computations: the
models' own forward and decode caches, the reference's descent depth, literal loops of each
method's rule, and the paged decode session's stored counts."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnspec.experiments import presses
from attnspec.experiments.models import TinyModel
from attnspec.reference import fpa as ref_fpa

MIXERS = ("fpa", "fpa_foxinit", "fox", "softmax_rope")


def _model(mixer: str, seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    model = TinyModel(
        14, 14, mixer=mixer, d_model=16, n_layers=2, n_heads=2, head_dim=8, mlp_hidden=16
    ).double()
    if mixer.startswith("fpa"):  # fields that descend: depths of a few nats
        with torch.no_grad():
            for block in model.layers():
                block.mixer.b_delta.fill_(-0.3)
    return model.eval()


def _tokens(B: int = 3, T: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 14, (B, T), generator=torch.Generator().manual_seed(seed))


def test_descent_depth_is_the_references():
    rng = np.random.default_rng(0)
    field = rng.normal(size=(2, 3, 17)).cumsum(-1)
    level = field + rng.normal(size=field.shape)
    ours = presses.descent_depth(torch.from_numpy(field), torch.from_numpy(level))
    np.testing.assert_allclose(ours.numpy(), ref_fpa.descent_depth(field, level), atol=1e-12)


@pytest.mark.parametrize("mixer", MIXERS)
def test_full_cache_is_the_models_forward(mixer):
    model, x = _model(mixer), _tokens()
    with torch.no_grad():
        run = presses.compressed_forward(model, x, presses.FullCache())
        torch.testing.assert_close(run.logits, model(x), rtol=1e-9, atol=1e-9)
    assert (run.live == torch.arange(1, 25)).all()


@pytest.mark.parametrize("mixer", ["fpa", "fpa_foxinit"])
@pytest.mark.parametrize("theta", [math.inf, 2.0, 0.5])
def test_depth_eviction_is_the_decode_cache(mixer, theta):
    """The mask pi_ij < theta against the (F7) caches the models decode with."""
    model, x = _model(mixer), _tokens()
    with torch.no_grad():
        run = presses.compressed_forward(model, x, presses.DepthEviction(theta))
        caches = model.new_caches(theta)
        torch.testing.assert_close(run.logits, model(x, caches), rtol=1e-9, atol=1e-9)
    peak = torch.stack([c.attention.peak.reshape(3, 2) for c in caches])  # [layers, B, H]
    assert torch.equal(run.live.amax(-1), peak)
    kept = presses.kept_fractions(run.live)
    expected = [c.attention.kept_fraction for c in caches]
    np.testing.assert_allclose(kept.mean(1).numpy(), expected, rtol=1e-12)
    if theta < math.inf:
        assert kept.mean() < 1.0


def test_depth_eviction_counts_are_the_paged_sessions():
    """Live keys per row against a paged session's stored entries (one kv head per head, no
    rollback: an evicted entry is freed at once), decoding one layer token by token."""
    model, x = _model("fpa"), _tokens(B=2, T=20)
    layer = model.layers()[0]
    h = layer.norm1(model.embed(x)).detach()
    inputs = presses.attention_inputs(layer.mixer, h)
    keep = presses.DepthEviction(1.5).keep(inputs, 0)
    session = layer.mixer.open_session(2, theta=1.5, page_size=4)
    stored = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            session.advance({"x": h[:, t : t + 1]}, torch.ones(2, 1, dtype=torch.bool))
            stored.append(session.counts()["stored"].clone())
    assert torch.equal(torch.stack(stored, -1), keep.sum(-1).reshape(*stored[0].shape, -1))


def _inputs(B=2, H=2, T=21, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.zeros(B, H, T, T, dtype=torch.float64)
    return presses.AttentionInputs(q, k, v, bias, None, torch.eye(H * 4, dtype=torch.float64))


def test_sink_window_by_a_loop():
    inputs = _inputs()
    keep = presses.SinkWindow(0.5, sinks=2).keep(inputs, 0)
    C = round(0.5 * 21)
    for i in range(21):
        live = [j for j in range(i + 1) if j < 2 or i - j < C - 2]
        assert keep[0, 0, i].nonzero().flatten().tolist() == live
        assert len(live) <= C


def test_heavy_hitter_by_a_loop():
    """H2O as its paper states it, one token at a time with Python lists."""
    inputs = _inputs()
    keep = presses.HeavyHitter(0.4).keep(inputs, 0)
    scores = (inputs.q @ inputs.k.transpose(-1, -2))[0, 1].numpy()
    C = round(0.4 * 21)
    live: list[int] = []
    received = np.zeros(21)
    for i in range(21):
        live.append(i)
        if len(live) > C:
            old = [j for j in live if j < i + 1 - C // 2]
            live.remove(min(old, key=lambda j: (received[j], j)))
        assert sorted(keep[0, 1, i].nonzero().flatten().tolist()) == sorted(live)
        w = np.exp(scores[i, live] - scores[i, live].max())
        received[live] += w / w.sum()


def test_knorm_threshold_by_a_loop():
    inputs = _inputs()
    keep = presses.KnormThreshold([-1.5], window=3).keep(inputs, 0)
    norms = inputs.k[1, 0].norm(dim=-1).numpy()
    for i in range(21):
        live = [j for j in range(i + 1) if i - j < 3 or -norms[j] >= -1.5]
        assert keep[1, 0, i].nonzero().flatten().tolist() == live


def test_the_knorm_press_is_cited_by_kvpress_current_name():
    """kvpress 0.5 calls its threshold press over a scorer DMSPress (kvpress/presses/dms_press.py);
    the experiments and the docs cite that name, not an older one."""
    root = Path(__file__).resolve().parents[1]
    assert "kvpress's DMSPress(KnormPress)" in presses.KnormThreshold.__doc__
    files = [*root.joinpath("experiments").glob("*.py"), *root.joinpath("docs").glob("*.md")]
    cited = [f.name for f in files if re.search(r"ThresholdPress|threshold press", f.read_text())]
    assert not cited, cited


def test_snapkv_by_a_loop():
    inputs = _inputs(T=30)
    press = presses.SnapKV(0.5, context=24, window=4, kernel=3)
    keep = press.keep(inputs, 0)
    c, C, w = 24, 12, 4
    scores = (inputs.q @ inputs.k.transpose(-1, -2))[0, 0].numpy()
    votes = np.zeros(c)
    for i in range(c - w, c):
        e = np.exp(scores[i, : i + 1] - scores[i, : i + 1].max())
        votes[: i + 1] += e / e.sum()
    padded = np.concatenate([[0.0], votes, [0.0]])  # average pooling, zero padding
    pooled = np.array([padded[j : j + 3].sum() / 3 for j in range(c)])
    chosen = set(np.argsort(-pooled[: c - w])[: C - w]) | set(range(c - w, c))
    for i in range(30):
        expected = list(range(i + 1)) if i < c else sorted(chosen | set(range(c, i + 1)))
        assert keep[0, 0, i].nonzero().flatten().tolist() == expected
    assert press.first_row(30) == c


def test_knorm_calibration_passes_the_fraction():
    model, x = _model("softmax_rope"), _tokens(B=4, T=40)
    thresholds = presses.calibrate_knorm(model, x, 0.3)
    layer = model.layers()[0]
    with torch.no_grad():
        inputs = presses.attention_inputs(layer.mixer, layer.norm1(model.embed(x)))
    passing = (-inputs.k.norm(dim=-1) >= thresholds[0]).double().mean()
    assert abs(float(passing) - 0.3) < 0.01


def test_bad_press_input_is_a_value_error():
    with pytest.raises(ValueError, match="theta"):
        presses.DepthEviction(0.0)
    with pytest.raises(ValueError, match="depth eviction needs a field"):
        presses.DepthEviction(1.0).keep(_inputs(), 0)
    with pytest.raises(ValueError, match="context"):
        presses.SnapKV(0.5, context=40).keep(_inputs(), 0)
    with pytest.raises(ValueError, match="mixer"):
        presses.attention_inputs(torch.nn.Linear(2, 2), torch.zeros(1, 3, 2))
