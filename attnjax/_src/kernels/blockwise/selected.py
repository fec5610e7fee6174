"""Selected-block attention by gathering: each query row attends to the key blocks it chose.

The O(T)-memory engine of :func:`attnjax._src.kernels.selected_reference.selected_attention`
(NSA's selected branch; DSA's top-k keys are blocks of one key). Row-major (:func:`_forward`,
:func:`_backward`): a scan over query blocks gathers each row's ``n`` blocks per KV head and
runs the normaliser on that tile. Block-major, for blocks of :data:`BLOCK_MAJOR_MIN` keys or
more: the selections sorted by the block they name (:func:`_by_block`) form ``[rows * G,
block]`` tiles, for the backward and for softmax's forward without statistics (an online
softmax per row); normalisers with row pre-passes stay row-major. No ``[T, S]`` array.
Differentiable in every mode (``kernels.autodiff``). Guide: docs/guides/sparse.md, section
"Native sparse attention".
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from attnjax._src import normalizers
from attnjax._src.attention_stats import AttentionStats, row_mean
from attnjax._src.kernels import autodiff, selected_reference

Array = jnp.ndarray

# Bytes of gathered keys and values one query block may hold (float32): sets the rows per step.
TILE_BYTES = 8 * 2**20


# Query segments of the selection passes (NSA's block scores, DSA's top-k): segment ``s`` of
# ``SELECTION_SEGMENTS`` scores only what its last row can see (a causal staircase: ~5/8 of
# the ``[T, S]`` work at 4 segments; at T=65536 in fla's configuration NSA's pass took 3.1 s
# with one segment, 2.67 s with four).
SELECTION_SEGMENTS = 4


def causal_segments(one: Callable, nq: int, tq: int, width: Callable[[int], int]) -> Array:
  """``one(i, width(end))`` for query blocks ``i`` of ``tq`` rows, ``[nq, ...]``, in
  :data:`SELECTION_SEGMENTS` segments: each a ``lax.map`` over its blocks, whose static
  ``width`` is that of the segment's rows below ``end`` (its last row + 1)."""
  parts = []
  edges = sorted({round(s * nq / SELECTION_SEGMENTS) for s in range(SELECTION_SEGMENTS + 1)})
  for lo, hi in zip(edges[:-1], edges[1:]):
    w = width(hi * tq)
    parts.append(jax.lax.map(lambda i, w=w: one(i, w), jnp.arange(lo, hi)))
  return jnp.concatenate(parts, axis=0)


def rows_per_step(K: int, slots: int, block_size: int, H: int, Hv: int, T: int) -> int:
  """Query rows per scan step: a power of two (1 .. 64, at most ``T``) whose gathered tile
  ``[rows, K, slots * block_size, H + Hv]`` stays within :data:`TILE_BYTES`."""
  per_row = max(1, K * slots * block_size * (H + Hv) * 4)
  rows = max(1, min(64, TILE_BYTES // per_row))
  rows = 1 << (rows.bit_length() - 1)
  return max(1, min(rows, 1 << max(0, (T - 1).bit_length())))


def slot_valid(block_idx: Array, num_blocks: int) -> Array:
  """``bool [..., n]``: a slot names a block in ``[0, num_blocks)`` not named by an earlier slot
  of its row (so a block listed twice counts once, as the reference's set)."""
  n = block_idx.shape[-1]
  inside = jnp.logical_and(block_idx >= 0, block_idx < num_blocks)
  same = block_idx[..., :, None] == block_idx[..., None, :]
  earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [slot, other]: other < slot
  earlier = jnp.reshape(earlier, (1,) * (block_idx.ndim - 1) + (n, n))
  duplicate = jnp.any(jnp.logical_and(same, earlier), axis=-1)
  return jnp.logical_and(inside, jnp.logical_not(duplicate))


class _Plan:
  """Shapes and static choices of one call."""

  def __init__(self, q, k, v, block_idx, block_size, scale, normalizer, block_q, distinct):
    self.B, self.T, self.N, self.H = q.shape
    self.S, self.K, self.Hv = k.shape[1], k.shape[2], v.shape[3]
    self.G = self.N // self.K
    self.n = block_idx.shape[3]
    self.bs = block_size
    self.nb = -(-self.S // block_size)
    self.L = self.n * block_size
    self.scale = float(scale)
    self.nz = normalizers.get(normalizer)
    tq = block_q or rows_per_step(self.K, self.n, block_size, self.H, self.Hv, self.T)
    self.tq = max(1, min(tq, self.T))
    self.nq = -(-self.T // self.tq)
    self.Tp = self.nq * self.tq
    self.work = jnp.promote_types(q.dtype, jnp.float32)
    self.distinct = distinct


def _blocks(c: _Plan, x: Array) -> Array:
  """``x [B, S, K, X]`` as ``[B, nb, bs, K, X]`` in the working dtype (zero padded)."""
  x = jnp.pad(x.astype(c.work), [(0, 0), (0, c.nb * c.bs - c.S), (0, 0), (0, 0)])
  return jnp.reshape(x, (c.B, c.nb, c.bs, c.K, x.shape[-1]))


def _gather(c: _Plan, blocks: Array, safe: Array) -> Array:
  """``blocks [B, nb, bs, K, X]`` at ``safe [B, tq, K, n]`` -> ``[B, tq, K, n * bs, X]``."""
  b = jnp.arange(c.B)[:, None, None, None]
  kh = jnp.arange(c.K)[None, None, :, None]
  g = blocks[b, safe, :, kh, :]  # [B, tq, K, n, bs, X]
  return jnp.reshape(g, safe.shape[:3] + (c.L, blocks.shape[-1]))


def _tile(c: _Plan, q: Array, idx_all: Array, i: Array):
  """Query block ``i``: ``(qb [B, tq, K, G, H], idx [B, tq, K, n], allowed [B, tq, K, 1, L],
  pos [B, tq, K, L])`` (rows past ``T`` have no key)."""
  t0 = i * c.tq
  qb = jax.lax.dynamic_slice_in_dim(q, t0, c.tq, axis=1).astype(c.work)
  qb = jnp.reshape(qb, (c.B, c.tq, c.K, c.G, c.H))
  idx = jax.lax.dynamic_slice_in_dim(idx_all, t0, c.tq, axis=1)
  if c.distinct:  # the caller's slots name distinct blocks: only the range is checked
    valid = jnp.logical_and(idx >= 0, idx < c.nb)
  else:
    valid = slot_valid(idx, c.nb)  # [B, tq, K, n]
  safe = jnp.clip(idx, 0, c.nb - 1)
  pos = safe[..., None] * c.bs + jnp.arange(c.bs)[None, None, None, None]  # [B, tq, K, n, bs]
  t = t0 + jnp.arange(c.tq)
  ok = jnp.logical_and(valid[..., None], pos <= t[None, :, None, None, None])
  ok = jnp.logical_and(ok, pos < c.S)
  pos = jnp.reshape(pos, safe.shape[:3] + (c.L,))
  allowed = jnp.reshape(ok, safe.shape[:3] + (1, c.L))
  return qb, safe, allowed, pos


def _logits(c: _Plan, qb: Array, kg: Array) -> Array:
  return jnp.einsum("btkgh,btklh->btkgl", qb, kg) * c.scale


def _row_inputs(c: _Plan, z: Array, allowed: Array) -> dict:
  """The row terms of a row-major tile, which holds every key of its rows (a ``needs_lse``
  normaliser's log-normaliser is the tile's)."""
  counts = None
  if c.nz.needs_counts:
    counts = jnp.sum(allowed, axis=-1, keepdims=True, dtype=c.work)
  terms = normalizers.row_softmax_terms(z, allowed) if c.nz.needs_lse else None
  return c.nz.row_inputs(None, counts, terms)


def _plain_lse(z: Array, allowed: Array) -> Array:
  zm = jnp.where(allowed, z, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(zm, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  s = jnp.sum(jnp.exp(zm - m), axis=-1, keepdims=True)
  return m + jnp.log(jnp.where(s > 0, s, 1.0))


def _stat_rows(c: _Plan, z, allowed, pos) -> dict:
  """Per-row statistics of one tile from its materialised weights (``[B, tq, K, G]`` each)."""
  full = jnp.broadcast_to(allowed, z.shape)
  w, log_norm = c.nz.weights(z, full)
  w = jnp.where(full, w, 0.0)
  has_key = jnp.any(full, axis=-1)
  mag = jnp.abs(w)
  total = jnp.sum(mag, axis=-1, keepdims=True)
  p = mag / jnp.where(total > 0, total, 1.0)
  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  key0 = jnp.logical_and(pos == 0, allowed[..., 0, :])[..., None, :]
  lse = log_norm[..., 0]
  return dict(
    has_key=has_key,
    normalisable=jnp.logical_and(has_key, total[..., 0] > 0),
    entropy=-jnp.sum(plogp, axis=-1),
    p0=jnp.sum(jnp.where(key0, p, 0.0), axis=-1),
    zmax=jnp.max(jnp.where(full, z, -jnp.inf), axis=-1),
    lse=jnp.where(jnp.logical_and(has_key, jnp.isfinite(lse)), lse, 0.0),
    row_sum=jnp.sum(w, axis=-1),
  )


def stats_of_rows(rows: dict, T: int) -> AttentionStats:
  """:class:`attnjax.AttentionStats` of per-row statistics ``[B, N, T]`` (query ``t`` at
  position ``t``; ``sink_mass`` over rows ``t >= 1``)."""
  later = (jnp.arange(T) >= 1)[None, None, :]
  zmax = jnp.max(rows["zmax"], axis=-1)
  return AttentionStats(
    sink_mass=row_mean(rows["p0"], jnp.logical_and(rows["normalisable"], later)),
    entropy=row_mean(rows["entropy"], rows["normalisable"]),
    max_logit=jnp.where(jnp.isfinite(zmax), zmax, 0.0),
    logsumexp=rows["lse"],
    row_sum=row_mean(rows["row_sum"], rows["has_key"]),
  )


def _forward(c: _Plan, x, nondiff, stats: bool):
  """``((out, lse, stat rows), residuals)``: the scan over query blocks."""
  q, k, v = x
  (block_idx,) = nondiff
  idx_all = jnp.pad(
    block_idx.astype(jnp.int32), [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)], constant_values=-1
  )
  q = jnp.pad(q, [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)])
  k_blocks, v_blocks = _blocks(c, k), _blocks(c, v)
  nz = c.nz

  def step(carry, i):
    out_buf, lse_buf = carry
    qb, safe, allowed, pos = _tile(c, q, idx_all, i)
    kg, vg = _gather(c, k_blocks, safe), _gather(c, v_blocks, safe)
    z = _logits(c, qb, kg)
    row = _row_inputs(c, z, allowed)
    rows = (c.B, c.tq, c.K, c.G, 1)
    st = nz.init(rows, rows[:-1] + (c.Hv,), False)
    pv = lambda w: jnp.einsum("btkgl,btklh->btkgh", w, vg)
    st = nz.visit(st, z, allowed, pv, row, False, False)
    out, res, _ = nz.finish(st, row, False)
    lse = res["log_norm"] if nz.softmax_like else _plain_lse(z, allowed)
    has_key = jnp.any(allowed, axis=-1, keepdims=True)
    lse = jnp.where(has_key, lse, 0.0)
    t0 = i * c.tq
    out_buf = jax.lax.dynamic_update_slice_in_dim(out_buf, out.astype(out_buf.dtype), t0, axis=1)
    lse_buf = jax.lax.dynamic_update_slice_in_dim(
      lse_buf, jnp.broadcast_to(lse, rows).astype(lse_buf.dtype)[..., 0], t0, axis=1
    )
    res = {name: jnp.broadcast_to(r, rows) for name, r in res.items()}
    extra = _stat_rows(c, z, allowed, pos) if stats else None
    return (out_buf, lse_buf), (res, extra)

  init = (jnp.zeros((c.B, c.Tp, c.K, c.G, c.Hv), c.work), jnp.zeros((c.B, c.Tp, c.K, c.G), c.work))
  (out32, lse32), (res, extra) = jax.lax.scan(step, init, jnp.arange(c.nq))
  out = jnp.reshape(out32[:, : c.T], (c.B, c.T, c.N, c.Hv)).astype(x[0].dtype)
  lse = jnp.reshape(lse32[:, : c.T], (c.B, c.T, c.N))
  stat_rows = None
  if stats:
    # [nq, B, tq, K, G] -> [B, N, T]
    stat_rows = {
      name: jnp.reshape(jnp.transpose(r, (1, 3, 4, 0, 2)), (c.B, c.N, c.Tp))[..., : c.T]
      for name, r in extra.items()
    }
  return (out, lse, stat_rows), (out32, lse32, res)


def _backward(c: _Plan, x, nondiff, residuals, cts):
  q, k, v = x
  (block_idx,) = nondiff
  out32, lse32, res_all = residuals
  d_out, d_lse = cts[0], cts[1]
  nz = c.nz
  idx_all = jnp.pad(
    block_idx.astype(jnp.int32), [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)], constant_values=-1
  )
  qp = jnp.pad(q, [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)])
  d_out = jnp.pad(d_out.astype(c.work), [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)])
  d_out = jnp.reshape(d_out, (c.B, c.Tp, c.K, c.G, c.Hv))
  d_lse = jnp.pad(d_lse.astype(c.work), [(0, 0), (0, c.Tp - c.T), (0, 0)])
  d_lse = jnp.reshape(d_lse, (c.B, c.Tp, c.K, c.G, 1))
  k_blocks, v_blocks = _blocks(c, k), _blocks(c, v)
  b = jnp.arange(c.B)[:, None, None, None]
  kh = jnp.arange(c.K)[None, None, :, None]

  def step(carry, xs):
    dq_buf, dk_blocks, dv_blocks = carry
    i, res = xs
    qb, safe, allowed, _ = _tile(c, qp, idx_all, i)
    kg, vg = _gather(c, k_blocks, safe), _gather(c, v_blocks, safe)
    z = _logits(c, qb, kg)
    t0 = i * c.tq
    do = jax.lax.dynamic_slice_in_dim(d_out, t0, c.tq, axis=1)
    o = jax.lax.dynamic_slice_in_dim(out32, t0, c.tq, axis=1)
    dp = jnp.einsum("btkgh,btklh->btkgl", do, vg)
    row_dot = None
    if nz.reads_row_dot and nz.row_dot_of_output:
      row_dot = jnp.sum(do * o, axis=-1, keepdims=True)
    elif nz.reads_row_dot:  # the normaliser's own row term, over the tile (the whole row)
      row_dot = nz.row_dot_tile(z, allowed, dp, res)
    g_lse = jax.lax.dynamic_slice_in_dim(d_lse, t0, c.tq, axis=1)
    if nz.softmax_like:  # the logsumexp is the normaliser's
      w, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g_lse)
    else:  # a plain logsumexp beside the weights: d lse / dz = exp(z - lse)
      w, dz = nz.tile_backward(z, allowed, dp, res, row_dot, None)
      lse = jax.lax.dynamic_slice_in_dim(lse32, t0, c.tq, axis=1)[..., None]
      dz = dz + g_lse * jnp.exp(jnp.where(allowed, z, -jnp.inf) - lse)
    w = jnp.where(allowed, w, 0.0)
    dz = jnp.where(allowed, dz, 0.0) * c.scale
    dqb = jnp.einsum("btkgl,btklh->btkgh", dz, kg)
    dkg = jnp.einsum("btkgl,btkgh->btklh", dz, qb)
    dvg = jnp.einsum("btkgl,btkgh->btklh", w, do)
    shape = safe.shape + (c.bs,)
    dk_blocks = dk_blocks.at[b, safe, :, kh, :].add(jnp.reshape(dkg, shape + (c.H,)))
    dv_blocks = dv_blocks.at[b, safe, :, kh, :].add(jnp.reshape(dvg, shape + (c.Hv,)))
    dqb = jnp.reshape(dqb, (c.B, c.tq, c.N, c.H))
    dq_buf = jax.lax.dynamic_update_slice_in_dim(dq_buf, dqb, t0, axis=1)
    return (dq_buf, dk_blocks, dv_blocks), None

  init = (
    jnp.zeros((c.B, c.Tp, c.N, c.H), c.work),
    jnp.zeros((c.B, c.nb, c.bs, c.K, c.H), c.work),
    jnp.zeros((c.B, c.nb, c.bs, c.K, c.Hv), c.work),
  )
  (dq, dk, dv), _ = jax.lax.scan(step, init, (jnp.arange(c.nq), res_all))
  dk = jnp.reshape(dk, (c.B, c.nb * c.bs, c.K, c.H))[:, : c.S]
  dv = jnp.reshape(dv, (c.B, c.nb * c.bs, c.K, c.Hv))[:, : c.S]
  return dq[:, : c.T].astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# Key blocks at least this long take the block-major backward (:func:`_backward_by_block`) and
# softmax's block-major forward (:func:`_forward_by_block`); shorter ones (DSA's single keys)
# the row-major ones, whose per-row scatters they keep small.
BLOCK_MAJOR_MIN = 8


def chunk_rows(G: int) -> int:
  """Selections per chunk of the block-major backward: ``R`` rows of ``G`` heads, ~1024 rows
  (at G=8, NSA's fla configuration at T=8192: 64 rows took 2.6 s for the branch's forward and
  backward, 128 rows 2.1 s, 256 rows 2.4 s)."""
  return max(8, min(256, 1024 // max(G, 1)))


def _by_block(c: _Plan, block_idx: Array, R: int):
  """The selections ``(row t, slot)`` of each ``(batch, kv head)`` sorted by the block they
  name and laid out in chunks of ``R``, each chunk within one block (a block's run padded to a
  multiple of ``R``): ``(pairs [B, K, chunks, R]`` (``t * n + slot``, ``P = Tp * n`` =
  padding), ``blocks [B, K, chunks]`` (``nb``: an empty chunk)). ``chunks = ceil(P / R) + nb``
  bounds the padding statically."""
  n = c.n
  P = c.Tp * n
  chunks = -(-P // R) + c.nb
  idx = jnp.pad(
    block_idx.astype(jnp.int32), [(0, 0), (0, c.Tp - c.T), (0, 0), (0, 0)], constant_values=-1
  )
  valid = (
    jnp.logical_and(idx >= 0, idx < c.nb) if c.distinct else slot_valid(idx, c.nb)
  )  # [B, Tp, K, n]
  keys = jnp.where(valid, idx, c.nb)
  keys = jnp.reshape(jnp.moveaxis(keys, 2, 1), (c.B, c.K, P))  # pair t * n + slot
  order = jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)  # [B, K, P]
  blk = jnp.take_along_axis(keys, order, axis=-1)
  # Where each block's run starts in the sorted order, and its length (no [P, nb] array).
  find = jax.vmap(jax.vmap(lambda a: jnp.searchsorted(a, jnp.arange(c.nb + 1, dtype=a.dtype))))
  bounds = find(blk).astype(jnp.int32)  # [B, K, nb + 1]
  first = bounds[..., :-1]  # its first pair in the sorted order
  counts = bounds[..., 1:] - first
  padded = -(-counts // R) * R  # [B, K, nb]
  start = jnp.cumsum(padded, axis=-1) - padded  # where each block's padded run starts
  blk_c = jnp.minimum(blk, c.nb - 1)
  at = lambda table: jnp.take_along_axis(table, blk_c, axis=-1)
  dest = at(start) + jnp.arange(P, dtype=jnp.int32)[None, None, :] - at(first)
  dest = jnp.where(blk < c.nb, dest, chunks * R)  # invalid selections: dropped
  bi = jnp.arange(c.B)[:, None, None]
  ki = jnp.arange(c.K)[None, :, None]
  pairs = jnp.full((c.B, c.K, chunks * R), P, jnp.int32)
  pairs = pairs.at[bi, ki, dest].set(order, mode="drop")
  pairs = jnp.reshape(pairs, (c.B, c.K, chunks, R))
  # A chunk's block: the last block whose run starts at or before it.
  edges = jnp.arange(chunks, dtype=jnp.int32) * R
  ends = start + padded
  after = jax.vmap(jax.vmap(lambda e: jnp.searchsorted(e, edges, side="right")))
  blocks = after(ends)  # [B, K, chunks]: runs that end at or before the chunk's start
  return pairs, jnp.minimum(blocks, c.nb).astype(jnp.int32)


def _rows_of(c: _Plan, x: Array) -> Array:
  """``x [B, T, N, X]`` padded to ``Tp`` rows and grouped, ``[B, Tp, K, G, X]``, in the working
  dtype."""
  x = jnp.pad(x.astype(c.work), [(0, 0), (0, c.Tp - c.T)] + [(0, 0)] * (x.ndim - 2))
  return jnp.reshape(x, (c.B, c.Tp, c.K, c.G, x.shape[-1]))


def _at_rows(a: Array, t: Array) -> Array:
  """``a [B, Tp, K, ...]`` at the rows ``t [B, K, R]`` -> ``[B, K, R, ...]``."""
  bi = jnp.arange(t.shape[0])[:, None, None]
  ki = jnp.arange(t.shape[1])[None, :, None]
  return a[bi, t, ki]


def _block_of(blocks: Array, safe: Array) -> Array:
  """``blocks [B, nb, bs, K, X]`` at the block ``safe [B, K]`` of each (batch, kv head) ->
  ``[B, K, bs, X]``."""
  b2 = jnp.arange(blocks.shape[0])[:, None]
  k2 = jnp.arange(blocks.shape[3])[None, :]
  return blocks[b2, safe, :, k2, :]


def _chunk(c: _Plan, qg: Array, k_blocks: Array, pair: Array, blk: Array):
  """One chunk of the block-major passes, ``R`` selections ``pair [B, K, R]`` of the key block
  ``blk [B, K]``: ``(t [B, K, R], qr [B, K, R, G, H], safe [B, K], kb [B, K, bs, H],
  allowed [B, K, R, 1, bs], z [B, K, R, G, bs])`` (a padding selection reads row 0, no key)."""
  ok = pair < c.Tp * c.n
  t = jnp.where(ok, pair // c.n, 0)
  qr = _at_rows(qg, t)
  safe = jnp.minimum(blk, c.nb - 1)
  kb = _block_of(k_blocks, safe)
  pos = safe[..., None] * c.bs + jnp.arange(c.bs)[None, None, :]  # [B, K, bs]
  allowed = (pos[:, :, None, :] <= t[..., None]) & (pos[:, :, None, :] < c.S) & ok[..., None]
  allowed = jnp.logical_and(allowed, (blk < c.nb)[..., None, None])[:, :, :, None, :]
  z = jnp.einsum("bkrgh,bksh->bkrgs", qr, kb) * c.scale
  return t, qr, safe, kb, allowed, z


def _chunks(c: _Plan, block_idx: Array, R: int):
  """:func:`_by_block`'s chunks as scan inputs, ``(pairs [chunks, B, K, R], blocks [chunks, B,
  K])``."""
  pairs, blocks = _by_block(c, jax.lax.stop_gradient(block_idx), R)
  return jnp.moveaxis(pairs, 2, 0), jnp.moveaxis(blocks, 2, 0)


def plain_softmax(nz: normalizers.Normalizer) -> bool:
  """Whether ``nz`` is softmax itself (no null column): its weights are ``exp(z - lse)`` and
  its residual the row's logsumexp, which :func:`_forward_by_block` computes."""
  return type(nz) is normalizers.SoftmaxFamily and not nz.null_column


def forward_chunk_rows(G: int) -> int:
  """Selections per chunk of the block-major forward: ``R`` rows of ``G`` heads, ~2048 rows
  (larger tiles than the backward's: fewer, longer scan steps)."""
  return max(8, min(256, 2048 // max(G, 1)))


def _forward_by_block(c: _Plan, x, nondiff):
  """Softmax's forward one key block at a time in one pass over :func:`_by_block`'s chunks.

  Each row carries a running maximum, sum and weighted-value accumulator (online softmax):
  a chunk reads them at its rows, forms its ``[R G, block]`` logits once, rescales and adds
  its block, and writes them back (a row appears at most once in a chunk: its slots name
  distinct blocks; padding selections write to a spare row ``Tp``). Returns what
  :func:`_forward` returns without statistics (the residual ``log_norm`` is the row's
  logsumexp, 0 for a row with no key).
  """
  q, k, v = x
  (block_idx,) = nondiff
  xs = _chunks(c, block_idx, forward_chunk_rows(c.G))
  qg = _rows_of(c, q)  # [B, Tp, K, G, H]
  k_blocks, v_blocks = _blocks(c, k), _blocks(c, v)  # [B, nb, bs, K, X]
  bi = jnp.arange(c.B)[:, None, None]
  ki = jnp.arange(c.K)[None, :, None]
  P = c.Tp * c.n

  def step(carry, xs):
    m_rows, s_rows, acc_rows = carry
    pair, blk = xs
    t, _, safe, _, allowed, z = _chunk(c, qg, k_blocks, pair, blk)
    rows = jnp.where(pair < P, t, c.Tp)  # [B, K, R]: padding -> the spare row
    m_old, s_old = _at_rows(m_rows, rows), _at_rows(s_rows, rows)  # [B, K, R, G]
    zm = jnp.where(allowed, z, -jnp.inf)
    m_new = jnp.maximum(m_old, jnp.max(zm, axis=-1))
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    e = jnp.exp(zm - m_ref[..., None])  # [B, K, R, G, bs], 0 where not allowed
    alpha = jnp.exp(m_old - m_ref)  # 0 for a row's first block
    pv = jnp.einsum("bkrgs,bksh->bkrgh", e, _block_of(v_blocks, safe))
    acc = _at_rows(acc_rows, rows) * alpha[..., None] + pv
    m_rows = m_rows.at[bi, rows, ki].set(m_new)
    s_rows = s_rows.at[bi, rows, ki].set(s_old * alpha + jnp.sum(e, axis=-1))
    acc_rows = acc_rows.at[bi, rows, ki].set(acc)
    return (m_rows, s_rows, acc_rows), None

  rows = (c.B, c.Tp + 1, c.K, c.G)
  init = (
    jnp.full(rows, -jnp.inf, c.work),
    jnp.zeros(rows, c.work),
    jnp.zeros(rows + (c.Hv,), c.work),
  )
  (m, s, acc), _ = jax.lax.scan(step, init, xs)
  m, s, acc = m[:, : c.Tp], s[:, : c.Tp], acc[:, : c.Tp]
  has_key = m > -jnp.inf
  s_safe = jnp.where(s > 0, s, 1.0)
  lse32 = jnp.where(has_key, m + jnp.log(s_safe), 0.0)  # [B, Tp, K, G]
  out32 = jnp.where(has_key[..., None], acc / s_safe[..., None], 0.0)
  out = jnp.reshape(out32[:, : c.T], (c.B, c.T, c.N, c.Hv)).astype(q.dtype)
  lse_out = jnp.reshape(lse32[:, : c.T], (c.B, c.T, c.N))
  log_norm = jnp.moveaxis(jnp.reshape(lse32, (c.B, c.nq, c.tq, c.K, c.G, 1)), 1, 0)
  return (out, lse_out, None), (out32, lse32, {"log_norm": log_norm})


def _backward_by_block(c: _Plan, x, nondiff, residuals, cts):
  """The backward one key block at a time: the selections of a block gathered as query rows.

  A chunk holds ``R`` selections of one key block: its query rows (``[R, G, H]``, the group's
  heads), their output cotangents and per-row residuals are gathered; logits, weights and
  their cotangents form an ``[R G, block]`` tile (dense products); ``dk``, ``dv`` of the block
  are added in place, and the rows' ``dq`` scatter-added (``G H`` values per selection, not
  ``block H``: the gather carries the queries, which a group shares per key block).
  """
  q, k, v = x
  (block_idx,) = nondiff
  out32, lse32, res_all = residuals
  d_out, d_lse = cts[0], cts[1]
  nz = c.nz
  xs = _chunks(c, block_idx, chunk_rows(c.G))
  qg = _rows_of(c, q)
  do = _rows_of(c, d_out)
  g_lse = _rows_of(c, d_lse[..., None])
  row_dot = jnp.sum(do * out32, axis=-1, keepdims=True)  # [B, Tp, K, G, 1]
  # The forward's residual rows, [nq, B, tq, K, G, 1] -> [B, Tp, K, G, 1].
  res_rows = {
    name: jnp.reshape(jnp.moveaxis(r, 0, 1), (c.B, c.Tp) + r.shape[3:])
    for name, r in res_all.items()
  }
  k_blocks, v_blocks = _blocks(c, k), _blocks(c, v)  # [B, nb, bs, K, X]
  bi = jnp.arange(c.B)[:, None, None]
  ki = jnp.arange(c.K)[None, :, None]
  b2 = jnp.arange(c.B)[:, None]
  k2 = jnp.arange(c.K)[None, :]

  def step(carry, xs):
    dq, dk_blocks, dv_blocks = carry
    pair, blk = xs  # [B, K, R], [B, K]
    t, qr, safe, kb, allowed, z = _chunk(c, qg, k_blocks, pair, blk)
    rows = lambda a: _at_rows(a, t)  # [B, Tp, K, ...] -> [B, K, R, ...]
    dor = rows(do)  # [B, K, R, G, Hv]
    vb = _block_of(v_blocks, safe)
    dp = jnp.einsum("bkrgh,bksh->bkrgs", dor, vb)
    res = {name: rows(r) for name, r in res_rows.items()}
    g = rows(g_lse)
    if nz.softmax_like:
      w, dz = nz.tile_backward(z, allowed, dp, res, rows(row_dot) if nz.reads_row_dot else None, g)
    else:
      w, dz = nz.tile_backward(
        z, allowed, dp, res, rows(row_dot) if nz.reads_row_dot else None, None
      )
      lse = rows(lse32[..., None])
      dz = dz + g * jnp.exp(jnp.where(allowed, z, -jnp.inf) - lse)
    w = jnp.where(allowed, w, 0.0)
    dz = jnp.where(allowed, dz, 0.0) * c.scale
    dk_blocks = dk_blocks.at[b2, safe, :, k2, :].add(jnp.einsum("bkrgs,bkrgh->bksh", dz, qr))
    dv_blocks = dv_blocks.at[b2, safe, :, k2, :].add(jnp.einsum("bkrgs,bkrgh->bksh", w, dor))
    dq = dq.at[bi, t, ki].add(jnp.einsum("bkrgs,bksh->bkrgh", dz, kb))
    return (dq, dk_blocks, dv_blocks), None

  init = (
    jnp.zeros((c.B, c.Tp, c.K, c.G, c.H), c.work),
    jnp.zeros((c.B, c.nb, c.bs, c.K, c.H), c.work),
    jnp.zeros((c.B, c.nb, c.bs, c.K, c.Hv), c.work),
  )
  (dq, dk, dv), _ = jax.lax.scan(step, init, xs)
  dq = jnp.reshape(dq[:, : c.T], (c.B, c.T, c.N, c.H))
  dk = jnp.reshape(dk, (c.B, c.nb * c.bs, c.K, c.H))[:, : c.S]
  dv = jnp.reshape(dv, (c.B, c.nb * c.bs, c.K, c.Hv))[:, : c.S]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def run(
  q: Array,
  k: Array,
  v: Array,
  block_idx: Array,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  return_stats: bool = False,
  block_q: Optional[int] = None,
  distinct: bool = False,
):
  """``(out [B, T, N, Hv], lse [B, T, N], statistics or None)`` of a validated call.

  ``out`` and ``lse`` (as :func:`selected_attention` returns it) are differentiable in ``q``,
  ``k``, ``v`` in every mode; of the statistics (:class:`attnjax.AttentionStats` of the selected
  keys, ``sink_mass`` the weight on key 0) only ``logsumexp`` carries a gradient.
  ``block_q``: query rows per scan step (None: :func:`rows_per_step`). ``distinct``: the
  caller guarantees that no row names a block twice (NSA's and DSA's selections), which
  skips the ``n x n`` comparison that otherwise makes a repeated block count once.
  """
  c = _Plan(q, k, v, block_idx, block_size, scale, normalizer, block_q, distinct)

  # Block-major tiles hold one block of a row: a normaliser with row pre-passes (its
  # log-normaliser, its backward row term over every key) keeps the row-major layout.
  block_major = c.bs >= BLOCK_MAJOR_MIN and not c.nz.row_passes

  def forward(x, nondiff):
    if block_major and plain_softmax(c.nz) and not return_stats:
      return _forward_by_block(c, x, nondiff)
    return _forward(c, x, nondiff, return_stats)

  def backward(x, nondiff, residuals, cts):
    if block_major:
      return _backward_by_block(c, x, nondiff, residuals, cts)
    return _backward(c, x, nondiff, residuals, cts)

  out, lse, rows = autodiff.custom_vjp_with_jvp(
    forward, backward, (q, k, v), (block_idx,), name="selected_blockwise"
  )
  stats = None
  if return_stats:
    stats = stats_of_rows(jax.lax.stop_gradient(rows), c.T)
    stats = stats._replace(logsumexp=jnp.swapaxes(lse, 1, 2).astype(jnp.float32))
  return out, lse, stats


def selected_attention(
  q: Array,
  k: Array,
  v: Array,
  block_idx: Array,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  interpret: bool = False,
  return_lse: bool = False,
):
  """:func:`attnjax._src.kernels.selected_reference.selected_attention` by gathering in O(T)
  memory, :func:`run` (same arguments; ``interpret`` is accepted and ignored)."""
  del interpret
  selected_reference.check_inputs(q, k, v, block_idx, block_size=block_size)
  out, lse, _ = run(q, k, v, block_idx, block_size=block_size, scale=scale, normalizer=normalizer)
  return (out, lse) if return_lse else out
