"""Adapters of the JAX backend for the conformance kit (``attnspec.conformance.protocol``).

The kit speaks the canonical layout (B, H, T, D) with NumPy at the boundary; the adapters put
arrays on a JAX device in the tested dtype, fold them into the public layout [B, T, N, H], call
the public functions and unfold the results. Every call runs inside ``jax.enable_x64(True)``
(float64 is a tested dtype) without changing the process-wide setting. Gradients come from one
jitted ``jax.vjp`` of the public function (the custom_vjp for FPA and FoX).

Shape buckets [decision]: the kit runs many small shapes and every new shape recompiles, so the
adapters zero-pad batch, T and head dims to powers of two before the jitted calls. This is
exact: the ops are causal (real rows never see padded tokens, padded cotangents are zero), padded
head dims leave every dot product unchanged, and padded value channels come out zero. Packed
sequences and decoding keep their T (static offsets; kept fractions count real tokens only).

Host-side layout [decision]: the folding, padding and unfolding around a call, and the zero
cotangents, are NumPy work on the host, each array then put on the device once: done with
``jax.numpy`` on device arrays, every reshape, swap, pad, slice and conversion compiled a program
of its own for each new shape: 354 programs for the first 40 smoke cases, 21 of them the op's
(now 21 in all; the smoke run in float64 and bfloat16 went from 72 to 65 s on a CPU, where the
op's own tracing, lowering and compilation take the rest). The values are the same: these
steps only move data.

Compilation budget [decision]: every compiled program keeps its machine code mapped (about 70
memory maps each on XLA:CPU), and a process may hold 65,530 maps, so the full kit on four dtypes
(about 1,000 programs) ended in "LLVM compilation error: Cannot allocate memory". The adapters
count the distinct programs they ask for and clear JAX's caches every ``PROGRAM_BUDGET`` of them.

``jax``: every op, by the XLA implementation. ``pallas``: FPA and FoX by the Pallas kernels
(interpreted on CPU); the other ops have no kernel and are reported as not implemented.
``mosaic``: FPA and FoX by the Mosaic GPU kernels (interpreted on CPU by Mosaic GPU's own
interpreter), in the 16-bit dtypes they take.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attnspec.backends import session_checks
from attnspec.conformance.protocol import OPS as OP_TABLE
from attnspec.conformance.protocol import op_claims
from attnspec.reference.ops import S4D_PARAMS
from attnspec.reference.validation import positive_int, threshold

from . import decode, fpa, interdomain, layers, sessions

ATTENTION = ("fpa_attention", "fox_attention")
# A call's static parameters as sorted (name, value) pairs: hashable, a jit static argument.
StaticParams = tuple[tuple[str, Any], ...]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def time_bucket(T: int) -> int:
    """T padded: a power of two >= 64 up to 512, then a multiple of 512 (quadratic cost)."""
    return _pow2(max(T, 64)) if T <= 512 else -(-T // 512) * 512


def _small(T: int) -> bool:
    return time_bucket(T) <= 256


def rows_bucket(Z: int, T: int) -> int:
    """Batch rows padded to a power of two, at least 8 for short sequences."""
    return _pow2(max(Z, 8 if _small(T) else 1))


def width_bucket(d: int, T: int) -> int:
    """Head dims padded to a power of two, at least 64 for short sequences (16 otherwise)."""
    return _pow2(max(d, 64 if _small(T) else 16))


class _Fold:
    """Canonical (B, H, T, ...) arrays <-> padded public [Z, T', N, ...] arrays.

    ``group`` query heads share a batch row: Z = B * H / group (attention folds the kv heads into
    the batch, LegS every head, S4D none); ``pad_time`` pads T to a bucket.
    """

    def __init__(self, B: int, H: int, T: int, group: int, pad: bool, pad_time: bool) -> None:
        self.B, self.H, self.T = B, H, T
        self.Z = B * H // group
        self.rows = rows_bucket(self.Z, T) if pad else self.Z
        self.time = time_bucket(T) if pad and pad_time else T

    def fold(self, x: jax.Array, width: int | None = None, fill: float = 0.0) -> np.ndarray:
        """(B, heads, T, ...) -> [Z', T', heads / (H / group), ...] on the host; width pads the
        last axis (with zeros), ``fill`` the padded rows and tokens."""
        y = np.asarray(x).reshape(self.Z, -1, self.T, *x.shape[3:]).swapaxes(1, 2)
        rows_and_time = [(0, self.rows - self.Z), (0, self.time - self.T)]
        y = np.pad(y, rows_and_time + [(0, 0)] * (y.ndim - 2), constant_values=fill)
        if y.ndim == 4:
            y = np.pad(y, [(0, 0)] * 3 + [(0, (width or y.shape[-1]) - y.shape[-1])])
        return y

    def unfold(
        self, x: jax.Array, device: jax.Device, width: int | None = None, heads: int | None = None
    ) -> jax.Array:
        """The inverse of :meth:`fold` for an array of ``heads`` heads and last axis ``width``,
        put on ``device``."""
        y = np.asarray(x)[: self.Z, : self.T]
        if y.ndim == 4:
            y = y[..., :width]
        y = y.swapaxes(1, 2)
        return jax.device_put(y.reshape(self.B, heads or self.H, self.T, *y.shape[3:]), device)


def _fold_for(op: str, inputs: dict[str, jax.Array], params: dict[str, Any]) -> _Fold:
    first = inputs["q"] if "q" in inputs else inputs["fq"]
    B, H, T = first.shape[:3]
    packed = params.get("cu_seqlens") is not None
    if op in ATTENTION or op == "fpa_decode":
        group = H // inputs["k"].shape[1] if not packed else H
        return _Fold(B, H, T, group, pad=not packed, pad_time=op != "fpa_decode")
    if op == "interdomain_legs":  # padded with positive features: the ratio's denominator > 0
        return _Fold(B, H, T, 1, pad=True, pad_time=True)
    # interdomain_s4d: heads own parameters; a ratio readout's padding could divide by zero
    return _Fold(B, H, T, H, pad=not packed and params["readout"] == "linear", pad_time=True)


PROGRAM_BUDGET = 128  # distinct compiled programs between two clears of JAX's caches
_programs: set[tuple[Any, ...]] = set()


def _count_program(op: str, impl: str, static: Any, arrays: dict[str, jax.Array]) -> None:
    """Record the program a call compiles (or reuses); clear JAX's caches when the budget of
    distinct programs is spent, before this one compiles."""
    key = (op, impl, static, tuple((n, x.shape, x.dtype) for n, x in sorted(arrays.items())))
    if key in _programs:
        return
    if len(_programs) >= PROGRAM_BUDGET:
        jax.clear_caches()
        _programs.clear()
    _programs.add(key)


FILL_ONE = ("fq", "fk")  # LegS features: positive padding keeps xi(q)^T u_0 > 0


def _widths(inputs: dict[str, jax.Array]) -> dict[str, int]:
    return {n: width_bucket(x.shape[-1], x.shape[2]) for n, x in inputs.items() if x.ndim == 4}


def _fold_inputs(
    fold: _Fold, inputs: dict[str, jax.Array], device: jax.Device
) -> dict[str, jax.Array]:
    widths = _widths(inputs)
    return {
        n: x
        if n in S4D_PARAMS
        else jax.device_put(fold.fold(x, widths.get(n), 1.0 if n in FILL_ONE else 0.0), device)
        for n, x in inputs.items()
    }


def _call(
    op: str, impl: str, static: StaticParams, folded: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """The public function on folded inputs; outputs by the kit's names."""
    params = dict(static)
    x = folded
    if op in ATTENTION:
        scalars = [x[n] for n in ("field", "level", "log_f") if n in x]
        o, lse = getattr(fpa, op)(
            x["q"],
            x["k"],
            x["v"],
            *scalars,
            scale=params["scale"],
            cu_seqlens=params.get("cu_seqlens"),
            window=params.get("window"),
            return_lse=True,
            implementation=impl,
            validate=False,
        )
        outputs = [name for name, _ in OP_TABLE[op].outputs]
        return {n: x for n, x in (("o", o), ("lse", lse)) if n in outputs}
    if op == "interdomain_legs":
        return {"o": interdomain.interdomain_legs(x["fq"], x["fk"], x["v"], params["M"])}
    o = interdomain.interdomain_s4d(
        x["fq"],
        x["kt"],
        x["vt"],
        x["lam_re"] + 1j * x["lam_im"],
        x["b_re"] + 1j * x["b_im"],
        x["c_re"] + 1j * x["c_im"],
        readout=params["readout"],
        cu_seqlens=params.get("cu_seqlens"),
        validate=False,
    )
    return {"o": o}


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _joint(
    op: str,
    impl: str,
    static: StaticParams,
    folded: dict[str, jax.Array],
    cotangents: dict[str, jax.Array],
) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """Outputs and input cotangents in one compiled call: the kit asks for the outputs and then
    the gradients of the same shapes, so one compilation serves both (zero cotangents when
    only the outputs are wanted)."""
    outputs, pullback = jax.vjp(lambda x: _call(op, impl, static, x), folded)
    return outputs, pullback({n: cotangents[n].astype(outputs[n].dtype) for n in outputs})[0]


def _zero_cotangents(
    op: str, folded: dict[str, jax.Array], device: jax.Device
) -> dict[str, jax.Array]:
    """Zeros shaped like the folded outputs, typed and placed as the kit's cotangents arrive
    (committed to the device: committed and uncommitted arrays compile separately)."""
    first = folded["q" if "q" in folded else "fq"]
    width = folded["v" if "v" in folded else "vt"].shape[-1]
    zeros = {"o": np.zeros((*first.shape[:-1], width), first.dtype)}
    if "lse" in OP_TABLE[op].cotangents:
        zeros["lse"] = np.zeros(first.shape[:-1], first.dtype)
    return jax.device_put(zeros, device)


def _static(op: str, inputs: dict[str, jax.Array], params: dict[str, Any]) -> StaticParams:
    """The static parameters of a call, spelled the same way for the outputs and the VJP so
    that both hit one compilation."""
    static = {"cu_seqlens": params.get("cu_seqlens")}
    if op in ATTENTION:
        scale = params.get("scale")
        static["scale"] = 1.0 / float(np.sqrt(inputs["q"].shape[-1])) if scale is None else scale
        static["window"] = params.get("window")
    elif op == "interdomain_legs":
        static = {"M": params["M"]}
    else:
        static["readout"] = params["readout"]
    return tuple(sorted(static.items()))


class JaxBackend:
    """The kit's view of ``attnspec.backends.jax`` with ``implementation="xla"``."""

    name = "jax"
    implementation = "xla"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")
    # every op of the protocol, with the VJPs and features the op table defines, but packed
    # sequences through the layers
    OPS: tuple[str, ...] = tuple(OP_TABLE)
    NOT_IMPLEMENTED: tuple[str, ...] = ("fpa_layer.varlen", "interdomain_layer.varlen")

    def __init__(self, device: str = "cpu") -> None:
        platform, _, index = device.partition(":")
        platform = {"cuda": "gpu"}.get(platform, platform)
        try:
            self._device = jax.devices(platform)[int(index or 0)]
        except (RuntimeError, IndexError, ValueError) as exc:
            raise ValueError(f"device: no JAX device {device!r} here ({exc})") from None
        self.device = device

    # decode sessions (F8, F9, I15): the pure functions of :mod:`.sessions`, fixed capacity
    SESSIONS: tuple[str, ...] = (
        "fpa_decode",
        "interdomain_s4d",
        "interdomain_legs",
        "fpa_layer",
        "interdomain_layer",
    )

    def capabilities(self) -> set[str]:
        claims = op_claims(self.OPS, without=self.NOT_IMPLEMENTED)
        return claims | {f"{op}.session" for op in self.SESSIONS}

    def open_session(self, op: str, *, rows: int, dtype: str, config: dict[str, Any]) -> Any:
        """A decode session of ``op`` with ``rows`` rows in ``dtype`` (the session contract of
        docs/conformance.md): :class:`JaxSession` over :mod:`.sessions`. ``config`` may add
        ``capacity`` (FPA slots per (row, kv head), LegS steps; default
        :data:`SESSION_CAPACITY`)."""
        if f"{op}.session" not in self.capabilities():
            raise NotImplementedError(f"op: no decode session for {op!r} in {self.name}")
        if dtype not in self.dtypes:
            raise ValueError(f"dtype: expected one of {self.dtypes}, got {dtype!r}")
        rows = positive_int("rows", rows)
        W = session_checks.max_rollback(config)
        with jax.enable_x64(True):
            spec = SESSION_SPECS[op](jnp.dtype(dtype), config)
        return JaxSession(spec, rows, W, self._device)

    def asarray(self, x: np.ndarray, dtype: str) -> jax.Array:
        with jax.enable_x64(True):
            return jax.device_put(np.asarray(x).astype(jnp.dtype(dtype)), self._device)

    def asarray_strided(self, x: np.ndarray, dtype: str, layout: str) -> jax.Array:
        """Declined: a JAX array has no strides (a slice or transpose is a new array, and XLA
        chooses the layouts of a program's operands)."""
        raise NotImplementedError("JAX arrays have no strides; every input is a fresh array")

    def to_numpy(self, x: object) -> np.ndarray:
        if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16:
            return np.asarray(x, dtype=np.float32)  # NumPy has no bfloat16: widen exactly
        return np.asarray(x)

    def dtype_name(self, x: jax.Array) -> str:
        return jnp.dtype(x.dtype).name

    def versions(self) -> dict[str, str]:
        import jaxlib

        return {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "implementation": self.implementation,
            "device": str(self._device),
        }

    # ops

    def _run(
        self, op: str, inputs: dict[str, jax.Array], params: dict[str, Any]
    ) -> dict[str, jax.Array]:
        with jax.enable_x64(True):
            fold = _fold_for(op, inputs, params)
            folded = _fold_inputs(fold, inputs, self._device)
            static = _static(op, inputs, params)
            _count_program(op, self.implementation, static, folded)
            if OP_TABLE[op].differentiable:
                outputs, _ = _joint(
                    op,
                    self.implementation,
                    static,
                    folded,
                    _zero_cotangents(op, folded, self._device),
                )
            else:
                outputs = _call(op, self.implementation, static, folded)
            width = inputs["v" if "v" in inputs else "vt"].shape[-1]
            return {n: fold.unfold(y, self._device, width) for n, y in outputs.items()}

    def fpa_attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        field: jax.Array,
        level: jax.Array,
        *,
        scale: float | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        inputs = {"q": q, "k": k, "v": v, "field": field, "level": level}
        params = {"scale": scale, "cu_seqlens": cu_seqlens, "window": window}
        out = self._run("fpa_attention", inputs, params)
        return (out["o"], out["lse"]) if return_lse else out["o"]

    def fox_attention(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        log_f: jax.Array,
        *,
        scale: float | None = None,
        cu_seqlens: tuple[int, ...] | None = None,
        window: int | None = None,
    ) -> jax.Array:
        inputs = {"q": q, "k": k, "v": v, "log_f": log_f}
        params = {"scale": scale, "cu_seqlens": cu_seqlens, "window": window}
        return self._run("fox_attention", inputs, params)["o"]

    def fpa_decode(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        field: jax.Array,
        level: jax.Array,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[jax.Array, float]:
        with jax.enable_x64(True):
            inputs = {"q": q, "k": k, "v": v, "field": field, "level": level}
            fold = _fold_for("fpa_decode", inputs, {})
            x = _fold_inputs(fold, inputs, self._device)
            scale = 1.0 / float(np.sqrt(q.shape[-1])) if scale is None else scale
            _count_program("fpa_decode", self.implementation, theta, x)
            o, cache = decode.fpa_decode(
                x["q"], x["k"], x["v"], x["field"], x["level"], theta=theta, scale=scale
            )
            peaks = np.asarray(cache.peak, dtype=np.float64)[: fold.Z].reshape(-1)  # (b, h)
            o = fold.unfold(o, self._device, v.shape[-1])
        # the reference's mean over (b, h) of peak / T, in the same order and precision
        return o, float(np.mean(peaks / q.shape[2]))

    def interdomain_legs(self, fq: jax.Array, fk: jax.Array, v: jax.Array, *, M: int) -> jax.Array:
        return self._run("interdomain_legs", {"fq": fq, "fk": fk, "v": v}, {"M": M})["o"]

    def interdomain_s4d(
        self,
        fq: jax.Array,
        kt: jax.Array,
        vt: jax.Array,
        lam_re: jax.Array,
        lam_im: jax.Array,
        b_re: jax.Array,
        b_im: jax.Array,
        c_re: jax.Array,
        c_im: jax.Array,
        *,
        readout: str,
        cu_seqlens: tuple[int, ...] | None = None,
    ) -> jax.Array:
        inputs = dict(
            zip(
                ("fq", "kt", "vt", "lam_re", "lam_im", "b_re", "b_im", "c_re", "c_im"),
                (fq, kt, vt, lam_re, lam_im, b_re, b_im, c_re, c_im),
                strict=True,
            )
        )
        params = {"readout": readout, "cu_seqlens": cu_seqlens}
        return self._run("interdomain_s4d", inputs, params)["o"]

    def fpa_layer(
        self, x: jax.Array, params: dict[str, jax.Array], *, increments: str = "signed"
    ) -> jax.Array:
        with jax.enable_x64(True):
            _count_program("fpa_layer", self.implementation, increments, {"x": x, **params})
            return layers.fpa_layer(
                x, params, increments=increments, implementation=self.implementation
            )

    def interdomain_layer(
        self,
        x: jax.Array,
        params: dict[str, jax.Array],
        *,
        readout: str = "linear",
        **options: bool,
    ) -> jax.Array:
        """The layer with the options ``gate``, ``use_rope`` and ``output_norm`` it accepts;
        the optional parameters (wg, norm_o_g) are passed only when their flag is on."""
        accepted = inspect.signature(layers.interdomain_layer).parameters
        flags = {"gate": "wg", "output_norm": "norm_o_g"}
        dropped = {flags[f] for f, on in options.items() if f in flags and not on}
        params = {n: p for n, p in params.items() if n not in dropped}
        kwargs = {n: v for n, v in options.items() if n in accepted}
        static = (readout, tuple(sorted(kwargs.items())))
        with jax.enable_x64(True):
            _count_program("interdomain_layer", self.implementation, static, {"x": x, **params})
            return layers.interdomain_layer(x, params, readout=readout, **kwargs)

    # gradients

    def vjp(
        self,
        op: str,
        inputs: dict[str, jax.Array],
        params: dict[str, Any],
        cotangents: dict[str, jax.Array],
    ) -> dict[str, jax.Array]:
        """Input cotangents by name, from one jitted ``jax.vjp`` of the public function."""
        if f"{op}.vjp" not in self.capabilities():
            raise NotImplementedError(f"op: no VJP for {op!r} in the {self.name} backend")
        with jax.enable_x64(True):
            fold = _fold_for(op, inputs, params)
            widths = _widths(inputs)
            width = widths["v" if "v" in inputs else "vt"]
            cts = {
                n: jax.device_put(fold.fold(c, width), self._device) for n, c in cotangents.items()
            }
            static = _static(op, inputs, params)
            folded = _fold_inputs(fold, inputs, self._device)
            _count_program(op, self.implementation, static, folded)
            _, grads = _joint(op, self.implementation, static, folded, cts)
            return {
                n: fold.unfold(g, self._device, inputs[n].shape[-1], inputs[n].shape[1])
                if n not in S4D_PARAMS
                else g
                for n, g in grads.items()
            }


class PallasBackend(JaxBackend):
    """FPA and FoX by the Pallas kernels (interpreted on CPU)."""

    name = "pallas"
    implementation = "pallas"
    OPS = ATTENTION
    # the window of (F3w) runs on the XLA loop only (docs/decisions.md)
    NOT_IMPLEMENTED = ("fpa_attention.window", "fox_attention.window")

    SESSIONS = ()


class MosaicBackend(PallasBackend):
    """FPA and FoX by the Mosaic GPU kernels (interpreted on CPU), bfloat16 and float16 inputs
    (the dtypes of their wgmma operands)."""

    name = "mosaic"
    implementation = "mosaic"
    dtypes = ("bfloat16", "float16")


# decode sessions

SESSION_CAPACITY = 1024  # default fixed capacity: FPA slots per (row, kv head), LegS steps


def session_rows_bucket(R: int) -> int:
    """Rows a session state holds: R padded to a power of two, at least 4 (padding rows never
    hold a token: exact), so that the programs compile once per bucket."""
    return _pow2(max(R, 4))


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
                _count_program("session." + spec.op, "xla", Rp, position)
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
        inputs: tuple[str, ...],
        output: str,
        *,
        dtype: jnp.dtype,
        check: Any,
        empty: Any,
        advance: Any,
        rollback: Any,
        capacity: int | None = None,
        capacity_unit: str = "",
    ) -> None:
        self.op, self.inputs, self.output, self.dtype = op, inputs, output, dtype
        self.axis = 1 if op.endswith("layer") else 2
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


def _expect_shape(name: str, x: jax.Array, shape: tuple[int, ...], meaning: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({meaning}), got {x.shape}")


def _config_keys(config: dict[str, Any], known: set[str], required: set[str]) -> None:
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
    keys = {"heads", "kv_heads", "dk", "dv", "scale", "theta", "window", "max_rollback"}
    _config_keys(config, keys | {"capacity"}, {"heads", "kv_heads", "dk", "dv"})
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
            _expect_shape(name, y, (R, heads, n, width), f"{R} rows, {heads} heads, n of q")
        for name in ("field", "level"):
            _expect_shape(
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
        ("q", "k", "v", "field", "level"),
        "o",
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
        _expect_shape(b, _array(b, x[b], 4, dtype, "(R, H, n, R)"), (R, H, n, F), f"as {a}")
        v = _array(c, x[c], 4, dtype, "(R, H, n, dv)")
        if v.shape[:3] != (R, H, n):
            raise ValueError(f"{c}: expected shape ({R}, {H}, {n}, dv) (as {a}), got {v.shape}")
        return n, (H, F, v.shape[3])

    return check


def _s4d_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    names = {f"{p}_{part}" for p in ("lam", "b", "c") for part in ("re", "im")}
    _config_keys(config, names | {"readout", "max_rollback"}, names)
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
        ("fq", "kt", "vt"),
        "o",
        dtype=dtype,
        check=_features_check(("fq", "kt", "vt"), dtype, H),
        empty=empty,
        advance=advance,
        rollback=rollback,
    )


def _legs_spec(dtype: jnp.dtype, config: dict[str, Any]) -> _SessionSpec:
    _config_keys(config, {"M", "max_rollback", "capacity"}, {"M"})
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
        ("fq", "fk", "v"),
        "o",
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
    keys = {"params", "increments", "theta", "window", "max_rollback", "capacity", "options"}
    _config_keys(config, keys, {"params"})
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
        ("x",),
        "y",
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
    _config_keys(config, {"params", "options", "max_rollback", *flags}, {"params"})
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
        ("x",),
        "y",
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
