"""Gradient checks by directional derivatives (the inner-product identity).

For a function f with outputs y and a cotangent c, the VJP g = J^T c must satisfy, for every
direction d, <g, d> = d/dh <c, f(x + h d)> at h = 0. The right-hand side is estimated by a
fourth-order central difference in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np


def inner(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Sum of elementwise products over matching arrays (real parts for complex input)."""
    return float(sum(np.real(np.vdot(x, y)) for x, y in zip(a, b, strict=True)))


@dataclass(frozen=True)
class DirectionalCheck:
    """Result of one directional check: finite difference vs VJP inner product."""

    finite_difference: float
    vjp_inner: float
    magnitude: float  # sum_k |g_k| |d_k|, the natural scale of both numbers
    noise: float  # bound on the rounding error of the finite difference itself

    @property
    def error(self) -> float:
        """|fd - vjp| relative to the magnitude, or to the rounding floor when that is larger."""
        return abs(self.finite_difference - self.vjp_inner) / max(
            self.magnitude, self.noise, 1e-300
        )

    def passes(self, tol: float) -> bool:
        """True when |fd - vjp| <= tol * magnitude + noise (NaN never passes)."""
        return bool(
            abs(self.finite_difference - self.vjp_inner) <= tol * self.magnitude + self.noise
        )


def directional_check(
    fun: Callable[..., Sequence[np.ndarray]],
    inputs: Mapping[str, np.ndarray],
    cotangents: Sequence[np.ndarray],
    grads: Mapping[str, np.ndarray],
    direction: Mapping[str, np.ndarray],
    *,
    h: float = 1e-3,
) -> DirectionalCheck:
    """Compare <grads, direction> with the derivative of <cotangents, fun(inputs + h d)>.

    Args:
        fun: maps keyword inputs to a sequence of outputs matching ``cotangents``.
        inputs: the point; only the names in ``direction`` are perturbed.
        cotangents: one array per output.
        grads: the VJP to check, by input name.
        direction: a perturbation per differentiated input name.
        h: step of the fourth-order central difference.
    """

    def moved(t: float) -> dict[str, np.ndarray]:
        point = dict(inputs)
        for name, d in direction.items():
            point[name] = inputs[name] + t * d
        return point

    def objective(t: float) -> float:
        return inner(cotangents, fun(**moved(t)))

    fd = (-objective(2 * h) + 8 * objective(h) - 8 * objective(-h) + objective(-2 * h)) / (12 * h)
    an = inner([grads[n] for n in direction], [direction[n] for n in direction])
    magnitude = float(sum(np.sum(np.abs(grads[n]) * np.abs(direction[n])) for n in direction))
    # Each objective carries a rounding error of about eps * sum |c| |y| (times a safety factor
    # of 10 for the error of y itself); the stencil weights sum to 18 / (12 h).
    scale = inner([np.abs(c) for c in cotangents], [np.abs(y) for y in fun(**moved(0.0))])
    noise = 10 * np.finfo(np.float64).eps * scale * 18 / (12 * h)
    return DirectionalCheck(fd, an, magnitude, float(noise))
