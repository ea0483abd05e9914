"""What a backend claims, and what it does outside its claims.

A backend claims dtypes (``dtypes``) and capabilities (``capabilities()``); the kit judges it on
those. Outside them the kit also runs a few items (PyTorch's OpInfo ``test_dtypes`` idea): the
first case of every family in each dtype the backend does not claim, and the first case of
every family that needs a capability it does not claim (in its first smoke dtype), when the
backend has the method to call. Each such item is reported as "unclaimed: passes" or
"unclaimed: fails" and never counts against the verdict: a claim the backend could make, or a
refusal that is right, is visible rather than silently skipped.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from .cases import Case
from .protocol import Backend
from .runner import CaseResult, required_capabilities, run_case
from .tolerances import DTYPES

PASSES = "unclaimed: passes"
FAILS = "unclaimed: fails"
UNCLAIMED = (PASSES, FAILS)


class Claiming:
    """``backend`` as if it claimed ``dtype`` and ``capabilities`` too (everything else is the
    backend's own), so that the runner judges an unclaimed item as a claimed one. A proxy;
    :func:`claiming` prefers a copy of the backend in a subclass of its own class."""

    def __init__(self, backend: Backend, dtype: str, capabilities: Iterable[str]) -> None:
        self._backend = backend
        self._dtype = dtype
        self._capabilities = set(capabilities)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return (*self._backend.dtypes, self._dtype)

    def capabilities(self) -> set[str]:
        return set(self._backend.capabilities()) | self._capabilities

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def claiming(backend: Backend, dtype: str, capabilities: Iterable[str]) -> Backend:
    """``backend`` claiming ``dtype`` and ``capabilities`` too: a shallow copy whose class is a
    subclass of the backend's with its name (so that a report names the backend's own class
    and source lines), or a :class:`Claiming` proxy where the object cannot be copied so."""
    cls, extra = type(backend), set(capabilities)
    dtypes = (*backend.dtypes, dtype)
    own = getattr(backend, "__dict__", {})
    if "capabilities" in own or not isinstance(inspect.getattr_static(cls, "dtypes", ()), tuple):
        return Claiming(backend, dtype, extra)  # claims held per object, or computed

    claimed = backend.capabilities  # the original's, however it is defined

    def capabilities_(self: Any) -> set[str]:
        return set(claimed()) | extra

    names = {"__qualname__": cls.__qualname__, "__module__": cls.__module__}
    try:
        sub = type(cls.__name__, (cls,), {**names, "capabilities": capabilities_})
        clone = copy.copy(backend)
        clone.__class__ = sub
        if "dtypes" in own:
            vars(clone)["dtypes"] = dtypes
        else:
            sub.dtypes = dtypes  # type: ignore[attr-defined]  # the subclass's own claim
    except (TypeError, AttributeError):  # a module, a slotted or built-in object, ...
        return Claiming(backend, dtype, extra)
    return clone


def _family(case: Case) -> str:
    return case.id.rpartition("/")[0]


def _callable(backend: Backend, case: Case, kind: str) -> bool:
    """Whether the backend has what the item calls: the op (or open_session), vjp, and for a
    case in a strided layout asarray_strided (without it the case is not implemented in every
    dtype, claimed or not)."""
    needs = ["open_session" if "session" in case.params else case.op]
    if kind == "gradient":
        needs.append("vjp")
    if case.layout:
        needs.append("asarray_strided")
    return all(callable(getattr(backend, name, None)) for name in needs)


def unclaimed_items(
    backend: Backend,
    cases: Iterable[Case],
    dtypes: Iterable[str],
    *,
    other_dtypes: bool = True,
    gradients: bool = True,
) -> list[tuple[Case, str, str, tuple[str, ...]]]:
    """(case, dtype, kind, unclaimed capabilities) of the items outside the claims: for each
    family among ``cases``, its first case in every dtype of :data:`DTYPES` neither claimed nor
    among ``dtypes`` (the run's; only with ``other_dtypes``), on the capabilities claimed; and
    the first case of each set of unclaimed capabilities a family needs, in the first of
    ``dtypes``. Outputs and, with ``gradients``, VJPs."""
    declared = set(backend.dtypes)
    run_dtypes = list(dtypes)
    extra = [d for d in DTYPES if d not in declared and d not in run_dtypes] if other_dtypes else []
    caps = set(backend.capabilities())
    kinds = ("output", "gradient") if gradients else ("output",)
    items: list[tuple[Case, str, str, tuple[str, ...]]] = []
    seen: set[tuple[str, str, tuple[str, ...]]] = set()
    for case in cases:
        for kind in kinds:
            if kind == "gradient" and not case.gradient:
                continue
            missing = tuple(c for c in required_capabilities(case, kind) if c not in caps)
            key = (_family(case), kind, missing)
            if key in seen or not _callable(backend, case, kind):
                continue
            seen.add(key)
            if missing and run_dtypes:
                items.append((case, run_dtypes[0], kind, missing))
            elif not missing:
                items += [(case, dtype, kind, ()) for dtype in extra]
    return items


def run_unclaimed(
    backend: Backend,
    items: list[tuple[Case, str, str, tuple[str, ...]]],
    *,
    backend_name: str | None = None,
    device: str = "cpu",
    progress: Callable[[int, int, CaseResult], None] | None = None,
) -> list[CaseResult]:
    """Each item judged as if claimed; the verdict "unclaimed: passes" or "unclaimed: fails"
    (anything but a pass: wrong values, an exception, a shape it declines), the message saying
    what was not claimed and the repro line rerunning it (``--unclaimed``)."""
    results = []
    for n, (case, dtype, kind, missing) in enumerate(items, 1):
        result = run_case(
            claiming(backend, dtype, missing),
            case,
            dtype,
            kind,
            backend_name=backend_name or str(getattr(backend, "name", "?")),
            device=device,
        )
        what = ", ".join(missing) if missing else f"dtype {dtype}"
        passed = result.verdict == "passed"
        result.verdict = PASSES if passed else FAILS
        result.message = f"not claimed: {what}" + ("" if passed else f"; {result.message}")
        result.repro = result.repro.split(" --dtypes ")[0] + " --unclaimed"
        results.append(result)
        if progress:
            progress(n, len(items), result)
    return results
