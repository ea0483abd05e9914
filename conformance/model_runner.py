"""A verdict on a transformers causal LM's cache: model programs run with the cache, each forward
compared with the forward of the same tokens without one.

Decoding with a cache must give the logits of the uncached forward of the same tokens: no
reference is needed. For each :class:`~.model_programs.ModelProgram` the kit keeps every row's
tokens and attention mask (``history``); a ``forward`` passes the chunk, the mask of everything
so far and the cache under the keyword the installed transformers' ``generate()`` uses
(``ALL_CACHE_NAMES[0]``: ``past_key_values`` up to 5.23, ``cache`` from 5.24), and compares the
chunk's logits at its non-padding positions with the last positions of ``model(history,
attention_mask=mask, use_cache=False)``, normwise and row by row (:func:`.metrics.compare`) at
the tolerance of the model's dtype (:func:`.tolerances.tolerance`, the "output" quantity). The
cache calls change the history as transformers defines them (crop removes the last positions,
reorder and select pick rows, repeat_interleave repeats each row); ``generate()`` programs
compare the cached and uncached tokens exactly (and greedy's logits within the tolerance).

Caches that evict by a rule the uncached forward does not apply (the attnspec models' finite
``theta``, (F7)) cannot be judged this way: every case is "not applicable", with the reason. A
window is applied by the uncached forward too (``window_size``, ``sliding_window``), so windowed
caches are judged. The first failing operation ends a program; its message lists the program up
to it, and the result's repro line reruns exactly that program.
"""

from __future__ import annotations

import math
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from .drawers import case_seed
from .metrics import Comparison, compare
from .model_loading import format_overrides
from .model_programs import ModelProgram, Op, build_program, family_of, note_of
from .runner import CaseResult, RunReport
from .skips import SkipList, XfailList
from .tolerances import tolerance

DTYPES = ("float32", "float64")  # the dtypes a model is checked in [decision]
CacheFactory = Callable[[Any], Any]


def cache_keyword() -> str:
    """The keyword under which the installed transformers' generate() hands the model its cache."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    return str(ALL_CACHE_NAMES[0])


def not_applicable(config: Any) -> str | None:
    """Why the cached forward of this configuration cannot be compared with its uncached forward
    (the cache evicts by a rule the uncached forward does not apply), or None."""
    theta = getattr(config, "theta", math.inf)
    kinds = tuple(getattr(config, "layer_kinds", ()))
    if isinstance(theta, int | float) and theta < math.inf and any(k != "ID" for k in kinds):
        return (
            f"the cache evicts keys at depth >= theta = {theta:g} (spec/fpa.md F7) and the "
            "model's forward without a cache keeps every key: the model defines no evicted "
            "forward to compare with"
        )
    return None


def repro_command(
    spec: str,
    case_id: str,
    dtype: str,
    *,
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    cache: str | None = None,
    device: str = "cpu",
) -> str:
    """The command that reruns exactly one model program."""
    words = ["attnspec", "conformance", "--model", spec]
    if overrides:
        words += ["--model-config", *format_overrides(overrides)]
    if seed:
        words += ["--model-seed", str(seed)]
    if cache:
        words += ["--cache", cache]
    if device != "cpu":
        words += ["--device", device]
    words += ["--cases", case_id, "--dtypes", dtype]
    return shlex.join(words)


class _Fault(Exception):
    """An operation whose outcome is a verdict other than passed (carried out of the program)."""

    def __init__(self, verdict: str, message: str, comparison: Comparison | None = None):
        super().__init__(message)
        self.verdict, self.message, self.comparison = verdict, message, comparison


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name})"


def _raised(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


class ProgramRun:
    """One program on one model: the cache, the rows' history, the worst comparison so far."""

    def __init__(self, model: Any, program: ModelProgram, dtype: str, factory: CacheFactory | None):
        self.model, self.program, self.factory = model, program, factory
        self.keyword = cache_keyword()
        self.tolerance = tolerance("model", dtype, "output")
        self.device = next(model.parameters()).device
        self.cache: Any = None
        self.ids = np.zeros((program.rows, 0), dtype=np.int64)
        self.present = np.zeros((program.rows, 0), dtype=bool)
        self.worst: Comparison | None = None
        self.crops = any(op.method == "crop" for op in program.ops)
        self.at = 0

    @torch.no_grad()
    def run(self) -> None:
        """Every operation in order (``at``: the one running); _Fault for a verdict other than
        passed, any other exception for a fault of the model or its cache."""
        for at, op in enumerate(self.program.ops):
            self.at = at
            if op.method == "forward":
                self.forward(op)
            elif op.method == "generate":
                self.generate(op)
            else:
                self.cache_call(op)

    def recording(self, cache: Any) -> Any:
        """``cache``, told to keep what a crop may need to restore (transformers'
        ``activate_past_recording``, which assisted decoding calls) in programs that crop."""
        record = getattr(cache, "activate_past_recording", None)
        if self.crops and record is not None:
            record()
        return cache

    def tensor(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def note(self, comparison: Comparison) -> None:
        if self.worst is None or comparison.ratio > self.worst.ratio:
            self.worst = comparison

    def forward(self, op: Op) -> None:
        ids, present = op.args["ids"], op.args["present"]
        n = ids.shape[1]
        history_ids = np.concatenate([self.ids, ids], axis=1)
        history_present = np.concatenate([self.present, present], axis=1)
        mask = self.tensor(history_present.astype(np.int64))
        given = self.cache
        if given is None and self.factory is not None:
            given = self.recording(self.factory(self.model.config))
        before = _length(given)
        kwargs = {} if given is None else {self.keyword: given}
        out = self.model(self.tensor(ids), attention_mask=mask, use_cache=True, **kwargs)
        # where generate() looks for it: the keyword's name, then the other names of the cache
        others = [name for name in ("past_key_values", "cache") if name != self.keyword]
        names = (self.keyword, *others)
        returned = next((out[name] for name in names if out.get(name) is not None), None)
        if returned is None:
            raise _Fault("failed", f"the model returned no cache (use_cache=True; {names})")
        self.cache = returned if returned is given else self.recording(returned)
        full = self.model(self.tensor(history_ids), attention_mask=mask, use_cache=False)
        cached = _numpy(out.logits)[present]  # [tokens, vocab]
        want = _numpy(full.logits[:, -n:])[present]
        comparison = compare(cached, want, self.tolerance, row_ndim=1)
        self.ids, self.present = history_ids, history_present
        self.note(comparison)
        if not comparison.passed:
            text = f"logits: {comparison.describe()}"
            unused = ""
            if given is not None and returned is not given:
                unused = f"the model returned another cache than the one passed as {self.keyword}="
            elif given is not None and _length(given) == before:
                unused = f"get_seq_length() of the cache passed as {self.keyword}= stayed {before}"
            if unused:
                text += (
                    f"; {unused}: does the model read the keyword {self.keyword!r}, under which "
                    "this transformers passes the cache?"
                )
            raise _Fault("failed", text, comparison)

    def cache_call(self, op: Op) -> None:
        value = op.args["value"]
        method = getattr(self.cache, op.method, None)
        if method is None:
            raise _Fault("not implemented", f"the cache has no {op.method}()")
        argument = self.tensor(np.asarray(value)) if isinstance(value, list) else value
        try:
            method(argument)
        except NotImplementedError as exc:
            raise _Fault("not implemented", f"the cache raised {_raised(exc)}") from None
        except ValueError as exc:
            if op.method == "crop" and value < 0:  # a cache that rolls back only so far
                raise _Fault("not implemented", f"the cache declines: {_raised(exc)}") from None
            raise
        if op.method == "crop":
            keep = self.ids.shape[1] + value
            self.ids, self.present = self.ids[:, :keep], self.present[:, :keep]
        elif op.method == "batch_repeat_interleave":
            self.ids = np.repeat(self.ids, value, axis=0)
            self.present = np.repeat(self.present, value, axis=0)
        else:
            self.ids, self.present = self.ids[value], self.present[value]

    def generate(self, op: Op) -> None:
        a = op.args
        pad = self.model.config.pad_token_id
        options: dict[str, Any] = dict(
            input_ids=self.tensor(a["ids"]),
            attention_mask=self.tensor(a["present"].astype(np.int64)),
            max_new_tokens=a["max_new_tokens"],
            min_new_tokens=a["max_new_tokens"],
            do_sample=False,
            pad_token_id=0 if pad is None else pad,
            return_dict_in_generate=True,
        )
        if a["mode"] == "beams":
            options.update(num_beams=a["num_beams"], num_return_sequences=2)
        else:
            options.update(output_logits=True)
        cache = {} if self.factory is None else {self.keyword: self.factory(self.model.config)}
        cached = self.model.generate(**options, use_cache=True, **cache)
        uncached = self.model.generate(**options, use_cache=False)
        got, want = cached.sequences.cpu(), uncached.sequences.cpu()
        prompt = a["ids"].shape[1]
        steps = got.shape[1] - prompt  # the steps both runs took on the same tokens
        text = ""
        if got.shape != want.shape or not torch.equal(got, want):
            text = (
                f"tokens: cached {got[:, prompt:].tolist()}, uncached {want[:, prompt:].tolist()}"
            )
            if got.shape == want.shape:
                steps = int((got != want).nonzero()[:, 1].min()) - prompt
                text += f"; first difference at new token {steps}"
                steps += 1  # the step that chose differently, from the same tokens
        if a["mode"] == "greedy":
            logits = compare(
                _numpy(torch.stack(cached.logits[:steps], dim=1)),
                _numpy(torch.stack(uncached.logits[:steps], dim=1)),
                self.tolerance,
                row_ndim=1,
            )
            self.note(logits)
            if text:
                text += (
                    f"; logits up to it (a near tie if within the tolerance): {logits.describe()}"
                )
            elif not logits.passed:
                raise _Fault("failed", f"same tokens, but logits: {logits.describe()}", logits)
        else:
            self.note(Comparison(0.0, 0.0, 0.0, ()))
        if text:
            raise _Fault("failed", text)


def _length(cache: Any) -> int | None:
    try:
        return None if cache is None else int(cache.get_seq_length())
    except Exception:  # a cache whose length is not readable: no hint from it
        return None


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(device="cpu", dtype=torch.float64).numpy()


def run_program(
    model: Any,
    case_id: str,
    dtype: str,
    *,
    factory: CacheFactory | None = None,
    repro: str = "",
) -> CaseResult:
    """The verdict of one model case; never raises for a fault of the model or its cache."""
    family = family_of(case_id)
    program = build_program(case_id, int(model.config.vocab_size))
    result = CaseResult(
        case_id,
        family,
        dtype,
        program.kind,
        "failed",
        repro=repro,
        seed=case_seed(case_id),
        shapes={"ids": (program.rows, _positions(program))},
        note=note_of(case_id),
    )
    result.tolerance = tolerance("model", dtype, "output")
    reason = not_applicable(model.config)
    if reason is not None:
        result.verdict, result.message = "not applicable", reason
        return result
    state = ProgramRun(model, program, dtype, factory)
    try:
        state.run()
    except _Fault as fault:
        result.verdict = fault.verdict
        i = state.at
        result.message = f"operation {i}: {fault.message}\n{_indented(program.listing(i))}"
        if fault.comparison is not None:
            state.note(fault.comparison)
    except Exception as exc:  # a fault of the model or its cache, reported per case
        i = state.at
        result.raised = _raised(exc)
        result.message = (
            f"operation {i}: {program.ops[i].method} raised {result.raised}{_where(exc)}\n"
            f"{_indented(program.listing(i))}"
        )
    else:
        result.verdict = "passed"
    if state.worst is not None:
        result.error, result.ratio = state.worst.rel, state.worst.ratio
        result.details = {"worst": state.worst.describe()}
    return result


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def _positions(program: ModelProgram) -> int:
    return sum(op.args["ids"].shape[1] for op in program.ops if "ids" in op.args)


TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run_model(
    model: Any,
    case_ids: Iterable[str],
    dtypes: Iterable[str] = ("float32",),
    *,
    spec: str = "",
    overrides: dict[str, Any] | None = None,
    seed: int = 0,
    factory: CacheFactory | None = None,
    cache_spec: str | None = None,
    device: str = "cpu",
    skips: SkipList | None = None,
    xfails: XfailList | None = None,
    progress: Callable[[int, int, CaseResult], None] | None = None,
) -> RunReport:
    """Every case in every dtype (the model is converted in place and given back in its own
    dtype); ``spec``, ``overrides``, ``seed``, ``cache_spec`` and ``device`` make the repro
    lines. ``factory(config)`` makes the cache of each program (default: the model's own)."""
    dtypes, case_ids = list(dtypes), list(case_ids)
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        raise ValueError(f"dtypes: a model is checked in {', '.join(DTYPES)}; got {unknown}")
    own = next(model.parameters()).dtype
    skips = skips or SkipList([])
    start = time.perf_counter()
    results = []
    work = [(case_id, dtype) for dtype in dtypes for case_id in case_ids]
    try:
        for n, (case_id, dtype) in enumerate(work, 1):
            model.to(TORCH_DTYPES[dtype])
            repro = repro_command(
                spec or type(model).__name__,
                case_id,
                dtype,
                overrides=overrides,
                seed=seed,
                cache=cache_spec,
                device=device,
            )
            reason = skips.reason(case_id, dtype)
            if reason is not None:
                family = family_of(case_id)
                kind = "tokens" if family.startswith("generate") else "logits"
                result = CaseResult(case_id, family, dtype, kind, "skipped", message=reason)
            else:
                result = run_program(model, case_id, dtype, factory=factory, repro=repro)
                if xfails is not None:
                    result = xfails.judge(result)
            results.append(result)
            if progress:
                progress(n, len(work), result)
    finally:
        model.to(own)
    return RunReport(
        f"model {type(model).__name__}",
        device,
        results,
        skips.unmatched() + ([] if xfails is None else xfails.unmatched()),
        versions(),
        time.perf_counter() - start,
        report_notes(model, spec, cache_spec),
        model={
            "spec": spec or type(model).__name__,
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "config": format_overrides(overrides or {}),
            "seed": seed,
            "cache": cache_spec,
            "dtypes": dtypes,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
    )


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": sys.platform,
    }


def report_notes(model: Any, spec: str, cache_spec: str | None) -> list[str]:
    import transformers

    notes = [
        f"model {spec or type(model).__name__}: {type(model).__name__}, "
        f"{sum(p.numel() for p in model.parameters())} parameters; cache: "
        + (cache_spec or "the model's own"),
        f"transformers {transformers.__version__} passes the cache as {cache_keyword()}=; so "
        "does the kit, and each forward's logits are compared with the forward of the same "
        "tokens without a cache (the 'output' tolerance of the table below)",
    ]
    reason = not_applicable(model.config)
    if reason is not None:
        notes.append(f"not applicable: {reason}")
    return notes


def model_command(
    args: Any, prog: str, progress: Callable[[int, int, CaseResult], None] | None = None
) -> int:
    """``attnspec conformance --model ...`` (the parsed arguments of the conformance command;
    ``progress`` as :func:`run_model`'s): 0 all passed, 1 a case failed, 2 a usage error."""
    from .model_loading import load_model, parse_overrides
    from .model_programs import FAMILIES, model_case_ids
    from .registry import load_object
    from .report import format_report, write_json, write_junit

    def usage(text: str) -> int:
        print(f"{prog}: {text}", file=sys.stderr)
        return 2

    if args.ops:
        return usage("--ops selects backend ops; with --model select programs with --cases")
    dtypes = args.dtypes or ["float32"]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        return usage(
            f"--dtypes {' '.join(unknown)}: a model is checked in {', '.join(DTYPES)} "
            "(docs/decisions.md)"
        )
    case_ids = model_case_ids(args.cases)
    if args.cases and not case_ids:
        return usage("--cases matched no model case id (attnspec conformance --model M --list)")
    if args.smoke:
        case_ids = [i for i in case_ids if i.endswith("/0")]
    if args.list:
        for case_id in case_ids:
            print(f"{case_id:<32} {FAMILIES[family_of(case_id)][2]}")
        return 0
    try:
        overrides = parse_overrides(args.model_config)
        factory = None if args.cache is None else load_object(args.cache)
        if factory is not None and not callable(factory):
            raise ValueError(f"--cache: {args.cache!r} is not callable")
        model = load_model(args.model, overrides, seed=args.model_seed, device=args.device)
        skips = SkipList.load("model", args.skips)
        xfails = XfailList.load("model", args.xfails)
    except Exception as exc:  # anything a model's import or constructor may raise
        text = " ".join(str(exc).split())
        if not text.startswith("--"):
            text = f"--model {args.model}: {type(exc).__name__}: {text}"
        return usage(text.replace("backend: ", "--cache: "))
    report = run_model(
        model,
        case_ids,
        dtypes,
        spec=args.model,
        overrides=overrides,
        seed=args.model_seed,
        factory=factory,
        cache_spec=args.cache,
        device=args.device,
        skips=skips,
        xfails=xfails,
        progress=progress,
    )
    print(format_report(report))
    if args.json:
        write_json(report, args.json)
    if args.junit:
        write_junit(report, args.junit)
    return 0 if report.ok else 1
