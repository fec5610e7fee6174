"""The plan of a selected-block attention call: checks, loop order, block lists and the inverted index.

:func:`check_inputs` names bad arguments; :func:`make_plan` chooses the loop order
(:func:`loop_order`: query-token-major for ``G >= QUERY_MAJOR_MIN_GROUP`` query heads per
group, key-block-major for smaller groups) and the tiles; :func:`canonical_blocks` sorts each
row's selected blocks; :func:`work_list` inverts them (the query tokens that selected each
key block, in work items of :attr:`Plan.rows` rows); :func:`gather_rows`, :func:`merge_parts`
and :func:`sum_parts` move rows between the two orders in XLA.
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import normalizers

Array = jnp.ndarray

# The loop orders: "query" (NSA: one program per query token and key/value head, the G query
# heads of the group as the tile's rows, walking the token's selected blocks) and "kv" (FSA,
# arXiv 2508.18224: per key block, the query tokens that selected it, G heads each, as rows).
ORDERS = ("query", "kv")
# Query heads per group from which the query-token-major order fills a tile (NSA's kernel needs
# at least 16; Yuan et al. 2025, section 3.4). Smaller groups run key-block-major.
QUERY_MAJOR_MIN_GROUP = 16


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_inputs(q, k, v, block_idx, *, block_size, scale, normalizer) -> None:
  """Raises ``ValueError`` / ``TypeError`` naming the argument and the shapes or values seen.

  ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]`` of one floating dtype,
  ``block_idx [B, T, K, n]`` integer, ``block_size`` a positive int, ``scale`` a finite
  Python float, ``normalizer`` a name of :data:`attnjax.normalizers.NORMALIZERS`.
  """
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      letters = "[B, T, N, H]" if name == "q" else "[B, S, K, H]"
      raise ValueError(f"{name} must have rank 4 {letters}, got shape {np.shape(x)}")
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
  B, T, N, H = q.shape
  if k.shape[0] != B or k.shape[3] != H or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"k must be [B, S, K, H] and v [B, S, K, Hv] for q {tuple(q.shape)} [B, T, N, H]; got "
      f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    )
  K = k.shape[2]
  if K == 0 or N % K:
    raise ValueError(
      f"query heads N={N} must be a multiple of key/value heads K={K} "
      f"(q {tuple(q.shape)}, k {tuple(k.shape)})"
    )
  if np.ndim(block_idx) != 4 or tuple(np.shape(block_idx)[:3]) != (B, T, K):
    raise ValueError(
      f"block_idx must be [B, T, K, n] = [{B}, {T}, {K}, n] for q {tuple(q.shape)} and k "
      f"{tuple(k.shape)}; got shape {tuple(np.shape(block_idx))}"
    )
  if not jnp.issubdtype(jnp.result_type(block_idx), jnp.integer):
    raise TypeError(f"block_idx must be an integer array, got dtype {jnp.result_type(block_idx)}")
  if not _is_int(block_size) or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
    raise TypeError(f"scale must be a Python float (static), got {type(scale).__name__}")
  if not np.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale!r}")
  normalizers.get(normalizer)  # ValueError naming the choices


def loop_order(G: int, normalizer: str) -> str:
  """The loop order of a call with ``G`` query heads per group: ``"query"`` from
  :data:`QUERY_MAJOR_MIN_GROUP` heads on (their rows fill a tile), ``"kv"`` below, where a
  token's heads alone would leave most of a tile empty. ``"kv"`` computes each (token, block)
  pair's part apart and merges the parts by their log-normalisers, so it takes mergeable
  normalisers only (softmax, softmax_one); the others run ``"query"`` at any ``G``."""
  if G >= QUERY_MAJOR_MIN_GROUP or not normalizers.get(normalizer).mergeable:
    return "query"
  return "kv"


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a selected-block kernel reads from Python: shapes, tiles, options.

  Attributes:
    B, T, S, N, K, H, Hv: the shape letters (``G = N // K`` query heads per group).
    n: selection slots per (token, key/value head).
    block_size: keys per selection block; ``nb`` blocks cover the keys (the last one ragged
      when ``S % block_size``), laid out padded to ``Sp = nb * block_size``.
    scale: multiplies ``<q, k>``.
    normalizer: a name of :data:`attnjax.normalizers.NORMALIZERS`.
    order: ``"query"`` or ``"kv"`` (:func:`loop_order`).
    tokens: ``"kv"``: query tokens per work item (their ``tokens * G`` (token, head) pairs
      are the item's rows, padded to ``rows``).
    rows: ``"kv"``: rows per work item.
    return_lse: the call returns the log-normaliser.
    interpret: run the kernels in interpret mode.
  """

  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  Hv: int
  n: int
  block_size: int
  scale: float
  normalizer: str
  order: str
  tokens: int
  rows: int
  return_lse: bool
  interpret: bool

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def nb(self) -> int:
    return -(-self.S // self.block_size)

  @property
  def Sp(self) -> int:
    return self.nb * self.block_size

  @property
  def W(self) -> int:
    """Work items per (batch row, key/value head) of the ``"kv"`` order: every selected
    (token, block) pair takes a row group, and every block at least one item (its dk, dv
    are written there), so ``ceil(T n / tokens) + nb`` bound the items."""
    return -(-self.T * self.n // self.tokens) + self.nb

  @property
  def nz(self) -> normalizers.Normalizer:
    return normalizers.REGISTRY[self.normalizer]

  @property
  def with_stats(self) -> bool:
    """The normaliser's statistics run with the call: the log-normaliser a call returns is the
    statistic ``lse`` where the normaliser is not softmax-like."""
    return self.return_lse and not self.nz.softmax_like

  @property
  def needs_counts(self) -> bool:
    """Rows take their number of allowed keys (the normaliser's constants, statistics)."""
    return self.nz.needs_counts or self.with_stats

  @property
  def part_normalizer(self) -> normalizers.Normalizer:
    """The normaliser of the ``"kv"`` order's parts (the normaliser's ``merge_part``)."""
    return normalizers.REGISTRY[self.nz.merge_part or self.normalizer]


def make_plan(
  q,
  k,
  v,
  block_idx,
  *,
  block_size: int,
  scale: float,
  normalizer: str,
  return_lse: bool,
  interpret: bool,
  order: Optional[str],
  rows: int,
  align: int,
) -> Plan:
  """The plan of a checked call. ``order`` None: :func:`loop_order`; ``rows``: the
  ``"kv"`` order's target rows per work item, filled with whole tokens (``rows // G`` of
  them, at least one) and padded to a multiple of ``align``."""
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  G = N // K
  if order is None:
    order = loop_order(G, normalizer)
  if order not in ORDERS:
    raise ValueError(f"order={order!r} is not one of: " + ", ".join(repr(o) for o in ORDERS))
  if order == "kv" and not normalizers.get(normalizer).mergeable:
    raise ValueError(
      f"order='kv' merges the parts of each row by their log-normalisers; normalizer="
      f"{normalizer!r} does not merge (use order='query')"
    )
  tokens = max(1, rows // G)
  return Plan(
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    n=block_idx.shape[3],
    block_size=int(block_size),
    scale=float(scale),
    normalizer=normalizer,
    order=order,
    tokens=tokens,
    rows=-(-tokens * G // align) * align,
    return_lse=bool(return_lse),
    interpret=bool(interpret),
  )


# ---------------------------------------------------------------------------
# Each row's blocks, sorted.


class Blocks(NamedTuple):
  """Each (batch row, token, key/value head)'s selected blocks, canonical.

  Attributes:
    idx: int32 ``[B, T, K, n]``: the distinct selected blocks a token can reach (in range and
      starting at or before it), ascending, then the padding slots, which repeat the last
      block (block 0 for a token with none): a kernel stepping over them fetches nothing new.
    count: int32 ``[B, T, K]``: the real slots of each row.
  """

  idx: Array
  count: Array


def canonical_blocks(block_idx: Array, plan: Plan) -> Blocks:
  """The :class:`Blocks` of ``block_idx`` (no gradient): ``-1``, blocks outside
  ``[0, nb)``, blocks that start after the token and repeats of a block select nothing."""
  idx = jax.lax.stop_gradient(jnp.asarray(block_idx)).astype(jnp.int32)
  t = jnp.arange(plan.T, dtype=jnp.int32)[None, :, None, None]
  bs, nb = plan.block_size, plan.nb
  ok = (idx >= 0) & (idx < nb) & (idx * bs <= t)
  key = jnp.sort(jnp.where(ok, idx, nb), axis=-1)  # unselected slots last
  first = jnp.concatenate([jnp.ones_like(key[..., :1], bool), key[..., 1:] != key[..., :-1]], -1)
  key = jnp.sort(jnp.where(first & (key < nb), key, nb), axis=-1)  # repeats dropped
  count = jnp.sum(key < nb, axis=-1).astype(jnp.int32)
  last = jnp.take_along_axis(key, jnp.maximum(count - 1, 0)[..., None], axis=-1)
  idx = jnp.where(key < nb, key, jnp.where(count[..., None] > 0, last, 0))
  return Blocks(idx.astype(jnp.int32), count)


def slot_valid(blocks: Blocks) -> Array:
  """bool ``[B, T, K, n]``: the real slots."""
  n = blocks.idx.shape[-1]
  return jnp.arange(n, dtype=jnp.int32)[None, None, None, :] < blocks.count[..., None]


def row_counts(blocks: Blocks, plan: Plan) -> Array:
  """float32 ``[B, T, K]``: the keys each row attends (keys ``s <= t`` of its blocks)."""
  t = jnp.arange(plan.T, dtype=jnp.int32)[None, :, None, None]
  start = blocks.idx * plan.block_size
  end = jnp.minimum(jnp.minimum(start + plan.block_size, plan.S), t + 1)
  keys = jnp.where(slot_valid(blocks), jnp.maximum(end - start, 0), 0)
  return jnp.sum(keys, axis=-1).astype(jnp.float32)


def needs_mask(plan: Plan, j, t):
  """Whether block ``j`` has keys query ``t`` may not attend: the block reaching past the
  token (its diagonal block) or a ragged last block (keys past ``S``)."""
  last_key = (j + 1) * plan.block_size - 1
  return last_key > jnp.minimum(t, plan.S - 1)


# ---------------------------------------------------------------------------
# The inverted index: per key block, the tokens that selected it.


class WorkList(NamedTuple):
  """The ``"kv"`` order's work: per (batch row, key/value head), ``W`` items of one key block
  and up to ``tokens`` query tokens (``rows`` rows: the tokens' G heads), ordered by block.

  Attributes:
    block: int32 ``[B, K, W]``: the item's key block (the last items, past the work, repeat the
      last block and have no token).
    first: int32 ``[B, K, W]``: 1 on the first item of its block (dk, dv start there).
    last: int32 ``[B, K, W]``: 1 on the last item of its block (dk, dv are written there).
    live: int32 ``[B, K, W]``: the item's tokens (0: nothing to compute).
    token: int32 ``[B, K, W * rows]``: each row's query token (-1 for padding rows).
    pos: int32 ``[B, T, K, n]``: the first row of each real slot's token in its item (0 for
      the padding slots; :func:`slot_valid` tells them apart).
  """

  block: Array
  first: Array
  last: Array
  live: Array
  token: Array
  pos: Array


def work_list(blocks: Blocks, plan: Plan) -> WorkList:
  """The :class:`WorkList` of the canonical blocks (sorts ``T * n`` pairs per (batch row,
  key/value head))."""
  T, n, nb, tokens, rows, G, W = plan.T, plan.n, plan.nb, plan.tokens, plan.rows, plan.G, plan.W

  def one(idx, count):  # [T, n], [T] of one (batch row, key/value head)
    valid = jnp.arange(n)[None, :] < count[:, None]
    key = jnp.where(valid, idx, nb).reshape(T * n)
    order = jnp.argsort(key, stable=True)  # by block, tokens ascending within one
    block_sorted = key[order]
    token_sorted = (order // n).astype(jnp.int32)
    per_block = jnp.zeros((nb + 1,), jnp.int32).at[key].add(1)[:nb]
    start = jnp.cumsum(per_block) - per_block  # first sorted pair of each block
    items = jnp.maximum(1, -(-per_block // tokens))
    item_end = jnp.cumsum(items)
    item_start = item_end - items
    b = jnp.minimum(block_sorted, nb - 1)
    r = jnp.arange(T * n, dtype=jnp.int32) - start[b]  # rank of the pair in its block
    item = item_start[b] + r // tokens
    slot = item * tokens + r % tokens
    real = block_sorted < nb
    slot = jnp.where(real, slot, W * tokens)  # dropped below
    token_of_slot = jnp.full((W * tokens + 1,), -1, jnp.int32).at[slot].set(token_sorted)[:-1]
    row_token = jnp.repeat(token_of_slot.reshape(W, tokens), G, axis=1)
    row_token = jnp.pad(row_token, ((0, 0), (0, rows - tokens * G)), constant_values=-1)
    base = item * rows + (r % tokens) * G
    pos = jnp.zeros((T * n,), jnp.int32).at[order].set(jnp.where(real, base, 0))
    w = jnp.arange(W, dtype=jnp.int32)
    blk = jnp.minimum(jnp.searchsorted(item_end, w, side="right"), nb - 1).astype(jnp.int32)
    live = jnp.clip(per_block[blk] - (w - item_start[blk]) * tokens, 0, tokens)
    live = jnp.where(w < item_end[-1], live, 0)
    first = jnp.concatenate([jnp.ones((1,), bool), blk[1:] != blk[:-1]])
    last = jnp.concatenate([blk[1:] != blk[:-1], jnp.ones((1,), bool)])
    return (
      blk,
      first.astype(jnp.int32),
      last.astype(jnp.int32),
      live.astype(jnp.int32),
      row_token.reshape(W * rows),
      pos.reshape(T, n),
    )

  idx = jnp.moveaxis(blocks.idx, 2, 1)  # [B, K, T, n]
  count = jnp.moveaxis(blocks.count, 2, 1)
  blk, first, last, live, token, pos = jax.vmap(jax.vmap(one))(idx, count)
  return WorkList(blk, first, last, live, token, jnp.moveaxis(pos, 1, 2))


def gather_rows(x: Array, work: WorkList, plan: Plan) -> Array:
  """``x [B, T, N, X]`` in the work items' rows: ``[B, K, W * rows, X]`` (row of token
  ``t``, head ``g``: ``x[b, t, kh * G + g]``; zeros for padding rows)."""
  B, T, K, G, W, X = plan.B, plan.T, plan.K, plan.G, plan.W, x.shape[-1]
  xg = jnp.moveaxis(jnp.reshape(x, (B, T, K, G, X)), 2, 1)  # [B, K, T, G, X]
  tok = work.token.reshape(B, K, W, plan.rows)[..., ::G][..., : plan.tokens]  # [B, K, W, tokens]
  b = jnp.arange(B)[:, None, None, None]
  kh = jnp.arange(K)[None, :, None, None]
  g = jnp.where((tok >= 0)[..., None, None], xg[b, kh, jnp.maximum(tok, 0)], 0)
  g = g.reshape(B, K, W, plan.tokens * G, X)
  g = jnp.pad(g, ((0, 0), (0, 0), (0, 0), (0, plan.rows - plan.tokens * G), (0, 0)))
  return g.reshape(B, K, W * plan.rows, X)


def parts_of_rows(x: Array, work: WorkList, blocks: Blocks, plan: Plan) -> Array:
  """The rows ``x [B, K, W * rows, X]`` of each (token, slot): ``[B, T, K, n, G, X]`` (the
  padding slots read row 0)."""
  rows = work.pos[..., None] + jnp.arange(plan.G, dtype=jnp.int32).reshape(1, 1, 1, 1, -1)
  rows = jnp.where(slot_valid(blocks)[..., None], rows, 0)
  b = jnp.arange(plan.B)[:, None, None, None, None]
  kh = jnp.arange(plan.K)[None, None, :, None, None]
  return x[b, kh, rows]


def merge_parts(out_parts: Array, lse_parts: Array, work, blocks, plan: Plan):
  """The ``"kv"`` order's result from its parts: ``(out [B, T, N, Hv] float32, residual rows
  {name: [B, T, N, 1]})``.

  Each (token, slot) part was computed with the normaliser's ``merge_part`` (softmax) over
  its block: ``out_p`` and its log-normaliser ``lse_p``. For a softmax-like normaliser the
  whole row is the normaliser over the parts' ``lse_p`` as logits, each part's output as its
  value: ``exp(lse_p - L)`` weighs ``out_p`` and ``L`` (null columns included) is the row's
  log-normaliser, which its own ``init`` / ``visit`` / ``finish`` give with the residuals.
  """
  B, T, K, G, N = plan.B, plan.T, plan.K, plan.G, plan.N
  valid = slot_valid(blocks)  # [B, T, K, n]; other slots read row 0, maybe never written
  outs = parts_of_rows(out_parts, work, blocks, plan)  # [B, T, K, n, G, Hv]
  outs = jnp.where(valid[..., None, None], outs, 0.0)
  lses = parts_of_rows(lse_parts, work, blocks, plan)[..., 0]  # [B, T, K, n, G]
  lses = jnp.where(valid[..., None], lses, 0.0)
  z = jnp.moveaxis(lses, 3, 4)  # [B, T, K, G, n]
  allowed = valid[:, :, :, None, :]
  nz = plan.nz
  rows = (B, T, K, G, 1)
  st = nz.init(rows, (B, T, K, G, plan.Hv), False)
  pv = lambda w: jnp.einsum("btkgn,btkngh->btkgh", w, outs)
  st = nz.visit(st, z, allowed, pv, nz.row_inputs(None, None), False, False)
  out, res, _ = nz.finish(st, nz.row_inputs(None, None), False)
  res = {key: jnp.reshape(jnp.broadcast_to(x, rows), (B, T, N, 1)) for key, x in res.items()}
  return jnp.reshape(out, (B, T, N, plan.Hv)), res


def sum_parts(parts: Array, work, blocks, plan: Plan) -> Array:
  """``[B, T, N, X]``: each (token, head)'s rows ``parts [B, K, W * rows, X]`` summed over
  its slots (the ``"kv"`` order's dq)."""
  x = parts_of_rows(parts, work, blocks, plan)  # [B, T, K, n, G, X]
  x = jnp.where(slot_valid(blocks)[..., None, None], x, 0)
  return jnp.reshape(jnp.sum(x, axis=3), (plan.B, plan.T, plan.N, parts.shape[-1]))


def heads_first(x: Array, L: int) -> Array:
  """``[B, S, K, X] -> [B, K, L, X]`` padded with zero rows to ``L``."""
  x = jnp.moveaxis(x, 2, 1)
  return jnp.pad(x, ((0, 0), (0, 0), (0, L - x.shape[2]), (0, 0)))


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m
