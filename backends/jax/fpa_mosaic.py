"""Mosaic GPU kernels for the FPA and FoX forward (Pallas' supported GPU backend from JAX 0.11).

One program per (head, query block of 64 rows): the block's queries in shared memory (TMA), key
blocks i, i-1, ..., 0 (diagonal first, then outward with the running gap of spec/fpa.md section
7), each one's k^T and v brought in by TMA and multiplied by warpgroup matmuls (wgmma) on the
16-bit operands with float32 accumulators; the probabilities are rounded to the input dtype
before p v, as in the Pallas (``fpa_pallas``) and torch Triton kernels. The penalty pieces come
precomputed from ``tiles`` (the same arrays the Pallas kernels read) and are loaded straight from
global memory into the wgmma accumulator's row and column layouts, so the tile arithmetic is the
one of ``tiles`` on register arrays. Same contract as ``blockwise.forward`` and
``fpa_pallas.forward``: the three produce the same o and lse.

Scope: Hopper (sm90, wgmma), bfloat16 and float16 inputs, float32 penalties, head dims padded to
multiples of 64, tiles of 64 positions; anything else raises NotImplementedError (the caller
falls back on the Pallas or XLA path). The backward is not ported yet. On CPU the kernel runs
under Mosaic GPU's interpreter (``interpret=True``, which simulates shared memory, TMA, barriers
and wgmma); that interpreter is private API in JAX 0.10 and 0.11
(``jax._src.pallas.mosaic_gpu.interpret``), imported only when asked for.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .blockwise import Penalties

BLOCK = 64  # rows of a wgmma tile (one warpgroup), and the positions of a key block
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unavailable() -> str | None:
    """Why the Mosaic GPU kernels cannot be used with the installed JAX, or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as exc:  # e.g. absl-py missing (Mosaic GPU imports it)
        return f"jax.experimental.pallas.mosaic_gpu does not import: {exc}"
    return None


def supports(q_dtype: jnp.dtype, ct: jnp.dtype, bs: int) -> str | None:
    """Why these inputs cannot take the Mosaic GPU kernels, or None."""
    if jnp.dtype(q_dtype) not in NARROW:
        return f"the Mosaic GPU kernels take bfloat16 or float16 inputs, got {q_dtype}"
    if jnp.dtype(ct) != jnp.float32:
        return f"the Mosaic GPU kernels take float32 per-token scalars, got {ct}"
    if bs != BLOCK:
        return f"the Mosaic GPU kernels use tiles of {BLOCK} positions, got {bs}"
    return unavailable()


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


@functools.cache
def _load_takes_index() -> bool:
    """Whether plgpu.load requires its index argument (JAX 0.10); JAX 0.11 makes it optional
    and deprecates it (index the ref with ``.at`` instead)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError:
        return False
    index = inspect.signature(plgpu.load).parameters.get("idx")
    return index is not None and index.default is inspect.Parameter.empty


def _interpret_params() -> Any:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _forward_kernel(
    *refs: Any, names: tuple[str, ...], kind: str, scale: float, G: int, interpret: bool
) -> None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    o_ref, lse_ref = refs[n_in : n_in + 2]
    q_smem, kt_smem, v_smem, p_smem, o_smem, lse_smem, barriers = refs[n_in + 2 :]
    bs = BLOCK
    wg = plgpu.Layout.WGMMA
    row_layout, col_layout = wg.reduce(1), wg.reduce(0)
    zg = lax.axis_index("zg")
    i = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = q_smem.dtype

    def load(ref: Any, idx: tuple[Any, ...], layout: Any) -> jax.Array:
        """Global memory straight into registers in a wgmma layout (the interpreter, which has
        no layouts and no plgpu.load, reads the ref)."""
        if interpret:
            return ref[idx]
        if _load_takes_index():  # JAX 0.10: load(ref, idx); 0.11 deprecates idx for ref.at[idx]
            return plgpu.load(ref.at[idx], (), layout=layout, optimized=False)
        return plgpu.load(ref.at[idx], layout=layout, optimized=False)

    def cast(x: jax.Array, layout: Any) -> jax.Array:  # a register array into a wgmma layout
        return x if interpret else plgpu.layout_cast(x, layout)

    def rows(name: str, n: jax.Array) -> jax.Array:  # block n of a per-position array, by row
        return load(r[name], (zg, pl.ds(n * bs, bs)), row_layout)

    def cols(name: str, n: jax.Array) -> jax.Array:  # the same, by column
        return load(r[name], (zg, pl.ds(n * bs, bs)), col_layout)

    def bcast_rows(x: jax.Array) -> jax.Array:
        return lax.broadcast_in_dim(x, (bs, bs), [0])

    def bcast_cols(x: jax.Array) -> jax.Array:
        return lax.broadcast_in_dim(x, (bs, bs), [1])

    def fetch(j: jax.Array) -> None:  # k^T and v of key block j into shared memory
        plgpu.copy_gmem_to_smem(r["kt"].at[z, :, pl.ds(j * bs, bs)], kt_smem, barriers.at[1])
        plgpu.copy_gmem_to_smem(r["v"].at[z, pl.ds(j * bs, bs)], v_smem, barriers.at[2])
        plgpu.barrier_wait(barriers.at[1])
        plgpu.barrier_wait(barriers.at[2])

    def logits_of(j: jax.Array) -> jax.Array:
        def product(acc_ref: Any) -> jax.Array:
            plgpu.wgmma(acc_ref, q_smem, kt_smem)
            return acc_ref[...]

        return scale * pl.run_scoped(product, plgpu.ACC((bs, bs), jnp.float32))

    def segment_mask(j: jax.Array) -> jax.Array | None:
        if "seg" not in r:
            return None
        return bcast_rows(rows("seg", i)) == bcast_cols(cols("seg", j))

    def fold(
        logits: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The online softmax over one more key block (FlashAttention-2)."""
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - bcast_rows(m_new))
        l = l * correction + jnp.sum(p, axis=1)
        p16 = p.astype(dtype)  # rounded to the input dtype for the second product
        if interpret:  # the interpreter's wgmma reads its operands from shared memory only
            p_smem[...] = p16
            plgpu.commit_smem()

        def product(acc_ref: Any) -> jax.Array:
            plgpu.wgmma(acc_ref, p_smem if interpret else p16, v_smem)
            return acc_ref[...]

        pv = pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))
        return m_new, l, acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

    plgpu.copy_gmem_to_smem(r["q"].at[zg, pl.ds(i * bs, bs)], q_smem, barriers.at[0])
    plgpu.barrier_wait(barriers.at[0])
    prefix = rows("prefix", i)

    # The diagonal tile: causal, penalty from the in-block pieces.
    fetch(i)
    logits = logits_of(i)
    diag = load(r["diag"], (zg, i), wg)
    if kind == "fpa":
        penalty = jnp.maximum(0.0, bcast_cols(cols("level", i)) - diag)  # (F2)
    else:
        penalty = diag
    row_ids = cast(lax.broadcasted_iota(jnp.int32, (bs, bs), 0), wg)
    col_ids = cast(lax.broadcasted_iota(jnp.int32, (bs, bs), 1), wg)
    mask = col_ids <= row_ids
    seg = segment_mask(i)
    mask = mask if seg is None else mask & seg
    logits = jnp.where(mask, logits - penalty, -jnp.inf)  # (F3)
    m = jnp.max(logits, axis=1)  # the diagonal itself is never masked
    zeros = cast(jnp.zeros((bs, o_smem.shape[1]), jnp.float32), wg)
    m, l, acc = fold(logits, m, jnp.zeros_like(m), zeros)
    empty = jnp.inf if kind == "fpa" else 0.0
    gap = cast(jnp.full((bs,), empty, jnp.float32), row_layout)

    def key_block(t: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, l, acc, gap = carry
        j = i - t  # from the diagonal outward
        fetch(j)
        logits = logits_of(j)
        suffix = bcast_cols(cols("suffix", j))
        if kind == "fpa":
            low = jnp.minimum(jnp.minimum(suffix, bcast_rows(gap)), bcast_rows(prefix))  # (F1)
            penalty = jnp.maximum(0.0, bcast_cols(cols("level", j)) - low)  # (F2)
        else:
            penalty = suffix + bcast_rows(gap) + bcast_rows(prefix)  # (F6)
        logits = logits - penalty
        seg = segment_mask(j)
        if seg is not None:
            logits = jnp.where(seg, logits, -jnp.inf)
        m, l, acc = fold(logits, m, l, acc)
        stat = rows("stat", j)  # the block's minimum (fpa) or decay sum (fox), on every row
        gap = jnp.minimum(gap, stat) if kind == "fpa" else gap + stat
        return m, l, acc, gap

    m, l, acc, _ = lax.fori_loop(1, i + 1, key_block, (m, l, acc, gap))
    o_smem[...] = acc / lax.broadcast_in_dim(l, acc.shape, [0])  # (F5)
    lse_smem[...] = m + jnp.log(l)  # (F4)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[zg, pl.ds(i * bs, bs)])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[zg, pl.ds(i * bs, bs)])
    plgpu.wait_smem_to_gmem(0)


def forward(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    *,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """Same contract as ``blockwise.forward``: o (Z, G, nb, bs, dv), lse (Z, G, nb, bs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    Z, G, nb, bs, dk = q.shape
    dv = v.shape[-1]
    if kind == "fpa":
        level, field = pen.fpa()
        ct = level.dtype
    else:
        decay = pen.fox()
        ct = decay.prefix_sum.dtype
    reason = supports(q.dtype, ct, bs)
    if reason is not None:
        raise NotImplementedError(reason)
    dtype = q.dtype
    Tp = nb * bs
    dkp, dvp = _round_up(dk, 64), _round_up(dv, 64)
    flat = lambda x: x.reshape(Z * G, Tp)  # noqa: E731
    arrays = {
        "q": _pad_last(q.reshape(Z * G, Tp, dk), dkp),
        "kt": jnp.swapaxes(_pad_last(k.reshape(Z, Tp, dk), dkp), 1, 2),  # (Z, dkp, Tp)
        "v": _pad_last(v.reshape(Z, Tp, dv), dvp),
    }
    if kind == "fpa":
        arrays |= {
            "prefix": flat(field.prefix_min),
            "suffix": flat(field.suffix_min),
            "level": flat(level),
            "stat": flat(jnp.broadcast_to(field.block_min[..., None], field.prefix_min.shape)),
            "diag": field.diag_min.reshape(Z * G, nb, bs, bs),
        }
    else:
        arrays |= {
            "prefix": flat(decay.prefix_sum),
            "suffix": flat(decay.suffix_sum),
            "stat": flat(jnp.broadcast_to(decay.block_sum[..., None], decay.prefix_sum.shape)),
            "diag": decay.diag_sum.reshape(Z * G, nb, bs, bs),
        }
    if seg is not None:
        arrays["seg"] = jnp.broadcast_to(seg.reshape(1, Tp), (Z * G, Tp)).astype(jnp.int32)
    names = tuple(arrays)
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    kernel = plgpu.kernel(
        functools.partial(
            _forward_kernel, names=names, kind=kind, scale=float(scale), G=G, interpret=interpret
        ),
        out_type=(
            jax.ShapeDtypeStruct((Z * G, Tp, dvp), jnp.float32),
            jax.ShapeDtypeStruct((Z * G, Tp), jnp.float32),
        ),
        scratch_types=(
            plgpu.SMEM((bs, dkp), dtype, transforms=swizzle),  # q
            plgpu.SMEM((dkp, bs), dtype, transforms=swizzle),  # k^T
            plgpu.SMEM((bs, dvp), dtype, transforms=swizzle),  # v
            plgpu.SMEM((bs, bs), dtype, transforms=swizzle),  # p (interpreter only)
            plgpu.SMEM((bs, dvp), jnp.float32),  # o
            plgpu.SMEM((bs,), jnp.float32),  # lse
            plgpu.Barrier(num_barriers=3),
        ),
        grid=(Z * G, nb),
        grid_names=("zg", "blk"),
        # Lane semantics, the default of JAX 0.10 (0.11 defaults to Warpgroup): the same
        # lowering on both.
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=_interpret_params() if interpret else None,
    )
    o, lse = kernel(*arrays.values())
    return o[..., :dv].reshape(Z, G, nb, bs, dv), lse.reshape(Z, G, nb, bs)
