"""Block layouts: which (query block, key block) pairs a block-wise kernel computes.

Implementation behind the public module :mod:`attnjax.layout`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import lowering, validators

Array = jnp.ndarray


# ---------------------------------------------------------------------------
# The static block layout.


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """Which key blocks each query block visits (static and hashable).

  Attributes:
    q_len: ``T``.
    kv_len: ``S``.
    block_q: rows per query block (the last block may be shorter).
    block_k: columns per key block (the last block may be shorter).
    kv_blocks: ``[num_q_blocks][max_visits]`` key-block indices, ``-1`` = padding.
    needs_mask: same shape; True where the visit must evaluate ``mask_fn``.
  """

  q_len: int
  kv_len: int
  block_q: int
  block_k: int
  kv_blocks: tuple[tuple[int, ...], ...]
  needs_mask: tuple[tuple[bool, ...], ...]

  def __post_init__(self):
    for name in ("q_len", "kv_len", "block_q", "block_k"):
      validators.check_positive_int(f"BlockLayout.{name}", getattr(self, name))
    if len(self.kv_blocks) != self.num_q_blocks or len(self.needs_mask) != self.num_q_blocks:
      raise ValueError(
        f"BlockLayout needs one row per query block ({self.num_q_blocks} for q_len="
        f"{self.q_len}, block_q={self.block_q}), got {len(self.kv_blocks)} kv_blocks rows "
        f"and {len(self.needs_mask)} needs_mask rows"
      )
    for i, (row, flags) in enumerate(zip(self.kv_blocks, self.needs_mask)):
      if len(row) != len(flags):
        raise ValueError(
          f"BlockLayout row {i}: kv_blocks {row} and needs_mask {flags} differ in length"
        )
      real = [kb for kb in row if kb >= 0]
      if any(kb < -1 or kb >= self.num_kv_blocks for kb in row):
        raise ValueError(
          f"BlockLayout row {i}: key-block indices must lie in [0, {self.num_kv_blocks}) "
          f"or be -1 (padding), got {row}"
        )
      if len(set(real)) != len(real):
        raise ValueError(f"BlockLayout row {i} visits a key block twice: {row}")

  @property
  def num_q_blocks(self) -> int:
    return -(-self.q_len // self.block_q)

  @property
  def num_kv_blocks(self) -> int:
    return -(-self.kv_len // self.block_k)

  @property
  def num_pairs(self) -> int:
    """Number of (query block, key block) pairs computed (before run-time segment skipping)."""
    return sum(kb >= 0 for row in self.kv_blocks for kb in row)

  def q_range(self, i: int) -> tuple[int, int]:
    return i * self.block_q, min(self.q_len, (i + 1) * self.block_q)

  def kv_range(self, j: int) -> tuple[int, int]:
    return j * self.block_k, min(self.kv_len, (j + 1) * self.block_k)

  def visits(self, i: int) -> list[tuple[int, bool]]:
    """``[(key_block, needs_mask), ...]`` of query block ``i`` (padding dropped)."""
    return [(kb, nm) for kb, nm in zip(self.kv_blocks[i], self.needs_mask[i]) if kb >= 0]

  def as_arrays(self) -> tuple[np.ndarray, np.ndarray]:
    """``(kv_blocks int32 [num_q_blocks, max_visits], needs_mask bool [...])``."""
    width = max([len(r) for r in self.kv_blocks] + [0])
    idx = np.full((self.num_q_blocks, width), -1, np.int32)
    flag = np.zeros((self.num_q_blocks, width), bool)
    for i, (row, flags) in enumerate(zip(self.kv_blocks, self.needs_mask)):
      idx[i, : len(row)] = row
      flag[i, : len(flags)] = flags
    return idx, flag

  @classmethod
  def from_visits(
    cls,
    q_len: int,
    kv_len: int,
    block_q: int,
    block_k: int,
    visits: Sequence[Sequence[tuple[int, bool]]],
  ) -> "BlockLayout":
    """Builds a layout from per-query-block lists of ``(key_block, needs_mask)``."""
    width = max([len(v) for v in visits] + [0])
    kv_blocks = tuple(tuple(int(kb) for kb, _ in v) + (-1,) * (width - len(v)) for v in visits)
    needs_mask = tuple(tuple(bool(nm) for _, nm in v) + (False,) * (width - len(v)) for v in visits)
    return cls(int(q_len), int(kv_len), int(block_q), int(block_k), kv_blocks, needs_mask)


@functools.lru_cache(maxsize=256)
def structural_layout(
  q_len: int,
  kv_len: int,
  block_q: int,
  block_k: int,
  *,
  is_causal: bool = False,
  window: Optional[tuple[int, int]] = None,
) -> BlockLayout:
  """The layout of causal / window structure: exact, from each row's allowed key range.

  Row ``i`` may attend keys ``lo_i .. hi_i`` (``lo_i = i - left`` with a window,
  ``hi_i = i`` when causal, ``i + right`` with a window, clipped to the keys).
  A key block is visited when some row of the query block reaches into it, and
  needs a mask unless every row's range covers it.

  Args:
    q_len: ``T``.
    kv_len: ``S``.
    block_q: query block size.
    block_k: key block size.
    is_causal: rows see keys ``j <= i``.
    window: ``(left, right)``, or None.

  Returns:
    The :class:`.BlockLayout`.
  """
  rows = np.arange(q_len)
  lo = np.zeros(q_len, np.int64)
  hi = np.full(q_len, kv_len - 1, np.int64)
  if is_causal:
    hi = np.minimum(hi, rows)
  if window is not None:
    lo = np.maximum(lo, rows - window[0])
    hi = np.minimum(hi, rows + window[1])
  nq, nk = -(-q_len // block_q), -(-kv_len // block_k)
  visits = []
  for i in range(nq):
    r_lo, r_hi = lo[i * block_q : (i + 1) * block_q], hi[i * block_q : (i + 1) * block_q]
    row = []
    for j in range(nk):
      k0, k1 = j * block_k, min(kv_len, (j + 1) * block_k) - 1
      touches = np.any((r_lo <= k1) & (r_hi >= k0) & (r_lo <= r_hi))
      if touches:
        full = bool(np.all((r_lo <= k0) & (r_hi >= k1)))
        row.append((j, not full))
    visits.append(row)
  return BlockLayout.from_visits(q_len, kv_len, block_q, block_k, visits)


def kept_blocks(layout: BlockLayout) -> np.ndarray:
  """The blocks a layout visits.

  Args:
    layout: a :class:`.BlockLayout`.

  Returns:
    numpy bool ``[num_q_blocks, num_kv_blocks]`` (e.g. for ``imshow``).
  """
  kv_blocks, _ = layout.as_arrays()
  out = np.zeros((layout.num_q_blocks, layout.num_kv_blocks), bool)
  rows, cols = np.nonzero(kv_blocks >= 0)
  out[rows, kv_blocks[rows, cols]] = True
  return out


def full_blocks(layout: BlockLayout) -> np.ndarray:
  """The visited blocks that need no element mask.

  Args:
    layout: a :class:`.BlockLayout`.

  Returns:
    numpy bool ``[num_q_blocks, num_kv_blocks]``.
  """
  kv_blocks, needs_mask = layout.as_arrays()
  out = np.zeros((layout.num_q_blocks, layout.num_kv_blocks), bool)
  rows, cols = np.nonzero(np.logical_and(kv_blocks >= 0, np.logical_not(needs_mask)))
  out[rows, kv_blocks[rows, cols]] = True
  return out


def density(layout: BlockLayout) -> float:
  """Fraction of all ``num_q_blocks * num_kv_blocks`` blocks the layout computes.

  Args:
    layout: a :class:`.BlockLayout`.

  Returns:
    A float in ``[0, 1]``.
  """
  return layout.num_pairs / (layout.num_q_blocks * layout.num_kv_blocks)


# ---------------------------------------------------------------------------
# Run-time classification under segment ids.


SKIP, FULL, MASKED = 0, 1, 2


def segment_block_relations(
  q_segment_ids: Array, kv_segment_ids: Array, layout: BlockLayout
) -> Array:
  """Run-time relation of every (query block, key block) pair under segment ids.

  Args:
    q_segment_ids: ``[B, T]`` integer ids.
    kv_segment_ids: ``[B, S]`` integer ids.
    layout: the blocks.

  Returns:
    int32 ``[num_q_blocks, num_kv_blocks]``: ``SKIP`` (0) when, in every batch
    row, the query block's id range and the key block's id range do not
    overlap (no pair can match, the block is not computed), ``FULL`` (1) when
    every query and key of the pair share one id in every batch row (no
    segment comparison needed), else ``MASKED`` (2). Exact for sorted
    (packed) ids; for unsorted ids a block may be ``MASKED`` that could have
    been skipped, never the reverse.
  """

  def ranges(ids, n, rng):
    lo = jnp.stack([jnp.min(ids[:, a:b], axis=1) for a, b in map(rng, range(n))], axis=1)
    hi = jnp.stack([jnp.max(ids[:, a:b], axis=1) for a, b in map(rng, range(n))], axis=1)
    return lo[:, :, None], hi[:, :, None]  # [B, n, 1]

  qlo, qhi = ranges(q_segment_ids, layout.num_q_blocks, layout.q_range)
  klo, khi = ranges(kv_segment_ids, layout.num_kv_blocks, layout.kv_range)
  klo, khi = jnp.transpose(klo, (0, 2, 1)), jnp.transpose(khi, (0, 2, 1))  # [B, 1, nk]
  meets = jnp.any(jnp.logical_and(qlo <= khi, klo <= qhi), axis=0)
  single = jnp.all((qlo == qhi) & (klo == khi) & (qlo == klo), axis=0)
  return jnp.where(meets, jnp.where(single, FULL, MASKED), SKIP).astype(jnp.int32)


# ---------------------------------------------------------------------------
# Layouts of element rules (patterns).


def key_block_candidates(ranges, S: int, block_size: int) -> np.ndarray:
  """The key blocks touching any half-open position range ``[lo, hi)``.

  Args:
    ranges: ``(lo, hi)`` pairs of key positions (clipped to ``[0, S)``).
    S: key length.
    block_size: key block size.

  Returns:
    numpy bool ``[ceil(S / block_size)]``.
  """
  out = np.zeros(-(-S // block_size), bool)
  for lo, hi in ranges:
    lo, hi = max(lo, 0), min(hi, S)
    if lo < hi:
      out[lo // block_size : (hi - 1) // block_size + 1] = True
  return out


@dataclasses.dataclass(frozen=True)
class SparsePlan:
  """The block-sparse computation of a pattern on ``(T, S)``.

  Attributes:
    extra_keys: ``int32 [E]`` key positions gathered and appended after the ``S``
      keys (empty for most patterns).
    layout: :class:`.BlockLayout` over the ``S + E`` key slots.
    rule: a rule (see :func:`.rule_layout`) whose ``allowed`` takes slot indices
      and the shape ``(T, S + E)``; the element mask of partial blocks.
  """

  extra_keys: np.ndarray
  layout: BlockLayout
  rule: Any


# Rule evaluations per compiled call when building a layout (bounds its memory).
_LAYOUT_CHUNK_ELEMENTS = 1 << 23


@functools.partial(jax.jit, static_argnames=("rule", "shape", "block_size"))
def classify_blocks(rule, q_blocks, k_blocks, *, shape, block_size):
  """Which candidate blocks a pattern's rule allows somewhere, and everywhere.

  Args:
    rule: a pattern (its ``allowed(q_positions, k_positions, shape)``).
    q_blocks: int ``[R]`` query block indices.
    k_blocks: int ``[R, C]`` candidate key block indices of each query block.
    shape: ``(T, S)``; positions past it are disallowed.
    block_size: the block size of both axes.

  Returns:
    ``(any, all)``, each bool ``[R, C]``: some pair of the block is allowed; every pair
    is (a ragged block past ``T`` or ``S`` is never all-allowed).
  """
  T, S = shape
  offsets = jnp.arange(block_size)

  def one_row(qb, kbs):
    q_pos = qb * block_size + offsets  # [bq]
    k_pos = (kbs[:, None] * block_size + offsets[None, :]).reshape(-1)  # [C * bk]
    inside = jnp.logical_and((q_pos < T)[:, None], (k_pos < S)[None, :])
    allowed = rule.allowed(jnp.minimum(q_pos, T - 1), jnp.minimum(k_pos, S - 1), shape)
    allowed = jnp.logical_and(allowed, inside).reshape(block_size, kbs.shape[0], block_size)
    # A ragged block (past T or S) is never "full": its padding must be masked.
    inside = inside.reshape(block_size, kbs.shape[0], block_size)
    return allowed.any(axis=(0, 2)), jnp.logical_and(allowed, inside).all(axis=(0, 2)) & inside.all(
      axis=(0, 2)
    )

  return jax.vmap(one_row)(q_blocks, k_blocks)


@functools.lru_cache(maxsize=256)
def rule_layout(rule: Any, T: int, S: int, block_size: int) -> BlockLayout:
  """The layout of an element rule on ``(T, S)`` with square blocks (cached per rule and shape).

  Args:
    rule: a hashable object with ``allowed(q_positions [Tq], k_positions [Sk],
      shape) -> bool [Tq, Sk]`` and ``candidate_key_blocks(q_lo, q_hi, shape,
      block_size) -> bool [num_k_blocks]`` (a cheap superset of the key blocks
      queries ``[q_lo, q_hi)`` may see), e.g. an :class:`attnjax.patterns.Pattern`.
    T: number of queries.
    S: number of keys (or key slots).
    block_size: edge of the square blocks.

  Returns:
    A :class:`.BlockLayout`: a candidate block is kept when the rule allows some
    pair in it, and needs a mask unless it allows every pair (ragged edge blocks
    always need one). The rule is evaluated only on candidate blocks.
  """
  nq = -(-T // block_size)
  candidates = np.stack(
    [
      rule.candidate_key_blocks(qb * block_size, min((qb + 1) * block_size, T), (T, S), block_size)
      for qb in range(nq)
    ]
  )
  width = max(1, int(candidates.sum(axis=1).max()))
  # Candidate key blocks of each row, ascending, padded with block 0 (dropped below).
  order = np.argsort(np.logical_not(candidates), axis=1, kind="stable")[:, :width]
  is_candidate = np.take_along_axis(candidates, order, axis=1)
  cand_blocks = np.where(is_candidate, order, 0).astype(np.int32)
  rows_per_call = max(1, _LAYOUT_CHUNK_ELEMENTS // (width * block_size * block_size))
  rows_per_call = min(rows_per_call, nq)
  any_allowed = np.zeros((nq, width), bool)
  all_allowed = np.zeros((nq, width), bool)
  # Concrete evaluation even when called while tracing a jitted function: the
  # layout is static structure, not part of the computation.
  with lowering.host_eval():
    for lo in range(0, nq, rows_per_call):
      rows = np.minimum(np.arange(lo, lo + rows_per_call), nq - 1)  # equal shapes: one compile
      a, b = classify_blocks(
        rule,
        jnp.asarray(rows, jnp.int32),
        jnp.asarray(cand_blocks[rows]),
        shape=(T, S),
        block_size=block_size,
      )
      n = min(rows_per_call, nq - lo)
      any_allowed[lo : lo + n] = np.asarray(a)[:n]
      all_allowed[lo : lo + n] = np.asarray(b)[:n]
  kept = np.logical_and(any_allowed, is_candidate)
  visits = []
  for qb in range(nq):
    cols = np.flatnonzero(kept[qb])
    visits.append([(int(cand_blocks[qb, c]), not bool(all_allowed[qb, c])) for c in cols])
  return BlockLayout.from_visits(T, S, block_size, block_size, visits)


# ---------------------------------------------------------------------------
# Layouts of mask modifiers (attnjax.mods, FlexAttention's create_block_mask).


def intersect(a: BlockLayout, b: BlockLayout) -> BlockLayout:
  """The blocks both layouts visit; a visit needs a mask when either layout says so.

  Args:
    a: a :class:`.BlockLayout`.
    b: a layout of the same lengths and block sizes.

  Returns:
    The intersected :class:`.BlockLayout`.

  Raises:
    ValueError: layouts of different lengths or block sizes.
  """
  if (a.q_len, a.kv_len, a.block_q, a.block_k) != (b.q_len, b.kv_len, b.block_q, b.block_k):
    raise ValueError(
      f"cannot intersect layouts of different geometry: (q_len, kv_len, block_q, block_k) = "
      f"{(a.q_len, a.kv_len, a.block_q, a.block_k)} and "
      f"{(b.q_len, b.kv_len, b.block_q, b.block_k)}; build block_layout with the block "
      f"sizes of the call"
    )
  visits = []
  for i in range(a.num_q_blocks):
    other = dict(b.visits(i))
    visits.append([(j, nm or other[j]) for j, nm in a.visits(i) if j in other])
  return BlockLayout.from_visits(a.q_len, a.kv_len, a.block_q, a.block_k, visits)


def _mask_mod_blocks(
  fn,
  args: tuple,
  T: int,
  S: int,
  block_q: int,
  block_k: int,
  batch: int,
  heads: int,
  positions=None,
) -> tuple[Array, Array]:
  """``(any, all)`` allowed per block, each ``bool [num_q_blocks, num_kv_blocks]``.

  Every element is evaluated (one query block at a time, ``lax.map``), so the
  result is exact for any ``mask_mod``; ``all`` counts only the pairs inside
  ``(T, S)`` (edge blocks are shorter, never padded).
  """
  nq, nk = -(-T // block_q), -(-S // block_k)
  qi = jnp.arange(nq * block_q, dtype=jnp.int32)
  kj = jnp.arange(nk * block_k, dtype=jnp.int32)
  q_in, k_in = qi < T, kj < S
  qi, kj = jnp.minimum(qi, T - 1), jnp.minimum(kj, S - 1)
  if positions is not None:
    qi, kj = positions[0][qi].astype(jnp.int32), positions[1][kj].astype(jnp.int32)
  b = jnp.reshape(jnp.arange(batch, dtype=jnp.int32), (batch, 1, 1, 1))
  n = jnp.reshape(jnp.arange(heads, dtype=jnp.int32), (1, heads, 1, 1))
  j = jnp.reshape(kj, (1, 1, 1, -1))

  def one(iq):
    rows = jax.lax.dynamic_slice_in_dim(qi, iq * block_q, block_q)
    inside = jnp.logical_and(
      jax.lax.dynamic_slice_in_dim(q_in, iq * block_q, block_q)[:, None], k_in[None, :]
    )
    m = jnp.asarray(fn(b, n, jnp.reshape(rows, (1, 1, -1, 1)), j, *args))
    m = jnp.broadcast_to(m, jnp.broadcast_shapes(m.shape, (1, 1, block_q, nk * block_k)))
    m = jnp.reshape(m, m.shape[:2] + (block_q, nk, block_k))
    inside = jnp.reshape(inside, (1, 1, block_q, nk, block_k))
    return (
      jnp.any(jnp.logical_and(m, inside), axis=(0, 1, 2, 4)),
      jnp.all(jnp.logical_or(m, jnp.logical_not(inside)), axis=(0, 1, 2, 4)),
    )

  return jax.lax.map(one, jnp.arange(nq))


def mask_mod_block_table(
  fn, args: tuple, layout: BlockLayout, batch: int, heads: int, *, positions=None
) -> Array:
  """Each block's kind under a ``mask_mod`` whose arguments are traced (run time).

  A modifier may carry a cheaper exact rule as an attribute,
  ``fn.block_table(layout, *args) -> int32 [num_q_blocks, num_kv_blocks]`` of
  ``SKIP`` / ``FULL`` / ``MASKED`` (e.g. :func:`attnjax.mods.document_mask`: from
  the ids' ranges per block, as ``segment_ids``); it is used when the rows and
  keys are at their own positions. Otherwise every element is evaluated.

  Args:
    fn: the mask modifier ``fn(b, n, i, j, *args) -> bool``.
    args: its arguments.
    layout: the :class:`.BlockLayout` whose blocks are classified.
    batch: ``B``.
    heads: ``N``.
    positions: None, or int ``(q_positions [T], k_positions [S])`` the modifier sees.

  Returns:
    int32 ``[num_q_blocks, num_kv_blocks]`` of :data:`.SKIP`, :data:`.FULL`,
    :data:`.MASKED`.
  """
  rule = getattr(fn, "block_table", None)
  if rule is not None and positions is None:
    return rule(layout, *args).astype(jnp.int32)
  any_ok, all_ok = _mask_mod_blocks(
    fn,
    tuple(args),
    layout.q_len,
    layout.kv_len,
    layout.block_q,
    layout.block_k,
    batch,
    heads,
    positions,
  )
  return jnp.where(any_ok, jnp.where(all_ok, FULL, MASKED), SKIP).astype(jnp.int32)


_MASK_MOD_LAYOUTS: dict = {}


def from_mask_mod(
  fn,
  q_len: int,
  kv_len: int,
  block_q: int,
  block_k: int,
  *args,
  batch: Optional[int] = None,
  heads: Optional[int] = None,
) -> BlockLayout:
  """The block layout of a ``mask_mod`` (as FlexAttention's ``create_block_mask``).

  Build it once, outside ``jit``, and pass it to every call that uses the same
  ``mask_mod`` and lengths as ``block_layout=`` (dense, block-wise and sparse
  calls; it also fixes the block sizes of a block-wise call). Blocks where
  ``fn`` allows nothing are never computed; blocks where it allows every pair
  are computed without evaluating it.

  ``fn(b, n, i, j, *args)`` is evaluated on every element, one query block at
  a time, so the layout is exact for any rule (document masks from unsorted
  ids and scattered patterns included); it costs ``O(batch * heads * T * S)``
  elementwise work once. Lengths, block sizes and the modifier are static;
  layouts of argument-free modifiers are cached.

  Args:
    fn: ``mask_mod(b, n, i, j, *args) -> bool`` (see :mod:`attnjax.mods`).
    q_len: ``T``.
    kv_len: ``S``.
    block_q: rows per query block (the call's block size).
    block_k: keys per key block.
    *args: the ``mask_mod_args`` (concrete arrays: the layout is static).
    batch: number of batch rows ``fn`` distinguishes; None = ``fn`` ignores
      ``b`` (evaluated at ``b = 0``).
    heads: likewise for the query head ``n``.

  Returns:
    A :class:`.BlockLayout`.
  """
  for name, value in (
    ("q_len", q_len),
    ("kv_len", kv_len),
    ("block_q", block_q),
    ("block_k", block_k),
  ):
    validators.check_positive_int(name, value, where="from_mask_mod")
  if not callable(fn):
    raise TypeError(f"from_mask_mod: fn must be a mask_mod callable, got {type(fn).__name__}")
  if any(isinstance(a, jax.core.Tracer) for a in args):
    raise ValueError(
      "from_mask_mod needs concrete args (the layout is static); build it "
      "outside jit, or pass mask_mod_args to the call (blocks are then "
      "skipped at run time)"
    )
  block_q, block_k = min(int(block_q), int(q_len)), min(int(block_k), int(kv_len))
  batch = 1 if batch is None else int(batch)
  heads = 1 if heads is None else int(heads)
  key = None
  if not args:
    key = (fn, int(q_len), int(kv_len), block_q, block_k, batch, heads)
    if key in _MASK_MOD_LAYOUTS:
      return _MASK_MOD_LAYOUTS[key]
  with lowering.host_eval():
    any_ok, all_ok = _mask_mod_blocks(
      fn,
      tuple(jnp.asarray(a) for a in args),
      int(q_len),
      int(kv_len),
      block_q,
      block_k,
      batch,
      heads,
    )
    any_ok, all_ok = np.asarray(any_ok), np.asarray(all_ok)
  visits = [
    [(int(j), not bool(all_ok[i, j])) for j in np.flatnonzero(any_ok[i])]
    for i in range(any_ok.shape[0])
  ]
  out = BlockLayout.from_visits(q_len, kv_len, block_q, block_k, visits)
  if key is not None:
    _MASK_MOD_LAYOUTS[key] = out
  return out
