"""docs/examples/serving.py (shown in docs/fpa.md's serving section): the paged session's
outputs on ragged, left-padded rows equal the layer on each row alone, the parallel forward
without eviction and the single-stream (F7) cache stepped token by token at a finite theta,
which keeps fewer keys than it has seen; rollback and select leave the counts they promise."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "docs", "examples", "serving.py")


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("serving_example", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("theta", [math.inf, 2.0])
def test_each_row_equals_the_layer_on_that_row_alone(example, theta):
    run = example.serve(theta=theta)
    layer = run["layer"]
    assert not run["absent"].any()
    for x, y in zip(run["x"], run["y"], strict=True):
        with torch.no_grad():
            if math.isinf(theta):
                want = layer(x[None])[0]
            else:
                cache = layer.new_cache(theta=theta)
                want = torch.cat([layer.step(x[None, t], cache) for t in range(x.shape[0])])
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    if math.isinf(theta):
        assert bool((run["kept"] == 1).all())
    else:
        assert float(run["kept"].min()) < 1.0  # keys were evicted
    assert run["session"].counts()["tokens"].tolist() == [11, 11]  # row 1's 3 + 8, twice


def test_the_serving_section_shows_the_example():
    page = open(os.path.join(ROOT, "docs", "fpa.md")).read()
    serving = page[page.index("### Serving") : page.index("## The layer")]
    assert '--8<-- "docs/examples/serving.py:session"' in serving


def test_the_script_prints_counts_and_bytes():
    done = subprocess.run(
        [sys.executable, PATH], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert re.search(r"^tokens \[14, 11\] kept per head \[\[", done.stdout, re.M), done.stdout
    assert re.search(r"^bytes held in pages \d+$", done.stdout, re.M), done.stdout
    assert "after rollback and select: tokens [11, 11]" in done.stdout
