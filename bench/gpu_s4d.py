"""GPU check, S4D section: the chunked ``interdomain_s4d`` Triton kernels against
flash-linear-attention's ``chunk_gla`` at the same real state size (GLA key dim K = 2M).

Order: a reference-matching check first (float32 and bfloat16 against the float64 reference,
outputs and every gradient, the kit's tolerances), then timings with ``triton.testing.do_bench``
(median of quantiles 0.5/0.2/0.8, warmup 25 ms, rep 100 ms; inputs prepared outside the timed
region): forward and forward+backward at T in {2048, 8192, 32768}, M = 64, R = 64,
dv in {64, 128}, bf16. Printed: ms, tokens/s, the ratio to chunk_gla and time(32K)/time(8K),
and the time of the 16-row S4D tiling (programs of 16 tokens, the loop form: the Hopper default
before the chunk-wide lag tiling, "S4D 16-row" in bench/gpu_static_interdomain.py) to confirm
the Hopper default by measurement.
Goals (issue 11): forward+backward within 2x of chunk_gla, time(32K)/time(8K) <= 4.4.

Run from the repository root: ``python -m bench.gpu_s4d`` or ``python bench/gpu_s4d.py``;
``--dry-run`` runs the same steps on CPU under the Triton interpreter at tiny shapes, with fla's
naive recurrent GLA standing in for chunk_gla (which needs a GPU) and wall-clock timing.
``--compile-only`` needs no GPU either: it runs the static Hopper gate of the Interdomain
kernels, ``python -m bench.gpu_static_interdomain`` (every kernel compiled for sm_90 at the
Hopper tiles beside fla's chunk_gla; registers, spills, shared memory, tensor-core kind).
Exit status 1 when the reference check or a compilation fails. ``--out FILE``: the check, the
rows (ms, peer ms, ratio) and the summary as JSON, written as the run goes (bench/gpu_check.sh
writes ``s4d.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from types import SimpleNamespace

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GPU_SHAPES = dict(B=1, H=16, R=64, M=64, Ts=(2048, 8192, 32768), dvs=(64, 128))
DRY_SHAPES = dict(B=1, H=1, R=16, M=16, Ts=(16, 32, 64), dvs=(16,))


def _inputs(torch, B, T, H, R, V, M, dtype, device, seed=0):
    """S4D inputs at initialisation scales (S4D-Inv, log dt uniform in [log 1e-3, log 1e-1],
    b = 1, C complex normal / sqrt(2M)); features in ``dtype``, parameters float32."""
    import numpy as np

    from attnspec.reference import hippo
    from attnspec.reference import interdomain as ref

    rng = np.random.default_rng(seed)
    fq, kt = rng.standard_normal((2, B, T, H, R)) / R**0.5
    vt, do = rng.standard_normal((2, B, T, H, V))
    a_log, a_im = hippo.s4d_init(M)
    log_dt = rng.uniform(np.log(1e-3), np.log(1e-1), H)
    lam = ref.s4d_lambda(log_dt, np.tile(a_log, (H, 1)), np.tile(a_im, (H, 1)))
    b = np.ones((H, M), dtype=complex)
    c = (rng.standard_normal((H, M, M)) + 1j * rng.standard_normal((H, M, M))) / np.sqrt(2 * M)
    feats = [torch.tensor(x, dtype=dtype, device=device) for x in (fq, kt, vt, do)]
    params = [
        torch.view_as_real(torch.tensor(x, dtype=torch.complex64, device=device)).contiguous()
        for x in (lam, b, c)
    ]
    return feats, params


def reference_check(torch, ti, device, T: int) -> bool:
    """Outputs and gradients against the float64 reference, both readouts, two dtypes."""
    import numpy as np

    from attnspec.conformance.metrics import relative_error
    from attnspec.conformance.tolerances import round_to, tolerance
    from attnspec.reference import interdomain as ref

    ok = True
    B, H, R, V, M = 1, 2, 16, 24, 16
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for readout in ("linear", "ratio"):
            (fq, kt, vt, do), (lam, b, c) = _inputs(torch, B, T, H, R, V, M, dtype, device, 1)
            if readout == "ratio":  # positive features, C near I: the denominator stays away from 0
                fq, kt = fq.abs() + 0.1, kt.abs() + 0.1
                c = (
                    0.1 * c
                    + torch.eye(M, device=device)[..., None]
                    * torch.tensor([1.0, 0.0], device=device)
                ).contiguous()
            args = (fq, kt, vt, lam, b, c, readout, None, None)
            o, _, saved = ti.s4d_fwd(*args, return_saved=True)
            grads = ti.s4d_bwd(*args, do, None, saved)
            np_ = lambda x: np.swapaxes(x.double().cpu().numpy(), 1, 2)  # noqa: E731
            cx = lambda x: torch.view_as_complex(x.double().cpu()).numpy()  # noqa: E731
            want_o = ref.interdomain_s4d(
                np_(fq), np_(kt), np_(vt), cx(lam), cx(b), cx(c), readout=readout
            )
            want = ref.interdomain_s4d_vjp(
                np_(fq),
                np_(kt),
                np_(vt),
                cx(lam),
                cx(b),
                cx(c),
                round_to(np_(do), name),
                readout=readout,
            )
            errors = {"o": relative_error(np_(o), want_o)}
            for key, x in zip(("dfq", "dkt", "dvt"), grads[:3], strict=True):
                errors[key] = relative_error(np_(x), getattr(want, key))
            for key, x in zip(("dlam", "db", "dc"), grads[3:6], strict=True):
                errors[key] = relative_error(cx(x), getattr(want, key))
            tol_o = tolerance("interdomain_s4d", name, "output")
            tol_g = tolerance("interdomain_s4d", name, "gradient")
            passed = errors["o"] < tol_o and all(e < tol_g for k, e in errors.items() if k != "o")
            ok &= passed
            errs = ", ".join(f"{k} {e:.1e}" for k, e in errors.items())
            verdict = "pass" if passed else "FAIL"
            print(f"  check {name:<8} {readout:<6} T={T} M={M}: {verdict} ({errs})")
    return ok


def _timer(torch, dry: bool):
    if dry:

        def wall(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

        return wall
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])[0]


def _gla_peer(dry: bool):
    """(description, fn(q, k, v, g) -> o or None when flash-linear-attention is missing)."""
    try:
        if dry:
            from fla.ops.gla.naive import naive_recurrent_gla as gla

            name = "naive_recurrent_gla (dry-run stand-in)"
        else:
            from fla.ops.gla import chunk_gla as gla

            name = "chunk_gla"
    except ImportError as exc:
        return f"none: flash-linear-attention not importable ({exc})", None
    import fla

    return f"fla {getattr(fla, '__version__', '?')} {name}", lambda q, k, v, g: gla(q, k, v, g)[0]


def _time_config(torch, ti, bench, peer, B, T, H, R, V, M, dtype, device):
    """(ours fwd, peer fwd, ours fwd+bwd, peer fwd+bwd) in ms for one shape (peer: nan
    without one)."""
    import torch.nn.functional as F

    (fq, kt, vt, do), (lam, b, c) = _inputs(torch, B, T, H, R, V, M, dtype, device)
    args = (fq, kt, vt, lam, b, c, "linear", None, None)

    def ours_fwdbwd():  # as the autograd op runs them: the backward takes the forward's saved
        _, _, saved = ti.s4d_fwd(*args, return_saved=True)
        ti.s4d_bwd(*args, do, None, saved)

    with torch.no_grad():
        t_fwd = bench(lambda: ti.s4d_fwd(*args))
    t_fb = bench(ours_fwdbwd)
    if peer is None:
        return t_fwd, math.nan, t_fb, math.nan
    q, k = (torch.randn(B, T, H, 2 * M, device=device, dtype=dtype) for _ in range(2))
    g = F.logsigmoid(torch.randn(B, T, H, 2 * M, device=device)).div(16)
    leaves = [x.clone().requires_grad_() for x in (q, k, vt)]

    def peer_fwdbwd():
        peer(*leaves, g).backward(do)

    with torch.no_grad():
        p_fwd = bench(lambda: peer(q, k, vt, g))
    return t_fwd, p_fwd, t_fb, bench(peer_fwdbwd)


def timings(torch, ti, device, shapes, dry: bool) -> list[dict]:
    bench = _timer(torch, dry)
    peer_name, peer = _gla_peer(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    B, H, R, M = shapes["B"], shapes["H"], shapes["R"], shapes["M"]
    rows = []
    print(f"  peer: {peer_name}, K = 2M = {2 * M}; ours: M = {M} complex modes, R = {R}")
    for V in shapes["dvs"]:
        for T in shapes["Ts"]:
            t_fwd, p_fwd, t_fb, p_fb = _time_config(
                torch, ti, bench, peer, B, T, H, R, V, M, dtype, device
            )
            w_fwd = w_fb = math.nan  # the 16-row tiling beside the default, at the longest T
            if T == shapes["Ts"][-1]:  # (the summary's column; no peer rerun)
                with ti.rows16():
                    w_fwd, _, w_fb, _ = _time_config(
                        torch, ti, bench, None, B, T, H, R, V, M, dtype, device
                    )
            for mode, t, p, w in (("fwd", t_fwd, p_fwd, w_fwd), ("fwd+bwd", t_fb, p_fb, w_fb)):
                rows.append(
                    dict(
                        T=T, dv=V, mode=mode, ms=t, peer_ms=p, rows16_ms=w, tok_s=B * T / (t * 1e-3)
                    )
                )
                print(
                    f"  T={T:>6} dv={V:>4} {mode:<8} ours {t:9.3f} ms  peer {p:9.3f} ms  "
                    f"ratio {t / p:6.2f}  {B * T / (t * 1e-3):12.4g} tokens/s"
                    + ("" if math.isnan(w) else f"  16-row {w:9.3f} ms")
                )
    return rows


def summary(rows: list[dict], Ts, label: str) -> list[str]:
    """The short table: ratio to the peer and time(T_max)/time(T_prev) per (dv, mode)."""
    big, prev = Ts[-1], Ts[-2]
    lines = [
        f"S4D vs chunk_gla ({label}): ratio = ours / peer; linearity = t({big}) / t({prev})",
        f"{'dv':>4} {'mode':<8} {'ratio@' + str(big):>12} {'linearity':>10} {'peer lin.':>10}"
        f" {'16-row ratio':>13}",
    ]
    for dv in sorted({r["dv"] for r in rows}):
        for mode in ("fwd", "fwd+bwd"):
            sel = {r["T"]: r for r in rows if r["dv"] == dv and r["mode"] == mode}
            lin = sel[big]["ms"] / sel[prev]["ms"]
            peer_lin = sel[big]["peer_ms"] / sel[prev]["peer_ms"]
            ratio = sel[big]["ms"] / sel[big]["peer_ms"]
            rows16 = sel[big]["rows16_ms"] / sel[big]["peer_ms"]
            lines.append(
                f"{dv:>4} {mode:<8} {ratio:>12.2f} {lin:>10.2f} {peer_lin:>10.2f} {rows16:>13.2f}"
            )
    lines.append("goals: fwd+bwd ratio <= 2.0; linearity <= 4.4 for T 8K -> 32K")
    return lines


def save(report: dict, out: str | None) -> None:
    """Write the report (again) now: a crash later loses nothing measured."""
    if out:
        with open(out + ".tmp", "w") as fh:
            json.dump(report, fh, indent=1)
        os.replace(out + ".tmp", out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, Triton interpreter, tiny shapes"
    )
    parser.add_argument(
        "--compile-only", action="store_true", help="compile for sm_90 on this machine (no GPU)"
    )
    parser.add_argument("--out", help="JSON file of the check, the rows and the summary")
    args = parser.parse_args(argv)
    if args.compile_only:
        from bench import gpu_static_interdomain

        return gpu_static_interdomain.main([])
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch
    import triton

    from attnspec.backends.torch import triton_chunks, triton_s4d, triton_s4d_bwd
    from bench.gpu_static_interdomain import ROWS16, VARIANTS

    ti = SimpleNamespace(
        s4d_fwd=triton_s4d.s4d_fwd,
        s4d_bwd=triton_s4d_bwd.s4d_bwd,
        rows16=lambda: triton_chunks.block_sizes(**dataclasses.asdict(VARIANTS()[ROWS16])),
    )
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("gpu_s4d: no CUDA device; use --dry-run on CPU", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    name = "CPU (Triton interpreter)" if dry else torch.cuda.get_device_name()
    print(
        f"== S4D section: {name}; torch {torch.__version__}, triton {triton.__version__}, "
        f"CUDA {torch.version.cuda}"
    )
    report = {"section": "s4d", "device": name, "dry_run": dry, "rows": [], "summary": []}
    report["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    print("reference check (float64 reference, kit tolerances):")
    report["check_passed"] = reference_check(torch, ti, device, T=40 if dry else 300)
    save(report, args.out)
    if not report["check_passed"]:
        print("S4D: reference check FAILED; timings skipped")
        return 1
    shapes = DRY_SHAPES if dry else GPU_SHAPES
    report["rows"] = timings(torch, ti, device, shapes, dry)
    label = "float32, interpreter: not a speed measure" if dry else "bf16"
    report["summary"] = summary(report["rows"], shapes["Ts"], label)
    save(report, args.out)
    print("\n" + "\n".join(report["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
