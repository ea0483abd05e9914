"""Each theory check passes on the reference and FAILS when fed a wrong implementation."""

import json
import os
import sys
from unittest import mock

import numpy as np
import pytest
from scipy.optimize import linprog
from scipy.special import expit

from attnspec.conformance import mutants
from attnspec.reference import fpa, hippo
from attnspec.reference import interdomain as idm
from attnspec.theory import CHECKS, load_all, run_checks
from attnspec.theory.__main__ import main

load_all()


@pytest.fixture(scope="module")
def results():
    return {r.id: r for r in run_checks()}


def test_every_spec_statement_has_a_check():
    expected = {f"T{n}" for n in range(1, 7)} | {f"H{n}" for n in range(1, 12)} | {"F6"}
    assert expected <= set(CHECKS)


@pytest.mark.parametrize("check_id", sorted(CHECKS))
def test_check_passes_on_the_reference(results, check_id):
    r = results[check_id]
    assert r.passed, (r.measured, r.tolerance, r.witness)
    assert r.statement and r.witness


# wrong implementations


def stack_pops_equal_levels(field):
    """A monotonic stack that also pops keys at the same level (>= instead of >)."""
    field = np.asarray(field, float)
    live = np.zeros((*field.shape, field.shape[-1]), dtype=bool)
    for b in np.ndindex(*field.shape[:-1]):
        stack = []
        for i in range(field.shape[-1]):
            while stack and field[b][stack[-1]] >= field[b][i]:
                stack.pop()
            stack.append(i)
            live[b][i, stack] = True
    return live


def live_strict(field, level):
    """Liveness with the strict inequality l_j < m_ij: siblings at the same depth die."""
    T = np.shape(field)[-1]
    m = fpa.segment_min(field)
    return ((np.asarray(level)[..., None, :] < m) | np.eye(T, dtype=bool)) & np.tril(
        np.ones((T, T), dtype=bool)
    )


def depth_sum_not_max(field, level):
    return mutants.SumNotMax().depth(np.asarray(field, float), np.asarray(level, float))


def fox_without_cumsum(q, k, v, log_f, *, scale=None, return_lse=False):
    return fpa.fpa_attention(q, k, v, log_f, log_f, scale=scale, return_lse=return_lse)


def fox_per_key_gate(q, k, v, log_f, *, scale=None):
    """FoX whose bias is the key's own gate, log f_j, instead of the sum over (j, i]."""
    T = q.shape[-2]
    s = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    o, _ = mutants._attend(
        s * q @ np.swapaxes(k, -1, -2) + np.broadcast_to(log_f[..., None, :], (*log_f.shape, T)), v
    )
    return o


def selectable_without_bias(keys, subset):
    """Thresholding <q, k> at 0 only (no bias b): homogeneous halfspaces."""
    N, dk = keys.shape
    sign = np.where(np.isin(np.arange(N), subset), -1.0, 1.0)
    res = linprog(
        np.zeros(dk), A_ub=sign[:, None] * keys, b_ub=-np.ones(N), bounds=[(None, None)] * dk
    )
    return res.status == 0


def legs_transition_wrong_b(M):
    A, _ = hippo.legs_transition(M)
    return A, 2 * np.arange(M) + 1.0  # B_n = 2n+1 instead of sqrt(2n+1)


def legs_project_euler(f, M):
    A, B = hippo.legs_transition(M)
    f = np.asarray(f, float)
    flat = f.reshape(f.shape[0], -1)
    c, out = np.zeros((M, flat.shape[1])), np.zeros((f.shape[0], M, flat.shape[1]))
    for n in range(1, f.shape[0] + 1):
        c = c + (-A @ c + np.outer(B, flat[n - 1])) / n
        out[n - 1] = c
    return out.reshape(f.shape[0], M, *f.shape[1:])


def ratio_without_denominator(fq, co):
    a = np.einsum("...tmr,...tr->...tm", co.U, fq)
    return np.einsum("...tm,...tmd->...td", a, co.Gamma)


def s4d_transpose(fq, kt, vt, lam, b, c, *, readout="linear"):
    return mutants._s4d_variant(fq, kt, vt, lam, b, c, readout, pairing="transpose")


def s4d_anticausal(fq, kt, vt, lam, b, c, *, readout="linear"):
    flip = lambda x: x[..., ::-1, :]  # noqa: E731
    return flip(idm.interdomain_s4d(flip(fq), flip(kt), flip(vt), lam, b, c, readout=readout))


def states_lagged(z, lam, b):
    lagged = np.concatenate([np.zeros_like(z[..., :1, :]), z[..., :-1, :]], axis=-2)
    return idm.s4d_states(lagged, lam, b)


def feature_map_squared_norm(y, eps=1e-6):
    y = np.asarray(y, float)
    return y * expit(y) / (np.sum(y**2, axis=-1, keepdims=True) + eps)


def lambda_without_exp(log_dt, a_log, a_im):
    a = -np.exp(np.asarray(a_log)) + 1j * np.asarray(a_im)
    return np.exp(np.asarray(log_dt)[:, None] * a)  # uses log_dt as dt


WRONG = {
    "F6": {"fox_attention": fox_without_cumsum},
    "F2-max": {"descent_depth": depth_sum_not_max},
    "T1": {"stack_live_keys": stack_pops_equal_levels},
    "T1-brackets": {"live_keys": live_strict},
    "T2": {"descent_depth": depth_sum_not_max},
    "T3": {"fpa_decode": lambda *a, theta, **k: fpa.fpa_decode(*a, theta=theta / 4, **k)},
    "T4": {
        "fpa_attention": lambda q, k, v, field, level: mutants.NoClamp().fpa_attention(
            q, k, v, field, level
        )
    },
    "T5": {"fox_attention_direct": fox_per_key_gate},
    "T6": {"selectable": selectable_without_bias},
    "H1": {"legs_transition": legs_transition_wrong_b},
    "H2": {"legs_project": legs_project_euler},
    "H3": {"interdomain_discrete": idm.interdomain_legs},
    "H4": {"interdomain_legs": lambda fq, fk, v, M: idm.interdomain_legs(fq, fk, v, 4)},
    "H5": {"ratio_readout": ratio_without_denominator},
    "H6": {
        "decoder": lambda lam, b, c, readout: idm.InterdomainDecoder(
            np.ones_like(lam), b, c, readout=readout
        )
    },
    "H7": {"interdomain_s4d": s4d_anticausal},
    "H8": {"s4d_states": states_lagged},
    "H9": {"interdomain_s4d": s4d_transpose},
    "H10": {"feature_map": feature_map_squared_norm},
    "H11": {"s4d_lambda": lambda_without_exp},
}


def _earliest_vjp(q, k, v, field, level, d_out, **kw):
    """The FPA backward with ties of (G3) sent to the earliest argmin."""
    with mock.patch.object(fpa, "segment_argmin", mutants._earliest_segment_argmin):
        return fpa.fpa_attention_vjp(q, k, v, field, level, d_out, **kw)


WRONG["F6-grad"] = {"fpa_attention_vjp": _earliest_vjp}


def test_every_check_has_a_wrong_implementation():
    assert set(WRONG) == set(CHECKS)


@pytest.mark.parametrize("check_id", sorted(WRONG))
def test_check_fails_for_a_wrong_implementation(check_id):
    result = CHECKS[check_id](**WRONG[check_id])
    assert not result.passed, f"{check_id} passed a wrong implementation: {result.measured}"


# the command


def test_command_prints_table_writes_json_and_plots(tmp_path, capsys):
    js = tmp_path / "theory.json"
    assert main(["--json", str(js), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    for check_id in CHECKS:
        assert f"\n{check_id:<12} PASS" in out
    assert "failed: " not in out and f"{len(CHECKS)} passed, 0 failed" in out
    rows = json.loads(js.read_text())
    assert {r["id"] for r in rows} == set(CHECKS) and all(r["passed"] for r in rows)
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert pngs == ["attention_maps.png", "eviction.png", "legs.png", "stack.png"]
    for name in pngs:
        with open(tmp_path / "plots" / name, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plots_without_matplotlib_say_so_before_the_checks_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    ran = []
    monkeypatch.setitem(CHECKS, "H10", lambda: ran.append("H10"))
    with pytest.raises(SystemExit) as exit_:
        main(["--only", "H10", "--plots", str(tmp_path / "plots")])
    assert exit_.value.code == 2 and not ran
    err = capsys.readouterr().err
    assert "--plots needs matplotlib" in err and "'.[plots]'" in err
    assert not (tmp_path / "plots").exists()


def test_command_exit_code_on_failure(monkeypatch, capsys):
    monkeypatch.setitem(CHECKS, "H11", lambda: CHECKS["H10"](feature_map=feature_map_squared_norm))
    assert main(["--only", "H11"]) == 1
    assert "FAIL" in capsys.readouterr().out


# context parallelism


def _cross_chunk_min_no_gap(field, key, query, chunks):
    """(CP1) without the minima of the chunks strictly between key and query."""
    return cp.cross_chunk_min(field, key, query, [])


def _inclusive_scan(totals):
    """(CP3) off by one chunk: the inclusive scan of chunk totals."""
    return np.cumsum(totals, axis=-1)


def _carry_not_propagated(decays, finals):
    """(CP4) each shard receives only its left neighbour's final state, not the carried one."""
    return [np.zeros_like(finals[0]), *finals[:-1]]


def _owner_only(*args, **kw):
    """(CP2) without the reduction: each chunk keeps only its owner's gradient contributions."""
    return cp.sharded_fpa(*args, **kw, reduce=False)


from attnspec.theory import context_parallel as cp  # noqa: E402

WRONG["CP1"] = {"cross_chunk_min": _cross_chunk_min_no_gap}
WRONG["CP2"] = {"sharded_fpa": _owner_only}
WRONG["CP3"] = {"exclusive_scan": _inclusive_scan}
WRONG["CP4"] = {"carry_scan": _carry_not_propagated}


@pytest.mark.parametrize("check_id", ["CP1", "CP2", "CP3", "CP4"])
def test_context_parallel_check_fails_for_a_wrong_implementation(check_id):
    result = CHECKS[check_id](**WRONG[check_id])
    assert not result.passed, f"{check_id} passed a wrong implementation: {result.measured}"


from attnspec.conformance import session_mutants  # noqa: E402

WRONG["F8"] = {"factory": session_mutants._FreedByFirstHead}
WRONG["F3w"] = {"factory": session_mutants._WindowOffByOne}
WRONG["F9"] = {"factory": session_mutants._MinimaNotRestored}
WRONG["I15"] = {"legs_factory": session_mutants._LegsChunkCounter}


@pytest.mark.parametrize("check_id", ["F8", "F3w", "F9", "I15"])
def test_session_check_fails_for_a_wrong_session(check_id):
    result = CHECKS[check_id](**WRONG[check_id])
    assert not result.passed, f"{check_id} passed a wrong session: {result.measured}"
