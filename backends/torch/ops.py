"""The public torch ops: checked entry points over custom ops registered with torch.library.

Each op is one ``torch.library.custom_op`` (``attnspec::fpa_fwd``, ...) with a fake
implementation and a registered autograd formula whose backward is a second custom op, so
``torch.compile(fullgraph=True)`` sees one node per pass. The custom op looks its kernel up in
:mod:`.dispatch` by the ``impl`` string it carries: ``"eager"`` (the twins in
:mod:`.eager_fpa`, :mod:`.eager_interdomain`) or ``"triton"``, registered by the Triton modules
beside this one when they are imported. ``impl=None`` picks "triton" for CUDA tensors when a
Triton kernel is registered and serves the call (the envelope, backends/envelope.py: not, e.g.,
float64 FPA), else "eager"; a backward with no Triton kernel runs the eager twin.
Value checks (NaN/Inf, gates, |Lambda|, offsets) read the data, so they run inside the custom
op, where compiled code runs them too; while a CUDA graph captures, only the offsets are read
(:func:`.checks.values_checked`), so a call without cu_seqlens can be captured. Every custom op
carries the tags of :data:`.dispatch.OP_TAGS`.

Layout (flash-attn / flash-linear-attention): q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
per-token scalars ``[B, T, H]``, output ``[B, T, H, V]``.

Autocast: like SDPA, under ``torch.autocast`` q, k, v (and the Interdomain features) are cast to
the autocast dtype, float64 stays float64; the field, level, gates and SSM parameters keep their
float32-or-wider dtype, and nothing inside the op is autocast again.
"""

import importlib
from typing import Any, Literal, overload

import torch
from torch import Tensor

from attnspec.backends import envelope
from attnspec.reference.packing import Packing
from attnspec.reference.validation import positive_int

from . import checks, dispatch
from . import eager_fpa as _eager_fpa  # noqa: F401  (registers the eager FPA/FoX kernels)
from . import eager_interdomain as _eager_interdomain  # noqa: F401  (and the Interdomain ones)

TRITON_MODULES = (
    "attnspec.backends.torch.triton_fpa",
    "attnspec.backends.torch.triton_s4d",
    "attnspec.backends.torch.triton_s4d_bwd",
    "attnspec.backends.torch.triton_legs",
)
_triton_loaded = False


def load_triton_kernels() -> None:
    """Import the Triton kernel modules once, so they register impl "triton".

    A module that is absent, or that cannot import triton, is skipped: the eager kernels remain.
    Any other import error is a bug of that module and propagates.
    """
    global _triton_loaded
    if _triton_loaded:
        return
    _triton_loaded = True
    for name in TRITON_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            if exc.name != name and not (exc.name or "").startswith("triton"):
                raise


def _has_triton(kernel: str) -> bool:
    load_triton_kernels()
    return "triton" in dispatch.implementations(kernel)


if torch.cuda.is_available():
    # a constant for torch.compile. Only with CUDA: the decorator imports torch._dynamo, which
    # imports triton, and a CPU-only process may still have to choose the Triton interpreter.
    _has_triton = torch.compiler.assume_constant_result(_has_triton)


def resolve_impl(kernel: str, impl: str | None, device: torch.device) -> str:
    """The implementation of ``kernel`` to run: ``impl`` if given (ValueError if it is not
    registered, or if it is "triton" for CPU tensors outside the Triton interpreter); otherwise
    "triton" for CUDA tensors when a Triton kernel is registered, else "eager"."""
    if impl is None:
        return "triton" if device.type == "cuda" and _has_triton(kernel) else "eager"
    if not isinstance(impl, str):
        raise ValueError(f"impl: expected None, 'eager' or 'triton', got {impl!r}")
    if impl == "triton":
        checks.triton_device(device)
        load_triton_kernels()
    dispatch.lookup(kernel, impl)
    return impl


def _served(
    family: str,
    requested: str | None,
    impl: str,
    x: Tensor,
    scalars: torch.dtype,
    *,
    head_dim: int = 0,
    cu_seqlens: Tensor | None = None,
    heads: int = 1,
) -> str:
    """``impl``, or "eager" where the envelope (backends/envelope.py) says no Triton kernel
    serves this call on CUDA; an explicit ``impl="triton"`` there is a ValueError. Reads
    dtypes and shapes only (no data): the same answer under torch.compile."""
    if impl != "triton" or x.device.type != "cuda":
        return impl
    sequences = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    served, reason = envelope.route(
        family, str(x.dtype), str(scalars), head_dim=head_dim, sequences=sequences, heads=heads
    )
    if served == "triton":
        return impl
    if requested == "triton":
        raise ValueError(
            f"impl: no Triton kernel serves this call on CUDA ({reason}); impl='eager' or None "
            "runs the eager twin"
        )
    return "eager"


def _backward_impl(kernel: str, impl: str) -> str:
    """The backward runs the forward's implementation when it has one, else the eager twin."""
    return impl if impl in dispatch.implementations(kernel) else "eager"


def _autocast(*xs: Tensor) -> tuple[Tensor, ...]:
    """Cast to the autocast dtype if autocast is on for the device (float64 left alone)."""
    device_type = xs[0].device.type
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):  # meta: no autocast
        return xs
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x if x.dtype == torch.float64 else x.to(dtype) for x in xs)


def _no_autocast(x: Tensor) -> torch.autocast:
    return torch.autocast(x.device.type, enabled=False)


def _empty(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _empty_batch(shape: tuple[int, ...], dtype: torch.dtype, *inputs: Tensor) -> Tensor:
    """An empty batch (B = 0) [decision, as SDPA]: the empty output, computed before any
    kernel, tied to every input so that backward gives each its gradient (empty, or zero for
    parameters such as lam, b, c)."""
    tie = sum((x.sum() * 0).to(dtype) for x in inputs)  # 0 with a path to every input
    return inputs[0].new_zeros(shape, dtype=dtype) + tie


def _packing(
    T: int, cu_seqlens: Tensor | None, *values: checks.ValueCheck
) -> tuple[Packing | None, Tensor | None]:
    """The value checks and the offsets, read in one sync (:func:`.checks.read_values`), as the
    kernels take them: the :class:`Packing` of the non-empty sequences (zero-length ones
    contribute nothing [decision, as FlashAttention's varlen]), and the indices of the sequences
    kept (None when none is dropped). It reads data, so it runs inside the custom ops."""
    plan = checks.read_values(T, cu_seqlens, *values)
    if plan is None or not plan.has_empty:
        return plan, None
    assert cu_seqlens is not None
    kept = torch.tensor(plan.kept, dtype=torch.int64, device=cu_seqlens.device)
    return Packing(plan.nonempty_offsets), kept


def _window_kwarg(window: int | None) -> dict[str, int]:
    """The kernels take the window of (F3w) as the keyword ``window``, passed only when there
    is one: a kernel registered without it still serves every call without a window."""
    return {} if window is None else {"window": window}


# FPA


@torch.library.custom_op(
    "attnspec::fpa_fwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor q, Tensor k, Tensor v, Tensor field, Tensor level, float scale, "
    "Tensor? cu_seqlens, str impl, int? window=None) -> (Tensor, Tensor)",
)
def _fpa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    plan, _ = _packing(
        q.shape[1],
        cu_seqlens,
        checks.finite_check("field", field),
        checks.finite_check("level", level),
    )
    with _no_autocast(q):
        kernel = dispatch.lookup("fpa_fwd", impl)
        return kernel(q, k, v, field, level, scale, plan, **_window_kwarg(window))


@_fpa_fwd.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), field.new_empty(B, T, HQ)


@torch.library.custom_op(
    "attnspec::fpa_bwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor q, Tensor k, Tensor v, Tensor field, Tensor level, Tensor o, Tensor lse, "
    "Tensor do, Tensor? dlse, float scale, Tensor? cu_seqlens, str impl, int? window=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _fpa_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, ...]:
    plan, _ = _packing(q.shape[1], cu_seqlens)
    with _no_autocast(q):
        kernel = dispatch.lookup("fpa_bwd", impl)
        args = (q, k, v, field, level, o, lse, do, dlse, scale, plan)
        return tuple(kernel(*args, **_window_kwarg(window)))


@_fpa_bwd.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, ...]:
    return _empty(q), _empty(k), _empty(v), _empty(field), _empty(level)


def _fpa_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, field, level, scale, cu_seqlens, impl, window = inputs
    ctx.save_for_backward(q, k, v, field, level, *output, cu_seqlens)
    ctx.scale, ctx.impl, ctx.window = scale, impl, window


def _fpa_backward(ctx: Any, do: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, field, level, o, lse, cu_seqlens = ctx.saved_tensors
    impl = _backward_impl("fpa_bwd", ctx.impl)
    grads = _fpa_bwd(
        q,
        k,
        v,
        field,
        level,
        o,
        lse,
        do.contiguous(),
        dlse.contiguous(),
        ctx.scale,
        cu_seqlens,
        impl,
        ctx.window,
    )
    return (*grads, None, None, None, None)


_fpa_fwd.register_autograd(_fpa_backward, setup_context=_fpa_setup)


@overload
def fpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float | None = ...,
    window: int | None = ...,
    cu_seqlens: Tensor | None = ...,
    *,
    window_size: int | None = ...,
    return_lse: Literal[False] = ...,
    impl: str | None = ...,
) -> Tensor: ...


@overload
def fpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float | None = ...,
    window: int | None = ...,
    cu_seqlens: Tensor | None = ...,
    *,
    window_size: int | None = ...,
    return_lse: Literal[True],
    impl: str | None = ...,
) -> tuple[Tensor, Tensor]: ...


def fpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    window_size: int | None = None,
    return_lse: bool = False,
    impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """First Passage Attention, (F1)-(F5) of spec/fpa.md, with gradients (G1)-(G4).

    The positional order after the inputs is flash-linear-attention's (scale, window_size,
    cu_seqlens), as in :func:`fox_attention`.

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; HQ a multiple of H (GQA: query head
            h reads key/value head h // (HQ / H)). float64, float32, float16 or bfloat16, one
            dtype, one device.
        field, level: [B, T, HQ], float32 or float64 (promoted to float64 when q is float64);
            float16 and bfloat16 are widened to float32 (they carry no more precision than
            they arrive with).
        scale: softmax scale; default 1/sqrt(K).
        window: None, or the window W >= 1 of (F3w): query i sees keys i-W+1..i of its own
            sequence. ``window_size`` is the same argument under flash-linear-attention's
            name (keyword only; give one of the two).
        cu_seqlens: int32/int64 offsets [N + 1] of N packed sequences (B must be 1).
        return_lse: also return lse [B, T, HQ] (natural log, field's dtype).
        impl: "eager", "triton", or None (Triton on CUDA when registered and the envelope,
            backends/envelope.py, says a kernel serves the call; else eager). "triton" at a
            corner no kernel serves on CUDA is a ValueError.

    Returns:
        o [B, T, HQ, V] in q's dtype, or (o, lse). An empty batch (B = 0) gives empty outputs
        with gradients, as SDPA does; a zero-length packed sequence contributes nothing.

    Time O(T^2 (K + V)) per sequence; memory O(T * block) (eager) beyond inputs and outputs.
    """
    dims = checks.attention_inputs(q, k, v)
    field = checks.per_token("field", field, q)
    level = checks.per_token("level", level, q)
    checks.same_dtype(("field", "level"), (field, level))
    s = checks.scale(scale, dims.K)
    window = checks.window(window, window_size)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, q)
    requested, impl = impl, resolve_impl("fpa_fwd", impl, q.device)
    q, k, v = _autocast(q, k, v)
    if q.dtype == torch.float64:
        field, level = field.to(torch.float64), level.to(torch.float64)
    width = max(dims.K, dims.V)
    impl = _served("fpa", requested, impl, q, field.dtype, head_dim=width, cu_seqlens=cu_seqlens)
    if dims.B == 0:
        o = _empty_batch((0, dims.T, dims.HQ, dims.V), q.dtype, q, k, v, field, level)
        lse = _empty_batch((0, dims.T, dims.HQ), field.dtype, field, level)
        return (o, lse) if return_lse else o
    o, lse = _fpa_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        field.contiguous(),
        level.contiguous(),
        s,
        cu_seqlens,
        impl,
        window,
    )
    return (o, lse) if return_lse else o


# FoX


@torch.library.custom_op(
    "attnspec::fox_fwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor q, Tensor k, Tensor v, Tensor log_f, float scale, Tensor? cu_seqlens, "
    "str impl, int? window=None) -> (Tensor, Tensor)",
)
def _fox_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    plan, _ = _packing(q.shape[1], cu_seqlens, checks.gates_check(log_f))
    with _no_autocast(q):
        kernel = dispatch.lookup("fox_fwd", impl)
        return kernel(q, k, v, log_f, scale, plan, **_window_kwarg(window))


@_fox_fwd.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, Tensor]:
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), log_f.new_empty(B, T, HQ)


@torch.library.custom_op(
    "attnspec::fox_bwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor q, Tensor k, Tensor v, Tensor log_f, Tensor o, Tensor lse, Tensor do, "
    "Tensor? dlse, float scale, Tensor? cu_seqlens, str impl, int? window=None) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
)
def _fox_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, ...]:
    plan, _ = _packing(q.shape[1], cu_seqlens)
    with _no_autocast(q):
        kernel = dispatch.lookup("fox_bwd", impl)
        args = (q, k, v, log_f, o, lse, do, dlse, scale, plan)
        return tuple(kernel(*args, **_window_kwarg(window)))


@_fox_bwd.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    o: Tensor,
    lse: Tensor,
    do: Tensor,
    dlse: Tensor | None,
    scale: float,
    cu_seqlens: Tensor | None,
    impl: str,
    window: int | None = None,
) -> tuple[Tensor, ...]:
    return _empty(q), _empty(k), _empty(v), _empty(log_f)


def _fox_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    q, k, v, log_f, scale, cu_seqlens, impl, window = inputs
    ctx.save_for_backward(q, k, v, log_f, *output, cu_seqlens)
    ctx.scale, ctx.impl, ctx.window = scale, impl, window


def _fox_backward(ctx: Any, do: Tensor, dlse: Tensor) -> tuple[Tensor | None, ...]:
    q, k, v, log_f, o, lse, cu_seqlens = ctx.saved_tensors
    impl = _backward_impl("fox_bwd", ctx.impl)
    grads = _fox_bwd(
        q,
        k,
        v,
        log_f,
        o,
        lse,
        do.contiguous(),
        dlse.contiguous(),
        ctx.scale,
        cu_seqlens,
        impl,
        ctx.window,
    )
    return (*grads, None, None, None, None)


_fox_fwd.register_autograd(_fox_backward, setup_context=_fox_setup)


def fox_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    scale: float | None = None,
    window: int | None = None,
    cu_seqlens: Tensor | None = None,
    *,
    window_size: int | None = None,
    impl: str | None = None,
) -> Tensor:
    """Forgetting Transformer attention, (F6): FPA with field = level = cumsum(log_f).

    The call shape of flash-linear-attention's ``parallel_forgetting_attn(q, k, v, g,
    scale=None, window_size=None, cu_seqlens=None)``: the same positional order, and
    ``window_size=`` accepted by that name; the decay is computed from segment-local
    cumulative sums.

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V] (GQA as in :func:`fpa_attention`).
        log_f: [B, T, HQ] log forget gates <= 0, float32 or float64 (float64 when q is);
            float16 and bfloat16 gates, as ``parallel_forgetting_attn`` takes them, are
            widened to float32 (they carry no more precision than they arrive with).
        scale, window, cu_seqlens, window_size, impl: as in :func:`fpa_attention` (window
            and window_size: the window of (F3w), fla's ``window_size``).

    Returns:
        o [B, T, HQ, V] in q's dtype. Time O(T^2 (K + V)), O(T W (K + V)) with a window W;
        memory O(T * block) (eager).
    """
    dims = checks.attention_inputs(q, k, v)
    log_f = checks.per_token("log_f", log_f, q)
    s = checks.scale(scale, dims.K)
    window = checks.window(window, window_size)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, q)
    requested, impl = impl, resolve_impl("fox_fwd", impl, q.device)
    q, k, v = _autocast(q, k, v)
    if q.dtype == torch.float64:
        log_f = log_f.to(torch.float64)
    width = max(dims.K, dims.V)
    impl = _served("fox", requested, impl, q, log_f.dtype, head_dim=width, cu_seqlens=cu_seqlens)
    if dims.B == 0:
        return _empty_batch((0, dims.T, dims.HQ, dims.V), q.dtype, q, k, v, log_f)
    o, _ = _fox_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        log_f.contiguous(),
        s,
        cu_seqlens,
        impl,
        window,
    )
    return o


# Interdomain: the S4D core


def _s4d_state_channels(R: int, V: int, readout: str) -> int:
    return R + V + (readout == "ratio")


@torch.library.custom_op(
    "attnspec::s4d_fwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor fq, Tensor kt, Tensor vt, Tensor lam, Tensor b, Tensor c, str readout, "
    "Tensor? cu_seqlens, Tensor? initial_state, str impl) -> (Tensor, Tensor, Tensor[])",
)
def _s4d_fwd(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    cu_seqlens: Tensor | None,
    initial_state: Tensor | None,
    impl: str,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """o, the final state, and what the implementation keeps for its backward (``saved``)."""
    named = (("lam", lam), ("b", b), ("c", c), ("initial_state", initial_state))
    values = [checks.finite_check(name, x) for name, x in named if x is not None]
    offsets, keep = _packing(fq.shape[1], cu_seqlens, *values, checks.decays_check(lam))
    kept_initial = initial_state if keep is None or initial_state is None else initial_state[keep]
    with _no_autocast(fq):
        kernel = dispatch.lookup("s4d_fwd", impl)
        o, final, saved = kernel(
            fq, kt, vt, lam, b, c, readout, offsets, kept_initial, return_saved=True
        )
    if keep is None or cu_seqlens is None:
        return o, final, saved
    # a zero-length sequence ends in the state it started from
    N = len(cu_seqlens) - 1
    full = final.new_zeros(N, *final.shape[1:]) if initial_state is None else initial_state.clone()
    full[keep] = final
    return o, full, saved


@_s4d_fwd.register_fake
def _(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    cu_seqlens: Tensor | None,
    initial_state: Tensor | None,
    impl: str,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    B, T, H, R = fq.shape
    V, M = vt.shape[3], lam.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    C = _s4d_state_channels(R, V, readout)
    saved = []
    if impl == "triton":  # the chunk count of packed sequences depends on their offsets
        from .triton_s4d import saved_fake

        chunks = None if cu_seqlens is None else torch.library.get_ctx().new_dynamic_size()
        saved = saved_fake(fq, lam, C, chunks)
    return fq.new_empty(B, T, H, V), lam.new_empty(N, H, M, C, 2), saved


@torch.library.custom_op(
    "attnspec::s4d_bwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor fq, Tensor kt, Tensor vt, Tensor lam, Tensor b, Tensor c, str readout, "
    "Tensor? cu_seqlens, Tensor? initial_state, Tensor do, Tensor? dfinal_state, "
    "Tensor[] saved, str impl) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _s4d_bwd(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    cu_seqlens: Tensor | None,
    initial_state: Tensor | None,
    do: Tensor,
    dfinal_state: Tensor | None,
    saved: list[Tensor],
    impl: str,
) -> tuple[Tensor, ...]:
    offsets, keep = _packing(fq.shape[1], cu_seqlens)
    kept_initial, kept_dfinal = initial_state, dfinal_state
    if keep is not None:
        kept_initial = None if initial_state is None else initial_state[keep]
        kept_dfinal = None if dfinal_state is None else dfinal_state[keep]
    with _no_autocast(fq):
        kernel = dispatch.lookup("s4d_bwd", impl)
        *grads, d_initial = kernel(
            fq, kt, vt, lam, b, c, readout, offsets, kept_initial, do, kept_dfinal, saved
        )
    if keep is not None and initial_state is not None:  # final = initial where T = 0
        full = torch.zeros_like(initial_state) if dfinal_state is None else dfinal_state.clone()
        full[keep] = d_initial
        d_initial = full
    # the schema has no optional output: no initial state, an empty cotangent
    return (*grads, lam.new_empty(0) if d_initial is None else d_initial)


@_s4d_bwd.register_fake
def _(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    readout: str,
    cu_seqlens: Tensor | None,
    initial_state: Tensor | None,
    do: Tensor,
    dfinal_state: Tensor | None,
    saved: list[Tensor],
    impl: str,
) -> tuple[Tensor, ...]:
    d_initial = lam.new_empty(0) if initial_state is None else _empty(initial_state)
    return _empty(fq), _empty(kt), _empty(vt), _empty(lam), _empty(b), _empty(c), d_initial


def _s4d_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    fq, kt, vt, lam, b, c, readout, cu_seqlens, initial_state, impl = inputs
    saved = output[2]  # the forward's chunk states and per-token buffers (Triton): kept for
    # the backward, which then recomputes less (docs/decisions.md)
    ctx.save_for_backward(fq, kt, vt, lam, b, c, cu_seqlens, initial_state, *saved)
    ctx.mark_non_differentiable(*saved)
    ctx.readout, ctx.impl = readout, impl


def _s4d_backward(ctx: Any, do: Tensor, dfinal_state: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    fq, kt, vt, lam, b, c, cu_seqlens, initial_state, *saved = ctx.saved_tensors
    impl = _backward_impl("s4d_bwd", ctx.impl)
    *grads, d_initial = _s4d_bwd(
        fq,
        kt,
        vt,
        lam,
        b,
        c,
        ctx.readout,
        cu_seqlens,
        initial_state,
        do.contiguous(),
        dfinal_state.contiguous(),
        saved,
        impl,
    )
    return (*grads, None, None, None if initial_state is None else d_initial, None)


_s4d_fwd.register_autograd(_s4d_backward, setup_context=_s4d_setup)


def s4d_pairs(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    *,
    readout: str = "linear",
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
    impl: str | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`interdomain_s4d` with the complex parameters and states as (re, im) pairs in a
    last axis of size 2 (lam, b [H, M, 2]; c [H, M, M, 2]; states [N, H, M, C, 2]), the form the
    modules use so compiled graphs hold no complex tensors.

    Returns:
        (o [B, T, H, V], final state [N, H, M, C, 2]).
    """
    B, _, H, R, V = checks.interdomain_features(("fq", "kt", "vt"), fq, kt, vt)
    readout = checks.readout(readout)
    M = checks.s4d_parameters(lam, b, c, H, pairs=True)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, B, fq)
    checks.same_device(("fq", "lam", "b", "c"), (fq, lam, b, c))
    if initial_state is not None:
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        dims = (N, H, M, _s4d_state_channels(R, V, readout))
        initial_state = checks.s4d_state(initial_state, dims, pairs=True, lam=lam)
        checks.same_device(("fq", "initial_state"), (fq, initial_state))
    requested, impl = impl, resolve_impl("s4d_fwd", impl, fq.device)
    fq, kt, vt = _autocast(fq, kt, vt)
    if fq.dtype == torch.float64:
        lam, b, c = lam.to(torch.float64), b.to(torch.float64), c.to(torch.float64)
        if initial_state is not None:
            initial_state = initial_state.to(torch.float64)
    impl = _served("s4d", requested, impl, fq, lam.dtype, cu_seqlens=cu_seqlens, heads=H)
    if B == 0:
        params = (lam, b, c) if initial_state is None else (lam, b, c, initial_state)
        o = _empty_batch((0, *fq.shape[1:3], V), fq.dtype, fq, kt, vt, *params)
        C = _s4d_state_channels(R, V, readout)
        return o, _empty_batch((0, H, M, C, 2), lam.dtype, *params)
    contiguous = (x.contiguous() for x in (fq, kt, vt, lam, b, c))
    o, final, _ = _s4d_fwd(
        *contiguous,
        readout,
        cu_seqlens,
        None if initial_state is None else initial_state.contiguous(),
        impl,
    )
    return o, final


@overload
def interdomain_s4d(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    *,
    readout: str = ...,
    cu_seqlens: Tensor | None = ...,
    initial_state: Tensor | None = ...,
    output_final_state: Literal[False] = ...,
    impl: str | None = ...,
) -> Tensor: ...


@overload
def interdomain_s4d(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    *,
    readout: str = ...,
    cu_seqlens: Tensor | None = ...,
    initial_state: Tensor | None = ...,
    output_final_state: Literal[True],
    impl: str | None = ...,
) -> tuple[Tensor, Tensor]: ...


def interdomain_s4d(
    fq: Tensor,
    kt: Tensor,
    vt: Tensor,
    lam: Tensor,
    b: Tensor,
    c: Tensor,
    *,
    readout: str = "linear",
    cu_seqlens: Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """The S4D core of Interdomain Attention, (I11)-(I13) of spec/interdomain.md, chunked.

    Args:
        fq: [B, T, H, R] query features xi(q); kt: [B, T, H, R] SSM key inputs k~;
            vt: [B, T, H, V] SSM value inputs v~. One float dtype of float64, float32, float16,
            bfloat16.
        lam, b: [H, M] complex; c: [H, M, M] complex (complex64 or complex128; |lam| <= 1).
            Gradients are dL/dRe + i dL/dIm, the reference's convention.
        readout: "linear" (denominator-free, I13) or "ratio".
        cu_seqlens: int32/int64 offsets [N + 1] of N packed sequences (B = 1), each started
            from its own state.
        initial_state: [N, H, M, C] complex (C = R + V, + 1 for "ratio"; N = B, or the number
            of packed sequences), the state x before the first token; zeros if None.
        output_final_state: also return the state after the last token.
        impl: "eager", "triton", or None (Triton on CUDA when registered and the envelope,
            backends/envelope.py, says a kernel serves the call; else eager). "triton" at a
            corner no kernel serves on CUDA is a ValueError.

    Returns:
        o [B, T, H, V] in fq's dtype, or (o, final state [N, H, M, C] complex).

    Time O(T (L M + M (R + V + M))) with chunks of L tokens; memory O(L^2 M) per batch-head
    beyond inputs and outputs (eager); the state does not grow with T. With autograd the
    Triton backend keeps its forward's chunk states and qe for the backward: per token and
    head 2 M (R + V) / L state values (bf16 for bf16 inputs) and 2 M float32 values, 1,280 B at
    M = R = L = 64, V = 128 (eager keeps nothing); ``torch.utils.checkpoint`` around the layer
    trades them for a second forward.
    """
    dims = checks.interdomain_features(("fq", "kt", "vt"), fq, kt, vt)
    readout = checks.readout(readout)
    M = checks.s4d_parameters(lam, b, c, dims.H, pairs=False)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, fq)
    if initial_state is not None:
        N = dims.B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        C = _s4d_state_channels(dims.R, dims.V, readout)
        initial_state = checks.s4d_state(initial_state, (N, dims.H, M, C), pairs=False, lam=lam)
        initial_state = torch.view_as_real(initial_state)
    params = (lam, b, c)
    o, final = s4d_pairs(
        fq,
        kt,
        vt,
        *(torch.view_as_real(p) for p in params),
        readout=readout,
        cu_seqlens=cu_seqlens,
        initial_state=initial_state,
        impl=impl,
    )
    return (o, torch.view_as_complex(final)) if output_final_state else o


# Interdomain: the LegS projection with the ratio readout


@torch.library.custom_op(
    "attnspec::legs_fwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor fq, Tensor fk, Tensor v, int M, Tensor? cu_seqlens, str impl) -> Tensor",
)
def _legs_fwd(
    fq: Tensor, fk: Tensor, v: Tensor, M: int, cu_seqlens: Tensor | None, impl: str
) -> Tensor:
    plan, _ = _packing(fq.shape[1], cu_seqlens)
    with _no_autocast(fq):
        return dispatch.lookup("legs_fwd", impl)(fq, fk, v, M, plan)


@_legs_fwd.register_fake
def _(fq: Tensor, fk: Tensor, v: Tensor, M: int, cu_seqlens: Tensor | None, impl: str) -> Tensor:
    return _empty(v)


@torch.library.custom_op(
    "attnspec::legs_bwd",
    mutates_args=(),
    tags=dispatch.OP_TAGS,
    schema="(Tensor fq, Tensor fk, Tensor v, int M, Tensor? cu_seqlens, Tensor do, str impl) "
    "-> (Tensor, Tensor, Tensor)",
)
def _legs_bwd(
    fq: Tensor, fk: Tensor, v: Tensor, M: int, cu_seqlens: Tensor | None, do: Tensor, impl: str
) -> tuple[Tensor, ...]:
    plan, _ = _packing(fq.shape[1], cu_seqlens)
    with _no_autocast(fq):
        return tuple(dispatch.lookup("legs_bwd", impl)(fq, fk, v, M, plan, do))


@_legs_bwd.register_fake
def _(
    fq: Tensor, fk: Tensor, v: Tensor, M: int, cu_seqlens: Tensor | None, do: Tensor, impl: str
) -> tuple[Tensor, ...]:
    return _empty(fq), _empty(fk), _empty(v)


def _legs_setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    fq, fk, v, M, cu_seqlens, impl = inputs
    ctx.save_for_backward(fq, fk, v, cu_seqlens)
    ctx.M, ctx.impl = M, impl


def _legs_backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
    fq, fk, v, cu_seqlens = ctx.saved_tensors
    impl = _backward_impl("legs_bwd", ctx.impl)
    grads = _legs_bwd(fq, fk, v, ctx.M, cu_seqlens, do.contiguous(), impl)
    return (*grads, None, None, None)


_legs_fwd.register_autograd(_legs_backward, setup_context=_legs_setup)


def interdomain_legs(
    fq: Tensor,
    fk: Tensor,
    v: Tensor,
    M: int,
    *,
    cu_seqlens: Tensor | None = None,
    impl: str | None = None,
) -> Tensor:
    """Interdomain attention with the HiPPO-LegS basis: (I2) coefficients by the exact steps
    (I5), ratio readout (I3).

    Args:
        fq, fk: [B, T, H, R] query and key features (the denominator xi(q) . u_0 must not
            vanish: positive features keep it positive); v: [B, T, H, V]. One float dtype.
        M: number of Legendre coefficients (>= 1).
        cu_seqlens, impl: as in :func:`interdomain_s4d`.

    Returns:
        o [B, T, H, V] in fq's dtype. Time O(T (L M + M^2 + M (R + V))) with chunks of L tokens;
        the cached step products hold T (M^2 + L M) numbers per (M, dtype, device).
    """
    dims = checks.interdomain_features(("fq", "fk", "v"), fq, fk, v)
    M = positive_int("M", M)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, fq)
    requested, impl = impl, resolve_impl("legs_fwd", impl, fq.device)
    fq, fk, v = _autocast(fq, fk, v)
    impl = _served("legs", requested, impl, fq, fq.dtype, cu_seqlens=cu_seqlens, heads=dims.H)
    if dims.B == 0:
        return _empty_batch(tuple(v.shape), v.dtype, fq, fk, v)
    return _legs_fwd(fq.contiguous(), fk.contiguous(), v.contiguous(), M, cu_seqlens, impl)
