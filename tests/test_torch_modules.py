"""The layers as nn.Modules against the reference layers, with the reference's parameter dicts;
their decode paths against their parallel forward; packed sequences against separate ones."""

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention  # noqa: E402
from attnspec.reference import fpa  # noqa: E402
from attnspec.reference import interdomain as idm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


X = np.random.default_rng(0).standard_normal((2, 17, 16))


def decode(layer, x, split):
    """Prefill the first ``split`` tokens, then step through the rest."""
    cache = layer.new_cache()
    head = layer.prefill(x[:, :split], cache)
    tail = [layer.step(x[:, t], cache) for t in range(split, x.shape[1])]
    return torch.cat([head, torch.stack(tail, 1)], 1)


@pytest.mark.parametrize("increments", ["signed", "logsigmoid"])
def test_fpa_layer_matches_the_reference_layer(increments):
    params = fpa.init_fpa_params(16, 2, 4, 3, seed=1)
    want = fpa.fpa_layer(X, params, increments=increments)
    layer = FirstPassageAttention.from_reference_params(params, increments=increments)
    assert layer.wq.dtype == torch.float64 and layer.wq.shape == (16, 8)
    x = torch.from_numpy(X)
    with torch.no_grad():
        np.testing.assert_allclose(layer(x).numpy(), want, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(decode(layer, x, 9).numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("readout", "gate", "use_rope"),
    [("linear", False, False), ("ratio", False, False), ("linear", True, True)],
)
def test_interdomain_layer_matches_the_reference_layer(readout, gate, use_rope):
    params = idm.init_interdomain_params(16, 2, 4, 3, 8, seed=1, gate=gate)
    if readout == "ratio":  # positive k~ and C near I keep the denominator away from zero
        params["norm_k_b"] += 3.0
        params["c_re"] += np.eye(8)
    want = idm.interdomain_layer(X, params, readout=readout, gate=gate, use_rope=use_rope)
    layer = InterdomainAttention.from_reference_params(params, readout=readout, use_rope=use_rope)
    assert layer.gate == gate
    x = torch.from_numpy(X)
    with torch.no_grad():
        got = layer(x).numpy()
        stepped = decode(layer, x, 9).numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12 * scale)
    np.testing.assert_allclose(stepped, want, rtol=1e-11, atol=1e-12 * scale)


@pytest.mark.parametrize("layer_type", [FirstPassageAttention, InterdomainAttention])
def test_packed_sequences_equal_separate_calls(layer_type):
    torch.manual_seed(0)
    layer = layer_type(16, 2, 4, 3).double()
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    cu = [0, 12, 13, 30]
    with torch.no_grad():
        packed = layer(x, cu_seqlens=torch.tensor(cu))
        for a, e in itertools.pairwise(cu):
            assert torch.allclose(packed[:, a:e], layer(x[:, a:e]), rtol=1e-12, atol=1e-12)


def test_layers_train_end_to_end():
    torch.manual_seed(1)
    layers = [FirstPassageAttention(16, 2, 4), InterdomainAttention(16, 2, 4, n_modes=8)]
    x = torch.randn(2, 20, 16)
    for layer in layers:
        layer(x).square().mean().backward()
        grads = {name: p.grad for name, p in layer.named_parameters()}
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
        assert grads["wq"].abs().sum() > 0  # gradients reach the projections through the op


def test_bad_parameters_and_input():
    params = fpa.init_fpa_params(16, 2, 4, 3)
    with pytest.raises(ValueError, match=r"params: missing \['w_lam'\]"):
        FirstPassageAttention.from_reference_params(
            {k: v for k, v in params.items() if k != "w_lam"}
        )
    with pytest.raises(ValueError, match=r"params\['wk'\]: expected shape \(16, 8\)"):
        FirstPassageAttention.from_reference_params({**params, "wk": params["wk"][:, :4]})
    layer = FirstPassageAttention.from_reference_params(params)
    with pytest.raises(ValueError, match="x: expected d_model = 16 features"):
        layer(torch.zeros(1, 5, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="increments: expected 'signed' or 'logsigmoid'"):
        FirstPassageAttention(16, 2, 4, increments="cumsum")
    with pytest.raises(ValueError, match="readout: expected 'linear' or 'ratio'"):
        InterdomainAttention(16, 2, 4, readout="softmax")


def test_interdomain_layer_without_output_norm_is_the_paper_literal_reference_layer():
    params = idm.init_interdomain_params(16, 2, 4, 3, 8, seed=2, output_norm=False)
    want = idm.interdomain_layer(X, params, output_norm=False)
    layer = InterdomainAttention.from_reference_params(params, output_norm=False)
    assert not hasattr(layer, "norm_o_g")
    x = torch.from_numpy(X)
    with torch.no_grad():
        np.testing.assert_allclose(layer(x).numpy(), want, rtol=1e-11, atol=1e-14)
        np.testing.assert_allclose(decode(layer, x, 5).numpy(), want, rtol=1e-11, atol=1e-14)
    with pytest.raises(ValueError, match=r"params: missing \['norm_o_g'\]"):
        InterdomainAttention.from_reference_params(params)


@pytest.mark.parametrize("readout", ["linear", "ratio"])
def test_interdomain_output_rms_at_initialisation_is_order_one_for_every_length(readout):
    # (I11) zero-order hold and (I14) output norm. Before: RMS 89 at T = 16, 2,000 at T = 256
    # and 8,900 at T = 4,096 with the linear readout (these sizes, seed 0).
    torch.manual_seed(0)
    layer = InterdomainAttention(16, 2, 8, n_modes=16, readout=readout)
    for T in (16, 4096):
        x = torch.randn(1, T, 16)
        with torch.no_grad():
            rms = layer(x).square().mean().sqrt().item()
        assert 0.1 <= rms <= 10, (T, rms)


@pytest.mark.parametrize("layer_type", [FirstPassageAttention, InterdomainAttention])
def test_layers_take_an_empty_batch_and_the_meta_device(layer_type):
    torch.manual_seed(2)
    layer = layer_type(16, 2, 4, 3)
    y = layer(torch.randn(0, 7, 16))
    assert y.shape == (0, 7, 16)
    y.sum().backward()
    grads = [p.grad for p in layer.parameters()]
    assert all(g is not None and not g.any() for g in grads)  # an empty sum: zero gradients
    meta = layer_type(16, 2, 4, 3, device="meta")
    for B in (0, 3):
        y = meta(torch.empty(B, 9, 16, device="meta"))
        assert (y.shape, y.device.type) == ((B, 9, 16), "meta")


def test_zero_order_hold_keeps_float32_precision_for_small_steps():
    # (I11) b_bar = (Lambda - 1) / a (.) b at dt = 1e-3, the smallest step of the
    # initialisation: exp(dt a) - 1 in float32 cancels (relative error 5.8e-5 measured with
    # these modes); the expm1 form stays at float32 rounding (5e-8 measured).
    torch.manual_seed(3)
    layer = InterdomainAttention(8, 2, 4, n_modes=16)
    with torch.no_grad():
        layer.log_dt.fill_(np.log(1e-3))
        _, b, _ = layer.ssm_parameters()
    p = {k: v.detach().double().numpy() for k, v in layer.named_parameters()}
    want = idm.s4d_b_bar(p["log_dt"], p["a_log"], p["a_im"], p["b_re"] + 1j * p["b_im"])
    got = torch.view_as_complex(b.contiguous()).numpy()
    assert b.dtype == torch.float32
    assert np.max(np.abs(got - want) / np.abs(want)) < 1e-6


def reference_layer(x, P, *, kv, increments, key_offsets, window):
    """The layer of spec/fpa.md section 3 in NumPy with GQA (query head h reads key/value head
    h // (H / kv)), levels on the field without key offsets, the window of (F3w); FoX (F6) by
    the reference's direct form (logits plus summed log forget gates)."""
    H = P["b_delta"].shape[0]
    dk, dv = P["wq"].shape[1] // H, P["wv"].shape[1] // kv

    def heads(y, n, width):  # (T, n width) -> (H, T, width), kv heads repeated per group
        return np.repeat(np.swapaxes(y.reshape(-1, n, width), 0, 1), H // n, axis=0)

    q, k, v = heads(x @ P["wq"], H, dk), heads(x @ P["wk"], kv, dk), heads(x @ P["wv"], kv, dv)
    delta = (x @ P["w_delta"] + P["b_delta"]).T  # (H, T)
    if increments == "logsigmoid":
        delta = -np.logaddexp(0.0, -delta)
    if increments == "logsigmoid" and not key_offsets:
        o = fpa.fox_attention_direct(q, k, v, delta, window=window)
    else:
        field = np.cumsum(delta, axis=-1)
        level = field + (x @ P["w_lam"] + P["b_lam"]).T if key_offsets else field
        o = fpa.fpa_attention(q, k, v, field, level, window=window)
    return np.swapaxes(o, 0, 1).reshape(x.shape[0], H * dv) @ P["wo"]


FPA_KINDS = {  # name -> (kv heads, increments, key offsets, window)
    "gqa": (2, "signed", True, None),
    "fox": (4, "logsigmoid", False, None),
    "fox_gqa_window": (2, "logsigmoid", False, 3),
    "mqa_window": (1, "logsigmoid", True, 4),
}


@pytest.mark.parametrize("kind", sorted(FPA_KINDS))
def test_fpa_layer_with_kv_heads_fox_and_a_window_against_the_reference(kind):
    """Key/value heads (GQA, MQA), FoX (no key offsets, logsigmoid increments: the reference's
    direct FoX) and the (F3w) window, in float64: the forward on a batch with left and right
    padding (``padding``), and the decode session (prefill, ragged steps) row by row, against
    the NumPy layer on each row's tokens alone."""
    from attnspec.backends.torch.padding import Padding

    kv, increments, key_offsets, window = FPA_KINDS[kind]
    params = fpa.init_fpa_params(16, 4, 4, 3, seed=2)
    params["b_delta"] = params["b_delta"] - 0.4  # a falling field: descents penalise keys
    rng = np.random.default_rng(3)
    params["wk"], params["wv"] = (rng.standard_normal((16, kv * n)) / 4 for n in (4, 3))
    if not key_offsets:
        del params["w_lam"], params["b_lam"]
    layer = FirstPassageAttention.from_reference_params(
        params, n_kv_heads=kv, increments=increments, key_offsets=key_offsets, window=window
    )
    assert (layer.n_kv_heads, layer.fox) == (kv, increments == "logsigmoid" and not key_offsets)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[1, :4] = False  # left padding
    mask[2, 8:] = False  # right padding
    x = torch.from_numpy(rng.standard_normal((3, 11, 16)))
    want = [reference_layer(x[r][mask[r]].numpy(), params, kv=kv, increments=increments,
                            key_offsets=key_offsets, window=window) for r in range(3)]  # fmt: skip
    with torch.no_grad():
        y = layer(x, padding=Padding(mask))
        session = layer.open_session(3, max_rollback=1, page_size=4)
        decoded = [session.advance({"x": x[:, :6]}, mask[:, :6])["y"]]
        decoded += [session.advance({"x": x[:, t : t + 1]}, mask[:, t : t + 1])["y"]
                    for t in range(6, 11)]  # fmt: skip
    decoded = torch.cat(decoded, dim=1)
    for r in range(3):
        np.testing.assert_allclose(y[r][mask[r]].numpy(), want[r], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(decoded[r][mask[r]].numpy(), want[r], rtol=0, atol=1e-10)
    assert not y[~mask].any() and not decoded[~mask].any()
    assert session.counts()["stored"].shape == (3, kv)  # k and v once per kv head (F8 gqa)


def test_fpa_layer_kinds_refuse_bad_arguments():
    from attnspec.backends.torch.padding import Padding

    with pytest.raises(ValueError, match="n_kv_heads: expected a divisor of n_heads = 4"):
        FirstPassageAttention(16, 4, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        FirstPassageAttention(16, 4, 4, window=0)
    with pytest.raises(ValueError, match="key_offsets: expected True or False"):
        FirstPassageAttention(16, 4, 4, key_offsets=None)
    fox = FirstPassageAttention(16, 4, 4, increments="logsigmoid", key_offsets=False, window=3)
    assert {n for n, _ in fox.named_parameters()} == {"wq", "wk", "wv", "wo", "w_delta", "b_delta"}
    with pytest.raises(ValueError, match=r"window: the single-stream cache has no \(F3w\)"):
        fox.new_cache()
    x = torch.zeros(2, 5, 16)
    with pytest.raises(ValueError, match=r"padding: give padding .* or cu_seqlens"):
        fox(
            x[:1],
            padding=Padding(torch.ones(1, 5, dtype=torch.bool)),
            cu_seqlens=torch.tensor([0, 5]),
        )
    with pytest.raises(ValueError, match=r"padding: expected a Padding of x's \[B, T\] = \(2, 5\)"):
        fox(x, padding=Padding(torch.ones(2, 4, dtype=torch.bool)))
    params = fpa.init_fpa_params(16, 4, 4, 4)
    with pytest.raises(ValueError, match=r"params\['wk'\]: expected shape \(16, 8\)"):
        FirstPassageAttention.from_reference_params(params, n_kv_heads=2)
