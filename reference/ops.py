"""The table of ops: each op of the spec named once, with what every layer reads of it.

The conformance kit (``attnspec.conformance.protocol`` re-exports the table), the numpy adapter,
the torch and JAX kits and the torch kernel registry all derive their per-op lists from
:data:`OPS`: the case-id prefix, the inputs and outputs, the differentiable inputs and outputs,
the optional features and the torch kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OpSpec:
    """One op of the protocol.

    inputs: array arguments in canonical order; ``wide`` ones stay float32 or wider when the
    tested dtype is narrower (field, level and gate arithmetic, SSM parameters) [decision].
    outputs: names of the returned values with their tolerance quantity.
    prefix: the first part of the op's case ids (``fpa/ragged/2``).
    differentiable: inputs whose cotangents ``vjp`` must return (none: the op has no VJP).
    cotangents: the outputs that receive a cotangent in a VJP (``lse`` as well as ``o`` for FPA).
    call_options: keywords every call of the op passes (``return_lse=True`` where the op returns
    lse beside o).
    torch_kernels: the names of its forward and backward kernels in the torch registry
    (``attnspec.backends.torch.dispatch``); none for an op the torch kit composes from others.
    varlen, gqa, window: the op defines packed sequences (``cu_seqlens``), grouped-query
    attention and the window of (F3w), the optional capabilities ``<op>.varlen``, ``<op>.gqa``
    and ``<op>.window``.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[tuple[str, str], ...]
    differentiable: tuple[str, ...] = ()
    wide: tuple[str, ...] = ()
    layer: bool = False
    varlen: bool = False
    gqa: bool = False
    window: bool = False
    prefix: str = ""
    cotangents: tuple[str, ...] = ("o",)
    call_options: tuple[tuple[str, Any], ...] = ()
    torch_kernels: tuple[str, ...] = ()


S4D_PARAMS = ("lam_re", "lam_im", "b_re", "b_im", "c_re", "c_im")

OPS: dict[str, OpSpec] = {
    spec.name: spec
    for spec in [
        OpSpec(
            "fpa_attention",
            ("q", "k", "v", "field", "level"),
            (("o", "output"), ("lse", "lse")),
            ("q", "k", "v", "field", "level"),
            wide=("field", "level"),
            varlen=True,
            gqa=True,
            window=True,
            prefix="fpa",
            cotangents=("o", "lse"),
            call_options=(("return_lse", True),),
            torch_kernels=("fpa_fwd", "fpa_bwd"),
        ),
        OpSpec(
            "fox_attention",
            ("q", "k", "v", "log_f"),
            (("o", "output"),),
            ("q", "k", "v", "log_f"),
            wide=("log_f",),
            varlen=True,
            gqa=True,
            window=True,
            prefix="fox",
            torch_kernels=("fox_fwd", "fox_bwd"),
        ),
        OpSpec(
            "fpa_decode",
            ("q", "k", "v", "field", "level"),
            (("o", "output"), ("kept_fraction", "state")),
            wide=("field", "level"),
            prefix="decode",
        ),
        OpSpec(
            "interdomain_legs",
            ("fq", "fk", "v"),
            (("o", "output"),),
            ("fq", "fk", "v"),
            prefix="legs",
            torch_kernels=("legs_fwd", "legs_bwd"),
        ),
        OpSpec(
            "interdomain_s4d",
            ("fq", "kt", "vt", *S4D_PARAMS),
            (("o", "output"),),
            ("fq", "kt", "vt", *S4D_PARAMS),
            wide=S4D_PARAMS,
            varlen=True,
            prefix="s4d",
            torch_kernels=("s4d_fwd", "s4d_bwd"),
        ),
        *(
            OpSpec(
                name,
                ("x",),
                (("y", "output"),),
                layer=True,
                varlen=True,
                prefix=name,
                cotangents=(),
            )
            for name in ("fpa_layer", "interdomain_layer")
        ),
    ]
}

__all__ = ["OPS", "S4D_PARAMS", "OpSpec"]
