"""bench/matrix.py: the newest leg installs from the package index alone (no pip configuration
file, constraint, find-links or extra index of the machine reaches it), is never reused, and
reports the versions it resolved."""

import os
import subprocess
import sys

from bench import matrix


def test_the_newest_leg_installs_every_user_extra_unpinned():
    (leg,) = [leg for leg in matrix.LEGS if leg.name == "newest"]
    assert leg.pins == () and set(leg.extras.split(",")) >= {"all", "test"}
    ran = " ".join(" ".join(step) for _, step in leg.steps)
    targets = (
        "test_hf_models",
        "test_jax_nnx",
        "test_theory",
        "test_torch_fpa",
        "test_torch_library",
    )
    for target in (f"tests/{name}.py" for name in targets):
        assert target in ran
    assert "--backend numpy,torch,jax" in ran


def test_index_only_env_hides_the_local_pip_configuration(tmp_path, monkeypatch):
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nconstraint = /nowhere/c.txt\nfind-links = /nowhere/wheels\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_CONSTRAINT", "/nowhere/c2.txt")
    monkeypatch.setenv("PIP_FIND_LINKS", "/nowhere/w2")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///nowhere/simple")
    monkeypatch.setenv("PIP_INDEX_URL", "https://index.example/simple")
    env = matrix.index_only_env()
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "nowhere" not in listed, listed
    assert env["PIP_INDEX_URL"] == "https://index.example/simple"  # the index itself is kept
    assert env["PIP_CONFIG_FILE"] == os.devnull


def test_resolved_names_the_python_and_the_main_versions(tmp_path, monkeypatch):
    monkeypatch.setattr(matrix, "BASE", tmp_path)
    (leg,) = [leg for leg in matrix.LEGS if leg.name == "newest"]
    assert matrix.resolved(leg) == ""
    (tmp_path / "newest-versions.txt").write_text(
        "# Python 3.13.0; pip install -e '.[all,bench,test]', 2026-12-07\n"
        "jax==0.12.1\nnumpy==2.5.5\npluggy==1.7.0\ntorch==2.15.0\n"
    )
    assert matrix.resolved(leg) == "Python 3.13.0; resolved torch==2.15.0 jax==0.12.1 numpy==2.5.5"
