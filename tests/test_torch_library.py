"""torch.library registration: opcheck of every custom op (schema, fake tensors, autograd
registration, AOT dispatch) and a model with both layers compiled with fullgraph=True."""

import pytest

torch = pytest.importorskip("torch")

from attnspec.backends.torch import FirstPassageAttention, InterdomainAttention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def randn(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype, generator=GEN).requires_grad_(grad)


GEN = torch.Generator().manual_seed(0)
OFFSETS = torch.tensor([0, 4, 5, 11])


def fpa_args(grad=True, dtype=torch.float64):
    q, k, v = randn(1, 11, 4, 3, dtype=dtype, grad=grad), randn(1, 11, 2, 3), randn(1, 11, 2, 2)
    field = randn(1, 11, 4, grad=False).cumsum(1).requires_grad_(grad)
    level = (field.detach() + randn(1, 11, 4, grad=False)).requires_grad_(grad)
    return q, k.to(dtype).requires_grad_(grad), v.to(dtype).requires_grad_(grad), field, level


def s4d_params(M=3, H=2):
    lam = torch.polar(
        torch.full((H, M), 0.9, dtype=torch.float64),
        torch.rand(H, M, generator=GEN, dtype=torch.float64),
    )
    pairs = [torch.view_as_real(lam), randn(H, M, 2, grad=False), randn(H, M, M, 2, grad=False)]
    return [p.detach().clone().requires_grad_() for p in pairs]


def forward_ops():
    q, k, v, field, level = fpa_args()
    log_f = (-field.detach().abs()).requires_grad_()
    fq, kt, vt = randn(1, 11, 2, 3), randn(1, 11, 2, 3), randn(1, 11, 2, 2)
    positive = [(x.detach().abs() + 0.1).requires_grad_() for x in (fq, kt)]
    state = randn(3, 2, 3, 5, 2)
    single = fpa_args(dtype=torch.float32)
    ops = torch.ops.attnspec
    s4d = (fq, kt, vt, *s4d_params(), "linear", OFFSETS, state, "eager")
    ratio = (*positive, vt, *s4d_params(), "ratio", None, None, "eager")
    return [
        pytest.param(ops.fpa_fwd.default, (q, k, v, field, level, 0.5, OFFSETS, "eager"), id="fpa"),
        pytest.param(ops.fpa_fwd.default, (*single, 0.5, None, "eager"), id="fpa-float32"),
        pytest.param(ops.fox_fwd.default, (q, k, v, log_f, 0.5, OFFSETS, "eager"), id="fox"),
        pytest.param(ops.s4d_fwd.default, s4d, id="s4d"),
        pytest.param(ops.s4d_fwd.default, ratio, id="s4d-ratio"),
        pytest.param(ops.legs_fwd.default, (*positive, vt, 4, OFFSETS, "eager"), id="legs"),
    ]


def backward_ops():
    q, k, v, field, level = fpa_args(grad=False)
    o, lse, do = (randn(*shape, grad=False) for shape in [(1, 11, 4, 2), (1, 11, 4), (1, 11, 4, 2)])
    fq, kt, vt = randn(1, 11, 2, 3, grad=False), randn(1, 11, 2, 3, grad=False), do[:, :, :2]
    params = [p.detach() for p in s4d_params()]
    ops = torch.ops.attnspec
    fpa = (q, k, v, field, level, o, lse, do, lse, 0.5, OFFSETS, "eager")
    fox = (q, k, v, -field.abs(), o, lse, do, None, 0.5, None, "eager")
    s4d = (fq, kt, vt, *params, "linear", None, None, vt, None, [], "eager")
    legs = (fq.abs(), kt.abs(), vt, 4, OFFSETS, vt, "eager")
    return [
        pytest.param(ops.fpa_bwd.default, fpa, id="fpa"),
        pytest.param(ops.fox_bwd.default, fox, id="fox"),
        pytest.param(ops.s4d_bwd.default, s4d, id="s4d"),
        pytest.param(ops.legs_bwd.default, legs, id="legs"),
    ]


@pytest.mark.parametrize(("op", "args"), forward_ops())
def test_opcheck_forward_ops(op, args):
    torch.library.opcheck(op, args)


@pytest.mark.parametrize(("op", "args"), backward_ops())
def test_opcheck_backward_ops(op, args):
    torch.library.opcheck(op, args)


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fpa = FirstPassageAttention(16, 2, 4)
        self.interdomain = InterdomainAttention(16, 2, 4, n_modes=4)

    def forward(self, x):
        x = x + self.fpa(x)
        return x + self.interdomain(x)


def test_a_model_with_both_layers_compiles_without_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    model = TwoLayers()
    # fullgraph: any graph break is an error. aot_eager traces the whole graph through
    # dynamo and AOTAutograd (the ops' fakes and autograd formulas) without inductor's C++
    # build, which alone takes most of a minute on two cores.
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (13, 29):  # the second length reuses the graph: no recompilation
        x = torch.randn(2, T, 16)
        with torch.compiler.set_stance("fail_on_recompile" if T == 29 else "default"):
            y = compiled(x)
        y.square().sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        model.zero_grad()
        y_eager = model(x)
        y_eager.square().sum().backward()
        assert torch.allclose(y, y_eager, rtol=1e-5, atol=1e-5)
        for name, p in model.named_parameters():
            assert torch.allclose(grads[name], p.grad, rtol=1e-4, atol=1e-6), name
        model.zero_grad()
