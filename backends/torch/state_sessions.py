"""Decode sessions of the Interdomain states (spec/interdomain.md I15, spec/fpa.md F8 rows, F9).

A session holds R rows, each its own fixed-size state: the S4D state x (I11), the LegS
coefficients c_t with their step counter t (I5), or the Interdomain layer's short-convolution
windows (I8) with its S4D state. The recurrences are those of :mod:`.decode`
(:class:`S4DDecodeState`, :class:`LegSDecodeState`) and :meth:`.InterdomainAttention.step`,
run on the rows a chunk position holds a token for (grouped by the row's token index where the
step depends on it: LegS's t, RoPE's position). Absent positions do not advance a row and
output 0.

Rollback (F9, I15): each row keeps a snapshot of its state before its last b <= W tokens and
those b inputs; rollback(r, n) recomputes the row forward from the snapshot over the first
b - n of them. b is the contract's rollback budget: it grows by each new token up to W (the
snapshot then advances by the oldest input) and shrinks by each rollback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from attnspec.backends import session_checks
from attnspec.reference.ops import session_contract
from attnspec.reference.validation import positive_int

from . import checks
from .decode import LegSDecodeState, S4DDecodeState
from .modules import InterdomainAttention, InterdomainLayerState

State = dict[str, Tensor]  # each entry (rows, ...)
Token = dict[str, Tensor]  # one token's inputs, each (rows, ...)


class StateStep(Protocol):
    """One op's recurrence as a session sees it."""

    inputs: tuple[str, ...]
    uses_position: bool  # whether the step depends on the row's token index

    def check(self, inputs: dict[str, Tensor], R: int) -> int:
        """Validate a chunk of ``R`` rows; returns its n positions."""
        ...

    def zeros(self, R: int) -> State:
        """The state before the first token, for R rows."""
        ...

    def token(self, inputs: dict[str, Tensor], rows: Tensor, p: int) -> Token:
        """Chunk position p of ``rows``."""
        ...

    def step(self, state: State, token: Token, t: int) -> tuple[Tensor, State]:
        """Token index t of every row in ``state``: (outputs (rows, ...), next state)."""
        ...

    def outputs(self, R: int, n: int) -> Tensor:
        """Zeros in the output layout of a chunk."""
        ...

    def put(self, out: Tensor, rows: Tensor, p: int, value: Tensor) -> None:
        """Write one position's outputs of ``rows``."""
        ...

    output_name: str


def _rows_of(state: State, rows: Tensor) -> State:
    return {name: x[rows] for name, x in state.items()}


def _put_rows(state: State, rows: Tensor, new: State) -> State:
    """A new state dict, ``rows`` replaced (the old tensors are not modified)."""
    out = {}
    for name, x in state.items():
        y = x.clone()
        y[rows] = new[name]
        out[name] = y
    return out


class _Features:
    """The op sessions: inputs (R, H, n, dim) as the parallel ops, output o (R, H, n, dv)."""

    output_name = "o"
    uses_position = False

    def __init__(
        self,
        names: tuple[str, str, str],
        heads: int | None,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.inputs: tuple[str, ...] = names
        self.heads, self.dtype, self.device = heads, dtype, device
        self.dims: tuple[int, int, int] | None = None  # (H, R, dv) of the first advance

    def check(self, inputs: dict[str, Tensor], R: int) -> int:
        a, b, c = self.inputs
        fq = checks.tensor(
            a, inputs.get(a), 4, (self.dtype,), "(R, H, n, dim) in the session's dtype"
        )
        H, n, F = fq.shape[1:]
        if fq.shape[0] != R or (self.heads is not None and H != self.heads):
            heads = "H" if self.heads is None else str(self.heads)
            raise ValueError(
                f"{a}: expected shape ({R}, {heads}, n, R) (R rows), got {tuple(fq.shape)}"
            )
        checks.tensor(b, inputs.get(b), 4, (self.dtype,), "(R, H, n, dim) in the session's dtype")
        checks.shape(b, inputs[b], (R, H, n, F), f"(R, H, n, R) as {a}")
        v = checks.tensor(
            c, inputs.get(c), 4, (self.dtype,), "(R, H, n, dv) in the session's dtype"
        )
        if v.shape[:3] != (R, H, n):
            raise ValueError(
                f"{c}: expected shape ({R}, {H}, {n}, dv) (as {a}), got {tuple(v.shape)}"
            )
        dims = (H, F, v.shape[3])
        if self.dims is not None and dims != self.dims:
            raise ValueError(
                f"{a}, {c}: expected the (H, R, dv) {self.dims} of the first advance, got {dims}"
            )
        return n

    def token(self, inputs: dict[str, Tensor], rows: Tensor, p: int) -> Token:
        return {name: inputs[name][rows, :, p] for name in self.inputs}

    def outputs(self, R: int, n: int) -> Tensor:
        assert self.dims is not None
        H, _, dv = self.dims
        return torch.zeros(R, H, n, dv, dtype=self.dtype, device=self.device)

    def put(self, out: Tensor, rows: Tensor, p: int, value: Tensor) -> None:
        out[rows, :, p] = value


class S4DStep(_Features):
    """(I11)-(I13) by :class:`S4DDecodeState`; state x (rows, H, M, C) complex."""

    def __init__(self, lam: Tensor, b: Tensor, c: Tensor, readout: str, dtype: torch.dtype):
        super().__init__(("fq", "kt", "vt"), lam.shape[0], dtype, lam.device)
        self.recurrence = S4DDecodeState(lam, b, c, readout=readout)
        self.readout = readout

    def zeros(self, R: int) -> State:
        assert self.dims is not None
        H, F, dv = self.dims
        lam = self.recurrence.lam
        C = F + dv + (self.readout == "ratio")
        return {"x": torch.zeros(R, H, lam.shape[1], C, dtype=lam.dtype, device=lam.device)}

    def step(self, state: State, token: Token, t: int) -> tuple[Tensor, State]:
        self.recurrence.state = state["x"]
        o = self.recurrence.step(token["fq"], token["kt"], token["vt"])
        return o, {"x": self.recurrence.state}


class LegSStep(_Features):
    """(I5), (I3) by :class:`LegSDecodeState`; state c (rows, H, M, R + dv), step t per row."""

    uses_position = True

    def __init__(self, M: int, dtype: torch.dtype, device: torch.device):
        super().__init__(("fq", "fk", "v"), None, dtype, device)
        self.recurrence = LegSDecodeState(M)

    def zeros(self, R: int) -> State:
        assert self.dims is not None
        H, F, dv = self.dims
        wide = torch.promote_types(self.dtype, torch.float32)
        M = self.recurrence.M
        return {"c": torch.zeros(R, H, M, F + dv, dtype=wide, device=self.device)}

    def step(self, state: State, token: Token, t: int) -> tuple[Tensor, State]:
        self.recurrence.n, self.recurrence.coefficients = t, state["c"]  # token t + 1 (1-based)
        o = self.recurrence.step(token["fq"], token["fk"], token["v"])
        assert self.recurrence.coefficients is not None
        return o, {"c": self.recurrence.coefficients}


class InterdomainLayerStep:
    """:meth:`InterdomainAttention.step`: x (R, n, d) -> y (R, n, d); state the windows
    conv_q, conv_k (rows, S - 1, H R) (I8) and the S4D state x (rows, H, M, C)."""

    inputs: tuple[str, ...] = ("x",)
    output_name = "y"

    def __init__(self, layer: InterdomainAttention, dtype: torch.dtype, device: torch.device):
        self.layer, self.dtype, self.device = layer, dtype, device
        self.uses_position = layer.use_rope
        self.ssm = layer.new_cache().ssm

    def check(self, inputs: dict[str, Tensor], R: int) -> int:
        x = checks.tensor(
            "x", inputs.get("x"), 3, (self.dtype,), "(R, n, d) in the session's dtype"
        )
        if x.shape[0] != R or x.shape[2] != self.layer.d_model:
            raise ValueError(
                f"x: expected shape ({R}, n, {self.layer.d_model}), got {tuple(x.shape)}"
            )
        return int(x.shape[1])

    def zeros(self, R: int) -> State:
        layer = self.layer
        H, M = layer.n_heads, layer.n_modes
        C = layer.head_dim + layer.value_dim + (layer.readout == "ratio")
        lam = self.ssm.lam
        window = (R, layer.conv_q.shape[0] - 1, H * layer.head_dim)
        return {
            "x": torch.zeros(R, H, M, C, dtype=lam.dtype, device=self.device),
            "conv_q": torch.zeros(window, dtype=self.layer.wq.dtype, device=self.device),
            "conv_k": torch.zeros(window, dtype=self.layer.wq.dtype, device=self.device),
        }

    def token(self, inputs: dict[str, Tensor], rows: Tensor, p: int) -> Token:
        return {"x": inputs["x"][rows, p].to(self.layer.wq.dtype)}

    def step(self, state: State, token: Token, t: int) -> tuple[Tensor, State]:
        self.ssm.state = state["x"]
        layer_state = InterdomainLayerState(self.ssm, state["conv_q"], state["conv_k"], t)
        y = self.layer.step(token["x"], layer_state)
        assert layer_state.conv_q is not None and layer_state.conv_k is not None
        assert self.ssm.state is not None
        return y, {"x": self.ssm.state, "conv_q": layer_state.conv_q, "conv_k": layer_state.conv_k}

    def outputs(self, R: int, n: int) -> Tensor:
        return torch.zeros(R, n, self.layer.d_model, dtype=self.dtype, device=self.device)

    def put(self, out: Tensor, rows: Tensor, p: int, value: Tensor) -> None:
        out[rows, p] = value.to(out.dtype)


@dataclass
class _Rows:
    """The per-row bookkeeping: tokens seen and the inputs kept for rollback (b = len)."""

    tokens: list[int]
    kept: list[list[Token]]  # per row, its last b tokens' inputs, oldest first


class StateSession:
    """A decode session of R rows over one :class:`StateStep` (the session contract of
    docs/conformance.md): ``advance``, ``select``, ``rollback``, ``counts``.

    Every call checks its arguments first and commits only at its end, so a call that raises
    leaves the session as it was. Time per advance O(n R) steps of the recurrence (twice with
    W > 0: the snapshot follows W tokens behind); memory O(R (state + W inputs)).
    """

    def __init__(self, step: StateStep, rows: int, max_rollback: int):
        self.kind = step
        self.R = positive_int("rows", rows)
        self.W = max_rollback
        self.state: State | None = None
        self.snapshot: State | None = None  # each row's state before its kept tokens
        self.rows = _Rows([0] * self.R, [[] for _ in range(self.R)])

    def _check_present(self, present: object, n: int) -> Tensor:
        if not isinstance(present, Tensor) or present.dtype != torch.bool:
            kind = getattr(present, "dtype", type(present).__name__)
            raise ValueError(f"present: expected a torch.bool tensor (R, n), got {kind}")
        checks.shape("present", present, (self.R, n), "(R, n): rows by chunk positions")
        return present.to("cpu")

    def _steps(
        self, state: State, tokens: dict[int, Token], t: dict[int, int]
    ) -> tuple[dict[int, Tensor], State]:
        """One step of each row r in ``tokens`` at its token index t[r], batched over the rows
        that share t where the step depends on it."""
        groups: dict[int, list[int]] = {}
        for r in tokens:
            groups.setdefault(t[r] if self.kind.uses_position else 0, []).append(r)
        outs: dict[int, Tensor] = {}
        for members in groups.values():
            rows = torch.tensor(members, device=next(iter(state.values())).device)
            token = {
                name: torch.stack([tokens[r][name] for r in members]) for name in self.kind.inputs
            }
            out, new = self.kind.step(_rows_of(state, rows), token, t[members[0]])
            state = _put_rows(state, rows, new)
            outs.update({r: out[i] for i, r in enumerate(members)})
        return outs, state

    def advance(self, inputs: dict[str, Tensor], present: Tensor) -> dict[str, Tensor]:
        """(F8 rows, I15) the chunk's present positions, in order, as steps of their rows."""
        if not isinstance(inputs, dict) or set(inputs) != set(self.kind.inputs):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"inputs: expected the names {sorted(self.kind.inputs)}, got {got}")
        n = self.kind.check(inputs, self.R)
        mask = self._check_present(present, n)
        if isinstance(self.kind, _Features) and self.kind.dims is None:  # fixed from now on
            a, _, c = self.kind.inputs
            self.kind.dims = (inputs[a].shape[1], inputs[a].shape[3], inputs[c].shape[3])
        with torch.no_grad():
            state = self.kind.zeros(self.R) if self.state is None else self.state
            snapshot = state if self.snapshot is None else self.snapshot
            tokens, kept = list(self.rows.tokens), [list(k) for k in self.rows.kept]
            out = self.kind.outputs(self.R, n)
            for p in range(n):
                rows = mask[:, p].nonzero()[:, 0].tolist()
                if not rows:
                    continue
                index = torch.tensor(rows, device=out.device)
                chunk = self.kind.token(inputs, index, p)
                new = {r: {name: x[i] for name, x in chunk.items()} for i, r in enumerate(rows)}
                outs, state = self._steps(state, new, {r: tokens[r] for r in rows})
                self.kind.put(out, index, p, torch.stack([outs[r] for r in rows]))
                oldest: dict[int, Token] = {}
                for r in rows:
                    tokens[r] += 1
                    if self.W:
                        kept[r].append(new[r])
                        if len(kept[r]) > self.W:
                            oldest[r] = kept[r].pop(0)
                if oldest:  # the snapshot follows W tokens behind
                    behind = {r: tokens[r] - self.W - 1 for r in oldest}
                    _, snapshot = self._steps(snapshot, oldest, behind)
        self.state, self.snapshot = state, snapshot
        self.rows = _Rows(tokens, kept)
        return {self.kind.output_name: out}

    def select(self, rows: Sequence[int]) -> None:
        """(F9) the listed rows, in order, repetitions allowed: exact copies."""
        picked = session_checks.selected_rows(rows, self.R)
        if self.state is not None and self.snapshot is not None:
            index = torch.tensor(picked, device=next(iter(self.state.values())).device)
            self.state = _rows_of(self.state, index)
            self.snapshot = _rows_of(self.snapshot, index)
        self.rows = _Rows(
            [self.rows.tokens[r] for r in picked], [list(self.rows.kept[r]) for r in picked]
        )
        self.R = len(picked)

    def rollback(self, row: int, n: int) -> None:
        """(F9, I15) row returns to its state after its first t - n tokens: recomputed from
        its snapshot over its kept inputs but the last n."""
        budget = [len(k) for k in self.rows.kept]
        row, n = session_checks.rollback_args(row, n, self.R, self.W, budget)
        if n == 0 or self.state is None or self.snapshot is None:
            return
        kept = self.rows.kept[row]
        start = self.rows.tokens[row] - len(kept)
        with torch.no_grad():
            index = torch.tensor([row], device=next(iter(self.state.values())).device)
            state = _put_rows(self.state, index, _rows_of(self.snapshot, index))
            for i, token in enumerate(kept[: len(kept) - n]):
                _, state = self._steps(state, {row: token}, {row: start + i})
        tokens = list(self.rows.tokens)
        tokens[row] -= n
        all_kept = [list(k) for k in self.rows.kept]
        all_kept[row] = kept[: len(kept) - n]
        self.state, self.rows = state, _Rows(tokens, all_kept)

    def counts(self) -> dict[str, Tensor]:
        """{"tokens": (R,) int64}, the tokens seen per row."""
        return {"tokens": torch.tensor(self.rows.tokens, dtype=torch.int64)}


def _config(op: str, config: dict[str, Any], extra: tuple[str, ...] = ()) -> None:
    """``config`` against the op's session contract (reference/ops.py) and the adapter's
    ``extra`` keys: nothing unknown, nothing required missing."""
    contract = session_contract(op)
    known, required = set(contract.keys) | set(extra), set(contract.required)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; expected some of {sorted(known)}")
    missing = sorted(required - set(config))
    if missing:
        raise ValueError(f"config: missing {missing}")


def s4d_session(rows: int, dtype: torch.dtype, config: dict[str, Any]) -> StateSession:
    """interdomain_s4d.session: config lam_re, lam_im, b_re, b_im (H, M), c_re, c_im
    (H, M, M) as the parallel op takes them (float32 or wider), readout (default "linear"),
    max_rollback."""
    pairs = ("lam", "b", "c")
    _config("interdomain_s4d", config)
    joined = []
    for p in pairs:
        re, im = config[f"{p}_re"], config[f"{p}_im"]
        for name, x in ((f"{p}_re", re), (f"{p}_im", im)):
            checks.tensor(
                name, x, 3 if p == "c" else 2, checks.WIDE_DTYPES, "real, float32 or wider"
            )
        checks.shape(f"{p}_im", im, tuple(re.shape), f"as {p}_re")
        joined.append(torch.complex(re, im))
    readout = checks.readout(config.get("readout", "linear"))
    W = session_checks.max_rollback(config)
    return StateSession(S4DStep(joined[0], joined[1], joined[2], readout, dtype), rows, W)


def legs_session(
    rows: int, dtype: torch.dtype, device: torch.device, config: dict[str, Any]
) -> StateSession:
    """interdomain_legs.session: config M (modes), max_rollback."""
    _config("interdomain_legs", config)
    M = positive_int("M", config["M"])
    return StateSession(LegSStep(M, dtype, device), rows, session_checks.max_rollback(config))


def interdomain_layer_session(
    rows: int, dtype: torch.dtype, device: torch.device, config: dict[str, Any]
) -> StateSession:
    """interdomain_layer.session: config params (the reference's dict), the options readout,
    gate, use_rope, output_norm (flat or as a dict "options"), max_rollback."""
    flags = ("readout", "gate", "use_rope", "output_norm")
    _config("interdomain_layer", config, ("options",))
    options = {**config.get("options", {}), **{f: config[f] for f in flags if f in config}}
    params = dict(config["params"])
    if not options.get("gate", "wg" in params):
        params.pop("wg", None)
    output_norm = bool(options.get("output_norm", True))
    if not output_norm:
        params.pop("norm_o_g", None)
    layer = InterdomainAttention.from_reference_params(
        params,
        readout=options.get("readout", "linear"),
        use_rope=bool(options.get("use_rope", False)),
        output_norm=output_norm,
        device=device,
        dtype=torch.promote_types(dtype, torch.float32),
    )
    W = session_checks.max_rollback(config)
    return StateSession(InterdomainLayerStep(layer, dtype, device), rows, W)
