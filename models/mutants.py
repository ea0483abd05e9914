"""Deliberately wrong caches: the self-test of ``attnspec conformance --model``.

Each mutant is a correct cache with one fault, written the way caches go wrong, as a subclass of
transformers' ``DynamicCache`` (for transformers' own models: Llama) or of the attnspec models'
``AttnSpecCache``, and names the model family written to catch it (``family``).
``tests/test_model_conformance.py`` asserts that each fails its family and that the correct
cache passes it. A mutant is made from the model's configuration, as the kit's ``--cache``
factories are:
``attnspec conformance --model transformers:LlamaConfig ... --cache
attnspec.models.mutants:DynamicCropOffByOne``.

- ``*DroppedBetweenSteps``: every forward starts from an empty cache (what a model that does not
  read the keyword its transformers passes the cache under does);
- ``*CropOffByOne``: ``crop`` removes one position more than asked;
- ``*ReorderMissesLayer``: ``reorder_cache`` leaves the last layer's rows where they were;
- ``AttnSpecPaddingCountedAsTokens``: padded positions enter the decode state as tokens (a
  ``DynamicCache`` never sees the padding mask, so it has no such mutant).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import DynamicCache

from .cache import AttnSpecCache


class _CropOffByOne:
    """crop(k) removes one position more: crop(-2) removes 3, crop(0) removes 1."""

    family: ClassVar[str] = "crop"

    def crop(self, max_length: int) -> None:
        super().crop(max_length - 1)  # type: ignore[misc]  # the cache's crop


class _ReorderMissesLayer:
    """reorder_cache reorders every layer but the last."""

    family: ClassVar[str] = "beams"
    layers: list[Any]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers[:-1]:
            layer.reorder_cache(beam_idx)


class DynamicDroppedBetweenSteps(DynamicCache):
    """Each forward's keys and values replace the layer's, so a step sees only itself."""

    family: ClassVar[str] = "steps"

    def __init__(self, config: Any):
        super().__init__(config=config)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if layer_idx < len(self.layers):
            self.layers[layer_idx].reset()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class DynamicCropOffByOne(_CropOffByOne, DynamicCache):
    __doc__ = _CropOffByOne.__doc__

    def __init__(self, config: Any):
        super().__init__(config=config)


class DynamicReorderMissesLayer(_ReorderMissesLayer, DynamicCache):
    __doc__ = _ReorderMissesLayer.__doc__

    def __init__(self, config: Any):
        super().__init__(config=config)


class AttnSpecDroppedBetweenSteps(AttnSpecCache):
    """Each layer's decode state is reset before every chunk after the first."""

    family: ClassVar[str] = "steps"

    def __init__(self, config: Any):
        super().__init__(config)
        for layer in self.session_layers:
            layer.advance = _dropping(layer)  # type: ignore[method-assign]


def _dropping(layer: Any) -> Any:
    advance = layer.advance

    def dropped(inputs: dict[str, Tensor], present: Tensor, open_session: Any) -> Any:
        if layer.positions:
            layer.reset()
        return advance(inputs, present, open_session)

    return dropped


class AttnSpecCropOffByOne(_CropOffByOne, AttnSpecCache):
    __doc__ = _CropOffByOne.__doc__


class AttnSpecReorderMissesLayer(_ReorderMissesLayer, AttnSpecCache):
    __doc__ = _ReorderMissesLayer.__doc__


class AttnSpecPaddingCountedAsTokens(AttnSpecCache):
    """Every position of a chunk is advanced as a token, padding included."""

    family: ClassVar[str] = "padded"

    def __init__(self, config: Any):
        super().__init__(config)
        for layer in self.session_layers:
            layer.advance = _padding_as_tokens(layer)  # type: ignore[method-assign]


def _padding_as_tokens(layer: Any) -> Any:
    advance = layer.advance

    def counted(inputs: dict[str, Tensor], present: Tensor, open_session: Any) -> Any:
        return advance(inputs, torch.ones_like(present), open_session)

    return counted


MUTANTS: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        DynamicDroppedBetweenSteps,
        DynamicCropOffByOne,
        DynamicReorderMissesLayer,
        AttnSpecDroppedBetweenSteps,
        AttnSpecCropOffByOne,
        AttnSpecReorderMissesLayer,
        AttnSpecPaddingCountedAsTokens,
    )
}
