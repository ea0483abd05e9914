"""Hypothesis strategies over the case generators: new seeds, the same fixed shape menu.

Each drawn case reuses a family's builder and shape with a fresh seed, so compiled backends
see no new shapes. Needs the ``test`` extra (hypothesis).
"""

from __future__ import annotations

from hypothesis import strategies as st

from .cases import Case, build_case, case_ids


def cases(ops: list[str] | None = None) -> st.SearchStrategy[Case]:
    """Cases of the given ops (all by default) with random seeds."""
    return st.builds(
        lambda case_id, seed: build_case(case_id, seed=seed),
        st.sampled_from(case_ids(ops)),
        st.integers(0, 2**32 - 1),
    )
