"""Per-backend skip and expected-failure files: one entry a line,
``<case-id prefix> [dtype]  # reason``.

The reason is required. Entries that match no planned case are reported, so stale entries do
not hide anything. A skipped item is not run; an expected failure is run, reported "xfailed"
when it fails and failed when it passes (the entry is stale: remove it). Packaged files live in
``conformance/skips/<backend>.txt`` and ``conformance/skips/<backend>.xfails.txt``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from importlib import resources
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from .judging import CaseResult


@dataclass
class SkipEntry:
    prefix: str
    dtype: str | None
    reason: str
    source: str
    used: bool = False


class SkipList:
    suffix = ".txt"  # of the packaged file: skips/<backend><suffix>
    what = "skip"

    def __init__(self, entries: list[SkipEntry]):
        self.entries = entries

    @classmethod
    def parse(cls, text: str, source: str) -> Self:
        entries = []
        for lineno, raw in enumerate(text.splitlines(), 1):
            body, _, reason = raw.partition("#")
            words = body.split()
            if not words:
                continue
            if not reason.strip():
                raise ValueError(f"{source}:{lineno}: a skip entry needs a reason after '#'")
            if len(words) > 2:
                raise ValueError(
                    f"{source}:{lineno}: expected '<case-id prefix> [dtype]  # reason'"
                )
            dtype = words[1] if len(words) == 2 else None
            entries.append(SkipEntry(words[0], dtype, reason.strip(), f"{source}:{lineno}"))
        return cls(entries)

    @classmethod
    def load(cls, backend_name: str, extra_files: list[str] | None = None) -> Self:
        """The packaged skip file of ``backend_name`` (if any) plus the given files."""
        entries: list[SkipEntry] = []
        packaged_name = f"{backend_name}{cls.suffix}"
        packaged = resources.files("attnspec.conformance") / "skips" / packaged_name
        if packaged.is_file():
            entries += cls.parse(packaged.read_text(), f"skips/{packaged_name}").entries
        for path in extra_files or []:
            if not os.path.isfile(path):
                raise ValueError(f"{cls.what}s: no such file {path!r}")
            with open(path) as fh:
                entries += cls.parse(fh.read(), path).entries
        return cls(entries)

    def reason(self, case_id: str, dtype: str) -> str | None:
        """The reason to skip (case_id, dtype), or None."""
        for entry in self.entries:
            if case_id.startswith(entry.prefix) and entry.dtype in (None, dtype):
                entry.used = True
                return f"{entry.reason} ({entry.source})"
        return None

    def unmatched(self) -> list[str]:
        return [
            f"{e.source}: '{e.prefix}{' ' + e.dtype if e.dtype else ''}' matched no case"
            for e in self.entries
            if not e.used
        ]


class XfailList(SkipList):
    """Expected failures: run, and judged by :meth:`judge`."""

    suffix = ".xfails.txt"
    what = "xfail"

    def judge(self, result: CaseResult) -> CaseResult:
        """A failure of a listed item becomes "xfailed"; a pass of one becomes a failure that
        names the entry, so an expected failure that starts passing is reported."""
        reason = self.reason(result.case_id, result.dtype)
        if reason is None or result.verdict not in ("passed", "failed"):
            return result
        if result.verdict == "failed":
            return replace(
                result, verdict="xfailed", message=f"expected: {reason}; {result.message}"
            )
        return replace(
            result,
            verdict="failed",
            message=f"listed as an expected failure ({reason}) but passed: remove the entry",
        )

    def unmatched(self) -> list[str]:
        return [f"xfail entry {text}" for text in super().unmatched()]
