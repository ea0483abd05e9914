"""Input checks at the public boundary of the torch ops.

Every public op runs its arguments through these before anything is computed. A failure is a
ValueError naming the argument, what was expected and what arrived; nothing is broadcast, cast
between devices or promoted silently. Shape, dtype and device checks read only metadata, so they
run while ``torch.compile`` traces; value checks (NaN/Inf, positive gates, cu_seqlens offsets)
read the data and run inside the custom op, where they also hold in compiled code.

A value check reads its verdict back to the host, which a CUDA graph cannot hold: the NaN/Inf,
gate and decay checks run where a host read is allowed (:func:`values_checked`), and are skipped
while a CUDA stream is capturing, while ``torch.compile`` traces, and inside
``value_checks(enabled=False)`` (docs/decisions.md, issue 55). The offsets of
packed sequences are always read: the kernels' plan is made from them on the host.

These are the only checks of user input on the torch path: the kernels behind the custom ops
(the eager twins, the Triton launchers) assert the invariants they rely on and raise nothing of
their own, except where a kernel has a limit of its own (:func:`head_dims`) or a result is
undefined (the ratio readout's zero denominator).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from attnspec.reference.packing import Packing, packing

from .devices import interpreting

QKV_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
WIDE_DTYPES = (torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)
OFFSET_DTYPES = (torch.int32, torch.int64)


def tensor(
    name: str, x: object, ndim: int, dtypes: tuple[torch.dtype, ...], meaning: str
) -> Tensor:
    """Require a torch.Tensor with ``ndim`` dimensions and a dtype from ``dtypes``."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor {meaning}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(
            f"{name}: expected {ndim} dimensions {meaning}, got shape {tuple(x.shape)}"
        )
    if x.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name}: expected dtype {names}, got {str(x.dtype).removeprefix('torch.')}"
        )
    return x


def shape(name: str, x: Tensor, expected: tuple[int, ...], meaning: str) -> None:
    """Require ``x.shape == expected``; ``meaning`` spells the layout for the message."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name}: expected shape {tuple(expected)} ({meaning}), got {tuple(x.shape)}"
        )


def same_dtype(names: tuple[str, ...], xs: tuple[Tensor, ...]) -> None:
    """All of ``xs`` share one dtype."""
    for name, x in zip(names[1:], xs[1:], strict=True):
        if x.dtype != xs[0].dtype:
            expected, got = (str(d).removeprefix("torch.") for d in (xs[0].dtype, x.dtype))
            raise ValueError(f"{name}: expected the dtype of {names[0]} ({expected}), got {got}")


def same_device(names: tuple[str, ...], xs: tuple[Tensor | None, ...]) -> None:
    """All tensors of ``xs`` (None entries ignored) live on the device of the first."""
    device = next(x.device for x in xs if x is not None)
    for name, x in zip(names[1:], xs[1:], strict=True):
        if x is not None and x.device != device:
            raise ValueError(
                f"{name}: expected device {device} (that of {names[0]}), got {x.device}"
            )


def scale(value: float | None, head_dim: int) -> float:
    """The softmax scale: ``None`` gives 1/sqrt(head_dim); otherwise a finite real number."""
    if value is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"scale: expected a real number or None, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"scale: expected a finite number, got {value}")
    return float(value)


def window(value: int | None, window_size: int | None = None) -> int | None:
    """The window W of (F3w), given as ``window`` (the project's name) or ``window_size``
    (flash-linear-attention's): None (no window) or an integer >= 1; both given is an error."""
    if window_size is not None:
        if value is not None:
            raise ValueError(
                f"window, window_size: give one of them (window_size is flash-linear-attention's "
                f"name for window), got window={value!r} and window_size={window_size!r}"
            )
        value, name = window_size, "window_size"
    else:
        name = "window"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected an integer >= 1 or None, got {value!r}")
    return int(value)


class AttentionDims(NamedTuple):
    B: int
    T: int
    HQ: int
    H: int
    K: int
    V: int


def attention_inputs(q: Tensor, k: Tensor, v: Tensor) -> AttentionDims:
    """q [B, T, HQ, K], k [B, T, H, K], v [B, T, H, V], HQ a multiple of H (GQA), T >= 1."""
    q = tensor("q", q, 4, QKV_DTYPES, "[B, T, HQ, K]")
    k = tensor("k", k, 4, QKV_DTYPES, "[B, T, H, K]")
    v = tensor("v", v, 4, QKV_DTYPES, "[B, T, H, V]")
    same_dtype(("q", "k", "v"), (q, k, v))
    same_device(("q", "k", "v"), (q, k, v))
    B, T, HQ, K = q.shape
    if T < 1:
        raise ValueError(f"q: expected a sequence of length T >= 1, got T = {T}")
    if K < 1:
        raise ValueError(f"q: expected a head dim K >= 1, got shape {tuple(q.shape)}")
    H = k.shape[2]
    if H < 1 or HQ % H:
        raise ValueError(
            f"k: expected H heads dividing the {HQ} query heads of q (GQA), got shape "
            f"{tuple(k.shape)}"
        )
    shape("k", k, (B, T, H, K), "[B, T, H, K]: B, T and K of q")
    V = v.shape[3]
    shape("v", v, (B, T, H, V), "[B, T, H, V]: B, T of q and H of k")
    if V < 1:
        raise ValueError(f"v: expected a value dim V >= 1, got shape {tuple(v.shape)}")
    return AttentionDims(B, T, HQ, H, K, V)


def triton_device(device: torch.device) -> None:
    """impl="triton" needs a CUDA device, or the Triton interpreter for CPU tensors."""
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            f"impl: Triton kernels need a CUDA device, or TRITON_INTERPRET=1 on cpu; got {device} "
            "tensors"
        )


def head_dims(K: int, V: int, limit: int, kernels: str) -> None:
    """K and V within the largest head dim of an implementation's kernels (a limit of those
    kernels, not of the op: the eager twins take any)."""
    for arg, name, size in (("q", "K", K), ("v", "V", V)):
        if size > limit:
            raise ValueError(
                f"{arg}: head dim {name} = {size} exceeds the {kernels} kernels' limit of "
                f"{limit}; impl='eager' takes any"
            )


def per_token(name: str, x: Tensor, q: Tensor) -> Tensor:
    """A per-token scalar of every query head: [B, T, HQ] on q's device, float32 or float64.

    float16 and bfloat16 (a drop-in call passes gates in the input's dtype) are widened to
    float32 for the penalty arithmetic; they carry no more precision than they arrive with.
    """
    x = tensor(name, x, 3, QKV_DTYPES, "[B, T, HQ]")
    shape(name, x, tuple(q.shape[:3]), "[B, T, HQ]: B, T and the query heads of q")
    same_device(("q", name), (q, x))
    return x if x.dtype in WIDE_DTYPES else x.to(torch.float32)


def cu_seqlens(x: Tensor | None, B: int, q: Tensor) -> Tensor | None:
    """FlashAttention's offsets: a 1-D int32/int64 tensor on q's device, with B = 1.

    Returns:
        The offsets as int64 (a fresh tensor), or None. Their values are checked by
        :func:`read_values` inside the op.
    """
    if x is None:
        return None
    x = tensor("cu_seqlens", x, 1, OFFSET_DTYPES, "[N + 1] of sequence offsets")
    same_device(("q", "cu_seqlens"), (q, x))
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need B = 1, got B = {B}")
    if x.shape[0] < 2:
        raise ValueError(f"cu_seqlens: expected at least 2 offsets [0, ..., T], got {x.shape[0]}")
    return x.to(torch.int64)


_VALUE_CHECKS = [True]  # the process-wide switch of value_checks / set_value_checks


def set_value_checks(*, enabled: bool) -> None:
    """Turn the NaN/Inf, gate and decay checks of every torch op, layer and session on or off
    for the process (on by default). Off, bad values are not refused but computed with, as
    SDPA and FlashAttention compute with them; the metadata checks and the offsets' check stay."""
    if not isinstance(enabled, bool):
        raise ValueError(f"enabled: expected True or False, got {enabled!r}")
    _VALUE_CHECKS[0] = enabled


@contextlib.contextmanager
def value_checks(*, enabled: bool) -> Iterator[None]:
    """:func:`set_value_checks` for the block, restored after it."""
    before = _VALUE_CHECKS[0]
    set_value_checks(enabled=enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS[0] = before


def capturing() -> bool:
    """True while the current CUDA stream captures a graph (a host read would end the capture
    with an error). False in a process that never initialised CUDA."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def values_checked() -> bool:
    """Whether the value checks run now: switched on (:func:`value_checks`), no CUDA graph
    capturing, and not traced by ``torch.compile`` (the custom ops run them when the compiled
    code runs; a check in traced code would be a graph break)."""
    return _VALUE_CHECKS[0] and not capturing() and not torch.compiler.is_compiling()


# A value check: (a thunk giving a 0-d bool on the device, True when every value passes; the
# check that raises naming the argument, run on the host only when that flag is False). The
# flag is computed only when the checks run (:func:`values_checked`).
ValueCheck = tuple[Callable[[], Tensor], Callable[[], None]]


def read_values(T: int, cu_seqlens: Tensor | None, *values: ValueCheck) -> Packing | None:
    """Everything an op checks on the host, read in one device-to-host copy (one sync per call):
    the flags of ``values`` (:func:`finite_check`, :func:`gates_check`, :func:`decays_check`)
    when :func:`values_checked`, and the offsets' values, checked by the one rule of
    :mod:`attnspec.reference.packing` (start at 0, end at T, never decrease; a zero-length
    sequence contributes nothing, as in FlashAttention's varlen functions [decision]). Without
    offsets and with the value checks off it reads nothing: the call can be captured in a CUDA
    graph.

    Returns:
        The offsets' :class:`Packing`, or None without offsets.
    """
    if cu_seqlens is not None and capturing():
        raise ValueError(
            "cu_seqlens: packed sequences are planned from their offsets on the host, which a "
            "CUDA graph capture does not allow; capture calls without cu_seqlens (pad instead)"
        )
    values = values if values_checked() else ()
    parts = [torch.stack([flag() for flag, _ in values]).to(torch.int64)] if values else []
    if cu_seqlens is not None:
        parts.append(cu_seqlens.to(torch.int64))
    host = torch.cat(parts).tolist() if parts else []
    for good, (_, check) in zip(host, values, strict=False):
        if not good:
            check()
    return None if cu_seqlens is None else packing(host[len(values) :], T)


def finite_check(name: str, x: Tensor) -> ValueCheck:
    """:func:`finite` as a :data:`ValueCheck`."""
    return lambda: torch.isfinite(x).all(), lambda: finite(name, x)


def gates_check(x: Tensor) -> ValueCheck:
    """:func:`log_gates` as a :data:`ValueCheck`."""
    return lambda: (torch.isfinite(x) & (x <= 0)).all(), lambda: log_gates(x)


def decays_check(lam: Tensor) -> ValueCheck:
    """:func:`decays` as a :data:`ValueCheck`."""
    return lambda: (~(torch.linalg.vector_norm(lam, dim=-1) > 1)).all(), lambda: decays(lam)


def finite(name: str, x: Tensor) -> None:
    """No NaN or Inf in ``x``."""
    bad = ~torch.isfinite(x)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: contains NaN or Inf (first at index {index})")


def log_gates(x: Tensor) -> None:
    """Finite log forget gates, all <= 0."""
    finite("log_f", x)
    positive = x > 0
    if positive.any():
        index = tuple(int(i) for i in positive.nonzero()[0])
        raise ValueError(
            f"log_f: expected log forget gates <= 0, got {float(x[index]):.6g} at index {index}"
        )


def readout(value: str) -> str:
    """The S4D readout: "linear" (I13) or "ratio"."""
    if value not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {value!r}")
    return value


class FeatureDims(NamedTuple):
    B: int
    T: int
    H: int
    R: int
    V: int


def interdomain_features(
    names: tuple[str, str, str], fq: Tensor, fk: Tensor, v: Tensor
) -> FeatureDims:
    """fq, fk [B, T, H, R] and v [B, T, H, V]: one float dtype, one device, T >= 1."""
    fq = tensor(names[0], fq, 4, QKV_DTYPES, "[B, T, H, R]")
    fk = tensor(names[1], fk, 4, QKV_DTYPES, "[B, T, H, R]")
    v = tensor(names[2], v, 4, QKV_DTYPES, "[B, T, H, V]")
    same_dtype(names, (fq, fk, v))
    same_device(names, (fq, fk, v))
    B, T, H, R = fq.shape
    if T < 1 or H < 1 or R < 1:
        raise ValueError(f"{names[0]}: expected T, H, R >= 1, got shape {tuple(fq.shape)}")
    shape(names[1], fk, (B, T, H, R), f"[B, T, H, R], as {names[0]}")
    V = v.shape[3]
    shape(names[2], v, (B, T, H, V), f"[B, T, H, V]: B, T, H of {names[0]}")
    if V < 1:
        raise ValueError(f"{names[2]}: expected a value dim V >= 1, got shape {tuple(v.shape)}")
    return FeatureDims(B, T, H, R, V)


def decays(lam: Tensor) -> None:
    """S4D decays as (re, im) pairs [..., 2] with |Lambda| <= 1 (the recurrence is stable)."""
    modulus = torch.linalg.vector_norm(lam, dim=-1)
    bad = modulus > 1
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"lam: expected |Lambda| <= 1, got |Lambda| = {float(modulus[index]):.6g} at "
            f"index {index}"
        )


def s4d_parameters(lam: Tensor, b: Tensor, c: Tensor, H: int, pairs: bool) -> int:
    """lam, b [H, M] and c [H, M, M], complex, or as (re, im) pairs in a last axis of size 2
    (float32 or wider); one dtype.

    Returns:
        M.
    """
    extra, dtypes = ((2,), WIDE_DTYPES) if pairs else ((), COMPLEX_DTYPES)
    form = " + (2,) (re, im)" if pairs else " complex"
    lam = tensor("lam", lam, 2 + len(extra), dtypes, f"[H, M]{form}")
    M = lam.shape[1]
    shape("lam", lam, (H, M, *extra), f"[H, M]{form}, H = heads of fq")
    b = tensor("b", b, 2 + len(extra), dtypes, f"[H, M]{form}")
    shape("b", b, (H, M, *extra), f"[H, M]{form}, as lam")
    c = tensor("c", c, 3 + len(extra), dtypes, f"[H, M, M]{form}")
    shape("c", c, (H, M, M, *extra), f"[H, M, M]{form}, M of lam")
    same_dtype(("lam", "b", "c"), (lam, b, c))
    return M


def s4d_state(x: Tensor, dims: tuple[int, int, int, int], pairs: bool, lam: Tensor) -> Tensor:
    """An S4D state [N, H, M, C] complex (or + (2,) as (re, im) pairs), of lam's dtype."""
    extra, dtypes = ((2,), WIDE_DTYPES) if pairs else ((), COMPLEX_DTYPES)
    x = tensor("initial_state", x, 4 + len(extra), dtypes, "[N, H, M, C]")
    shape("initial_state", x, (*dims, *extra), "[N, H, M, C]: N sequences, C = R + V (+ 1)")
    same_dtype(("lam", "initial_state"), (lam, x))
    return x
