"""attnspec's causal language models for Hugging Face transformers (the ``.[hf]`` extra).

Importing this package registers the configurations and models with ``AutoConfig``,
``AutoModel`` and ``AutoModelForCausalLM`` (``exist_ok=True``), so a saved model loads with
``AutoModelForCausalLM.from_pretrained(path)`` after ``import attnspec.models``.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .cache import AttnSpecCache
from .configuration import (
    LAYER_KINDS,
    AttnSpecConfig,
    FoXConfig,
    FPAConfig,
    HybridConfig,
    InterdomainConfig,
)
from .modeling import (
    AttnSpecForCausalLM,
    AttnSpecModel,
    FoXForCausalLM,
    FoXModel,
    FPAForCausalLM,
    FPAModel,
    HybridForCausalLM,
    HybridModel,
    InterdomainForCausalLM,
    InterdomainModel,
)

# configuration -> (base model, causal LM)
MODELS = {
    FPAConfig: (FPAModel, FPAForCausalLM),
    FoXConfig: (FoXModel, FoXForCausalLM),
    InterdomainConfig: (InterdomainModel, InterdomainForCausalLM),
    HybridConfig: (HybridModel, HybridForCausalLM),
}

for _config, (_base, _lm) in MODELS.items():
    AutoConfig.register(_config.model_type, _config, exist_ok=True)
    AutoModel.register(_config, _base, exist_ok=True)
    AutoModelForCausalLM.register(_config, _lm, exist_ok=True)

__all__ = [
    "LAYER_KINDS",
    "AttnSpecCache",
    "AttnSpecConfig",
    "AttnSpecForCausalLM",
    "AttnSpecModel",
    "FPAConfig",
    "FPAForCausalLM",
    "FPAModel",
    "FoXConfig",
    "FoXForCausalLM",
    "FoXModel",
    "HybridConfig",
    "HybridForCausalLM",
    "HybridModel",
    "InterdomainConfig",
    "InterdomainForCausalLM",
    "InterdomainModel",
]
