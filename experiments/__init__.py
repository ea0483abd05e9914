"""attnspec.experiments: small-scale reproductions of the papers' claims.

One module per experiment, each one command (``--quick`` for the CI smoke setting):

- ``python -m attnspec.experiments.e1``: bracket-scope set selection, one layer, several seeds
  (FPA, FoX, softmax + ALiBi, softmax + RoPE).
- ``python -m attnspec.experiments.e2``: passkey retrieval at 1x-8x the training length, FPA with
  and without KV-cache eviction, FoX, softmax + RoPE.
- ``python -m attnspec.experiments.e3``: tiny byte-level language models on the Python standard
  library's sources: loss by position at 1x, 2x, 4x the training length.

Results (JSON: config, seeds, versions, time) and a figure per experiment; the measured numbers
and verdicts are in docs/experiments.md. Needs the ``torch`` and ``plots`` extras.
"""
