"""Reports of a conformance run: the summary table, failures with repro lines, JSON, JUnit XML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from typing import Any

from .provenance import header
from .runner import CaseResult, RunReport
from .tolerances import format_table as tolerance_table
from .unclaimed import FAILS, PASSES

VERDICTS = ("passed", "failed", "not implemented", "skipped", "xfailed", "not applicable")
NOT_RUN = ("skipped", "not implemented", "not applicable")  # JUnit's skipped


def summary_rows(report: RunReport) -> list[dict]:
    """One row per (op, dtype, kind): counts by verdict and the worst error / tolerance."""
    groups: dict[tuple, list] = defaultdict(list)
    for r in report.results:
        groups[(r.op, r.dtype, r.kind)].append(r)
    rows = []
    for (op, dtype, kind), results in groups.items():
        counts = {v: sum(r.verdict == v for r in results) for v in VERDICTS}
        compared = [r for r in results if r.verdict in ("passed", "failed") and r.ratio == r.ratio]
        # a dtype fault has ratio inf but its measured error: rank the rows by that error
        worst = max(compared, key=lambda r: (r.ratio, r.error), default=None)
        raised = [r.raised for r in results if r.verdict == "failed" and r.raised]
        rows.append(
            {
                "op": op,
                "dtype": dtype,
                "kind": kind,
                **counts,
                "worst_error": worst.error if worst else None,
                "tolerance": worst.tolerance if worst else None,
                "worst_case": worst.case_id if worst else None,
                "raised": len(raised),
                "first_raised": raised[0] if raised else None,
                "dtype_faults": sum(
                    r.verdict == "failed" and "(the values pass" in r.message for r in results
                ),
            }
        )
    return rows


def format_report(report: RunReport, *, max_failures: int = 30) -> str:
    subject = report.backend if report.backend.startswith("model ") else f"backend {report.backend}"
    lines = [
        f"attnspec conformance: {subject} on {report.device} "
        f"({', '.join(f'{k} {v}' for k, v in report.versions.items())})",
        "",
    ]
    head = (
        f"{'op':<18} {'dtype':<8} {'kind':<17} {'pass':>5} {'fail':>5} {'n/i':>5} {'skip':>5}"
        f"  {'worst error':>11} {'tolerance':>9}  verdict"
    )
    lines += [head, "-" * len(head)]
    for row in summary_rows(report):
        err = "" if row["worst_error"] is None else f"{row['worst_error']:.2e}"
        tol = "" if row["tolerance"] is None else f"{row['tolerance']:.0e}"
        if row["failed"] and row["raised"] == row["failed"]:  # no error to show: exceptions
            err = tol = ""
            verdict = f"raised {_clip(row['first_raised'])}"
        elif row["failed"] and row["dtype_faults"] == row["failed"]:  # values right
            verdict = "FAILED (wrong dtype, values pass)"
        elif row["failed"]:
            verdict = "FAILED" + (f" ({row['raised']} raised)" if row["raised"] else "")
        elif row["passed"]:
            verdict = "passed"
        elif row["not applicable"]:
            verdict = "not applicable"
        else:
            verdict = "not implemented" if row["not implemented"] else "skipped"
        lines.append(
            f"{row['op']:<18} {row['dtype']:<8} {row['kind']:<17} {row['passed']:>5} "
            f"{row['failed']:>5} {row['not implemented']:>5} {row['skipped']:>5}  "
            f"{err:>11} {tol:>9}  {verdict}"
        )
    failures = [r for r in report.results if r.verdict == "failed"]
    if failures:
        lines += ["", f"{len(failures)} failure(s):"]
        for r in failures[:max_failures]:
            lines.append(f"  {r.case_id} [{r.dtype}, {r.kind}]: {r.message}")
            if r.note:
                lines.append(f"    case: {r.note}")
            lines.append(f"    repro: {r.repro}")
        if len(failures) > max_failures:
            lines.append(f"  ... and {len(failures) - max_failures} more (see --json)")
    for warning in report.unmatched_skips:
        entry = warning if warning.startswith("xfail entry ") else f"skip entry {warning}"
        lines.append(f"warning: {entry}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines += unclaimed_lines(report)
    lines += ["", "tolerances (normwise relative error):", tolerance_table(), ""]
    counts = {v: sum(r.verdict == v for r in report.results) for v in VERDICTS}
    lines.append(
        f"{counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['not implemented']} not implemented, {counts['skipped']} skipped"
        + (f", {counts['xfailed']} xfailed" if counts["xfailed"] else "")
        + (f", {counts['not applicable']} not applicable" if counts["not applicable"] else "")
        + (
            f", {len(report.unclaimed)} outside the claims "
            f"({sum(r.verdict == PASSES for r in report.unclaimed)} pass)"
            if report.unclaimed
            else ""
        )
        + f" in {report.seconds:.1f} s"
    )
    return "\n".join(lines)


def unclaimed_lines(report: RunReport) -> list[str]:
    """The items outside the backend's claims, by (op, what is not claimed, kind): how many
    pass and fail, with the first failure's message (they do not count in the verdict)."""
    groups: dict[tuple[str, str, str], list[CaseResult]] = defaultdict(list)
    for r in report.unclaimed:
        what = r.message.partition(";")[0].removeprefix("not claimed: ")
        groups[(r.op, what, r.kind)].append(r)
    if not groups:
        return []
    width = max(len(what) for _, what, _ in groups)
    lines = ["", "outside the claims (the first case of each family; not counted in the verdict):"]
    for (op, what, kind), results in groups.items():
        fails = [r for r in results if r.verdict == FAILS]
        passes = len(results) - len(fails)
        counts = ", ".join(
            f"{n} {verdict.removeprefix('unclaimed: ')}"
            for n, verdict in ((passes, PASSES), (len(fails), FAILS))
            if n
        )
        first = f": {_clip(fails[0].message.partition('; ')[2], 60)}" if fails else ""
        lines.append(f"  {op:<18} {what:<{width}} {kind:<9} unclaimed: {counts}{first}")
    return lines


def _clip(text: str, width: int = 70) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 3] + "..."


def report_data(report: RunReport) -> dict[str, Any]:
    """The JSON report as a dict: the header of :func:`provenance.header`, what was judged
    (the backend's claims, or the model), then the results (docs/report-schema.md)."""
    return {
        **header(report.device),
        "backend": report.backend,
        "device": report.device,
        "versions": report.versions,
        "seconds": report.seconds,
        "summary": summary_rows(report),
        "unmatched_skips": report.unmatched_skips,
        "notes": report.notes,
        "cases": [r.as_dict() for r in report.results],
        "claims": report.claims,
        "model": report.model,
        "unclaimed": [r.as_dict() for r in report.unclaimed],
    }


def write_json(report: RunReport, path: str) -> None:
    with open(path, "w") as fh:
        json.dump(report_data(report), fh, indent=1, default=float)


def write_junit(report: RunReport, path: str) -> None:
    """JUnit XML: one testcase per (case, dtype, kind); failures carry the repro line."""
    suite = ET.Element(
        "testsuite",
        name=f"attnspec-conformance-{report.backend}",
        tests=str(len(report.results) + len(report.unclaimed)),
        time=f"{report.seconds:.3f}",
        failures=str(sum(r.verdict == "failed" for r in report.results)),
        skipped=str(sum(r.verdict in NOT_RUN for r in report.results) + len(report.unclaimed)),
    )
    for r in report.results:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"{report.backend}.{r.op}",
            name=f"{r.case_id}[{r.dtype}-{r.kind}]",
        )
        if r.verdict == "failed":
            failure = ET.SubElement(case, "failure", message=r.message[:500])
            failure.text = f"{r.message}\nrepro: {r.repro}"
        elif r.verdict in NOT_RUN:
            ET.SubElement(case, "skipped", message=f"{r.verdict}: {r.message}")
    for r in report.unclaimed:  # never counted against the verdict: skipped, with the outcome
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"{report.backend}.{r.op}",
            name=f"{r.case_id}[{r.dtype}-{r.kind}-unclaimed]",
        )
        ET.SubElement(case, "skipped", message=f"{r.verdict} ({r.message})"[:500])
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)
