"""Adapters of the JAX backend for the conformance kit (``attnspec.conformance.protocol``).

The kit speaks the canonical layout (B, H, T, D) with NumPy at the boundary; the adapters put
arrays on a JAX device in the tested dtype, fold them into the public layout [B, T, N, H], call
the public functions and unfold the results. Every call runs inside ``jax.enable_x64(True)``
(float64 is a tested dtype) without changing the process-wide setting. Gradients come from one
jitted ``jax.vjp`` of the public function (the custom_vjp for FPA and FoX).

Host-side layout [decision]: the folding, padding and unfolding around a call, and the zero
cotangents, are NumPy work on the host, each array then put on the device once: done with
``jax.numpy`` on device arrays, every reshape, swap, pad, slice and conversion compiled a program
of its own for each new shape: 354 programs for the first 40 smoke cases, 21 of them the op's
(now 21 in all; the smoke run in float64 and bfloat16 went from 72 to 65 s on a CPU, where the
op's own tracing, lowering and compilation take the rest). The values are the same: these
steps only move data.

Shape buckets and the compilation budget: :mod:`.compile_budget`; the decode sessions:
:mod:`.session_adapter`.

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
from attnspec.reference.validation import positive_int

from . import compile_budget, decode, fpa, interdomain, layers
from .session_adapter import SESSION_SPECS, JaxSession

ATTENTION = ("fpa_attention", "fox_attention")
# A call's static parameters as sorted (name, value) pairs: hashable, a jit static argument.
StaticParams = tuple[tuple[str, Any], ...]


class _Fold:
    """Canonical (B, H, T, ...) arrays <-> padded public [Z, T', N, ...] arrays.

    ``group`` query heads share a batch row: Z = B * H / group (attention folds the kv heads into
    the batch, LegS every head, S4D none); ``pad_time`` pads T to a bucket.
    """

    def __init__(self, B: int, H: int, T: int, group: int, pad: bool, pad_time: bool) -> None:
        self.B, self.H, self.T = B, H, T
        self.Z = B * H // group
        self.rows = compile_budget.rows_bucket(self.Z, T) if pad else self.Z
        self.time = compile_budget.time_bucket(T) if pad and pad_time else T

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


FILL_ONE = ("fq", "fk")  # LegS features: positive padding keeps xi(q)^T u_0 > 0


def _widths(inputs: dict[str, jax.Array]) -> dict[str, int]:
    return {
        n: compile_budget.width_bucket(x.shape[-1], x.shape[2])
        for n, x in inputs.items()
        if x.ndim == 4
    }


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
        docs/conformance.md): :class:`.session_adapter.JaxSession` over :mod:`.sessions`.
        ``config`` may add ``capacity`` (FPA slots per (row, kv head), LegS steps; default
        :data:`.session_adapter.SESSION_CAPACITY`)."""
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
            compile_budget.count_program(op, self.implementation, static, folded)
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
            compile_budget.count_program("fpa_decode", self.implementation, theta, x)
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
            compile_budget.count_program(
                "fpa_layer", self.implementation, increments, {"x": x, **params}
            )
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
            compile_budget.count_program(
                "interdomain_layer", self.implementation, static, {"x": x, **params}
            )
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
            compile_budget.count_program(op, self.implementation, static, folded)
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
