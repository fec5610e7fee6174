"""Block-wise (FlashAttention-2 style) dense attention: O(T) memory, skipped blocks.

Query blocks visit only the key blocks their :class:`attnjax.layout.BlockLayout` lists,
keeping the normaliser's online state (no ``T x S`` array is formed); the backward
(custom VJP through ``attnjax._src.kernels.autodiff``) recomputes each visited block. Long
calls scan their query blocks, so the program does not grow with ``T``.

Entry points: :func:`run` (a dense call), :func:`run_layout` (the block-sparse
contract: a static layout and a ``mask_fn`` for partial blocks), :func:`accumulate`
(the ring's step), :func:`twin` (the Pallas kernels' differentiable twin).
Guide: docs/guides/kernels.md, section "The block-wise engine".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import deprecation, empty, logits, static, options, masks, normalizers, validators
from attnjax._src.attention_stats import AttentionStats, stats_from_rows
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.linear_map import as_aval, zeros_of
from attnjax._src.kernels.blockwise.tiles import (
  GPU_BLOCK_K,
  GPU_BLOCK_Q,
  Arrays,
  MaskFn,
  TilePlan,
  add_tile,
  as_rows,
  from_rows,
  gpu_block_sizes,
  gpu_memory_bytes,
  segment_relations,
  sink_rows,
  span,
  target_platform,
  tile_allowed,
  tile_logits,
  tile_of,
  tile_score_mod,
)
from attnjax._src.layout import BlockLayout, intersect, mask_mod_block_table, structural_layout

Array = jnp.ndarray


def structural_mask_fn(opts) -> Optional[MaskFn]:
  """The default ``mask_fn``: causal / window from ``opts`` by
  :func:`attnjax.masks.structural_mask`."""
  if not opts.is_causal and opts.window is None:
    return None
  return functools.partial(masks.structural_mask, is_causal=opts.is_causal, window=opts.window)


# Measured on the 2-core CPU of this project (B=1, N=8, H=64, fp32, causal, interleaved
# best-of-5 against jax.nn in the same run): 512 x 256 blocks ran the T=4096 forward in
# 0.194x jax.nn's time (512 x 512: 0.232x, 1024 x 256: 0.214x) and the T=2048 forward +
# backward in 0.196x (512 x 512: 0.247x, 256 x 256: 0.197x). Large query blocks amortise
# the per-visit overhead; 256-key tiles ([8, 512, 256] fp32, 4 MiB) stay in cache between
# the matmul and the elementwise passes over them. GPU tiles: tiles.gpu_block_sizes.
CPU_BLOCK_Q = 512
CPU_BLOCK_K = 256


def default_block_sizes(
  T: int,
  S: int,
  platform: Optional[str] = None,
  *,
  window: Optional[tuple[int, int]] = None,
  rows: Optional[int] = None,
  is_causal: bool = False,
  **renamed,
) -> tuple[int, int]:
  """``(block_q, block_k)`` for the target, never larger than the sequences.

  The target is ``platform`` (``"cpu"``, ``"cuda"``, ``"tpu"``; ``"gpu"`` means
  ``"cuda"``), else the one a program traced now is compiled for
  (``tiles.target_platform``: the ambient mesh's device, else the default backend's). A
  CPU gets ``CPU_BLOCK_Q x CPU_BLOCK_K``. A GPU gets tiles as large as its memory's
  tile budget allows (``tiles.gpu_block_sizes``: e.g. 2048 x 2048 on an
  H200 for ``rows=16`` at T=16384), or ``GPU_BLOCK_Q x GPU_BLOCK_K`` when
  ``rows`` is None; so does a TPU. A narrow window gets blocks of about half its span (at
  least 128): each query block then computes ~1.5x the allowed pairs instead of
  ~4x with 512-blocks (measured at window=(256, 0): 128-blocks ran T=16384 in
  0.6x the time of 512-blocks).

  Args:
    T, S: query and key lengths.
    platform: the target platform; None: ``tiles.target_platform``. (Its old name
      ``backend=`` still works and warns once.)
    window: the call's window, or None.
    rows: batch times query heads of the call (a GPU's tile budget), or None.
    is_causal: the call is causal (a GPU keeps 4 blocks a side).
  """
  if renamed:  # the old keyword backend=
    given = deprecation.renamed_in("default_block_sizes", renamed, {"backend": "platform"})
    if set(given) != {"platform"} or platform is not None:
      raise TypeError(
        f"default_block_sizes takes platform= (once; backend= is its old name), got "
        f"{sorted(renamed)} with platform={platform!r}"
      )
    platform = given["platform"]
  platform = target_platform() if platform is None else platform
  if platform == "cpu":
    bq, bk = CPU_BLOCK_Q, CPU_BLOCK_K
  elif platform in ("cuda", "gpu") and rows is not None:
    bq, bk = gpu_block_sizes(T, S, rows, gpu_memory_bytes(), is_causal=is_causal)
  else:  # a TPU (whose own kernels cover every call), or a GPU call of unknown rows
    bq, bk = GPU_BLOCK_Q, GPU_BLOCK_K
  if window is not None:
    half_span = (window[0] + window[1] + 1) // 2
    narrow = max(128, 1 << max(0, half_span.bit_length() - 1))  # power of two <= half span
    bq, bk = min(bq, narrow), min(bk, narrow)
  return min(bq, T), min(bk, S)


# A query block's unmasked visits to full-size key blocks run in a lax.fori_loop once there are
# more than this many (keeps the program, and its compile time, O(number of query blocks));
# fewer are unrolled, which lets XLA schedule them freely.
MAX_UNROLLED_FULL_VISITS = 2

# Above this many full-size query blocks, they run in one lax.scan over a traced block index
# (the program and its compile memory no longer grow with T; measured: blockwise causal fwd + bwd
# at T=16384 peaked at 1223 MiB of RSS unrolled, 672 MiB rolled, mostly compiled code); at most
# this many, and a ragged last query block always, are unrolled: XLA schedules unrolled blocks
# a little better (rolled ran T=4096, 8 blocks of 512, ~2-4% slower in-process on 2 cores).
MAX_UNROLLED_Q_BLOCKS = 8


def _split_visits(c: TilePlan, i: int, rolled: bool) -> tuple[list, list]:
  """Query block ``i``'s visits as ``(looped, unrolled)`` lists of ``(j, needs_mask)``.

  Looped: visits to full-size key blocks, except block 0 when statistics are
  asked for (its first column feeds ``sink_mass``). In an unrolled query block
  they are looped only when more than ``MAX_UNROLLED_FULL_VISITS`` are unmasked.
  """
  L = c.layout
  visits = L.visits(i)
  looped = [
    (j, nm)
    for j, nm in visits
    if (j != 0 or not c.with_stats) and L.kv_range(j)[1] - L.kv_range(j)[0] == L.block_k
  ]
  if not rolled and sum(not nm for _, nm in looped) <= MAX_UNROLLED_FULL_VISITS:
    looped = []
  return looped, [(j, nm) for j, nm in visits if (j, nm) not in looped]


@dataclasses.dataclass(frozen=True)
class _Rolled:
  """The visits of the leading ``n`` full-size query blocks, as tables a traced ``i`` indexes.

  ``kv [n, m]``: looped key blocks (padded with 0); ``state [n, m]``: 0 padding,
  1 unmasked, 2 masked; ``specials``: ``(j, state [n])`` for each key block
  visited outside the loop (block 0 with statistics, a ragged last block).
  """

  n: int
  kv: np.ndarray
  state: np.ndarray
  specials: tuple


def _rolled_visits(c: TilePlan) -> Optional[_Rolled]:
  """The query-block loop's tables, or None when every query block is unrolled (at most
  ``MAX_UNROLLED_Q_BLOCKS`` of them, unless the plan rolls them all).

  A plan that rolls a short call (at most ``MAX_UNROLLED_Q_BLOCKS`` query blocks) evaluates
  the mask on every visit: one visit body instead of a masked and an unmasked one (a pattern
  at T=128 in blocks of 16: 40-46 XLA computations instead of 39-61 forward, 88-101 instead
  of 86-125 with the gradient; a short call's compile time outweighs its run time).
  """
  L = c.layout
  n = c.T // L.block_q
  if n <= (1 if c.roll_query_blocks else MAX_UNROLLED_Q_BLOCKS):
    return None
  # Visit states: 0 padding, 1 unmasked, 2 masked (see _Rolled).
  state_of = lambda needs_mask: 2 if needs_mask or n <= MAX_UNROLLED_Q_BLOCKS else 1
  rows, specials = [], {}
  for i in range(n):
    looped, unrolled = _split_visits(c, i, rolled=True)
    rows.append(looped)
    for j, nm in unrolled:
      specials.setdefault(j, np.zeros(n, np.int32))[i] = state_of(nm)
  m = max(1, max(len(r) for r in rows))
  kv, state = np.zeros((n, m), np.int32), np.zeros((n, m), np.int32)
  for i, r in enumerate(rows):
    for t, (j, nm) in enumerate(r):
      kv[i, t], state[i, t] = j, state_of(nm)
  return _Rolled(n, kv, state, tuple(sorted(specials.items())))


def _visit_blocks(
  c: TilePlan,
  relation,
  i,
  carry,
  visit,
  rolled: Optional[_Rolled] = None,
  tile=None,
  remat: bool = False,
):
  """Folds ``visit(carry, k0, tk, needs_mask, seg_mask, first)`` over query block ``i``'s visits.

  ``i`` is a static int, or a traced index into ``rolled``'s tables (the
  query-block loop). The looped visits (see :func:`_split_visits`) run in one
  ``lax.fori_loop`` with a traced ``k0`` and a ``lax.cond`` / ``lax.switch`` on
  the visit's state (unmasked blocks evaluate no mask; in the query-block loop
  padding entries skip). One loop body per query block keeps the program small
  and lets XLA reuse one set of tile buffers (unrolled visits each got their
  own). Ragged key blocks, and every visit of short rows, are unrolled (in the
  query-block loop: a ``lax.switch`` on whether block ``i`` visits them).
  With segment ids (or a ``mask_mod`` classified at run time) each visit is
  wrapped in ``lax.switch`` on the run-time block relation: a block whose query
  and key segments cannot meet (or that the ``mask_mod`` masks entirely) costs a
  few scalar comparisons (only the chosen branch runs), and a block inside one
  segment (fully allowed) pays no segment comparison (no ``mask_mod`` call);
  ``seg_mask`` is True on the ``MASKED`` branch.

  With ``tile(k0, tk, needs_mask, seg_mask, first) -> d`` the branches compute
  only the visit's tile results ``d`` (a skipped visit gives zeros) and
  ``visit(carry, d, k0, tk)`` folds them in after the branch: large
  accumulators (the backward's ``dk`` / ``dv``) then never pass through a
  conditional, which otherwise copies them on every visit (measured: the
  rolled causal backward at T=4096 ran 1.5x slower).

  With ``remat`` each visit, its branch included, is rematerialised (``jax.checkpoint``), for
  a caller differentiated by autodiff: the loop then keeps only its carry per visit. The
  checkpoint sits outside the branch: a residual leaving a ``lax.switch`` is that branch's
  output, which the loop would stack once per visit even for the loop-invariant keys and
  values (T=8192: [32, B, K, S, H] per array), where from outside it is the loop's own input.
  """
  L = c.layout

  def one(carry, j, k0, tk, needs_mask, first):
    """The visit's branch result: a new carry, or (with ``tile``) its tile results."""

    def body(seg_mask):
      if tile is None:
        return visit(carry, k0, tk, needs_mask, seg_mask, first)
      return tile(k0, tk, needs_mask, seg_mask, first)

    if not c.runtime_skip:
      return body(False)
    return jax.lax.switch(
      relation(i, j), [lambda: skip(carry, k0, tk, first), lambda: body(False), lambda: body(True)]
    )

  def skip(carry, k0, tk, first):
    if tile is None:
      return carry
    shapes = jax.eval_shape(lambda: tile(k0, tk, False, False, first))
    return jax.tree.map(lambda s: zeros_of(as_aval(s)), shapes)

  def fold(carry, result, k0, tk):
    return result if tile is None else visit(carry, result, k0, tk)

  def by_state(state, carry, j, k0, tk, first, has):
    """The visit's branch (0 skip, 1 unmasked, 2 masked); only the states in ``has`` compiled."""
    branches = [
      lambda: skip(carry, k0, tk, first),
      lambda: one(carry, j, k0, tk, False, first),
      lambda: one(carry, j, k0, tk, True, first),
    ]
    kept = [b for b, h in zip(branches, has) if h]
    if len(kept) == 1:
      return fold(carry, kept[0](), k0, tk)
    index = jnp.asarray(np.cumsum(has) - 1, jnp.int32)[state]  # state -> its branch in kept
    return fold(carry, jax.lax.switch(index, kept), k0, tk)

  if isinstance(i, int):
    looped, unrolled = _split_visits(c, i, rolled=False)
    kv = np.asarray([j for j, _ in looped], np.int32)
    state = np.asarray([1 + nm for _, nm in looped], np.int32)
    states_seen = state
  else:  # the query-block loop: block i's row of the tables
    unrolled = ()
    kv, state = jnp.asarray(rolled.kv)[i], jnp.asarray(rolled.state)[i]
    states_seen = rolled.state

  has = tuple(bool((states_seen == s).any()) for s in range(3))
  if has[1] or has[2]:  # some looped visit is real (else the loop would only skip)
    kv, state = jnp.asarray(kv), jnp.asarray(state)

    def step(n, carry):
      j = kv[n]
      return by_state(state[n], carry, j, j * L.block_k, L.block_k, False, has)

    carry = jax.lax.fori_loop(0, kv.shape[0], jax.checkpoint(step) if remat else step, carry)
  checkpoint = jax.checkpoint if remat else (lambda f: f)
  for j, needs_mask in unrolled:
    k0, k1 = L.kv_range(j)
    first = k0 == 0 and c.holds_key0

    def unrolled_visit(carry, j=j, k0=k0, tk=k1 - k0, needs_mask=needs_mask, first=first):
      return fold(carry, one(carry, j, k0, tk, needs_mask, first), k0, tk)

    carry = checkpoint(unrolled_visit)(carry)
  if not isinstance(i, int):
    for j, states in rolled.specials:
      k0, k1 = L.kv_range(j)
      has = tuple(bool((states == s).any()) for s in range(3))

      def special(carry, index, j=j, k0=k0, tk=k1 - k0, has=has):
        return by_state(index, carry, j, k0, tk, k0 == 0 and c.holds_key0, has)

      carry = checkpoint(special)(carry, jnp.asarray(states)[i])
  return carry


def _query_blocks(c: TilePlan, block, rolled: Optional[_Rolled], carry=None, tie=lambda rows: rows):
  """Runs ``block(i, q0, tq, carry, after) -> (carry, rows)`` over every query block.

  ``rows`` is a pytree of ``[B, K, G, tq, X]`` arrays; returns the final carry
  and the rows concatenated along time (``[B, K, G, T, X]``). The first
  ``rolled.n`` blocks run in one ``lax.scan`` over a traced index (``q0 = i *
  block_q``), the others unrolled. ``after(x)`` returns ``x`` made to wait for
  ``tie(rows)`` of the previous block: otherwise XLA may schedule unrolled blocks
  side by side and keep all their tiles alive at once (in the scan it is the
  identity). ``tie`` picks rows every caller uses: whatever goes into the
  barrier is computed, so rows a caller drops (statistics) must stay out of it.
  """
  L = c.layout
  parts, start = [], 0
  if rolled is not None:
    bq = L.block_q

    def step(carry, i):
      return block(i, i * bq, bq, carry, lambda x: x)

    carry, stacked = jax.lax.scan(step, carry, jnp.arange(rolled.n))

    def join(x):  # [n, B, K, G, tq, X] -> [B, K, G, n * tq, X]
      x = jnp.moveaxis(x, 0, 3)
      return jnp.reshape(x, x.shape[:3] + (x.shape[3] * x.shape[4], x.shape[5]))

    parts.append(jax.tree.map(join, stacked))
    start = rolled.n
  for i in range(start, L.num_q_blocks):
    q0, q1 = L.q_range(i)
    prev = tie(parts[-1]) if parts else None

    def after(x, prev=prev):
      return x if prev is None else jax.lax.optimization_barrier((x, prev))[0]

    carry, rows = block(i, q0, q1 - q0, carry, after)
    parts.append(rows)
  rows = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=3), *parts)
  return carry, rows


# ---------------------------------------------------------------------------
# Mask-only pre-pass: number of allowed keys per row.


def _allowed_counts(c: TilePlan, a: Arrays, relation, rolled: Optional[_Rolled]) -> Array:
  """``[B, K, G, T, 1]`` float32 number of allowed keys of each row."""

  def block(i, q0, tq, carry, after):
    del after
    shape = (c.B, c.K, c.G * tq, 1)

    def visit(total, k0, tk, needs_mask, seg_mask, first):
      del first
      allowed = tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)
      if allowed is None:
        return total + float(tk)
      return total + jnp.broadcast_to(
        jnp.sum(allowed, axis=-1, keepdims=True, dtype=jnp.float32), shape
      )

    total = _visit_blocks(c, relation, i, a.vary(jnp.zeros(shape, jnp.float32)), visit, rolled)
    return carry, from_rows(total, c.G)

  return _query_blocks(c, block, rolled)[1]


# Logits-only pre-pass: each row's log-normaliser (a ``needs_lse`` normaliser: clipped softmax).


def _row_softmax_terms(c: TilePlan, a: Arrays, relation, rolled: Optional[_Rolled]):
  """``(max, log_sum)`` ``[B, K, G, T, 1]`` float32 of each row's allowed logits (both 0 on
  a row with no key): :func:`attnjax._src.normalizers.row_softmax_terms` over the key blocks."""

  def block(i, q0, tq, carry, after):
    shape = (c.B, c.K, c.G * tq, 1)
    qb = after(a.q_rows(c, q0, tq))

    def visit(st, k0, tk, needs_mask, seg_mask, first):
      del first
      z, _ = tile_logits(c, a, qb, q0, tq, k0, tk)
      z = tile_score_mod(c, a, z, a.score_args, q0, tq, k0, tk)
      allowed = tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)
      return normalizers.softmax_terms_visit(st, z, allowed)

    init = jax.tree.map(a.vary, normalizers.softmax_terms_init(shape))
    st = _visit_blocks(c, relation, i, init, visit, rolled)
    m, log_sum = normalizers.softmax_terms_finish(st)
    return carry, (from_rows(m, c.G), from_rows(log_sum, c.G))

  return _query_blocks(c, block, rolled)[1]


# ---------------------------------------------------------------------------
# Forward.


def _fwd_visit(
  c: TilePlan, a: Arrays, st: dict, qb, q0, tq, k0, tk, needs_mask, seg_mask, first, row
) -> dict:
  z, _ = tile_logits(c, a, qb, q0, tq, k0, tk)
  z = tile_score_mod(c, a, z, a.score_args, q0, tq, k0, tk)
  allowed = tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)
  vb = span(a.v, k0, tk, 2)

  def pv(w):
    return jnp.einsum("bkrs,bksh->bkrh", w, vb, preferred_element_type=jnp.float32)

  return c.nz.visit(st, z, allowed, pv, row, c.with_stats, first)


def _forward(c: TilePlan, a: Arrays):
  """Returns ``out [B, K, G, T, Hv]``, residual rows (``[B, K, G, T, 1]``) and statistics."""
  G = c.G
  nz = c.nz
  relation = segment_relations(c, a) if c.runtime_skip else None
  rolled = _rolled_visits(c)
  counts = _allowed_counts(c, a, relation, rolled) if c.needs_counts else None
  terms = _row_softmax_terms(c, a, relation, rolled) if nz.needs_lse else None

  def block(i, q0, tq, carry, after):
    cb = None if counts is None else as_rows(span(counts, q0, tq, 3), G, tq)
    tb = None if terms is None else tuple(as_rows(span(t, q0, tq, 3), G, tq) for t in terms)
    row = nz.row_inputs(sink_rows(c, a, tq), cb, tb)
    qb = after(a.q_rows(c, q0, tq))

    def visit(st, k0, tk, needs_mask, seg_mask, first):
      return _fwd_visit(c, a, st, qb, q0, tq, k0, tk, needs_mask, seg_mask, first, row)

    init = jax.tree.map(
      a.vary, nz.init((c.B, c.K, G * tq, 1), (c.B, c.K, G * tq, c.Hv), c.with_stats)
    )
    st = _visit_blocks(c, relation, i, init, visit, rolled)
    out, res, srow = nz.finish(st, row, c.with_stats)
    rows = {"out": from_rows(out, G), "res": {key: from_rows(val, G) for key, val in res.items()}}
    if c.with_stats:
      shape = out.shape[:3] + (1,)
      rows["stats"] = {key: from_rows(jnp.broadcast_to(val, shape), G) for key, val in srow.items()}
    return carry, rows

  rows = _query_blocks(c, block, rolled, tie=lambda r: r["out"])[1]
  out, res = rows["out"], rows["res"]
  stats = None
  if c.with_stats:
    res["has_key"] = counts > 0
    stats = _collect_stats(c, rows["stats"], a.q_pos)
  return out, res, stats


def count_allowed(c: TilePlan, a: Arrays) -> Array:
  """``[B, K, G, T, 1]`` float32 number of keys of ``c.layout`` each row may attend."""
  relation = segment_relations(c, a) if c.runtime_skip else None
  return _allowed_counts(c, a, relation, _rolled_visits(c))


def accumulate(c: TilePlan, a: Arrays, counts: Optional[Array], state: dict) -> dict:
  """The normaliser's online ``state`` after the visits of ``c.layout``, without finishing.

  ``state`` holds rows ``[B, K, G, T, X]`` (:meth:`Normalizer.init`'s entries,
  time on axis 3); ``counts`` ``[B, K, G, T, 1]`` are the rows' allowed keys
  over the whole call (None unless the normaliser or statistics need them). A
  caller that sees the keys in several parts (a ring over devices) carries the
  state from part to part and finishes once.
  """
  G, nz = c.G, c.nz
  relation = segment_relations(c, a) if c.runtime_skip else None
  rolled = _rolled_visits(c)

  def block(i, q0, tq, carry, after):
    cb = None if counts is None else as_rows(span(counts, q0, tq, 3), G, tq)
    row = nz.row_inputs(sink_rows(c, a, tq), cb)
    qb = after(a.q_rows(c, q0, tq))
    st = {key: as_rows(span(val, q0, tq, 3), G, tq) for key, val in state.items()}

    def visit(st, k0, tk, needs_mask, seg_mask, first):
      return _fwd_visit(c, a, st, qb, q0, tq, k0, tk, needs_mask, seg_mask, first, row)

    st = _visit_blocks(c, relation, i, st, visit, rolled)
    return carry, {key: from_rows(val, G) for key, val in st.items()}

  return _query_blocks(c, block, rolled, tie=lambda r: r["acc"])[1]


def _to_bnt(c: TilePlan, x: Array) -> Array:
  """``[Bx, Kx, Gx, T, 1]`` rows -> ``[B, N, T]``."""
  x = jnp.broadcast_to(x, (c.B, c.K, c.G, c.T, 1))
  return jnp.reshape(x, (c.B, c.K * c.G, c.T))


def _collect_stats(c: TilePlan, rows: dict, q_positions: Optional[Array]) -> tuple:
  cat = {key: _to_bnt(c, val) for key, val in rows.items()}
  q_positions = jnp.arange(c.T) if q_positions is None else q_positions
  return stats_from_rows(cat, q_positions, c.stats_axis, empty_logsumexp=c.opts.empty_row_logsumexp)


# ---------------------------------------------------------------------------
# Backward: recompute each visited block.


def _backward(c: TilePlan, a: Arrays, res: dict, out: Array, d_out: Array, d_lse: Optional[Array]):
  """Gradients ``(dq [B, K, G, T, H], dk [B, K, S, H], dv, dbias, dsink, dargs)``.

  ``dargs`` (float32, one per ``score_mod_args`` array) is accumulated over the
  visited blocks from a VJP of ``score_mod`` on each tile.
  """
  G = c.G
  relation = segment_relations(c, a) if c.runtime_skip else None
  rolled = _rolled_visits(c)
  # D_i = <dO_i, O_i>: the softmax-family row term (and softpick's denominator term); a
  # normaliser whose row term is not that (clipped softmax) sums it over the tiles first.
  if c.nz.row_dot_of_output:
    row_dot = jnp.sum(d_out * out, axis=-1, keepdims=True)  # [B, K, G, T, 1]
  else:
    row_dot = _tile_row_dot(c, a, res, d_out, relation, rolled)
  g = None
  if d_lse is not None:
    g = jnp.where(res["has_key"], d_lse, 0.0)

  zeros = lambda shape: a.vary(jnp.zeros(shape, jnp.float32))
  dk = zeros((c.B, c.K, c.S, c.H))
  dv = zeros((c.B, c.K, c.S, c.Hv))
  dbias = None if a.bias is None else zeros(a.bias.shape)
  dargs = tuple(zeros(jnp.shape(x)) for x in a.score_args)
  dsink = zeros((1, c.K, G, 1, 1)) if c.has_sink else None

  def block(i, q0, tq, carry, after):
    dk, dv, dbias, dsink, dargs = carry

    def rows(x):
      return None if x is None else as_rows(span(x, q0, tq, 3), G, tq)

    qb, do_b, dk, dv = after((a.q_rows(c, q0, tq), rows(d_out), dk, dv))
    rd_b, g_b = rows(row_dot), rows(g)
    res_b = {key: rows(val) for key, val in res.items() if key != "has_key"}
    if c.has_sink:
      term = from_rows(c.nz.null_grad(sink_rows(c, a, tq), res_b, rd_b, g_b), G)
      dsink = dsink + jnp.sum(term, axis=(0, 3, 4), keepdims=True)

    def tile(k0, tk, needs_mask, seg_mask, first):
      del first
      return _bwd_visit(c, a, qb, q0, tq, k0, tk, needs_mask, seg_mask, do_b, rd_b, g_b, res_b)

    def visit(carry, d, k0, tk):
      del tk
      dq_b, dk, dv, dbias, dargs = carry
      if dargs:
        dargs = tuple(acc + g for acc, g in zip(dargs, d["dargs"]))
      dk = add_tile(dk, d["dk"], (0, 0, k0, 0))
      dv = add_tile(dv, d["dv"], (0, 0, k0, 0))
      if dbias is not None:
        dbias = add_tile(
          dbias,
          d["dbias"],
          (0, 0, 0, q0 if dbias.shape[3] != 1 else 0, k0 if dbias.shape[4] != 1 else 0),
        )
      return dq_b + d["dq"], dk, dv, dbias, dargs

    dq_b = a.vary(jnp.zeros((c.B, c.K, G * tq, c.H), jnp.float32))
    dq_b, dk, dv, dbias, dargs = _visit_blocks(
      c, relation, i, (dq_b, dk, dv, dbias, dargs), visit, rolled, tile=tile
    )
    return (dk, dv, dbias, dsink, dargs), from_rows(dq_b, G)

  (dk, dv, dbias, dsink, dargs), dq = _query_blocks(c, block, rolled, (dk, dv, dbias, dsink, dargs))
  if c.opts.similarity == "dot":
    dq = dq * c.opts.scale
  return dq, dk, dv, dbias, dsink, dargs


def _tile_row_dot(c: TilePlan, a: Arrays, res: dict, d_out: Array, relation, rolled) -> Array:
  """``[B, K, G, T, 1]``: each row's ``row_dot`` as the sum of the normaliser's
  ``row_dot_tile`` over its tiles (a backward pre-pass; ``dp = dO V^T`` recomputed)."""
  G = c.G

  def block(i, q0, tq, carry, after):
    def rows(x):
      return as_rows(span(x, q0, tq, 3), G, tq)

    qb, do_b = after((a.q_rows(c, q0, tq), rows(d_out)))
    res_b = {key: rows(val) for key, val in res.items() if key != "has_key"}

    def visit(total, k0, tk, needs_mask, seg_mask, first):
      del first
      z, _ = tile_logits(c, a, qb, q0, tq, k0, tk)
      z = tile_score_mod(c, a, z, a.score_args, q0, tq, k0, tk)
      allowed = tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)
      vb = span(a.v, k0, tk, 2)
      dp = jnp.einsum("bkrh,bksh->bkrs", do_b, vb, preferred_element_type=jnp.float32)
      return total + c.nz.row_dot_tile(z, allowed, dp, res_b)

    init = a.vary(jnp.zeros((c.B, c.K, G * tq, 1), jnp.float32))
    total = _visit_blocks(c, relation, i, init, visit, rolled)
    return carry, from_rows(total, G)

  return _query_blocks(c, block, rolled)[1]


def _bwd_visit(
  c: TilePlan, a: Arrays, qb, q0, tq, k0, tk, needs_mask, seg_mask, do_b, rd_b, g_b, res_b
) -> dict:
  z_pre, capped = tile_logits(c, a, qb, q0, tq, k0, tk)
  mod_vjp = None
  if c.opts.score_mod is None:
    z = z_pre
  else:
    # Typed as varying like the tile (inside shard_map): the tile's part of their cotangent then
    # stays this device's, summed over devices once, after every tile (autodiff.invariant_like),
    # not by a collective inside a visit (visits differ between devices of a ring).
    z, mod_vjp = jax.vjp(
      lambda zz, args: tile_score_mod(c, a, zz, args, q0, tq, k0, tk),
      z_pre,
      tuple(
        a.vary(x.astype(jnp.float32)) if jnp.issubdtype(x.dtype, jnp.floating) else x
        for x in a.score_args
      ),
    )
  allowed = tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)
  kb = span(a.k, k0, tk, 2)
  vb = span(a.v, k0, tk, 2)
  dp = jnp.einsum("bkrh,bksh->bkrs", do_b, vb, preferred_element_type=jnp.float32)
  w, dz = c.nz.tile_backward(z, allowed, dp, res_b, rd_b, g_b)

  d = {"dv": jnp.einsum("bkrs,bkrh->bksh", w, do_b, preferred_element_type=jnp.float32)}
  if mod_vjp is not None:
    if allowed is not None:  # a modifier's derivative at a masked pair must not leak in
      dz = jnp.where(allowed, dz, 0.0)
    dz, dargs = mod_vjp(dz)
    if allowed is not None:
      dz = jnp.where(allowed, dz, 0.0)
    d["dargs"] = tuple(
      jnp.zeros(jnp.shape(x), jnp.float32)
      if g is None or g.dtype == jax.dtypes.float0
      else g.astype(jnp.float32)
      for x, g in zip(a.score_args, dargs)
    )
  if a.bias is not None:
    shape = tile_of(a.bias, q0, tq, k0, tk).shape
    dz5 = from_rows(dz, c.G)
    axes = tuple(ax for ax in range(5) if shape[ax] == 1 and dz5.shape[ax] != 1)
    d["dbias"] = jnp.sum(dz5, axis=axes, keepdims=True) if axes else dz5
  ds = logits.softcap_grad(dz, c.opts.softcap, capped=capped)
  dq = jnp.einsum("bkrs,bksh->bkrh", ds, kb, preferred_element_type=jnp.float32)
  dk = jnp.einsum("bkrs,bkrh->bksh", ds, qb, preferred_element_type=jnp.float32)
  if c.opts.similarity != "dot":
    f = -2.0 * c.opts.scale
    dq = f * (qb * jnp.sum(ds, axis=-1, keepdims=True) - dq)
    col = jnp.sum(ds, axis=2)[..., None]  # [B, K, tk, 1]
    dk = f * (kb * col - dk)
  d["dq"], d["dk"] = dq, dk
  return d


# ---------------------------------------------------------------------------
# The kernel with its custom VJP.


def run_layout(
  inputs,
  opts,
  *,
  layout: BlockLayout,
  mask_fn: Optional[MaskFn] = None,
  use_default_mask_fn: bool = True,
  positions=None,
  mod_table: bool = False,
  stats_axis: Optional[str] = None,
  roll_query_blocks: bool = False,
):
  """Block-wise attention of a validated dense call over a static
  :class:`~attnjax.layout.BlockLayout`.

  Args:
    inputs: :class:`attnjax.options.DenseInputs` (from ``dense.prepare``).
    opts: :class:`attnjax.options.DenseOptions`.
    layout: which key blocks each query block visits (see the module docstring).
      With ``opts.mask_mod`` the layout must already exclude the blocks it
      masks (see ``layout_for``), or ``mod_table`` be True.
    mask_fn: ``(q_positions [tq], k_positions [tk]) -> bool [B|1, 1, tq, tk]`` or None,
      evaluated on visits flagged ``needs_mask``. If None and
      ``use_default_mask_fn``, :func:`structural_mask_fn` of ``opts``.
    use_default_mask_fn: False makes ``mask_fn=None`` mean "no static mask".
    positions: None, or int ``(q_positions [T], k_positions [S])``: the global
      positions that ``score_mod`` / ``mask_mod`` see for each row and key
      slot (chunked or gathered sparse calls).
    mod_table: ``opts.mask_mod``'s blocks are classified at run time (its
      arguments are traced, so no static layout could be built): blocks it
      masks entirely are skipped, fully allowed ones do not evaluate it.
    stats_axis: None, or the ``shard_map`` axis whose devices hold the other query
      rows of the call (context parallelism, all-gather): the statistics' means and
      maximum are then over the rows of every device (:func:`attnjax._src.attention_stats.stats_from_rows`).
    roll_query_blocks: run every full-size query block in one loop over tables of its
      visits, however few (a pattern's layout, whose rows differ: unrolled, each compiles
      its own visits; see :data:`MAX_UNROLLED_Q_BLOCKS`).

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)`` when
    ``opts.return_stats``.
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  if (layout.q_len, layout.kv_len) != (T, S):
    raise ValueError(
      f"layout is for q_len={layout.q_len}, kv_len={layout.kv_len} but the call has "
      f"T={T}, S={S} (q {tuple(q.shape)}, k {tuple(k.shape)})"
    )
  if mask_fn is None and use_default_mask_fn:
    mask_fn = structural_mask_fn(opts)
  G = N // K
  mod_table = bool(mod_table and opts.mask_mod is not None)
  c = TilePlan(
    opts=opts,
    layout=layout,
    mask_fn=mask_fn,
    B=B,
    T=T,
    S=S,
    K=K,
    G=G,
    H=H,
    Hv=Hv,
    has_sink=inputs.sink_logits is not None,
    has_segments=inputs.q_segment_ids is not None,
    mod_table=mod_table,
    stats_axis=stats_axis,
    roll_query_blocks=roll_query_blocks,
  )
  return _run(c, inputs, positions)


def run_gathered(inputs, opts, *, q_positions: Array, stats_axis: str):
  """This device's query rows against every key of a sequence sharded over ``stats_axis``.

  The all-gather strategy of context parallelism with statistics
  (:mod:`attnjax._src.parallel.strategies`): ``inputs`` hold the local queries (at global
  positions ``q_positions`` ``[T]``) and the gathered keys / values in natural order;
  ``opts`` carry no causal / window structure (express it in ``opts.mask_mod``, which
  sees global positions here, as ``score_mod`` does, and whose blocks are classified per
  call). The statistics are those of the whole sequence (:func:`attnjax._src.attention_stats.stats_from_rows` over the
  axis); ``logsumexp`` is the local rows', with its gradient.
  """
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  block_q, block_k = default_block_sizes(T, S)
  layout = structural_layout(T, S, block_q, block_k, is_causal=False, window=None)
  positions = (jnp.asarray(q_positions, jnp.int32), jnp.arange(S, dtype=jnp.int32))
  return run_layout(
    inputs,
    opts,
    layout=layout,
    positions=positions,
    mod_table=opts.mask_mod is not None,
    stats_axis=stats_axis,
  )


def _arrays(c: TilePlan, x: tuple, nondiff: tuple) -> Arrays:
  """:class:`Arrays` of ``x = (q, k, v, bias, sink, score_args)`` and ``nondiff = (mask,
  q_seg, kv_seg, mask_args, positions)``, with the ``mask_mod`` block table where the call
  classifies its blocks at run time."""
  mask, q_seg, kv_seg, mask_args, pos = nondiff
  mod_any = None
  if c.mod_table:
    # Over batch rows and heads only when the modifier reads b / n (as layout_for).
    used_b, used_n = index_use(c.opts.mask_mod, mask_args)
    mod_any = mask_mod_block_table(
      c.opts.mask_mod,
      mask_args,
      c.layout,
      c.B if used_b else 1,
      c.K * c.G if used_n else 1,
      positions=pos,
    )
  return Arrays(c, x[0], x[1], x[2], x[3], x[4], mask, q_seg, kv_seg, x[5], mask_args, pos, mod_any)


def _to_output(c: TilePlan, o: Array, dtype) -> Array:
  """Output rows ``[B, K, G, T, Hv]`` as ``[B, T, N, Hv]`` in ``dtype``."""
  o = jnp.transpose(o, (0, 3, 1, 2, 4))  # [B, T, K, G, Hv]
  return jnp.reshape(o, (c.B, c.T, c.K * c.G, c.Hv)).astype(dtype)


def _run_weights(c: TilePlan, inputs, positions):
  """A weights-only normaliser (:class:`attnjax.normalizers.WeightsOnly`) over the layout.

  Plain JAX, differentiated by autodiff (reverse and forward mode): per query block, pass 1
  folds the row quantities it declares (and, with statistics, the logsumexp) over the
  block's visits, pass 2 its weights times V, tile by tile; the same visits, skips and masks
  as the online kernel. Each query block and each visit is rematerialised
  (``jax.checkpoint``): the backward keeps the query rows and the visits' states, never a
  tile, so memory stays O(T).
  """
  nz, G = c.nz, c.G
  x = (inputs.q, inputs.k, inputs.v, inputs.bias, None, inputs.score_mod_args)
  nondiff = (inputs.mask, inputs.q_segment_ids, inputs.kv_segment_ids, inputs.mask_mod_args)
  a = _arrays(c, x, nondiff + (positions,))
  relation = segment_relations(c, a) if c.runtime_skip else None
  rolled = _rolled_visits(c)
  quantities = nz.row_quantities
  counts = None
  if "count" in quantities or c.with_stats:
    counts = _allowed_counts(c, a, relation, rolled)
  params = {
    p.name: jnp.reshape(x.astype(jnp.float32), (1, c.K, G, 1, 1) if x.shape[1] > 1 else (1,) * 5)
    for p, x in zip(nz.params, inputs.normalizer_params)
  }
  first_pass = c.with_stats or "max" in quantities or "logsumexp" in quantities

  def block(i, q0, tq, carry, after):
    rows, acc = (c.B, c.K, G * tq, 1), (c.B, c.K, G * tq, c.Hv)
    cb = None if counts is None else as_rows(span(counts, q0, tq, 3), G, tq)

    def tile(qb, k0, tk, needs_mask, seg_mask):
      z, _ = tile_logits(c, a, qb, q0, tq, k0, tk)
      z = tile_score_mod(c, a, z, a.score_args, q0, tq, k0, tk)
      return z, tile_allowed(c, a, q0, tq, k0, tk, needs_mask, seg_mask)

    def compute(qb):
      row = {name: as_rows(val, G, tq) for name, val in params.items()}
      if "count" in quantities:
        row["count"] = jnp.maximum(cb, 1.0)
      lse, filler = None, 0.0
      if first_pass:

        def count_visit(st, k0, tk, needs_mask, seg_mask, first):
          del first
          z, allowed = tile(qb, k0, tk, needs_mask, seg_mask)
          return nz.quantities_visit(st, z, allowed, row)

        init = jax.tree.map(a.vary, nz.quantities_init(rows))
        found = nz.quantities_finish(
          _visit_blocks(c, relation, i, init, count_visit, rolled, remat=True)
        )
        row.update({key: found[key] for key in ("max", "logsumexp") if key in quantities})
        lse, filler = found["logsumexp"], jax.lax.stop_gradient(found["max"])
      weight_row = dict(row, filler=filler)

      def weight_visit(st, k0, tk, needs_mask, seg_mask, first):
        z, allowed = tile(qb, k0, tk, needs_mask, seg_mask)
        vb = span(a.v, k0, tk, 2)

        def pv(w):
          return jnp.einsum("bkrs,bksh->bkrh", w, vb, preferred_element_type=jnp.float32)

        return nz.weights_visit(st, z, allowed, pv, weight_row, c.with_stats, first)

      init = jax.tree.map(a.vary, nz.weights_init(rows, acc, c.with_stats))
      st = _visit_blocks(c, relation, i, init, weight_visit, rolled, remat=True)
      return nz.weights_finish(st, cb, lse, c.with_stats)

    out, srow = jax.checkpoint(compute)(after(a.q_rows(c, q0, tq)))
    result = {"out": from_rows(out, G)}
    if c.with_stats:
      result["stats"] = {
        key: from_rows(jnp.broadcast_to(val, rows), G) for key, val in srow.items()
      }
    return carry, result

  result = _query_blocks(c, block, rolled, tie=lambda r: r["out"])[1]
  out = _to_output(c, result["out"], inputs.q.dtype)
  if not c.opts.return_stats:
    return out
  sink_mass, entropy, max_logit, lse, row_sum = _collect_stats(c, result["stats"], a.q_pos)
  return out, AttentionStats(
    sink_mass=sink_mass, entropy=entropy, max_logit=max_logit, logsumexp=lse, row_sum=row_sum
  )


def _run(c: TilePlan, inputs, positions):
  """The custom-VJP (and custom-JVP, see :mod:`attnjax._src.kernels.autodiff`) kernel of a call;
  a weights-only normaliser's is :func:`_run_weights`."""
  if c.nz.weights_only:
    return _run_weights(c, inputs, positions)
  B, T, N, H, K, G, Hv = c.B, c.T, c.K * c.G, c.H, c.K, c.G, c.Hv
  q = inputs.q

  def to_output(o):
    return _to_output(c, o, q.dtype)

  def arrays(x, nondiff):
    return _arrays(c, x, nondiff)

  def forward(x, nondiff):
    """The forward pass: ``((output, statistics), (output rows, residual rows))`` (plain JAX)."""
    out, res, stats = _forward(c, arrays(x, nondiff))
    return (to_output(out), stats), (out, res)

  def backward(x, nondiff, saved, cts):
    q, k, v, bias, sink, score_args = x
    out, res = saved
    d_out, d_stats = cts
    a = arrays(x, nondiff)
    d_out = jnp.transpose(jnp.reshape(d_out.astype(jnp.float32), (B, T, K, G, Hv)), (0, 2, 3, 1, 4))
    d_lse = None
    if d_stats is not None and c.opts.return_stats:
      d_lse = jnp.reshape(d_stats[3].astype(jnp.float32), (B, K, G, T, 1))
    dq, dk, dv, dbias, dsink, dargs = _backward(c, a, res, out, d_out, d_lse)
    dq = jnp.reshape(jnp.transpose(dq, (0, 3, 1, 2, 4)), (B, T, N, H)).astype(q.dtype)
    dk = jnp.transpose(dk, (0, 2, 1, 3)).astype(k.dtype)
    dv = jnp.transpose(dv, (0, 2, 1, 3)).astype(v.dtype)
    if dbias is not None:
      dbias = jnp.reshape(dbias, bias.shape).astype(bias.dtype)
    if dsink is not None:
      dsink = jnp.reshape(dsink, sink.shape).astype(sink.dtype)
    dargs = tuple(_cotangent_like(x, g) for x, g in zip(score_args, dargs))
    return dq, dk, dv, dbias, dsink, dargs

  x = (inputs.q, inputs.k, inputs.v, inputs.bias, inputs.sink_logits, inputs.score_mod_args)
  nondiff = (
    inputs.mask,
    inputs.q_segment_ids,
    inputs.kv_segment_ids,
    inputs.mask_mod_args,
    positions,
  )
  out, stats = autodiff.custom_vjp_with_jvp(forward, backward, x, nondiff, name="blockwise")
  if not c.opts.return_stats:
    return out
  sink_mass, entropy, max_logit, lse, row_sum = stats
  return out, AttentionStats(
    sink_mass=sink_mass, entropy=entropy, max_logit=max_logit, logsumexp=lse, row_sum=row_sum
  )


def _cotangent_like(x, g):
  """A float32 gradient as ``x``'s cotangent (float0 zeros for integer arrays)."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return np.zeros(jnp.shape(x), jax.dtypes.float0)
  return g.astype(x.dtype)


def index_use(fn, args) -> tuple[bool, bool]:
  """Whether a ``mask_mod`` reads its batch and head indices (from its jaxpr)."""
  return _index_use(fn, args)


def _index_use(fn, args, lead: tuple = ()) -> tuple[bool, bool]:
  """Whether ``fn(*lead, b, n, i, j, *args)`` reads ``b`` and ``n`` (from its jaxpr)."""
  index = jax.ShapeDtypeStruct((), jnp.int32)
  specs = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args]
  jaxpr = jax.make_jaxpr(fn)(*lead, index, index, index, index, *specs).jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return id(jaxpr.invars[len(lead)]) in read, id(jaxpr.invars[len(lead) + 1]) in read


def layout_for(inputs, opts, block_q: int, block_k: int, base: BlockLayout):
  """``(layout, mod_table)``: ``base`` intersected with ``opts.mask_mod``'s blocks.

  ``opts.block_layout`` (from :func:`attnjax.layout.from_mask_mod`) when given;
  else the mask_mod's blocks found now when its arguments are concrete
  (every element evaluated once per trace, over the batch rows and heads only
  when the modifier reads ``b`` / ``n``); else ``base`` and
  ``mod_table=True`` (blocks skipped at run time from a table evaluated per call).
  """
  if opts.mask_mod is None:
    return base, False
  if opts.block_layout is not None:
    return intersect(base, opts.block_layout), False
  if any(isinstance(x, jax.core.Tracer) for x in inputs.mask_mod_args):
    return base, True
  from attnjax._src.layout import from_mask_mod

  B, N = inputs.q.shape[0], inputs.q.shape[2]
  used = index_use(opts.mask_mod, inputs.mask_mod_args)
  mod_layout = from_mask_mod(
    opts.mask_mod,
    base.q_len,
    base.kv_len,
    block_q,
    block_k,
    *inputs.mask_mod_args,
    batch=B if used[0] else None,
    heads=N if used[1] else None,
  )
  return intersect(base, mod_layout), False


# ---------------------------------------------------------------------------
# Dense registry entry and a public function with explicit block sizes.


def unsupported(inputs, opts) -> list[str]:
  """Reasons the block-wise path cannot run a call: none, every dense option is block-wise."""
  del inputs, opts
  return []


def run(inputs, opts, *, block_q: Optional[int] = None, block_k: Optional[int] = None):
  """The ``implementation="blockwise"`` engine: block sizes, the call's layout, then :func:`run_layout`."""
  q = inputs.q
  T, S = q.shape[1], inputs.k.shape[1]
  if opts.block_layout is not None:  # the caller's layout fixes the block sizes
    block_q, block_k = opts.block_layout.block_q, opts.block_layout.block_k
  dq, dk = default_block_sizes(
    T, S, window=opts.window, rows=q.shape[0] * q.shape[2], is_causal=opts.is_causal
  )
  block_q = dq if block_q is None else min(block_q, T)
  block_k = dk if block_k is None else min(block_k, S)
  layout = structural_layout(T, S, block_q, block_k, is_causal=opts.is_causal, window=opts.window)
  layout, mod_table = layout_for(inputs, opts, block_q, block_k, layout)
  return run_layout(inputs, opts, layout=layout, mod_table=mod_table)


# ---------------------------------------------------------------------------
# This engine as the twin of the dense kernels that JAX cannot differentiate in forward mode.


def split_inputs(inputs) -> tuple[tuple, tuple]:
  """A dense call's arrays without modifier arguments as ``(x, nondiff)``: ``x = (q, k, v,
  bias, sink_logits)`` (differentiable), ``nondiff = (mask, q_segment_ids, kv_segment_ids)``."""
  return (
    (inputs.q, inputs.k, inputs.v, inputs.bias, inputs.sink_logits),
    (inputs.mask, inputs.q_segment_ids, inputs.kv_segment_ids),
  )


def join_inputs(x: tuple, nondiff: tuple):
  """The :class:`attnjax.options.DenseInputs` of :func:`split_inputs`'s ``(x, nondiff)``."""
  (q, k, v, bias, sink), (mask, q_seg, kv_seg) = x, nondiff
  return options.DenseInputs(
    q=q,
    k=k,
    v=v,
    bias=bias,
    mask=mask,
    sink_logits=sink,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
  )


def twin(opts, offsets=None):
  """This engine as another dense kernel's ``twin`` (``attnjax._src.kernels.autodiff``):
  ``(x, nondiff) -> out`` on :func:`split_inputs`'s arrays, differentiable in every mode:
  the call ``opts`` describes (``(out, AttentionStats)`` with ``opts.return_stats``), on the
  shard at ``offsets`` (see :func:`run_shard`)."""
  return lambda x, nondiff: run_shard(join_inputs(x, nondiff), opts, offsets)


def run_shard(inputs, opts, offsets=None):
  """:func:`run` on one shard of a call split by :func:`attnjax._src.sharding.per_shard`.

  A platform kernel's twin runs on the shard the kernel runs on: modifiers reading the
  batch or head index must see the whole call's (as the kernel does), not the shard's.

  Args:
    inputs, opts: the shard's call.
    offsets: ``(batch row, query head)`` where the shard starts in the whole call (an
      :class:`attnjax._src.sharding.ShardOffsets`, int32 scalars traced inside ``shard_map``);
      None: the whole call.
  """
  return run(*shifted_indices(inputs, opts, offsets))


def shifted_indices(inputs, opts, offsets):
  """``(inputs, opts)`` whose ``score_mod`` / ``mask_mod`` read the batch and head indices of
  the whole call on a shard starting at ``offsets`` (see :func:`run_shard`).

  The offsets enter as two more modifier arguments (int32 scalars, no derivative), so that
  no modifier closes over a traced value; a modifier that reads neither index is kept.
  """
  if offsets is None or all(not isinstance(o, jax.core.Tracer) and int(o) == 0 for o in offsets):
    return inputs, opts
  extra = tuple(jnp.asarray(o, jnp.int32) for o in offsets)
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  changes, moved = {}, {}
  if opts.score_mod is not None and any(
    _index_use(opts.score_mod, inputs.score_mod_args, (scalar,))
  ):
    score_mod = opts.score_mod
    changes["score_mod"] = lambda z, b, n, i, j, *a: score_mod(
      z, b + a[-2], n + a[-1], i, j, *a[:-2]
    )
    moved["score_mod_args"] = tuple(inputs.score_mod_args) + extra
  if opts.mask_mod is not None and any(index_use(opts.mask_mod, inputs.mask_mod_args)):
    mask_mod = opts.mask_mod
    changes["mask_mod"] = lambda b, n, i, j, *a: mask_mod(b + a[-2], n + a[-1], i, j, *a[:-2])
    moved["mask_mod_args"] = tuple(inputs.mask_mod_args) + extra
  return dataclasses.replace(inputs, **moved), dataclasses.replace(opts, **changes)


def _attention(q, k, v, *, block_q: Optional[int] = None, block_k: Optional[int] = None, **kwargs):
  """:func:`attnjax.dot_product_attention` on the block-wise path with chosen block sizes.

  Args:
    q, k, v: as :func:`attnjax.dot_product_attention`.
    block_q: query rows per block (None: :func:`default_block_sizes`).
    block_k: keys per block (None: :func:`default_block_sizes`).
    **kwargs: the dense keywords of :class:`attnjax._src.options.DenseKeywords` (``bias``,
      ``mask``, ``is_causal``, ``scale``, ``normalizer``, ``normalizer_params``,
      ``sink_logits``, ``softcap``,
      ``window``, ``segment_ids``, ``similarity``, ``return_stats``, ``score_mod``,
      ``score_mod_args``, ``mask_mod``, ``mask_mod_args``, ``block_layout``,
      ``context_axis``, ``context_strategy``, ``context_layout``); not
      ``implementation`` nor jax.nn's names (``local_window_size``,
      ``query_seq_lengths``, ``key_value_seq_lengths``, ``return_residual``): any other
      keyword is a ``TypeError`` naming it.

  Returns:
    As :func:`attnjax.dot_product_attention`.
  """
  validators.check_positive_int("block_q", block_q, allow_none=True)
  validators.check_positive_int("block_k", block_k, allow_none=True)
  if "implementation" in kwargs:
    raise TypeError("blockwise.attention takes no implementation argument")
  inputs, opts = options.validate(q, k, v, **kwargs)
  if empty.is_empty(q, k):
    return empty.dense(inputs, opts)
  return run(inputs, opts, block_q=block_q, block_k=block_k)


attention = static.jit(
  _attention,
  ("block_q", "block_k") + options.STATIC_NAMES,
  flags=options.FLAGS,
  keywords=options.KEYWORDS,
  name="blockwise.attention",
)
