"""Model programs: what a server and ``generate()`` do with a causal LM's cache, as data.

A :class:`ModelProgram` is a list of :class:`Op` s on one model and its cache, drawn from
(family, seed) and the model's vocabulary size: ``forward`` (a chunk of token ids [R, n] with its
presence mask: 0 at left padding), the cache calls of transformers' ``Cache`` (``crop``,
``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``), and ``generate``
(greedy or beam search on a left-padded prompt). :mod:`.model_runner` runs a program with the
cache and compares every forward's logits with the forward of the same tokens without a cache.

:data:`FAMILIES` maps each family to ``(count, build, note)``; case ids are
``model/<family>/<n>``, seeded by :func:`.drawers.case_seed` of the id. Padded positions hold random
token ids, so a cache that reads them shows it. ``crop`` follows transformers' definition: a
negative argument removes that many positions from the end of every row, 0 removes nothing
(the paths of assisted decoding that reject candidates and that accept them all).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .drawers import case_seed

PREFIX = "model"


@dataclass(frozen=True)
class Op:
    """One operation of a program. method: "forward", "crop", "reorder_cache",
    "batch_select_indices", "batch_repeat_interleave" or "generate"; args: its arguments
    (forward: ids int64 [R, n] and present bool [R, n]; the cache calls: their one argument;
    generate: ids, present, mode "greedy" or "beams", max_new_tokens, num_beams); note: why."""

    method: str
    args: dict[str, Any]
    note: str = ""

    def describe(self) -> str:
        """The operation as one line (chunks by shape and presence, rows as 0/1 strings)."""
        if self.method in ("forward", "generate"):
            present = np.asarray(self.args["present"])
            rows = " ".join("".join("1" if p else "0" for p in row) for row in present)
            options = {k: v for k, v in self.args.items() if k not in ("ids", "present")}
            extra = "".join(f", {k}={v!r}" for k, v in options.items())
            text = f"{self.method}(ids {present.shape}, present [{rows}]{extra})"
        else:
            value = self.args["value"]
            value = value.tolist() if isinstance(value, np.ndarray) else value
            text = f"cache.{self.method}({value!r})"
        return text + (f"  # {self.note}" if self.note else "")


@dataclass(frozen=True)
class ModelProgram:
    """A family's program: rows at the start, then the operations."""

    family: str
    rows: int
    ops: tuple[Op, ...]

    @property
    def kind(self) -> str:
        """ "tokens" for the generate() programs (token ids compared), else "logits"."""
        return "tokens" if self.ops and self.ops[0].method == "generate" else "logits"

    def listing(self, upto: int | None = None) -> str:
        """The program as numbered lines (up to operation ``upto`` included)."""
        ops = self.ops if upto is None else self.ops[: upto + 1]
        head = f"{self.family}: {self.rows} rows"
        return "\n".join([head, *(f"  {i:>3}: {op.describe()}" for i, op in enumerate(ops))])


@dataclass
class Writer:
    """Writes a program op by op, keeping the row count (it follows the cache calls)."""

    rng: np.random.Generator
    vocab: int
    rows: int
    ops: list[Op] = field(default_factory=list)

    def ids(self, n: int) -> NDArray[np.int64]:
        return self.rng.integers(0, self.vocab, (self.rows, n)).astype(np.int64)

    def forward(self, n: int, pads: list[int] | None = None, note: str = "") -> None:
        """A chunk of n positions; row r's first ``pads[r]`` positions are padding."""
        present = np.ones((self.rows, n), dtype=bool)
        for r, pad in enumerate(pads or []):
            present[r, :pad] = False
        self.ops.append(Op("forward", {"ids": self.ids(n), "present": present}, note))

    def steps(self, count: int) -> None:
        for _ in range(count):
            self.forward(1, note="one-token step")

    def cache(self, method: str, value: Any, note: str = "") -> None:
        self.ops.append(Op(method, {"value": value}, note))
        if method == "batch_repeat_interleave":
            self.rows *= int(value)
        elif method in ("reorder_cache", "batch_select_indices"):
            self.rows = len(value)

    def program(self, family: str, rows: int) -> ModelProgram:
        return ModelProgram(family, rows, tuple(self.ops))


Build = Callable[[np.random.Generator, int, int], ModelProgram]


def _steps(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    w = Writer(rng, vocab, 2)
    w.forward(int(rng.integers(3, 7)), note="prefill")
    w.steps(4)
    return w.program("steps", 2)


def _chunked(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    w = Writer(rng, vocab, 2)
    sizes = [5, 1, 3, 2] if n == 0 else [int(s) for s in rng.permutation([4, 2, 1, 3])]
    for i, size in enumerate(sizes):
        w.forward(size, note="prefill chunk" if i else "first prefill chunk")
    w.steps(2)
    return w.program("chunked", 2)


def _padded(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    """Three rows left-padded by 0, a and b < 6 positions; the odd cases prefill in two chunks,
    the longest padding reaching one position into the second (so that row's first chunk is
    all padding)."""
    w = Writer(rng, vocab, 3)
    a, b = (int(x) for x in rng.choice(np.arange(1, 6), 2, replace=False))
    if n % 2 == 0:
        w.forward(6, [0, a, b], "left-padded prefill")
    else:
        first = max(a, b) - 1
        w.forward(first, [0, a, b], "left-padded first chunk")
        w.forward(6 - first, [0, max(a - first, 0), max(b - first, 0)], "second chunk")
    w.steps(4)
    return w.program("padded", 3)


def _beam_index(rng: np.random.Generator, groups: int, beams: int) -> list[int]:
    """Beam search's reorder: each row takes one of its own prompt's beams, not all kept."""
    while True:
        index = [g * beams + int(rng.integers(beams)) for g in range(groups) for _ in range(beams)]
        if index != list(range(groups * beams)):
            return index


def _beams(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    w = Writer(rng, vocab, 2)
    w.forward(5, [0, 2], "left-padded prompts")
    w.cache("batch_repeat_interleave", 3, "three beams per prompt")
    w.forward(1, note="a token per beam")
    for _ in range(2):
        w.cache("reorder_cache", _beam_index(rng, 2, 3), "beam search's reorder")
        w.forward(1, note="a token per beam")
    keep = sorted(int(i) for i in rng.choice(6, 4, replace=False))
    w.cache("batch_select_indices", [keep[1], keep[0], *keep[2:]], "four rows kept")
    w.steps(2)
    return w.program("beams", 2)


def _crop(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    w = Writer(rng, vocab, 2)
    w.forward(5, [0, 1], "prefill")
    w.steps(3)
    removals = [2, 1, 3] if n == 0 else [int(k) for k in rng.permutation([3, 1, 2])]
    for k in removals:
        w.cache("crop", -k, f"remove the last {k} positions")
        w.forward(int(rng.integers(1, 3)), note="new tokens after the crop")
    w.steps(1)
    return w.program("crop", 2)


def _crop_zero(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    w = Writer(rng, vocab, 2)
    w.forward(4, note="prefill")
    w.steps(1)
    w.cache("crop", 0, "removes nothing (every candidate accepted)")
    w.steps(2)
    w.cache("crop", 0, "removes nothing")
    w.steps(1)
    return w.program("crop_zero", 2)


def _assisted(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
    """Assisted decoding's rejection path: a chunk of candidates, then crop(-rejected)."""
    w = Writer(rng, vocab, 1)
    w.forward(5, note="prompt")
    for _ in range(3):
        c = int(rng.integers(2, 5))
        m = int(rng.integers(0, c))  # at least one candidate rejected
        w.forward(c, note=f"{c} candidate tokens verified")
        w.cache("crop", m - c, f"{m} of {c} candidates accepted")
    w.steps(1)
    return w.program("assisted", 1)


def _generate(mode: str) -> Build:
    def build(rng: np.random.Generator, n: int, vocab: int) -> ModelProgram:
        T = 6
        present = np.ones((2, T), dtype=bool)
        present[1, : int(rng.integers(1, 4))] = False  # left padding
        ids = rng.integers(0, vocab, (2, T)).astype(np.int64)
        args: dict[str, Any] = {"ids": ids, "present": present, "mode": mode}
        args["max_new_tokens"] = 6 if mode == "greedy" else 5
        if mode == "beams":
            args["num_beams"] = 3
        op = Op("generate", args, f"generate(): {mode}, cached against uncached")
        return ModelProgram(f"generate_{mode}", 2, (op,))

    return build


FAMILIES: dict[str, tuple[int, Build, str]] = {
    "steps": (2, _steps, "prefill, then one-token steps"),
    "chunked": (2, _chunked, "prefill in uneven chunks, then steps"),
    "padded": (2, _padded, "a left-padded ragged batch with its attention mask"),
    "beams": (
        2,
        _beams,
        "beam search's batch_repeat_interleave, reorder_cache and batch_select_indices",
    ),
    "crop": (2, _crop, "crop(-k) removes the last k positions, then new tokens"),
    "crop_zero": (1, _crop_zero, "crop(0) removes nothing"),
    "assisted": (2, _assisted, "assisted decoding's rejection path: candidates, crop"),
    "generate_greedy": (2, _generate("greedy"), "generate(): greedy, cached = uncached"),
    "generate_beams": (1, _generate("beams"), "generate(): beam search, cached = uncached"),
}


def model_case_ids(prefixes: list[str] | None = None) -> list[str]:
    """Every model case id (``model/<family>/<n>``) starting with one of ``prefixes``."""
    ids = [f"{PREFIX}/{name}/{n}" for name, (count, _, _) in FAMILIES.items() for n in range(count)]
    return [i for i in ids if not prefixes or any(i.startswith(p) for p in prefixes)]


def family_of(case_id: str) -> str:
    """The family of a model case id; ValueError naming the case id if it is not one."""
    parts = case_id.split("/")
    if len(parts) != 3 or parts[0] != PREFIX or parts[1] not in FAMILIES:
        raise ValueError(f"case id: {case_id!r} is not a model case (model/<family>/<n>)")
    count = FAMILIES[parts[1]][0]
    if not parts[2].isdigit() or int(parts[2]) >= count:
        raise ValueError(f"case id: {case_id!r} out of range: the family has {count} cases")
    return parts[1]


def build_program(case_id: str, vocab: int) -> ModelProgram:
    """The program of ``case_id`` for a model with ``vocab`` token ids."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"vocab: expected an integer >= 2, got {vocab!r}")
    family = family_of(case_id)
    build = FAMILIES[family][1]
    n = int(case_id.rpartition("/")[2])
    return build(np.random.default_rng(case_seed(case_id)), n, vocab)


def note_of(case_id: str) -> str:
    return FAMILIES[family_of(case_id)][2]
