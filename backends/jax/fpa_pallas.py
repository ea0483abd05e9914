"""Pallas kernels for the FPA and FoX forward and backward (the Triton-style GPU path).

Three kernels, each a grid over (Z, G, blocks) with one program per (head, block), FlashAttention-2
style and atomic-free:

- forward: one query block against key blocks i, i-1, ..., 0 (diagonal first, then outward with
  the running gap of spec/fpa.md section 7), online softmax; writes o and lse.
- dq: the same sweep, recomputing p from lse; writes dq and the field-cotangent partial sums of
  the query side (row sums, gap sums and their argmins, the diagonal tile's W).
- dkv: one key block against query blocks j, j+1, ..., nb-1; writes dk and dv per query head
  (summed over the GQA group afterwards) and the column sums.

The kernels only do tile arithmetic: every sequential quantity (prefix and suffix minima, the
diagonal tiles' segment minima) comes precomputed from ``tiles``; the XLA loop in ``blockwise``
is their twin and produces the same partial sums. No complex numbers, no atomics.

Precision, as in the torch Triton kernels: penalties, logits, softmax statistics and accumulators
are in the compute dtype (float32, float64 for float64 inputs). The four products (q k^T, p v in
the forward; do v^T, g k, g^T q, p^T do in the backward) take bfloat16 and float16 operands as
stored, with the probabilities p and the logit cotangents g rounded to the input dtype first, and
accumulate in float32: tensor-core matmuls on a GPU. Float32 and float64 operands keep their
precision (``Precision.HIGHEST``: no TF32).

On a GPU the kernels compile through Pallas' Triton lowering, which JAX deprecates from 0.11 (a
DeprecationWarning at every lowering, removal announced): ``triton_lowering_available`` says
whether the installed JAX has it without the deprecation, and compiling for a GPU on a later JAX
raises NotImplementedError naming the alternatives (``fpa_mosaic``, the Mosaic GPU kernels, and
the XLA loop). On CPU the kernels run with ``interpret=True`` on every JAX; autodiff never runs
through ``pallas_call`` (``fpa.py`` holds the custom_vjp).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import tiles
from .blockwise import Partials, Penalties

HIGHEST = lax.Precision.HIGHEST
# A BlockSpec's index map: grid indices (z, g, n) -> the block's index along each axis.
_IndexMap = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array | int, ...]]
# The carries of the kernels' loops over tiles.
_Online = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # online softmax: m, l, acc, gap
_DqCarry = tuple[  # dq, row, gap_sums, gap_args, gap, gap_arg (fox: gap pieces unchanged)
    jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array
]
_DkvCarry = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]  # dk, dv, col, col_w, gap


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _pad_last(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The arrays whose loads keep the input dtype: the products' operands.
_DATA = frozenset({"q", "k", "v", "do"})


def operand_dtype(data: jnp.dtype, ct: jnp.dtype) -> jnp.dtype:
    """The dtype of the products' operands: a 16-bit input dtype as stored (tensor cores), the
    compute dtype otherwise."""
    return jnp.dtype(data) if jnp.dtype(data) in NARROW else jnp.dtype(ct)


def _product(a: jax.Array, b: jax.Array, od: jnp.dtype, ct: jnp.dtype) -> jax.Array:
    """a (m, k) @ b (k, n) on od operands, accumulated in float32 (16-bit operands, default
    precision: tensor cores) or in od itself at full precision; returned in ct."""
    a, b = a.astype(od), b.astype(od)
    if od in NARROW:
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(ct)
    return jnp.dot(a, b, precision=HIGHEST, preferred_element_type=od).astype(ct)


def _last(x: jax.Array) -> jax.Array:
    """The last entry of a 1-D block, without dynamic indexing."""
    return jnp.sum(jnp.where(jnp.arange(x.shape[0]) == x.shape[0] - 1, x, 0), dtype=x.dtype)


class _Layout:
    """The arrays a kernel reads, flattened to (Z, G, Tp) / (Z, Tp, d), with their BlockSpecs."""

    def __init__(self, bs: int, Tp: int) -> None:
        self.bs, self.Tp = bs, Tp
        self.names: list[str] = []
        self.arrays: list[jax.Array] = []
        self.specs: list[pl.BlockSpec] = []

    def row_block(self, name: str, x: jax.Array) -> None:  # (Z, G, Tp[, d]) read one block of rows
        self._add(
            name, x, (None, None, self.bs, *x.shape[3:]), lambda z, g, n: (z, g, n, 0)[: x.ndim]
        )

    def full_head(self, name: str, x: jax.Array) -> None:  # (Z, G, Tp[, d]) read whole
        self._add(name, x, (None, None, *x.shape[2:]), lambda z, g, n: (z, g, 0, 0)[: x.ndim])

    def full_kv(
        self, name: str, x: jax.Array
    ) -> None:  # (Z, Tp, d) shared by the query heads of a group
        self._add(name, x, (None, *x.shape[1:]), lambda z, g, n: (z, 0, 0))

    def tile(
        self, name: str, x: jax.Array
    ) -> None:  # (Z, G, nb, bs, bs) the diagonal tile of block n
        self._add(name, x, (None, None, None, self.bs, self.bs), lambda z, g, n: (z, g, n, 0, 0))

    def whole(self, name: str, x: jax.Array) -> None:  # (Tp,) segment ids
        self._add(name, x, x.shape, lambda z, g, n: (0,))

    def _add(
        self, name: str, x: jax.Array, block: tuple[int | None, ...], index: _IndexMap
    ) -> None:
        self.names.append(name)
        self.arrays.append(x)
        self.specs.append(pl.BlockSpec(block, index))


def _flat(x: jax.Array) -> jax.Array:
    """(Z, G, nb, bs, ...) -> (Z, G, Tp, ...)."""
    return x.reshape(*x.shape[:2], x.shape[2] * x.shape[3], *x.shape[4:])


def _penalty_arrays(
    layout: _Layout, kind: str, pen: Penalties, backward: bool, rows_whole: bool
) -> None:
    """Register the per-position penalty pieces: the query side as a row block (or whole for
    the dkv kernel), the key side whole, the diagonal tile."""
    rows = layout.full_head if rows_whole else layout.row_block
    if kind == "fpa":
        level, field = pen.fpa()
        rows("prefix_min", _flat(field.prefix_min))
        layout.full_head("suffix_min", _flat(field.suffix_min))
        layout.full_head("level", _flat(level))
        layout.full_head("block_min_src", _flat(field.prefix_min))
        if backward:
            assert field.prefix_arg is not None  # the backward's tiles carry argmins
            layout.full_head("block_arg_src", _flat(field.prefix_arg))
        layout.tile("diag_min", field.diag_min)
    else:
        decay = pen.fox()
        rows("prefix_sum", _flat(decay.prefix_sum))
        layout.full_head("suffix_sum", _flat(decay.suffix_sum))
        layout.full_head("prefix_sum_all", _flat(decay.prefix_sum))
        layout.tile("diag_sum", decay.diag_sum)


def _jax_version() -> tuple[int, ...]:
    return tuple(int(part) for part in jax.__version_info__[:2])


def triton_lowering_available() -> bool:
    """Whether the installed JAX lowers Pallas kernels through Triton without a deprecation:
    JAX < 0.11 (from 0.11 every such lowering warns, and the backend is to be removed)."""
    return _jax_version() < (0, 11)


def _call(
    kernel: Callable[..., None],
    layout: _Layout,
    grid: tuple[int, ...],
    out_shape: list[jax.ShapeDtypeStruct],
    out_specs: list[pl.BlockSpec],
    interpret: bool,
    name: str,
) -> list[jax.Array]:
    compiler_params = None
    if not interpret:  # the Triton lowering, kept out of the CPU path
        if not triton_lowering_available():
            raise NotImplementedError(
                f"implementation='pallas': Pallas' Triton lowering is deprecated in JAX "
                f"{jax.__version__} (JAX >= 0.11); use implementation='mosaic' (the Mosaic GPU "
                "kernels) or 'xla' on a GPU, or interpret=True"
            )
        from jax.experimental.pallas import triton as plgpu

        compiler_params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        functools.partial(kernel, names=tuple(layout.names)),
        grid=grid,
        in_specs=layout.specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        name=name,
        compiler_params=compiler_params,
    )(*layout.arrays)


# tile helpers


class _Refs:
    """Named access to a kernel's input refs, cast on load: q, k, v and do to the operand dtype
    of the products, everything else to the compute dtype ct."""

    def __init__(
        self, names: tuple[str, ...], refs: Sequence[jax.Ref], ct: jnp.dtype, bs: int
    ) -> None:
        self.refs = dict(zip(names, refs, strict=False))
        self.ct, self.bs = jnp.dtype(ct), bs
        self.od = operand_dtype(self.refs["q"].dtype, self.ct)

    def has(self, name: str) -> bool:
        return name in self.refs

    def _cast(self, name: str, x: jax.Array) -> jax.Array:
        return x.astype(self.od if name in _DATA else self.ct)

    def block(self, name: str, n: jax.Array, cast: bool = True) -> jax.Array:
        """Block n of a whole-sequence ref (rows of a head, or keys of a kv head)."""
        x = self.refs[name][pl.ds(n * self.bs, self.bs), ...]
        return self._cast(name, x) if cast else x

    def all(self, name: str, cast: bool = True) -> jax.Array:
        x = self.refs[name][...]
        return self._cast(name, x) if cast else x

    def dot(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """a (m, k) @ b (n, k)^T, the transposed-operand product (logits, dp)."""
        return _product(a, b.T, self.od, self.ct)

    def dot_nn(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """a (m, n) @ b (n, k), a (p or g) rounded to the operand dtype first."""
        return _product(a, b, self.od, self.ct)

    def dot_tn(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """a (m, n)^T @ b (m, k), a (p or g) rounded to the operand dtype first."""
        return _product(a.T, b, self.od, self.ct)


def _segment_mask(r: _Refs, i: jax.Array, j: jax.Array) -> jax.Array | None:
    if not r.has("seg"):
        return None
    seg = r.refs["seg"]
    rows = seg[pl.ds(i * r.bs, r.bs)]
    cols = seg[pl.ds(j * r.bs, r.bs)]
    return rows[:, None] == cols[None, :]


def _diag_penalty(kind: str, r: _Refs, n: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """Penalty (and the segment minimum m for fpa) of the diagonal tile of block n."""
    if kind == "fpa":
        m = r.all("diag_min")
        return tiles.diagonal_penalty("fpa", m, r.block("level", n)), m
    return tiles.diagonal_penalty("fox", r.all("diag_sum")), None


def _offdiag_penalty(
    kind: str, r: _Refs, rows_prefix: jax.Array, j: jax.Array, gap: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
    if kind == "fpa":
        m = tiles.offdiagonal_min(rows_prefix, r.block("suffix_min", j), gap)
        return jnp.maximum(0.0, r.block("level", j)[None, :] - m), m  # (F2)
    cols = (r.block("suffix_sum", j),)
    return tiles.offdiagonal_penalty("fox", rows_prefix, cols, gap), None


def _gap_stat(kind: str, r: _Refs, n: jax.Array) -> jax.Array:
    """Block n's minimum (fpa) or decay sum (fox), the quantity the gap accumulates."""
    if kind == "fpa":
        return jnp.min(r.block("block_min_src", n))
    return _last(r.block("prefix_sum_all", n))


def _causal(bs: int, seg_mask: jax.Array | None) -> jax.Array:
    below = jnp.arange(bs)[None, :] <= jnp.arange(bs)[:, None]
    return below if seg_mask is None else below & seg_mask


def _masked(logits: jax.Array, mask: jax.Array | None) -> jax.Array:
    return logits if mask is None else jnp.where(mask, logits, -jnp.inf)


# forward


def _forward_kernel(
    *refs: jax.Ref, names: tuple[str, ...], kind: str, scale: float, bs: int, ct: jnp.dtype
) -> None:
    o_ref, lse_ref = refs[-2:]
    r = _Refs(names, refs[:-2], ct, bs)
    i = pl.program_id(2)
    q = r.all("q")  # (bs, dk)
    prefix = r.all("prefix_min" if kind == "fpa" else "prefix_sum")
    penalty, _ = _diag_penalty(kind, r, i)
    mask = _causal(bs, _segment_mask(r, i, i))
    logits = _masked(scale * r.dot(q, r.block("k", i)) - penalty, mask)  # (F3)
    m = jnp.max(logits, axis=1)
    p = jnp.exp(logits - m[:, None])
    l = jnp.sum(p, axis=1)
    acc = r.dot_nn(p, r.block("v", i))

    def key_block(t: jax.Array, carry: _Online) -> _Online:
        m, l, acc, gap = carry
        j = i - 1 - t  # from the diagonal outward
        penalty, _ = _offdiag_penalty(kind, r, prefix, j, gap)
        logits = _masked(scale * r.dot(q, r.block("k", j)) - penalty, _segment_mask(r, i, j))
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(logits - m_new[:, None])
        l = l * correction + jnp.sum(p, axis=1)
        acc = acc * correction[:, None] + r.dot_nn(p, r.block("v", j))
        return m_new, l, acc, tiles.extend_gap(kind, gap, _gap_stat(kind, r, j))

    gap = tiles.empty_gap(kind, jnp.zeros((), ct))
    m, l, acc, _ = lax.fori_loop(0, i, key_block, (m, l, acc, gap))
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)  # (F5)
    lse_ref[...] = (m + jnp.log(l)).astype(lse_ref.dtype)  # (F4)


def _prepare(
    q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None, dims: tuple[int, int]
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Flatten blocked q, k, v to (.., Tp, d) with head dims padded to powers of two."""
    dk, dv = dims
    q = _pad_last(_flat(q), dk)
    k = _pad_last(k.reshape(k.shape[0], -1, k.shape[-1]), dk)
    v = _pad_last(v.reshape(v.shape[0], -1, v.shape[-1]), dv)
    seg = None if seg is None else seg.reshape(-1)
    return q, k, v, seg


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
    Z, G, nb, bs, dk = q.shape
    dv = v.shape[-1]
    ct = tiles_dtype(pen)
    dims = (_next_pow2(dk), _next_pow2(dv))
    qf, kf, vf, segf = _prepare(q, k, v, seg, dims)
    Tp = nb * bs
    layout = _Layout(bs, Tp)
    layout.row_block("q", qf)
    layout.full_kv("k", kf)
    layout.full_kv("v", vf)
    _penalty_arrays(layout, kind, pen, backward=False, rows_whole=False)
    if segf is not None:
        layout.whole("seg", segf)
    kernel = functools.partial(_forward_kernel, kind=kind, scale=scale, bs=bs, ct=ct)
    o, lse = _call(
        kernel,
        layout,
        (Z, G, nb),
        [
            jax.ShapeDtypeStruct((Z, G, Tp, dims[1]), ct),
            jax.ShapeDtypeStruct((Z, G, Tp), ct),
        ],
        [
            pl.BlockSpec((None, None, bs, dims[1]), lambda z, g, n: (z, g, n, 0)),
            pl.BlockSpec((None, None, bs), lambda z, g, n: (z, g, n)),
        ],
        interpret,
        f"{kind}_forward",
    )
    return o[..., :dv].reshape(Z, G, nb, bs, dv), lse.reshape(Z, G, nb, bs)


def tiles_dtype(pen: Penalties) -> jnp.dtype:
    """The compute dtype: that of the penalty pieces (float32, or float64)."""
    if pen.level is not None:
        return pen.level.dtype
    return pen.fox().prefix_sum.dtype


# backward


def _tile_grads(
    r: _Refs,
    q: jax.Array,
    do: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    j: jax.Array,
    logits_fn: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """p, G and the dq contribution of key block j; logits_fn(k_j) gives the masked logits."""
    k_j = r.block("k", j)
    logits = logits_fn(k_j)
    p = jnp.exp(logits - lse[:, None])  # (F4)
    dp = r.dot(do, r.block("v", j))
    g = tiles.logit_cotangent(p, dp, delta)  # (G1), (G4)
    return p, g, r.dot_nn(g, k_j)


def _dq_kernel(
    *refs: jax.Ref,
    names: tuple[str, ...],
    kind: str,
    scale: float,
    bs: int,
    nbp: int,
    ct: jnp.dtype,
) -> None:
    if kind == "fpa":
        dq_ref, row_ref, gap_sum_ref, gap_arg_ref, diag_w_ref = refs[-5:]
        r = _Refs(names, refs[:-5], ct, bs)
    else:
        dq_ref, row_ref = refs[-2:]
        r = _Refs(names, refs[:-2], ct, bs)
    i = pl.program_id(2)
    q, do, lse, delta = r.all("q"), r.all("do"), r.all("lse"), r.all("delta")
    prefix = r.all("prefix_min" if kind == "fpa" else "prefix_sum")
    penalty, m = _diag_penalty(kind, r, i)
    mask = _causal(bs, _segment_mask(r, i, i))
    _, g, dq = _tile_grads(
        r, q, do, lse, delta, i, lambda k_j: _masked(scale * r.dot(q, k_j) - penalty, mask)
    )
    if kind == "fpa":
        assert m is not None  # fpa tiles carry their segment minimum
        below = jnp.arange(bs)[None, :] < jnp.arange(bs)[:, None]
        w = jnp.where((r.block("level", i)[None, :] >= m) & below, g, 0.0)  # active_ij, j < i
        diag_w_ref[...] = w.astype(diag_w_ref.dtype)
        row = jnp.zeros((bs,), ct)
    else:
        row = jnp.sum(g, axis=1)
    lanes = jnp.arange(nbp)

    def key_block(t: jax.Array, carry: _DqCarry) -> _DqCarry:
        dq, row, gap_sums, gap_args, gap, gap_arg = carry
        j = i - 1 - t
        penalty, m = _offdiag_penalty(kind, r, prefix, j, gap)
        seg_mask = _segment_mask(r, i, j)
        _, g, dq_j = _tile_grads(
            r, q, do, lse, delta, j, lambda k_j: _masked(scale * r.dot(q, k_j) - penalty, seg_mask)
        )
        dq = dq + dq_j
        if kind == "fpa":
            assert m is not None
            w = jnp.where(r.block("level", j)[None, :] >= m, g, 0.0)  # (G2) active
            in_b, in_gap = tiles.offdiagonal_regions(prefix, r.block("suffix_min", j), gap)
            row = row + jnp.sum(jnp.where(in_b, w, 0.0), axis=1)  # (G3) argmin in B
            here = lanes == j
            gap_sums = jnp.where(here, jnp.sum(jnp.where(in_gap, w, 0.0)), gap_sums)
            gap_args = jnp.where(here, gap_arg, gap_args)
            block_min = _gap_stat(kind, r, j)
            block_arg = _last(r.block("block_arg_src", j, cast=False))
            lower = block_min < gap  # ties keep the later position
            gap_arg = jnp.where(lower, block_arg, gap_arg)
            gap = jnp.where(lower, block_min, gap)
        else:
            row = row + jnp.sum(g, axis=1)
            gap = tiles.extend_gap(kind, gap, _gap_stat(kind, r, j))
        return dq, row, gap_sums, gap_args, gap, gap_arg

    carry = (
        dq,
        row,
        jnp.zeros((nbp,), ct),
        jnp.zeros((nbp,), jnp.int32),
        tiles.empty_gap(kind, jnp.zeros((), ct)),
        jnp.zeros((), jnp.int32),
    )
    dq, row, gap_sums, gap_args, _, _ = lax.fori_loop(0, i, key_block, carry)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    row_ref[...] = row.astype(row_ref.dtype)
    if kind == "fpa":
        gap_sum_ref[...] = gap_sums.astype(gap_sum_ref.dtype)
        gap_arg_ref[...] = gap_args


def _dkv_kernel(
    *refs: jax.Ref,
    names: tuple[str, ...],
    kind: str,
    scale: float,
    bs: int,
    nb: int,
    ct: jnp.dtype,
) -> None:
    if kind == "fpa":
        dk_ref, dv_ref, col_ref, col_w_ref = refs[-4:]
        r = _Refs(names, refs[:-4], ct, bs)
    else:
        dk_ref, dv_ref, col_ref = refs[-3:]
        r = _Refs(names, refs[:-3], ct, bs)
    j = pl.program_id(2)
    k, v = r.block("k", j), r.block("v", j)
    prefix_name = "prefix_min" if kind == "fpa" else "prefix_sum"

    def tile(
        i: jax.Array, penalty: jax.Array, mask: jax.Array | None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        q, do = r.block("q", i), r.block("do", i)
        logits = _masked(scale * r.dot(q, k) - penalty, mask)
        p = jnp.exp(logits - r.block("lse", i)[:, None])  # (F4)
        g = tiles.logit_cotangent(p, r.dot(do, v), r.block("delta", i))  # (G1), (G4)
        return g, r.dot_tn(g, q), r.dot_tn(p, do)

    penalty, m = _diag_penalty(kind, r, j)
    g, dk, dv = tile(j, penalty, _causal(bs, _segment_mask(r, j, j)))
    if kind == "fpa":
        assert m is not None  # fpa tiles carry their segment minimum
        below = jnp.arange(bs)[None, :] < jnp.arange(bs)[:, None]
        w = jnp.where((r.block("level", j)[None, :] >= m) & below, g, 0.0)
        col_w, col = jnp.sum(w, axis=0), jnp.zeros((bs,), ct)
    else:
        col_w, col = jnp.zeros((bs,), ct), jnp.sum(g, axis=0)  # fox: col_w carried, unused

    def query_block(i: jax.Array, carry: _DkvCarry) -> _DkvCarry:
        dk, dv, col, col_w, gap = carry
        rows = r.block(prefix_name, i)
        penalty, m = _offdiag_penalty(kind, r, rows, j, gap)
        g, dk_i, dv_i = tile(i, penalty, _segment_mask(r, i, j))
        if kind == "fpa":
            assert m is not None
            w = jnp.where(r.block("level", j)[None, :] >= m, g, 0.0)  # (G2) active
            col_w = col_w + jnp.sum(w, axis=0)
            in_b, in_gap = tiles.offdiagonal_regions(rows, r.block("suffix_min", j), gap)
            col = col + jnp.sum(jnp.where(in_b | in_gap, 0.0, w), axis=0)  # (G3) argmin in A
        else:
            col = col + jnp.sum(g, axis=0)
        gap = tiles.extend_gap(kind, gap, _gap_stat(kind, r, i))
        return dk + dk_i, dv + dv_i, col, col_w, gap

    gap = tiles.empty_gap(kind, jnp.zeros((), ct))
    carry = (dk, dv, col, col_w, gap)
    dk, dv, col, col_w, _ = lax.fori_loop(j + 1, nb, query_block, carry)
    dk_ref[...] = (scale * dk).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    col_ref[...] = col.astype(col_ref.dtype)
    if kind == "fpa":
        col_w_ref[...] = col_w.astype(col_w_ref.dtype)


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
    """Same contract as ``blockwise.backward``."""
    Z, G, nb, bs, dk = q.shape
    dv = v.shape[-1]
    ct = tiles_dtype(pen)
    Tp = nb * bs
    nbp = _next_pow2(nb)
    dims = (_next_pow2(dk), _next_pow2(dv))
    qf, kf, vf, segf = _prepare(q, k, v, seg, dims)
    dof = _pad_last(_flat(do), dims[1])
    lsef, deltaf = _flat(lse), _flat(delta)
    head = lambda z, g, n: (z, g, n, 0)  # noqa: E731
    row = lambda z, g, n: (z, g, n)  # noqa: E731

    # dq sweep: one query block per program
    layout = _Layout(bs, Tp)
    layout.row_block("q", qf)
    layout.row_block("do", dof)
    layout.row_block("lse", lsef)
    layout.row_block("delta", deltaf)
    layout.full_kv("k", kf)
    layout.full_kv("v", vf)
    _penalty_arrays(layout, kind, pen, backward=True, rows_whole=False)
    if segf is not None:
        layout.whole("seg", segf)
    shapes = [jax.ShapeDtypeStruct((Z, G, Tp, dims[0]), ct), jax.ShapeDtypeStruct((Z, G, Tp), ct)]
    specs = [pl.BlockSpec((None, None, bs, dims[0]), head), pl.BlockSpec((None, None, bs), row)]
    if kind == "fpa":
        shapes += [
            jax.ShapeDtypeStruct((Z, G, nb, nbp), ct),
            jax.ShapeDtypeStruct((Z, G, nb, nbp), jnp.int32),
            jax.ShapeDtypeStruct((Z, G, nb, bs, bs), ct),
        ]
        specs += [
            pl.BlockSpec((None, None, None, nbp), head),
            pl.BlockSpec((None, None, None, nbp), head),
            pl.BlockSpec((None, None, None, bs, bs), lambda z, g, n: (z, g, n, 0, 0)),
        ]
    kernel = functools.partial(_dq_kernel, kind=kind, scale=scale, bs=bs, nbp=nbp, ct=ct)
    dq_out = _call(kernel, layout, (Z, G, nb), shapes, specs, interpret, f"{kind}_backward_dq")

    # dkv sweep: one key block per program, per query head
    layout = _Layout(bs, Tp)
    for name, x in (("q", qf), ("do", dof), ("lse", lsef), ("delta", deltaf)):
        layout.full_head(name, x)
    layout.full_kv("k", kf)
    layout.full_kv("v", vf)
    _penalty_arrays(layout, kind, pen, backward=True, rows_whole=True)
    if segf is not None:
        layout.whole("seg", segf)
    shapes = [
        jax.ShapeDtypeStruct((Z, G, Tp, dims[0]), ct),
        jax.ShapeDtypeStruct((Z, G, Tp, dims[1]), ct),
        jax.ShapeDtypeStruct((Z, G, Tp), ct),
    ]
    specs = [
        pl.BlockSpec((None, None, bs, dims[0]), head),
        pl.BlockSpec((None, None, bs, dims[1]), head),
        pl.BlockSpec((None, None, bs), row),
    ]
    if kind == "fpa":
        shapes.append(jax.ShapeDtypeStruct((Z, G, Tp), ct))
        specs.append(pl.BlockSpec((None, None, bs), row))
    kernel = functools.partial(_dkv_kernel, kind=kind, scale=scale, bs=bs, nb=nb, ct=ct)
    dkv_out = _call(kernel, layout, (Z, G, nb), shapes, specs, interpret, f"{kind}_backward_dkv")

    dq = scale * dq_out[0][..., :dk].reshape(Z, G, nb, bs, dk)
    blocked = lambda x: x.reshape(Z, G, nb, bs)  # noqa: E731
    dk_ = jnp.sum(dkv_out[0][..., :dk], axis=1).reshape(Z, nb, bs, dk)  # sum over the group
    dv_ = jnp.sum(dkv_out[1][..., :dv], axis=1).reshape(Z, nb, bs, dv)
    if kind == "fpa":
        return Partials(
            dq,
            dk_,
            dv_,
            blocked(dq_out[1]),
            blocked(dkv_out[2]),
            blocked(dkv_out[3]),
            dq_out[2][..., :nb],
            dq_out[3][..., :nb],
            dq_out[4],
        )
    return Partials(dq, dk_, dv_, blocked(dq_out[1]), blocked(dkv_out[2]))
