"""The window of (F3w) in the Triton FPA and FoX kernels, under the Triton interpreter: values and
gradients against the float64 reference with tiles forced small (the window inside a tile, across
tile borders, W = 1, W >= T, packed, GQA), and the tiles wholly outside the window not visited."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import numpy as np
import pytest
from drawers import attention, gated, to_ref, to_torch

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnspec.backends.torch import triton_fpa as tf  # noqa: E402
from attnspec.conformance.metrics import relative_error  # noqa: E402
from attnspec.conformance.numpy_backend import NumpyBackend  # noqa: E402
from attnspec.reference.packing import Packing  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NUMPY = NumpyBackend()
SMALL = tf.Tiles(32, 16)  # BT = 2 BS: windows cross both tile sizes

# (B, T, HQ, H, K, V), window, cu_seqlens
WINDOWED = [
    ((1, 70, 2, 2, 16, 16), 1, None),
    ((1, 70, 2, 2, 16, 16), 9, None),  # inside a BS tile
    ((1, 80, 4, 2, 16, 16), 37, None),  # across BT and BS borders, GQA 4/2
    ((1, 90, 2, 2, 16, 16), 17, (0, 40, 41, 90)),  # packed, a length-1 sequence
    ((1, 50, 2, 2, 16, 16), 64, None),  # W >= T
]


def _check(got, want, tol, name):
    if not want.any():  # W = 1: no pair off the diagonal, no field or level gradient
        assert not to_ref(got).any(), name
    else:
        assert relative_error(to_ref(got), want) < tol, name


@pytest.mark.parametrize(("shape", "window", "cu"), WINDOWED)
def test_windowed_triton_fpa_matches_the_reference(shape, window, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + window)
    inputs = dict(
        zip(("q", "k", "v", "field", "level"), attention(rng, B, T, HQ, H, K, V), strict=True)
    )
    do, dlse = rng.standard_normal((B, HQ, T, V)), rng.standard_normal((B, HQ, T))
    params = {"scale": 0.7, "cu_seqlens": cu, "window": window}
    o_ref, lse_ref = NUMPY.fpa_attention(**inputs, **params, return_lse=True)
    g_ref = NUMPY.vjp("fpa_attention", inputs, params, {"o": do, "lse": dlse})
    args = [to_torch(x) for x in inputs.values()]
    offsets = None if cu is None else Packing(tuple(cu))
    with tf.forced_tiles(SMALL):
        o, lse = tf.fpa_fwd(*args, 0.7, offsets, window=window)
        grads = tf.fpa_bwd(*args, o, lse, to_torch(do), to_torch(dlse), 0.7, offsets, window=window)
    assert relative_error(to_ref(o), o_ref) < 1e-12
    assert relative_error(to_ref(lse), lse_ref) < 1e-12
    for name, got in zip(inputs, grads, strict=True):
        _check(got, g_ref[name], 1e-11, name)


@pytest.mark.parametrize(("shape", "window", "cu"), WINDOWED[1:])
def test_windowed_triton_fox_matches_the_reference(shape, window, cu):
    B, T, HQ, H, K, V = shape
    rng = np.random.default_rng(T + window)
    inputs = dict(
        zip(("q", "k", "v", "log_f"), gated(rng, B, T, HQ, H, K, V, unit=0.3), strict=True)
    )
    do = rng.standard_normal((B, HQ, T, V))
    params = {"cu_seqlens": cu, "window": window}
    o_ref = NUMPY.fox_attention(**inputs, **params)
    g_ref = NUMPY.vjp("fox_attention", inputs, params, {"o": do})
    args = [to_torch(x) for x in inputs.values()]
    offsets = None if cu is None else Packing(tuple(cu))
    with tf.forced_tiles(SMALL):
        o, lse = tf.fox_fwd(*args, None, offsets, window=window)
        grads = tf.fox_bwd(*args, o, lse, to_torch(do), None, None, offsets, window=window)
    assert relative_error(to_ref(o), o_ref) < 1e-12
    for name, got in zip(inputs, grads, strict=True):
        _check(got, g_ref[name], 1e-11, name)


@pytest.mark.parametrize("fox", [False, True])
def test_tiles_wholly_outside_the_window_are_not_visited(fox):
    # T = 128, BT = 32, BS = 16, W = 20: a query tile at qs visits the key tiles [s, s + 16)
    # with qs - (s + 15) < 20 (two left of its diagonal); a key tile at ks the query tiles
    # below ks + 51. A NaN there reaches every row of a tile that loads it (0 * NaN), so NaN
    # at key 0 must stay in the query tiles [0, 64), and NaN at query 127 (q and dO) in the
    # key tiles [64, 128).
    B, T, HQ, K = 1, 128, 1, 16
    rng = np.random.default_rng(0)
    q, k, v = (torch.tensor(rng.standard_normal((B, T, HQ, K))) for _ in range(3))
    log_f = torch.tensor(-rng.exponential(0.1, (B, T, HQ)))
    field = torch.cumsum(log_f, 1)
    wide = (log_f,) if fox else (field, field.clone())
    fwd, bwd = (tf.fox_fwd, tf.fox_bwd) if fox else (tf.fpa_fwd, tf.fpa_bwd)
    with tf.forced_tiles(SMALL):
        o, lse = fwd(q, k, v, *wide, None, None, window=20)
        k_nan, v_nan = k.clone(), v.clone()
        k_nan[0, 0] = v_nan[0, 0] = float("nan")
        o_nan, _ = fwd(q, k, v_nan, *wide, None, None, window=20)
        dq, *_ = bwd(
            q, k_nan, v_nan, *wide, o, lse, torch.ones_like(o), None, None, None, window=20
        )
        q_nan, do = q.clone(), torch.ones_like(o)
        q_nan[0, 127] = do[0, 127] = float("nan")
        _, dk, dv, *_ = bwd(q_nan, k, v, *wide, o, lse, do, None, None, None, window=20)
    for rows in (o_nan[0], dq[0]):  # query tiles
        assert rows[:64].isnan().any() and not rows[64:].isnan().any()
    for rows in (dk[0], dv[0]):  # key tiles
        assert rows[64:].isnan().any() and not rows[:64].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_triton_fox_in_narrow_dtypes(dtype):
    rng = np.random.default_rng(3)
    q, k, v, log_f = gated(rng, 1, 80, 2, 2, 16, 16)
    inputs = {"q": q, "k": k, "v": v, "log_f": log_f}
    rounded = {n: to_ref(to_torch(x).to(dtype)) if n != "log_f" else x for n, x in inputs.items()}
    o_ref = NUMPY.fox_attention(**rounded, window=30)
    args = [to_torch(x).to(dtype) for x in (q, k, v)] + [to_torch(log_f).float()]
    with tf.forced_tiles(SMALL):
        o, _ = tf.fox_fwd(*args, None, None, window=30)
    assert relative_error(to_ref(o.float()), o_ref) < (1e-5 if dtype == torch.float32 else 2e-2)
