"""The JAX backend's decode sessions for the conformance kit (the session contract of
docs/conformance.md): :class:`JaxSession`, the kit's stateful view of a pure session of
:mod:`.sessions`, and per op its :class:`_SessionSpec` (names, layout, checks and the jitted pure
functions). ``kit.JaxBackend.open_session`` opens them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnspec.backends import session_checks
from attnspec.reference.ops import session_contract, session_inputs
from attnspec.reference.validation import positive_int, threshold

from . import compile_budget, layers, sessions, validation

SESSION_CAPACITY = 1024  # default fixed capacity: FPA slots per (row, kv head), LegS steps


def session_rows_bucket(R: int) -> int:
    """Rows a session state holds: R padded to a power of two, at least 4 (padding rows never
    hold a token: exact), so that the programs compile once per bucket."""
    return compile_budget.pow2(max(R, 4))


class JaxSession:
    """The kit's stateful view of a pure session of :mod:`.sessions` (the session contract of
    docs/conformance.md). Each call checks its arguments, runs the jitted pure functions and
    commits the new state only when it succeeded: a full fixed capacity (``overflowed``) is a
    ValueError naming the capacity, the session unchanged.

    Compilation [decision]: the kit's programs have chunks of every size and row counts that
    select changes; one program per shape compiled for longer than the steps take. So the state
    holds :func:`session_rows_bucket` rows (the real ones first) and a chunk runs position by
    position through the jitted advance of one position: one program per (op, row bucket,
    dtype).

    spec: the op's names, layout and functions (``_SessionSpec``); rows, max_rollback.
    """

    def __init__(self, spec: _SessionSpec, rows: int, max_rollback: int, device: jax.Device):
        self.spec, self.R, self.W, self.device = spec, rows, max_rollback, device
        self.state: Any = None  # made at the first advance (dims of the features)
        self.dims: tuple[int, ...] | None = None

    def _present(self, present: object, n: int) -> np.ndarray:
        if not isinstance(present, jax.Array | np.ndarray) or present.dtype != bool:
            kind = getattr(present, "dtype", type(present).__name__)
            raise ValueError(f"present: expected a bool array (R, n), got {kind}")
        if tuple(present.shape) != (self.R, n):
            raise ValueError(
                f"present: expected shape ({self.R}, {n}) (rows by chunk positions), got "
                f"{tuple(present.shape)}"
            )
        return np.asarray(present)

    def _padded(self, x: np.ndarray) -> np.ndarray:
        rows = session_rows_bucket(self.R) - x.shape[0]
        return np.pad(x, [(0, rows)] + [(0, 0)] * (x.ndim - 1))

    def advance(self, inputs: dict[str, jax.Array], present: jax.Array) -> dict[str, jax.Array]:
        with jax.enable_x64(True):
            spec = self.spec
            if not isinstance(inputs, dict) or set(inputs) != set(spec.inputs):
                got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
                raise ValueError(f"inputs: expected the names {sorted(spec.inputs)}, got {got}")
            n, dims = spec.check(inputs, self.R)
            if self.dims is not None and dims != self.dims:
                raise ValueError(
                    f"{', '.join(spec.inputs)}: expected the dims {self.dims} of the first "
                    f"advance, got {dims}"
                )
            flags = self._padded(self._present(present, n))
            Rp = session_rows_bucket(self.R)
            state = spec.empty(Rp, dims, self.W) if self.state is None else self.state
            if n == 0:
                self.state, self.dims = state, dims
                return {spec.output: spec.empty_output(self.R, dims, inputs)}
            axis = spec.axis
            host = {name: self._padded(np.asarray(x)) for name, x in inputs.items()}
            outs, new = [], state
            for p in range(n):
                position = {
                    name: jax.device_put(np.take(x, [p], axis=axis), self.device)
                    for name, x in host.items()
                }
                compile_budget.count_program("session." + spec.op, "xla", Rp, position)
                out, new = spec.advance(
                    new, position, jax.device_put(flags[:, p : p + 1], self.device)
                )
                outs.append(out)
            overflowed = np.asarray(sessions.session_counts(new)["overflowed"])[: self.R]
            if overflowed.any():
                raise ValueError(
                    f"capacity: the session's fixed capacity of {spec.capacity} "
                    f"{spec.capacity_unit} is full (overflowed); open it with a larger "
                    "config['capacity']"
                )
            self.state, self.dims = new, dims
            return {spec.output: jnp.concatenate(outs, axis=axis)[: self.R]}

    def select(self, rows: Any) -> None:
        picked = session_checks.selected_rows(rows, self.R)
        if self.state is not None:
            index = picked + [0] * (session_rows_bucket(len(picked)) - len(picked))
            with jax.enable_x64(True):
                self.state = sessions.session_select(self.state, jnp.asarray(index, jnp.int32))
        self.R = len(picked)

    def rollback(self, row: int, n: int) -> None:
        budget = [0] * self.R if self.state is None else self._budget()[: self.R]
        row, n = session_checks.rollback_args(row, n, self.R, self.W, budget)
        if n == 0:
            return
        undo = np.zeros(session_rows_bucket(self.R), np.int32)
        undo[row] = n
        with jax.enable_x64(True):
            self.state = self.spec.rollback(self.state, jax.device_put(undo, self.device))

    def _budget(self) -> list[int]:
        s = self.state
        budget = s.attention.budget if isinstance(s, sessions.FPALayerSession) else s.budget
        return [int(b) for b in np.asarray(budget)]

    def counts(self) -> dict[str, jax.Array]:
        with jax.enable_x64(True):
            if self.state is None:
                return {"tokens": jnp.zeros(self.R, jnp.int32)}
            return {k: v[: self.R] for k, v in sessions.session_counts(self.state).items()}


class _SessionSpec:
    """One op's session for :class:`JaxSession`: its inputs and output, the position axis of
    its chunks, the checks, and the pure functions bound to its configuration."""

    def __init__(
        self,
        op: str,
        *,
        dtype: jnp.dtype,
        check: Any,
        empty: Any,
        advance: Any,
        rollback: Any,
        capacity: int | None = None,
        capacity_unit: str = "",
    ) -> None:
        contract = session_contract(op)  # the op's card (reference/ops.py)
        self.op, self.inputs, self.output, self.dtype = (
            op,
            session_inputs(op),
            contract.output,
            dtype,
        )
        self.axis = contract.token_axis
        self.check, self.empty, self.advance, self.rollback = check, empty, advance, rollback
        self.capacity, self.capacity_unit = capacity, capacity_unit

    def empty_output(
        self, R: int, dims: tuple[int, ...], inputs: dict[str, jax.Array]
    ) -> jax.Array:
        first = inputs[self.inputs[0]]
        if self.axis == 1:
            return jnp.zeros((R, 0, first.shape[2]), self.dtype)
        value = inputs[self.inputs[2]]
        return jnp.zeros((R, first.shape[1], 0, value.shape[3]), self.dtype)


def _array(name: str, x: object, ndim: int, dtype: jnp.dtype | None, meaning: str) -> jax.Array:
    if not isinstance(x, jax.Array):
        raise ValueError(f"{name}: expected a jax.Array {meaning}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions {meaning}, got shape {x.shape}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {jnp.dtype(dtype).name}, got {x.dtype}")
    if dtype is None and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}: expected a real floating array, got {x.dtype}")
    return x


def _config_keys(
    op: str, config: dict[str, Any], extra: set[str], defaults: tuple[str, ...] = ()
) -> None:
    """``config`` against the op's session contract (reference/ops.py): no key outside its keys
    and the adapter's ``extra`` ones, none of its required keys missing but those the adapter
    gives a default (``defaults``)."""
    contract = session_contract(op)
    known = set(contract.keys) | extra
    required = set(contract.required) - set(defaults)
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"config: unknown keys {unknown}; expected some of {sorted(known)}")
    missing = sorted(required - set(config))
    if missing:
        raise ValueError(f"config: missing {missing}")


def _capacity(config: dict[str, Any]) -> int:
    return positive_int("capacity", config.get("capacity", SESSION_CAPACITY))


def _theta_window(config: dict[str, Any], ct: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    theta = config.get("theta", np.inf)
    threshold("theta", theta)
    window = config.get("window")
    window = sessions.NO_WINDOW if window is None else positive_int("window", window)
    return jnp.asarray(theta, ct), jnp.asarray(window, jnp.int32)


def _fpa_decode_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    _config_keys("fpa_decode", config, {"capacity"}, defaults=("scale",))  # scale: 1/sqrt(dk)
    HQ, H = (positive_int(n, config[n]) for n in ("heads", "kv_heads"))
    dk, dv = (positive_int(n, config[n]) for n in ("dk", "dv"))
    if HQ % H:
        raise ValueError(f"kv_heads: expected a divisor of heads = {HQ}, got {H}")
    ct = jnp.result_type(jnp.float32, dtype)
    theta, window = _theta_window(config, ct)
    scale = config.get("scale")
    scale = jnp.asarray(1.0 / np.sqrt(dk) if scale is None else float(scale), ct)
    capacity = _capacity(config)

    def check(x: dict[str, jax.Array], R: int) -> tuple[int, tuple[int, ...]]:
        q = _array("q", x["q"], 4, dtype, "(R, HQ, n, dk)")
        n = q.shape[2]
        for name, heads, width in (("q", HQ, dk), ("k", H, dk), ("v", H, dv)):
            y = _array(name, x[name], 4, dtype, "(R, heads, n, dim)")
            validation.shape(name, y, (R, heads, n, width), f"{R} rows, {heads} heads, n of q")
        for name in ("field", "level"):
            validation.shape(
                name, _array(name, x[name], 3, None, "(R, HQ, n)"), (R, HQ, n), "(R, HQ, n)"
            )
        return n, ()

    def empty(R: int, dims: tuple[int, ...], W: int) -> sessions.FPASession:
        return sessions.fpa_session(
            R, HQ, H, dk, dv, capacity=capacity, max_rollback=W, dtype=dtype
        )

    def advance(state: Any, x: dict[str, jax.Array], present: jax.Array) -> Any:
        wide = {n: x[n].astype(ct) for n in ("field", "level")}
        return sessions.fpa_advance(
            state,
            x["q"],
            x["k"],
            x["v"],
            wide["field"],
            wide["level"],
            present,
            scale,
            theta,
            window,
        )

    return _SessionSpec(
        "fpa_decode",
        dtype=dtype,
        check=check,
        empty=empty,
        advance=advance,
        rollback=sessions.fpa_rollback,
        capacity=capacity,
        capacity_unit="slots per (row, kv head)",
    )


def _features_check(names: tuple[str, str, str], dtype: jnp.dtype, heads: int | None) -> Any:
    a, b, c = names

    def check(x: dict[str, jax.Array], R: int) -> tuple[int, tuple[int, ...]]:
        fq = _array(a, x[a], 4, dtype, "(R, H, n, R)")
        H, n, F = fq.shape[1:]
        if fq.shape[0] != R or (heads is not None and H != heads):
            raise ValueError(f"{a}: expected shape ({R}, {heads or 'H'}, n, R), got {fq.shape}")
        validation.shape(b, _array(b, x[b], 4, dtype, "(R, H, n, R)"), (R, H, n, F), f"as {a}")
        v = _array(c, x[c], 4, dtype, "(R, H, n, dv)")
        if v.shape[:3] != (R, H, n):
            raise ValueError(f"{c}: expected shape ({R}, {H}, {n}, dv) (as {a}), got {v.shape}")
        return n, (H, F, v.shape[3])

    return check


def _s4d_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    _config_keys("interdomain_s4d", config, set())
    readout = config.get("readout", "linear")
    if readout not in ("linear", "ratio"):
        raise ValueError(f"readout: expected 'linear' or 'ratio', got {readout!r}")
    pairs = {
        p: jnp.asarray(config[f"{p}_re"]) + 1j * jnp.asarray(config[f"{p}_im"])
        for p in ("lam", "b", "c")
    }
    H, M = pairs["lam"].shape
    if pairs["b"].shape != (H, M) or pairs["c"].shape != (H, M, M):
        raise ValueError(
            f"b_re, c_re: expected shapes ({H}, {M}) and ({H}, {M}, {M}) (H, M of lam), got "
            f"{pairs['b'].shape} and {pairs['c'].shape}"
        )
    lam, b, c = (pairs[p] for p in ("lam", "b", "c"))

    def empty(R: int, dims: tuple[int, ...], W: int) -> Any:
        _, F, dv = dims
        return sessions.s4d_session(R, H, M, F, dv, readout=readout, max_rollback=W, dtype=dtype)

    def advance(state: Any, x: dict[str, jax.Array], present: jax.Array) -> Any:
        return sessions.s4d_advance(state, x["fq"], x["kt"], x["vt"], present, lam, b, c, readout)

    def rollback(state: Any, n: jax.Array) -> Any:
        return sessions.s4d_rollback(state, n, lam, b, c, readout)

    return _SessionSpec(
        "interdomain_s4d",
        dtype=dtype,
        check=_features_check(("fq", "kt", "vt"), dtype, H),
        empty=empty,
        advance=advance,
        rollback=rollback,
    )


def _legs_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    _config_keys("interdomain_legs", config, {"capacity"})
    M = positive_int("M", config["M"])
    capacity = _capacity(config)
    E, F = sessions.legs_table(M, capacity, dtype)

    def empty(R: int, dims: tuple[int, ...], W: int) -> Any:
        H, Rf, dv = dims
        return sessions.legs_session(R, H, M, Rf, dv, max_rollback=W, dtype=dtype)

    def advance(state: Any, x: dict[str, jax.Array], present: jax.Array) -> Any:
        return sessions.legs_advance(state, x["fq"], x["fk"], x["v"], present, E, F)

    def rollback(state: Any, n: jax.Array) -> Any:
        return sessions.legs_rollback(state, n, E, F)

    return _SessionSpec(
        "interdomain_legs",
        dtype=dtype,
        check=_features_check(("fq", "fk", "v"), dtype, None),
        empty=empty,
        advance=advance,
        rollback=rollback,
        capacity=capacity,
        capacity_unit="tokens per row (the LegS step table)",
    )


def _layer_check(dtype: jnp.dtype, d: int) -> Any:
    def check(x: dict[str, jax.Array], R: int) -> tuple[int, tuple[int, ...]]:
        y = _array("x", x["x"], 3, dtype, "(R, n, d)")
        if y.shape[0] != R or y.shape[2] != d:
            raise ValueError(f"x: expected shape ({R}, n, {d}), got {y.shape}")
        return y.shape[1], ()

    return check


def _fpa_layer_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    _config_keys("fpa_layer", config, {"capacity", "options"})
    options = {
        **config.get("options", {}),
        **({"increments": config["increments"]} if "increments" in config else {}),
    }
    increments = options.get("increments", "signed")
    if increments not in ("signed", "logsigmoid"):
        raise ValueError(f"increments: expected 'signed' or 'logsigmoid', got {increments!r}")
    P = layers._params("FPA_PARAMETER_SCHEMA", config["params"], layers.FPA_PARAMETER_SCHEMA)
    H = P["b_delta"].shape[0]
    d, dk = P["wq"].shape[0], P["wq"].shape[1] // H
    ct = jnp.result_type(jnp.float32, dtype)
    theta, window = _theta_window(config, ct)
    scale = jnp.asarray(1.0 / np.sqrt(dk), ct)
    capacity = _capacity(config)

    def empty(R: int, dims: tuple[int, ...], W: int) -> Any:
        return sessions.fpa_layer_session(P, R, capacity=capacity, max_rollback=W, dtype=dtype)

    def advance(state: Any, x: dict[str, jax.Array], present: jax.Array) -> Any:
        return sessions.fpa_layer_advance(
            state, x["x"], present, increments, P, scale, theta, window
        )

    return _SessionSpec(
        "fpa_layer",
        dtype=dtype,
        check=_layer_check(dtype, d),
        empty=empty,
        advance=advance,
        rollback=sessions.fpa_layer_rollback,
        capacity=capacity,
        capacity_unit="slots per (row, head)",
    )


def _interdomain_layer_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    flags = ("readout", "gate", "use_rope", "output_norm")
    _config_keys("interdomain_layer", config, {"options"})
    options = {**config.get("options", {}), **{f: config[f] for f in flags if f in config}}
    params = dict(config["params"])
    gate = bool(options.get("gate", "wg" in params))
    output_norm = bool(options.get("output_norm", True))
    readout, use_rope = options.get("readout", "linear"), bool(options.get("use_rope", False))
    dropped = {n for n, on in (("wg", gate), ("norm_o_g", output_norm)) if not on}
    params = {n: p for n, p in params.items() if n not in dropped}
    d = jnp.shape(params["wq"])[0]
    P = layers._interdomain_params(d, params, readout, use_rope, gate, output_norm)
    static = (readout, use_rope, gate, output_norm)

    def empty(R: int, dims: tuple[int, ...], W: int) -> Any:
        return sessions.interdomain_layer_session(
            P, R, readout=readout, max_rollback=W, dtype=dtype
        )

    def advance(state: Any, x: dict[str, jax.Array], present: jax.Array) -> Any:
        return sessions.interdomain_layer_advance(state, x["x"], present, P, static)

    def rollback(state: Any, n: jax.Array) -> Any:
        return sessions.interdomain_layer_rollback(state, n, P, static)

    return _SessionSpec(
        "interdomain_layer",
        dtype=dtype,
        check=_layer_check(dtype, d),
        empty=empty,
        advance=advance,
        rollback=rollback,
    )


SESSION_SPECS = {
    "fpa_decode": _fpa_decode_spec,
    "interdomain_s4d": _s4d_spec,
    "interdomain_legs": _legs_spec,
    "fpa_layer": _fpa_layer_spec,
    "interdomain_layer": _interdomain_layer_spec,
}
