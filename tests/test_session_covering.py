"""Session programs from covering designs: each program does what its row says, every pair of
session-feature values is in some program, and the reading of programs is held to hand-made
ones."""

import numpy as np
import pytest

from attnspec.conformance import coverage_report
from attnspec.conformance import session_covering as sc
from attnspec.conformance.session_programs import script


@pytest.mark.parametrize("op", sc.OPS)
def test_each_program_shows_the_values_of_its_row(op):
    for n, row in enumerate(sc.rows(op)):
        shown = sc.program_axes(op, sc.program(op, np.random.default_rng(n), n))
        assert all(value in shown.get(axis, set()) for axis, value in row.items()), (n, row, shown)


def test_every_pair_of_session_features_is_covered():
    for op, (covered, required, missing) in coverage_report.session_coverage().items():
        assert covered == required and not missing, (op, sorted(missing, key=repr)[:5])
    assert coverage_report.session_coverage_lines()[0].startswith(
        "session pair coverage, fpa_decode: "
    )


def test_the_reading_of_a_hand_made_program():
    s = script("fpa_decode", np.random.default_rng(0), 0, 3, window=4, max_rollback=3)
    present = np.ones((3, 6), dtype=bool)
    present[0, :2] = False  # left
    present[2] = False  # ragged
    s.advance(present)
    s.rollback(1, 1)  # budget 3 (full), before the select, after the window freed entries
    s.select([1, 1, 0])
    s.full(1)
    s.rollback(0, 2)  # budget 2 + 1 capped at 3 -> 3: partial, after the select
    shown = sc.program_axes("fpa_decode", s.program())
    assert shown["padding"] == {"left", "ragged", "none"}  # the step has none
    assert shown["chunking"] == {"uneven", "one"}
    assert shown["select"] == {"repetition"}
    assert shown["rollback"] == {"partial"}
    assert shown["when"] == {"before_select", "after_freed", "after_select"}
    assert shown["window"] == {"small"} and shown["max_rollback"] == {"small"}
    assert shown["theta"] == {"finite"} and shown["group"] == {1}
