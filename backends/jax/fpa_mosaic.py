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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .blockwise import Partials, Penalties

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


class _Tile:
    """What every kernel here does on 64 x 64 tiles: loads into the wgmma accumulator's layouts,
    broadcasts of row and column vectors, TMA copies waited on, and warpgroup matmuls.

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

    def fetch(self, copies: list[tuple[Any, Any]], first: int = 0) -> None:
        """TMA copies (global view, shared buffer) on barriers first, first+1, ...; waited."""
        for n, (src, dst) in enumerate(copies):
            self.plgpu.copy_gmem_to_smem(src, dst, self.barriers.at[first + n])
        for n in range(len(copies)):
            self.plgpu.barrier_wait(self.barriers.at[first + n])

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

    def fetch(j: jax.Array) -> None:  # k^T and v of key block j
        t.fetch(
            [
                (r["kt"].at[z, :, pl.ds(j * bs, bs)], kt_smem),
                (r["v"].at[z, pl.ds(j * bs, bs)], v_smem),
            ],
            first=1,
        )

    def fold(
        logits: jax.Array, m: jax.Array, l: jax.Array, acc: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The online softmax over one more key block (FlashAttention-2)."""
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - t.by_row(m_new))
        l = l * correction + jnp.sum(p, axis=1)
        pv = t.product_of_registers(p.astype(dtype), v_smem, acc.shape[1])  # p rounded
        return m_new, l, acc * lax.broadcast_in_dim(correction, acc.shape, [0]) + pv

    t.fetch([(r["q"].at[zg, pl.ds(i * bs, bs)], q_smem)])
    prefix = t.rows("prefix", i)

    # The diagonal tile: causal, penalty from the in-block pieces.
    fetch(i)
    logits = scale * t.product(q_smem, kt_smem, bs)
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
    m, l, acc = fold(logits, m, jnp.zeros_like(m), t.zeros(o_smem.shape[1]))
    gap = t.constant(jnp.inf if kind == "fpa" else 0.0)

    def key_block(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, l, acc, gap = carry
        j = i - step  # from the diagonal outward
        fetch(j)
        logits = scale * t.product(q_smem, kt_smem, bs)
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
        m, l, acc = fold(logits, m, l, acc)
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


# ------------------------------------------------------------------------------ backward (FoX)


def _fox_dq_kernel(
    *refs: Any, names: tuple[str, ...], scale: float, G: int, interpret: bool
) -> None:
    """dq and the row sums of G for one query block: key blocks i, i-1, ..., 0."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    dq_ref, row_ref = refs[n_in : n_in + 2]
    q_smem, do_smem, kt_smem, vt_smem, k_smem, a_smem, dq_smem, row_smem, barriers = refs[
        n_in + 2 :
    ]
    t = _Tile(r, a_smem, barriers, interpret)
    bs, zg = BLOCK, t.zg
    i = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = q_smem.dtype
    t.fetch(
        [(r["q"].at[zg, pl.ds(i * bs, bs)], q_smem), (r["do"].at[zg, pl.ds(i * bs, bs)], do_smem)]
    )
    prefix, lse, delta = t.rows("prefix", i), t.rows("lse", i), t.rows("delta", i)

    def grads(j: jax.Array, penalty: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
        keys = pl.ds(j * bs, bs)
        t.fetch(
            [
                (r["kt"].at[z, :, keys], kt_smem),
                (r["vt"].at[z, :, keys], vt_smem),
                (r["k"].at[z, keys], k_smem),
            ],
            first=2,
        )
        logits = scale * t.product(q_smem, kt_smem, bs) - penalty
        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        p = jnp.exp(logits - t.by_row(lse))  # (F4)
        g = p * (t.product(do_smem, vt_smem, bs) - t.by_row(delta))  # (G1), (G4)
        return g, t.product_of_registers(g.astype(dtype), k_smem, dq_smem.shape[1])

    mask = t.ids(1) <= t.ids(0)
    seg = t.segment_mask(i, i)
    g, dq = grads(i, t.tile("diag", i), mask if seg is None else mask & seg)
    row = jnp.sum(g, axis=1)

    def key_block(step: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dq, row, gap = carry
        j = i - step
        penalty = t.by_col(t.cols("suffix", j)) + t.by_row(gap) + t.by_row(prefix)  # (F6)
        g, dq_j = grads(j, penalty, t.segment_mask(i, j))
        return dq + dq_j, row + jnp.sum(g, axis=1), gap + t.rows("stat", j)

    dq, row, _ = lax.fori_loop(1, i + 1, key_block, (dq, row, t.constant(0.0)))
    dq_smem[...] = dq
    row_smem[...] = row
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dq_ref.at[zg, pl.ds(i * bs, bs)])
    plgpu.copy_smem_to_gmem(row_smem, row_ref.at[zg, pl.ds(i * bs, bs)])
    plgpu.wait_smem_to_gmem(0)


def _fox_dkv_kernel(
    *refs: Any, names: tuple[str, ...], scale: float, G: int, nb: int, interpret: bool
) -> None:
    """dk, dv (per query head) and the column sums of G for one key block: query blocks j,
    j+1, ..., nb-1, each tile computed transposed (keys on rows) so that G^T and p^T are the
    left operands of the products."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n_in = len(names)
    r = dict(zip(names, refs[:n_in], strict=True))
    dk_ref, dv_ref, col_ref = refs[n_in : n_in + 3]
    (k_smem, v_smem, qt_smem, q_smem, dot_smem, do_smem, a_smem, dk_smem, dv_smem, col_smem) = refs[
        n_in + 3 : -1
    ]
    barriers = refs[-1]
    t = _Tile(r, a_smem, barriers, interpret)
    bs, zg = BLOCK, t.zg
    j = lax.axis_index("blk")
    z = lax.div(zg, jnp.array(G, zg.dtype))
    dtype = k_smem.dtype
    t.fetch([(r["k"].at[z, pl.ds(j * bs, bs)], k_smem), (r["v"].at[z, pl.ds(j * bs, bs)], v_smem)])
    suffix = t.rows("suffix", j)

    def grads(i: jax.Array, penalty: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
        queries = pl.ds(i * bs, bs)
        t.fetch(
            [
                (r["qt"].at[zg, :, queries], qt_smem),
                (r["q"].at[zg, queries], q_smem),
                (r["dot"].at[zg, :, queries], dot_smem),
                (r["do"].at[zg, queries], do_smem),
            ],
            first=2,
        )
        logits = scale * t.product(k_smem, qt_smem, bs) - penalty  # (keys, queries)
        if mask is not None:
            logits = jnp.where(mask, logits, -jnp.inf)
        p = jnp.exp(logits - t.by_col(t.cols("lse", i)))  # (F4)
        dv_i = t.product_of_registers(p.astype(dtype), do_smem, dv_smem.shape[1])
        g = p * (t.product(v_smem, dot_smem, bs) - t.by_col(t.cols("delta", i)))  # (G1), (G4)
        dk_i = t.product_of_registers(g.astype(dtype), q_smem, dk_smem.shape[1])
        return g, dk_i, dv_i

    mask = t.ids(1) >= t.ids(0)  # query >= key
    seg = t.segment_mask(j, j)
    g, dk, dv = grads(j, t.tile("diagt", j), mask if seg is None else mask & seg)
    col = jnp.sum(g, axis=1)

    def query_block(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        dk, dv, col, gap = carry
        penalty = t.by_row(suffix) + t.by_row(gap) + t.by_col(t.cols("prefix", i))  # (F6)
        g, dk_i, dv_i = grads(i, penalty, t.segment_mask(j, i))
        return dk + dk_i, dv + dv_i, col + jnp.sum(g, axis=1), gap + t.rows("stat", i)

    dk, dv, col, _ = lax.fori_loop(j + 1, nb, query_block, (dk, dv, col, t.constant(0.0)))
    dk_smem[...] = scale * dk
    dv_smem[...] = dv
    col_smem[...] = col
    plgpu.commit_smem()
    rows = pl.ds(j * bs, bs)
    plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[zg, rows])
    plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[zg, rows])
    plgpu.copy_smem_to_gmem(col_smem, col_ref.at[zg, rows])
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
    """Same contract as ``blockwise.backward``, FoX only (the FPA backward's argmin bookkeeping
    is not ported yet: NotImplementedError)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if kind != "fox":
        raise NotImplementedError("the Mosaic GPU backward covers FoX only")
    Z, G, nb, bs, dk = q.shape
    dv = v.shape[-1]
    decay = pen.fox()
    reason = supports(q.dtype, decay.prefix_sum.dtype, bs)
    if reason is not None:
        raise NotImplementedError(reason)
    dtype = q.dtype
    Tp = nb * bs
    dkp, dvp = _round_up(dk, 64), _round_up(dv, 64)
    flat = lambda x: x.reshape(Z * G, Tp)  # noqa: E731
    qf = _pad_last(q.reshape(Z * G, Tp, dk), dkp)
    dof = _pad_last(do.reshape(Z * G, Tp, dv), dvp)
    kf = _pad_last(k.reshape(Z, Tp, dk), dkp)
    vf = _pad_last(v.reshape(Z, Tp, dv), dvp)
    common = {
        "prefix": flat(decay.prefix_sum),
        "suffix": flat(decay.suffix_sum),
        "stat": flat(jnp.broadcast_to(decay.block_sum[..., None], decay.prefix_sum.shape)),
        "lse": flat(lse),
        "delta": flat(delta),
    }
    if seg is not None:
        common["seg"] = jnp.broadcast_to(seg.reshape(1, Tp), (Z * G, Tp)).astype(jnp.int32)
    swizzle = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def smem(rows: int, width: int) -> Any:
        return plgpu.SMEM((rows, width), dtype, transforms=swizzle)

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
        "diag": decay.diag_sum.reshape(Z * G, nb, bs, bs),
        **common,
    }
    dq_out, row = plgpu.kernel(
        functools.partial(
            _fox_dq_kernel, names=tuple(dq_in), scale=float(scale), G=G, interpret=interpret
        ),
        out_type=(
            jax.ShapeDtypeStruct((Z * G, Tp, dkp), jnp.float32),
            jax.ShapeDtypeStruct((Z * G, Tp), jnp.float32),
        ),
        scratch_types=(
            smem(bs, dkp),  # q
            smem(bs, dvp),  # do
            smem(dkp, bs),  # k^T
            smem(dvp, bs),  # v^T
            smem(bs, dkp),  # k
            smem(bs, bs),  # G (interpreter only)
            plgpu.SMEM((bs, dkp), jnp.float32),  # dq
            plgpu.SMEM((bs,), jnp.float32),  # row sums
            plgpu.Barrier(num_barriers=5),
        ),
        **params,
    )(*dq_in.values())
    dkv_in = {
        "k": kf,
        "v": vf,
        "qt": jnp.swapaxes(qf, 1, 2),
        "q": qf,
        "dot": jnp.swapaxes(dof, 1, 2),
        "do": dof,
        "diagt": jnp.swapaxes(decay.diag_sum, -1, -2).reshape(Z * G, nb, bs, bs),
        **common,
    }
    dk_out, dv_out, col = plgpu.kernel(
        functools.partial(
            _fox_dkv_kernel,
            names=tuple(dkv_in),
            scale=float(scale),
            G=G,
            nb=nb,
            interpret=interpret,
        ),
        out_type=(
            jax.ShapeDtypeStruct((Z * G, Tp, dkp), jnp.float32),
            jax.ShapeDtypeStruct((Z * G, Tp, dvp), jnp.float32),
            jax.ShapeDtypeStruct((Z * G, Tp), jnp.float32),
        ),
        scratch_types=(
            smem(bs, dkp),  # k
            smem(bs, dvp),  # v
            smem(dkp, bs),  # q^T
            smem(bs, dkp),  # q
            smem(dvp, bs),  # do^T
            smem(bs, dvp),  # do
            smem(bs, bs),  # p^T, G^T (interpreter only)
            plgpu.SMEM((bs, dkp), jnp.float32),  # dk
            plgpu.SMEM((bs, dvp), jnp.float32),  # dv
            plgpu.SMEM((bs,), jnp.float32),  # column sums
            plgpu.Barrier(num_barriers=6),
        ),
        **params,
    )(*dkv_in.values())
    dq = scale * dq_out[..., :dk].reshape(Z, G, nb, bs, dk)
    dk_ = dk_out[..., :dk].reshape(Z, G, Tp, dk).sum(1).reshape(Z, nb, bs, dk)
    dv_ = dv_out[..., :dv].reshape(Z, G, Tp, dv).sum(1).reshape(Z, nb, bs, dv)
    return Partials(dq, dk_, dv_, row.reshape(Z, G, nb, bs), col.reshape(Z, G, nb, bs))
