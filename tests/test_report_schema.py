"""The JSON report against its schema (conformance/report-schema.json, docs/report-schema.md), and
the items outside a backend's claims ("unclaimed: passes" / "unclaimed: fails")."""

import copy
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import types
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import attnspec
from attnspec.cli import main
from attnspec.conformance import provenance, report, runner, unclaimed
from attnspec.conformance.tolerances import DTYPES

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads(Path(provenance.SCHEMA_FILE).read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)

# A backend that computes everything right but claims only float64, and no FoX GQA; and one
# that is also wrong in float16, which it does not claim.
BACKENDS = """
import numpy as np
from attnspec.conformance.numpy_backend import NumpyBackend

class Float64Only(NumpyBackend):
    dtypes = ("float64",)

    def capabilities(self):
        return super().capabilities() - {"fox_attention.gqa"}

class WrongInFloat16(Float64Only):
    def to_numpy(self, x):
        y = np.asarray(x)
        return y * 1.5 if y.dtype == np.float16 else y
"""


def run_cli(argv, tmp_path, name="r"):
    js, xml = tmp_path / f"{name}.json", tmp_path / f"{name}.xml"
    status = main(["conformance", *argv, "--json", str(js), "--junit", str(xml)])
    return status, json.loads(js.read_text()), ET.parse(xml).getroot()


@pytest.fixture(scope="module")
def numpy_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    status, data, _ = run_cli(["--backend", "numpy", "--cases", "fox/gqa/", "decode/2"], tmp)
    assert status == 0
    return data


def test_the_schema_is_draft_2020_12_and_names_the_kits_own_values():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    defs = SCHEMA["$defs"]
    assert defs["verdict"]["enum"] == list(report.VERDICTS)
    assert defs["unclaimed_verdict"]["enum"] == list(unclaimed.UNCLAIMED)
    assert defs["dtype"]["enum"] == list(DTYPES)
    assert set(runner.KINDS) < set(defs["kind"]["enum"])
    assert SCHEMA["properties"]["schema_version"]["const"] == provenance.SCHEMA_VERSION
    libraries = SCHEMA["properties"]["libraries"]["required"]
    assert libraries == ["python", *provenance.LIBRARIES]


def test_a_backend_report_validates_and_says_where_and_with_what_it_ran(numpy_report):
    data = numpy_report
    VALIDATOR.validate(data)
    assert data["schema_version"] == 1 and data["kit"]["version"] == attnspec.__version__
    created = datetime.strptime(data["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs((datetime.now(UTC) - created).total_seconds()) < 600
    assert data["libraries"]["numpy"] == np.__version__ and data["machine"]["gpu"] is None
    assert data["claims"]["dtypes"] == ["float64", "float32", "float16"]
    assert {"fox_attention.gqa", "fpa_decode.session", "strided"} <= set(
        data["claims"]["capabilities"]
    )
    assert data["model"] is None
    # the keys the kit wrote before the header, unchanged
    assert data["backend"] == "numpy" and data["device"] == "cpu"
    assert data["versions"]["numpy"] == np.__version__
    assert {c["verdict"] for c in data["cases"]} == {"passed"}


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_commit_is_the_checkouts_and_none_elsewhere(numpy_report, tmp_path):
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True)
    if done.returncode != 0:
        pytest.skip("not run from a git checkout")
    assert numpy_report["kit"]["checkout"]["commit"] == done.stdout.decode().strip()
    assert provenance.kit_commit(str(tmp_path)) is None  # not a checkout
    (tmp_path / "conformance").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    # a checkout of something else that holds a conformance folder, with no commit yet
    assert provenance.kit_commit(str(tmp_path / "conformance")) is None


def test_the_gpu_is_named_by_the_loaded_framework_for_a_gpu_device_only(monkeypatch):
    class Cuda:
        @staticmethod
        def is_available():
            return True

        @staticmethod
        def get_device_name(device):
            return f"Some GPU ({device})"

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=Cuda))
    assert provenance.machine("cuda:1")["gpu"] == "Some GPU (cuda:1)"
    assert provenance.machine("cpu")["gpu"] is None
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    assert provenance.machine("cuda")["gpu"] is None  # nothing loaded to ask: no import


def test_no_git_gives_no_commit_and_no_error(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert provenance.kit_commit() is None


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda d: d.pop("schema_version"), "schema_version"),
        (lambda d: d.update(schema_version=2), "schema_version"),
        (lambda d: d.update(created="2026-12-07 23:30"), "created"),
        (lambda d: d["kit"]["checkout"].update(commit="HEAD"), "commit"),
        (lambda d: d.update(claims=None), "claims"),
        (lambda d: d["libraries"].pop("torch"), "torch"),
        (lambda d: d["cases"][0].update(verdict="unclaimed: passes"), "verdict"),
        (lambda d: d["cases"][0].update(dtype="float8"), "dtype"),
        (lambda d: d["unclaimed"][0].update(verdict="passed"), "verdict"),
        (lambda d: d["summary"][0].pop("failed"), "failed"),
    ],
)
def test_a_report_with_a_missing_or_wrong_field_fails_validation(numpy_report, change, where):
    data = copy.deepcopy(numpy_report)
    if data["kit"]["checkout"] is None:
        data["kit"]["checkout"] = {"commit": "0" * 40, "modified": False}
    VALIDATOR.validate(data)
    change(data)
    with pytest.raises(jsonschema.ValidationError) as error:
        VALIDATOR.validate(data)
    assert where in str(error.value)


def test_a_model_report_validates(tmp_path):
    pytest.importorskip("transformers")
    from test_model_conformance import LLAMA, LLAMA_CONFIG

    from attnspec.conformance.model_loading import format_overrides

    argv = ["--model", LLAMA, "--model-config", *format_overrides(LLAMA_CONFIG)]
    status, data, _ = run_cli([*argv, "--cases", "model/steps/0"], tmp_path)
    assert status == 0
    VALIDATOR.validate(data)
    assert data["claims"] is None and data["unclaimed"] == []
    model = data["model"]
    assert model["spec"] == LLAMA and model["class"].endswith("LlamaForCausalLM")
    assert model["config"] == format_overrides(LLAMA_CONFIG) and model["cache"] is None
    assert data["libraries"]["transformers"] == data["versions"]["transformers"]
    broken = copy.deepcopy(data)
    broken["model"] = None
    with pytest.raises(jsonschema.ValidationError):
        VALIDATOR.validate(broken)


def unclaimed_by(data):
    return {(r["case_id"], r["dtype"], r["kind"]): r for r in data["unclaimed"]}


def test_a_backend_that_passes_where_it_claims_nothing_is_reported_so(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text(BACKENDS)
    cases = ["--cases", "fox/shapes/", "fox/gqa/"]
    status, data, suite = run_cli(["--backend", f"{path}:Float64Only", *cases], tmp_path)
    out = capsys.readouterr().out
    assert status == 0  # the unclaimed failures (bfloat16, tf32) do not count
    VALIDATOR.validate(data)
    assert data["claims"]["dtypes"] == ["float64"]
    assert {c["dtype"] for c in data["cases"]} == {"float64"}
    gqa = [
        c
        for c in data["cases"]
        if c["case_id"].startswith("fox/gqa/") and c["kind"] != "finite_difference"
    ]
    assert gqa and {c["verdict"] for c in gqa} == {"not implemented"}
    items = unclaimed_by(data)
    for dtype in ("float32", "float16"):
        for kind in ("output", "gradient"):
            item = next(r for k, r in items.items() if k[1:] == (dtype, kind))
            assert item["case_id"].startswith("fox/shapes/")
            assert item["verdict"] == "unclaimed: passes", item["message"]
            assert item["message"] == f"not claimed: dtype {dtype}"
            assert item["error"] <= item["tolerance"]  # judged by the table as if claimed
    for dtype in ("bfloat16", "tf32"):  # NumPy has neither
        item = items[("fox/shapes/0", dtype, "output")]
        # NumPy does not understand the dtype, or (once ml_dtypes has registered bfloat16 with
        # NumPy: JAX imports it) the reference refuses it; the message says which dtype
        assert item["verdict"] == "unclaimed: fails"
        assert dtype in item["message"].split(";", 1)[1], item["message"]
    item = items[("fox/gqa/0", "float64", "output")]
    assert item["verdict"] == "unclaimed: passes"
    assert item["message"] == "not claimed: fox_attention.gqa"
    # one item per family, dtype and kind
    families = [(k[0].rpartition("/")[0], k[1], k[2]) for k in items]
    assert len(families) == len(set(families)) == len(data["unclaimed"])
    assert "outside the claims (the first case of each family; not counted" in out
    assert re.search(r"fox_attention +dtype float32 +output +unclaimed: 1 passes\n", out)
    # TypeError: NumPy does not know bfloat16; ValueError: the reference refuses it (ml_dtypes)
    assert re.search(
        r"dtype bfloat16 +output +unclaimed: 1 fails: (TypeError|ValueError) raised", out
    )
    assert re.search(r"fox_attention.gqa +gradient +unclaimed: 1 passes\n", out)
    assert "0 failed" in out and f"{len(items)} outside the claims" in out
    skipped = {
        case.get("name"): case.find("skipped").get("message")
        for case in suite
        if case.get("name").endswith("-unclaimed]")
    }
    assert len(skipped) == len(items) and int(suite.get("failures")) == 0
    assert skipped["fox/gqa/0[float64-output-unclaimed]"].startswith("unclaimed: passes")

    # its repro line reruns it
    words = shlex.split(items[("fox/gqa/0", "float64", "output")]["repro"])
    assert words[:2] == ["attnspec", "conformance"] and "--unclaimed" in words
    status, again, _ = run_cli(words[2:], tmp_path, "again")
    assert status == 0
    assert unclaimed_by(again)[("fox/gqa/0", "float64", "output")]["verdict"] == item["verdict"]

    argv = ["--backend", f"{path}:Float64Only", "--cases", "fox/shapes/", "--no-unclaimed"]
    status, none, suite = run_cli(argv, tmp_path, "off")
    assert status == 0 and none["unclaimed"] == [] and len(suite) == len(none["cases"])


def test_wrong_values_in_an_unclaimed_dtype_are_reported_and_not_counted(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text(BACKENDS)
    argv = ["--backend", f"{path}:WrongInFloat16", "--cases", "fox/shapes/", "--no-gradients"]
    status, data, _ = run_cli(argv, tmp_path)
    assert status == 0 and {c["verdict"] for c in data["cases"]} == {"passed"}
    items = unclaimed_by(data)
    wrong = items[("fox/shapes/0", "float16", "output")]
    assert wrong["verdict"] == "unclaimed: fails" and "rel " in wrong["message"]
    assert not math.isnan(wrong["error"]) and wrong["error"] > wrong["tolerance"]
    assert items[("fox/shapes/0", "float32", "output")]["verdict"] == "unclaimed: passes"
    assert "unclaimed: 1 fails: o: rel" in capsys.readouterr().out


def test_an_item_outside_the_claims_runs_on_a_copy_that_claims_it():
    from attnspec.conformance.numpy_backend import NumpyBackend

    class PerObject(NumpyBackend):  # dtypes set per object, as the Triton backend does
        def __init__(self):
            super().__init__()
            self.dtypes = ("float64",)

    class Computed(NumpyBackend):  # dtypes a property: a proxy claims for it
        @property
        def dtypes(self):
            return ("float64",)

    for backend in (PerObject(), Computed()):
        copy_ = unclaimed.claiming(backend, "float32", {"fox_attention.extra"})
        assert copy_.dtypes == ("float64", "float32")
        assert "fox_attention.extra" in copy_.capabilities()
        assert (
            backend.dtypes == ("float64",) and "fox_attention.extra" not in backend.capabilities()
        )
        assert copy_.fox_attention.__func__ is NumpyBackend.fox_attention
    assert type(unclaimed.claiming(PerObject(), "float32", ())).__qualname__.endswith("PerObject")
    assert isinstance(unclaimed.claiming(Computed(), "float32", ()), unclaimed.Claiming)
