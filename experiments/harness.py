"""What every experiment shares: its command line, a progress bar, and the result record.

Each experiment module (``e1``, ``e2``, ``e3``) defines its settings ("quick" for CI smoke tests,
"full" for the numbers in docs/experiments.md) and a ``run(setting, progress)`` that returns its
config, seeds and results; :func:`main` wraps that in the record written as JSON (config, seeds,
versions, wall time, machine load) and draws the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PACKAGE_DIR = Path(__file__).resolve().parent
# In a checkout the committed full-setting results live beside the code and the figures in the
# docs; an installed package (no checkout around it) writes everything under the working folder.
IN_CHECKOUT = (PACKAGE_DIR.parent / "pyproject.toml").is_file()
RESULTS_DIR = PACKAGE_DIR / "results"
FIGURES_DIR = PACKAGE_DIR.parent / "docs" / "figures" / "experiments"
QUICK_DIR = Path("build") / "experiments"

RECORD_KEYS = (
    "experiment",
    "setting",
    "config",
    "seeds",
    "results",
    "versions",
    "started",
    "seconds",
    "cpu_seconds",
    "load_average",
    "figure",
)


class Progress:
    """A one-line progress bar on stderr: ``label [#####-----] 12/40 0:07 loss 0.412``.

    On a terminal it redraws in place; elsewhere (CI logs) it prints a line at every tenth.
    """

    def __init__(self, stream: TextIO | None = None, width: int = 24):
        self.stream = stream or sys.stderr
        self.width = width
        self.tty = self.stream.isatty()
        self.label, self.total, self.done, self.start = "", 1, 0, time.monotonic()
        self._printed = -1

    def begin(self, label: str, total: int) -> None:
        """Start a new bar of ``total`` steps."""
        self.label, self.total, self.done = label, max(int(total), 1), 0
        self.start, self._printed = time.monotonic(), -1
        self._draw("")

    def advance(self, note: str = "") -> None:
        """One step done; ``note`` (e.g. the running loss) follows the bar."""
        self.done = min(self.done + 1, self.total)
        self._draw(note)

    def end(self, note: str = "") -> None:
        """Finish the bar (drawn full once)."""
        if self.done < self.total or self.tty:
            self.done = self.total
            self._draw(note, final=True)

    def _draw(self, note: str, final: bool = False) -> None:
        filled = self.width * self.done // self.total
        elapsed = int(time.monotonic() - self.start)
        line = (
            f"{self.label:<28} [{'#' * filled}{'-' * (self.width - filled)}] "
            f"{self.done}/{self.total} {elapsed // 60}:{elapsed % 60:02d} {note}"
        )
        if self.tty:
            self.stream.write("\r" + line[:120].ljust(120) + ("\n" if final else ""))
        else:
            tenth = 10 * self.done // self.total
            if tenth == self._printed and not final:
                return
            self._printed = tenth
            self.stream.write(line + "\n")
        self.stream.flush()


# the files runs write (a run before this one must not mark the code as changed)
_OUTPUTS = (":(top,exclude)experiments/results", ":(top,exclude)docs/figures/experiments")


def source_revision() -> str:
    """The git commit of the code that ran (``+dirty`` with uncommitted changes to tracked
    files other than the experiments' own results and figures), or "unknown" outside a git
    checkout."""
    try:
        git = ["git", "-C", str(PACKAGE_DIR)]
        head = subprocess.run(
            [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", *_OUTPUTS],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


_NUMBER_LIST = re.compile(r"\[[-+0-9.eE,\s]*\]")


def record_json(record: dict) -> str:
    """The record as indented JSON with every list of plain numbers on one line."""
    text = json.dumps(record, indent=1)
    return _NUMBER_LIST.sub(lambda m: re.sub(r"\s+", "", m.group()).replace(",", ", "), text) + "\n"


def versions() -> dict[str, str]:
    """Versions of what produced a result: the code's commit, Python, the project, torch,
    NumPy, the machine."""
    import numpy as np
    import torch

    try:
        attnspec = metadata.version("attnspec")
    except metadata.PackageNotFoundError:
        attnspec = "not installed"
    return {
        "source": source_revision(),
        "python": platform.python_version(),
        "attnspec": attnspec,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpu_count": str(os.cpu_count()),
        "torch_threads": str(torch.get_num_threads()),
    }


def parse_args(name: str, description: str, argv: list[str] | None) -> argparse.Namespace:
    """The options every experiment takes: --quick, --out, --figures, --replot, --threads."""
    parser = argparse.ArgumentParser(
        prog=f"python -m attnspec.experiments.{name}", description=description
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the CI smoke setting (under a minute); results go to build/experiments/ by default",
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        help="where the JSON goes (default: experiments/results/ of the checkout for the full "
        "setting, else build/experiments/)",
    )
    parser.add_argument(
        "--figures",
        metavar="DIR",
        type=Path,
        help="where the PNG goes (default: docs/figures/experiments/ of the checkout for the full "
        "setting, else the JSON's folder)",
    )
    parser.add_argument(
        "--replot",
        metavar="JSON",
        type=Path,
        help="only redraw the figure from a record written before (into --figures)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: at these sizes more threads on a shared "
        "machine only wait for each other)",
    )
    return parser.parse_args(argv)


def main(
    name: str,
    description: str,
    run: Callable[[str, Progress], dict],
    plot: Callable[[dict, Path], None],
    argv: list[str] | None = None,
) -> int:
    """Run one experiment from the command line; write ``NAME.json`` and ``NAME.png``.

    ``run(setting, progress)`` returns ``{"config": ..., "seeds": [...], "results": ...}``;
    ``plot(record, path)`` draws the figure from the record alone.
    """
    import torch

    args = parse_args(name, description, argv)
    if args.threads < 1:
        raise SystemExit(f"--threads: expected an integer >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    setting = "quick" if args.quick else "full"
    committed = not args.quick and IN_CHECKOUT  # the full setting in a checkout
    out = args.out or (RESULTS_DIR if committed else QUICK_DIR)
    figures = args.figures or (FIGURES_DIR if committed and not args.out else out)
    out.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    if args.replot:
        record = json.loads(args.replot.read_text())
        if record.get("experiment") != name:
            raise SystemExit(f"--replot: expected a record of {name}, got {args.replot}")
        figure = figures / f"{name}.png"
        plot(record, figure)
        print(f"wrote {figure}")
        return 0

    started = datetime.now(UTC).isoformat(timespec="seconds")
    code = versions()  # before the run writes anything
    load_before = os.getloadavg()
    t0, cpu0 = time.monotonic(), time.process_time()
    outcome = run(setting, Progress())
    seconds, cpu_seconds = time.monotonic() - t0, time.process_time() - cpu0
    figure = figures / f"{name}.png"
    record = {
        "experiment": name,
        "setting": setting,
        "config": outcome["config"],
        "seeds": outcome["seeds"],
        "results": outcome["results"],
        "versions": code,
        "started": started,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu_seconds, 1),  # this process, every thread
        # 1-minute load average before and after: the machine is shared, timings depend on it
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "figure": figure.name,
    }
    path = out / f"{name}.json"
    path.write_text(record_json(record))
    plot(record, figure)
    print(f"wrote {path} and {figure} ({seconds:.0f} s)")
    return 0


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path) -> None:
    """Write ``fig`` as a PNG at ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
