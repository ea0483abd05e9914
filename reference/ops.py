"""The table of ops: each op of the spec named once, with what every layer reads of it.

The conformance kit (``attnspec.conformance.protocol`` re-exports the table), the numpy adapter,
the torch and JAX kits and the torch kernel registry all derive their per-op lists from
:data:`OPS`: the case-id prefix, the inputs and outputs, the differentiable inputs and outputs,
the optional features, the torch kernels and the contract of the op's decode session (the
reference sessions, the kit's session driver and the torch and JAX session adapters read it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SessionContract:
    """What a decode session of an op takes and gives (docs/conformance.md, "Decode sessions").

    required, optional: the config keys every session needs and those it may take, besides
    ``max_rollback`` (every session's delay W of (F9)); an adapter may take keys of its own
    (a capacity, a page size).
    output: the name of the output ``advance`` returns.
    token_axis: the axis of the chunk's positions in the inputs and the output ((R, H, n, ...)
    for the ops, (R, n, d) for the layers).
    counts: the keys ``counts()`` reports, integer arrays.
    """

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    output: str = "o"
    token_axis: int = 2
    counts: tuple[str, ...] = ("tokens",)

    @property
    def keys(self) -> frozenset[str]:
        """Every config key of the contract (required and optional), max_rollback included."""
        return frozenset((*self.required, *self.optional, "max_rollback"))


FPA_COUNTS = ("tokens", "live", "stored")


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
    session: the contract of its decode session (the capability ``<op>.session``); None when
    the op has none.
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
    session: SessionContract | None = None


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
            session=SessionContract(
                ("heads", "kv_heads", "dk", "dv", "scale"), ("window",), counts=FPA_COUNTS
            ),
        ),
        OpSpec(
            "fpa_decode",
            ("q", "k", "v", "field", "level"),
            (("o", "output"), ("kept_fraction", "state")),
            wide=("field", "level"),
            prefix="decode",
            session=SessionContract(
                ("heads", "kv_heads", "dk", "dv", "scale"),
                ("theta", "window"),
                counts=FPA_COUNTS,
            ),
        ),
        OpSpec(
            "interdomain_legs",
            ("fq", "fk", "v"),
            (("o", "output"),),
            ("fq", "fk", "v"),
            prefix="legs",
            torch_kernels=("legs_fwd", "legs_bwd"),
            session=SessionContract(("M",)),
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
            session=SessionContract(S4D_PARAMS, ("readout",)),
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
                session=SessionContract(("params",), options, "y", 1, counts),
            )
            for name, options, counts in (
                ("fpa_layer", ("increments", "theta", "window"), FPA_COUNTS),
                ("interdomain_layer", ("readout", "gate", "use_rope", "output_norm"), ("tokens",)),
            )
        ),
    ]
}


def session_contract(op: str) -> SessionContract:
    """The session contract of ``op``; ValueError naming the op when it has no session."""
    spec = OPS.get(op)
    if spec is None or spec.session is None:
        sessions = [name for name, s in OPS.items() if s.session is not None]
        raise ValueError(f"op: expected one of {sessions}, got {op!r}")
    return spec.session


def session_inputs(op: str) -> tuple[str, ...]:
    """The arrays of a chunk of ``op``'s session: its inputs but those its config gives (the
    S4D parameters), in canonical order."""
    config = set(session_contract(op).keys)
    return tuple(name for name in OPS[op].inputs if name not in config)


__all__ = [
    "FPA_COUNTS",
    "OPS",
    "S4D_PARAMS",
    "OpSpec",
    "SessionContract",
    "session_contract",
    "session_inputs",
]
