"""HiPPO operators: LegS and LegT transitions, the exact LegS step, discretisation, S4D inits.

The executable statement of section 1 of ``docs/spec/interdomain.md``; labels (``# (I5)``) are
the spec's. Sign convention: ``legs_transition`` and ``legt_transition`` return the positive
matrices of the spec, for dc/dt = -(1/t) A c + (1/t) B f (LegS) and dc/dt = -A c + B f (LegT);
``discretize`` takes the standard state-space form dx/dt = A x + B u, as scipy does.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numpy.polynomial import legendre
from numpy.typing import ArrayLike, NDArray
from scipy.linalg import expm, solve_triangular

from .validation import check_shape, finite_result, positive_int, real_array, scalar


def legs_transition(M: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(I4) the HiPPO-LegS matrices.

    A_nk = sqrt(2n+1) sqrt(2k+1) if n > k; n + 1 if n = k; 0 if n < k.  B_n = sqrt(2n+1).

    Returns:
        A (M, M) lower triangular, B (M,), float64. Cost: O(M^2) time and memory.
    """
    M = positive_int("M", M)
    # --8<-- [start:i4]
    r = np.sqrt(2 * np.arange(M) + 1.0)
    A = np.tril(np.outer(r, r), k=-1) + np.diag(np.arange(1.0, M + 1))
    # --8<-- [end:i4]
    return A, r.copy()


def legt_transition(M: int, theta: float = 1.0) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """HiPPO-LegT (sliding window of length theta, the LMU form) for dc/dt = -A c + B f.

    A_nk = (2n+1)/theta * ((-1)^(n-k) if n >= k else 1),  B_n = (2n+1) (-1)^n / theta.
    The coefficients are those of f on the window in the shifted Legendre basis P_n(2r - 1),
    normalised so that a constant input has steady state e_0.

    Args:
        M: integer >= 1; theta: window length > 0.

    Returns:
        A (M, M), B (M,), float64. Cost: O(M^2) time and memory.
    """
    M = positive_int("M", M)
    theta = scalar("theta", theta, positive=True)
    n = np.arange(M)[:, None]
    k = np.arange(M)[None, :]
    A = (2 * n + 1.0) * np.where(n >= k, (-1.0) ** (n - k), 1.0) / theta
    B = (2 * np.arange(M) + 1.0) * (-1.0) ** np.arange(M) / theta
    return A, B  # type: ignore[return-value]  # numpy's stubs widen int * float to floating[Any]


@lru_cache(maxsize=4096)
def _legs_step_cached(n: int, M: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    A, B = legs_transition(M)
    # --8<-- [start:i5]
    A_inv_B = solve_triangular(A, B, lower=True)
    if n == 1:
        return np.zeros((M, M)), A_inv_B  # (I5) c_1 = A^{-1} B f_1: the history starts at t = 0
    E = expm(-A * np.log(n / (n - 1)))  # (I5) E_n, exact over log time [log(n-1), log n]
    F = solve_triangular(A, (np.eye(M) - E) @ B, lower=True)  # A^{-1} (I - E_n) B
    # --8<-- [end:i5]
    return E, F


def legs_step(n: int, M: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(I5) the exact LegS step for token n (1-based) with piecewise-constant input.

    c_n = E_n c_{n-1} + F_n f_n with E_n = expm(-A log(n/(n-1))), F_n = A^{-1} (I - E_n) B;
    E_1 = 0 and F_1 = A^{-1} B.

    Returns:
        E_n (M, M), F_n (M,) float64 (fresh copies; callers may modify them).

    Cost: O(M^3) time (one expm, cached per (n, M)), O(M^2) memory.
    """
    n = positive_int("n", n)
    M = positive_int("M", M)
    E, F = _legs_step_cached(n, M)
    return E.copy(), F.copy()


def legs_chunk_products(
    M: int, L: int, stop: int, start: int = 0
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """(I5) composed across chunks of L tokens: the tables a chunked LegS scan multiplies by.

    For the token at 0-based position p (token n = p + 1) in the chunk that starts at n0:
    Phi[p] = E_{p+1} ... E_{n0+1} carries the state before the chunk to p, and
    K[p, j] = E_{p+1} ... E_{n0+j+2} F_{n0+j+1} weighs the input at n0 + j (zero when
    n0 + j > p), so c_p = Phi[p] c_{n0-1} + sum_j K[p, j] f_{n0+j}. Chunks start at multiples of
    L; the rows are those of positions start .. stop - 1 (start a multiple of L). The torch,
    Triton and JAX LegS kernels take their chunk tables from here (reshaped to their layouts).

    Returns:
        Phi (stop - start, M, M), K (stop - start, L, M), float64.

    Cost: O((stop - start) M^2 (M + L)) time, plus the steps' expm (cached per (n, M)).
    """
    M, L = positive_int("M", M), positive_int("L", L)
    if start < 0 or start % L or stop < start:
        raise ValueError(
            f"start: expected a multiple of L = {L} in [0, stop = {stop}], got {start}"
        )
    phi = np.zeros((stop - start, M, M))
    weights = np.zeros((stop - start, L, M))
    for n0 in range(start, stop, L):
        P, K = np.eye(M), np.zeros((M, L))
        for p in range(n0, min(n0 + L, stop)):
            E, F = _legs_step_cached(p + 1, M)  # (I5) token n = p + 1
            P, K = E @ P, E @ K
            K[:, p - n0] = F
            phi[p - start], weights[p - start] = P, K.T
    return phi, weights


def legs_project(f: ArrayLike, M: int) -> NDArray[np.float64]:
    """Causal LegS projection of a token sequence by the recurrence (I5).

    Args:
        f: (T,) or (T, C) real, token n's value held on [n-1, n).
        M: number of Legendre coefficients.

    Returns:
        c (T, M) or (T, M, C): row n-1 holds the coefficients of the history [0, n].

    Cost: O(T M^3) for the steps (cached) plus O(T M^2 C) time, O(T M C) memory.
    """
    f = real_array("f", f, min_ndim=1)
    M = positive_int("M", M)
    channels = f.reshape(f.shape[0], -1)  # (T, C)
    c = np.zeros((f.shape[0], M, channels.shape[1]))
    state = np.zeros((M, channels.shape[1]))
    # --8<-- [start:i5-scan]
    for n in range(1, f.shape[0] + 1):
        E, F = _legs_step_cached(n, M)
        state = E @ state + np.outer(F, channels[n - 1])  # (I5)
        c[n - 1] = state
    # --8<-- [end:i5-scan]
    return c.reshape(f.shape[0], M, *f.shape[1:])


def legs_project_vjp(f_shape: tuple[int, ...], dc: ArrayLike) -> NDArray[np.float64]:
    """Adjoint of :func:`legs_project` (linear in f): g_n = dc_n + E_{n+1}^T g_{n+1}, reversed.

    Args:
        f_shape: (T,) or (T, C), the shape of f.
        dc: cotangent shaped like the output of :func:`legs_project`.

    Returns:
        df shaped ``f_shape``. Cost: O(T M^2 C) time (steps cached), O(T M C) memory.
    """
    f_shape = tuple(positive_int("f_shape", n) for n in f_shape)
    if len(f_shape) not in (1, 2):
        raise ValueError(f"f_shape: expected (T,) or (T, C), got {f_shape}")
    dc = real_array("dc", dc, min_ndim=2)
    T, M = dc.shape[:2]
    check_shape("dc", dc, (f_shape[0], M, *f_shape[1:]), "(T, M) + the channels of f_shape")
    flat = dc.reshape(T, M, -1)  # (T, M, C)
    df = np.zeros((T, flat.shape[2]))
    g = np.zeros((M, flat.shape[2]))
    for n in range(T, 0, -1):
        if n < T:
            E_next, _ = _legs_step_cached(n + 1, M)
            g = E_next.T @ g
        g = g + flat[n - 1]
        _, F = _legs_step_cached(n, M)
        df[n - 1] = F @ g
    return df.reshape(f_shape)


def legs_project_closed_form(f: ArrayLike, M: int) -> NDArray[np.float64]:
    """The LegS projection integral, evaluated with Legendre antiderivatives (witness for (I5)).

    c_m(N) = (sqrt(2m+1)/N) sum_n f_n int_{n-1}^{n} P_m(2s/N - 1) ds
           = (sqrt(2m+1)/2) sum_n f_n [Q_m(x_n) - Q_m(x_{n-1})],  x_n = 2n/N - 1, Q_m' = P_m.

    Same contract as :func:`legs_project`. Cost: O(T^2 M C + T M^3) time, O(T M C) memory.
    """
    f = real_array("f", f, min_ndim=1)
    M = positive_int("M", M)
    T = f.shape[0]
    channels = f.reshape(T, -1)
    out = np.zeros((T, M, channels.shape[1]))
    for N in range(1, T + 1):
        x = 2.0 * np.arange(N + 1) / N - 1.0  # token edges mapped to [-1, 1]
        for m in range(M):
            Q = legendre.legint(np.eye(M)[m])  # antiderivative of P_m
            increments = np.diff(legendre.legval(x, Q))  # (N,) integrals over each token
            out[N - 1, m] = np.sqrt(2 * m + 1) / 2 * increments @ channels[:N]
    return out.reshape(T, M, *f.shape[1:])


def legs_reconstruct(c: ArrayLike, t: float, x: ArrayLike) -> NDArray[np.float64]:
    """Evaluate sum_m c_m g_m(x), g_m(x) = sqrt(2m+1) P_m(2x/t - 1), at points x in [0, t].

    Args:
        c: (M,) coefficients of the history [0, t].
        t: the current time.
        x: points (P,).

    Returns:
        (P,) float64. Cost: O(P M) time, O(P + M) memory.
    """
    c = real_array("c", c, min_ndim=1)
    if c.ndim != 1:
        raise ValueError(f"c: expected shape (M,), got {c.shape}")
    x = real_array("x", x, min_ndim=1)
    t = scalar("t", t, positive=True)
    scale = np.sqrt(2 * np.arange(c.shape[0]) + 1.0)
    return legendre.legval(2 * x / t - 1, c * scale)


def discretize(
    A: ArrayLike, B: ArrayLike, dt: float, method: str = "zoh"
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Discretise dx/dt = A x + B u with step dt.

    zoh: Ad = expm(A dt), Bd = int_0^dt expm(A s) ds B (the upper-right block of the expm of
    [[A, B], [0, 0]] dt; valid for singular A).
    bilinear: Ad = (I - dt/2 A)^{-1} (I + dt/2 A), Bd = (I - dt/2 A)^{-1} dt B.

    Args:
        A: (N, N); B: (N,) or (N, P).

    Returns:
        Ad (N, N), Bd shaped like B. Cost: O((N + P)^3) time, O((N + P)^2) memory.
    """
    A = real_array("A", A, min_ndim=2)
    B = real_array("B", B, min_ndim=1)
    dt = scalar("dt", dt, positive=True)
    N = A.shape[0]
    if A.shape != (N, N):
        raise ValueError(f"A: expected a square matrix, got shape {A.shape}")
    if B.shape[0] != N or B.ndim > 2:
        raise ValueError(f"B: expected ({N},) or ({N}, P) (N from A), got shape {B.shape}")
    B2 = B.reshape(N, -1)
    if method not in ("zoh", "bilinear"):
        raise ValueError(f"method: expected 'zoh' or 'bilinear', got {method!r}")
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below
        if method == "zoh":
            P = B2.shape[1]
            block = np.zeros((N + P, N + P))
            block[:N, :N] = A
            block[:N, N:] = B2
            E = expm(block * dt)
            Ad, Bd = E[:N, :N], E[:N, N:]
        else:
            left = np.eye(N) - dt / 2 * A
            try:
                Ad = np.linalg.solve(left, np.eye(N) + dt / 2 * A)
            except np.linalg.LinAlgError:
                raise ValueError(
                    "A, dt: I - dt/2 A is singular (dt/2 times an eigenvalue of A is 1); "
                    "the bilinear transform is undefined there"
                ) from None
            Bd = np.linalg.solve(left, dt * B2)
    overflow = "A, B, dt: the discretised system overflows float64 (A dt too large)"
    return finite_result(Ad, overflow), finite_result(Bd, overflow).reshape(B.shape)


def discrete_orthonormal_basis(T: int, M: int) -> NDArray[np.float64]:
    """(I7) G (T, M): orthonormal columns under uniform weights 1/T, first column constant 1.

    Column m spans the polynomials of degree <= m in x_t = 2t/T - 1 (t = 1..T). The QR is taken
    of the Legendre-Vandermonde matrix, which spans the same space as the monomial one but is
    far better conditioned [decision]. Requires M <= T.

    Cost: O(T M^2) time (one QR), O(T M) memory.
    """
    T = positive_int("T", T)
    M = positive_int("M", M)
    if M > T:
        raise ValueError(f"M: expected M <= T = {T} (at most T orthonormal columns), got {M}")
    # --8<-- [start:i7]
    x = 2.0 * np.arange(1, T + 1) / T - 1.0
    Q, R = np.linalg.qr(legendre.legvander(x, M - 1))
    return np.sqrt(T) * Q * np.sign(np.diag(R))  # G^T G / T = I, G[:, 0] = +1
    # --8<-- [end:i7]


def s4d_init(M: int, kind: str = "inv") -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """S4D diagonal initialisations: a = -exp(a_log) + i a_im with a_log = log(1/2).

    inv: a_im[n] = (N/pi) (N/(2n+1) - 1), N = 2M (the upper halves of N = 2M conjugate pairs).
    lin: a_im[n] = pi n.

    Returns:
        a_log (M,), a_im (M,). Cost: O(M).
    """
    M = positive_int("M", M)
    n = np.arange(M)
    if kind == "inv":
        N = 2 * M
        a_im = N / np.pi * (N / (2 * n + 1.0) - 1.0)
    elif kind == "lin":
        a_im = np.pi * n.astype(float)
    else:
        raise ValueError(f"kind: expected 'inv' or 'lin', got {kind!r}")
    return np.full(M, np.log(0.5)), a_im
