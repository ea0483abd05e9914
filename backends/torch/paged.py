"""A paged FPA decode session (spec/fpa.md F7, F8 rows, F8 gqa, F9 rollback, F3w window).

Storage. k and v live once per kv head in a pool of fixed-size pages (``page_size`` tokens,
16 by default, as vLLM and FlashInfer page their caches); each (row, kv head) has a page table,
and its entries fill the slots of its pages in token order. The small per-entry state of (F7)
lives beside the tables, per query head: the level l_j, the running minimum m_j, the running
minimum m0_j as of the oldest step a rollback can reach, and the step at which the entry was
evicted for that head (``LIVE`` while attended). It is per row, so rows that share pages after
:meth:`PagedFPASession.select` keep their own minima; the pages themselves are never copied by a
select (reference counts), only when a row writes into a shared page (copy on write).

Freeing (the contract's budget rule, docs/decisions.md). An entry evicted at step t_e for a
query head is kept for that head while t_e >= tokens - b (b the row's rollback budget, at most
``max_rollback``); a slot is stored while any of the G query heads of its kv head keeps it (the
union rule of F8 gqa). A slot no head keeps becomes a hole; a page without a stored slot goes
back to the pool. Compaction: when a (row, kv head) spans more pages than its stored entries
need (pages up to its last held one > ceil(stored / page_size): a page's worth of holes, on held
pages or freed ones before the last), its stored entries from the first page with a hole on move
down in order, into its own pages when no other row holds them (a run of pages stays a run,
read in place by the attention), else into fresh pages (a beam's shared pages stay shared); the
pages before stay. After every call the pages held, and the page-table columns attention scans,
per (row, kv head) are at most ceil(stored / page_size): the bytes held are within one page of
the stored entries. Cost: a compaction moves the entries after the first hole, (dk + dv)
elements each; it happens once per page_size holes, so with one eviction per step it adds about
stored / page_size entry copies per step, 1 / page_size of what attention reads.

Attention over the pages is :func:`paged_attention_eager` (the twin of the Triton decode kernel
in :mod:`.triton_decode`), one block of at most ``QUERY_BLOCK`` chunk positions at a time.

Decoding without a host read (serving under CUDA graphs). :meth:`PagedFPASession.advance` plans
on the host every call (pages to allocate, entries to free). :meth:`PagedFPASession.decode`
splits that: :meth:`~PagedFPASession.reserve` (host side, once per ``decode_reserve`` tokens)
frees what no head keeps, compacts, and allocates the pages of the next tokens of every row;
:meth:`~PagedFPASession.decode_step` (device side) writes one token per row into its reserved
slot, evicts, attends and advances the minima, in place, with no host read and no allocation of
pages, so ``torch.compile(session.decode_step, fullgraph=True)`` compiles it whole and a CUDA
graph captures it. Between reservations the pages of evicted entries stay held: the bytes held
are within one page, plus the pages reserved, of the stored entries.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from attnspec.reference.validation import nonnegative_int, positive_int, threshold

from . import checks, devices, dispatch

LIVE = torch.iinfo(torch.int64).max // 2  # the eviction step of an entry still attended
QUERY_BLOCK = 16  # chunk positions per attention block (the decode kernel's query chunk)
PAGE_SIZE = 16
DECODE_RESERVE = 64  # tokens per row that PagedFPASession.decode reserves at a time

Attention = Callable[..., Tensor]


def pages_in_place(table: Tensor) -> tuple[int, int, int]:
    """(c, b, A): the leading c page-table columns hold, for every (row, kv head) rh, the pages
    b + rh A + column of the pool (pages allocated together, as a prefill allocates them), so
    the pool read with strides covers them and they need no gather; c = 0 when none do."""
    R, H, NT = table.shape
    if NT == 0:
        return 0, 0, 0
    flat = table.reshape(R * H, NT)
    first = flat[:, 0]
    b = int(first[0])
    A = int(first[1]) - b if R * H > 1 else 0
    if b < 0 or A < 0 or not torch.equal(first, b + A * torch.arange(R * H, device=table.device)):
        return 0, 0, 0
    run = flat == first[:, None] + torch.arange(NT, device=table.device)
    return int(run.cumprod(dim=1).sum(dim=1).min()), b, A


def _pages(
    pool: Tensor,
    table: Tensor,
    in_place: tuple[int, int, int],
    name: str,
    buffers: dict[str, Tensor] | None,
) -> list[Tensor]:
    """The pages of every (row, kv head) in table order as [R, H, slots, D] parts: the columns
    in place as a strided view of the pool, the rest gathered into ``buffers[name]``."""
    R, H, NT = table.shape
    _, P, D = pool.shape
    c, b, A = in_place
    pool = pool.contiguous()
    parts = []
    if c:
        strides = (H * A * P * D, A * P * D, D, 1)
        parts.append(pool[b:].as_strided((R, H, c * P, D), strides))  # (from page b on)
    if c < NT or not parts:  # (an empty table: one empty part)
        pages = table[..., c:].clamp_min(0).flatten()
        if buffers is None:  # (compiled code: the gather is the compiler's to place)
            parts.append(pool.index_select(0, pages).view(R, H, -1, D))
            return parts
        shape = (pages.numel(), P, D)
        buf = buffers.get(name)
        if buf is None or buf.numel() < math.prod(shape) or buf.dtype != pool.dtype:
            buf = pool.new_empty(math.prod(shape) * 5 // 4)  # room to grow: faults are slow
            buffers[name] = buf
        out = buf[: math.prod(shape)].view(shape)
        parts.append(torch.index_select(pool, 0, pages, out=out).view(R, H, -1, D))
    return parts


def _infinite_where_not(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``mask``, +inf elsewhere, as 1/1 - 1 and 1/0 - 1: torch.where and masked_fill
    branch per element, ten times slower on the irregular masks that eviction makes."""
    return torch.reciprocal(mask.to(dtype)).sub_(1.0)


def paged_attention_eager(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    pos: Tensor,
    level: Tensor,
    mins: Tensor,
    evict: Tensor,
    tok: Tensor,
    field: Tensor,
    scale: float,
    buffers: dict[str, Tensor] | None = None,
    *,
    in_place: tuple[int, int, int] | None = None,
) -> Tensor:
    """(F3)-(F5) for a block of chunk positions over the row's pages, GQA by kv head.

    Args:
        q: [R, HQ, n, K] the block's queries; k_pool [NP, P, K], v_pool [NP, P, V] the pages.
        table: [R, H, NT] int64 page ids (-1: none); pos: [R, H, NT * P] int64 token of each
            slot (-1: no stored entry).
        level, mins, evict: [R, HQ, NT * P] l_j, m_j before the block (wide), eviction step.
        tok: [R, n] int64 the token index of each position (-1: absent); field: [R, HQ, n] wide.
        scale: the softmax scale.
        buffers: where pages not in place (:func:`pages_in_place`) are gathered, kept by the
            caller between calls and grown by a quarter at a time (a fresh 100 MB tensor costs
            more in page faults than the copy into it); None: a fresh gather.
        in_place: :func:`pages_in_place` of ``table`` when the caller knows it (None: read from
            the table, three host reads); with it given the function reads nothing back.

    Returns:
        o [R, HQ, n, V] in the dtype of ``mins``; 0 at absent positions.
        Key j is attended from token t iff pos_j <= t < evict_j; its depth is
        max(0, l_j - min(m_j, field over the block's tokens in (pos_j, t])) (F2).
    """
    R, HQ, n, K = q.shape
    H, wide = table.shape[1], mins.dtype
    G, S = HQ // H, pos.shape[2]
    in_place = pages_in_place(table) if in_place is None else in_place
    keys = _pages(k_pool, table, in_place, "k", buffers)  # [R, H, slots, K] each
    values = _pages(v_pool, table, in_place, "v", buffers)  # [R, H, slots, V] each
    rows = q.to(wide).reshape(R, H, G * n, K)
    logits = rows.new_empty(R, H, G * n, S)
    start = 0
    for k in keys:
        # k q^T: BLAS streams the keys by rows (on a CPU twice as fast as q k^T, a skinny product)
        kq = k.to(wide) @ rows.transpose(2, 3)  # [R, H, slots, G n]
        part = logits[..., start : start + k.shape[2]]
        if torch.compiler.is_compiling():  # (out= into a strided slice does not trace)
            part.copy_(kq.transpose(2, 3) * scale)
        else:
            torch.mul(kq.transpose(2, 3), scale, out=part)
        start += k.shape[2]
    logits = logits.view(R, H, G, n, S)
    j = pos.view(R, H, 1, S)  # the token of each slot, shared by the G query heads
    running = mins.view(R, H, G, S)
    lv, gone = level.view(R, H, G, S), evict.view(R, H, G, S)
    for p in range(n):
        t = tok[:, p].view(R, 1, 1, 1)
        # (F7) m_j <- min(m_j, phi_t) for the keys before token t
        f = field[:, :, p].view(R, H, G, 1)
        running = torch.minimum(running, f + _infinite_where_not(j < t, wide))
        depth = torch.sub(lv, running).clamp_min_(0.0)  # (F2)
        seen = ((j >= 0) & (j <= t) & (t >= 0)) & (gone > t)
        logits[:, :, :, p].sub_(depth.add_(_infinite_where_not(seen, wide)))  # (F3)
    weights = torch.softmax(logits, dim=-1).view(R, H, G * n, S)  # (F4); NaN in absent rows
    o, start = None, 0
    for v in values:  # (F5)
        part = weights[..., start : start + v.shape[2]] @ v.to(wide)
        o, start = part if o is None else o.add_(part), start + v.shape[2]
    assert o is not None
    return o.view(R, HQ, n, -1).masked_fill((tok < 0)[:, None, :, None], 0.0)


@torch.library.custom_op(
    "attnspec::paged_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor pos, Tensor level, "
    "Tensor mins, Tensor evict, Tensor tok, Tensor field, float scale, str impl) -> Tensor",
    tags=dispatch.OP_TAGS,
)
def _paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    pos: Tensor,
    level: Tensor,
    mins: Tensor,
    evict: Tensor,
    tok: Tensor,
    field: Tensor,
    scale: float,
    impl: str,
) -> Tensor:
    """The attention over pages as one node of a compiled graph: the Triton decode kernel
    (``impl="triton"``), whose launcher torch.compile does not trace, or the eager twin."""
    args = (q, k_pool, v_pool, table, pos, level, mins, evict, tok, field, scale)
    if impl == "triton":
        from .triton_decode import paged_attention_triton

        with devices.guard(q.device):
            return paged_attention_triton(*args)
    return paged_attention_eager(*args)


@_paged_attention.register_fake
def _(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    table: Tensor,
    pos: Tensor,
    level: Tensor,
    mins: Tensor,
    evict: Tensor,
    tok: Tensor,
    field: Tensor,
    scale: float,
    impl: str,
) -> Tensor:
    R, HQ, n, _ = q.shape
    return q.new_empty(R, HQ, n, v_pool.shape[2], dtype=mins.dtype)


@dataclass
class RowState:
    """Everything a row owns (page tables and per-entry state); indexed by rows on select."""

    table: Tensor  # [R, H, NT] int64 page ids, -1 none
    fill: Tensor  # [R, H] int64 slots used (holes included)
    pos: Tensor  # [R, H, S] int64 token of the slot's entry, -1 no stored entry
    level: Tensor  # [R, HQ, S] l_j
    mins: Tensor  # [R, HQ, S] m_j after the row's last token
    base: Tensor  # [R, HQ, S] m0_j: min field over (j, c], c the oldest restorable token
    evict: Tensor  # [R, HQ, S] int64 step of eviction for this head, LIVE if attended
    tokens: Tensor  # [R] int64
    budget: Tensor  # [R] int64 tokens a rollback may undo
    ring: Tensor  # [R, HQ, max(W, 1)] field of token u at u % W, for the last W tokens

    def index(self, rows: Tensor) -> RowState:
        return RowState(*(getattr(self, f.name)[rows] for f in fields(self)))


class PagedFPASession:
    """An (F8) decode session of ``rows`` rows with a paged cache; see the module docstring.

    Args:
        rows: R >= 1; heads: HQ; kv_heads: H dividing HQ; dk, dv: head dims.
        dtype: the torch dtype of q, k, v and the outputs; device: where everything lives.
        scale: the softmax scale; theta: eviction threshold > 0 (inf: none); window: (F3w) or
            None; max_rollback: the W of (F9).
        page_size: tokens per page; max_pages: the pool's size (None: grows by doubling).
        attention: the attention over pages (:func:`paged_attention_eager` or the kernel's
            launcher), same signature.

    Time per token O(S (dk + dv)) for S stored slots of its row; memory: pages held.
    """

    def __init__(
        self,
        *,
        rows: int,
        heads: int,
        kv_heads: int,
        dk: int,
        dv: int,
        dtype: torch.dtype,
        scale: float,
        theta: float = math.inf,
        window: int | None = None,
        max_rollback: int = 0,
        page_size: int = PAGE_SIZE,
        max_pages: int | None = None,
        device: torch.device | str = "cpu",
        attention: Attention = paged_attention_eager,
    ):
        R, HQ, H = (
            positive_int("rows", rows),
            positive_int("heads", heads),
            positive_int("kv_heads", kv_heads),
        )
        if HQ % H:
            raise ValueError(f"kv_heads: expected a divisor of heads={HQ}, got {H}")
        self.dk, self.dv = positive_int("dk", dk), positive_int("dv", dv)
        if dtype not in checks.QKV_DTYPES:
            raise ValueError(f"dtype: expected one of {checks.QKV_DTYPES}, got {dtype!r}")
        threshold("theta", theta)
        self.window = None if window is None else positive_int("window", window)
        self.W = nonnegative_int("max_rollback", max_rollback)
        self.P = positive_int("page_size", page_size)
        self.max_pages = None if max_pages is None else positive_int("max_pages", max_pages)
        self.scale = checks.scale(scale, self.dk)
        self.theta = float(theta)
        self.evicting = math.isfinite(self.theta) or self.window is not None
        self.HQ, self.H, self.G = HQ, H, HQ // H
        self.dtype, self.device = dtype, torch.device(device)
        self.wide = torch.float64 if dtype == torch.float64 else torch.float32
        self.attention = attention
        self._buffers: dict[str, Tensor] = {}  # the attention's scratch, kept between calls
        self.decode_reserve = DECODE_RESERVE
        self._reserved = 0  # decode steps left in the reservation (0: none)
        self._in_place = (0, 0, 0)  # pages_in_place of the reserved table
        NP = self.max_pages or 4
        self.k_pool = torch.zeros(NP, self.P, self.dk, dtype=dtype, device=self.device)
        self.v_pool = torch.zeros(NP, self.P, self.dv, dtype=dtype, device=self.device)
        self.refs = torch.zeros(NP, dtype=torch.int64, device=self.device)
        self.state = self._empty(R)

    def _empty(self, R: int) -> RowState:
        i64, dev, w = torch.int64, self.device, self.wide
        return RowState(
            table=torch.full((R, self.H, 0), -1, dtype=i64, device=dev),
            fill=torch.zeros(R, self.H, dtype=i64, device=dev),
            pos=torch.full((R, self.H, 0), -1, dtype=i64, device=dev),
            level=torch.zeros(R, self.HQ, 0, dtype=w, device=dev),
            mins=torch.zeros(R, self.HQ, 0, dtype=w, device=dev),
            base=torch.zeros(R, self.HQ, 0, dtype=w, device=dev),
            evict=torch.zeros(R, self.HQ, 0, dtype=i64, device=dev),
            tokens=torch.zeros(R, dtype=i64, device=dev),
            budget=torch.zeros(R, dtype=i64, device=dev),
            ring=torch.zeros(R, self.HQ, max(self.W, 1), dtype=w, device=dev),
        )

    @property
    def rows(self) -> int:
        return int(self.state.tokens.shape[0])

    # checks

    def _check_chunk(self, inputs: dict[str, Tensor], present: Tensor) -> int:
        R, HQ, H = self.rows, self.HQ, self.H
        if not isinstance(inputs, dict):
            raise ValueError(f"inputs: expected a dict of tensors, got {type(inputs).__name__}")
        missing = {"q", "k", "v", "field", "level"} - set(inputs)
        if missing:
            raise ValueError(f"inputs: missing {sorted(missing)}")
        # q first: the chunk's n is read from q, so a q in another layout is named as q
        q = checks.tensor("q", inputs["q"], 4, (self.dtype,), "in the session's layout and dtype")
        if (q.shape[0], q.shape[1], q.shape[3]) != (R, HQ, self.dk):
            raise ValueError(
                f"q: expected shape ({R}, {HQ}, n, {self.dk}) ((rows, heads, n, dim) of the "
                f"session, n the chunk's length), got {tuple(q.shape)}"
            )
        n = q.shape[2]
        checks.tensor("present", present, 2, (torch.bool,), "(R, n) bool")
        checks.shape("present", present, (R, n), "(rows, n of q)")
        expected = {
            "q": (R, HQ, n, self.dk),
            "k": (R, H, n, self.dk),
            "v": (R, H, n, self.dv),
            "field": (R, HQ, n),
            "level": (R, HQ, n),
        }
        for name, shape in expected.items():
            x = inputs[name]
            dtypes = (self.dtype,) if name in "qkv" else checks.WIDE_DTYPES + checks.QKV_DTYPES
            checks.tensor(name, x, len(shape), dtypes, "in the session's layout and dtype")
            checks.shape(name, x, shape, "(rows, heads, n, dim) of the session")
            if x.device != self.device:
                raise ValueError(f"{name}: expected device {self.device}, got {x.device}")
        if present.device != self.device:
            raise ValueError(f"present: expected device {self.device}, got {present.device}")
        if checks.values_checked():  # one host read for both
            field, level = inputs["field"], inputs["level"]
            if not bool(torch.isfinite(field).all() & torch.isfinite(level).all()):
                checks.finite("field", field)
                checks.finite("level", level)
        return n

    # pages

    def free_pages(self) -> int:
        """Pages of the pool not held by any row."""
        return int((self.refs == 0).sum())

    def _allocate(self, count: int) -> Tensor:
        free = torch.nonzero(self.refs == 0).flatten()
        if free.numel() < count:  # only a growing pool gets here (checked before)
            NP = self.refs.numel()
            grow = max(NP, count - free.numel())
            self.k_pool = torch.cat(
                [self.k_pool, self.k_pool.new_zeros(grow, *self.k_pool.shape[1:])]
            )
            self.v_pool = torch.cat(
                [self.v_pool, self.v_pool.new_zeros(grow, *self.v_pool.shape[1:])]
            )
            self.refs = torch.cat([self.refs, self.refs.new_zeros(grow)])
            free = torch.nonzero(self.refs == 0).flatten()
        ids = free[:count]
        self.refs[ids] = 1
        return ids

    def _recount(self) -> None:
        table = self.state.table
        held = table[table >= 0]
        self.refs = torch.bincount(held, minlength=self.refs.numel())

    def _widen(self, S: int) -> None:
        """Slots (and table columns) for at least S entries per (row, kv head)."""
        st, P = self.state, self.P
        NT = -(-S // P)
        extra = NT - st.table.shape[2]
        if extra <= 0:
            return

        def pad(x: Tensor, by: int, value: float) -> Tensor:
            return torch.cat([x, x.new_full((*x.shape[:2], by), value)], dim=2)

        self.state = replace(
            st,
            table=pad(st.table, extra, -1),
            pos=pad(st.pos, extra * P, -1),
            level=pad(st.level, extra * P, 0.0),
            mins=pad(st.mins, extra * P, math.inf),
            base=pad(st.base, extra * P, math.inf),
            evict=pad(st.evict, extra * P, LIVE),
        )

    def _pages_needed(self, count: Tensor) -> tuple[Tensor, Tensor]:
        """Table cells [R, H, NT'] written by appending ``count`` [R] entries: new pages and
        shared pages to copy first."""
        st, P = self.state, self.P
        fill = st.fill
        top = fill + count[:, None]
        NT = max(int(-(-int(top.max()) // P)) if top.numel() else 0, st.table.shape[2])
        table = torch.cat(
            [st.table, st.table.new_full((*st.table.shape[:2], NT - st.table.shape[2]), -1)], 2
        )
        cell = torch.arange(NT, device=self.device)
        touched = (cell >= fill[..., None] // P) & (cell * P < top[..., None])
        touched &= count[:, None, None] > 0
        fresh = touched & (table < 0)
        shared = touched & (table >= 0) & (self.refs[table.clamp_min(0)] > 1)
        return fresh, shared

    # the protocol

    def advance(self, inputs: dict[str, Tensor], present: Tensor) -> dict[str, Tensor]:
        """(F8 rows) consume a chunk: q [R, HQ, n, dk], k [R, H, n, dk], v [R, H, n, dv],
        field, level [R, HQ, n]; present [R, n] bool (False: padding).

        Returns:
            {"o": [R, HQ, n, dv]} in the session's dtype, 0 at absent positions.
        """
        n = self._check_chunk(inputs, present)
        self._reserved = 0  # (its pages are freed by the release below, or by the next one)
        R, HQ = self.rows, self.HQ
        count = present.sum(dim=1)  # [R]
        fresh, shared = self._pages_needed(count)
        need = int(fresh.sum() + shared.sum())
        if self.max_pages is not None and need > self.free_pages():
            raise ValueError(
                f"max_pages: the pool of {self.max_pages} pages has {self.free_pages()} free, "
                f"this chunk needs {need}"
            )
        o = torch.zeros(R, HQ, n, self.dv, dtype=self.dtype, device=self.device)
        if n == 0:
            return {"o": o}
        self._widen_dtype(inputs["field"])
        wide = self.wide
        field = inputs["field"].to(wide).masked_fill(~present[:, None, :], math.inf)
        level = inputs["level"].to(wide)
        st = self.state
        rank = torch.cumsum(present.to(torch.int64), dim=1) - 1  # [R, n]
        tok = torch.where(present, st.tokens[:, None] + rank, -1)  # [R, n]
        self._widen(int((st.fill + count[:, None]).max()))
        self._write(inputs["k"], inputs["v"], level, present, rank, fresh, shared)
        for p0 in range(0, n, QUERY_BLOCK):
            p1 = min(p0 + QUERY_BLOCK, n)
            q = inputs["q"][:, :, p0:p1]
            with devices.guard(q.device):
                block, updates = self._block(q, tok[:, p0:p1], field[:, :, p0:p1], self._attend)
            o[:, :, p0:p1] = block.to(self.dtype)
            self.state = replace(self.state, **updates)
        if self.evicting:  # else no entry is ever evicted, and none freed
            self._release()
        return {"o": o}

    def _widen_dtype(self, field: Tensor) -> None:
        """A float64 field makes the per-entry state float64 (from then on)."""
        if field.dtype == torch.float64 and self.wide != torch.float64:
            self.wide = torch.float64
            self.state = replace(
                self.state,
                **{f: getattr(self.state, f).double() for f in ("level", "mins", "base", "ring")},
            )

    def _attend(self, *args: Any) -> Tensor:
        """The session's attention, with the scratch buffers kept between calls."""
        return self.attention(*args, buffers=self._buffers)

    def _attend_in_graph(self, *args: Any) -> Tensor:
        """The attention of :meth:`decode_step`: reads nothing back. The eager twin with the
        reserved table's layout known (torch.compile traces and fuses it); the Triton kernel
        as one custom op (its launcher is not traced); any other attention as it is."""
        if self.attention is paged_attention_eager:
            return paged_attention_eager(*args, in_place=self._in_place)
        kernel = sys.modules.get(f"{__package__}.triton_decode")  # loaded if it is the kernel
        if kernel is not None and self.attention is kernel.paged_attention_triton:
            return _paged_attention(*args, impl="triton")
        return self.attention(*args)

    # decoding without a host read

    def reserve(self, steps: int) -> None:
        """The host side of :meth:`decode`: slots with no head keeping their entry freed (and
        the pages no row needs compacted or given back), then, for every row, the slots and
        pages of its next ``steps`` tokens (its own pages: a page shared with another row is
        copied first), so that ``steps`` calls of :meth:`decode_step` need no host read and no
        allocation. ``reserve(0)`` gives back the pages reserved and not used. Reads the state
        on the host; a later :meth:`advance`, :meth:`select`, :meth:`rollback` or
        :meth:`prefill_state` ends the reservation.
        """
        steps = nonnegative_int("steps", steps)
        self._reserved = 0
        self._release()
        fresh, shared = self._pages_needed(torch.full((self.rows,), steps, device=self.device))
        need = int(fresh.sum() + shared.sum())
        if self.max_pages is not None and need > self.free_pages():
            raise ValueError(
                f"max_pages: the pool of {self.max_pages} pages has {self.free_pages()} free, "
                f"reserving {steps} tokens a row needs {need}"
            )
        if steps:
            self._widen(int(self.state.fill.max()) + steps)
            NT = self.state.table.shape[2]
            table = self._own_pages(fresh[..., :NT], shared[..., :NT])
            self.state = replace(self.state, table=table)
        self._in_place = pages_in_place(self.state.table)
        self._reserved = steps

    def decode(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """(F8 rows) one token in every row: q [R, HQ, 1, dk], k [R, H, 1, dk], v [R, H, 1, dv],
        field, level [R, HQ, 1]. The outputs and the state of :meth:`advance` with every row
        present, but the freeing of :meth:`advance` happens at the reservations: every
        ``decode_reserve`` tokens (64) :meth:`reserve` runs on the host; between them
        :meth:`decode_step` runs on the device alone (replace it by its compiled form:
        ``session.decode_step = torch.compile(session.decode_step, fullgraph=True)``).
        Host reads per call: none in the step; the value checks of field and level in one
        read while they run (:func:`.checks.values_checked`).

        Returns:
            {"o": [R, HQ, 1, dv]} in the session's dtype.
        """
        R = self.rows
        q = inputs.get("q") if isinstance(inputs, dict) else None
        if isinstance(q, Tensor) and q.dim() == 4 and q.shape[2] != 1:
            raise ValueError(
                f"q: expected one token a row, shape {(R, self.HQ, 1, self.dk)}, got "
                f"{tuple(q.shape)} (advance takes chunks)"
            )
        self._check_chunk(inputs, torch.ones(R, 1, dtype=torch.bool, device=self.device))
        self._widen_dtype(inputs["field"])
        if self._reserved == 0:
            self.reserve(self.decode_reserve)
        self._reserved -= 1
        o = self.decode_step(
            inputs["q"], inputs["k"], inputs["v"], inputs["field"], inputs["level"]
        )
        return {"o": o}

    def decode_step(self, q: Tensor, k: Tensor, v: Tensor, field: Tensor, level: Tensor) -> Tensor:
        """The device part of :meth:`decode` (its inputs as there, checked): the token of every
        row written into its reserved slot, evictions, attention, minima, all in place on the
        session's tensors. No host read, no allocation of pages, so torch.compile compiles it
        whole (``fullgraph=True``) and a CUDA graph captures it (its tensors stay the same
        until the next :meth:`reserve`). Call it only within a reservation (:meth:`decode`
        keeps the count).

        Returns:
            o [R, HQ, 1, dv] in the session's dtype.
        """
        st, P, G, R, H = self.state, self.P, self.G, self.rows, self.H
        wide = st.mins.dtype
        slot = st.fill  # [R, H] the next slot of every (row, kv head), on a reserved page
        page = st.table.gather(2, torch.div(slot, P, rounding_mode="floor")[..., None])[..., 0]
        self.k_pool.index_put_((page, slot % P), k[:, :, 0])
        self.v_pool.index_put_((page, slot % P), v[:, :, 0])
        st.pos.scatter_(2, slot[..., None], st.tokens[:, None, None].expand(R, H, 1))
        slotq = slot.repeat_interleave(G, dim=1)[..., None]  # [R, HQ, 1]
        st.level.scatter_(2, slotq, level.to(wide))
        st.mins.scatter_(2, slotq, math.inf)  # empty segment: pi_tt = 0
        st.base.scatter_(2, slotq, math.inf)
        st.evict.scatter_(2, slotq, LIVE)
        st.fill.add_(1)
        o, updates = self._block(q, st.tokens[:, None], field.to(wide), self._attend_in_graph)
        for name, value in updates.items():
            getattr(st, name).copy_(value)
        return o.to(self.dtype)

    def _own_pages(self, fresh: Tensor, shared: Tensor) -> Tensor:
        """The page table with the cells ``fresh`` given new pages and the cells ``shared``
        given copies of their pages (copy on write)."""
        table = self.state.table.clone()
        if bool(shared.any()):
            old = table[shared]
            new = self._allocate(old.numel())
            self.k_pool[new], self.v_pool[new] = self.k_pool[old], self.v_pool[old]
            self.refs.index_add_(0, old, torch.full_like(old, -1))
            table[shared] = new
        if bool(fresh.any()):
            table[fresh] = self._allocate(int(fresh.sum()))
        return table

    def _write(
        self,
        k: Tensor,
        v: Tensor,
        level: Tensor,
        present: Tensor,
        rank: Tensor,
        fresh: Tensor,
        shared: Tensor,
    ) -> None:
        """Pages for the new entries (fresh, or copies of shared ones), then k, v and the
        per-entry state written into the slots fill + rank."""
        st, P, G = self.state, self.P, self.G
        NT = st.table.shape[2]
        table = self._own_pages(fresh[..., :NT], shared[..., :NT])
        r, p = torch.nonzero(present, as_tuple=True)  # entries in token order per row
        slot = st.fill[r] + rank[r, p, None]  # [E, H]
        h = torch.arange(self.H, device=self.device).expand_as(slot)
        rr = r[:, None].expand_as(slot)
        page = table[rr, h, slot // P]
        self.k_pool[page, slot % P] = k[rr, h, p[:, None]]
        self.v_pool[page, slot % P] = v[rr, h, p[:, None]]
        pos = st.pos  # written in place: the checks are behind us
        pos[rr, h, slot] = st.tokens[r, None] + rank[r, p, None]
        slotq = slot.repeat_interleave(G, dim=1)  # [E, HQ]
        hq = torch.arange(self.HQ, device=self.device).expand_as(slotq)
        rq = r[:, None].expand_as(slotq)
        lv, mins, base, evict = st.level, st.mins, st.base, st.evict
        lv[rq, hq, slotq] = level[rq, hq, p[:, None]]
        mins[rq, hq, slotq] = math.inf  # empty segment: pi_tt = 0
        base[rq, hq, slotq] = math.inf
        evict[rq, hq, slotq] = LIVE
        self.state = replace(
            st,
            table=table,
            pos=pos,
            level=lv,
            mins=mins,
            base=base,
            evict=evict,
            fill=st.fill + present.sum(dim=1)[:, None],
        )

    def _block(
        self, q: Tensor, tok: Tensor, field: Tensor, attention: Callable[..., Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """At most QUERY_BLOCK positions: evictions (F7, F3w), attention, then the minima, the
        budgets, the base minima and the ring of fields advanced token by token.

        Returns:
            The outputs (in the wide dtype) and the new evict, mins, base, ring, tokens and
            budget of the state (the caller stores them).
        """
        st, R, H, G = self.state, self.rows, self.H, self.G
        S = st.pos.shape[2]
        j = st.pos.view(R, H, 1, S)  # the token of each slot, shared by the G query heads
        evict = st.evict
        if self.evicting:
            level = st.level.view(R, H, G, S)
            for p in range(tok.shape[1]):
                t = tok[:, p].view(R, 1, 1, 1)
                hit = (level - field[:, :, p].view(R, H, G, 1)) >= self.theta  # (F2)
                if self.window is not None:
                    hit = hit | (t - j >= self.window)  # (F3w)
                hit = (hit & (t > j) & (j >= 0)).to(evict.dtype)
                # t where hit, else LIVE; an entry's eviction step is the first such t (the
                # steps it holds are LIVE or earlier tokens). Arithmetic, not torch.where,
                # which branches per element: ten times slower on the masks eviction makes.
                evict = torch.minimum(evict, (LIVE - hit * (LIVE - t)).view_as(evict))
        o = attention(
            q,
            self.k_pool,
            self.v_pool,
            st.table,
            st.pos,
            st.level,
            st.mins,
            evict,
            tok,
            field,
            self.scale,
        )
        mins, base = st.mins.view(R, H, G, S), st.base.view(R, H, G, S)
        ring, tokens, budget = st.ring.clone(), st.tokens.clone(), st.budget.clone()
        for p in range(tok.shape[1]):
            here = tok[:, p] >= 0  # [R]
            u = tok[:, p].view(R, 1, 1, 1)
            f = field[:, :, p].view(R, H, G, 1)
            mins = torch.minimum(mins, f + _infinite_where_not(j < u, mins.dtype))  # (F7)
            if self.W:
                # (F9) at the cap, the oldest restorable token's field folds into the base
                full = here & (budget == self.W)
                slot = (tokens % self.W)[:, None, None].expand(-1, self.HQ, 1)
                oldest = ring.gather(2, slot).view(R, H, G, 1)  # field of token t - W
                fold = full.view(R, 1, 1, 1) & (j < (tokens - self.W).view(R, 1, 1, 1))
                base = torch.where(fold, torch.minimum(base, oldest), base)
                ring = torch.where(
                    here[:, None, None], ring.scatter(2, slot, f.view(R, -1, 1)), ring
                )
            tokens = tokens + here
            budget = torch.clamp_max(budget + here, self.W)
        return o, {
            "evict": evict,
            "mins": mins.view(R, -1, S),
            "base": base.view(R, -1, S),
            "ring": ring,
            "tokens": tokens,
            "budget": budget,
        }

    def _stored(self) -> Tensor:
        """[R, H, S] slots holding an entry some query head of the kv head keeps (the union
        rule with the F9 delay)."""
        st = self.state
        oldest = (st.tokens - st.budget)[:, None, None]
        # some head keeps it: the latest eviction step over the G heads (a max, not an any,
        # which torch reduces slowly over a middle dimension)
        keep = st.evict.view(self.rows, self.H, self.G, -1).amax(dim=2) >= oldest
        return keep & (st.pos >= 0)

    def _release(self) -> None:
        """Holes for the slots no head keeps, pages without a stored slot back to the pool,
        then the compaction of (row, kv head)s holding a page of holes."""
        st, P = self.state, self.P
        stored = self._stored()
        pos = (st.pos + 1) * stored - 1  # -1 where not stored (where() branches: slow here)
        count = stored.sum(dim=2)
        empty = ~(pos >= 0).view(*pos.shape[:2], -1, P).any(dim=3) & (st.table >= 0)
        table = st.table.masked_fill(empty, -1)
        # pages spanned (up to the last held one) beyond those the stored entries need: holes
        # on held pages, or pages freed before the last held one (attention scans the span)
        cols = torch.arange(1, table.shape[2] + 1, device=self.device)
        span = ((table >= 0) * cols).amax(dim=2) if cols.numel() else count * 0
        compact = span > -(-count // P)  # [R, H]
        # those keep their empty pages for the compaction, which fills its own pages in
        # column order (a run of pages stays a run) and frees the rest
        table = torch.where(compact[..., None], st.table, table)
        self.state = replace(st, pos=pos, table=table)
        self._recount()
        for r, h in torch.nonzero(compact).tolist():
            if not self._compact(r, h):
                table[r, h].masked_fill_(empty[r, h], -1)
                self._recount()
        self._trim()

    def _trim(self) -> None:
        """Table columns (and slots) past the last held page of every (row, kv head) dropped,
        so attention visits only pages some row holds."""
        st, P = self.state, self.P
        NT = st.table.shape[2]
        cols = torch.arange(1, NT + 1, device=self.device)
        last = ((st.table >= 0) * cols).amax(dim=2) if NT else st.fill * 0  # [R, H]
        width = int(last.max()) if last.numel() else 0
        fill = torch.minimum(st.fill, last * P)
        if width == NT and torch.equal(fill, st.fill):
            return
        S = width * P
        self.state = replace(
            st,
            table=st.table[..., :width],
            fill=fill,
            **{f: getattr(st, f)[..., :S] for f in ("pos", "level", "mins", "base", "evict")},
        )

    def _compact(self, r: int, h: int) -> bool:
        """Stored entries of (r, h) from its first page with a hole on, moved down in order:
        into its own pages from there on when no other row holds them (pages allocated
        together stay together, see :func:`pages_in_place`), else into fresh pages (a beam's
        shared pages stay shared); the pages left over go back to the pool. Written in place
        (the checks are behind us). False if there was no hole or no room in a fixed pool."""
        st, P, G = self.state, self.P, self.G
        fill = int(st.fill[r, h])
        pos = st.pos[r, h]
        hole = torch.nonzero(pos[:fill] < 0)
        if hole.numel() == 0:
            return False
        a = int(hole[0]) // P * P
        moved = a + torch.nonzero(pos[a:fill] >= 0).flatten()
        m, need = moved.numel(), -(-moved.numel() // P)
        old = st.table[r, h, a // P :]
        old = old[old >= 0]
        own = bool((self.refs[old] == 1).all())
        if (
            not own
            and self.max_pages is not None
            and need > self.free_pages() + int((self.refs[old] == 1).sum())
        ):
            return False  # a fixed pool too full to hold the copies of shared pages: not now
        pages = st.table[r, h, moved // P]
        keys, values = self.k_pool[pages, moved % P], self.v_pool[pages, moved % P]  # copies
        st.table[r, h, a // P :] = -1
        if own:
            new = old[:need]
        else:
            self._recount()
            new = self._allocate(need)
        st.table[r, h, a // P : a // P + need] = new
        dest = torch.arange(a, a + m, device=self.device)
        self.k_pool[st.table[r, h, dest // P], dest % P] = keys
        self.v_pool[st.table[r, h, dest // P], dest % P] = values
        pos[a : a + m] = pos[moved]
        pos[a + m :] = -1
        heads = slice(h * G, (h + 1) * G)
        for name in ("level", "mins", "base", "evict"):
            x = getattr(st, name)
            x[r, heads, a : a + m] = x[r, heads][:, moved]
        st.fill[r, h] = a + m
        self._recount()
        return True

    def prefill_state(self, inputs: dict[str, Tensor]) -> None:
        """An empty session takes a prompt of T tokens in every row, without computing its
        outputs (a server takes them from the parallel op): the state equals that of
        :meth:`advance` with every position present. k [R, H, T, dk], v [R, H, T, dv],
        field, level [R, HQ, T] (q is not needed; if given it is ignored).

        The eviction step of key j is the first u > j with l_j - phi_u >= theta (F2, F7), found
        by binary lifting over a table of range minima (rounding is monotone, so
        l_j - min phi = max (l_j - phi)); time O(T log T) per head, not the O(T^2) of steps.
        """
        if int(self.state.tokens.max()) > 0:
            raise ValueError("inputs: prefill_state expects an empty session")
        self._reserved = 0
        R, T = self.rows, inputs["k"].shape[2] if "k" in inputs else 0
        self._check_chunk(
            {"q": torch.zeros(R, self.HQ, T, self.dk, dtype=self.dtype, device=self.device)}
            | {x: inputs[x] for x in ("k", "v", "field", "level") if x in inputs},
            torch.ones(R, T, dtype=torch.bool, device=self.device),
        )
        P, NT = self.P, -(-T // self.P)
        need = R * self.H * NT
        if self.max_pages is not None and need > self.free_pages():
            raise ValueError(
                f"max_pages: the pool of {self.max_pages} pages has {self.free_pages()} free, "
                f"the prompt needs {need}"
            )
        if T == 0:
            return
        if inputs["field"].dtype == torch.float64:
            self.wide = torch.float64
        wide, S = self.wide, NT * P
        f, lv = inputs["field"].to(wide), inputs["level"].to(wide)  # [R, HQ, T]
        j = torch.arange(T, device=self.device)
        # range minima mins_k[u] = min f[u : u + 2^k]; first hit by binary lifting
        levels, step = [f], 1
        while 2 * step <= T:
            prev = levels[-1]
            levels.append(
                torch.minimum(
                    prev[..., : T - 2 * step + 1], prev[..., step:][..., : T - 2 * step + 1]
                )
            )
            step *= 2
        u = (j + 1).expand(R, self.HQ, T).clone()
        for k in range(len(levels) - 1, -1, -1):
            width = 1 << k
            ok = u + width <= T
            at = u.clamp_max(levels[k].shape[2] - 1)
            clear = (lv - levels[k].gather(2, at)) < self.theta
            u = torch.where(ok & clear, u + width, u)
        evict = torch.where(u < T, u, LIVE)
        if self.window is not None:
            by_window = j + self.window
            evict = torch.minimum(evict, torch.where(by_window < T, by_window, LIVE))
        after = torch.cat([f[..., 1:], torch.full_like(f[..., :1], math.inf)], dim=2)
        mins = torch.cummin(after.flip(2), dim=2).values.flip(2)  # min f over (j, T - 1]
        b = min(T, self.W)
        c = T - b - 1
        base = torch.cummin(after.masked_fill(j >= c, math.inf).flip(2), dim=2).values.flip(2)
        ring = torch.zeros(R, self.HQ, max(self.W, 1), dtype=wide, device=self.device)
        if self.W:
            last = torch.arange(T - b, T, device=self.device)
            ring[..., last % self.W] = f[..., last]
        pages = self._allocate(need).view(R, self.H, NT)
        pad = S - T
        self.k_pool[pages] = torch.nn.functional.pad(inputs["k"], (0, 0, 0, pad)).view(
            R, self.H, NT, P, -1
        )
        self.v_pool[pages] = torch.nn.functional.pad(inputs["v"], (0, 0, 0, pad)).view(
            R, self.H, NT, P, -1
        )

        def slots(x: Tensor, value: float) -> Tensor:
            return torch.nn.functional.pad(x, (0, pad), value=value)

        self.state = replace(
            self.state,
            table=pages,
            fill=torch.full((R, self.H), T, dtype=torch.int64, device=self.device),
            pos=slots(j.expand(R, self.H, T), -1).contiguous(),
            level=slots(lv, 0.0),
            mins=slots(mins, math.inf),
            base=slots(base, math.inf),
            evict=slots(evict, LIVE),
            tokens=torch.full((R,), T, dtype=torch.int64, device=self.device),
            budget=torch.full((R,), b, dtype=torch.int64, device=self.device),
            ring=ring,
        )
        self._release()

    def select(self, rows: Sequence[int]) -> None:
        """(F9) the session now holds len(rows) rows, row i a copy of old row rows[i]; pages are
        shared (reference counts), never copied."""
        try:
            index = [int(i) for i in rows]
        except (TypeError, ValueError):
            raise ValueError(f"rows: expected a sequence of integers, got {rows!r}") from None
        if not index or any(isinstance(i, bool) for i in rows):
            raise ValueError(f"rows: expected a non-empty sequence of integers, got {rows!r}")
        bad = [i for i in index if not 0 <= i < self.rows]
        if bad or any(i != x for i, x in zip(index, rows, strict=True)):
            raise ValueError(f"rows: expected indices in [0, {self.rows}), got {list(rows)!r}")
        self._reserved = 0  # (a shared reserved page would be written by two rows)
        self.state = self.state.index(torch.tensor(index, device=self.device))
        self._recount()

    def rollback(self, row: int, n: int) -> None:
        """(F9) row returns to its state after its first tokens - n tokens."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.rows:
            raise ValueError(f"row: expected an integer in [0, {self.rows}), got {row!r}")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n: expected an integer >= 0, got {n!r}")
        if n > self.W:
            raise ValueError(f"max_rollback: n = {n} exceeds the rollback window W = {self.W}")
        st = self.state
        b = int(st.budget[row])
        if n > b:
            raise ValueError(f"n: row {row} can undo at most {b} tokens now, asked for {n}")
        if n == 0:
            return
        self._reserved = 0
        t = int(st.tokens[row])
        kept = t - n
        pos, evict = st.pos.clone(), st.evict.clone()
        gone = pos[row] >= kept
        pos[row] = pos[row].masked_fill(gone, -1)
        fill = st.fill.clone()
        fill[row] -= gone.sum(dim=1)
        evict[row] = evict[row].masked_fill(evict[row] >= kept, LIVE)
        # m_j from the base minimum and the fields of the restorable tokens (c, kept - 1]
        c = t - b - 1
        posq = pos[row].repeat_interleave(self.G, dim=0)  # [HQ, S]
        mins = st.base[row].clone()
        for u in range(c + 1, kept):
            f = st.ring[row, :, u % self.W, None]  # [HQ, 1]
            mins = torch.minimum(mins, f.where(posq < u, math.inf))
        all_mins = st.mins.clone()
        all_mins[row] = mins
        tokens, budget = st.tokens.clone(), st.budget.clone()
        tokens[row], budget[row] = kept, b - n
        self.state = replace(
            st, pos=pos, fill=fill, evict=evict, mins=all_mins, tokens=tokens, budget=budget
        )
        self._release()

    def counts(self) -> dict[str, Tensor]:
        """ "tokens" [R]; "live" [R, HQ] keys attended now; "stored" [R, H] entries stored."""
        st = self.state
        posq = st.pos.repeat_interleave(self.G, dim=1)
        return {
            "tokens": st.tokens.clone(),
            "live": ((posq >= 0) & (st.evict == LIVE)).sum(dim=2),
            "stored": (st.pos >= 0).sum(dim=2),
        }

    def pages_held(self) -> Tensor:
        """[R, H] pages in the page table of each (row, kv head) (shared pages counted by
        every row that holds them)."""
        return (self.state.table >= 0).sum(dim=2)

    def bytes_held(self) -> int:
        """Bytes of k and v in the pool's pages held by some row (each physical page once)."""
        per_page = self.P * (self.dk + self.dv) * self.k_pool.element_size()
        return int((self.refs > 0).sum()) * per_page
