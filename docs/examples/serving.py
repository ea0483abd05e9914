"""Serving one FPA layer with its paged decode session: ragged prompts, decode steps, beam
selection and rollback, with eviction at a finite threshold.

Two rows: a prompt of 6 tokens and one of 3, left-padded to 6 (``present`` marks the real
positions; absent ones give 0 and change nothing). Then one token per row and step; row 0 undoes
its last 2 tokens (within ``max_rollback``), and ``select`` continues both rows from row 1, as
beam search does (pages are shared, not copied). The inputs are random hidden states: what the
example shows is the session's contract, not a model.

Run: ``python docs/examples/serving.py`` (needs the torch extra).
"""

from __future__ import annotations

import torch

from attnspec.backends.torch import FirstPassageAttention

D, HEADS, HEAD_DIM = 32, 4, 8


def serve(theta: float = 2.0, steps: int = 8, seed: int = 0) -> dict:
    """Run the session; returns what the test compares: the layer and session, each row's
    inputs and outputs at its real positions (before the rollback), the outputs at absent
    positions, the kept fractions."""
    # --8<-- [start:session]
    torch.manual_seed(seed)
    layer = FirstPassageAttention(D, HEADS, HEAD_DIM).eval()
    session = layer.open_session(rows=2, theta=theta, max_rollback=4)

    prompt = torch.randn(2, 6, D)  # row 1's prompt is its last 3 positions (left padding)
    present = torch.tensor([[True] * 6, [False] * 3 + [True] * 3])
    inputs, outputs = [prompt], [session.advance({"x": prompt}, present)["y"]]  # 0 if absent
    for _ in range(steps):  # one new token per row and step
        inputs.append(torch.randn(2, 1, D))
        y = session.advance({"x": inputs[-1]}, torch.ones(2, 1, dtype=torch.bool))["y"]
        outputs.append(y)  # [2, 1, D]

    counts = session.counts()  # tokens [R]; live [R, heads]: keys attended now
    kept = counts["live"] / counts["tokens"][:, None]
    print("tokens", counts["tokens"].tolist(), "kept per head", kept.round(decimals=2).tolist())
    print("bytes held in pages", session.attention.bytes_held())

    session.rollback(0, 2)  # row 0: back to its state before its last 2 tokens
    session.select([1, 1])  # beam search: both rows now continue row 1
    print("after rollback and select: tokens", session.counts()["tokens"].tolist())
    # --8<-- [end:session]
    rows = torch.cat([present, torch.ones(2, steps, dtype=torch.bool)], dim=1)
    x, y = torch.cat(inputs, dim=1), torch.cat(outputs, dim=1)
    return {
        "layer": layer,
        "session": session,
        "x": [x[r][rows[r]] for r in range(2)],  # each row's real tokens [T_r, D]
        "y": [y[r][rows[r]] for r in range(2)],
        "absent": y[~rows],
        "kept": kept,
    }


if __name__ == "__main__":
    serve()
