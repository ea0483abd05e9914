"""Session programs: the calls a server makes, as data, generated from (family, seed).

A :class:`Program` is an op, a row count, a config (float64 arrays and numbers) and a list of
:class:`Call` s (advance, select, rollback). Calls that must fail name the argument the ValueError
must name; the kit checks the session is unchanged after them. :data:`FAMILIES` maps each op to
its session families, ``name -> (count, build, note)`` with ``build(rng, n) -> Program``;
``cases.py`` turns them into cases ``<prefix>/session_<name>/<n>`` that need ``<op>.session``.

Inputs are drawn so that every float dtype sees the same control flow: FPA fields and levels
lie on a grid of 1/8 (exact in float32, the dtype of field and level below float64) and finite
thresholds lie 1/16 off the grid [decision], except in the ``theta_exact`` family where depths
reach theta exactly. Absent (padded) positions hold garbage, so a backend that reads them shows it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import fpa
from attnspec.reference import interdomain as idm

GRID = 8.0  # FPA fields and levels are multiples of 1 / GRID


@dataclass(frozen=True)
class Call:
    """One call of a program. method: "advance", "select" or "rollback"; args: its keyword
    arguments (advance: inputs (float64 arrays), present (bool (R, n))); error: "" for a call
    that must succeed, else the argument its ValueError must name; note: why the call is there."""

    method: str
    args: dict[str, Any]
    error: str = ""
    note: str = ""

    def describe(self) -> str:
        """The call as one line of Python (arrays by shape, masks as 0/1 strings)."""
        if self.method == "advance":
            present = np.asarray(self.args["present"])
            rows = " ".join("".join("1" if p else "0" for p in row) or "-" for row in present)
            shapes = ", ".join(f"{k}{tuple(np.shape(v))}" for k, v in self.args["inputs"].items())
            dtype = "" if present.dtype == np.bool_ else f" dtype {present.dtype}"
            text = f"advance({shapes}; present {present.shape}{dtype} [{rows}])"
        else:
            text = f"{self.method}({', '.join(f'{k}={v!r}' for k, v in self.args.items())})"
        if self.error:
            text += f"  -> ValueError naming {self.error!r}"
        return text + (f"  # {self.note}" if self.note else "")


@dataclass(frozen=True)
class Program:
    """op, rows, config (the protocol's open_session config, float64 arrays), calls."""

    op: str
    rows: int
    config: dict[str, Any]
    calls: tuple[Call, ...]

    def listing(self, upto: int | None = None) -> str:
        """The program as numbered lines (up to call ``upto`` included)."""
        scalars = {k: v for k, v in self.config.items() if not isinstance(v, np.ndarray | dict)}
        arrays = [k for k, v in self.config.items() if isinstance(v, np.ndarray | dict)]
        head = f"open_session({self.op!r}, rows={self.rows}, config={scalars}"
        head += f" + arrays {arrays})" if arrays else ")"
        calls = self.calls if upto is None else self.calls[: upto + 1]
        return "\n".join([head, *(f"  {i:>3}: {c.describe()}" for i, c in enumerate(calls))])


# chunk drawing


@dataclass
class Script:
    """Writes a program call by call; draws each chunk for the op and keeps the FPA field walk of
    each row going across chunks (rows follow select)."""

    op: str
    rng: np.random.Generator
    rows: int
    config: dict[str, Any]
    dims: dict[str, int]
    garbage_field: float = -1000.0  # the field at absent positions (a deep descent if read)
    calls: list[Call] = field(default_factory=list)
    walk: NDArray[np.float64] | None = None

    def __post_init__(self) -> None:
        self.opened = self.rows  # the row count the session is opened with (before a select)

    def chunk(self, present: NDArray[np.bool_]) -> dict[str, NDArray[np.float64]]:
        R, n = present.shape
        rng, d = self.rng, self.dims
        if self.op == "fpa_decode":
            HQ, H, dk, dv = d["heads"], d["kv_heads"], d["dk"], d["dv"]
            if self.walk is None:
                self.walk = np.zeros((R, HQ))
            steps = np.round(rng.normal(d.get("drift", 0.0), 1.0, (R, HQ, n)) * GRID) / GRID
            steps = np.where(present[:, None, :], steps, 0.0)
            field_ = self.walk[:, :, None] + np.cumsum(steps, axis=-1)
            self.walk = field_[:, :, -1] if n else self.walk
            offsets = np.round(rng.normal(d.get("offset", 0.0), 1.0, (R, HQ, n)) * GRID) / GRID
            level = field_ + offsets
            absent = ~present[:, None, :]
            inputs = {
                "q": rng.standard_normal((R, HQ, n, dk)),
                "k": rng.standard_normal((R, H, n, dk)),
                "v": rng.standard_normal((R, H, n, dv)),
                "field": np.where(absent, self.garbage_field, field_),
                "level": np.where(absent, -self.garbage_field, level),
            }
            for name in ("q", "k", "v"):
                heads = inputs[name].shape[1]
                mask = np.broadcast_to(absent[:, :1, :, None], (R, heads, n, 1))
                inputs[name] = np.where(mask, 30.0 * inputs[name], inputs[name])
            return inputs
        if self.op == "fox_attention":
            HQ, H, dk, dv = d["heads"], d["kv_heads"], d["dk"], d["dv"]
            absent = ~present[:, None, :]
            log_f = -rng.exponential(d.get("decay", 0.3), (R, HQ, n))
            inputs = {
                "q": rng.standard_normal((R, HQ, n, dk)),
                "k": rng.standard_normal((R, H, n, dk)),
                "v": rng.standard_normal((R, H, n, dv)),
                "log_f": np.where(absent, -abs(self.garbage_field) / 100, log_f),  # a decay if read
            }
            for name in ("q", "k", "v"):
                heads = inputs[name].shape[1]
                mask = np.broadcast_to(absent[:, :1, :, None], (R, heads, n, 1))
                inputs[name] = np.where(mask, 30.0 * inputs[name], inputs[name])
            return inputs
        if self.op in ("interdomain_s4d", "interdomain_legs"):
            H, Rf, dv = d["H"], d["R"], d["dv"]
            names = ("fq", "kt", "vt") if self.op == "interdomain_s4d" else ("fq", "fk", "v")
            inputs = {
                names[0]: rng.uniform(0.1, 1.0, (R, H, n, Rf)),  # positive: ratio readouts
                names[1]: rng.uniform(0.1, 1.0, (R, H, n, Rf)),
                names[2]: rng.standard_normal((R, H, n, dv)),
            }
            absent = ~present[:, None, :, None]
            return {k: np.where(absent, 50.0 * v - 20.0, v) for k, v in inputs.items()}
        x = rng.standard_normal((R, n, d["d"]))
        return {"x": np.where(~present[:, :, None], 30.0 * x, x)}

    def advance(self, present: Any, note: str = "") -> None:
        mask = np.asarray(present, dtype=bool).reshape(self.rows, -1)
        self.calls.append(Call("advance", {"inputs": self.chunk(mask), "present": mask}, "", note))

    def full(self, n: int, note: str = "") -> None:
        self.advance(np.ones((self.rows, n), dtype=bool), note)

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.full(1, "one-token step")

    def select(self, rows: list[int], note: str = "") -> None:
        self.calls.append(Call("select", {"rows": rows}, "", note))
        self.rows = len(rows)
        if self.walk is not None:
            self.walk = self.walk[rows]

    def rollback(self, row: int, n: Any, error: str = "", note: str = "") -> None:
        self.calls.append(Call("rollback", {"row": row, "n": n}, error, note))

    def bad(self, method: str, args: dict[str, Any], error: str, note: str) -> None:
        self.calls.append(Call(method, args, error, note))

    def program(self) -> Program:
        return Program(self.op, self.opened, self.config, tuple(self.calls))


def _s4d_config(rng: np.random.Generator, H: int, M: int) -> dict[str, Any]:
    lam = rng.uniform(0.6, 0.98, (H, M)) * np.exp(1j * rng.uniform(-0.5, 0.5, (H, M)))
    b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
    c = (rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))) / np.sqrt(2 * M)
    return {
        "lam_re": lam.real,
        "lam_im": lam.imag,
        "b_re": b.real,
        "b_im": b.imag,
        "c_re": c.real,
        "c_im": c.imag,
    }


INTERDOMAIN_OPTIONS: list[dict[str, Any]] = [
    {"readout": "linear", "gate": False, "use_rope": False, "output_norm": True},
    {"readout": "ratio", "gate": True, "use_rope": True, "output_norm": False},
    {"readout": "linear", "gate": True, "use_rope": True, "output_norm": True},
]


def script(
    op: str,
    rng: np.random.Generator,
    n: int,
    rows: int,
    *,
    theta: float = 2.0 + 1 / 16,
    window: int | None = None,
    max_rollback: int = 0,
    heads: tuple[int, int] = (2, 2),
    **dims: Any,
) -> Script:
    """A fresh script for ``op`` with the session's config drawn from ``rng`` (case n picks the
    layer options)."""
    if op == "fpa_decode":
        HQ, H = heads
        d = {"heads": HQ, "kv_heads": H, "dk": 8, "dv": 8, **dims}
        config: dict[str, Any] = {
            "heads": HQ,
            "kv_heads": H,
            "dk": 8,
            "dv": 8,
            "scale": 1 / math.sqrt(8),
            "theta": theta,
            "window": window,
            "max_rollback": max_rollback,
        }
    elif op == "fox_attention":
        HQ, H = heads
        d = {"heads": HQ, "kv_heads": H, "dk": 8, "dv": 8, **dims}
        config = {
            "heads": HQ,
            "kv_heads": H,
            "dk": 8,
            "dv": 8,
            "scale": 1 / math.sqrt(8),
            "window": window,
            "max_rollback": max_rollback,
        }
    elif op == "interdomain_s4d":
        d = {"H": 2, "R": 4, "dv": 4}
        config = {**_s4d_config(rng, 2, 4), "max_rollback": max_rollback}
    elif op == "interdomain_legs":
        d = {"H": 2, "R": 4, "dv": 4}
        config = {"M": 6, "max_rollback": max_rollback}
    elif op == "fpa_layer":
        d = {"d": 16}
        params = fpa.init_fpa_params(16, 2, 4, 4, int(rng.integers(2**31)))
        params["b_lam"] = params["b_lam"] + 0.5  # levels above the field: keys can die
        config = {
            "params": params,
            "increments": ("signed", "logsigmoid")[n % 2],
            "theta": theta,
            "window": window,
            "max_rollback": max_rollback,
        }
    else:
        d = {"d": 16}
        options = INTERDOMAIN_OPTIONS[n % len(INTERDOMAIN_OPTIONS)]
        params = idm.init_interdomain_params(
            16,
            2,
            4,
            4,
            8,
            int(rng.integers(2**31)),
            gate=options["gate"],
            output_norm=options["output_norm"],
        )
        if options["readout"] == "ratio":
            params["norm_k_b"] = params["norm_k_b"] + 3.0  # positive k~: denominators away from 0
            params["c_re"] = params["c_re"] + np.eye(8)
        config = {"params": params, **options, "max_rollback": max_rollback}
    return Script(op, rng, rows, config, d)


# the families

Build = Callable[[np.random.Generator, int], Program]
FPA_OPS = ("fpa_decode", "fpa_layer")


def _prefill(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2)
        s.full(16, "prefill: one chunk (the only chunk over 8 tokens of the menu)")
        s.steps(6)
        return s.program()

    return build


def _chunked(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2)
        for size in (5, 2, 0, 7, 3, 4):
            s.full(size, "uneven chunked prefill")
        return s.program()

    return build


def _ragged(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        # row 0 never has a token; row 1 joins late; row 2 finishes early; row 3 throughout
        s = script(op, rng, n, 4, max_rollback=2)
        s.garbage_field = 1000.0  # absent positions here are not about the minima (padding is)
        plan = [(4, [0, 0, 1, 1]), (3, [0, 0, 1, 1]), (5, [0, 1, 1, 1]), (1, [0, 1, 1, 1])]
        plan += [(1, [0, 1, 0, 1]), (4, [0, 1, 0, 1]), (2, [0, 1, 0, 0])]
        for size, on in plan:
            s.advance(np.repeat(np.array(on, dtype=bool)[:, None], size, axis=1), "ragged rows")
        return s.program()

    return build


def _padding(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 3)
        prefill = np.ones((3, 8), dtype=bool)
        prefill[0, :3] = False  # left padding
        prefill[1, 6:] = False  # right padding
        s.advance(prefill, "left and right padding")
        s.steps(2)
        chunk = np.ones((3, 6), dtype=bool)
        chunk[0, 4:] = chunk[1, :2] = chunk[2, 2:4] = False
        s.advance(chunk, "padding at the end, the start and inside")
        s.steps(2)
        return s.program()

    return build


def _select(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 3, max_rollback=2)
        s.full(6)
        s.steps(1)
        s.select([0, 0, 2], "beam search: row 0 twice")
        s.steps(2)
        s.select([2, 1, 1, 0], "reorder and repeat")
        s.full(3)
        s.steps(2)
        return s.program()

    return build


def _rollback(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, max_rollback=3)
        s.full(7)
        s.steps(2)
        s.rollback(0, 2, note="within W")
        s.steps(1)
        s.rollback(1, 3, note="the whole budget")
        s.rollback(0, 0, note="no-op")
        s.full(5)
        s.rollback(0, 3, note="back into the chunk")
        s.rollback(1, 1)
        s.steps(3)
        return s.program()

    return build


def _rollback_past(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, max_rollback=2)
        s.full(6)
        s.rollback(0, 3, "max_rollback", "past W: the session is unchanged")
        s.steps(1)
        s.rollback(1, 2, note="the whole budget")
        s.rollback(1, 1, "n", "past the budget after a rollback")
        s.steps(1)
        s.rollback(1, 2, "n", "one token since the rollback")
        s.rollback(0, 1)
        s.steps(2)
        return s.program()

    return build


def _bad(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, max_rollback=1)
        s.full(5)
        good = s.chunk(np.ones((2, 2), dtype=bool))
        first = next(iter(good))
        wrong = dict(good)
        wrong[first] = np.concatenate([good[first], good[first][:1]])  # one row too many
        s.bad("advance", {"inputs": wrong, "present": np.ones((2, 2), bool)}, first, "rows + 1")
        s.steps(1)
        s.bad("advance", {"inputs": good, "present": np.ones((2, 3), bool)}, "present", "n + 1")
        s.bad("advance", {"inputs": good, "present": np.ones((2, 2))}, "present", "float mask")
        missing = {k: v for k, v in good.items() if k != first}
        s.bad("advance", {"inputs": missing, "present": np.ones((2, 2), bool)}, "inputs", "")
        s.steps(1)
        s.bad("select", {"rows": [0, 2]}, "rows", "out of range")
        s.bad("select", {"rows": []}, "rows", "empty")
        s.bad("rollback", {"row": 2, "n": 1}, "row", "out of range")
        s.bad("rollback", {"row": 0, "n": 0.5}, "n", "not an integer")
        s.full(2)
        return s.program()

    return build


def _long(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        # one row, over 300 tokens; FPA: keys rise with the field, so over 128 stay live
        extra: dict[str, Any] = {}
        if op == "fpa_decode":
            extra = {"drift": 0.3, "offset": -1.0}
        theta = 3.0 + 1 / 16 if op == "fpa_decode" else 8.0 + 1 / 16
        s = script(op, rng, n, 1, theta=theta, **extra)
        for size in [8] * 38 + [1, 3]:
            s.full(size, "long session in chunks of 8")
        s.steps(2)
        return s.program()

    return build


# Long sessions: case 0 short enough for every CI subset (256 tokens: drift 40 a token, a mode
# of abs(Lambda) = 0.05, whose abs(Lambda)^-t passes 1e308 at t = 237), case 1 at 2,048 tokens
# (drift 5 a token; abs(Lambda) = 0.6, the least of the menu: past 1e308 at t = 1390).
LONG_SESSION = [(256, 40.0, 0.05), (2048, 5.0, 0.6)]  # (tokens, drift, least abs(Lambda))


def _long_chunks(s: Script, tokens: int, note: str) -> None:
    for _ in range(tokens // 128 - 1):
        s.full(128, note + ", in chunks of 128")
    s.full(120)


def _drift(rng: np.random.Generator, n: int) -> Program:
    """fpa_decode: one row whose field rises by 40 (case 0) or 5 (case 1) a token, levels 1
    below it: |phi| passes 1e4."""
    tokens, drift, _ = LONG_SESSION[n]
    s = script(
        "fpa_decode",
        rng,
        n,
        1,
        theta=3.0 + 1 / 16,
        window=32,
        max_rollback=4,
        drift=drift,
        offset=-1.0,
    )
    _long_chunks(s, tokens, "a field drifting past 1e4")
    s.steps(4)
    s.rollback(0, 3, note="a rollback at |phi| > 1e4")
    s.steps(4)
    return s.program()


def _horizon(rng: np.random.Generator, n: int) -> Program:
    """interdomain_s4d: one row with a mode of small abs(Lambda), past the step where
    abs(Lambda)^-t passes the float64 range."""
    tokens, _, least = LONG_SESSION[n]
    s = script("interdomain_s4d", rng, n, 1, max_rollback=2)
    lam = s.config["lam_re"][0, 0] + 1j * s.config["lam_im"][0, 0]
    unit = lam / abs(lam)
    s.config["lam_re"][0, 0], s.config["lam_im"][0, 0] = (least * unit).real, (least * unit).imag
    _long_chunks(s, tokens, "past the horizon of an unrescaled state")
    s.steps(4)
    s.rollback(0, 2, note="a rollback past the horizon")
    s.steps(4)
    return s.program()


def _gqa(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, heads=(4, 2), max_rollback=2)
        s.full(8, "each query head on its own field")
        s.steps(3)
        s.full(5)
        s.steps(2)
        return s.program()

    return build


def _theta_exact(rng: np.random.Generator, n: int) -> Program:
    s = script("fpa_decode", rng, n, 2, theta=2.0)
    s.full(8, "depths reach theta = 2 exactly inside the chunk")
    s.steps(3)
    s.full(6)
    s.full(7)
    return s.program()


def _theta_exact_fpa(rng: np.random.Generator, n: int) -> Program:
    """Integer steps of the field and integer offsets: many depths equal theta exactly."""
    program = _theta_exact(rng, n)
    calls = []
    for call in program.calls:
        inputs = dict(call.args["inputs"])
        present = call.args["present"][:, None, :]
        inputs["field"] = np.where(present, np.round(inputs["field"]), inputs["field"])
        inputs["level"] = np.where(present, np.round(inputs["level"]), inputs["level"])
        calls.append(Call(call.method, {**call.args, "inputs": inputs}, call.error, call.note))
    return Program(program.op, program.rows, program.config, tuple(calls))


def _dense(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, theta=math.inf)
        for size in (6, 1, 4):
            s.full(size, "theta = inf: the parallel op")
        s.steps(2)
        return s.program()

    return build


def _window(op: str) -> Build:
    def build(rng: np.random.Generator, n: int) -> Program:
        s = script(op, rng, n, 2, window=4)
        for size in (3, 6, 1, 5):
            s.full(size, "window W = 4 across chunks")
        s.steps(2)
        return s.program()

    return build


COMMON = {
    "prefill": (_prefill, "prefill (one chunk), then one-token steps"),
    "chunked": (_chunked, "uneven chunked prefill (a chunk of 0 included)"),
    "ragged": (_ragged, "a row of length 0, a row that joins late, a row that finishes early"),
    "padding": (_padding, "left, right and inner padding (absent positions hold garbage)"),
    "select": (_select, "select with repetitions (beam search); copies then go their own way"),
    "rollback": (_rollback, "rollback within W, into a chunk, of the whole budget, n = 0"),
    "rollback_past": (_rollback_past, "rollback past W and past the budget: ValueError, then on"),
    "bad": (_bad, "bad input (shapes, mask, select, rollback): ValueError, session unchanged"),
    "long": (_long, "one row, 310 tokens in chunks of 8 (FPA: over 128 live keys)"),
}
FPA_ONLY = {
    "gqa": (_gqa, "GQA (HQ = 4, H = 2): live per query head, stored by the union rule"),
    "theta_exact": (
        lambda op: _theta_exact_fpa,
        "integer field and levels: depths equal to theta = 2 inside a chunk",
    ),
}
DENSE = {
    "dense": (_dense, "theta = inf: equals the parallel op"),
    "window": (_window, "window W = 4 (F3w) across chunk borders, finite theta"),
}


LONG_SESSIONS = ("drift", "horizon")  # 256 and 2,048 tokens a row: seconds per backend
LONG = ("long",)  # one case


def _families(op: str) -> dict[str, tuple[int, Build, str]]:
    menu: dict[str, tuple[Callable[[str], Build], str]] = dict(COMMON)
    if op == "fpa_decode":
        menu.update(FPA_ONLY)
    if op in FPA_OPS:
        menu.update(DENSE)
    if op == "fox_attention":
        menu.update({"gqa": FPA_ONLY["gqa"], "window": DENSE["window"]})
    if op == "fpa_decode":
        menu["drift"] = (lambda op: _drift, "one row of 256 and 2,048 tokens, fields past 1e4")
    if op == "interdomain_s4d":
        menu["horizon"] = (
            lambda op: _horizon,
            "one row of 256 and 2,048 tokens with a mode abs(Lambda) = 0.05 and 0.6",
        )
    return {name: (1 if name in LONG else 2, make(op), note) for name, (make, note) in menu.items()}


OPS = (
    "fpa_decode",
    "fox_attention",
    "interdomain_s4d",
    "interdomain_legs",
    "fpa_layer",
    "interdomain_layer",
)
FAMILIES: dict[str, dict[str, tuple[int, Build, str]]] = {op: _families(op) for op in OPS}
