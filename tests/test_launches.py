"""The launch capture of the static Hopper gates (bench/launches.py) on every Triton launcher of
the torch backend: each launch passes its kernel exactly the parameters the kernel declares."""

import importlib
import inspect
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnspec.backends.torch import triton_decode, triton_fpa  # noqa: E402
from bench import gpu_static_interdomain, launches  # noqa: E402

MODULES = [
    importlib.import_module(f"attnspec.backends.torch.{p.stem}")
    for p in sorted((ROOT / "backends" / "torch").glob("triton_*.py"))
]


def launched(module: object) -> set[str]:
    """The kernels a module launches: ``kernel[grid](...)`` in its source."""
    names = re.findall(r"\b(\w+)\[", inspect.getsource(module))
    return {n for n in names if hasattr(getattr(module, n, None), "run")}


def every_launch() -> list[launches.Captured]:
    """The launches of the FPA and FoX forward and backward, the paged decode (tiny shapes), and
    of the S4D and LegS launchers as the Interdomain gate captures them (forward, backward,
    steps)."""
    q, k, v, o, do = (torch.zeros(1, 64, 2, 16) for _ in range(5))
    field, level, lse = (torch.zeros(1, 64, 2) for _ in range(3))
    R, HQ, H, D, NT, P = 1, 2, 1, 16, 2, 16
    with launches.capture() as out:
        for forward, backward, scalars in (
            (triton_fpa.fpa_fwd, triton_fpa.fpa_bwd, (field, level)),
            (triton_fpa.fox_fwd, triton_fpa.fox_bwd, (field,)),
        ):
            forward(q, k, v, *scalars, None, None)
            backward(q, k, v, *scalars, o, lse, do, None, None, None)
        wide = torch.zeros(R, HQ, NT * P)
        triton_decode.paged_attention_triton(
            torch.zeros(R, HQ, 1, D),
            torch.zeros(R * H * NT, P, D),
            torch.zeros(R * H * NT, P, D),
            torch.arange(R * H * NT).view(R, H, NT),
            torch.arange(NT * P).expand(R, H, NT * P).contiguous(),
            wide,
            wide,
            torch.zeros(R, HQ, NT * P, dtype=torch.int64),
            torch.full((R, 1), NT * P - 1),
            torch.zeros(R, HQ, 1),
            D**-0.5,
        )
    return out + gpu_static_interdomain.ours()


def test_every_launch_binds_exactly_the_parameters_of_its_kernel():
    """At a GPU launch Triton raises KeyError for a keyword that is neither a parameter of the
    kernel nor a launch option; its interpreter accepts one, so the kit cannot see it. The
    capture raises as the GPU does: every launch of every launcher binds exactly its kernel's
    parameters, and every kernel that a backends/torch/triton_*.py module launches is among
    them."""
    captured = every_launch()
    for c in captured:
        declared = inspect.signature(c.fn.fn).parameters
        assert set(c.args) == set(declared), (c.name, set(c.args) ^ set(declared))
    expected = set().union(*(launched(m) for m in MODULES))
    assert {"_fwd_kernel", "_paged_decode_kernel", "_s4d_bwd_inputs", "_legs_step"} <= expected
    missing = expected - {c.name for c in captured}
    assert not missing, f"launched by no call of every_launch(): {sorted(missing)}"


def test_the_capture_raises_for_a_keyword_the_kernel_does_not_declare():
    """The failure the test above relies on, planted: a diagonal step passed to the delta pass
    (which declares none) raises; a launch option is taken."""
    o, delta = torch.zeros(16, 16), torch.zeros(16)
    args = dict(o=o, do=o, dlse=None, delta=delta, N_TOK=16, HQ=1, V=16, BLOCK=16, BV=16)
    with launches.capture() as out:
        triton_fpa._delta_kernel[(1, 1)](**args, HAS_DLSE=False, num_warps=2)
    assert (out[0].num_warps, out[0].num_stages, out[0].args["HAS_DLSE"]) == (2, 3, False)
    with pytest.raises(KeyError, match="_delta_kernel: keyword argument BDQ"), launches.capture():
        triton_fpa._delta_kernel[(1, 1)](**args, HAS_DLSE=False, BDQ=16)
