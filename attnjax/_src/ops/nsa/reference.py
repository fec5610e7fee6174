"""The readable reference of NSA: every branch's logits and weights materialised.

:func:`attend` takes the query positions as an array, so the decode step of the layer uses it
over its cache; the ``"reference"`` engine calls it with positions ``0 .. T - 1``. Exact in
float64 (inputs of that dtype are computed in it).
Guide: docs/guides/sparse.md, section "Native sparse attention".
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attnjax._src import empty, logits, normalizers
from attnjax._src.attention_stats import stats_from_weights
from attnjax._src.ops.nsa import rules

Array = jnp.ndarray


def _branch(q, k, v, allowed, normalizer: str, scale: float, want_stats: bool):
  """One branch over explicit keys: ``(out [B, T, N, Hv], weights [B, K, G, T, S], stats)``.

  ``allowed``: bool broadcastable to ``[B, K, G, T, S]``.
  """
  B, T, N, _ = q.shape
  K, S = k.shape[2], k.shape[1]
  work = q.dtype
  if S == 0:  # no compressed block has ended (S < l): every row has no key
    z = jnp.zeros((B, K, N // K, T, 0), work)
    out = jnp.zeros((B, T, N, v.shape[-1]), work)
    return out, z, (empty.empty_stats(B, N, T) if want_stats else None)
  z = jnp.einsum("btkgh,bskh->bkgts", logits.group_queries(q, K), k.astype(work)) * scale
  allowed = jnp.broadcast_to(allowed, z.shape)
  w, log_norm = normalizers.get(normalizer).weights(z, allowed)
  w = jnp.where(allowed, w, 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", w, v.astype(work))
  out = jnp.reshape(out, (B, T, N, v.shape[-1]))
  stats = None
  if want_stats:
    flat = lambda x: jnp.reshape(x, (B, N) + x.shape[3:])
    stats = stats_from_weights(
      flat(z).astype(jnp.float32),
      flat(w).astype(jnp.float32),
      flat(allowed),
      flat(log_norm).astype(jnp.float32),
    )
  return out, w, stats


def attend(
  q: Array,
  q_positions: Array,
  k: tuple[Array, Array, Array],
  v: tuple[Array, Array, Array],
  k_compressed: Array,
  v_compressed: Array,
  gates: Array,
  opts: rules.NSAOptions,
  *,
  key_positions: Optional[Array] = None,
  return_weights: bool = False,
):
  """NSA of queries at ``q_positions`` over keys at positions ``0 .. S - 1``.

  Args:
    q: ``[B, T, N, H]``.
    q_positions: int ``[T]``, each query's position (the keys it may see end there).
    k: the compressed, selected and window branches' raw keys, each ``[B, S, K, H]`` (the
      compressed branch's serve the selection block count only).
    v: their values, each ``[B, S, K, Hv]``.
    k_compressed: ``[B, C, K, H]`` compressed keys (block ``c`` ends at ``c d + l - 1``).
    v_compressed: ``[B, C, K, Hv]`` compressed values.
    gates: ``[B, T, N, 3]``.
    opts: the call's :class:`rules.NSAOptions`.
    key_positions: None, or int ``[S]`` positions of the raw keys (a decode cache's; -1 = an
      empty slot): the raw keys' rules use these instead of ``0 .. S - 1``.
    return_weights: also return ``{"implied": [B, N, T, S], "first": [B, N, T, 3]}``
      float32: the weight each raw key receives (the gated sum of the branches' weights, a
      compressed block's spread evenly over its ``l`` keys: its value is a learned summary of
      them, not their mean), and each branch's row-normalised weight on its first key
      (compressed block 0; raw key 0), 0 on a row with no key.

  Returns:
    ``out [B, T, N, Hv]`` in ``q``'s dtype; ``(out, rules.NSAStats)`` with
    ``opts.return_stats``; the weights appended with ``return_weights``.
  """
  work = jnp.promote_types(q.dtype, jnp.float32)
  qw = q.astype(work)
  S = k[1].shape[1]
  o = opts
  t = q_positions.astype(jnp.int32)[:, None]  # [T, 1]
  want = o.return_stats

  # Compressed branch: blocks that have ended.
  C = k_compressed.shape[1]
  ends = jnp.asarray(rules.block_ends(C, o.block_length, o.stride))[None, :]
  cmp_allowed = (ends <= t)[None, None, None]  # [1, 1, 1, T, C]
  out_c, w_c, st_c = _branch(
    qw, k_compressed, v_compressed, cmp_allowed, o.normalizers[0], o.scale, want
  )

  # Importance of the selection blocks, summed over the group's heads; the selection.
  scores = rules.selection_scores(
    jnp.sum(w_c, axis=2),  # the group's heads first: the map is linear
    block_length=o.block_length,
    stride=o.stride,
    selection_block=o.selection_block,
    num_keys=S,
  )  # [B, K, T, nsel]
  idx = rules.select(
    scores,
    q_positions,
    selection_block=o.selection_block,
    num_selected=o.num_selected,
    num_initial=o.num_initial,
    num_local=o.num_local,
  )  # [B, K, T, n]

  # Selected branch: keys of the selected blocks, causal.
  s = jnp.arange(S) if key_positions is None else key_positions.astype(jnp.int32)
  s = s[None, :]
  chosen = jnp.any(idx[..., None] == (s // o.selection_block)[None, None, None], axis=-2)
  raw = jnp.logical_and(s >= 0, s <= t)  # [T, S]
  slc_allowed = jnp.logical_and(chosen, raw[None, None])[:, :, None]  # [B, K, 1, T, S]
  out_s, w_s, st_s = _branch(qw, k[1], v[1], slc_allowed, o.normalizers[1], o.scale, want)

  # Window branch: keys t - w .. t.
  win_allowed = jnp.logical_and(raw, s >= t - o.window)[None, None, None]
  out_w, w_w, st_w = _branch(qw, k[2], v[2], win_allowed, o.normalizers[2], o.scale, want)

  out = rules.gate_mix((out_c, out_s, out_w), gates.astype(work)).astype(q.dtype)
  res = (out,)
  if want:
    gate_mean = jnp.mean(jnp.moveaxis(gates.astype(jnp.float32), 1, 2), axis=2)  # [B, N, 3]
    res += (rules.NSAStats(st_c, st_s, st_w, gate_mean),)
  if return_weights:
    spread = (s >= jnp.asarray(ends - (o.block_length - 1)).T) & (s <= ends.T)  # [C, S]
    w_raw_c = jnp.einsum("bkgtc,cs->bkgts", w_c, spread.astype(work)) / o.block_length
    g = jnp.moveaxis(gates.astype(work), 1, 3)  # [B, N, 3, T]
    B, N, T = g.shape[0], g.shape[1], g.shape[3]
    flat = lambda w: jnp.reshape(w, (B, N, T, w.shape[-1]))
    implied = sum(g[:, :, b, :, None] * flat(w) for b, w in enumerate((w_raw_c, w_s, w_w)))

    def first(w):  # [B, K, G, T, X] -> [B, N, T]
      if w.shape[-1] == 0:
        return jnp.zeros((B, N, T), jnp.float32)
      total = jnp.sum(jnp.abs(w), axis=-1)
      return jnp.reshape(jnp.abs(w[..., 0]) / jnp.where(total > 0, total, 1.0), (B, N, T))

    firsts = jnp.stack([first(w) for w in (w_c, w_s, w_w)], axis=-1).astype(jnp.float32)
    res += ({"implied": implied.astype(jnp.float32), "first": firsts},)
  return res[0] if len(res) == 1 else res


def selection(
  q: Array, q_positions: Array, k_compressed: Array, opts: rules.NSAOptions, num_keys: int
) -> Array:
  """The selection blocks of every query, ``int32 [B, T, K, n]`` (as :func:`attend` makes
  them; materialised)."""
  work = jnp.promote_types(q.dtype, jnp.float32)
  o = opts
  C = k_compressed.shape[1]
  K = k_compressed.shape[2]
  ends = jnp.asarray(rules.block_ends(C, o.block_length, o.stride))[None, :]
  allowed = (ends <= q_positions.astype(jnp.int32)[:, None])[None, None, None]
  z = jnp.einsum(
    "btkgh,bskh->bkgts", logits.group_queries(q.astype(work), K), k_compressed.astype(work)
  )
  z = z * o.scale
  allowed = jnp.broadcast_to(allowed, z.shape)
  if C == 0:
    w = z
  else:
    w, _ = normalizers.get(o.normalizers[0]).weights(z, allowed)
    w = jnp.where(allowed, w, 0.0)
  scores = rules.selection_scores(
    jnp.sum(w, axis=2),
    block_length=o.block_length,
    stride=o.stride,
    selection_block=o.selection_block,
    num_keys=num_keys,
  )
  idx = rules.select(
    scores,
    q_positions,
    selection_block=o.selection_block,
    num_selected=o.num_selected,
    num_initial=o.num_initial,
    num_local=o.num_local,
  )
  return jnp.moveaxis(jax.lax.stop_gradient(idx), 2, 1)
