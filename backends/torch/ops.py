"""The public torch ops: checked entry points over custom ops registered with torch.library.

Each op is one ``torch.library.custom_op`` (``attnspec::fpa_fwd``, ...) with a fake
implementation and a registered autograd formula whose backward is a second custom op, so
``torch.compile(fullgraph=True)`` sees one node per pass. The custom op looks its kernel up in
:mod:`.dispatch` by the ``impl`` string it carries: ``"eager"`` (the twins in
:mod:`.eager_fpa`, :mod:`.eager_interdomain`) or ``"triton"``, registered by the Triton modules
beside this one when they are imported.

Layout (flash-attn / flash-linear-attention): q, k ``[B, T, H, K]``, v ``[B, T, H, V]``,
per-token scalars ``[B, T, H]``, output ``[B, T, H, V]``.

Autocast: like SDPA, under ``torch.autocast`` q, k, v (and the Interdomain features) are cast to
the autocast dtype, float64 stays float64; the field, level, gates and SSM parameters keep their
float32-or-wider dtype, and nothing inside the op is autocast again.
"""

import importlib

import torch
from torch import Tensor

from . import checks, dispatch
from . import eager_fpa as _eager_fpa  # noqa: F401  (registers the eager FPA/FoX kernels)

TRITON_MODULES = (
    "attnspec.backends.torch.triton_fpa",
    "attnspec.backends.torch.triton_interdomain",
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


@torch.compiler.assume_constant_result
def _has_triton(kernel: str) -> bool:
    load_triton_kernels()
    return "triton" in dispatch.implementations(kernel)


def resolve_impl(kernel: str, impl: str | None, device: torch.device) -> str:
    """The implementation of ``kernel`` to run: ``impl`` if given (ValueError if it is not
    registered); otherwise "triton" for CUDA tensors when a Triton kernel is registered, else
    "eager"."""
    if impl is None:
        return "triton" if device.type == "cuda" and _has_triton(kernel) else "eager"
    if not isinstance(impl, str):
        raise ValueError(f"impl: expected None, 'eager' or 'triton', got {impl!r}")
    if impl == "triton":
        load_triton_kernels()
    dispatch.lookup(kernel, impl)
    return impl


def _backward_impl(kernel: str, impl: str) -> str:
    """The backward runs the forward's implementation when it has one, else the eager twin."""
    return impl if impl in dispatch.implementations(kernel) else "eager"


def _autocast(*xs: Tensor) -> tuple[Tensor, ...]:
    """Cast to the autocast dtype if autocast is on for the device (float64 left alone)."""
    device_type = xs[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return xs
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(x if x.dtype == torch.float64 else x.to(dtype) for x in xs)


def _no_autocast(x: Tensor):
    return torch.autocast(x.device.type, enabled=False)


def _empty(x: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------------------------
# FPA


@torch.library.custom_op(
    "attnspec::fpa_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor field, Tensor level, float scale, "
    "Tensor? cu_seqlens, str impl) -> (Tensor, Tensor)",
)
def _fpa_fwd(q, k, v, field, level, scale, cu_seqlens, impl):
    checks.finite("field", field)
    checks.finite("level", level)
    if cu_seqlens is not None:
        checks.cu_seqlens_values(cu_seqlens, q.shape[1])
    with _no_autocast(q):
        return dispatch.lookup("fpa_fwd", impl)(q, k, v, field, level, scale, cu_seqlens)


@_fpa_fwd.register_fake
def _(q, k, v, field, level, scale, cu_seqlens, impl):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), field.new_empty(B, T, HQ)


@torch.library.custom_op(
    "attnspec::fpa_bwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor field, Tensor level, Tensor o, Tensor lse, "
    "Tensor do, Tensor? dlse, float scale, Tensor? cu_seqlens, str impl) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def _fpa_bwd(q, k, v, field, level, o, lse, do, dlse, scale, cu_seqlens, impl):
    with _no_autocast(q):
        kernel = dispatch.lookup("fpa_bwd", impl)
        return tuple(kernel(q, k, v, field, level, o, lse, do, dlse, scale, cu_seqlens))


@_fpa_bwd.register_fake
def _(q, k, v, field, level, o, lse, do, dlse, scale, cu_seqlens, impl):
    return _empty(q), _empty(k), _empty(v), _empty(field), _empty(level)


def _fpa_setup(ctx, inputs, output):
    q, k, v, field, level, scale, cu_seqlens, impl = inputs
    ctx.save_for_backward(q, k, v, field, level, *output, cu_seqlens)
    ctx.scale, ctx.impl = scale, impl


def _fpa_backward(ctx, do, dlse):
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
    )
    return (*grads, None, None, None)


_fpa_fwd.register_autograd(_fpa_backward, setup_context=_fpa_setup)


def fpa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    field: Tensor,
    level: Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    return_lse: bool = False,
    impl: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """First Passage Attention, (F1)-(F5) of spec/fpa.md, with gradients (G1)-(G4).

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V]; HQ a multiple of H (GQA: query head
            h reads key/value head h // (HQ / H)). float64, float32, float16 or bfloat16, one
            dtype, one device.
        field, level: [B, T, HQ], float32 or float64 (promoted to float64 when q is float64).
        scale: softmax scale; default 1/sqrt(K).
        cu_seqlens: int32/int64 offsets [N + 1] of N packed sequences (B must be 1).
        return_lse: also return lse [B, T, HQ] (natural log, field's dtype).
        impl: "eager", "triton", or None (Triton on CUDA when registered, else eager).

    Returns:
        o [B, T, HQ, V] in q's dtype, or (o, lse).

    Time O(T^2 (K + V)) per sequence; memory O(T * block) (eager) beyond inputs and outputs.
    """
    dims = checks.attention_inputs(q, k, v)
    field = checks.per_token("field", field, q)
    level = checks.per_token("level", level, q)
    checks.same_dtype(("field", "level"), (field, level))
    s = checks.scale(scale, dims.K)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, q)
    impl = resolve_impl("fpa_fwd", impl, q.device)
    q, k, v = _autocast(q, k, v)
    if q.dtype == torch.float64:
        field, level = field.to(torch.float64), level.to(torch.float64)
    o, lse = _fpa_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        field.contiguous(),
        level.contiguous(),
        s,
        cu_seqlens,
        impl,
    )
    return (o, lse) if return_lse else o


# --------------------------------------------------------------------------------------------
# FoX


@torch.library.custom_op(
    "attnspec::fox_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor log_f, float scale, Tensor? cu_seqlens, "
    "str impl) -> (Tensor, Tensor)",
)
def _fox_fwd(q, k, v, log_f, scale, cu_seqlens, impl):
    checks.log_gates(log_f)
    if cu_seqlens is not None:
        checks.cu_seqlens_values(cu_seqlens, q.shape[1])
    with _no_autocast(q):
        return dispatch.lookup("fox_fwd", impl)(q, k, v, log_f, scale, cu_seqlens)


@_fox_fwd.register_fake
def _(q, k, v, log_f, scale, cu_seqlens, impl):
    B, T, HQ, _ = q.shape
    return q.new_empty(B, T, HQ, v.shape[3]), log_f.new_empty(B, T, HQ)


@torch.library.custom_op(
    "attnspec::fox_bwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor log_f, Tensor o, Tensor lse, Tensor do, "
    "Tensor? dlse, float scale, Tensor? cu_seqlens, str impl) -> (Tensor, Tensor, Tensor, Tensor)",
)
def _fox_bwd(q, k, v, log_f, o, lse, do, dlse, scale, cu_seqlens, impl):
    with _no_autocast(q):
        kernel = dispatch.lookup("fox_bwd", impl)
        return tuple(kernel(q, k, v, log_f, o, lse, do, dlse, scale, cu_seqlens))


@_fox_bwd.register_fake
def _(q, k, v, log_f, o, lse, do, dlse, scale, cu_seqlens, impl):
    return _empty(q), _empty(k), _empty(v), _empty(log_f)


def _fox_setup(ctx, inputs, output):
    q, k, v, log_f, scale, cu_seqlens, impl = inputs
    ctx.save_for_backward(q, k, v, log_f, *output, cu_seqlens)
    ctx.scale, ctx.impl = scale, impl


def _fox_backward(ctx, do, dlse):
    q, k, v, log_f, o, lse, cu_seqlens = ctx.saved_tensors
    impl = _backward_impl("fox_bwd", ctx.impl)
    grads = _fox_bwd(
        q, k, v, log_f, o, lse, do.contiguous(), dlse.contiguous(), ctx.scale, cu_seqlens, impl
    )
    return (*grads, None, None, None)


_fox_fwd.register_autograd(_fox_backward, setup_context=_fox_setup)


def fox_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_f: Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    impl: str | None = None,
) -> Tensor:
    """Forgetting Transformer attention, (F6): FPA with field = level = cumsum(log_f).

    The call shape of flash-linear-attention's ``parallel_forgetting_attn(q, k, v, g, scale,
    cu_seqlens)``; the decay is computed from segment-local cumulative sums.

    Args:
        q: [B, T, HQ, K]; k: [B, T, H, K]; v: [B, T, H, V] (GQA as in :func:`fpa_attention`).
        log_f: [B, T, HQ] log forget gates <= 0, float32 or float64 (float64 when q is).
        scale, cu_seqlens, impl: as in :func:`fpa_attention`.

    Returns:
        o [B, T, HQ, V] in q's dtype. Time O(T^2 (K + V)); memory O(T * block) (eager).
    """
    dims = checks.attention_inputs(q, k, v)
    log_f = checks.per_token("log_f", log_f, q)
    s = checks.scale(scale, dims.K)
    cu_seqlens = checks.cu_seqlens(cu_seqlens, dims.B, q)
    impl = resolve_impl("fox_fwd", impl, q.device)
    q, k, v = _autocast(q, k, v)
    if q.dtype == torch.float64:
        log_f = log_f.to(torch.float64)
    o, _ = _fox_fwd(
        q.contiguous(), k.contiguous(), v.contiguous(), log_f.contiguous(), s, cu_seqlens, impl
    )
    return o
