"""Host reads (device syncs) per pass of the torch ops: the value checks and the packing plan are
read in one device-to-host copy by the custom op, and the kernels read no offsets again; with the
value checks off (``value_checks(enabled=False)``) or while a CUDA graph captures, a forward
without cu_seqlens reads nothing, and the paged session's decode step reads nothing at all.

A host read is counted where the data leaves the tensor: ``tolist``, ``item``, ``bool``,
``int``, ``float``, ``numpy``. On a GPU each is a sync of the stream; on CPU the same calls run,
so the count is the one a GPU run makes. A capture is stood in for by making
``checks.capturing`` answer True (no GPU here): that shows what the ops read while capturing,
not that a real capture succeeds.
"""

import collections
import math

import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import (  # noqa: E402
    checks,
    fox_attention,
    fpa_attention,
    interdomain_legs,
    interdomain_s4d,
    value_checks,
)
from attnspec.backends.torch.paged import PagedFPASession  # noqa: E402

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
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_one_host_read_per_pass(monkeypatch, impl, op, packed, checked):
    """Forward: one read (the finite / gate checks, and the offsets when packed); with the value
    checks off, the offsets' read when packed and nothing otherwise. Backward: the offsets once
    when packed, nothing otherwise. (Before the plan was passed on: forward 2 and 4, backward 0
    and 2; before the checks could be off, the dense forward read once whatever was asked.)"""
    if impl == "triton":
        pytest.importorskip("triton")
    T = 24
    q, k, v, field, level, log_f = _fpa_inputs(T)
    cu = torch.tensor([0, 7, 7, T]) if packed else None  # a zero-length sequence among them
    reads = HostReads(monkeypatch)
    with value_checks(enabled=checked):
        if op == "fpa":
            counts = _step(
                reads, lambda: fpa_attention(q, k, v, field, level, cu_seqlens=cu, impl=impl)
            )
        else:
            counts = _step(reads, lambda: fox_attention(q, k, v, log_f, cu_seqlens=cu, impl=impl))
    expected = {"fwd": 1, "bwd": 1} if packed else {"fwd": 1} if checked else {}
    assert counts == expected, counts


def test_while_capturing_a_forward_reads_nothing_and_packed_calls_are_refused(monkeypatch):
    """The value checks are skipped while a CUDA graph captures (a read would end the capture);
    the offsets of packed sequences cannot be, so a packed call says so before reading."""
    q, k, v, field, level, log_f = _fpa_inputs(16)
    bad = level.detach().clone()
    bad[0, 3, 1] = math.nan
    monkeypatch.setattr(checks, "capturing", lambda: True)
    reads = HostReads(monkeypatch)
    reads.phase = "fwd"
    with torch.no_grad():
        fpa_attention(q, k, v, field, bad)  # not refused: nothing is read
        fox_attention(q, k, v, log_f)
    assert dict(reads.counts) == {}
    with pytest.raises(ValueError, match="cu_seqlens: packed sequences are planned from their"):
        fpa_attention(q, k, v, field, level, cu_seqlens=torch.tensor([0, 5, 16]))


def test_value_checks_off_and_on_again():
    """value_checks(enabled=False) lets bad values through (as SDPA does), then restores."""
    q, k, v, field, level, _ = _fpa_inputs(8)
    bad = level.detach().clone()
    bad[0, 3, 1] = math.nan
    with value_checks(enabled=False):
        assert torch.isnan(fpa_attention(q, k, v, field, bad)).any()
    with pytest.raises(ValueError, match="level: contains NaN"):
        fpa_attention(q, k, v, field, bad)
    with pytest.raises(ValueError, match="enabled: expected True or False, got 1"):
        checks.set_value_checks(enabled=1)


def _session_and_tokens(steps: int):
    g = torch.Generator().manual_seed(2)
    R, HQ, H, d, T = 2, 4, 2, 8, 20
    s = PagedFPASession(rows=R, heads=HQ, kv_heads=H, dk=d, dv=d, dtype=torch.float32,
                        scale=0.3, theta=1.0, max_rollback=2)  # fmt: skip

    def tokens(n):
        field = torch.randn(R, HQ, n, generator=g).cumsum(2)
        rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        return {"q": rand(R, HQ, n, d), "k": rand(R, H, n, d), "v": rand(R, H, n, d),
                "field": field, "level": field + torch.rand(R, HQ, n, generator=g)}  # fmt: skip

    s.prefill_state(tokens(T))
    return s, [tokens(1) for _ in range(steps)]


def test_the_paged_decode_step_reads_nothing(monkeypatch):
    """decode_step: no host read. decode: the value checks in one read (none with them off),
    and a reservation (host side) every decode_reserve tokens. advance plans on the host at
    every token: 9 reads a token at theta = inf, 11 to 17 with evictions (the checks, the pages
    to allocate, the release and the compaction; 10 and 12 to 18 before the two checks shared
    one read)."""
    s, steps = _session_and_tokens(9)
    s.decode_reserve = 4
    s.reserve(4)
    reads = HostReads(monkeypatch)
    reads.phase = "step"
    for x in steps[:4]:
        s._reserved -= 1
        s.decode_step(x["q"], x["k"], x["v"], x["field"], x["level"])
    assert dict(reads.counts) == {}
    reads.phase = "decode"
    s.decode(steps[4])  # a reservation, then the step
    reserve = reads.counts.pop("decode") - 1
    assert reserve > 0
    s.decode(steps[5])
    with value_checks(enabled=False):
        s.decode(steps[6])
    assert dict(reads.counts) == {"decode": 1}
    reads.counts.clear()
    reads.phase = "advance"
    s.advance(steps[7], torch.ones(2, 1, dtype=torch.bool))
    assert reads.counts["advance"] >= 9


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
