"""The reference run as a backend: NumPy arrays in, NumPy arrays out.

Inputs arrive rounded to the tested dtype; the reference computes in float64 and the outputs are
cast back to the dtype of the inputs (lse and the kept fraction stay float64). Its gradients are
the reference's hand-written VJPs; complex parameters travel as (re, im) pairs.
"""

from __future__ import annotations

import numpy as np

from attnspec.reference import fpa
from attnspec.reference import interdomain as idm


class NumpyBackend:
    name = "numpy"
    dtypes = ("float64", "float32", "float16")
    OPS = (
        "fpa_attention",
        "fox_attention",
        "fpa_decode",
        "interdomain_legs",
        "interdomain_s4d",
        "fpa_layer",
        "interdomain_layer",
    )
    VJPS = ("fpa_attention", "fox_attention", "interdomain_legs", "interdomain_s4d")

    def __init__(self, device: str = "cpu"):
        if device != "cpu":
            raise ValueError(f"device: the numpy backend runs on 'cpu' only, got {device!r}")
        self.device = device

    def capabilities(self) -> set[str]:
        return set(self.OPS) | {f"{op}.vjp" for op in self.VJPS}

    def asarray(self, x: np.ndarray, dtype: str) -> np.ndarray:
        return np.asarray(x, dtype=dtype)

    def to_numpy(self, x) -> np.ndarray:
        return np.asarray(x)

    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__}

    # ---------------------------------------------------------------- ops

    def fpa_attention(self, q, k, v, field, level, *, scale=None, return_lse=False):
        o, lse = fpa.fpa_attention(q, k, v, field, level, scale=scale, return_lse=True)
        return (o.astype(q.dtype), lse) if return_lse else o.astype(q.dtype)

    def fox_attention(self, q, k, v, log_f, *, scale=None):
        return fpa.fox_attention(q, k, v, log_f, scale=scale).astype(q.dtype)

    def fpa_decode(self, q, k, v, field, level, *, theta, scale=None):
        res = fpa.fpa_decode(q, k, v, field, level, theta=theta, scale=scale)
        return res.o.astype(q.dtype), res.kept_fraction

    def interdomain_legs(self, fq, fk, v, *, M):
        return idm.interdomain_legs(fq, fk, v, M).astype(fq.dtype)

    def interdomain_s4d(self, fq, kt, vt, lam_re, lam_im, b_re, b_im, c_re, c_im, *, readout):
        lam, b, c = lam_re + 1j * lam_im, b_re + 1j * b_im, c_re + 1j * c_im
        return idm.interdomain_s4d(fq, kt, vt, lam, b, c, readout=readout).astype(fq.dtype)

    def fpa_layer(self, x, params):
        return fpa.fpa_layer(x, params).astype(x.dtype)

    def interdomain_layer(self, x, params, *, readout="linear"):
        return idm.interdomain_layer(x, params, readout=readout).astype(x.dtype)

    # ---------------------------------------------------------------- gradients

    def vjp(self, op: str, inputs: dict, params: dict, cotangents: dict) -> dict:
        """Input cotangents of ``op`` for its differentiable inputs, by name."""
        if op == "fpa_attention":
            g = fpa.fpa_attention_vjp(
                **inputs,
                d_out=cotangents["o"],
                d_lse=cotangents.get("lse"),
                scale=params.get("scale"),
            )
            return {"q": g.dq, "k": g.dk, "v": g.dv, "field": g.dfield, "level": g.dlevel}
        if op == "fox_attention":
            g = fpa.fox_attention_vjp(**inputs, d_out=cotangents["o"], scale=params.get("scale"))
            return {"q": g.dq, "k": g.dk, "v": g.dv, "log_f": g.dlog_f}
        if op == "interdomain_legs":
            g = idm.interdomain_legs_vjp(**inputs, M=params["M"], d_out=cotangents["o"])
            return {"fq": g.dfq, "fk": g.dfk, "v": g.dv}
        if op == "interdomain_s4d":
            x = inputs
            g = idm.interdomain_s4d_vjp(
                x["fq"],
                x["kt"],
                x["vt"],
                x["lam_re"] + 1j * x["lam_im"],
                x["b_re"] + 1j * x["b_im"],
                x["c_re"] + 1j * x["c_im"],
                cotangents["o"],
                readout=params["readout"],
            )
            return {
                "fq": g.dfq,
                "kt": g.dkt,
                "vt": g.dvt,
                "lam_re": g.dlam.real,
                "lam_im": g.dlam.imag,
                "b_re": g.db.real,
                "b_im": g.db.imag,
                "c_re": g.dc.real,
                "c_im": g.dc.imag,
            }
        raise NotImplementedError(f"op: no VJP for {op!r} in the numpy backend")
