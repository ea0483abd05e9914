"""The window of (F3w) in the torch ops: the eager tiles against the reference (tiles outside
the window skipped, partly covered ones masked), flash-linear-attention's call shape
(q, k, v, g, scale, window_size, cu_seqlens), and fla's naive FoX with a window."""

import numpy as np
import pytest
from drawers import attention, gated, to_ref, to_torch

torch = pytest.importorskip("torch")

from attnspec.backends.torch import eager_fpa, fox_attention, fpa_attention  # noqa: E402
from attnspec.conformance.metrics import relative_error  # noqa: E402
from attnspec.conformance.numpy_backend import NumpyBackend  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUMPY = NumpyBackend()

# (B, T, HQ, H, K, V), window, block, key_block, cu_seqlens
WINDOWED = [
    ((2, 37, 2, 2, 8, 5), 1, 8, 5, None),  # W = 1: the diagonal only
    ((2, 37, 2, 2, 8, 5), 6, 8, 5, None),  # W inside a tile
    ((1, 41, 4, 2, 6, 7), 11, 6, 4, None),  # W across tile borders, GQA 4/2
    ((1, 40, 2, 2, 5, 4), 9, 4, 3, (0, 15, 16, 40)),  # varlen, a length-1 segment
    ((1, 23, 2, 1, 3, 2), 40, 8, None, None),  # W >= T: no pair outside
]


@pytest.mark.parametrize(("shape", "window", "block", "key_block", "cu"), WINDOWED)
def test_windowed_fpa_tiles_match_the_reference(shape, window, block, key_block, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + window)
    q, k, v, f, lev = attention(rng, B, T, HQ, H, K, V)
    do, dlse = rng.standard_normal((B, HQ, T, V)), rng.standard_normal((B, HQ, T))
    inputs = {"q": q, "k": k, "v": v, "field": f, "level": lev}
    params = {"scale": 0.7, "cu_seqlens": cu, "window": window}
    o_ref, lse_ref = NUMPY.fpa_attention(**inputs, **params, return_lse=True)
    g_ref = NUMPY.vjp("fpa_attention", inputs, params, {"o": do, "lse": dlse})
    args = [to_torch(x) for x in inputs.values()]
    offsets = None if cu is None else Packing(tuple(cu))
    tiles = dict(block=block, key_block=key_block, window=window)
    o, lse = eager_fpa.fpa_fwd(*args, 0.7, offsets, **tiles)
    grads = eager_fpa.fpa_bwd(*args, o, lse, to_torch(do), to_torch(dlse), 0.7, offsets, **tiles)
    assert relative_error(to_ref(o), o_ref) < 1e-13
    assert relative_error(to_ref(lse), lse_ref) < 1e-13
    for name, got in zip(inputs, grads, strict=True):
        want = g_ref[name]
        if not want.any():  # W = 1: no pair off the diagonal, no field or level gradient
            assert not to_ref(got).any(), name
        else:
            assert relative_error(to_ref(got), want) < 1e-12, name


@pytest.mark.parametrize(("shape", "window", "block", "key_block", "cu"), WINDOWED[1:])
def test_windowed_fox_tiles_match_the_reference(shape, window, block, key_block, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + window)
    q, k, v, log_f = gated(rng, B, T, HQ, H, K, V, unit=0.3)
    do = rng.standard_normal((B, HQ, T, V))
    inputs = {"q": q, "k": k, "v": v, "log_f": log_f}
    params = {"cu_seqlens": cu, "window": window}
    o_ref = NUMPY.fox_attention(**inputs, **params)
    g_ref = NUMPY.vjp("fox_attention", inputs, params, {"o": do})
    args = [to_torch(x) for x in inputs.values()]
    offsets = None if cu is None else Packing(tuple(cu))
    tiles = dict(block=block, key_block=key_block, window=window)
    o, lse = eager_fpa.fox_fwd(*args, K**-0.5, offsets, **tiles)
    grads = eager_fpa.fox_bwd(*args, o, lse, to_torch(do), None, K**-0.5, offsets, **tiles)
    assert relative_error(to_ref(o), o_ref) < 1e-13
    for name, got in zip(inputs, grads, strict=True):
        assert relative_error(to_ref(got), g_ref[name]) < 1e-12, name


def test_tiles_wholly_outside_the_window_are_not_visited():
    # query block [32, 40) with key blocks of 4, W = 10: keys 23..39 meet the window, so the
    # tiles [36, 40) (diagonal of its own block start 32), [28, 32), [24, 28) and [20, 24) are
    # visited, [16, 20) and earlier are not
    field = torch.randn(1, 40, dtype=torch.float64).cumsum(1)
    bias = eager_fpa.FPAPenalty(field, field.clone(), key_block=4)
    tiles = list(eager_fpa.within_window(bias.tiles(32, 40), 32, 40, 10))
    assert [(t.j0, t.j1) for t in tiles] == [(32, 40), (28, 32), (24, 28), (20, 24)]
    i, j = torch.arange(32, 40)[:, None], torch.arange(20, 24)[None, :]
    assert torch.equal(torch.isinf(tiles[-1].penalty[0]), i - j >= 10)  # (F3w) partly covered


def _fla_inputs(dtype, T=70, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, T, 4, 16, dtype=dtype, generator=gen)
    k, v = (torch.randn(2, T, 2, 16, dtype=dtype, generator=gen) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.randn(2, T, 4, dtype=dtype, generator=gen))
    return q, k, v, g


def test_fla_call_shape_positional_scale_window_and_cu_seqlens():
    q, k, v, g = _fla_inputs(torch.float64, T=30)
    assert torch.equal(fox_attention(q, k, v, g, 0.1), fox_attention(q, k, v, g, scale=0.1))
    by_position = fox_attention(q, k, v, g, 0.1, 7)
    assert torch.equal(by_position, fox_attention(q, k, v, g, scale=0.1, window=7))
    assert torch.equal(by_position, fox_attention(q, k, v, g, scale=0.1, window_size=7))
    assert not torch.equal(by_position, fox_attention(q, k, v, g, 0.1))
    offsets = torch.tensor([0, 11, 30])
    packed = [x[:1] for x in (q, k, v, g)]
    assert torch.equal(
        fox_attention(*packed, 0.1, 7, offsets),
        fox_attention(*packed, scale=0.1, window=7, cu_seqlens=offsets),
    )
    field = torch.cumsum(g, dim=1)
    assert torch.equal(
        fpa_attention(q, k, v, field, field, 0.1, 7),
        fpa_attention(q, k, v, field, field, scale=0.1, window_size=7),
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, "window: expected an integer >= 1 or None, got 0"),
        ({"window": 2.0}, "window: expected an integer >= 1"),
        ({"window_size": True}, "window_size: expected an integer >= 1"),
        ({"window": 3, "window_size": 3}, "window, window_size: give one of them"),
    ],
)
def test_a_bad_window_names_the_argument(kwargs, message):
    q, k, v, g = _fla_inputs(torch.float32, T=8)
    with pytest.raises(ValueError, match=message):
        fox_attention(q, k, v, g, **kwargs)
    with pytest.raises(ValueError, match=message):
        fpa_attention(q, k, v, g, g, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("window", [1, 13, 64, 100])
def test_fox_window_agrees_with_flash_linear_attention_naive(dtype, window):
    naive = pytest.importorskip("fla.ops.forgetting_attn.naive").naive_forgetting_attn
    q, k, v, g = _fla_inputs(dtype, seed=window)
    ours_leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    theirs_leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    ours = fox_attention(*ours_leaves, 0.3, window)  # fla's positional order
    theirs = naive(*theirs_leaves, 0.3, window)
    # the naive form computes in float32 whatever it is given
    assert relative_error(to_ref(ours), to_ref(theirs)) < 2e-6
    cot = torch.randn(ours.shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ours_g = torch.autograd.grad(ours, ours_leaves, cot)
    theirs_g = torch.autograd.grad(theirs, theirs_leaves, cot.float())
    for name, a, b in zip("qkvg", ours_g, theirs_g, strict=True):
        if window == 1 and name in "qkg":  # o = v: exactly zero, up to rounding on both sides
            assert to_ref(a).std() < 1e-6 and to_ref(b).std() < 1e-6, name
            continue
        assert relative_error(to_ref(a), to_ref(b)) < 1e-5, name
