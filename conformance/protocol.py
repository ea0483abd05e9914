"""The backend protocol: what a backend provides, and the table of ops the kit checks.

A backend is any object with:

- ``name: str`` and ``dtypes: tuple[str, ...]`` (the dtypes it accepts: float64, float32,
  float16, bfloat16);
- ``capabilities() -> set[str]``: the op names it implements, plus ``"<op>.vjp"`` for each op
  whose gradients it provides, ``"<op>.varlen"`` (packed sequences), ``"<op>.gqa"`` (fewer
  key/value heads) and ``"<op>.window"`` (the window of (F3w)) for the ops whose ``OpSpec`` in
  :data:`OPS` defines them. Anything absent
  is reported as "not implemented"; :func:`op_claims` derives the set from the table;
- ``asarray(x: numpy.ndarray, dtype: str)`` and ``to_numpy(x) -> numpy.ndarray``: the adapter,
  the only place where arrays cross between NumPy and the backend;
- optionally ``asarray_strided(x, dtype, layout)``: ``x`` (B, H, T, D) as a non-contiguous view
  in the backend's own array type with the same values, for the strided cases: ``"slice"`` (a
  slice of a wider array's last axis, as q of a fused qkv projection) or ``"transpose"`` (a
  (B, H, T, D) view of a (B, T, H, D) array). Raising NotImplementedError (JAX arrays have no
  strides), or not having it, makes those cases "not implemented";
- optionally ``dtype_name(x) -> str``: the dtype of a returned array in the kit's names
  ("bfloat16", ...). Without it the dtype of ``to_numpy(x)`` is used, and a bfloat16 result
  that arrives widened to float32 is accepted;
- the ops below, called with keyword arguments in the canonical layout, returning its own arrays;
- ``vjp(op, inputs, params, cotangents) -> dict``: input cotangents by input name.
- optionally ``unsupported(op, shapes) -> str | None``: the reason a shape (``shapes``: input
  name -> shape tuple) is outside what the backend takes (a kernel for head dims in {16, 32,
  64, 128} only), else None; an op or vjp may also raise :class:`UnsupportedShape`. Either
  makes the item "not implemented", with the reason;
- optionally ``environment() -> dict[str, str]``: environment variables the backend needs
  (``TRITON_INTERPRET=1``); the repro line of a failure sets them.

Conventions the runner checks:

- Outputs come back in the tested dtype; ``lse`` in float32 or wider; every gradient in the
  dtype of its input (the wide inputs field, level, log_f and the SSM parameters are float32
  when the tested dtype is narrower, float64 when it is float64).
- Inputs and cotangents are never modified.
- varlen: the case has B = 1 and ``params["cu_seqlens"]`` is a tuple of ints (0, ..., T),
  FlashAttention's convention; each segment is an independent sequence, and a zero-length one
  contributes nothing (:mod:`attnspec.reference.packing`).
- Layers take x, the parameter dict and their options as keywords: ``increments`` for
  fpa_layer; ``readout``, ``gate``, ``use_rope``, ``output_norm`` for interdomain_layer (the
  optional parameters wg and norm_o_g are in the dict only when their flag is on).
- Results do not depend on call history: call-order cases interleave the forwards and VJPs of
  two input sets of the same shape.
- padding (``fox_attention.padding``, a capability a backend declares itself; the op table does
  not derive it): ``params["present"]`` is a NumPy bool array (B, T), False at padding. A
  padding position is no token: each batch row is its present tokens alone (no key, no gate;
  the window counts tokens), and every output and gradient at a padding position is 0.
- window: ``params["window"]`` is an int W >= 1 (spec/fpa.md (F3w)): query i sees keys
  i-W+1..i of its own sequence (flash-linear-attention's ``window_size``); the op is called with
  ``window=W``, and with no ``window`` keyword when the case has none.
- GQA: k and v have H_kv heads, H_kv dividing the H heads of q; query head h reads key/value
  head h // (H / H_kv); per-token scalars (field, level, log_f) have the H heads of q.

Complex parameters cross the boundary as (re, im) pairs of real arrays (``lam_re``, ``lam_im``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

# The op table lives with the reference, where every layer can read it.
from attnspec.reference.ops import OPS as OPS
from attnspec.reference.ops import S4D_PARAMS as S4D_PARAMS
from attnspec.reference.ops import OpSpec as OpSpec


class UnsupportedShape(NotImplementedError):
    """Raised by a backend for a shape it does not take (the message says why): the item is
    reported as not implemented, with the message, rather than failed."""


@runtime_checkable
class Backend(Protocol):
    # Read-only members, so that a class attribute such as dtypes = ("float32",) conforms.
    @property
    def name(self) -> str: ...

    @property
    def dtypes(self) -> tuple[str, ...]: ...

    def capabilities(self) -> set[str]: ...

    def asarray(self, x: np.ndarray, dtype: str) -> Any: ...

    def to_numpy(self, x: Any) -> np.ndarray: ...

    def vjp(
        self, op: str, inputs: dict[str, Any], params: dict[str, Any], cotangents: dict[str, Any]
    ) -> dict[str, Any]: ...


def op_features(ops: Iterable[str]) -> tuple[str, ...]:
    """The optional capabilities ``<op>.varlen``, ``<op>.gqa`` and ``<op>.window`` that the op
    table defines for ``ops``, in table order."""
    chosen = set(ops)
    return tuple(
        f"{spec.name}.{feature}"
        for spec in OPS.values()
        if spec.name in chosen
        for feature in ("varlen", "gqa", "window")
        if getattr(spec, feature)
    )


def op_claims(
    ops: Iterable[str],
    *,
    vjps: Iterable[str] | None = None,
    features: Iterable[str] | None = None,
    without: Iterable[str] = (),
) -> set[str]:
    """What a backend implementing ``ops`` claims, derived from the op table: each op,
    ``<op>.vjp`` for each differentiable one (or for ``vjps`` when given), the features of
    :func:`op_features` (or ``features`` when given), minus the capabilities in ``without``."""
    ops = tuple(ops)
    vjps = [op for op in ops if OPS[op].differentiable] if vjps is None else vjps
    features = op_features(ops) if features is None else features
    return ({*ops, *(f"{op}.vjp" for op in vjps), *features}) - set(without)


def call_op(
    backend: Backend, op: str, inputs: dict[str, Any], params: dict[str, Any]
) -> dict[str, Any]:
    """Call ``op`` on ``backend`` with native inputs; return its outputs by name.

    Layer ops take ``x`` and a parameter dict: their inputs carry the parameters under
    ``params.<name>`` keys.
    """
    spec = OPS[op]
    fn = getattr(backend, op)
    if spec.layer:
        weights = {k.removeprefix("params."): v for k, v in inputs.items() if k != "x"}
        result = fn(inputs["x"], weights, **params)
    else:
        result = fn(**inputs, **params, **dict(spec.call_options))
    names = [name for name, _ in spec.outputs]
    if len(names) == 1:
        return {names[0]: result}
    if not isinstance(result, tuple | list) or len(result) != len(names):
        raise TypeError(
            f"{op}: expected a tuple of {len(names)} outputs {names}, got {type(result)}"
        )
    return dict(zip(names, result, strict=True))
