"""pytest plugin: ``pytest --pyargs attnspec.conformance --attnspec-backend NAME`` runs the kit's
cases, one pytest item per (case, dtype, check).

Registered through the ``pytest11`` entry point, so it loads in every pytest session of the
environment; its options therefore carry the ``--attnspec-`` prefix and the CLI's names:
``--attnspec-backend`` (a registered name, ``module:attribute`` or ``file.py:attribute``),
``--attnspec-device``, ``--attnspec-dtypes`` and ``--attnspec-cases`` (comma-separated),
``--attnspec-skips FILE`` and ``--attnspec-xfails FILE`` (repeatable). Entries of the skip and
expected-failure files that match no item are reported at the end of the session, and so are
expected failures that passed.

The short spellings (``--backend``, ``--backend-device``, ``--conformance-dtypes``,
``--conformance-cases``, ``--conformance-skips``) are added only when the session asks for the
kit by name (``--pyargs attnspec.conformance``, or ``-p attnspec.conformance.pytest_plugin``):
elsewhere a project's own ``--backend`` stays its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from .cases import Case, build_case, generate_cases
from .runner import probe_dtypes, run_case
from .skips import SkipList, XfailList

# (option, short spelling, keyword arguments of addoption); dest attnspec_<name>
OPTIONS: tuple[tuple[str, str, dict[str, object]], ...] = (
    (
        "backend",
        "--backend",
        {"default": None, "help": "conformance backend: registered name or module:attribute"},
    ),
    ("device", "--backend-device", {"default": "cpu", "help": "device passed to the backend"}),
    (
        "dtypes",
        "--conformance-dtypes",
        {"default": None, "help": "comma-separated dtypes (default: the backend's)"},
    ),
    ("cases", "--conformance-cases", {"default": None, "help": "comma-separated case-id prefixes"}),
    (
        "skips",
        "--conformance-skips",
        {"action": "append", "default": [], "help": "extra skip file (repeatable)"},
    ),
    (
        "xfails",
        "",
        {"action": "append", "default": [], "help": "expected-failure file (repeatable)"},
    ),
)
EXPLICIT = ("attnspec.conformance", "attnspec.conformance.pytest_plugin")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnspec", "attnspec conformance kit")
    for name, _, kwargs in OPTIONS:
        group.addoption(f"--attnspec-{name}", dest=f"attnspec_{name}", **kwargs)


def asks_for_the_kit(args: list[str]) -> bool:
    """Whether the command line names the kit: ``--pyargs`` with ``attnspec.conformance`` (or
    one of its modules), or ``-p attnspec.conformance.pytest_plugin``."""
    named = [a for a in args if a.split("::")[0] in EXPLICIT]
    loaded = any(
        a in ("-p" + EXPLICIT[1], "-p=" + EXPLICIT[1])
        or (a == "-p" and i + 1 < len(args) and args[i + 1] == EXPLICIT[1])
        for i, a in enumerate(args)
    )
    return loaded or ("--pyargs" in args and bool(named))


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(
    early_config: pytest.Config, parser: pytest.Parser, args: list[str]
) -> None:
    """Add the short spellings when the kit is asked for by name (before any conftest adds its
    own options, so a conftest's ``--backend`` conflicts only in a session that names both)."""
    if not asks_for_the_kit(args):
        return
    group = parser.getgroup("attnspec")
    for name, short, kwargs in OPTIONS:
        if short:
            extra = {k: v for k, v in kwargs.items() if k != "default"}
            group.addoption(short, dest=f"attnspec_{name}", **extra)


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

        self.name = config.getoption("attnspec_backend")
        self.device = config.getoption("attnspec_device")
        self.backend = get_backend(self.name, self.device)
        backend_name = getattr(self.backend, "name", self.name)
        self.skips = SkipList.load(backend_name, config.getoption("attnspec_skips"))
        self.xfails = XfailList.load(backend_name, config.getoption("attnspec_xfails"))
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
    if not config.getoption("attnspec_backend"):
        return [
            pytest.param(
                None,
                marks=pytest.mark.skip(
                    reason="pass --attnspec-backend NAME to run the conformance suite"
                ),
                id="no-backend",
            )
        ]
    session = _session(config)
    dtypes = config.getoption("attnspec_dtypes")
    probes = [] if dtypes else probe_dtypes(session.backend)
    dtypes = dtypes.split(",") if dtypes else list(getattr(session.backend, "dtypes", ("float64",)))
    prefixes = config.getoption("attnspec_cases")
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
    result = session.xfails.judge(
        run_case(
            session.backend,
            session.case(item.case_id),
            item.dtype,
            item.kind,
            backend_name=session.name,
            device=session.device,
            probe=item.probe,
        )
    )
    if result.verdict == "not implemented":
        pytest.skip(f"not implemented: {result.message}")
    if result.verdict == "xfailed":
        pytest.xfail(result.message)
    if result.verdict != "passed":
        note = f"\ncase: {result.note}" if result.note else ""
        pytest.fail(f"{result.message}{note}\nrepro: {result.repro}", pytrace=False)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    session = config.stash.get(_SESSION, None)
    if session is not None:
        for warning in session.skips.unmatched():
            terminalreporter.write_line(f"attnspec: skip entry {warning}", yellow=True)
        for warning in session.xfails.unmatched():
            terminalreporter.write_line(f"attnspec: {warning}", yellow=True)
