"""NSA's definitions, shared by every engine: compression, block importance, selection.

Compressed block ``c`` summarises keys ``[c d, c d + l)`` and has ended for query ``t`` when
``c d + l - 1 <= t``. Selection block ``j`` holds keys ``[j l', (j + 1) l')``; its importance
is the compressed weights of the blocks sharing keys with it, each counted once per stride of
keys they share (the paper's spatial relationship), summed over a GQA group's query heads.
Guide: docs/guides/sparse.md, section "Native sparse attention".
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src.attention_stats import AttentionStats

Array = jnp.ndarray

BRANCHES: tuple[str, ...] = ("compressed", "selected", "window")


class Compressor(NamedTuple):
  """The learned compressor ``phi`` of keys (or values): an MLP over one block of ``l`` rows.

  ``phi(x_block) = gelu(vec(x_block + position) @ w1 + b1) @ w2 + b2`` (exact GELU), the same
  for every key/value head; ``position`` is the intra-block position encoding.

  Attributes:
    position: ``[l, X]`` added to row ``r`` of the block.
    w1: ``[l * X, M]``.
    b1: ``[M]``.
    w2: ``[M, Y]``.
    b2: ``[Y]``.
  """

  position: Array
  w1: Array
  b1: Array
  w2: Array
  b2: Array


class NSAStats(NamedTuple):
  """Statistics of one :func:`attnjax.nsa_attention` call.

  Attributes:
    compressed: :class:`attnjax.AttentionStats` of the compressed branch over the compressed
      keys (``sink_mass``: the weight on compressed block 0, keys ``0 .. l - 1``).
    selected: of the selected branch over the raw keys it attends (``sink_mass``: key 0).
    window: of the sliding-window branch (``sink_mass``: key 0, seen by rows ``t <= w``).
    gate_mean: ``[B, N, 3]`` mean gate of each branch (compressed, selected, window) over the
      queries.
  """

  compressed: AttentionStats
  selected: AttentionStats
  window: AttentionStats
  gate_mean: Array


@dataclasses.dataclass(frozen=True)
class NSAOptions:
  """The static options of a validated call (hashable).

  Attributes:
    block_length: ``l``, keys per compressed block.
    stride: ``d``, positions between compressed blocks (``d <= l``; ``l % d == 0``).
    selection_block: ``l'``, keys per selection block (``l' % d == 0``).
    num_selected: ``n``, selection blocks per query, the initial and local ones included.
    num_initial: blocks ``0 .. num_initial - 1`` are always selected.
    num_local: the query's own selection block and the ``num_local - 1`` before it are always
      selected.
    window: ``w``: the window branch attends keys ``t - w .. t``.
    scale: logit scale.
    normalizers: each branch's normaliser (compressed, selected, window).
    return_stats: also return :class:`NSAStats`.
  """

  block_length: int
  stride: int
  selection_block: int
  num_selected: int
  num_initial: int
  num_local: int
  window: int
  scale: float
  normalizers: tuple[str, str, str]
  return_stats: bool = False


def num_compressed(S: int, block_length: int, stride: int) -> int:
  """Compressed blocks of ``S`` keys: whole blocks only, ``floor((S - l) / d) + 1`` (0 when
  ``S < l``)."""
  return 0 if S < block_length else (S - block_length) // stride + 1


def num_selection_blocks(S: int, selection_block: int) -> int:
  """Selection blocks covering ``S`` keys: ``ceil(S / l')`` (the last may be partial)."""
  return -(-S // selection_block)


def block_ends(C: int, block_length: int, stride: int) -> np.ndarray:
  """Position of the last key of each compressed block: ``c d + l - 1``."""
  return np.arange(C) * stride + block_length - 1


def compress(
  x: Array, compressor: Optional[Compressor], *, block_length: int, stride: int
) -> Array:
  """``x [B, S, K, X]`` -> compressed ``[B, C, K, Y]``: ``phi`` over each block of ``l`` rows.

  Args:
    x: keys or values.
    compressor: the learned :class:`Compressor`, or None: the mean of the block (``Y = X``).
    block_length: ``l``.
    stride: ``d``.

  Returns:
    ``[B, C, K, Y]`` in ``x``'s dtype (computed in float32, float64 for float64 inputs).
  """
  B, S, K, X = x.shape
  C = num_compressed(S, block_length, stride)
  work = jnp.promote_types(x.dtype, jnp.float32)
  rows = np.arange(C)[:, None] * stride + np.arange(block_length)[None, :]  # [C, l]
  blocks = jnp.take(x.astype(work), jnp.asarray(rows.reshape(-1), jnp.int32), axis=1)
  blocks = jnp.reshape(blocks, (B, C, block_length, K, X))
  if compressor is None:
    return jnp.mean(blocks, axis=2).astype(x.dtype)
  p = jax.tree.map(lambda a: a.astype(work), compressor)
  h = blocks + p.position[None, None, :, None, :]
  h = jnp.reshape(jnp.moveaxis(h, 2, 3), (B, C, K, block_length * X))
  h = jax.nn.gelu(h @ p.w1 + p.b1[None, None, None, :], approximate=False)
  return (h @ p.w2 + p.b2[None, None, None, :]).astype(x.dtype)


def selection_scores(
  p: Array, *, block_length: int, stride: int, selection_block: int, num_keys: int
) -> Array:
  """Compressed weights ``p [..., C]`` mapped onto the selection blocks: ``[..., ceil(S / l')]``.

  Selection block ``j`` gets ``sum_c overlap(c, j) / d * p[c]``, ``overlap`` the keys
  compressed block ``c`` and selection block ``j`` share (a multiple of ``d``): each stride-long
  run of keys passes on the weight of every compressed block holding it. With ``l = l' = d``
  this is ``p`` itself. (The paper's printed sum ``sum_m sum_n p[l'/d j - m - n]`` indexes the
  same double sum ending ``l'/d - 1`` blocks early, on blocks before selection block ``j``; we
  follow the stated spatial relationship.)
  """
  b = block_length // stride
  a = selection_block // stride
  nsel = num_selection_blocks(num_keys, selection_block)
  chunks = nsel * a
  C = p.shape[-1]
  pp = jnp.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, chunks - C)])
  mass = pp
  # chunk r lies in compressed blocks r - b + 1 .. r (shifts past the last chunk add nothing)
  for m in range(1, min(b, chunks)):
    mass = mass + jnp.pad(pp[..., : chunks - m], [(0, 0)] * (p.ndim - 1) + [(m, 0)])
  return jnp.sum(jnp.reshape(mass, p.shape[:-1] + (nsel, a)), axis=-1)


def select(
  scores: Array,
  q_positions: Array,
  *,
  selection_block: int,
  num_selected: int,
  num_initial: int,
  num_local: int,
) -> Array:
  """The selection blocks of each query: ``scores [..., T, nsel]`` -> int32 ``[..., T, n]``.

  Candidates are the blocks that start at or before the query (``j l' <= t``); the first
  ``num_initial`` and the ``num_local`` ending at the query's own are always taken, then the
  best-scoring others up to ``n``. Ties go to the lower block index (``lax.top_k``); slots with
  no candidate left are ``-1``; indices ascend, ``-1`` last. No gradient.
  """
  nsel = scores.shape[-1]
  j = jnp.arange(nsel)[None, :]
  own = (q_positions // selection_block)[:, None]
  candidate = j <= own
  forced = jnp.logical_and(candidate, jnp.logical_or(j < num_initial, j > own - num_local))
  key = jnp.where(forced, jnp.inf, jnp.where(candidate, jax.lax.stop_gradient(scores), -jnp.inf))
  best, idx = jax.lax.top_k(key, num_selected)
  idx = jnp.where(jnp.isneginf(best), nsel, idx.astype(jnp.int32))
  idx = jnp.sort(idx, axis=-1)
  return jnp.where(idx == nsel, -1, idx).astype(jnp.int32)


def gate_mix(outs: tuple[Array, Array, Array], gates: Array) -> Array:
  """``sum_b gates[..., b] * out_b``: each ``[B, T, N, Hv]``, ``gates [B, T, N, 3]``."""
  g = gates.astype(outs[0].dtype)
  return sum(g[..., b, None] * outs[b] for b in range(3))
