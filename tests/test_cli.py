"""The ``attnspec`` command as a user meets it: load errors, usage errors, help, version, pipes.

Where a real process matters (tracebacks printed by the interpreter, a closed pipe) the command
runs as a subprocess; elsewhere ``main`` is called in-process.
"""

import os
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

from attnspec.cli import main
from attnspec.conformance.cli import BROKEN_PIPE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "docs", "examples", "minimal_backend.py")
HALF_ONLY = """
class HalfOnly:
    name = "half-only"
    dtypes = ("float16", "bfloat16")

    def __init__(self, device="cpu"):
        pass

    def capabilities(self):
        return set()

    def asarray(self, x, dtype):
        return x

    def to_numpy(self, x):
        return x

    def vjp(self, op, inputs, params, cotangents):
        return {}
"""
BROKEN = {
    "syntax error": (
        "class Mine:\n    def capabilities(self)\n        return set()\n",
        "failed to load: SyntaxError: expected ':' (",
    ),
    "raises on import": (
        "raise RuntimeError('no device found\\nsee the log')\n",
        "failed to load: RuntimeError: no device found see the log",
    ),
    "constructor without device": (
        "class Mine:\n    def __init__(self):\n        pass\n",
        "TypeError: Mine.__init__() got an unexpected keyword argument 'device' (a backend "
        "class or factory is called with device=...)",
    ),
    "incomplete protocol": (
        "class Mine:\n    name = 'mine'\n    dtypes = ('float64',)\n"
        "    def __init__(self, device='cpu'):\n        pass\n",
        "lacks capabilities, asarray, to_numpy, vjp of the protocol",
    ),
    "unknown dtype name": (
        HALF_ONLY.replace("class HalfOnly", "class Mine").replace('"bfloat16"', '"fp32"'),
        "declares dtypes ('float16', 'fp32'); expected a non-empty tuple of float64",
    ),
    "missing attribute": ("class Other:\n    pass\n", "has no attribute 'Mine'"),
}


def run_cli(*argv):
    """The installed command in a fresh interpreter: (status, stdout, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "attnspec.conformance", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_backend_that_fails_to_load_is_one_line_and_exit_2(kind, tmp_path, capsys):
    source, message = BROKEN[kind]
    path = tmp_path / f"{kind.replace(' ', '_')}.py"
    path.write_text(source)
    assert main(["conformance", "--backend", f"{path}:Mine"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("attnspec conformance: "), err
    assert message in err


def test_a_module_that_raises_on_import(tmp_path, monkeypatch, capsys):
    (tmp_path / "attnspec_test_raising_backend.py").write_text("import no_such_dependency\n")
    (tmp_path / "attnspec_test_failing_backend.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["conformance", "--backend", "attnspec_test_raising_backend:B"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No module named 'no_such_dependency'" in err
    assert main(["conformance", "--backend", "attnspec_test_failing_backend:B"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "failed to load: ZeroDivisionError: division by zero" in err


def test_no_traceback_from_a_real_process(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(BROKEN["syntax error"][0])
    status, out, err = run_cli("--backend", f"{path}:Mine")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"SyntaxError: expected ':' ({path}, line 2)" in err


def test_every_backend_of_a_list_is_checked_before_any_runs(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text(BROKEN["syntax error"][0])
    cases = ["--cases", "fox/shapes/0", "--no-gradients"]
    for names in (f"numpy,{bad}:Mine", f"numpy,nosuch,{EXAMPLE}:MinimalFoX"):
        assert main(["conformance", "--backend", names, *cases]) == 2
        out, err = capsys.readouterr()
        assert out == ""  # numpy, first in the list and fine, did not run
        assert err.count("\n") == 1
    assert main(["conformance", "--backend", f"nosuch,{bad}:Mine", *cases]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "unknown name 'nosuch'" in err[0] and "SyntaxError" in err[1]
    assert main(["conformance", "--backend", f"numpy, {EXAMPLE}:MinimalFoX", *cases]) == 0
    out = capsys.readouterr().out
    assert out.count("passed, 0 failed") == 2


def test_an_undeclared_dtype_is_a_usage_error(tmp_path, capsys):
    # Before: every case came back "not implemented" and the run was green.
    assert main(["conformance", "--backend", "numpy", "--dtypes", "float64", "bfloat16"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "attnspec conformance: --dtypes bfloat16: backend 'numpy' declares only "
        "float64, float32, float16\n"
    )
    half = tmp_path / "half.py"
    half.write_text(HALF_ONLY)
    assert main(["conformance", "--backend", f"{half}:HalfOnly", "--dtypes", "float32"]) == 2
    assert "declares only float16, bfloat16" in capsys.readouterr().err
    args = ["--cases", "fox/shapes/0", "--no-gradients", "--dtypes", "float16"]
    assert main(["conformance", "--backend", "numpy", *args]) == 0


def test_a_bad_skip_file_is_not_called_a_load_failure(tmp_path, capsys):
    skips = tmp_path / "skips.txt"
    skips.write_text("fox/shapes\n")
    assert main(["conformance", "--backend", "numpy", "--skips", str(skips)]) == 2
    err = capsys.readouterr().err
    assert "needs a reason" in err and "failed to load" not in err


def test_version_comes_from_the_package_metadata(capsys):
    version = metadata.version("attnspec")
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"attnspec {version}\n"
    with pytest.raises(SystemExit) as exit_:
        main(["conformance", "--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"attnspec {version}\n"
    assert run_cli("--version") == (0, f"attnspec {version}\n", "")
    import attnspec

    assert attnspec.__version__ == version
    module = subprocess.run(
        [sys.executable, "-m", "attnspec", "--version"], capture_output=True, text=True
    )
    assert (module.returncode, module.stdout) == (0, f"attnspec {version}\n")


def test_a_missing_framework_names_the_install_that_works(monkeypatch):
    """attnspec is not on a package index: the hint is the checkout's extra."""
    from attnspec.conformance import registry

    real = registry.importlib.util.find_spec
    monkeypatch.setattr(
        registry.importlib.util, "find_spec", lambda n: None if n == "jax" else real(n)
    )
    with pytest.raises(ImportError) as missing:
        registry.get_backend("pallas")
    message = str(missing.value)
    assert "pip install '.[jax]'" in message and "pip install jax" in message
    assert "attnspec[" not in message


def test_the_smoke_subset_is_the_first_case_of_every_family(capsys):
    from attnspec.conformance.cases import FAMILIES

    assert main(["conformance", "--backend", "numpy", "--list", "--smoke"]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    families = [(op, name) for op, fam in FAMILIES.items() for name in fam]
    assert len(ids) == len(families) and all(i.endswith("/0") for i in ids)
    assert len({i.rsplit("/", 1)[0] for i in ids}) == len(ids)


def test_a_smoke_run_says_so_and_uses_float32_and_bfloat16(tmp_path, capsys):
    mine = tmp_path / "mine.py"
    mine.write_text(HALF_ONLY.replace('("float16", "bfloat16")', '("float32", "bfloat16")'))
    args = ["--backend", f"{mine}:HalfOnly", "--smoke", "--ops", "fox_attention"]
    assert main(["conformance", *args]) == 0
    out = capsys.readouterr().out
    assert "note: smoke subset:" in out and "the full run drops --smoke" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("fox_attention ")]
    assert {row[1] for row in rows} == {"float32", "bfloat16"}


def test_verify_gives_interpreted_kernels_the_smoke_subset(monkeypatch):
    from attnspec.conformance import cli

    monkeypatch.setattr(cli, "native_device", lambda name: "cpu")
    names = ["numpy", "torch", "triton", "jax", "pallas", "mosaic"]
    jobs, partial = cli.verify_jobs(names, full=False, cases=None, env={})
    assert partial == ["triton", "jax", "pallas", "mosaic"]
    plan = [(job.label, job.scope, " ".join(job.argv).partition("--device cpu")[2]) for job in jobs]
    assert plan == [
        ("theory", "every check", ""),
        ("numpy on cpu", "full kit", ""),
        ("torch on cpu", "full kit", ""),
        ("triton on cpu", "smoke subset, interpreted", " --smoke --no-unclaimed"),
        ("jax on cpu", "full kit in float32", " --dtypes float32"),
        ("jax on cpu", "smoke, float64 bfloat16", " --smoke --dtypes float64 bfloat16"),
        ("pallas on cpu", "smoke subset, interpreted", " --smoke --no-unclaimed"),
        ("mosaic on cpu", "smoke subset, interpreted", " --smoke --no-unclaimed"),
    ]
    assert {job.env.get("XLA_FLAGS") for job in jobs} == {None, cli.QUICK_XLA}
    jobs, partial = cli.verify_jobs(names, full=True, cases=None, env={})
    assert partial == [] and not any("--smoke" in job.argv for job in jobs)
    assert [job.argv[-1] for job in jobs[1:]] == ["cpu"] * 6  # every dtype, every case
    monkeypatch.setattr(cli, "native_device", lambda name: "cuda")
    jobs, partial = cli.verify_jobs(["triton"], full=False, cases=None, env={})
    assert partial == [] and jobs[1].scope == "full kit" and "cuda" in jobs[1].argv


def test_verify_runs_the_theory_and_the_kit_and_summarises(capsys):
    assert main(["verify", "--backend", "numpy", "--cases", "fox/shapes/0", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "==== numpy on cpu (full kit): passed" in out
    assert "==== theory (every check): passed" in out
    summary = out.split("==== summary:")[1]
    assert "numpy on cpu" in summary and "theory" in summary and "smoke" not in summary


def help_text(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines at the terminal


def test_help_explains_the_backend_forms_and_the_vectors_arguments(capsys):
    conformance = help_text(["conformance"], capsys)
    for form in ("a registered name", "package.module:attribute", "path/to/file.py:attribute"):
        assert form in conformance
    assert "comma-separated; all are loaded and checked before any runs" in conformance
    assert "each one the backend declares" in conformance
    export = help_text(["vectors", "export"], capsys)
    assert "DIR directory to write into" in export
    assert "inputs are rounded to each" in export
    check = help_text(["vectors", "check"], capsys)
    assert "DIR a directory written by 'export'" in check
    assert "--results RESULTS directory of result .npz files" in check
    assert "out.<name>" in check
    assert "docs/vectors.md" in help_text(["vectors"], capsys)


def test_output_piped_to_head_has_no_broken_pipe_traceback():
    command = textwrap.dedent(
        f"""\
        set -o pipefail
        "{sys.executable}" -m attnspec.conformance --backend numpy --list | head -1
        """
    )
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("fpa/shapes/0 ") and done.stdout.count("\n") == 1
    assert done.stderr == ""
    assert done.returncode in (0, BROKEN_PIPE)  # 0 when head read before the pipe closed


def test_a_reader_that_leaves_before_the_first_line():
    # The pipe is closed before the interpreter has started, so the first write must fail:
    # before the fix this printed a BrokenPipeError traceback.
    entry_point = "import sys; from attnspec.cli import main; sys.exit(main())"
    for argv in (["-m", "attnspec.conformance"], ["-c", entry_point, "conformance"]):
        proc = subprocess.Popen(
            [sys.executable, *argv, "--backend", "numpy", "--list"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == BROKEN_PIPE
        assert err == ""


def test_a_run_into_a_log_reports_progress_by_tenths(capsys):
    # capsys's stderr is not a terminal: one line per tenth, the last at 100%, nothing else.
    args = ["--cases", "fox/shapes", "fox/scale", "--dtypes", "float64", "float32"]
    assert main(["conformance", "--backend", "numpy", *args]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    total = int(lines[-1].split("/")[1].split("]")[0])
    assert len(lines) == min(10, total) and lines[-1].split()[-3] == "100%"
    assert f"{total} passed, 0 failed" in out


def test_quick_xla_flags_by_jaxlib_version():
    """jaxlib 0.11 and later abort on --xla_cpu_use_fusion_emitters: only older ones get it."""
    from attnspec.conformance import cli

    assert cli.quick_xla_flags("0.10.2") == (
        "--xla_cpu_use_fusion_emitters=false --xla_backend_optimization_level=0"
    )
    for version in ("0.11.2", "0.12.0.1", "1.0.0"):
        assert cli.quick_xla_flags(version) == "--xla_backend_optimization_level=0"
