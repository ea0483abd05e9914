"""The training loop the experiments share: AdamW, linear warm-up then cosine decay, gradient
clipping, the loss recorded at every step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .harness import Progress


def seed_everything(seed: int) -> torch.Generator:
    """Seed torch's global generator (initialisation) and return a generator for the data."""
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(10_000 + seed)


def train(
    model: nn.Module,
    batch_loss: Callable[[nn.Module, int], Tensor],
    *,
    steps: int,
    lr: float,
    progress: Progress,
    label: str,
    warmup: int | None = None,
    weight_decay: float = 0.01,
    clip: float = 1.0,
) -> list[float]:
    """Minimise ``batch_loss(model, step)`` for ``steps`` steps; returns the loss per step.

    A loss that turns NaN or infinite stops training with a ValueError naming the step, rather
    than training on garbage.
    """
    optimiser = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warmup = max(1, steps // 10) if warmup is None else warmup

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimiser, factor)
    losses: list[float] = []
    model.train()
    progress.begin(label, steps)
    for step in range(steps):
        loss = batch_loss(model, step)
        if not torch.isfinite(loss):
            raise ValueError(f"{label}: the loss is {loss.item()} at step {step}")
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimiser.step()
        schedule.step()
        losses.append(loss.item())
        progress.advance(f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    progress.end(f"loss {sum(losses[-20:]) / len(losses[-20:]):.4f}")
    model.eval()
    return losses
