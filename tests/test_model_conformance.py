"""``attnspec conformance --model``: the verdict on a transformers causal LM's cache.

The control is transformers' own Llama with its DynamicCache: it must pass every program. Each
shipped wrong cache (models/mutants.py) must fail the family written for it while the
correct cache it wraps passes that family. Our four model types pass the programs (the full run
under every transformers the range admits is the version matrix's); a finite theta is not
applicable, a window is judged against the windowed forward. Tiny models, float32.
"""

from __future__ import annotations

import json
import shlex
import xml.etree.ElementTree as ET

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnspec.models as M  # noqa: E402
from attnspec.cli import main  # noqa: E402
from attnspec.conformance import model_runner  # noqa: E402
from attnspec.conformance.model_loading import (  # noqa: E402
    format_overrides,
    load_model,
    parse_overrides,
)
from attnspec.conformance.model_programs import (  # noqa: E402
    FAMILIES,
    build_program,
    family_of,
    model_case_ids,
)
from attnspec.conformance.model_runner import run_model, run_program  # noqa: E402
from attnspec.models import mutants as model_mutants  # noqa: E402
from attnspec.models.cache import FPASessionLayer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA = "transformers:LlamaConfig"
LLAMA_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    initializer_range=0.2,  # logits far from uniform, so differences show
)
OURS = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_heads=4,
    intermediate_size=48,
    id_modes=8,
    initializer_range=0.2,
    max_rollback=4,
)
KINDS = ("FPAConfig", "FoXConfig", "InterdomainConfig", "HybridConfig")
# For our four model types in make test: padding in a chunked prefill, beam search's cache
# calls, assisted decoding's crops (the matrix runs every program).
SAMPLE = ["model/padded/1", "model/beams/0", "model/assisted/0"]


def llama():
    return load_model(LLAMA, LLAMA_CONFIG)


def ours(kind: str, **overrides):
    return load_model(f"attnspec.models:{kind}", {**OURS, **overrides})


def verdicts(report):
    return {(r.case_id, r.dtype): r.verdict for r in report.results}


def test_programs_are_drawn_from_their_id_and_follow_transformers_crop():
    a, b = build_program("model/crop/1", 64), build_program("model/crop/1", 64)
    assert a.listing() == b.listing()
    assert all(
        (x.args["ids"] == y.args["ids"]).all()
        for x, y in zip(a.ops, b.ops, strict=True)
        if "ids" in x.args
    )
    crops = [op.args["value"] for op in a.ops if op.method == "crop"]
    assert crops and all(k < 0 for k in crops)  # negative: remove that many positions
    zero = build_program("model/crop_zero/0", 64)
    assert [op.args["value"] for op in zero.ops if op.method == "crop"] == [0, 0]
    assisted = build_program("model/assisted/0", 64)
    for chunk, crop in zip(assisted.ops[1:-1:2], assisted.ops[2::2], strict=True):
        assert crop.method == "crop" and -chunk.args["ids"].shape[1] <= crop.args["value"] < 0
    assert len(model_case_ids()) == sum(count for count, _, _ in FAMILIES.values())
    for bad in ("model/nosuch/0", "model/steps/9", "fpa/shapes/0"):
        with pytest.raises(ValueError, match="case id"):
            family_of(bad)


def test_model_config_items_read_back_as_written():
    items = ["hidden_size=32", "layer_pattern=FPA,ID", "theta=inf", "window_size=None"]
    overrides = parse_overrides(items)
    assert overrides == {
        "hidden_size": 32,
        "layer_pattern": "FPA,ID",
        "theta": float("inf"),
        "window_size": None,
    }
    assert parse_overrides(format_overrides(overrides)) == overrides
    with pytest.raises(ValueError, match="--model-config"):
        parse_overrides(["hidden_size"])


def test_llama_with_its_dynamic_cache_passes_every_program():
    report = run_model(llama(), model_case_ids(), spec=LLAMA)
    assert report.ok and {r.verdict for r in report.results} == {"passed"}, [
        r.message for r in report.results if r.verdict != "passed"
    ]
    worst = max(r.ratio for r in report.results)
    assert worst < 0.5  # float32 rounding of two summation orders, well inside the tolerance


MUTANT_MODELS = {
    "Dynamic": (llama, transformers.DynamicCache),
    "AttnSpec": (lambda: ours("HybridConfig"), M.AttnSpecCache),
}


@pytest.mark.parametrize("name", sorted(model_mutants.MUTANTS))
def test_each_wrong_cache_fails_its_family_and_the_cache_it_wraps_passes(name):
    mutant = model_mutants.MUTANTS[name]
    make, correct = MUTANT_MODELS["Dynamic" if name.startswith("Dynamic") else "AttnSpec"]
    model = make()
    ids = [f"model/{mutant.family}/0"]
    if "Dropped" in name:
        ids.append("model/generate_greedy/0")  # what a model that ignores its cache gives
    wrong = run_model(model, ids, factory=mutant)
    assert {r.verdict for r in wrong.results} == {"failed"}
    if correct is transformers.DynamicCache:
        right = run_model(model, ids, factory=lambda config: correct(config=config))
    else:
        right = run_model(model, ids, factory=correct)
    assert {r.verdict for r in right.results} == {"passed"}, [r.message for r in right.results]


@pytest.mark.parametrize("kind", KINDS)
def test_our_model_types_pass_the_programs(kind):
    report = run_model(ours(kind), SAMPLE, spec=f"attnspec.models:{kind}")
    failed = [r.message for r in report.results if r.verdict != "passed"]
    assert not failed, failed


def test_crop_zero_removes_nothing_in_our_cache():
    result = run_program(ours("FPAConfig"), "model/crop_zero/0", "float32")
    assert result.verdict == "passed", result.message


def test_the_control_crop_zero_removes_nothing():
    assert run_program(llama(), "model/crop_zero/0", "float32").verdict == "passed"


def test_finite_theta_is_not_applicable_and_a_window_is_judged():
    report = run_model(ours("FPAConfig", theta=1.0), ["model/steps/0", "model/generate_beams/0"])
    assert {r.verdict for r in report.results} == {"not applicable"}
    assert "theta = 1" in report.results[0].message and report.ok
    assert any("not applicable" in note for note in report.notes)
    windowed = ours("FoXConfig", window_size=3)
    ids = ["model/steps/0", "model/crop/0"]
    assert {r.verdict for r in run_model(windowed, ids).results} == {"passed"}
    # the same model with a cache that keeps every key fails: the window is really compared
    report = run_model(windowed, ids, factory=cache_without_window)
    assert {r.verdict for r in report.results} == {"failed"}


def cache_without_window(config):
    """A cache whose FPA / FoX sessions open with a window longer than any program: every key
    kept, whatever the layer's window."""
    cache = M.AttnSpecCache(config)
    for layer in cache.session_layers:
        if isinstance(layer, FPASessionLayer):
            options = layer.session_options
            layer.session_options = lambda options=options: {**options(), "window": 10**6}
    return cache


def test_a_model_that_does_not_read_the_cache_keyword_fails_and_is_told(monkeypatch):
    """What transformers 5.24 and later do to a model that reads only past_key_values."""
    model = ours("FPAConfig")
    forward = model.forward

    def reads_only_past_key_values(*args, cache=None, **kwargs):
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", reads_only_past_key_values)
    monkeypatch.setattr(model_runner, "cache_keyword", lambda: "cache")
    result = run_program(model, "model/steps/0", "float32")
    assert result.verdict == "failed"
    assert "does the model read the keyword 'cache'" in result.message


def test_a_crop_the_cache_declines_is_not_implemented():
    result = run_program(ours("FoXConfig", max_rollback=0), "model/crop/0", "float32")
    assert result.verdict == "not implemented" and "max_rollback" in result.message


def test_the_repro_line_reruns_exactly_the_failing_program(tmp_path, capsys):
    config = format_overrides(LLAMA_CONFIG)
    cache = "attnspec.models.mutants:DynamicCropOffByOne"
    args = ["conformance", "--model", LLAMA, "--model-config", *config, "--cache", cache]
    report, junit = tmp_path / "r.json", tmp_path / "r.xml"
    files = ["--json", str(report), "--junit", str(junit)]
    assert main([*args, "--cases", "model/crop/", "model/steps/0", *files]) == 1
    out = capsys.readouterr().out
    assert "model LlamaForCausalLM" in out and "2 failed" in out and "repro: " in out
    cases = {c["case_id"]: c for c in json.loads(report.read_text())["cases"]}
    assert cases["model/steps/0"]["verdict"] == "passed"
    failed = cases["model/crop/1"]
    assert failed["verdict"] == "failed" and "cache.crop(" in failed["message"]
    failures = ET.parse(junit).getroot().findall("testcase/failure")
    assert len(failures) == 2 and failed["repro"] in failures[1].text
    words = shlex.split(failed["repro"])
    assert words[:2] == ["attnspec", "conformance"]
    assert main([*words[1:], "--json", str(report)]) == 1
    (again,) = json.loads(report.read_text())["cases"]
    assert again["case_id"] == "model/crop/1" and again["message"] == failed["message"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", LLAMA, "--dtypes", "bfloat16"], "a model is checked in float32, float64"),
        (["--model", "no_such_module:Config"], "--model: cannot import module"),
        (["--model", LLAMA, "--model-config", "hidden_size"], "expected KEY=VALUE"),
        (["--model", "transformers:LlamaConfig", "--cases", "fpa/"], "matched no model case"),
        (["--backend", "numpy", "--cache", "x:y"], "need --model"),
        (["--model", LLAMA, "--ops", "fpa_attention"], "--ops selects backend ops"),
    ],
)
def test_model_usage_errors_exit_2_with_a_message(argv, message, capsys):
    assert main(["conformance", *argv]) == 2
    assert message in capsys.readouterr().err


def test_list_prints_the_model_programs(capsys):
    assert main(["conformance", "--model", LLAMA, "--list", "--smoke"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [f"model/{f}/0" for f in FAMILIES]
