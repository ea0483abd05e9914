"""Host reads (device syncs) per pass of the torch ops: the value checks and the packing plan are
read in one device-to-host copy by the custom op, and the kernels read no offsets again.

A host read is counted where the data leaves the tensor: ``tolist``, ``item``, ``bool``,
``int``, ``float``, ``numpy``. On a GPU each is a sync of the stream; on CPU the same calls run,
so the count is the one a GPU run makes.
"""

import collections
import math

import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import (  # noqa: E402
    fox_attention,
    fpa_attention,
    interdomain_legs,
    interdomain_s4d,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "numpy")


class HostReads:
    """Counts the host reads of tensors while active, per phase ("fwd", "bwd")."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.phase = ""
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def read(tensor, *args, **kwargs):
            self.counts[self.phase] += 1
            return original(tensor, *args, **kwargs)

        return read


def _fpa_inputs(T: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, 2, 8, generator=g).requires_grad_() for _ in range(3))
    field = torch.randn(1, T, 2, generator=g).cumsum(1).requires_grad_()
    level = (field.detach() + 0.5).requires_grad_()
    log_f = torch.nn.functional.logsigmoid(torch.randn(1, T, 2, generator=g)).requires_grad_()
    return q, k, v, field, level, log_f


def _step(reads: HostReads, forward):
    reads.phase = "fwd"
    out = forward()
    reads.phase = "bwd"
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    reads.phase = ""
    return dict(reads.counts)


@pytest.mark.parametrize("impl", ["eager", "triton"])
@pytest.mark.parametrize("op", ["fpa", "fox"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_one_host_read_per_pass(monkeypatch, impl, op, packed):
    """Forward: one read (the finite / gate checks, and the offsets when packed). Backward: the
    offsets once when packed, nothing otherwise. (Before the plan was passed on: forward 2
    and 4, backward 0 and 2.)"""
    if impl == "triton":
        pytest.importorskip("triton")
    T = 24
    q, k, v, field, level, log_f = _fpa_inputs(T)
    cu = torch.tensor([0, 7, 7, T]) if packed else None  # a zero-length sequence among them
    reads = HostReads(monkeypatch)
    if op == "fpa":
        counts = _step(
            reads, lambda: fpa_attention(q, k, v, field, level, cu_seqlens=cu, impl=impl)
        )
    else:
        counts = _step(reads, lambda: fox_attention(q, k, v, log_f, cu_seqlens=cu, impl=impl))
    assert counts == ({"fwd": 1, "bwd": 1} if packed else {"fwd": 1}), counts


def test_interdomain_ops_read_once_per_pass(monkeypatch):
    """The Triton path (the eager twin also checks the ratio readout's denominator, once per
    sequence). S4D: the finite checks of lam, b, c, the decay check and the offsets in one read
    per pass; LegS: the offsets once per pass."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    T, H, M = 12, 2, 3
    fq, kt, vt = (torch.randn(1, T, H, 4, generator=g).requires_grad_() for _ in range(3))
    lam = torch.polar(torch.full((H, M), 0.9), torch.rand(H, M, generator=g) * math.pi)
    b = torch.ones(H, M, dtype=torch.complex64)
    c = torch.eye(M, dtype=torch.complex64).expand(H, M, M).clone()
    cu = torch.tensor([0, 5, T])
    reads = HostReads(monkeypatch)
    counts = _step(
        reads, lambda: interdomain_s4d(fq, kt, vt, lam, b, c, cu_seqlens=cu, impl="triton")
    )
    assert counts == {"fwd": 1, "bwd": 1}, counts
    reads.counts.clear()
    counts = _step(reads, lambda: interdomain_legs(fq, kt, vt, M, cu_seqlens=cu, impl="triton"))
    assert counts == {"fwd": 1, "bwd": 1}, counts


def test_a_failed_check_still_names_the_argument():
    """The flags are read in one copy; a failing one runs the check that names the argument."""
    q, k, v, field, level, log_f = _fpa_inputs(8)
    bad = level.detach().clone()
    bad[0, 3, 1] = math.nan
    with pytest.raises(ValueError, match=r"level: contains NaN or Inf \(first at index"):
        fpa_attention(q, k, v, field, bad)
    gates = log_f.detach().clone()
    gates[0, 2, 0] = 0.5
    with pytest.raises(ValueError, match=r"log_f: expected log forget gates <= 0, got 0\.5"):
        fox_attention(q, k, v, gates)
    with pytest.raises(ValueError, match="cu_seqlens: expected non-decreasing offsets"):
        fox_attention(q, k, v, log_f, cu_seqlens=torch.tensor([0, 5, 3, 8]))
