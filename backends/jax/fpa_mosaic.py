"""Mosaic GPU kernels for FPA and FoX (Pallas' supported GPU backend from JAX 0.11).

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
falls back on the Pallas or XLA path). The backward is two kernels, as in ``fpa_pallas``: dq with
the query side of the field cotangent (FPA: row sums, one gap sum and argmin per key block
stored at its lane of a shared-memory vector, W on the diagonal tile; FoX: row sums), and dk, dv
with the key side, each tile of that sweep computed transposed (keys on rows) so that p^T and
G^T are wgmma's register operand; q^T, k^T, v^T and do^T are transposed once in XLA (the
interpreter has no transposed shared-memory operands). Every kernel double-buffers its
per-tile TMA copies (the next tile's copies are issued after the current tile's first
product); the dkv kernel stages dk and dv through one float32 buffer when their widths agree,
so that D = 128 fits in shared memory. On CPU the kernels run under Mosaic
GPU's interpreter (``interpret=True``, which simulates shared memory, TMA, barriers and wgmma,
with its race detector on); that interpreter is private API in JAX 0.10 and 0.11
(``jax._src.pallas.mosaic_gpu.interpret``), imported only when asked for.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..tile_sizes import JAX_BLOCK
from .blockwise import Partials, Penalties

# rows of a wgmma tile (one warpgroup), and the positions of a key block: the table's 64
BLOCK = JAX_BLOCK["mosaic"]
NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def unavailable() -> str | None:
    """Why the Mosaic GPU kernels cannot be used with the installed JAX, or None."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as exc:  # e.g. absl-py missing (Mosaic GPU imports it)
        return f"jax.experimental.pallas.mosaic_gpu does not import: {exc}"
    return None


# Hopper's shared memory per block (227 KiB), less room for Mosaic GPU's own scratch (reductions,
# barriers, the alignment of swizzled buffers).
SHARED_BYTES = 227 * 1024 - 8 * 1024


def shared_bytes(dk: int, dv: int, nb: int) -> int:
    """Shared memory of the largest of the three kernels (forward, dq, dkv) for head dims dk, dv
    and nb key blocks (the dq kernel keeps one gap sum and argmin per key block)."""
    dkp, dvp, bs = _round_up(dk, 64), _round_up(dv, 64), BLOCK
    half, word = 2 * bs, 4 * bs  # bytes of a 16-bit and of a float32 row of 64 entries
    forward = half * (dkp + 2 * dkp + 2 * dvp + bs) + word * (dvp + 1)
    dq = half * (dkp + dvp + 2 * (2 * dkp + dvp) + bs) + word * (dkp + 1 + bs) + 8 * _lanes(nb)
    staging = dkp if dkp == dvp else dkp + dvp  # dk's float32 staging serves dv of its width
    dkv = half * (dkp + dvp + 2 * (2 * dkp + 2 * dvp) + bs) + word * (staging + 2)
    return max(forward, dq, dkv)


def supports(
    q_dtype: jnp.dtype, ct: jnp.dtype, bs: int, dk: int = 64, dv: int = 64, T: int = BLOCK
) -> str | None:
    """Why these inputs cannot take the Mosaic GPU kernels, or None."""
    if jnp.dtype(q_dtype) not in NARROW:
        return f"the Mosaic GPU kernels take bfloat16 or float16 inputs, got {q_dtype}"
    if jnp.dtype(ct) != jnp.float32:
        return f"the Mosaic GPU kernels take float32 per-token scalars, got {ct}"
    if bs != BLOCK:
        return f"the Mosaic GPU kernels use tiles of {BLOCK} positions, got {bs}"
    need = shared_bytes(dk, dv, -(-T // BLOCK))
    if need > SHARED_BYTES:
        return (
            f"head dims {dk}, {dv} at T = {T} need {need} bytes of shared memory per block, "
            f"more than the {SHARED_BYTES} the Mosaic GPU kernels budget on Hopper"
        )
    return unavailable()


def _lanes(nb: int) -> int:
    """Lanes of the per-key-block gap sums: a power of two, at least 4 (16-byte TMA rows)."""
    return max(4, 1 << max(nb - 1, 0).bit_length())


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _swizzle(dtype: Any) -> tuple[Any, ...]:
    """Shared-memory transforms of a 2-D tile of ``dtype``: tiles of 8 rows of 128 bytes (64
    16-bit or 32 float32 elements), swizzled 128 bytes; wgmma's operands need them, and JAX
    0.12's Mosaic GPU needs them on the float32 tiles registers are stored into too (without,
    it finds no store free of bank conflicts: TransferPlanDerivationError)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    columns = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(128))


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
    """Mosaic GPU's interpreter, with its race detector on (shared memory written by a TMA copy
    while a product may still read it, barriers completed twice before a wait)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams(detect_races=True)


class _Tile:
    """What every kernel here does on 64 x 64 tiles: loads into the wgmma accumulator's layouts,
    broadcasts of row and column vectors, double-buffered TMA copies, and warpgroup matmuls.

    Under the interpreter, which has no layouts, no ``plgpu.load`` and reads wgmma's left
    operand from shared memory only, loads read the ref and a register operand goes through
    the ``a_smem`` scratch first; the arithmetic is the same.
    """

    def __init__(self, refs: dict[str, Any], a_smem: Any, barriers: Any, interpret: bool):
        from jax.experimental import pallas as pl
        from jax.experimental.pallas import mosaic_gpu as plgpu

        self.pl, self.plgpu = pl, plgpu
        self.r, self.a_smem, self.barriers, self.interpret = refs, a_smem, barriers, interpret
        self.wg = plgpu.Layout.WGMMA
        self.row_layout, self.col_layout = self.wg.reduce(1), self.wg.reduce(0)
        self.zg = lax.axis_index("zg")

    def load(self, ref: Any, idx: tuple[Any, ...], layout: Any) -> jax.Array:
        """Global memory straight into registers in a wgmma layout."""
        if self.interpret:
            return ref[idx]
        load: Callable[..., jax.Array] = self.plgpu.load  # its signature depends on the version
        if _load_takes_index():  # JAX 0.10: load(ref, idx); 0.11 deprecates idx for ref.at[idx]
            return load(ref.at[idx], (), layout=layout, optimized=False)
        return load(ref.at[idx], layout=layout, optimized=False)

    def cast(self, x: jax.Array, layout: Any) -> jax.Array:
        """A register array into a wgmma layout."""
        return x if self.interpret else self.plgpu.layout_cast(x, layout)

    def rows(self, name: str, n: jax.Array) -> jax.Array:
        """Block n of a per-position array (Z*G, Tp), one entry per row of a tile."""
        return self.load(self.r[name], (self.zg, self.pl.ds(n * BLOCK, BLOCK)), self.row_layout)

    def cols(self, name: str, n: jax.Array) -> jax.Array:
        """The same, one entry per column."""
        return self.load(self.r[name], (self.zg, self.pl.ds(n * BLOCK, BLOCK)), self.col_layout)

    def tile(self, name: str, n: jax.Array) -> jax.Array:
        """Diagonal tile n of a (Z*G, nb, bs, bs) array."""
        return self.load(self.r[name], (self.zg, n), self.wg)

    @staticmethod
    def by_row(x: jax.Array) -> jax.Array:
        return lax.broadcast_in_dim(x, (BLOCK, BLOCK), [0])

    @staticmethod
    def by_col(x: jax.Array) -> jax.Array:
        return lax.broadcast_in_dim(x, (BLOCK, BLOCK), [1])

    def ids(self, dimension: int) -> jax.Array:
        return self.cast(lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), dimension), self.wg)

    def zeros(self, width: int) -> jax.Array:
        return self.cast(jnp.zeros((BLOCK, width), jnp.float32), self.wg)

    def constant(self, value: float) -> jax.Array:
        """A row vector of one value."""
        return self.cast(jnp.full((BLOCK,), value, jnp.float32), self.row_layout)

    def issue(self, copies: list[tuple[Any, Any]], slot: jax.Array, base: int) -> None:
        """TMA copies (global view, two-buffer shared array) into buffer ``slot``, the n-th on
        barrier base + 2 n + slot."""
        for n, (src, buffers) in enumerate(copies):
            barrier = self.barriers.at[base + 2 * n + slot]
            self.plgpu.copy_gmem_to_smem(src, buffers.at[slot], barrier)

    def wait(self, n: int, slot: jax.Array, base: int) -> None:
        """Wait for the n-th copy of ``issue`` into buffer ``slot``."""
        self.plgpu.barrier_wait(self.barriers.at[base + 2 * n + slot])

    def product_of_registers(self, a: jax.Array, b_smem: Any, width: int) -> jax.Array:
        """``product`` with a a 16-bit register array in the accumulator's layout."""
        if self.interpret:
            self.a_smem[...] = a
            self.plgpu.commit_smem()
            return self.product(self.a_smem, b_smem, width)
        return self.product(a, b_smem, width)

    def product(self, a: Any, b_smem: Any, width: int) -> jax.Array:
        """a (64, k) @ b (k, width) on the tensor cores, float32 accumulators; a in shared
        memory (or, from ``product_of_registers``, in registers)."""
        plgpu = self.plgpu

        def body(acc_ref: Any) -> jax.Array:
            plgpu.wgmma(acc_ref, a, b_smem)
            return acc_ref[...]

        return self.pl.run_scoped(body, plgpu.ACC((BLOCK, width), jnp.float32))

    def segment_mask(self, rows_block: jax.Array, cols_block: jax.Array) -> jax.Array | None:
        if "seg" not in self.r:
            return None
        return self.by_row(self.rows("seg", rows_block)) == self.by_col(
            self.cols("seg", cols_block)
        )


def _forward_kernel(
    *refs: Any, names: tuple[str, ...], kind: str, scale: float, G: int, interpret: bool
) -> None:
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    o_ref, lse_ref = refs[n_in : n_in + 2]
    q_smem, kt_smem, v_smem, p_smem, o_smem, lse_smem, barriers = refs[n_in + 2 :]
    t = _Tile(r, p_smem, barriers, interpret)
    bs, zg = BLOCK, t.zg
    i = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = q_smem.dtype

    # Two buffers for k^T and v: while step s multiplies key block i - s, the TMA brings in
    # block i - s - 1 (issued once every warp has passed step s's first product, so the
    # buffer it overwrites, read at step s - 1, is free). Barriers: q 0; k^T 1, 2; v 3, 4.
    def keys(j: jax.Array) -> list[tuple[Any, Any]]:
        rows = pl.ds(j * bs, bs)
        return [(r["kt"].at[z, :, rows], kt_smem), (r["v"].at[z, rows], v_smem)]

    def logits_of(step: jax.Array) -> jax.Array:
        """q k^T of step's key block; then the next block's copies are issued."""
        slot = lax.rem(step, jnp.array(2, step.dtype))
        t.wait(0, slot, base=1)
        logits = scale * t.product(q_smem, kt_smem.at[slot], bs)

        @pl.when(step < i)
        def _prefetch() -> None:
            t.issue(keys(i - step - 1), 1 - slot, base=1)

        return logits

    def fold(
        step: jax.Array, logits: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The online softmax over one more key block (FlashAttention-2)."""
        slot = lax.rem(step, jnp.array(2, step.dtype))
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - t.by_row(m_new))
        l = l * correction + jnp.sum(p, axis=1)
        t.wait(1, slot, base=1)
        pv = t.product_of_registers(p.astype(dtype), v_smem.at[slot], acc.shape[1])  # p rounded
        return m_new, l, acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

    plgpu.copy_gmem_to_smem(r["q"].at[zg, pl.ds(i * bs, bs)], q_smem, barriers.at[0])
    first = jnp.zeros((), jnp.int32)
    t.issue(keys(i), first, base=1)
    prefix = t.rows("prefix", i)
    plgpu.barrier_wait(barriers.at[0])

    # The diagonal tile: causal, penalty from the in-block pieces.
    logits = logits_of(first)
    diag = t.tile("diag", i)
    if kind == "fpa":
        penalty = jnp.maximum(0.0, t.by_col(t.cols("level", i)) - diag)  # (F2)
    else:
        penalty = diag
    mask = t.ids(1) <= t.ids(0)
    seg = t.segment_mask(i, i)
    mask = mask if seg is None else mask & seg
    logits = jnp.where(mask, logits - penalty, -jnp.inf)  # (F3)
    m = jnp.max(logits, axis=1)  # the diagonal itself is never masked
    m, l, acc = fold(first, logits, m, jnp.zeros_like(m), t.zeros(o_smem.shape[1]))
    gap = t.constant(jnp.inf if kind == "fpa" else 0.0)

    def key_block(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, l, acc, gap = carry
        j = i - step  # from the diagonal outward
        logits = logits_of(step)
        suffix = t.by_col(t.cols("suffix", j))
        if kind == "fpa":
            low = jnp.minimum(jnp.minimum(suffix, t.by_row(gap)), t.by_row(prefix))  # (F1)
            penalty = jnp.maximum(0.0, t.by_col(t.cols("level", j)) - low)  # (F2)
        else:
            penalty = suffix + t.by_row(gap) + t.by_row(prefix)  # (F6)
        logits = logits - penalty
        seg = t.segment_mask(i, j)
        if seg is not None:
            logits = jnp.where(seg, logits, -jnp.inf)
        m, l, acc = fold(step, logits, m, l, acc)
        stat = t.rows("stat", j)  # the block's minimum (fpa) or decay sum (fox), on every row
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
    reason = supports(q.dtype, ct, bs, dk, dv, nb * bs)
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
    swizzle = _swizzle(dtype)
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
            plgpu.SMEM((2, dkp, bs), dtype, transforms=swizzle),  # k^T, two buffers
            plgpu.SMEM((2, bs, dvp), dtype, transforms=swizzle),  # v, two buffers
            plgpu.SMEM((bs, bs), dtype, transforms=swizzle),  # p (interpreter only)
            plgpu.SMEM((bs, dvp), jnp.float32, transforms=_swizzle(jnp.float32)),  # o
            plgpu.SMEM((bs,), jnp.float32),  # lse
            plgpu.Barrier(num_barriers=5),
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


# backward


def _dq_kernel(
    *refs: Any, names: tuple[str, ...], kind: str, scale: float, G: int, nbp: int, interpret: bool
) -> None:
    """dq and the query side of the field cotangent for one query block: key blocks i, i-1,
    ..., 0. fox: the row sums of G. fpa: the row sums of W whose argmin lies in [i0, i], the
    gap sums with their argmins (one per key block j, stored at lane j), and W on the diagonal
    tile (spec section 6, as ``fpa_pallas``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in, n_out = len(names), (5 if kind == "fpa" else 2)
    r = dict(zip(names, refs[:n_in], strict=True))
    outs = refs[n_in : n_in + n_out]
    q_smem, do_smem, kt_smem, vt_smem, k_smem, a_smem, dq_smem, row_smem = refs[
        n_in + n_out : n_in + n_out + 8
    ]
    extra = refs[n_in + n_out + 8 : -1]  # fpa: W, gap sums, gap argmins
    barriers = refs[-1]
    t = _Tile(r, a_smem, barriers, interpret)
    bs, zg = BLOCK, t.zg
    i = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = q_smem.dtype

    # k^T, v^T and k of key block i - s in two buffers, as in the forward: barriers q 0, do 1,
    # then 2 + 2 n + slot for the n-th of the three.
    def keys(j: jax.Array) -> list[tuple[Any, Any]]:
        rows = pl.ds(j * bs, bs)
        return [
            (r["kt"].at[z, :, rows], kt_smem),
            (r["vt"].at[z, :, rows], vt_smem),
            (r["k"].at[z, rows], k_smem),
        ]

    rows_i = pl.ds(i * bs, bs)
    plgpu.copy_gmem_to_smem(r["q"].at[zg, rows_i], q_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(r["do"].at[zg, rows_i], do_smem, barriers.at[1])
    first = jnp.zeros((), jnp.int32)
    t.issue(keys(i), first, base=2)
    prefix, lse, delta = t.rows("prefix", i), t.rows("lse", i), t.rows("delta", i)
    plgpu.barrier_wait(barriers.at[0])
    plgpu.barrier_wait(barriers.at[1])

    def grads(step: jax.Array, penalty: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
        slot = lax.rem(step, jnp.array(2, step.dtype))
        t.wait(0, slot, base=2)
        logits = scale * t.product(q_smem, kt_smem.at[slot], bs) - penalty

        @pl.when(step < i)
        def _prefetch() -> None:
            t.issue(keys(i - step - 1), 1 - slot, base=2)

        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        p = jnp.exp(logits - t.by_row(lse))  # (F4)
        t.wait(1, slot, base=2)
        g = p * (t.product(do_smem, vt_smem.at[slot], bs) - t.by_row(delta))  # (G1), (G4)
        t.wait(2, slot, base=2)
        dq = t.product_of_registers(g.astype(dtype), k_smem.at[slot], dq_smem.shape[1])
        return g, dq

    mask = t.ids(1) <= t.ids(0)
    seg = t.segment_mask(i, i)
    mask = mask if seg is None else mask & seg
    if kind == "fpa":
        w_smem, gap_sum_smem, gap_arg_smem = extra
        low, level = t.tile("diag", i), t.by_col(t.cols("level", i))
        g, dq = grads(first, jnp.maximum(0.0, level - low), mask)  # (F2)
        below = t.ids(1) < t.ids(0)
        w_smem[...] = jnp.where((level >= low) & below, g, 0.0)  # W = G active, j < i (G2)

        def clear(n: jax.Array, carry: int) -> int:
            gap_sum_smem[n] = jnp.zeros((), jnp.float32)
            gap_arg_smem[n] = jnp.zeros((), jnp.int32)
            return carry

        lax.fori_loop(0, nbp, clear, 0)
        no_arg = t.cast(jnp.zeros((bs,), jnp.int32), t.row_layout)
        carry = (dq, t.constant(0.0), t.constant(jnp.inf), no_arg)

        def key_block(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq, row, gap, gap_arg = carry
            j = i - step
            suffix, level = t.by_col(t.cols("suffix", j)), t.by_col(t.cols("level", j))
            low = jnp.minimum(jnp.minimum(suffix, t.by_row(gap)), t.by_row(prefix))  # (F1)
            g, dq_j = grads(step, jnp.maximum(0.0, level - low), t.segment_mask(i, j))
            w = jnp.where(level >= low, g, 0.0)  # (G2) active
            # (G3): the latest argmin of (j, i] lies in B, in the gap, or in A (ties: later)
            in_b = t.by_row(prefix) <= jnp.minimum(suffix, t.by_row(gap))
            in_gap = jnp.logical_not(in_b) & (t.by_row(gap) <= suffix)
            row = row + jnp.sum(jnp.where(in_b, w, 0.0), axis=1)
            gap_sum_smem[j] = jnp.sum(jnp.sum(jnp.where(in_gap, w, 0.0), axis=1))
            gap_arg_smem[j] = jnp.max(gap_arg)  # the same on every row
            block_min, block_arg = t.rows("stat", j), t.rows("block_arg", j)
            lower = block_min < gap  # ties keep the later position
            gap_arg = jnp.where(lower, block_arg, gap_arg)
            return dq + dq_j, row, jnp.where(lower, block_min, gap), gap_arg

        dq, row, _, _ = lax.fori_loop(1, i + 1, key_block, carry)
    else:
        g, dq = grads(first, t.tile("diag", i), mask)

        def fox_block(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq, row, gap = carry
            j = i - step
            penalty = t.by_col(t.cols("suffix", j)) + t.by_row(gap) + t.by_row(prefix)  # (F6)
            g, dq_j = grads(step, penalty, t.segment_mask(i, j))
            return dq + dq_j, row + jnp.sum(g, axis=1), gap + t.rows("stat", j)

        fox_carry = (dq, jnp.sum(g, axis=1), t.constant(0.0))
        dq, row, _ = lax.fori_loop(1, i + 1, fox_block, fox_carry)
    dq_smem[...] = dq
    row_smem[...] = row
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, outs[0].at[zg, rows_i])
    plgpu.copy_smem_to_gmem(row_smem, outs[1].at[zg, rows_i])
    if kind == "fpa":
        plgpu.copy_smem_to_gmem(w_smem, outs[2].at[zg, i])
        plgpu.copy_smem_to_gmem(gap_sum_smem, outs[3].at[zg, i])
        plgpu.copy_smem_to_gmem(gap_arg_smem, outs[4].at[zg, i])
    plgpu.wait_smem_to_gmem(0)


def _dkv_kernel(
    *refs: Any, names: tuple[str, ...], kind: str, scale: float, G: int, nb: int, interpret: bool
) -> None:
    """dk, dv (per query head) and the key side of the field cotangent for one key block:
    query blocks j, j+1, ..., nb-1, each tile computed transposed (keys on rows) so that G^T and
    p^T are the left operands of the products. fox: the column sums of G. fpa: the column sums
    of W whose argmin lies in (j, j1], and all column sums of W (for dlevel)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in, n_out = len(names), (4 if kind == "fpa" else 3)
    r = dict(zip(names, refs[:n_in], strict=True))
    outs = refs[n_in : n_in + n_out]
    (k_smem, v_smem, qt_smem, q_smem, dot_smem, do_smem, a_smem, col_smem) = refs[
        n_in + n_out : n_in + n_out + 8
    ]
    # float32 staging of dk and dv (one buffer for both when their widths agree), then fpa's
    # column sums of W
    extra = refs[n_in + n_out + 8 : -1]
    n_stage = len(extra) - (1 if kind == "fpa" else 0)
    dk_smem, dv_smem = extra[0], extra[n_stage - 1]
    barriers = refs[-1]
    t = _Tile(r, a_smem, barriers, interpret)
    bs, zg = BLOCK, t.zg
    j = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = k_smem.dtype

    # q^T, q, do^T and do of query block j + s in two buffers, as in the forward: barriers k 0,
    # v 1, then 2 + 2 n + slot for the n-th of the four.
    def queries(i: jax.Array) -> list[tuple[Any, Any]]:
        rows = pl.ds(i * bs, bs)
        return [
            (r["qt"].at[zg, :, rows], qt_smem),
            (r["q"].at[zg, rows], q_smem),
            (r["dot"].at[zg, :, rows], dot_smem),
            (r["do"].at[zg, rows], do_smem),
        ]

    plgpu.copy_gmem_to_smem(r["k"].at[z, pl.ds(j * bs, bs)], k_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(r["v"].at[z, pl.ds(j * bs, bs)], v_smem, barriers.at[1])
    t.issue(queries(j), jnp.zeros((), jnp.int32), base=2)
    suffix = t.by_row(t.rows("suffix", j))
    plgpu.barrier_wait(barriers.at[0])
    plgpu.barrier_wait(barriers.at[1])

    def grads(i: jax.Array, penalty: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
        step = i - j
        slot = lax.rem(step, jnp.array(2, step.dtype))
        t.wait(0, slot, base=2)
        logits = scale * t.product(k_smem, qt_smem.at[slot], bs) - penalty  # (keys, queries)

        @pl.when(i + 1 < nb)
        def _prefetch() -> None:
            t.issue(queries(i + 1), 1 - slot, base=2)

        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        p = jnp.exp(logits - t.by_col(t.cols("lse", i)))  # (F4)
        t.wait(3, slot, base=2)
        dv_i = t.product_of_registers(p.astype(dtype), do_smem.at[slot], dv_smem.shape[1])
        t.wait(2, slot, base=2)
        dp = t.product(v_smem, dot_smem.at[slot], bs)
        g = p * (dp - t.by_col(t.cols("delta", i)))  # (G1), (G4)
        t.wait(1, slot, base=2)
        dk_i = t.product_of_registers(g.astype(dtype), q_smem.at[slot], dk_smem.shape[1])
        return g, dk_i, dv_i

    mask = t.ids(1) >= t.ids(0)  # query >= key
    seg = t.segment_mask(j, j)
    mask = mask if seg is None else mask & seg
    if kind == "fpa":
        col_w_smem = extra[-1]
        low, level = t.tile("diagt", j), t.by_row(t.rows("level", j))
        g, dk, dv = grads(j, jnp.maximum(0.0, level - low), mask)  # (F2)
        below = t.ids(1) > t.ids(0)  # key < query
        col_w = jnp.sum(jnp.where((level >= low) & below, g, 0.0), axis=1)  # W, (G2)
        carry = (dk, dv, t.constant(0.0), col_w, t.constant(jnp.inf))

        def query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dk, dv, col, col_w, gap = carry
            prefix = t.by_col(t.cols("prefix", i))
            low = jnp.minimum(jnp.minimum(suffix, t.by_row(gap)), prefix)  # (F1)
            g, dk_i, dv_i = grads(i, jnp.maximum(0.0, level - low), t.segment_mask(j, i))
            w = jnp.where(level >= low, g, 0.0)  # (G2) active
            in_b = prefix <= jnp.minimum(suffix, t.by_row(gap))  # (G3), ties: later
            in_gap = jnp.logical_not(in_b) & (t.by_row(gap) <= suffix)
            col = col + jnp.sum(jnp.where(in_b | in_gap, 0.0, w), axis=1)  # argmin in A
            gap = jnp.minimum(gap, t.rows("stat", i))
            return dk + dk_i, dv + dv_i, col, col_w + jnp.sum(w, axis=1), gap

        dk, dv, col, col_w, _ = lax.fori_loop(j + 1, nb, query_block, carry)
        col_w_smem[...] = col_w
    else:
        g, dk, dv = grads(j, t.tile("diagt", j), mask)

        def fox_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dk, dv, col, gap = carry
            penalty = suffix + t.by_row(gap) + t.by_col(t.cols("prefix", i))  # (F6)
            g, dk_i, dv_i = grads(i, penalty, t.segment_mask(j, i))
            return dk + dk_i, dv + dv_i, col + jnp.sum(g, axis=1), gap + t.rows("stat", i)

        fox_carry = (dk, dv, jnp.sum(g, axis=1), t.constant(0.0))
        dk, dv, col, _ = lax.fori_loop(j + 1, nb, fox_block, fox_carry)
    rows = pl.ds(j * bs, bs)
    col_smem[...] = col
    dk_smem[...] = scale * dk
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(col_smem, outs[2].at[zg, rows])
    if kind == "fpa":
        plgpu.copy_smem_to_gmem(col_w_smem, outs[3].at[zg, rows])
    plgpu.copy_smem_to_gmem(dk_smem, outs[0].at[zg, rows])
    plgpu.wait_smem_to_gmem(0)  # dk's staging may be dv's
    dv_smem[...] = dv
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dv_smem, outs[1].at[zg, rows])
    plgpu.wait_smem_to_gmem(0)


def backward(
    kind: str,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    pen: Penalties,
    seg: jax.Array | None,
    scale: float,
    lse: jax.Array,
    do: jax.Array,
    delta: jax.Array,
    *,
    interpret: bool,
) -> Partials:
    """Same contract as ``blockwise.backward`` (and ``fpa_pallas.backward``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    Z, G, nb, bs, dk = q.shape
    dv = v.shape[-1]
    Tp = nb * bs
    flat = lambda x: x.reshape(Z * G, Tp)  # noqa: E731
    per_block = lambda x: flat(jnp.broadcast_to(x[..., None], (*x.shape, bs)))  # noqa: E731
    if kind == "fpa":
        level, field = pen.fpa()
        assert field.block_arg is not None  # the backward's tiles carry argmins
        ct = level.dtype
        pieces = {
            "prefix": flat(field.prefix_min),
            "suffix": flat(field.suffix_min),
            "level": flat(level),
            "stat": per_block(field.block_min),
            "block_arg": per_block(field.block_arg).astype(jnp.int32),
        }
        diag = field.diag_min
    else:
        decay = pen.fox()
        ct = decay.prefix_sum.dtype
        pieces = {
            "prefix": flat(decay.prefix_sum),
            "suffix": flat(decay.suffix_sum),
            "stat": per_block(decay.block_sum),
        }
        diag = decay.diag_sum
    reason = supports(q.dtype, ct, bs, dk, dv, nb * bs)
    if reason is not None:
        raise NotImplementedError(reason)
    dtype = q.dtype
    dkp, dvp = _round_up(dk, 64), _round_up(dv, 64)
    nbp = _lanes(nb)
    qf = _pad_last(q.reshape(Z * G, Tp, dk), dkp)
    dof = _pad_last(do.reshape(Z * G, Tp, dv), dvp)
    kf = _pad_last(k.reshape(Z, Tp, dk), dkp)
    vf = _pad_last(v.reshape(Z, Tp, dv), dvp)
    common = pieces | {"lse": flat(lse), "delta": flat(delta)}
    if seg is not None:
        common["seg"] = jnp.broadcast_to(seg.reshape(1, Tp), (Z * G, Tp)).astype(jnp.int32)
    swizzle = _swizzle(dtype)
    fpa = kind == "fpa"

    def smem(*shape: int) -> Any:
        return plgpu.SMEM(shape, dtype, transforms=swizzle)

    def smem32(*shape: int) -> Any:  # a float32 tile registers are stored into
        return plgpu.SMEM(shape, jnp.float32, transforms=_swizzle(jnp.float32))

    def f32(*shape: int) -> Any:
        return jax.ShapeDtypeStruct((Z * G, *shape), jnp.float32)

    params: dict[str, Any] = {
        "grid": (Z * G, nb),
        "grid_names": ("zg", "blk"),
        "compiler_params": plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        "interpret": _interpret_params() if interpret else None,
    }
    dq_in = {
        "q": qf,
        "do": dof,
        "kt": jnp.swapaxes(kf, 1, 2),
        "vt": jnp.swapaxes(vf, 1, 2),
        "k": kf,
        "diag": diag.reshape(Z * G, nb, bs, bs),
        **common,
    }
    dq_scratch = [
        smem(bs, dkp),  # q
        smem(bs, dvp),  # do
        smem(2, dkp, bs),  # k^T, two buffers
        smem(2, dvp, bs),  # v^T, two buffers
        smem(2, bs, dkp),  # k, two buffers
        smem(bs, bs),  # G (interpreter only)
        smem32(bs, dkp),  # dq
        plgpu.SMEM((bs,), jnp.float32),  # row sums
    ]
    dq_types = [f32(Tp, dkp), f32(Tp)]
    if fpa:
        dq_scratch += [
            smem32(bs, bs),  # W on the diagonal tile
            plgpu.SMEM((nbp,), jnp.float32),  # gap sums
            plgpu.SMEM((nbp,), jnp.int32),  # gap argmins
        ]
        dq_types += [
            f32(nb, bs, bs),
            f32(nb, nbp),
            jax.ShapeDtypeStruct((Z * G, nb, nbp), jnp.int32),
        ]
    dq_out = plgpu.kernel(
        functools.partial(
            _dq_kernel,
            names=tuple(dq_in),
            kind=kind,
            scale=float(scale),
            G=G,
            nbp=nbp,
            interpret=interpret,
        ),
        out_type=tuple(dq_types),
        scratch_types=(*dq_scratch, plgpu.Barrier(num_barriers=8)),
        **params,
    )(*dq_in.values())
    dkv_in = {
        "k": kf,
        "v": vf,
        "qt": jnp.swapaxes(qf, 1, 2),
        "q": qf,
        "dot": jnp.swapaxes(dof, 1, 2),
        "do": dof,
        "diagt": jnp.swapaxes(diag, -1, -2).reshape(Z * G, nb, bs, bs),
        **common,
    }
    dkv_scratch = [
        smem(bs, dkp),  # k
        smem(bs, dvp),  # v
        smem(2, dkp, bs),  # q^T, two buffers
        smem(2, bs, dkp),  # q, two buffers
        smem(2, dvp, bs),  # do^T, two buffers
        smem(2, bs, dvp),  # do, two buffers
        smem(bs, bs),  # p^T, G^T (interpreter only)
        plgpu.SMEM((bs,), jnp.float32),  # column sums
        smem32(bs, dkp),  # dk (and dv when dv's width is dk's)
    ]
    if dvp != dkp:
        dkv_scratch.append(smem32(bs, dvp))  # dv
    dkv_types = [f32(Tp, dkp), f32(Tp, dvp), f32(Tp)]
    if fpa:
        dkv_scratch.append(plgpu.SMEM((bs,), jnp.float32))  # all column sums of W
        dkv_types.append(f32(Tp))
    dkv_out = plgpu.kernel(
        functools.partial(
            _dkv_kernel,
            names=tuple(dkv_in),
            kind=kind,
            scale=float(scale),
            G=G,
            nb=nb,
            interpret=interpret,
        ),
        out_type=tuple(dkv_types),
        scratch_types=(*dkv_scratch, plgpu.Barrier(num_barriers=10)),
        **params,
    )(*dkv_in.values())
    dq = scale * dq_out[0][..., :dk].reshape(Z, G, nb, bs, dk)
    dk_ = dkv_out[0][..., :dk].reshape(Z, G, Tp, dk).sum(1).reshape(Z, nb, bs, dk)
    dv_ = dkv_out[1][..., :dv].reshape(Z, G, Tp, dv).sum(1).reshape(Z, nb, bs, dv)
    blocked = lambda x: x.reshape(Z, G, nb, bs)  # noqa: E731
    if not fpa:
        return Partials(dq, dk_, dv_, blocked(dq_out[1]), blocked(dkv_out[2]))
    return Partials(
        dq,
        dk_,
        dv_,
        blocked(dq_out[1]),
        blocked(dkv_out[2]),
        blocked(dkv_out[3]),
        dq_out[3].reshape(Z, G, nb, nbp)[..., :nb],
        dq_out[4].reshape(Z, G, nb, nbp)[..., :nb],
        dq_out[2].reshape(Z, G, nb, bs, bs),
    )
