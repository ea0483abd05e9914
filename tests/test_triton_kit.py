"""The conformance kit on the ``triton`` backend (the Triton kernels, interpreted on CPU).

CI budget [decision]: the first case of every family of every op the backend claims, outputs
and VJPs, in float32 (about a minute per group under the interpreter on 2 cores); this reaches
every family, op and check. The same subset in bfloat16 is ``make verify`` (``attnspec verify``
runs the smoke subset in float32 and bfloat16 on interpreted kernels), which CI runs after
``make test``. The full run on every case and dtype is ``attnspec conformance --backend triton``
(15 to 25 minutes under the interpreter, about a minute on a GPU with ``--device cuda``, the kit
section of bench/gpu_check.sh).
"""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnspec.conformance import cases, runner  # noqa: E402
from attnspec.conformance.registry import get_backend  # noqa: E402
from attnspec.conformance.skips import SkipList  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# Two groups of ops: two tests of about the same length, which the test workers share.
GROUPS = {
    "attention": ("fpa_attention", "fox_attention"),
    "interdomain": ("interdomain_s4d", "interdomain_legs"),
}


@pytest.mark.verify_kit
@pytest.mark.parametrize("group", sorted(GROUPS))
@pytest.mark.parametrize("dtype", ["float32"])
def test_the_kit_passes_the_first_case_of_every_family(dtype, group):
    backend = get_backend("triton")
    claimed = {c for c in backend.capabilities() if "." not in c} & set(GROUPS[group])
    assert claimed == set(GROUPS[group])
    caps = backend.capabilities()
    ids = [
        i
        for i in cases.case_ids(sorted(claimed))
        if i.endswith("/0") and set(cases.build_case(i).requires) <= caps
    ]  # the families whose capabilities (sessions, padding, ...) this backend claims
    report = runner.run(
        backend, [cases.build_case(i) for i in ids], [dtype], skips=SkipList.load("triton", [])
    )
    failed = [
        f"{r.case_id} {r.kind}: {r.message}"
        for r in report.results
        if r.verdict not in ("passed", "skipped")
    ]
    assert not failed, "\n".join(failed[:20])
    kinds = {(r.op, r.kind) for r in report.results}
    assert {(op, "gradient") for op in claimed} <= kinds  # the Triton backward kernels ran
