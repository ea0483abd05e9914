"""The docs stay true to the code: excerpts appear verbatim, and the README example runs."""

import os
import re

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["docs/fpa.md", "docs/interdomain.md"]


def python_blocks(path):
    with open(os.path.join(ROOT, path)) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_code_excerpts_appear_verbatim_in_their_source(page):
    blocks = [b for b in python_blocks(page) if b.startswith("# ")]
    assert blocks
    for block in blocks:
        source, *lines = block.rstrip("\n").split("\n")
        with open(os.path.join(ROOT, source[2:])) as fh:
            text = fh.read()
        assert "\n".join(lines) in text, f"{page}: excerpt not found in {source[2:]}:\n{block}"


def test_readme_example_runs():
    (block,) = python_blocks("README.md")
    namespace = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["o"].shape == (1, 2, 16, 8)
    assert namespace["live"].dtype == np.bool_


def test_spec_copies_match_the_shared_spec():
    shared = os.path.join(os.path.dirname(ROOT), "shared", "spec")
    if not os.path.isdir(shared):
        pytest.skip("no ../shared/spec beside this checkout")
    for name in os.listdir(shared):
        with (
            open(os.path.join(shared, name)) as a,
            open(os.path.join(ROOT, "docs/spec", name)) as b,
        ):
            assert a.read() == b.read(), f"docs/spec/{name} differs from ../shared/spec/{name}"
