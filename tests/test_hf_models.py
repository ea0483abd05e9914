"""The attnspec models in Hugging Face transformers (attnspec.models, the ``.[hf]`` extra).

Tests of flash-linear-attention's kind for its Forgetting Transformer: the Auto classes build
every kind; prefill plus token-by-token decoding, with left padding, equals the forward without
a cache (given as ``cache=`` or ``past_key_values=``); at finite theta the decoded outputs equal
the reference's (F7) decoder; generate()'s greedy, sampling and beam search give what they give
without a cache, assisted and prompt-lookup decoding what greedy gives; crop as transformers
reads it; a forward that fails in a later layer leaves the cache as it was; the names other
libraries read; bytes held; save / load; Trainer. Tiny configurations, float32 (float64 where an
exact comparison wants it).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import model_outputs  # noqa: E402

import attnspec.models as M  # noqa: E402
from attnspec.conformance.tolerances import TOLERANCES  # noqa: E402
from attnspec.models.modeling import CACHE_NAME  # noqa: E402
from attnspec.reference.fpa import fpa_decode  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # name -> (configuration class, layer_pattern, num_kv_heads)
    "fpa": (M.FPAConfig, "FPA", 2),
    "fpa_fox": (M.FPAConfig, "FPA_FOX", 2),
    "fox": (M.FoXConfig, "FOX", 2),
    "interdomain": (M.InterdomainConfig, "ID", 4),
    "hybrid": (M.HybridConfig, "FPA,ID", 4),
}


def tiny(kind: str, **overrides):
    cls, pattern, kv = KINDS[kind]
    fields = dict(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        layer_pattern=pattern,
        num_heads=4,
        num_kv_heads=kv,
        intermediate_size=48,
        id_modes=8,
        initializer_range=0.2,  # logits far from uniform, so differences show
    )
    return cls(**{**fields, **overrides})


def build(kind: str, dtype=torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny(kind, **overrides))
    return model.to(dtype).eval()


def cache_of(output):
    """The cache of a forward's or generate()'s output, under the installed transformers' name
    (``cache`` from 5.24, ``past_key_values`` before)."""
    return getattr(output, CACHE_NAME)


def normwise(got, want) -> float:
    """The kit's metric: ||got - want|| / ||want||."""
    return float((got - want).norm() / want.norm())


def batch(seed: int = 1, T: int = 9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_auto_classes_build_every_kind(kind):
    config = tiny(kind)
    fields = {k: v for k, v in config.to_diff_dict().items() if k != "model_type"}
    again = transformers.AutoConfig.for_model(config.model_type, **fields)
    assert type(again) is type(config) and again.layer_kinds == config.layer_kinds
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model) is M.MODELS[type(config)][1]
    assert type(transformers.AutoModel.from_config(config)) is M.MODELS[type(config)][0]


@pytest.mark.parametrize("name", sorted(model_outputs.CASES))
def test_the_models_reproduce_their_saved_outputs(name):
    """Weights and outputs saved in tests/data/models (tests/model_outputs.py: FPA with GQA and
    eviction, FPA_FOX with a window, FoX with GQA and a window, Interdomain, hybrids, float64
    and bfloat16; the forward, a left-padded batch, prefill then steps, a crop, greedy
    generation, the cache's bytes and fractions): the checkpoints, written by the models before
    their FPA and FoX mixers became FirstPassageAttention, load with from_pretrained (the same
    parameter names and layouts) and give the saved outputs bit for bit on the torch and CPU
    kernels that wrote them (float sums depend on the vector kernels); elsewhere token ids and
    counts are equal and logits within the kit's output tolerance of their dtype."""
    want, platform = model_outputs.saved(name)
    got = model_outputs.outputs(model_outputs.load(name))
    assert sorted(got) == sorted(want)
    here = model_outputs.platform()
    bits = all(platform[k] == here[k] for k in ("torch", "cpu_capability"))
    for key in sorted(want):
        if bits or not want[key].is_floating_point() or not want[key].numel():
            assert torch.equal(got[key], want[key]), key
        else:
            tolerance = TOLERANCES[(str(want[key].dtype).removeprefix("torch."), "output")]
            assert normwise(got[key].double(), want[key].double()) <= tolerance, key


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_padded_rows_equal_their_unpadded_forward(kind):
    model = build(kind)
    ids, mask = batch()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        for r in range(3):
            alone = model(ids[r : r + 1, mask[r].bool()], use_cache=False).logits[0]
            torch.testing.assert_close(padded[r, mask[r].bool()], alone, rtol=0, atol=1e-5)
        # the mask matters: without it row 1 attends to its padding and differs
        unmasked = model(ids, use_cache=False).logits
        assert (unmasked[1, 3:] - padded[1, 3:]).abs().max() > 1e-3


def prefill_then_steps(model, ids, mask, cache=None, name=CACHE_NAME, prefill=4, start=0):
    """The logits of positions [start, T): a chunk up to ``prefill``, then one step per
    position, the cache passed as ``name``; and the cache."""
    out = model(ids[:, start:prefill], attention_mask=mask[:, :prefill], **{name: cache})
    logits, cache = [out.logits], cache_of(out)
    for t in range(prefill, ids.shape[1]):
        step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **{name: cache})
        logits.append(step.logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prefill_then_steps_equal_the_forward_without_cache(kind):
    """In float64. Decoding and the parallel forward sum in different orders (the S4D state's
    recurrence token by token against its chunked form, matrix-vector against matrix-matrix
    products), so they differ by rounding: in float32 the Interdomain model's logits differed
    by 4e-6 to 3e-5 (max abs) depending on which vector kernels the CPU runs (the same code
    and seeds; the tolerance of 1e-5 failed on some machines), each path within 8e-5 of the
    float64 logits. To first order both errors are a fixed multiple of the unit roundoff, so in
    float64 (2^-29 times float32's) they are below 1e-13 normwise: the kit's float64 tolerance
    of 1e-12 bounds them; a cache that restarts at every step is off by about 1."""
    model = build(kind, dtype=torch.float64)
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        decoded, cache = prefill_then_steps(model, ids, mask)
    present = mask.bool()
    assert normwise(decoded[present], full[present]) <= TOLERANCES[("float64", "output")]
    assert cache.get_seq_length() == ids.shape[1]


def test_the_cache_reaches_the_model_under_either_name():
    """transformers from 5.24 gives the cache to the model as ``cache=``, before as
    ``past_key_values=``: steps alternating the names continue the same cache (a model that
    read one name only would start a new cache at the others and decode wrong)."""
    model = build("hybrid", dtype=torch.float64)
    ids, mask = batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        out = model(ids[:, :4], attention_mask=mask[:, :4], cache=M.AttnSpecCache(model.config))
        logits, cache = [out.logits], cache_of(out)
        for t in range(4, ids.shape[1]):
            name = ("cache", "past_key_values")[t % 2]
            step = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **{name: cache})
            assert cache_of(step) is cache
            logits.append(step.logits)
    present = mask.bool()
    got = torch.cat(logits, dim=1)[present]
    assert normwise(got, full[present]) <= TOLERANCES[("float64", "output")]
    with pytest.raises(ValueError, match="cache: given twice"):
        model(ids[:, :1], cache=cache, past_key_values=M.AttnSpecCache(model.config))


def _attention_inputs(layer, x):
    """q, k, v, field, level of an FPA or FoX layer for x [1, T, d] from its projections
    (spec/fpa.md section 3), in the reference's layout."""
    HQ, H, dk = layer.n_heads, layer.n_kv_heads, layer.head_dim
    q = layer.q_proj(x).unflatten(-1, (HQ, dk))
    k, v = (p(x).unflatten(-1, (H, dk)) for p in (layer.k_proj, layer.v_proj))
    delta = layer.f_proj(x)
    if layer.kind != "FPA":
        delta = torch.nn.functional.logsigmoid(delta)
    lam = layer.lam_proj(x) if layer.kind != "FOX" else torch.zeros_like(delta)
    field = delta.cumsum(dim=1)
    k, v = (t.repeat_interleave(HQ // H, dim=2) for t in (k, v))
    arrays = [t.transpose(1, 2).double().numpy() for t in (q, k, v)]
    return (*arrays, *(t.transpose(1, 2).double().numpy() for t in (field, field + lam)))


@pytest.mark.parametrize("kind", ["fpa", "fox"])
def test_eviction_at_finite_theta_equals_the_reference_decoder(kind):
    """One FPA layer decoded with theta = 1.0 in float64: the block's attention output equals
    the reference's (F7) stream decoder on the same q, k, v, field, level (k, v repeated)."""
    model = build(kind, dtype=torch.float64, num_hidden_layers=1, theta=1.0)
    block = model.model.layers[0]
    ids = torch.randint(0, 40, (1, 24), generator=torch.Generator().manual_seed(3))
    seen = []
    block.attn.o_proj.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        cache = cache_of(model(ids[:, :10], use_cache=True))
        for t in range(10, 24):
            model(ids[:, t : t + 1], cache=cache)
        x = block.attn_norm(model.model.embeddings(ids))
        want = fpa_decode(*_attention_inputs(block.attn, x), theta=1.0)
    got = torch.cat(seen, dim=1)[0].view(24, 4, 8).transpose(0, 1).numpy()
    np.testing.assert_allclose(got, want.o[0], rtol=0, atol=1e-12)
    fractions = cache.fractions()[0]
    assert fractions["live"] < 1.0  # some keys were evicted
    live = cache.layers[0].session.counts()["live"]
    np.testing.assert_array_equal(live[0].numpy(), want.cache_sizes[0, :, -1])


@pytest.mark.parametrize("kind", ["fpa", "fox", "hybrid"])
def test_generate_greedy_sampling_and_beams_equal_generation_without_cache(kind):
    model = build(kind)
    ids, mask = batch(T=6)
    modes = {
        "greedy": dict(do_sample=False),
        "sampling": dict(do_sample=True, top_k=0, temperature=1.0),
        "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    }
    for name, options in modes.items():
        outputs = []
        for use_cache in (True, False):
            torch.manual_seed(7)
            outputs.append(
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=6,
                    use_cache=use_cache,
                    pad_token_id=0,
                    **options,
                )
            )
        torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0, msg=name)


def test_greedy_generation_is_the_argmax_of_the_forward():
    model = build("fpa")
    ids, mask = batch(T=5)
    out = model.generate(
        ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    seq, m = ids, mask
    with torch.no_grad():
        for _ in range(5):
            nxt = model(seq, attention_mask=m, use_cache=False).logits[:, -1].argmax(-1)
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
    torch.testing.assert_close(out, seq, rtol=0, atol=0)


def test_theta_per_generate_call_and_the_fractions_after_it():
    model = build("fpa", num_hidden_layers=1)
    ids, mask = batch(T=12)
    fractions = {}
    for theta in (math.inf, 0.5):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            theta=theta,
            return_dict_in_generate=True,
        )
        fractions[theta] = cache_of(out).fractions()[0]
    cache = M.AttnSpecCache(model.config, theta=1.0)
    with pytest.raises(ValueError, match=r"theta: 0\.5, but the cache given evicts at theta = 1"):
        model.generate(ids, cache=cache, theta=0.5, max_new_tokens=1, pad_token_id=0)
    assert fractions[math.inf] == {"live": 1.0, "stored": 1.0}
    assert fractions[0.5]["live"] < fractions[0.5]["stored"] <= 1.0 or (
        fractions[0.5]["live"] == fractions[0.5]["stored"] < 1.0
    )


def test_crop_is_a_rollback_within_max_rollback():
    """transformers' reading: crop(0) removes nothing (assisted decoding calls it when it
    rejects no draft), crop(-n) removes n positions; the older crop(m > 0) keeps m."""
    model = build("fpa", max_rollback=3, theta=0.5)
    ids, mask = batch(T=10)
    with torch.no_grad():
        fresh = cache_of(model(ids[:, :7], attention_mask=mask[:, :7]))
        want = model(ids[:, 7:10], attention_mask=mask[:, :10], past_key_values=fresh).logits
        cache = cache_of(model(ids[:, :7], attention_mask=mask[:, :7]))
        for crop in (lambda: cache.crop(-2), lambda: cache.crop(7)):
            model(ids[:, 7:9], attention_mask=mask[:, :9], past_key_values=cache)
            cache.crop(0)
            assert cache.get_seq_length() == 9
            crop()  # back to 7 positions
            assert cache.get_seq_length() == 7
            again = model(ids[:, 7:10], attention_mask=mask[:, :10], past_key_values=cache)
            torch.testing.assert_close(again.logits, want, rtol=0, atol=1e-6)
            cache.crop(-3)
    with pytest.raises(ValueError, match="max_rollback"):
        cache.crop(-4)
    with pytest.raises(ValueError, match="max_rollback"):
        cache.crop(cache.get_seq_length() - 4)
    assert cache.get_seq_length() == 7


def test_assisted_and_prompt_lookup_decoding_give_greedy_tokens(monkeypatch):
    """Speculative decoding with the cache generate() builds (it reserves a draft's rollback):
    a smaller attnspec model as the assistant, and prompt lookup, give exactly greedy's tokens,
    as transformers requires of any cache; drafts were rejected (crops removed positions)."""
    model = build("hybrid")
    assistant = build("fpa", num_hidden_layers=1, seed=3)
    ids = torch.tensor([[3, 9, 12, 3, 9, 12, 7, 22, 5, 3, 9]])  # repeats: lookup finds drafts
    crops = []
    crop = M.AttnSpecCache.crop
    monkeypatch.setattr(M.AttnSpecCache, "crop", lambda c, n: (crops.append(n), crop(c, n))[1])
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    greedy = model.generate(ids, **options)
    assert not crops
    for speculative in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=assistant)):
        crops.clear()
        got = model.generate(ids, **speculative, **options)
        torch.testing.assert_close(got, greedy, rtol=0, atol=0, msg=str(speculative))
        assert min(crops) < 0, crops


def test_speculative_decoding_names_max_rollback_when_the_cache_cannot_roll_back():
    """A cache holding tokens already cannot widen its rollback: prompt lookup over it is a
    ValueError naming max_rollback before anything is decoded."""
    model = build("fpa")
    ids, _ = batch(T=8)
    cache = cache_of(model(ids[:1, :5]))  # max_rollback = 0
    with pytest.raises(ValueError, match="max_rollback"):
        model.generate(
            ids[:1], cache=cache, prompt_lookup_num_tokens=3, max_new_tokens=4, pad_token_id=0
        )
    assert cache.get_seq_length() == 5


@pytest.mark.parametrize("prefill, chunk", [(0, 4), (4, 1), (4, 3)])
def test_a_forward_that_fails_in_a_later_layer_leaves_the_cache_as_it_was(prefill, chunk):
    """Layers FPA, ID, FPA at theta = 0.5 (keys are evicted); layer 2's field made infinite:
    the forward raises a ValueError naming layer 2, every layer keeps its positions, and with
    the weight repaired the cache decodes exactly as one that never saw the call. Undone: a new
    cache (prefill 0), one decode step (the FPA layers' reserved (F9) rollback) and a chunk of
    three (a copy)."""
    model = build("hybrid", num_hidden_layers=3, layer_pattern="FPA,ID,FPA", theta=0.5)
    ids, mask = batch()
    bias = model.model.layers[2].attn.f_proj.bias
    with torch.no_grad():
        cache, good = M.AttnSpecCache(model.config), bias.clone()
        if prefill:
            model(ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache)
        bias.fill_(math.inf)
        end = prefill + chunk
        with pytest.raises(ValueError, match=r"layer 2 \(FPA\): field"):
            model(ids[:, prefill:end], attention_mask=mask[:, :end], cache=cache)
        assert [layer.get_seq_length() for layer in cache.layers] == [prefill] * 3
        bias.copy_(good)
        got, _ = prefill_then_steps(model, ids, mask, cache, prefill=prefill + 1, start=prefill)
        want, _ = prefill_then_steps(model, ids, mask, prefill=max(prefill, 1))
    torch.testing.assert_close(got, want[:, prefill:], rtol=0, atol=0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_configurations_answer_to_the_names_other_libraries_read(kind, tmp_path):
    """num_attention_heads and num_key_value_heads (transformers, PEFT, accelerate and serving
    engines read them) are num_heads and num_kv_heads under another name: given to the
    constructor, read and set, one stored field; head_dim is always set; the modules have those
    sizes; a save / load keeps them."""
    cls = KINDS[kind][0]
    config = cls(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=2,
        layer_pattern=KINDS[kind][1],
        num_attention_heads=8,
        num_key_value_heads=2 if "ID" not in KINDS[kind][1] else 8,
        intermediate_size=48,
    )
    assert (config.num_heads, config.num_attention_heads, config.head_dim) == (8, 8, 4)
    assert config.num_key_value_heads == config.num_kv_heads
    assert not {"num_attention_heads", "num_key_value_heads"} & set(config.to_dict())
    model = transformers.AutoModelForCausalLM.from_config(config)
    attn = model.model.layers[0].attn
    if isinstance(attn, M.modeling.ForgetGateAttention):
        assert attn.k_proj.out_features == config.num_key_value_heads * config.head_dim
    else:
        assert attn.layer.n_heads == config.num_attention_heads
    config.save_pretrained(tmp_path)
    again = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (again.num_attention_heads, again.num_key_value_heads) == (8, config.num_kv_heads)
    config.num_key_value_heads = 4
    assert config.num_kv_heads == 4
    with pytest.raises(ValueError, match="num_attention_heads: 2, but num_heads"):
        cls(hidden_size=32, num_heads=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="num_heads: 3 does not divide"):
        cls(hidden_size=32, num_attention_heads=3)  # checked as num_heads is


def test_the_cache_reports_bytes_held_and_what_a_full_cache_would_hold():
    """One row of 32 tokens (two pages of 16) at theta = inf: the FPA layer holds what a full
    cache holds, k and v of every token per kv head (2 kv heads, head dim 8, float32: 32 x 2 x
    16 x 4 bytes); at theta = 0.5 it holds less. An Interdomain layer's state does not grow
    with the tokens, and is its full cache."""
    ids = torch.randint(0, 40, (1, 64), generator=torch.Generator().manual_seed(5))
    fpa = build("fpa", num_hidden_layers=1)
    full = cache_of(fpa(ids[:, :32]))
    assert full.bytes_held() == full.bytes_full() == 32 * 2 * 16 * 4
    evicting = cache_of(fpa(ids, theta=0.5))
    assert evicting.bytes_full() == 64 * 2 * 16 * 4
    assert 0 < evicting.bytes_held() < evicting.bytes_full()
    assert evicting.fractions()[0]["stored"] < 1
    interdomain = build("interdomain", num_hidden_layers=1)
    short, long = (cache_of(interdomain(ids[:, :T])) for T in (8, 64))
    assert short.bytes_held() == long.bytes_held() == long.bytes_full() > 0


def test_save_and_load_give_the_same_logits(tmp_path):
    model = build("hybrid")
    ids, mask = batch()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        a = model(ids, attention_mask=mask, use_cache=False).logits
        b = loaded(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_few_trainer_steps_lower_the_loss(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    text = (ROOT / "docs" / "spec" / "fpa.md").read_bytes()[:4096]
    data = torch.tensor(list(text), dtype=torch.long)
    windows = data[: (len(data) // 64) * 64].view(-1, 64)
    model = build("fpa", vocab_size=256, initializer_range=0.02).train()

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return len(windows)

        def __getitem__(self, i):
            return {"input_ids": windows[i], "labels": windows[i]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=12,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Windows())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(layer_pattern="FPA,XL"), "layer_pattern"),
        (dict(layer_pattern="FPA,FPA,FPA"), "layer_pattern"),
        (dict(num_kv_heads=3), "num_kv_heads"),
        (dict(hidden_size=30), "num_heads"),
        (dict(theta=0.0), "theta"),
        (dict(max_rollback=-1), "max_rollback"),
        (dict(id_readout="softmax"), "id_readout"),
    ],
)
def test_bad_configurations_name_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        tiny("fpa", **fields)


def test_a_cache_from_another_model_is_refused():
    fpa, hybrid = build("fpa"), build("hybrid")
    ids, mask = batch()
    cache = cache_of(fpa(ids[:, :4], attention_mask=mask[:, :4]))
    with pytest.raises(ValueError, match="cache: a cache for layers"):
        hybrid(ids[:, 4:5], attention_mask=mask[:, :5], past_key_values=cache)


def test_the_forward_compiles_without_graph_breaks():
    model = build("fpa")
    ids, _ = batch()
    explained = torch._dynamo.explain(lambda x: model(x, use_cache=False).logits)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons


def test_the_documented_example_trains_generates_and_reloads():
    import importlib.util

    path = ROOT / "docs" / "examples" / "transformers_lm.py"
    spec = importlib.util.spec_from_file_location("transformers_lm", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model, losses = example.train(steps=6)
    assert losses[-1] < losses[0]
    texts, fractions, _ = example.generate(model, theta=2.0)
    assert len(texts) == 2 and all(len(t) == 24 for t in texts)
    assert fractions[1] is None and 0 < fractions[0]["live"] <= fractions[0]["stored"] < 1
    assert example.generate(example.save_and_load(model))[0] == example.generate(model)[0]


@pytest.mark.parametrize("kind", ["fpa", "hybrid"])
def test_bfloat16_decoding_is_within_the_kit_tolerance_of_the_float64_forward(kind):
    """Prefill plus steps of a bfloat16 model against the float64 forward without a cache of
    the same (bfloat16-rounded) weights: normwise relative error within the kit's bfloat16
    output tolerance (conformance/tolerances.py)."""
    model = build(kind, dtype=torch.bfloat16)
    wide = build(kind).to(torch.float64).eval()
    wide.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids, mask = batch()
    with torch.no_grad():
        want = wide(ids, attention_mask=mask, use_cache=False).logits
        got = prefill_then_steps(model, ids, mask)[0].double()
    present = mask.bool()
    error = normwise(got[present], want[present])
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    assert error <= TOLERANCES[("bfloat16", "output")], error
