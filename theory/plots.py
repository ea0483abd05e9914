"""Teaching figures (matplotlib, PNG): the live-key stack, FPA vs FoX maps, LegS, eviction.

Labels are matplotlib mathtext (``$\\phi_t$``), so the symbols match the spec and the site.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from attnspec.reference import fpa, hippo

from .eviction import eviction_fields
from .expressivity import attention_weights
from .hippo_identities import legs_error_curve

if TYPE_CHECKING:  # matplotlib is the optional 'plots' extra
    from matplotlib.figure import Figure


def require_matplotlib() -> ModuleType:
    """matplotlib, or an ImportError that says how to install it (the command calls this before
    it runs the checks, so that a missing extra is not found only after them)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "attnspec theory --plots needs matplotlib: pip install matplotlib, or from the "
            "attnspec checkout pip install '.[plots]'"
        ) from None
    return matplotlib


def _pyplot() -> ModuleType:
    matplotlib = require_matplotlib()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: str, *, tight: bool = True) -> None:
    import matplotlib.pyplot as plt

    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches=None if tight else "tight")
    plt.close(fig)


def plot_stack(path: str) -> None:
    """(1) A bracket field and the live-key stack at every step (T1)."""
    plt = _pyplot()
    tokens = list("a(b(cd)e(f)g)h(i(j)k)l")
    field = np.cumsum([{"(": 1.0, ")": -1.0}.get(t, 0.0) for t in tokens])
    live = fpa.live_keys(field, field)
    T = len(tokens)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [1, 2]}
    )
    top.step(range(T), field, where="mid", color="C0")
    top.set_ylabel(r"field $\phi_t$ (depth)")
    top.set_title(r"Brackets: $\delta_t = +1$ on '(', $-1$ on ')'; level $l = \phi$ (one walk)")
    bottom.imshow(live.T, origin="lower", cmap="Greens", aspect="auto", interpolation="nearest")
    bottom.set_xticks(range(T), [f"{i}\n{t}" for i, t in enumerate(tokens)])
    bottom.set_yticks(range(T), [f"{t} {j}" for j, t in enumerate(tokens)])
    bottom.set_xlabel(r"query position $i$ (token)")
    bottom.set_ylabel(r"key $j$ (token)")
    bottom.set_title(r"Live keys ($\pi_{ij} = 0$, green): a stack (T1); closed blocks forgotten")
    _save(fig, path)


def plot_attention_maps(path: str) -> None:
    """(2) FoX vs FPA attention weights on the same queries, keys and values."""
    plt = _pyplot()
    rng = np.random.default_rng(50)
    T, dk = 32, 8
    q, k = rng.standard_normal((2, T, dk))
    log_f = -np.log1p(np.exp(-rng.normal(1.0, 1.0, T)))  # logsigmoid gates
    c = np.cumsum(log_f)
    walk = 1.5 * np.cumsum(rng.choice([1.0, -1.0, 0.0], size=T, p=[0.35, 0.35, 0.3]))
    maps = [
        (
            r"FoX, $\log f_t = \log \sigma(\cdot)$",
            attention_weights(fpa.fox_attention_direct, q, k, log_f=log_f),
        ),
        (
            r"FPA, $\phi = l = \mathrm{cumsum}(\log f)$  (F6)",
            attention_weights(fpa.fpa_attention, q, k, field=c, level=c),
        ),
        (
            r"FPA, signed walk $\phi$, $l = \phi$",
            attention_weights(fpa.fpa_attention, q, k, field=walk, level=walk),
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.8))
    for ax, (title, p) in zip(axes, maps, strict=True):
        im = ax.imshow(p, cmap="viridis", vmin=0, vmax=1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(r"key $j$")
        ax.set_ylabel(r"query $i$")
    fig.colorbar(im, ax=axes, label=r"attention weight $p_{ij}$", shrink=0.8)
    fig.suptitle(r"Same $q, k$: FoX = FPA on its monotone field; a signed field forgets blocks")
    _save(fig, path, tight=False)


def plot_legs(path: str) -> None:
    """(3) LegS reconstruction of a token sequence, and the readout error vs M (H4)."""
    plt = _pyplot()
    rng = np.random.default_rng(51)
    T = 64
    f = np.sin(np.linspace(0, 3 * np.pi, T)) + 0.3 * rng.standard_normal(T)
    x = np.linspace(0, T, 600)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    left.step(
        np.arange(T + 1),
        np.append(f, f[-1]),
        where="post",
        color="k",
        lw=1,
        label=r"tokens $f_n$ on $[n-1, n)$",
    )
    for M in (4, 16, 64):
        c = hippo.legs_project(f, M)[-1]
        left.plot(x, hippo.legs_reconstruct(c, T, x), label=rf"LegS, $M = {M}$")
    left.set_xlabel(r"time $t$")
    left.set_ylabel("value")
    left.set_title(rf"Reconstruction from the LegS coefficients at $t = {T}$")
    left.legend(fontsize=8)
    curve = legs_error_curve()
    right.loglog([m for m, _ in curve], [e for _, e in curve], "o-", label="LegS ratio readout")
    right.set_xlabel(r"basis size $M$")
    right.set_ylabel(r"$\Vert \tilde O_M - O \Vert \,/\, \Vert O \Vert$ vs linear attention (I1)")
    right.set_title(rf"Interdomain readout error falls with $M$ (H4), $T = {T}$")
    right.legend()
    _save(fig, path)


def plot_eviction(path: str) -> None:
    """(4) Kept fraction of the KV cache vs the eviction threshold theta (F7, T3)."""
    _save(eviction_figure(), path)


def eviction_figure() -> Figure:
    """The figure of :func:`plot_eviction`: the curves, and the T3 thresholds as dashed lines
    labelled beside them (left of each line, below the curves), not on them."""
    plt = _pyplot()
    rng = np.random.default_rng(52)
    T, dk = 256, 8
    q, k = rng.standard_normal((2, T, dk))
    v = rng.standard_normal((T, 4))
    thetas = np.array([0.5, 1, 2, 4, 8, 12, 16, 24, 32, 48])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, field in eviction_fields(T).items():
        kept = [fpa.fpa_decode(q, k, v, field, field, theta=t).kept_fraction for t in thetas]
        ax.semilogx(thetas, kept, "o-", label=kind)
    U = np.abs(q @ k.T).max() / np.sqrt(dk)
    for eps in (1e-2, 1e-8):
        theta = fpa.eviction_threshold(U, T, eps)
        ax.axvline(theta, color="gray", ls="--", lw=1)
        label = rf"safe for $\varepsilon = 10^{{{np.log10(eps):.0f}}}$"
        ax.annotate(
            label,
            xy=(theta, 0.03),
            xycoords=("data", "axes fraction"),
            xytext=(-3, 0),
            textcoords="offset points",
            rotation=90,
            ha="right",
            va="bottom",
            fontsize=8,
            color="gray",
        )
    ax.set_xlabel(r"eviction threshold $\theta$")
    ax.set_ylabel(r"kept fraction (peak cache / $T$)")
    ax.set_ylim(0, 1.05)
    ax.set_title(rf"FPA decoding with eviction (F7, T3), $T = {T}$, $l = \phi$")
    ax.legend()
    return fig


FIGURES = {
    "stack.png": plot_stack,
    "attention_maps.png": plot_attention_maps,
    "legs.png": plot_legs,
    "eviction.png": plot_eviction,
}


def write_all(directory: str) -> list[str]:
    """Write every figure into ``directory`` (created if missing); return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, plot in FIGURES.items():
        path = os.path.join(directory, name)
        plot(path)
        paths.append(path)
    return paths
