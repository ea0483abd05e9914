"""The model of ``attnspec conformance --model``: a transformers causal LM from a spec.

A spec is ``module:Attribute`` (or ``path/to/file.py:Attribute``) naming a configuration class
(built with ``AutoModelForCausalLM.from_config``), a model class (built from its
``config_class``) or a factory returning a model; or a local checkpoint folder (loaded with
``AutoModelForCausalLM.from_pretrained``). ``--model-config KEY=VALUE ...`` gives the
configuration's keyword arguments (values are Python literals, ``inf`` and ``nan`` floats, else
strings); the weights of a built model are drawn after ``torch.manual_seed(seed)``.
"""

from __future__ import annotations

import ast
import importlib
import json
import math
import os
from typing import Any

from .registry import load_object

SPEC_HELP = """the causal LM whose cache to check:
  package.module:Config              a configuration class, built with
                                     AutoModelForCausalLM.from_config
  package.module:ModelClass          a model class (its config_class)
  package.module:factory             a function returning a model
  path/to/file.py:attribute          the same in a Python file
  path/to/checkpoint                 a local folder for from_pretrained
e.g. transformers:LlamaConfig or attnspec.models:FPAConfig"""


def parse_overrides(items: list[str] | None) -> dict[str, Any]:
    """``["hidden_size=32", "layer_pattern=FPA,ID", "theta=inf"]`` -> keyword arguments.

    ValueError naming --model-config for an item that is not KEY=VALUE."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, eq, text = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--model-config: expected KEY=VALUE, got {item!r}")
        out[key] = _literal(text)
    return out


def _literal(text: str) -> Any:
    if text.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(text)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def format_overrides(overrides: dict[str, Any]) -> list[str]:
    """The KEY=VALUE items that :func:`parse_overrides` reads back to ``overrides``."""
    items = []
    for key, value in overrides.items():
        if isinstance(value, float) and not math.isfinite(value):
            text = str(value)
        elif isinstance(value, str) and _literal(value) == value:
            text = value
        else:
            text = repr(value)
        items.append(f"{key}={text}")
    return items


def _register_attnspec_models(folder: str) -> None:
    """Import attnspec.models (which registers its Auto classes) for a folder of one of them."""
    try:
        with open(os.path.join(folder, "config.json")) as fh:
            model_type = str(json.load(fh).get("model_type", ""))
    except (OSError, ValueError):
        return
    if model_type.startswith("attnspec"):
        importlib.import_module("attnspec.models")


def load_model(
    spec: str, overrides: dict[str, Any] | None = None, *, seed: int = 0, device: str = "cpu"
) -> Any:
    """The model of ``spec`` in eval mode on ``device`` (a ``PreTrainedModel`` with
    ``generate``). ValueError naming --model when the spec does not give one."""
    import torch
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    overrides = dict(overrides or {})
    model: Any
    torch.manual_seed(seed)
    if os.path.isdir(spec):
        _register_attnspec_models(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, **overrides)
    else:
        if ":" not in spec:
            raise ValueError(
                f"--model: expected 'module:Attribute' or a checkpoint folder, got {spec!r}"
            )
        try:
            obj = load_object(spec)
        except ValueError as exc:
            raise ValueError(f"--model: {str(exc).removeprefix('backend: ')}") from None
        if isinstance(obj, type) and issubclass(obj, PretrainedConfig):
            model = AutoModelForCausalLM.from_config(obj(**overrides))
        elif isinstance(obj, type) and issubclass(obj, PreTrainedModel):
            config_class: Any = obj.config_class
            model = obj(config_class(**overrides))
        elif callable(obj):
            model = obj(**overrides)
        else:
            raise ValueError(f"--model: {spec!r} is a {type(obj).__name__}, not a class or factory")
    if not isinstance(model, PreTrainedModel) or not hasattr(model, "generate"):
        raise ValueError(
            f"--model: {spec!r} gave a {type(model).__name__}; expected a transformers causal LM "
            "(a PreTrainedModel with generate())"
        )
    return model.eval().to(device)
