"""pytest plugin: ``pytest --pyargs attnspec.conformance --backend NAME`` runs the kit's cases.

Registered through the ``pytest11`` entry point. Options: ``--backend`` (a registered name or
``module:attribute``), ``--backend-device``, ``--conformance-dtypes`` and ``--conformance-cases``
(comma-separated), ``--conformance-skips FILE`` (repeatable). Entries of the skip files that
match no item are reported at the end of the session.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .cases import Case, build_case, generate_cases
from .runner import probe_dtypes, run_case
from .skips import SkipList


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnspec", "attnspec conformance kit")
    group.addoption(
        "--backend", default=None, help="conformance backend: registered name or module:attribute"
    )
    group.addoption("--backend-device", default="cpu", help="device passed to the backend")
    group.addoption(
        "--conformance-dtypes", default=None, help="comma-separated dtypes (default: the backend's)"
    )
    group.addoption("--conformance-cases", default=None, help="comma-separated case-id prefixes")
    group.addoption(
        "--conformance-skips", action="append", default=[], help="extra skip file (repeatable)"
    )


@dataclass(frozen=True)
class Item:
    case_id: str
    dtype: str
    kind: str
    probe: bool = False

    @property
    def id(self) -> str:
        return f"{self.case_id}-{self.dtype}-{self.kind}"


class _Session:
    """The backend and skip list of this pytest session, created on first use."""

    def __init__(self, config: pytest.Config) -> None:
        from .registry import get_backend

        self.name = config.getoption("--backend")
        self.device = config.getoption("--backend-device")
        self.backend = get_backend(self.name, self.device)
        self.skips = SkipList.load(
            getattr(self.backend, "name", self.name), config.getoption("--conformance-skips")
        )
        self.cases: dict[str, Case] = {}

    def case(self, case_id: str) -> Case:
        if case_id not in self.cases:
            self.cases[case_id] = build_case(case_id)
        return self.cases[case_id]


_SESSION = pytest.StashKey[_Session]()


def _session(config: pytest.Config) -> _Session:
    if _SESSION not in config.stash:
        config.stash[_SESSION] = _Session(config)
    return config.stash[_SESSION]


def selected_items(config: pytest.Config) -> list[object]:
    """The parametrisation of the conformance test: one item per (case, dtype, kind)."""
    if not config.getoption("--backend"):
        return [
            pytest.param(
                None,
                marks=pytest.mark.skip(reason="pass --backend NAME to run the conformance suite"),
                id="no-backend",
            )
        ]
    session = _session(config)
    dtypes = config.getoption("--conformance-dtypes")
    probes = [] if dtypes else probe_dtypes(session.backend)
    dtypes = dtypes.split(",") if dtypes else list(getattr(session.backend, "dtypes", ("float64",)))
    prefixes = config.getoption("--conformance-cases")
    items: list[Item] = []
    for case in generate_cases(None, prefixes.split(",") if prefixes else None):
        session.cases[case.id] = case
        for dtype in [*dtypes, *probes]:
            probe = dtype in probes
            items.append(Item(case.id, dtype, "output", probe))
            if case.gradient:
                items.append(Item(case.id, dtype, "gradient", probe))
            if case.call_order:
                items.append(Item(case.id, dtype, "call_order", probe))
    return [pytest.param(item, id=item.id) for item in items]


def run_item(config: pytest.Config, item: Item) -> None:
    session = _session(config)
    reason = session.skips.reason(item.case_id, item.dtype)
    if reason is not None:
        pytest.skip(reason)
    result = run_case(
        session.backend,
        session.case(item.case_id),
        item.dtype,
        item.kind,
        backend_name=session.name,
        device=session.device,
        probe=item.probe,
    )
    if result.verdict == "not implemented":
        pytest.skip(f"not implemented: {result.message}")
    if result.verdict != "passed":
        pytest.fail(f"{result.message}\nrepro: {result.repro}", pytrace=False)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None:
        for warning in session.skips.unmatched():
            terminalreporter.write_line(f"attnspec: skip entry {warning}", yellow=True)
