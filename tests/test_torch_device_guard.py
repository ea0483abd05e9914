"""The device guard of the Triton launches (issue 55, defect 8): a Triton launch goes to the
current CUDA device, so tensors on cuda:1 launched while cuda:0 is current would run on the
wrong GPU; every registered Triton kernel and the paged decode kernel run inside
``torch.cuda.device(<their tensors' device>)``.

No GPU here: ``torch.cuda.device`` is replaced by a recorder and a tensor reports cuda:1. What
these tests show: the guard is entered with the tensors' device, around the launch, by every
path that launches a Triton kernel. What they cannot show: that a launch inside
``torch.cuda.device(1)`` runs on the second GPU (that is Triton's and torch's behaviour, and
needs two GPUs to watch).
"""

import contextlib

import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import devices, dispatch, fpa_attention  # noqa: E402


class Recorder:
    """Stands in for torch.cuda.device: records the device entered and which one is current."""

    def __init__(self):
        self.entered, self.current = [], None

    def __call__(self, device):
        @contextlib.contextmanager
        def enter():
            before, self.current = self.current, torch.device(device)
            self.entered.append(self.current)
            try:
                yield
            finally:
                self.current = before

        return enter()


class OnSecondGPU(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_guard_enters_the_cuda_device_and_nothing_else(monkeypatch):
    recorder = Recorder()
    monkeypatch.setattr(torch.cuda, "device", recorder)
    with devices.guard(torch.device("cuda", 1)):
        assert recorder.current == torch.device("cuda", 1)
    assert recorder.current is None
    with devices.guard(torch.device("cpu")), devices.guard(torch.device("meta")):
        pass
    assert recorder.entered == [torch.device("cuda", 1)]


def test_a_registered_triton_kernel_runs_inside_its_tensors_device(monkeypatch):
    """dispatch wraps every "triton" registration: the kernel runs with the device of its first
    tensor current (the eager twins need no guard: torch ops follow their tensors)."""
    recorder = Recorder()
    monkeypatch.setattr(torch.cuda, "device", recorder)
    registry = {name: dict(impls) for name, impls in dispatch._REGISTRY.items()}
    monkeypatch.setattr(dispatch, "_REGISTRY", registry)
    seen = []

    @dispatch.register("fpa_fwd", "triton")
    def kernel(q, *args):
        seen.append(recorder.current)
        return q

    q = torch.zeros(2).as_subclass(OnSecondGPU)
    dispatch.lookup("fpa_fwd", "triton")(3, q, torch.zeros(1))  # the first tensor's device
    assert seen == [torch.device("cuda", 1)]
    assert recorder.current is None  # restored
    assert dispatch.lookup("fpa_fwd", "eager") is registry["fpa_fwd"]["eager"]


def test_every_triton_kernel_of_the_ops_is_guarded(monkeypatch):
    """The Triton modules' registrations all go through the guard, and an op call enters it
    with its tensors' device (CPU tensors here: the interpreter)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnspec.backends.torch import ops

    ops.load_triton_kernels()
    triton = {k: i["triton"] for k, i in dispatch._REGISTRY.items() if "triton" in i}
    assert set(triton) >= {"fpa_fwd", "fpa_bwd", "fox_fwd", "fox_bwd", "s4d_fwd", "legs_fwd"}
    assert all(getattr(fn, "__wrapped__", None) is not None for fn in triton.values())
    entered = []
    real = devices.guard

    def spy(device):
        entered.append(device)
        return real(device)

    monkeypatch.setattr(devices, "guard", spy)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g) for _ in range(3))
    field = torch.randn(1, 8, 2, generator=g).cumsum(1)
    fpa_attention(q, k, v, field, field + 1.0, impl="triton")
    assert entered == [torch.device("cpu")]


def test_the_paged_decode_kernel_is_guarded(monkeypatch):
    """The session enters the guard around its attention (advance) and the custom op of the
    compiled decode step around the Triton kernel."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from attnspec.backends.torch.paged import PagedFPASession
    from attnspec.backends.torch.triton_decode import paged_attention_triton

    entered = []
    real = devices.guard
    monkeypatch.setattr(devices, "guard", lambda d: entered.append(d) or real(d))
    s = PagedFPASession(rows=1, heads=2, kv_heads=1, dk=16, dv=16, dtype=torch.float32,
                        scale=0.25, attention=paged_attention_triton)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    x = {"q": torch.randn(1, 2, 1, 16, generator=g), "k": torch.randn(1, 1, 1, 16, generator=g),
         "v": torch.randn(1, 1, 1, 16, generator=g), "field": torch.zeros(1, 2, 1),
         "level": torch.zeros(1, 2, 1)}  # fmt: skip
    s.advance(x, torch.ones(1, 1, dtype=torch.bool))
    s.decode(x)
    assert entered == [torch.device("cpu")] * 2
