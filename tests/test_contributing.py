"""docs/contributing.md stays true to the tree: the files it names exist, every file of the code
folders that the traced ops reach is named, and each checklist's stated count is its length."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "contributing.md")
CODE_FOLDERS = ("reference", "conformance", "backends", "theory", "experiments")
# The ops the page traces end to end, with the kernel names their torch custom ops dispatch to.
TRACED = re.compile(r"\b(fox_attention|fox_fwd|fox_bwd|interdomain_legs|legs_fwd|legs_bwd)\b")
NAMED_FILE = re.compile(r"`([\w./-]+\.(?:py|md|txt|sh|toml|yml))`")


def page():
    with open(PAGE) as fh:
        return fh.read()


def tree_files():
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "site")]
        files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
    return files


def tables(text):
    """Each table of the page as (the text before it, its numbered rows' numbers)."""
    found, before, rows = [], [], []
    for line in text.splitlines():
        match = re.match(r"\| (\d+) \|", line)
        if match:
            rows.append(int(match.group(1)))
        elif line.startswith("|"):
            continue
        else:
            if rows:
                found.append(("\n".join(before), rows))
                before, rows = [], []
            before.append(line)
    return found


def test_every_file_named_exists():
    files = tree_files()
    basenames = {os.path.basename(f) for f in files}
    for name in set(NAMED_FILE.findall(page())):
        if "/" in name:
            assert os.path.isfile(os.path.join(ROOT, name)), f"contributing.md names {name}"
        else:
            assert name in basenames, f"contributing.md names {name}: no such file"


def test_every_file_the_traced_ops_reach_is_named():
    named = set(NAMED_FILE.findall(page()))
    reached = []
    for path in tree_files():
        if path.endswith(".py") and path.split(os.sep)[0] in CODE_FOLDERS:
            with open(os.path.join(ROOT, path)) as fh:
                if TRACED.search(fh.read()):
                    reached.append(path)
    assert len(reached) >= 20  # the trace found the ops (they are spelled as above)
    missing = sorted(set(reached) - named)
    assert not missing, f"files that name a traced op, not on docs/contributing.md: {missing}"


def test_checklists_are_numbered_and_counted():
    text = page()
    found = tables(text)
    assert len(found) == 5
    for before, rows in found:
        assert rows == list(range(1, len(rows) + 1)), rows
        stated = re.findall(r"\*\*(\d+) files\*\*", before.split("\n\n")[-1])
        if stated:
            assert int(stated[-1]) == len(rows), (before[-200:], len(rows))
    op_table = found[0][1]
    assert f"files in all ({len(op_table)})**" in text
