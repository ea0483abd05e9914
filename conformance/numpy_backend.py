"""The reference run as a backend: NumPy arrays in, NumPy arrays out.

Inputs arrive rounded to the tested dtype; the reference computes in float64 and the outputs are
cast back to the dtype of the inputs (lse and the kept fraction stay float64); each gradient is
cast to the dtype of its input. Its gradients are the reference's hand-written VJPs; complex
parameters travel as (re, im) pairs.

The optional capabilities of the protocol are met the plain way: packed sequences
(``cu_seqlens``) run the reference segment by segment, and grouped-query attention repeats each
key/value head for its group of query heads (gradients summed over the group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, TypeVar, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from attnspec.reference import fpa, sessions
from attnspec.reference import interdomain as idm
from attnspec.reference.packing import packing

from .protocol import OPS as OP_TABLE
from .protocol import op_claims, op_features

# An array in the tested dtype (float16, float32 or float64), as the kit's adapter delivers it.
FloatArray = NDArray[np.floating]
Result = TypeVar("Result")


def _per_segment(
    fn: Callable[..., Result],
    arrays: Mapping[str, FloatArray],
    cu_seqlens: ArrayLike | None,
    token_axis: Mapping[str, int],
) -> list[Result]:
    """Run ``fn`` on each packed sequence; ``token_axis[name]`` is the T axis of each array."""
    if cu_seqlens is None:
        return [fn(**arrays)]
    first = next(iter(arrays))
    T = arrays[first].shape[token_axis[first]]
    plan = packing(cu_seqlens, T, batch=arrays[first].shape[0])
    assert plan is not None
    results = []
    for bos, eos in plan.bounds:  # a zero-length sequence contributes nothing
        sliced = {}
        for name, x in arrays.items():
            axis = token_axis.get(name)
            sliced[name] = x if axis is None else np.take(x, np.arange(bos, eos), axis=axis)
        results.append(fn(**sliced))
    return results


def _heads_for_queries(x: FloatArray, H: int, name: str) -> FloatArray:
    """GQA: repeat each of the H_kv heads of x (..., H_kv, T, D) for its H / H_kv query heads."""
    H_kv = x.shape[-3]
    if H % H_kv:
        raise ValueError(f"{name}: {H_kv} heads do not divide the {H} query heads")
    return np.repeat(x, H // H_kv, axis=-3)


def _sum_groups(g: NDArray[np.float64], H_kv: int) -> NDArray[np.float64]:
    """The adjoint of :func:`_heads_for_queries`: sum the gradient over each group."""
    *lead, H, T, D = g.shape
    return g.reshape(*lead, H_kv, H // H_kv, T, D).sum(axis=-3)


class NumpySession:
    """A reference session whose advance returns the outputs in the tested dtype."""

    def __init__(self, session: sessions.Session, dtype: np.dtype[Any]) -> None:
        self.session, self.dtype = session, dtype

    def advance(self, inputs: Mapping[str, ArrayLike], present: ArrayLike) -> dict[str, FloatArray]:
        return {k: v.astype(self.dtype) for k, v in self.session.advance(inputs, present).items()}

    def select(self, rows: Any) -> None:
        self.session.select(rows)

    def rollback(self, row: int, n: int) -> None:
        self.session.rollback(row, n)

    def counts(self) -> dict[str, NDArray[np.int64]]:
        return self.session.counts()


ATTENTION_AXES = {"q": -2, "k": -2, "v": -2, "field": -1, "level": -1, "log_f": -1, "d_out": -2}
ATTENTION_AXES["d_lse"] = -1


def each_row_present(
    fn: Callable[[dict[str, FloatArray]], Mapping[str, NDArray[Any]]],
    arrays: Mapping[str, FloatArray],
    present: ArrayLike,
) -> dict[str, NDArray[np.float64]]:
    """(padding) ``fn`` on the present positions of each batch row alone, its results put back
    at those positions and 0 at the absent ones. ``present`` (B, T) bool; token axes as in
    :data:`ATTENTION_AXES` (the output ``o`` and its cotangent ``d_o`` on -2)."""
    mask = np.asarray(present, dtype=bool)
    axes = {**ATTENTION_AXES, "o": -2, "d_o": -2}  # outputs and their cotangents
    out: dict[str, NDArray[np.float64]] = {}
    for b in range(mask.shape[0]):
        idx = np.flatnonzero(mask[b])
        if not idx.size:
            continue  # a row without tokens: 0 everywhere
        sub = {n: np.take(x[b : b + 1], idx, axis=axes[n]) for n, x in arrays.items()}
        for name, y in fn(sub).items():
            axis = y.ndim + axes[name]
            if name not in out:
                shape = list(y.shape)
                shape[0], shape[axis] = mask.shape[0], mask.shape[1]
                out[name] = np.zeros(shape)
            where: tuple[Any, ...] = (slice(b, b + 1), *[slice(None)] * (axis - 1), idx)
            out[name][where] = y
    return out


class NumpyBackend:
    name: str = "numpy"
    dtypes: tuple[str, ...] = ("float64", "float32", "float16")
    # every op of the protocol, with every optional feature the op table defines
    OPS: ClassVar[tuple[str, ...]] = tuple(OP_TABLE)
    FEATURES: ClassVar[tuple[str, ...]] = (*op_features(OP_TABLE), "fox_attention.padding")

    def __init__(self, device: str = "cpu") -> None:
        if device != "cpu":
            raise ValueError(f"device: the numpy backend runs on 'cpu' only, got {device!r}")
        self.device = device

    # the decode sessions of docs/conformance.md ("<op>.session"), over reference/sessions.py
    SESSIONS: ClassVar[tuple[str, ...]] = sessions.SESSION_OPS

    def capabilities(self) -> set[str]:
        return op_claims(self.OPS, features=self.FEATURES) | {
            f"{op}.session" for op in self.SESSIONS
        }

    def open_session(
        self, op: str, *, rows: int, dtype: str, config: Mapping[str, Any]
    ) -> NumpySession:
        """The reference session of ``op`` (float64 inside), outputs in ``dtype``."""
        if op not in self.SESSIONS:
            raise ValueError(f"op: no session for {op!r}; sessions: {list(self.SESSIONS)}")
        return NumpySession(sessions.open_session(op, rows=rows, config=config), np.dtype(dtype))

    def asarray(self, x: NDArray[Any], dtype: str) -> NDArray[Any]:
        return np.asarray(x, dtype=dtype)

    def asarray_strided(self, x: NDArray[Any], dtype: str, layout: str) -> NDArray[Any]:
        """``x`` (B, H, T, D) as a non-contiguous view with the same values: ``"slice"`` the
        middle third of a (B, H, T, 3 D) array (q of a fused qkv projection), ``"transpose"``
        a (B, H, T, D) view of a (B, T, H, D) array."""
        fresh = self.asarray(x, dtype)  # the adapter's own array of that dtype
        if layout == "slice":
            D = x.shape[-1]
            wide = np.zeros((*x.shape[:-1], 3 * D), dtype=fresh.dtype)
            wide[..., D : 2 * D] = fresh
            return wide[..., D : 2 * D]
        if layout == "transpose":
            return np.ascontiguousarray(np.swapaxes(fresh, 1, 2)).swapaxes(1, 2)
        raise NotImplementedError(f"layout: unknown {layout!r}")

    def to_numpy(self, x: ArrayLike) -> NDArray[Any]:
        return np.asarray(x)

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}

    # ops

    @overload
    def fpa_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        return_lse: Literal[False] = False,
    ) -> FloatArray: ...
    @overload
    def fpa_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        return_lse: Literal[True],
    ) -> tuple[FloatArray, NDArray[np.float64]]: ...
    @overload
    def fpa_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]: ...
    def fpa_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        return_lse: bool = False,
    ) -> FloatArray | tuple[FloatArray, NDArray[np.float64]]:
        H = q.shape[-3]
        k, v = _heads_for_queries(k, H, "k"), _heads_for_queries(v, H, "v")
        parts = _per_segment(
            lambda **a: fpa.fpa_attention(**a, scale=scale, window=window, return_lse=True),
            {"q": q, "k": k, "v": v, "field": field, "level": level},
            cu_seqlens,
            ATTENTION_AXES,
        )
        o = np.concatenate([p[0] for p in parts], axis=-2).astype(q.dtype)
        lse = np.concatenate([p[1] for p in parts], axis=-1)
        return (o, lse) if return_lse else o

    def fox_attention(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        log_f: FloatArray,
        *,
        scale: float | None = None,
        cu_seqlens: ArrayLike | None = None,
        window: int | None = None,
        present: ArrayLike | None = None,
    ) -> FloatArray:
        if present is not None:  # padding: each row's present tokens alone
            if cu_seqlens is not None:
                raise ValueError("present: give present (padding) or cu_seqlens, not both")
            return each_row_present(
                lambda a: {"o": self.fox_attention(**a, scale=scale, window=window)},
                {"q": q, "k": k, "v": v, "log_f": log_f},
                present,
            )["o"].astype(q.dtype)
        H = q.shape[-3]
        k, v = _heads_for_queries(k, H, "k"), _heads_for_queries(v, H, "v")
        parts = _per_segment(
            lambda **a: fpa.fox_attention(**a, scale=scale, window=window),
            {"q": q, "k": k, "v": v, "log_f": log_f},
            cu_seqlens,
            ATTENTION_AXES,
        )
        return np.concatenate(parts, axis=-2).astype(q.dtype)

    def fpa_decode(
        self,
        q: FloatArray,
        k: FloatArray,
        v: FloatArray,
        field: FloatArray,
        level: FloatArray,
        *,
        theta: float,
        scale: float | None = None,
    ) -> tuple[FloatArray, float]:
        res = fpa.fpa_decode(q, k, v, field, level, theta=theta, scale=scale)
        return res.o.astype(q.dtype), res.kept_fraction

    def interdomain_legs(
        self, fq: FloatArray, fk: FloatArray, v: FloatArray, *, M: int
    ) -> FloatArray:
        return idm.interdomain_legs(fq, fk, v, M).astype(fq.dtype)

    def interdomain_s4d(
        self,
        fq: FloatArray,
        kt: FloatArray,
        vt: FloatArray,
        lam_re: FloatArray,
        lam_im: FloatArray,
        b_re: FloatArray,
        b_im: FloatArray,
        c_re: FloatArray,
        c_im: FloatArray,
        *,
        readout: str,
        cu_seqlens: ArrayLike | None = None,
    ) -> FloatArray:
        lam, b, c = lam_re + 1j * lam_im, b_re + 1j * b_im, c_re + 1j * c_im
        parts = _per_segment(
            lambda **a: idm.interdomain_s4d(**a, lam=lam, b=b, c=c, readout=readout),
            {"fq": fq, "kt": kt, "vt": vt},
            cu_seqlens,
            {"fq": -2, "kt": -2, "vt": -2},
        )
        return np.concatenate(parts, axis=-2).astype(fq.dtype)

    def fpa_layer(
        self,
        x: FloatArray,
        params: Mapping[str, FloatArray],
        *,
        cu_seqlens: ArrayLike | None = None,
        **options: Any,
    ) -> FloatArray:
        """The reference layer; packed sequences (B = 1) layer by layer on each segment."""
        parts = _per_segment(
            lambda x: fpa.fpa_layer(x, params, **options), {"x": x}, cu_seqlens, {"x": -2}
        )
        return np.concatenate(parts, axis=-2).astype(x.dtype)

    def interdomain_layer(
        self,
        x: FloatArray,
        params: Mapping[str, FloatArray],
        *,
        readout: str = "linear",
        cu_seqlens: ArrayLike | None = None,
        **options: Any,
    ) -> FloatArray:
        """The reference layer (options: gate, use_rope, output_norm); packed sequences (B = 1)
        on each segment, with its own conv window, positions and state."""
        parts = _per_segment(
            lambda x: idm.interdomain_layer(x, params, readout=readout, **options),
            {"x": x},
            cu_seqlens,
            {"x": -2},
        )
        return np.concatenate(parts, axis=-2).astype(x.dtype)

    # gradients

    def vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, FloatArray]:
        """Input cotangents of ``op`` for its differentiable inputs, by name, each in the dtype
        of its input."""
        grads = self._vjp(op, inputs, params, cotangents)
        return {name: g.astype(inputs[name].dtype) for name, g in grads.items()}

    def _vjp(
        self,
        op: str,
        inputs: Mapping[str, FloatArray],
        params: Mapping[str, Any],
        cotangents: Mapping[str, FloatArray],
    ) -> dict[str, NDArray[np.float64]]:
        cu_seqlens = params.get("cu_seqlens")
        if params.get("present") is not None:  # padding: each row's present tokens alone
            rest = {k: v for k, v in params.items() if k != "present"}
            return each_row_present(
                lambda a: self._vjp(
                    op, {n: a[n] for n in inputs}, rest, {n: a[f"d_{n}"] for n in cotangents}
                ),
                {**inputs, **{f"d_{n}": c for n, c in cotangents.items()}},
                params["present"],
            )
        if op in ("fpa_attention", "fox_attention"):
            H, H_kv = inputs["q"].shape[-3], inputs["k"].shape[-3]
            arrays = dict(inputs)
            arrays["k"] = _heads_for_queries(inputs["k"], H, "k")
            arrays["v"] = _heads_for_queries(inputs["v"], H, "v")
            arrays["d_out"] = cotangents["o"]
            if op == "fpa_attention":
                if "lse" in cotangents:
                    arrays["d_lse"] = cotangents["lse"]

                def backward(**a: FloatArray) -> dict[str, NDArray[np.float64]]:
                    return fpa.fpa_attention_vjp(
                        **a, scale=params.get("scale"), window=params.get("window")
                    )._asdict()

            else:

                def backward(**a: FloatArray) -> dict[str, NDArray[np.float64]]:
                    return fpa.fox_attention_vjp(
                        **a, scale=params.get("scale"), window=params.get("window")
                    )._asdict()

            parts = _per_segment(backward, arrays, cu_seqlens, ATTENTION_AXES)
            names = {"dq": "q", "dk": "k", "dv": "v", "dfield": "field", "dlevel": "level"}
            names["dlog_f"] = "log_f"
            grads = {}
            for key, name in names.items():
                if key in parts[0]:
                    axis = ATTENTION_AXES[name]
                    grads[name] = np.concatenate([p[key] for p in parts], axis=axis)
            grads["k"], grads["v"] = _sum_groups(grads["k"], H_kv), _sum_groups(grads["v"], H_kv)
            return grads
        if op == "interdomain_legs":
            g = idm.interdomain_legs_vjp(**inputs, M=params["M"], d_out=cotangents["o"])
            return {"fq": g.dfq, "fk": g.dfk, "v": g.dv}
        if op == "interdomain_s4d":
            x = inputs
            lam = x["lam_re"] + 1j * x["lam_im"]
            b, c = x["b_re"] + 1j * x["b_im"], x["c_re"] + 1j * x["c_im"]
            s4d_parts = _per_segment(
                lambda **a: idm.interdomain_s4d_vjp(
                    **a, lam=lam, b=b, c=c, readout=params["readout"]
                ),
                {"fq": x["fq"], "kt": x["kt"], "vt": x["vt"], "d_out": cotangents["o"]},
                cu_seqlens,
                {"fq": -2, "kt": -2, "vt": -2, "d_out": -2},
            )
            grads = {
                name: np.concatenate([getattr(p, f"d{name}") for p in s4d_parts], axis=-2)
                for name in ("fq", "kt", "vt")
            }
            for name in ("lam", "b", "c"):
                total = sum(getattr(p, f"d{name}") for p in s4d_parts)  # shared parameters
                grads[f"{name}_re"], grads[f"{name}_im"] = total.real, total.imag
            return grads
        raise NotImplementedError(f"op: no VJP for {op!r} in the numpy backend")
