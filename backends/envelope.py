"""What each op accepts, and which of those calls a Triton kernel serves on CUDA: the one table.

The ops of ``backends/torch`` accept more than their Triton kernels compile for a GPU. Each
family's row of :data:`ACCEPTS` says what its op takes; :data:`EAGER_ON_CUDA` lists the corners
a kernel does not serve, with the reason, which the op (``impl=None``) then routes to the eager
twin on CUDA instead of failing at its first launch; an explicit ``impl="triton"`` on CUDA at
such a corner is a ValueError naming ``impl``. Under the Triton interpreter (CPU tensors) every
corner runs the kernels. docs/api/envelope.md prints the table (:func:`markdown`);
``python -m bench.gpu_static_envelope`` compiles every kernel at the corners for sm_90 and
checks each against an H100/H200's limits (tests/test_envelope_gate.py).

Dtype names are torch's without the prefix (``"bfloat16"``), or the short names of the gate
(``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"``). Nothing here imports a framework.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ACCEPTS",
    "EAGER_ON_CUDA",
    "FAMILIES",
    "H200_BYTES",
    "MAX_ELEMENTS",
    "MAX_HEAD_DIM",
    "MAX_SEQUENCE_HEADS",
    "Accepts",
    "Eager",
    "markdown",
    "max_tokens",
    "route",
]

H200_BYTES = 141 * 10**9  # the largest device memory the table sizes for (an H200)
# q, k, v and o resident in 16-bit at GQA 1:1: the largest B * T * HQ * D of one call
MAX_ELEMENTS = H200_BYTES // (4 * 2)
MAX_HEAD_DIM = 256  # the Triton FPA/FoX kernels' widest K and V (larger: the eager twin)
# LegS's position programs take 64 (sequence, head) columns each on grid axis z (<= 65,535)
MAX_SEQUENCE_HEADS = 65_535 * 64
FAMILIES = ("fpa", "fox", "s4d", "legs", "paged")

_SHORT = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}


def _name(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    return _SHORT.get(name, name)


def max_tokens(bytes_per_token: int) -> int:
    """Tokens of the largest call whose resident tensors take ``bytes_per_token`` per token."""
    return H200_BYTES // bytes_per_token


@dataclass(frozen=True)
class Accepts:
    """What one op accepts (every implementation; the eager twin serves all of it)."""

    family: str
    op: str
    qkv: str  # dtypes of q, k, v (and their widths)
    scalars: str  # the per-token scalars and parameters
    head_dims: str
    gqa: str
    chunk: str  # query positions per call (decode) or per chunk
    size: str  # B * T * H * D
    sequences: str  # packed sequences (cu_seqlens)


ACCEPTS = (
    Accepts(
        "fpa",
        "fpa_attention",
        "bfloat16, float16, float32, float64 (one dtype)",
        "field, level: float32 or float64; float16/bfloat16 widened to float32; float64 with "
        "float64 q",
        "any K, V (Triton: K, V <= 256)",
        "HQ a multiple of H: 1:1 to MQA (HQ:1)",
        "any T",
        f"B * T * HQ * D up to {MAX_ELEMENTS:,} (q, k, v, o in 16-bit on 141 GB)",
        "any number (B = 1)",
    ),
    Accepts(
        "fox",
        "fox_attention",
        "bfloat16, float16, float32, float64 (one dtype)",
        "log_f: float32 or float64; float16/bfloat16 widened to float32; float64 with float64 q",
        "any K, V (Triton: K, V <= 256)",
        "HQ a multiple of H: 1:1 to MQA (HQ:1)",
        "any T",
        f"B * T * HQ * D up to {MAX_ELEMENTS:,}",
        "any number (B = 1)",
    ),
    Accepts(
        "s4d",
        "interdomain_s4d, s4d_pairs",
        "bfloat16, float16, float32, float64 (one dtype)",
        "lam, b, c: float32 or float64 (re, im) pairs",
        "features R and values V: any",
        "one state per head",
        "chunks of 64 tokens (Triton)",
        "any that fits the device",
        "any number (B = 1)",
    ),
    Accepts(
        "legs",
        "interdomain_legs",
        "bfloat16, float16, float32, float64 (one dtype)",
        "none (M basis functions)",
        "features R and values V: any",
        "one state per head",
        "chunks of 64 tokens (Triton)",
        "any that fits the device",
        f"any number (Triton: sequences x heads <= {MAX_SEQUENCE_HEADS:,})",
    ),
    Accepts(
        "paged",
        "paged FPA session (decode, decode_step)",
        "bfloat16, float16, float32, float64 (one dtype)",
        "field, level, minima: float32 or float64",
        "any dk, dv",
        "HQ a multiple of H: 1:1 to MQA (HQ:1)",
        "1 to 16 positions per step (longer prompts: blocks of 16)",
        "pages of the pool that fits the device",
        "rows of the session",
    ),
)


@dataclass(frozen=True)
class Eager:
    """A corner no Triton kernel serves on CUDA: the families, the q/k/v dtypes and per-token
    scalar dtypes it covers ("*": any), and why."""

    families: tuple[str, ...]
    qkv: tuple[str, ...]
    scalars: tuple[str, ...]
    reason: str


_NARROW = ("bfloat16", "float16", "float32")

EAGER_ON_CUDA = (
    Eager(
        ("fpa", "fox"),
        ("float64",),
        ("*",),
        "float64 q, k, v: Triton 3.6 compiles no float64 tl.dot with a float64 accumulator, "
        "and on 3.9 the FPA dq kernel asks 313,088 B of shared memory at D = 64 (232,448 B a "
        "block)",
    ),
    Eager(
        ("fpa", "fox"),
        _NARROW,
        ("float64",),
        "a float64 field with 16-bit or float32 q: the forward's float64 accumulator does not "
        "compile ('Unsupported mma result type' with float16), and FPA dq asks 265,728 B of "
        "shared memory with float32 q",
    ),
)


def route(
    family: str,
    qkv: str,
    scalars: str = "float32",
    *,
    head_dim: int = 0,
    sequences: int = 1,
    heads: int = 1,
) -> tuple[str, str]:
    """("triton", "") when a Triton kernel serves this call on CUDA, else ("eager", the
    reason). ``head_dim``: the widest of K and V; ``sequences``: packed sequences (1 without
    cu_seqlens); ``heads``: the state heads of an Interdomain call."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")
    qkv, scalars = _name(qkv), _name(scalars)
    for row in EAGER_ON_CUDA:
        if (
            family in row.families
            and (qkv in row.qkv or "*" in row.qkv)
            and (scalars in row.scalars or "*" in row.scalars)
        ):
            return "eager", row.reason
    if family in ("fpa", "fox") and head_dim > MAX_HEAD_DIM:
        return "eager", f"head dim {head_dim} > {MAX_HEAD_DIM}, the Triton kernels' widest"
    if family == "legs" and sequences * heads > MAX_SEQUENCE_HEADS:
        return "eager", (
            f"{sequences:,} packed sequences x {heads} heads > {MAX_SEQUENCE_HEADS:,}: LegS's "
            "position programs would pass grid axis z's 65,535"
        )
    return "triton", ""


def markdown() -> str:
    """The table as the docs print it (docs/api/envelope.md)."""
    head = "| op | q, k, v | per-token scalars | head dims | GQA | chunk | size | packed |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for a in ACCEPTS:
        lines.append(
            f"| `{a.op}` | {a.qkv} | {a.scalars} | {a.head_dims} | {a.gqa} | {a.chunk} | "
            f"{a.size} | {a.sequences} |"
        )
    lines += ["", "| ops | q, k, v | per-token scalars | on CUDA | why |", "|---|---|---|---|---|"]
    for e in EAGER_ON_CUDA:
        ops = ", ".join(e.families)
        lines.append(
            f"| {ops} | {', '.join(e.qkv)} | {', '.join(e.scalars)} | eager twin | {e.reason} |"
        )
    return "\n".join(lines)
