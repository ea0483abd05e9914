"""H1-H11: the identities of the HiPPO projection and the S4D layer (spec/interdomain.md sec. 3)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from attnspec.reference import hippo
from attnspec.reference import interdomain as idm

from .registry import CheckResult, check, relative_error, verdict


def positive_features(rng: np.random.Generator, shape: tuple[int, ...]) -> NDArray[np.float64]:
    return np.exp(0.5 * rng.standard_normal(shape))


def s4d_case(
    seed: int,
    *,
    T: int = 16,
    H: int = 2,
    R: int = 4,
    dv: int = 3,
    M: int = 6,
    ratio: bool = False,
) -> dict[str, NDArray[Any]]:
    """Inputs of the S4D core; for the ratio readout, positive features and C near I."""
    rng = np.random.default_rng(seed)
    fq, kt = rng.standard_normal((2, 2, H, T, R))
    vt = rng.standard_normal((2, H, T, dv))
    a_log, a_im = hippo.s4d_init(M)
    dt = rng.uniform(0.01, 0.3, H)
    lam = idm.s4d_lambda(np.log(dt), np.tile(a_log, (H, 1)), np.tile(a_im, (H, 1)))
    b = rng.standard_normal((H, M)) + 1j * rng.standard_normal((H, M))
    c = (rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))) / np.sqrt(2 * M)
    if ratio:
        fq, kt, b = positive_features(rng, fq.shape), positive_features(rng, kt.shape), np.abs(b)
        c = np.eye(M) + 0.1 * c
    return dict(fq=fq, kt=kt, vt=vt, lam=lam, b=b, c=c)


@check("H1")
def h1_constants_in_the_basis(
    *,
    legs_transition: Callable[
        [int], tuple[NDArray[np.float64], NDArray[np.float64]]
    ] = hippo.legs_transition,
    basis_coefficients: Callable[..., idm.Coefficients] = idm.basis_coefficients,
) -> CheckResult:
    rng = np.random.default_rng(30)
    worst = 0.0
    for M in (1, 4, 16, 64):
        A, B = legs_transition(M)
        worst = max(worst, np.abs(np.linalg.solve(A, B) - np.eye(M)[0]).max())
        co = basis_coefficients(rng.standard_normal((40, 3)), rng.standard_normal((40, 2)), M)
        worst = max(worst, np.abs(co.eta - np.eye(M)[0]).max())
    return verdict(
        "H1",
        "A^{-1} B = e_0 and eta = e_0 (I6): the denominator is xi(q)^T u_0",
        "linear solve and the recurrence on the constant channel, M in {1, 4, 16, 64}, T = 40",
        worst,
        1e-12,
    )


@check("H2")
def h2_recurrence_is_the_projection(
    *,
    legs_project: Callable[..., NDArray[np.float64]] = hippo.legs_project,
    closed_form: Callable[..., NDArray[np.float64]] = hippo.legs_project_closed_form,
) -> CheckResult:
    rng = np.random.default_rng(31)
    f = rng.standard_normal((64, 2))
    worst = max(relative_error(legs_project(f, M), closed_form(f, M)) for M in (1, 4, 8, 32))
    return verdict(
        "H2",
        "the exact log-time recurrence (I5) equals the LegS projection integral",
        "closed form with Legendre antiderivatives (numpy.polynomial.legendre), T = 64, "
        "M in {1, 4, 8, 32}",
        worst,
        1e-12,
    )


@check("H3")
def h3_complete_discrete_basis(
    *,
    interdomain_discrete: Callable[..., NDArray[np.float64]] = idm.interdomain_discrete,
    linear_attention: Callable[..., NDArray[np.float64]] = idm.linear_attention,
) -> CheckResult:
    rng = np.random.default_rng(32)
    T = 24
    fq, fk = positive_features(rng, (2, 3, T, 4))
    v = rng.standard_normal((3, T, 5))
    complete = relative_error(interdomain_discrete(fq, fk, v, T), linear_attention(fq, fk, v))
    M = 5
    o = interdomain_discrete(fq[0], fk[0], v[0], M)
    projector = 0.0
    for i in range(T):
        n = i + 1
        G = hippo.discrete_orthonormal_basis(n, min(M, n))
        P = G @ G.T / n
        want = (fq[0, i] @ fk[0, :n].T @ P @ v[0, :n]) / (fq[0, i] @ fk[0, :n].T @ P @ np.ones(n))
        projector = max(projector, relative_error(o[i], want))
    return verdict(
        "H3",
        "with a complete discrete basis (M = T) the ratio readout (I3) is linear attention (I1); "
        "for M < T it is the projector form",
        "causal linear attention computed directly; P = G G^T / T built explicitly, M = 5, T = 24",
        max(complete, projector),
        1e-12,
    )


def legs_error_curve(
    Ms: Iterable[int] = (1, 2, 4, 8, 16, 32, 64),
    *,
    interdomain_legs: Callable[..., NDArray[np.float64]] = idm.interdomain_legs,
    T: int = 64,
    seed: int = 33,
) -> list[tuple[int, float]]:
    """Normwise error of the LegS readout against linear attention, for each M."""
    rng = np.random.default_rng(seed)
    fq, fk = positive_features(rng, (2, 4, T, 4))
    v = rng.standard_normal((4, T, 3))
    ref = idm.linear_attention(fq, fk, v)
    return [(M, relative_error(interdomain_legs(fq, fk, v, M), ref)) for M in Ms]


@check("H4")
def h4_error_falls_with_m(
    *, interdomain_legs: Callable[..., NDArray[np.float64]] = idm.interdomain_legs
) -> CheckResult:
    curve = legs_error_curve(interdomain_legs=interdomain_legs)
    increases = sum(int(b[1] >= a[1]) for a, b in itertools.pairwise(curve))
    table = ["M      " + " ".join(f"{M:>8}" for M, _ in curve)]
    table.append("error  " + " ".join(f"{e:>8.4f}" for _, e in curve))
    return verdict(
        "H4",
        "the LegS readout error against linear attention falls as M grows",
        "normwise relative error on T = 64 tokens, positive features; measured = number of M "
        "steps where it does not fall",
        increases,
        0,
        table=table,
    )


@check("H5")
def h5_scale_invariance(
    *,
    ratio_readout: Callable[..., NDArray[np.float64]] = idm.ratio_readout,
    interdomain_s4d: Callable[..., NDArray[np.float64]] = idm.interdomain_s4d,
) -> CheckResult:
    rng = np.random.default_rng(34)
    fq, fk = positive_features(rng, (2, 20, 4))
    co = idm.basis_coefficients(fk, rng.standard_normal((20, 3)), 8)
    o = ratio_readout(fq, co)
    moved = ratio_readout(fq, idm.Coefficients(-0.3 * co.U, 7.0 * co.Gamma, 7.0 * co.eta))
    invariance = relative_error(moved, o)
    case = s4d_case(35)
    linear = interdomain_s4d(**case)
    scaled = interdomain_s4d(**{**case, "c": 2 * case["c"]})
    linear_changes = relative_error(scaled, linear) > 0.5  # (I13) is quadratic in C: it moves by x4
    return verdict(
        "H5",
        "the ratio readout is invariant to (Gamma, eta) -> a (Gamma, eta), U -> b U; "
        "the denominator-free readout (I13) is not",
        "a = 7, b = -0.3 on LegS coefficients; C -> 2C on the S4D core; measured = relative "
        "change of the ratio readout (+1 if (I13) did not change)",
        invariance + (0.0 if linear_changes else 1.0),
        1e-12,
    )


@check("H6")
def h6_decode_equals_scan(
    *,
    decoder: Callable[..., idm.InterdomainDecoder] = idm.InterdomainDecoder,
    interdomain_s4d: Callable[..., NDArray[np.float64]] = idm.interdomain_s4d,
) -> CheckResult:
    worst = 0.0
    sizes = set()
    for readout, T in itertools.product(("linear", "ratio"), (8, 40)):
        case = s4d_case(36, T=T, ratio=readout == "ratio")
        o = interdomain_s4d(**case, readout=readout)
        dec = decoder(case["lam"], case["b"], case["c"], readout=readout)
        for t in range(T):
            step = dec.step(case["fq"][..., t, :], case["kt"][..., t, :], case["vt"][..., t, :])
            worst = max(worst, relative_error(step, o[..., t, :]))
            sizes.add((readout, dec.state_size()))
    grows = len(sizes) != 2  # one state size per readout, whatever T
    return verdict(
        "H6",
        "step-by-step decode equals the full-sequence scan; the state size does not depend on T",
        f"InterdomainDecoder vs interdomain_s4d, T in {{8, 40}}, both readouts; state sizes "
        f"{sorted(s for _, s in sizes)}",
        worst + (1.0 if grows else 0.0),
        1e-12,
    )


@check("H7")
def h7_causality(
    *,
    interdomain_s4d: Callable[..., NDArray[np.float64]] = idm.interdomain_s4d,
    interdomain_legs: Callable[..., NDArray[np.float64]] = idm.interdomain_legs,
) -> CheckResult:
    rng = np.random.default_rng(37)
    case = s4d_case(37, T=20)
    o = interdomain_s4d(**case)
    moved = {n: x.copy() for n, x in case.items()}
    for name in ("fq", "kt", "vt"):
        moved[name][..., 12:, :] += rng.standard_normal(moved[name][..., 12:, :].shape)
    change = np.abs(interdomain_s4d(**moved)[..., :12, :] - o[..., :12, :]).max()
    fq, fk = positive_features(rng, (2, 20, 3))
    v = rng.standard_normal((20, 2))
    o2 = interdomain_legs(fq, fk, v, 6)
    fk2, v2 = fk.copy(), v.copy()
    fk2[12:] *= 3.0
    v2[12:] += 1.0
    change = max(change, np.abs(interdomain_legs(fq, fk2, v2, 6)[:12] - o2[:12]).max())
    return verdict(
        "H7",
        "tokens after t do not change o_t",
        "perturb every input after t = 12 (S4D core and LegS readout); measured = largest "
        "change of an earlier output (bitwise)",
        change,
        0.0,
    )


@check("H8")
def h8_convolution_form(
    *,
    s4d_states: Callable[..., NDArray[np.complex128]] = idm.s4d_states,
    s4d_states_chunked: Callable[..., NDArray[np.complex128]] = idm.s4d_states_chunked,
    s4d_states_fft: Callable[..., NDArray[np.complex128]] = idm.s4d_states_fft,
) -> CheckResult:
    case = s4d_case(38, T=30)
    z = np.concatenate([case["kt"], case["vt"]], axis=-1)
    lam, b = case["lam"], case["b"]
    x = s4d_states(z, lam, b)
    T = z.shape[-2]
    powers = lam[:, None, :] ** np.arange(T)[None, :, None]  # (H, T, M)
    conv = np.zeros_like(x)
    for t in range(T):
        for s in range(t + 1):  # x_t = sum_{s<=t} Lambda^(t-s) b z_s
            conv[..., t, :, :] += (powers[:, t - s] * b)[..., None] * z[..., s, None, :]
    worst = relative_error(x, conv)
    for chunk in (1, 4, 7, 30):
        worst = max(worst, relative_error(s4d_states_chunked(z, lam, b, chunk), conv))
    worst = max(worst, relative_error(s4d_states_fft(z, lam, b), conv))
    return verdict(
        "H8",
        "the convolution form x_t = sum_{s<=t} Lambda^(t-s) b z_s equals the recurrence "
        "(sequential, chunked, FFT)",
        "the double loop over (t, s) vs each method; chunks 1, 4, 7, 30",
        worst,
        1e-11,
    )


@check("H9")
def h9_oracle(
    *,
    interdomain_s4d: Callable[..., NDArray[np.float64]] = idm.interdomain_s4d,
    oracle: Callable[..., NDArray[np.float64]] = idm.interdomain_s4d_oracle,
) -> CheckResult:
    worst = 0.0
    for readout in ("linear", "ratio"):
        case = s4d_case(39, ratio=readout == "ratio")
        worst = max(
            worst,
            relative_error(
                interdomain_s4d(**case, readout=readout), oracle(**case, readout=readout)
            ),
        )
    return verdict(
        "H9",
        "(I13) equals the O(T^2) double sum with w(p, p') = (conj(L)^p conj(b))^T C^H C (L^p' b)",
        "interdomain_s4d_oracle, written without the recurrence; both readouts",
        worst,
        1e-12,
    )


@check("H10")
def h10_feature_norms(
    *, feature_map: Callable[..., NDArray[np.float64]] = idm.feature_map
) -> CheckResult:
    rng = np.random.default_rng(40)
    table = [f"{'scale of y':>10} {'min':>7} {'median':>7} {'max':>7}"]
    largest = 0.0
    smallest = np.inf
    for scale in (0.01, 0.1, 1.0, 10.0, 1000.0):
        norms = np.linalg.norm(feature_map(scale * rng.standard_normal((2000, 64))), axis=-1)
        largest, smallest = max(largest, norms.max()), min(smallest, norms.min())
        table.append(
            f"{scale:>10g} {norms.min():>7.3f} {np.median(norms):>7.3f} {norms.max():>7.3f}"
        )
    return verdict(
        "H10",
        "||xi(x)||_2 = ||SiLU(y)|| / sqrt(||y||^2 + eps) lies in (0, 1); its median is 0.5 "
        "(small y) to 1/sqrt(2) (large y) for Gaussian y",
        "norms over 2000 Gaussian y in R^64 at five scales; measured = largest norm",
        largest if smallest > 0 else np.inf,
        1.0,
        table=table,
    )


@check("H11")
def h11_lambda_at_init(
    *, s4d_lambda: Callable[..., NDArray[np.complex128]] = idm.s4d_lambda
) -> CheckResult:
    worst = 0.0
    outside = 0
    for seed in range(4):
        p = idm.init_interdomain_params(d=8, H=64, R=4, dv=4, M=16, seed=seed)
        modulus = np.abs(s4d_lambda(p["log_dt"], p["a_log"], p["a_im"]))
        dt = np.exp(p["log_dt"])[:, None]
        worst = max(worst, np.abs(modulus - np.exp(-dt / 2)).max())
        outside += int(((modulus < np.exp(-0.05)) | (modulus > np.exp(-0.0005))).sum())
    return verdict(
        "H11",
        "|Lambda| = exp(-dt/2), in [0.951, 0.9995] at the S4D-Inv initialisation",
        "4 seeds x 64 heads x 16 modes; measured = worst |Lambda| error + count outside the range",
        worst + outside,
        1e-14,
    )
