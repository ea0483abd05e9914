"""Per-backend skip files: one entry a line, ``<case-id prefix> [dtype]  # reason``.

The reason is required. Entries that match no planned case are reported, so stale skips do not
hide anything. Packaged skip files live in ``conformance/skips/<backend>.txt``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources


@dataclass
class SkipEntry:
    prefix: str
    dtype: str | None
    reason: str
    source: str
    used: bool = False


class SkipList:
    def __init__(self, entries: list[SkipEntry]):
        self.entries = entries

    @classmethod
    def parse(cls, text: str, source: str) -> SkipList:
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
    def load(cls, backend_name: str, extra_files: list[str] | None = None) -> SkipList:
        """The packaged skip file of ``backend_name`` (if any) plus the given files."""
        entries: list[SkipEntry] = []
        packaged = resources.files("attnspec.conformance") / "skips" / f"{backend_name}.txt"
        if packaged.is_file():
            entries += cls.parse(packaged.read_text(), f"skips/{backend_name}.txt").entries
        for path in extra_files or []:
            if not os.path.isfile(path):
                raise ValueError(f"skips: no such file {path!r}")
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
