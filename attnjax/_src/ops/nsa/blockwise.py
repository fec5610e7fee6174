"""NSA's ``"blockwise"`` engine: O(T) memory, no ``[T, S]`` array.

The compressed branch runs through the block-wise kernel over the compressed keys (a
staircase layout: a query block visits only the blocks that have ended for some of its
rows); the selection is computed per query block from that branch's weights (a ``[rows, C]``
tile, no gradient); the selected branch gathers each row's blocks
(:mod:`attnjax._src.kernels.blockwise.selected`, or a platform kernel); the window branch is
the block-wise kernel with ``window=(w, 0)``.
Guide: docs/guides/sparse.md, section "Native sparse attention".
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import empty, logits, normalizers, options
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.kernels.blockwise import selected
from attnjax._src.layout import BlockLayout
from attnjax._src.ops.nsa import rules

Array = jnp.ndarray

# Bytes of one selection tile ([B, N, rows, C] logits and weights, float32).
SELECTION_TILE_BYTES = 16 * 2**20


@functools.lru_cache(maxsize=64)
def staircase_layout(
  T: int, C: int, block_q: int, block_k: int, block_length: int, stride: int
) -> BlockLayout:
  """The block layout of the compressed branch: query ``t`` sees compressed keys
  ``c <= (t - l + 1) / d``; a key block is visited when some row of the query block sees into
  it, unmasked when every row sees all of it."""
  t = np.arange(T)
  hi = np.where(t >= block_length - 1, (t - block_length + 1) // stride, -1)
  hi = np.minimum(hi, C - 1)
  visits = []
  for i in range(-(-T // block_q)):
    lo_row, hi_row = i * block_q, min(T, (i + 1) * block_q) - 1
    reach, floor = hi[hi_row], hi[lo_row]
    row = []
    for j in range(-(-C // block_k)):
      c0, c1 = j * block_k, min(C, (j + 1) * block_k) - 1
      if c0 <= reach:
        row.append((j, not c1 <= floor))
    visits.append(row)
  return BlockLayout.from_visits(T, C, block_q, block_k, visits)


def _compressed_branch(q, k_c, v_c, opts: rules.NSAOptions, want_stats: bool):
  """``out`` (``(out, stats)``) of the compressed branch through the block-wise kernel."""
  B, T, N, _ = q.shape
  C = k_c.shape[1]
  if C == 0:  # no block has ended for any query
    out = jnp.zeros((B, T, N, v_c.shape[3]), q.dtype)
    return (out, empty.empty_stats(B, N, T)) if want_stats else out
  inputs, dense_opts = options.validate(
    q,
    k_c.astype(q.dtype),
    v_c.astype(q.dtype),
    scale=opts.scale,
    normalizer=opts.normalizers[0],
    return_stats=want_stats,
  )
  bq, bk = blockwise.default_block_sizes(T, C)
  layout = staircase_layout(T, C, bq, bk, opts.block_length, opts.stride)
  ends = lambda slots: slots * opts.stride + opts.block_length - 1

  def mask_fn(q_positions, k_slots):
    return (ends(k_slots)[None, :] <= q_positions[:, None])[None, None]

  return blockwise.run_layout(
    inputs, dense_opts, layout=layout, mask_fn=mask_fn, use_default_mask_fn=False
  )


def selection_rows(B: int, N: int, C: int, T: int) -> int:
  """Query rows per step of the selection pass (a power of two, 8 .. 256, at most ``T``)."""
  per_row = max(1, 3 * B * N * max(C, 1) * 4)
  rows = max(8, min(256, SELECTION_TILE_BYTES // per_row))
  rows = 1 << (rows.bit_length() - 1)
  return max(1, min(rows, T))


def selection(q: Array, k_c: Array, opts: rules.NSAOptions, num_keys: int) -> Array:
  """The selected blocks, ``int32 [B, T, K, n]``, one query block of weights at a time.

  Equal to :func:`attnjax._src.ops.nsa.reference.selection`; no gradient. The query blocks
  run in segments (:func:`attnjax._src.kernels.blockwise.selected.causal_segments`), each
  against the compressed blocks that have ended for some of its rows (the others weigh 0 for
  every row of the segment).
  """
  q = jax.lax.stop_gradient(q)
  k_c = jax.lax.stop_gradient(k_c)
  B, T, N, H = q.shape
  C, K = k_c.shape[1], k_c.shape[2]
  o = opts
  work = jnp.promote_types(q.dtype, jnp.float32)
  nsel = rules.num_selection_blocks(num_keys, o.selection_block)
  tq = selection_rows(B, N, C, T)
  nq = -(-T // tq)
  qp = jnp.pad(q.astype(work), [(0, 0), (0, nq * tq - T), (0, 0), (0, 0)])
  kc = k_c.astype(work)
  ends_np = rules.block_ends(C, o.block_length, o.stride)
  nz = normalizers.get(o.normalizers[0])

  def one(i, width: int):
    """Query block ``i`` against the first ``width`` compressed blocks."""
    pos = i * tq + jnp.arange(tq)
    if width == 0:  # no compressed block has ended for any row: every score is 0
      scores = jnp.zeros((B, K, tq, nsel), work)
    else:
      qb = jax.lax.dynamic_slice_in_dim(qp, i * tq, tq, axis=1)
      z = jnp.einsum("btkgh,bskh->bkgts", logits.group_queries(qb, K), kc[:, :width]) * o.scale
      ends = jnp.asarray(ends_np[:width])
      allowed = jnp.broadcast_to((ends[None, :] <= pos[:, None])[None, None, None], z.shape)
      w, _ = nz.weights(z, allowed)
      w = jnp.where(allowed, w, 0.0)
      # The group's heads first (the map is linear), summed as a product with ones: XLA:CPU
      # reduces over this non-minor axis at half the speed (at T=32768, C=512, G=8: the
      # pass took 1.57 s with jnp.sum, its weights and sum 1.29 s of it against 0.64 s).
      heads = jnp.einsum("bkgtc,g->bktc", w, jnp.ones((w.shape[2],), w.dtype))
      heads = jnp.pad(heads, [(0, 0), (0, 0), (0, 0), (0, C - width)])
      scores = rules.selection_scores(
        heads,
        block_length=o.block_length,
        stride=o.stride,
        selection_block=o.selection_block,
        num_keys=num_keys,
      )
    idx = rules.select(
      scores,
      pos,
      selection_block=o.selection_block,
      num_selected=o.num_selected,
      num_initial=o.num_initial,
      num_local=o.num_local,
    )  # [B, K, tq, n]
    return jnp.moveaxis(idx, 2, 1)

  # the compressed blocks ended by a segment's last row
  ended = lambda end: int(np.sum(ends_np <= end - 1))
  idx = selected.causal_segments(one, nq, tq, ended)  # [nq, B, tq, K, n]
  idx = jnp.reshape(jnp.moveaxis(idx, 0, 1), (B, nq * tq, K, o.num_selected))
  return idx[:, :T]


SelectedFn = Callable[..., tuple]


def gathered_selected(q, k, v, idx, opts: rules.NSAOptions, want_stats: bool):
  """The selected branch gathered per query row: ``(out, stats or None)``."""
  out, _, stats = selected.run(
    q,
    k,
    v,
    idx,
    block_size=opts.selection_block,
    scale=opts.scale,
    normalizer=opts.normalizers[1],
    return_stats=want_stats,
    distinct=True,  # rules.select names each block once
  )
  return out, stats


def compute(
  q: Array,
  k: tuple[Array, Array, Array],
  v: tuple[Array, Array, Array],
  k_c: Array,
  v_c: Array,
  gates: Array,
  opts: rules.NSAOptions,
  *,
  selected_branch: Optional[SelectedFn] = None,
):
  """NSA of queries at positions ``0 .. T - 1`` (``T == S``) in O(T) memory.

  Args:
    q, k, v, k_c, v_c, gates, opts: as :func:`attnjax._src.ops.nsa.reference.attend`.
    selected_branch: ``(q, k, v, idx, opts, want_stats) -> (out, stats)`` computing the
      selected branch (None: :func:`gathered_selected`).

  Returns:
    As :func:`attnjax._src.ops.nsa.reference.attend`.
  """
  want = opts.return_stats
  S = k[1].shape[1]
  res_c = _compressed_branch(q, k_c, v_c, opts, want)
  out_c, st_c = res_c if want else (res_c, None)
  idx = selection(q, k_c, opts, S)
  run_selected = selected_branch or gathered_selected
  out_s, st_s = run_selected(q, k[1], v[1], idx, opts, want)
  inputs, dense_opts = options.validate(
    q,
    k[2],
    v[2],
    is_causal=True,
    window=(opts.window, 0),
    scale=opts.scale,
    normalizer=opts.normalizers[2],
    return_stats=want,
  )
  res_w = blockwise.run(inputs, dense_opts)
  out_w, st_w = res_w if want else (res_w, None)
  work = jnp.promote_types(q.dtype, jnp.float32)
  outs = tuple(o.astype(work) for o in (out_c, out_s, out_w))
  out = rules.gate_mix(outs, gates.astype(work)).astype(q.dtype)
  if not want:
    return out
  gate_mean = jnp.mean(jnp.moveaxis(gates.astype(jnp.float32), 1, 2), axis=2)
  return out, rules.NSAStats(st_c, st_s, st_w, gate_mean)
