"""Naming the bug: a shipped wrong backend or session, run as a backend, is named by its failure.

Each wrong backend is run on one small case that catches it (the smallest by input size, found
once by running it on the cases of its ops); the failure message must say that its values match
the wrong backend itself. A few whose smallest catching case is long (naming reruns every
suspect of the op on it: seconds to a minute) are matched against themselves only.
"""

import numpy as np
import pytest

from attnspec.conformance import cases, fox_variants, mutants, naming, runner
from attnspec.conformance.mutants import Mutant
from attnspec.conformance.numpy_backend import NumpyBackend
from attnspec.conformance.session_mutants import SESSION_MUTANTS

# mutant -> (case that catches it with wrong values, dtype)
CATCHING = {
    "ClosedSegment": ("fpa/shapes/0", "float64"),
    "SumNotMax": ("fpa/shapes/0", "float64"),
    "NoClamp": ("fpa/headdim/0", "float64"),
    "ForgottenGap": ("fpa/shapes/3", "float64"),
    "HeadDimTail": ("fpa/headdim_long/3", "float64"),
    "NoScale": ("fpa/shapes/0", "float64"),
    "BackwardDefaultScale": ("fpa/scale/1", "float64"),
    "NoRowMax": ("fox/large_logits/0", "float32"),
    "HalfAccumulation": ("fpa/long_uniform/0", "float16"),
    "FieldInInputDtype": ("fpa/large_field/0", "float16"),
    "DiagonalDroppedInRaggedTail": ("fpa/headdim/0", "float16"),
    "EarliestArgmin": ("fpa/brackets/0", "float64"),
    "TieAcrossTiles": ("fpa/ties_tiles/0", "float64"),
    "ZeroLevelGradient": ("fpa/headdim/0", "float64"),
    "Float64Gradients": ("fpa/headdim/0", "float16"),
    "InPlaceCumsum": ("fox/large_logits/0", "float64"),
    "VarlenBackwardLeak": ("fpa/covering/24", "float64"),
    "GQAWrongHead": ("fox/gqa/2", "float64"),
    "EagerEviction": ("decode/theta_near/2", "float64"),
    "StrictEviction": ("decode/boundary/0", "float64"),
    "RingBufferCache": ("decode/long/2", "float64"),
    "FinalNotPeak": ("decode/brackets/1", "float64"),
    "TransposePairing": ("s4d/shapes/0", "float64"),
    "RecurrenceOffByOne": ("s4d/shapes/0", "float64"),
    "HalfPrecisionState": ("s4d/long_ratio/0", "float16"),
    "DroppedDenominator": ("legs/shapes/0", "float64"),
    "EulerLegs": ("legs/covering/5", "float64"),
    "HalfOnlySlightScale": ("fpa/shapes/0", "float32"),
    "GQABatchStride": ("fox/gqa_batch/0", "float64"),
    "VarlenGQAModulo": ("fox/varlen_gqa/0", "float64"),
    "MaxSeqlenFromLast": ("fox/packings/0", "float64"),
    "S4DLateBorderCarry": ("s4d/packings/1", "float64"),
    "HeadDimOver128": ("fox/headdim_big/0", "float64"),
    "LongRowSplitBackward": ("fox/long_gradient/1", "float64"),
    "SavedForwardByShape": ("fox/call_order/0", "float64"),
    "ChunkedShortConv": ("interdomain_layer/long/0", "float64"),
    "LogPowers": ("s4d/zero_mode/1", "float64"),
    "ThetaInInputDtype": ("decode/theta_near/0", "float16"),
    "LayerDropsBias": ("fpa_layer/trained/0", "float64"),
    "IgnoresStrides": ("fox/strided/0", "float64"),
    "EmptySequenceMerges": ("fox/empty_segment/1", "float64"),
    "WindowOffByOne": ("fox/window/0", "float64"),
    "ModesRoundedDown": ("s4d/covering/8", "float64"),
    "LegsModesRoundedDown": ("legs/covering/5", "float64"),
    "EqualPackingUnmasked": ("fox/covering/6", "float64"),
    "StridedGQAQueryHeads": ("fpa/covering/4", "float64"),
    "PersistentOutputs": ("s4d/call_order/0", "float64"),
    "PackedRopePositions": ("interdomain_layer/covering/8", "float64"),
    "DecayClampedAt50": ("fox/large_logits/0", "float64"),
    "PaddingKeysAttended": ("fox/padded/0", "float64"),
    "LongRowSharedAccumulator": ("fox/long_gradient/2", "float64"),
    "GateAtOwnKey": ("fox/covering/17", "float64"),
    "NoCausalMaskInChunk": ("fox/covering/17", "float64"),
    "GateMultipliesScores": ("fox/covering/17", "float64"),
    "GatedLinearAttention": ("fox/shapes/0", "float64"),
}
# naming reruns every suspect of the op: over two seconds on these cases (with the kind that fails)
LONG = {
    "HalfAccumulation": "output",
    "LongRowSplitBackward": "gradient",
    "VarlenGQAModulo": "output",
    "RingBufferCache": "output",
    "HeadDimOver128": "output",
    "PersistentOutputs": "call_order",
    "HeadDimTail": "output",
    "GQABatchStride": "output",
    "LongRowSharedAccumulator": "gradient",
}
WRONG_BACKENDS = {**mutants.MUTANTS, **fox_variants.FOX_VARIANTS}


def test_every_wrong_backend_has_a_catching_case():
    assert set(CATCHING) == set(WRONG_BACKENDS)


def _run(backend, case, dtype):
    declared = dtype in backend.dtypes
    return runner.run(
        backend, [case], [dtype] if declared else [], probes=[] if declared else [dtype]
    )


@pytest.mark.parametrize("name", sorted(set(CATCHING) - set(LONG)))
def test_a_wrong_backend_is_named_by_its_failure(name):
    case_id, dtype = CATCHING[name]
    report = _run(WRONG_BACKENDS[name](), cases.build_case(case_id), dtype)
    failed = [r for r in report.results if r.verdict == "failed"]
    assert failed and not failed[0].raised, [r.message for r in report.results]
    named = [r.message for r in failed if "the values match" in r.message]
    assert named and f"`{name}`" in named[0].split("the values match")[1], failed[0].message


@pytest.mark.parametrize("name", sorted(LONG))
def test_a_wrong_backend_on_a_long_case_matches_itself(name):
    case_id, dtype = CATCHING[name]
    case = cases.build_case(case_id)
    kind = LONG[name]
    itself = [s for s in naming.suspects(case) if s.name == name]
    found = naming.matches(WRONG_BACKENDS[name](), case, dtype, kind, among=itself)
    assert [m.suspect.name for m in found] == [name]


@pytest.mark.parametrize("name", sorted(SESSION_MUTANTS))
def test_a_wrong_session_is_named_by_its_failure(name):
    mutant = SESSION_MUTANTS[name]
    case = cases.build_case(f"{cases.PREFIX[mutant.op]}/session_{mutant.family}/0")
    (result,) = runner.run(mutant(), [case], ["float64"]).results
    assert result.verdict == "failed"
    assert f"the values match `{name}` exactly" in result.message, result.message


class ScaledOutput(Mutant):
    """A bug the kit has no suspect for: every output 1 % too large."""

    def fox_attention(self, q, k, v, log_f, **kw):
        return (1.01 * super().fox_attention(q, k, v, log_f, **kw)).astype(q.dtype)


def test_an_unknown_bug_is_not_named_and_the_reference_matches_nothing():
    case = cases.build_case("fox/shapes/1")
    (result, *_) = runner.run(ScaledOutput(), [case], ["float64"]).results
    assert result.verdict == "failed" and "the values match" not in result.message
    assert naming.matches(NumpyBackend(), case, "float64", "output") == []


def test_a_suspect_that_equals_the_reference_on_the_case_is_not_named():
    # fpa/shapes/0 has T = 1: a lost gap minimum (ForgottenGap) changes nothing there
    case = cases.build_case("fpa/shapes/0")
    found = naming.matches(mutants.NoScale(), case, "float64", "output")
    assert "ForgottenGap" not in {m.suspect.name for m in found}
    assert np.isfinite([m.error for m in found]).all()
