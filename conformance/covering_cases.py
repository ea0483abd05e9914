"""The covering families of the kit (``<op>/covering/<n>``): the rows of :mod:`.covering`'s
all-pairs design over each op's feature axes, built into cases by the kit's drawers
(:mod:`.drawers`). cases.py puts them last in each op's menu (FAMILIES); :func:`case_axes` reads
any case's values on the same axes for the menu's coverage report (:mod:`.coverage_report`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from attnspec.reference import fpa
from attnspec.reference.ops import OPS

from .covering import (
    Design,
    Row,
    classify_length,
    classify_packing,
    design_rows,
    draw_offsets,
    power_of_two,
)
from .drawers import (
    RATIO_LAYER,
    TRAINED,
    Built,
    Case,
    Family,
    Inputs,
    case_seed,
    draw_fox_inputs,
    draw_fpa_inputs,
    draw_interdomain_layer,
    draw_layer_inputs,
    legs_builder,
    s4d_builder,
    trained,
)

BUDGET = 30  # cases at most per attention family (T x packing alone needs 20)
LENGTHS = {"below": 33, "on": 128, "across": 129, "long": 300}
HEAD_DIMS = {"pow2": 16, "odd": 24, "wide_odd": 100}
DV_OF = {"equal": lambda dk: dk, "half": lambda dk: dk // 2, "odd": lambda dk: 13}
HEADS = (1, 2, 3)  # key/value heads
GROUPS = (1, 2, 4)  # query heads per key/value head
LAYOUTS = ("", "slice", "transpose")
PACKINGS = ("none", "equal", "unequal", "empty_or_one", "tile_borders")
LOGITS = ("default", "small", "large")


def _attention_forbid(a: str, x: Any, b: str, y: Any) -> bool:
    """Packed sequences need B = 1 and T >= 17; T = 1 has one layout-free token."""
    if a == "packing" and x != "none":
        return (b == "B" and y != 1) or (b == "T" and y == "one")
    return False


def _attention_needs(op: str) -> Any:
    def needs(axis: str, value: Any) -> str:
        if axis == "packing" and value != "none":
            return f"{op}.varlen"
        if axis == "group" and value != 1:
            return f"{op}.gqa"
        if axis == "layout" and value:
            return "strided"
        return ""

    return needs


def _attention_axes(extra: tuple[tuple[str, tuple[Any, ...]], ...]) -> Any:
    return (
        ("B", (1, 2, 3)),
        ("H_kv", HEADS),
        ("group", GROUPS),
        ("dk", tuple(HEAD_DIMS)),
        ("dv", tuple(DV_OF)),
        ("T", tuple(LENGTHS)),
        ("packing", PACKINGS),
        ("layout", LAYOUTS),
        ("logits", LOGITS),
        *extra,
    )


FPA_DESIGN = Design(
    "fpa_attention",
    _attention_axes((("field", ("walk", "brackets", "huge")),)),
    BUDGET,
    _attention_forbid,
    _attention_needs("fpa_attention"),
)
FOX_DESIGN = Design(
    "fox_attention",
    _attention_axes((("gates", ("decay", "unit", "strong")),)),
    BUDGET,
    _attention_forbid,
    _attention_needs("fox_attention"),
)


def _s4d_forbid(a: str, x: Any, b: str, y: Any) -> bool:
    """At M = 1 the ratio readout cancels b and C (numerator and denominator scale alike), so
    their gradients vanish identically and a relative error is undefined."""
    return (a, x, b, y) == ("M", 1, "readout", "ratio")


S4D_DESIGN = Design(
    "interdomain_s4d",
    (
        ("B", (1, 2)),
        ("H", (1, 2, 3)),
        ("M", (1, 3, 4, 7, 16)),
        ("readout", ("linear", "ratio")),
        ("R", (3, 4, 8)),
        ("dv", (2, 4, 5)),
        ("T", ("below", "on", "across", "long")),
        ("packing", PACKINGS),
        ("memory", ("long", "mid", "short")),
        ("layout", ("", "slice")),
    ),
    32,
    lambda a, x, b, y: _attention_forbid(a, x, b, y) or _s4d_forbid(a, x, b, y),
    lambda a, x: (
        "interdomain_s4d.varlen"
        if a == "packing" and x != "none"
        else ("strided" if a == "layout" and x else "")
    ),
)
LEGS_DESIGN = Design(
    "interdomain_legs",
    (
        ("B", (1, 2)),
        ("H", (1, 2, 3)),
        ("M", (1, 3, 8, 12, 16)),
        ("R", (3, 4)),
        ("dv", (2, 4, 5)),
        ("T", ("below", "on", "across", "long")),
        ("layout", ("", "slice", "transpose")),
    ),
    22,
    needs=lambda a, x: "strided" if a == "layout" and x else "",
)
LAYER_LENGTHS = ("below", "across")  # 33 and 129: within one chunk, and past two borders


def _layer_needs(op: str) -> Any:
    return lambda a, x: f"{op}.varlen" if a == "packing" and x != "none" else ""


FPA_LAYER_DESIGN = Design(
    "fpa_layer",
    (
        ("B", (1, 2)),
        ("T", LAYER_LENGTHS),
        ("increments", ("signed", "logsigmoid")),
        ("packing", PACKINGS),
    ),
    12,
    _attention_forbid,
    _layer_needs("fpa_layer"),
)
INTERDOMAIN_LAYER_DESIGN = Design(
    "interdomain_layer",
    (
        ("B", (1, 2)),
        ("T", LAYER_LENGTHS),
        ("readout", ("linear", "ratio")),
        ("gate", (False, True)),
        ("use_rope", (False, True)),
        ("output_norm", (True, False)),
        ("packing", PACKINGS),
    ),
    14,
    _attention_forbid,
    _layer_needs("interdomain_layer"),
)
DESIGNS = {
    d.op: d
    for d in (
        FPA_DESIGN,
        FOX_DESIGN,
        S4D_DESIGN,
        LEGS_DESIGN,
        FPA_LAYER_DESIGN,
        INTERDOMAIN_LAYER_DESIGN,
    )
}
LAYER_D = 16  # the layers' model width (H = 2 heads of 4: cases.py's trained layers)


def rows(op: str) -> tuple[Row, ...]:
    """The covering rows of ``op``'s family, from (family, seed)."""
    return design_rows(DESIGNS[op], case_seed(f"{OPS[op].prefix}/covering"))


def _attention(op: str, rng: np.random.Generator, n: int) -> Built:
    row = rows(op)[n]
    T = LENGTHS[row["T"]]
    dk = HEAD_DIMS[row["dk"]]
    dv = DV_OF[row["dv"]](dk)
    H_kv, H = row["H_kv"], row["H_kv"] * row["group"]
    B = row["B"]
    if op == "fpa_attention":
        inputs = draw_fpa_inputs(rng, (B, H, T, dk, dv), field_kind=row["field"])
    else:
        decay = {"decay": 0.5, "unit": 0.5, "strong": 5.0}[row["gates"]]
        inputs = draw_fox_inputs(rng, B, H, T, dk, dv, decay=decay)
        if row["gates"] == "unit":
            inputs["log_f"][rng.random(inputs["log_f"].shape) < 0.4] = 0.0
    inputs["k"], inputs["v"] = inputs["k"][:, :H_kv], inputs["v"][:, :H_kv]
    params: dict[str, Any] = {}
    offsets = draw_offsets(rng, row["packing"], T)
    if offsets is not None:
        params["cu_seqlens"] = offsets
    _, scale = _logits(row["logits"], dk)
    if scale is not None:
        params["scale"] = scale
    return inputs, params


def _logits(kind: str, dk: int) -> tuple[str, float | None]:
    return kind, {"default": None, "small": 0.3, "large": 40.0 / float(np.sqrt(dk))}[kind]


def _s4d(rng: np.random.Generator, n: int) -> Built:
    row = rows("interdomain_s4d")[n]
    T = LENGTHS[row["T"]]
    dt = {"long": (1e-3, 2e-3), "mid": (0.01, 0.3), "short": (1.0, 2.0)}[row["memory"]]
    menu = [(row["B"], row["H"], T, row["R"], row["dv"], row["M"])]
    for _ in range(20):
        inputs, params = s4d_builder(menu, dt_range=dt, readout=row["readout"])(rng, 0)
        offsets = draw_offsets(rng, row["packing"], T)
        if offsets is not None:
            params["cu_seqlens"] = offsets
        # M >= 16 ratio rows pass the check at the first draw (measured) and cost 1 s each
        if row["readout"] != "ratio" or row["M"] >= 16 or _well_conditioned(inputs, params, rng):
            return inputs, params
    raise RuntimeError("could not draw a well-conditioned ratio case")


RATIO_CONDITION = (
    "ratio readouts (M < 16) drawn so that a relative perturbation of 1e-7 of every input moves no "
    "gradient of the float64 reference by more than 1e-5 (relative)"
)


def _well_conditioned(inputs: Inputs, params: dict[str, Any], rng: np.random.Generator) -> bool:
    """RATIO_CONDITION, by the reference VJP (the ratio's b and C gradients cancel in part: the
    ratio is invariant to a common scale of them)."""
    from .metrics import compare
    from .numpy_backend import NumpyBackend
    from .protocol import call_op

    ref = NumpyBackend()
    noise = np.random.default_rng(int(rng.integers(2**31)))
    out = call_op(ref, "interdomain_s4d", inputs, params)["o"]
    cot = {"o": noise.standard_normal(np.shape(out))}
    grads = ref.vjp("interdomain_s4d", inputs, params, cot)
    moved = {n: x * (1 + 1e-7 * noise.standard_normal(x.shape)) for n, x in inputs.items()}
    again = ref.vjp("interdomain_s4d", moved, params, cot)
    return all(compare(again[n], g, 1.0).rel <= 1e-5 for n, g in grads.items())


def _legs(rng: np.random.Generator, n: int) -> Built:
    row = rows("interdomain_legs")[n]
    T = LENGTHS[row["T"]]
    return legs_builder([(row["B"], row["H"], T, row["R"], row["dv"], row["M"])])(rng, 0)


def _fpa_layer(rng: np.random.Generator, n: int) -> Built:

    row = rows("fpa_layer")[n]
    T = LENGTHS[row["T"]]
    params = trained(fpa.init_fpa_params(LAYER_D, 2, 4, 4, int(rng.integers(2**31))), rng)
    options: dict[str, Any] = {"increments": row["increments"]}
    offsets = draw_offsets(rng, row["packing"], T)
    if offsets is not None:
        options["cu_seqlens"] = offsets
    return draw_layer_inputs(rng, params, row["B"], T, LAYER_D), options


def _interdomain_layer(rng: np.random.Generator, n: int) -> Built:
    row = rows("interdomain_layer")[n]
    T = LENGTHS[row["T"]]
    options: dict[str, Any] = {a: row[a] for a in ("readout", "gate", "use_rope", "output_norm")}
    offsets = draw_offsets(rng, row["packing"], T)
    if offsets is not None:
        options["cu_seqlens"] = offsets
    return draw_interdomain_layer(rng, row["B"], T, LAYER_D, options)


def per_case(op: str) -> Any:
    """(requires, layout) of case n: the optional capabilities its row uses and its layout."""

    def extras(n: int) -> tuple[tuple[str, ...], str]:
        row = rows(op)[n]
        needs = {DESIGNS[op].needs(a, row[a]) for a in row} - {"", "strided"}
        return tuple(sorted(needs)), row.get("layout", "")

    return extras


COVERING = (
    "all-pairs covering design over the feature axes (B, heads and groups, dk, dv, T by tile "
    "borders, packings, layouts, logit scale, op-specific axes; conformance/covering_cases.py)"
)


LAYER_COVERING = (
    "all-pairs covering design over the layer's option flags (increments; readout, output gate, "
    "RoPE, output norm), B, T and packings (conformance/covering_cases.py)"
)


def families() -> dict[str, dict[str, Family]]:
    """The covering family of each op, for cases.FAMILIES."""
    out: dict[str, dict[str, Family]] = {}
    for op, build in (
        ("fpa_attention", lambda rng, n: _attention("fpa_attention", rng, n)),
        ("fox_attention", lambda rng, n: _attention("fox_attention", rng, n)),
        ("interdomain_s4d", _s4d),
        ("interdomain_legs", _legs),
        ("fpa_layer", _fpa_layer),
        ("interdomain_layer", _interdomain_layer),
    ):
        note = {
            "interdomain_s4d": f"{COVERING}; {RATIO_CONDITION}",
            "fpa_layer": f"{LAYER_COVERING}; {TRAINED}",
            "interdomain_layer": f"{LAYER_COVERING}; {TRAINED}; {RATIO_LAYER}",
        }.get(op, COVERING)
        gradient = op not in ("fpa_layer", "interdomain_layer")  # layers: forward only
        out[op] = {
            "covering": Family(len(rows(op)), build, note, gradient=gradient, per_case=per_case(op))
        }
    return out


def case_axes(case: Case) -> Row:
    """A case's values on its op's axes (as far as the case shows them)."""
    x = case.inputs
    p = case.params
    row: Row = {}
    if case.op in ("fpa_attention", "fox_attention"):
        B, H, T, dk = x["q"].shape
        H_kv, dv = x["k"].shape[1], x["v"].shape[-1]
        row = {"B": B, "H_kv": H_kv, "group": H // H_kv, "T": classify_length(T)}
        row["dk"] = "pow2" if power_of_two(dk) else ("wide_odd" if dk > 64 else "odd")
        row["dv"] = (
            "equal" if dv == dk else ("half" if 2 * dv == dk else ("odd" if dv % 2 else "other"))
        )
        row["packing"] = classify_packing(p.get("cu_seqlens"))
        row["layout"] = case.layout
        scale = p.get("scale")
        big = float(np.abs(x["q"]).max()) > 50
        row["logits"] = (
            "large"
            if big or (scale is not None and scale * np.sqrt(dk) > 10)
            else ("small" if scale is not None else "default")
        )
        if case.op == "fpa_attention":
            f = x["field"]
            steps = np.diff(f, axis=-1)
            row["field"] = (
                "huge"
                if np.abs(f).max() > 1e3
                else ("brackets" if steps.size and (steps == 0).mean() > 0.1 else "walk")
            )
        else:
            g = x["log_f"]
            row["gates"] = (
                "unit" if (g == 0).mean() > 0.1 else ("strong" if g.mean() < -2 else "decay")
            )
    elif case.op == "interdomain_s4d":
        B, H, T, R = x["fq"].shape
        lam = np.abs(x["lam_re"] + 1j * x["lam_im"])
        nz = lam[lam > 0]
        mean = float(nz.mean()) if nz.size else 0.0
        row = {
            "B": B,
            "H": H,
            "M": x["lam_re"].shape[-1],
            "readout": p.get("readout", "linear"),
            "R": R,
            "dv": x["vt"].shape[-1],
            "T": classify_length(T),
            "packing": classify_packing(p.get("cu_seqlens")),
            "memory": "long" if mean > 0.99 else ("short" if mean < 0.7 else "mid"),
            "layout": case.layout,
        }
    elif case.op in ("fpa_layer", "interdomain_layer"):
        B, T = x["x"].shape[0], x["x"].shape[-2]
        row = {"B": B, "T": classify_length(T), "packing": classify_packing(p.get("cu_seqlens"))}
        if case.op == "fpa_layer":
            row["increments"] = p.get("increments", "signed")
        else:
            row["readout"] = p.get("readout", "linear")
            row["gate"] = bool(p.get("gate", False))
            row["use_rope"] = bool(p.get("use_rope", False))
            row["output_norm"] = bool(p.get("output_norm", True))
    elif case.op == "interdomain_legs":
        B, H, T, R = x["fq"].shape
        row = {
            "B": B,
            "H": H,
            "M": p["M"],
            "R": R,
            "dv": x["v"].shape[-1],
            "T": classify_length(T),
            "layout": case.layout,
        }
    return row


def backend_capabilities(backend: Any) -> set[str]:
    """The backend's capabilities, with "strided" when it offers strided inputs."""
    caps = set(backend.capabilities())
    return caps | {"strided"} if hasattr(backend, "asarray_strided") else caps


__all__ = [
    "DESIGNS",
    "backend_capabilities",
    "case_axes",
    "families",
    "rows",
]
