"""Saved outputs of the attnspec models: weights and logits that later code must reproduce bit
for bit (tests/test_hf_models.py).

Each case of :data:`CASES` is a tiny model (fixed seeds, every parameter moved off its
initial value so that zero biases and zero key offsets take part; head dims 4 and 8) saved with
``save_pretrained`` in tests/data/models/<case>/, beside ``outputs.safetensors``: its outputs
from :func:`outputs` (the forward without a cache, a left-padded batch, a prefill then decode
steps with the cache and, where the cache can roll back, a crop and the steps again, greedy
generation's tokens and logits, the cache's bytes and live / stored fractions). The metadata
says which torch, transformers and CPU kernels (``torch.backends.cpu.get_cpu_capability``)
wrote them: float results depend on the vector kernels, so bits are compared where those are
the same. ``python tests/model_outputs.py`` writes the files again (only when the models'
outputs are meant to change).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import attnspec.models as M

DATA = Path(__file__).resolve().parent / "data" / "models"

SIZES = dict(
    vocab_size=24,
    hidden_size=16,
    num_heads=4,
    intermediate_size=24,
    id_modes=4,
    initializer_range=0.3,
)
CASES: dict[str, tuple[type, dict[str, Any], torch.dtype]] = {
    # name -> (configuration class, its fields beyond SIZES, dtype)
    "fpa_gqa": (
        M.FPAConfig,
        dict(num_hidden_layers=2, num_kv_heads=2, head_dim=8, theta=0.5),
        torch.float32,
    ),
    "fpa_fox_window": (
        M.FPAConfig,
        dict(num_hidden_layers=2, layer_pattern="FPA_FOX", num_kv_heads=1, window_size=3),
        torch.float32,
    ),
    "fox_gqa_window": (
        M.FoXConfig,
        dict(num_hidden_layers=2, num_kv_heads=2, head_dim=8, window_size=5, theta=1.0),
        torch.float32,
    ),
    "interdomain": (M.InterdomainConfig, dict(num_hidden_layers=2), torch.float32),
    "hybrid": (
        M.HybridConfig,
        dict(num_hidden_layers=3, layer_pattern="FPA,ID,FOX", num_kv_heads=2, max_rollback=2),
        torch.float32,
    ),
    "fpa_float64": (
        M.FPAConfig,
        dict(num_hidden_layers=2, num_kv_heads=2, head_dim=8, theta=2.0, max_rollback=2),
        torch.float64,
    ),
    "hybrid_bfloat16": (
        M.HybridConfig,
        dict(num_hidden_layers=2, layer_pattern="FPA,ID", num_kv_heads=2, theta=1.0),
        torch.bfloat16,
    ),
}


def build(name: str) -> Any:
    """The case's model, seeded, every parameter moved by 0.05 N(0, 1)."""
    cls, fields, dtype = CASES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**SIZES, **fields))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.to(dtype).eval()


def load(name: str) -> Any:
    """The case's saved model (from_pretrained), its parameters copied into fresh memory: the
    CPU's BLAS (MKL) sums in an order that depends on how its operands are aligned, and
    from_pretrained leaves them at the file's offsets."""
    path = DATA / name
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=CASES[name][2])
    for p in model.parameters():
        p.data = p.data.clone()
    return model.eval()


def inputs() -> dict[str, torch.Tensor]:
    """Token ids [3, 8] and a left-padding mask (rows with 0, 3 and 1 padded positions)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SIZES["vocab_size"], (3, 8), generator=g)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    return {"ids": ids, "mask": mask}


@torch.no_grad()
def outputs(model: Any) -> dict[str, torch.Tensor]:
    """What the saved outputs hold, computed by ``model`` (see the module docstring)."""
    data = inputs()
    ids, mask = data["ids"], data["mask"]
    out = {
        "forward": model(ids[:2, :7], use_cache=False).logits,
        "padded": model(ids, attention_mask=mask, use_cache=False).logits,
    }
    cache = M.AttnSpecCache(model.config)
    logits = [model(ids[:, :4], attention_mask=mask[:, :4], cache=cache).logits]
    for t in range(4, 8):
        logits.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
    out["decoded"] = torch.cat(logits, dim=1)
    out["bytes"] = torch.tensor([cache.bytes_held(), cache.bytes_full()])
    out["fractions"] = torch.tensor(
        [[f["live"], f["stored"]] for f in cache.fractions() if f is not None], dtype=torch.float64
    )
    if model.config.max_rollback >= 2:
        cache.crop(-2)
        again = [model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
                 for t in (6, 7)]  # fmt: skip
        out["cropped"] = torch.cat(again, dim=1)
    generated = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    out["generated"] = generated.sequences
    out["generated_logits"] = torch.stack(generated.logits, dim=1)
    return {**data, **out}


def platform() -> dict[str, str]:
    """What float results depend on besides the code: torch, transformers, the CPU kernels."""
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def saved(name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The saved outputs of a case and the platform that wrote them."""
    path = DATA / name / "outputs.safetensors"
    with safe_open(str(path), "pt") as f:
        metadata = dict(f.metadata())
    return load_file(str(path)), json.loads(metadata["platform"])


def write() -> None:
    """Save every case's model and outputs (one torch thread, as the tests run)."""
    torch.set_num_threads(1)
    shutil.rmtree(DATA, ignore_errors=True)
    for name in CASES:
        build(name).save_pretrained(DATA / name)
        tensors = {k: v.contiguous() for k, v in outputs(load(name)).items()}
        save_file(
            tensors,
            str(DATA / name / "outputs.safetensors"),
            metadata={"platform": json.dumps(platform())},
        )
        print(name, ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items()))


if __name__ == "__main__":
    sys.exit(write())
