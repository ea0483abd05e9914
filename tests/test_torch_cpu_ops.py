"""The aten calls of one eager FoX / FPA forward+backward (issue 40, point 1): each call pays the
dispatcher and, when it parallelises, a wake-up of torch's CPU threads, which on a shared machine
costs more than the arithmetic. Counted with torch.profiler, as bench/cpu_torch.py
--threads-table does; before the backward's products went through bmm (baddbmm_ into a slice ran
one addmm_ per sequence) the counts were 1,701 (FoX) and 2,950 (FPA)."""

import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import fox_attention, fpa_attention  # noqa: E402

T, B, H, D = 512, 1, 2, 64  # bench/cpu_torch.py's shapes


def aten_calls(fn) -> int:
    fn()  # warm-up: first calls initialise
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.name.startswith("aten::") for e in prof.events())


@pytest.mark.parametrize(("op", "most"), [("fox", 1400), ("fpa", 2650)])
def test_one_forward_backward_issues_few_aten_calls(op, most):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=gen).requires_grad_() for _ in range(3))
    field = torch.cumsum(torch.randn(B, T, H, generator=gen), dim=1).requires_grad_()
    level = (field.detach() + torch.randn(B, T, H, generator=gen)).requires_grad_()
    log_f = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen) + 3.0)
    log_f.requires_grad_()
    do = torch.randn(B, T, H, D, generator=gen)
    if op == "fox":
        calls = aten_calls(lambda: fox_attention(q, k, v, log_f).backward(do))
    else:
        calls = aten_calls(lambda: fpa_attention(q, k, v, field, level).backward(do))
    assert calls <= most, calls
