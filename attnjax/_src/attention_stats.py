"""``AttentionStats``: what one attention call reports about itself.

Implementation behind the public module :mod:`attnjax.attention_stats`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

Array = jnp.ndarray


class AttentionStats(NamedTuple):
  """Statistics of one attention call.

  Attributes:
    sink_mass: ``[B, N]`` mean over queries ``i >= 1`` of the weight on key 0,
      on row-normalised weights ``|w_ij| / sum_l |w_il|`` (equal to the raw
      weights for softmax; Gu et al. 2024 use row-normalised weights to compare
      normalisers whose rows do not sum to one).
    entropy: ``[B, N]`` mean over queries of ``-sum_j p_ij log p_ij`` on the same
      row-normalised weights (Zhai et al. 2023).
    max_logit: ``[B, N]`` maximum over allowed ``(i, j)`` of the logit the
      normaliser sees (Wortsman et al. 2023).
    logsumexp: ``[B, N, T]`` log of the softmax partition of each row, including
      the null column of ``softmax_one`` / ``sink_logits``; 0 for empty rows (jax.nn's
      masked logit when ``dot_product_attention`` returns jax.nn's residual from it).
    row_sum: ``[B, N]`` mean over queries of ``sum_j w_ij`` of the raw weights
      (1 for softmax; ``1 - null mass`` for softmax_one and sink logits).
  """

  sink_mass: Optional[Array] = None
  entropy: Optional[Array] = None
  max_logit: Optional[Array] = None
  logsumexp: Optional[Array] = None
  row_sum: Optional[Array] = None


def row_mean(x: Array, rows: Array) -> Array:
  """Mean of ``x`` over the rows where ``rows`` is True; 0 where none is.

  Args:
    x: ``[B, N, T]``.
    rows: boolean ``[B, N, T]``.

  Returns:
    ``[B, N]``.
  """
  count = jnp.sum(rows, axis=-1, dtype=jnp.float32)
  total = jnp.sum(jnp.where(rows, x, 0.0), axis=-1)
  return total / jnp.maximum(count, 1.0)


def stats_from_weights(
  z: Array, w: Array, allowed: Array, log_normalizer: Array, empty_logsumexp: float = 0.0
) -> AttentionStats:
  """Reference statistics from materialised logits and weights (the readable definition).

  Args:
    z: float32 logits ``[B, N, T, S]`` as the normaliser saw them.
    w: the weights ``[B, N, T, S]``.
    allowed: boolean mask broadcastable to ``[B, N, T, S]``.
    log_normalizer: ``[B, N, T, 1]`` the log partition of each row.
    empty_logsumexp: the ``logsumexp`` of a row with no allowed key.

  Returns:
    The :class:`.AttentionStats`.
  """
  allowed = jnp.broadcast_to(allowed, z.shape)
  has_key = jnp.any(allowed, axis=-1)  # [B, N, T]
  mag = jnp.abs(w)
  total = jnp.sum(mag, axis=-1, keepdims=True)
  p = mag / jnp.where(total > 0, total, 1.0)
  normalisable = jnp.logical_and(has_key, total[..., 0] > 0)

  plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
  entropy = row_mean(-jnp.sum(plogp, axis=-1), normalisable)

  T = z.shape[2]
  later = (jnp.arange(T) >= 1)[None, None, :]
  sink_mass = row_mean(p[..., 0], jnp.logical_and(normalisable, later))

  zmax = jnp.max(jnp.where(allowed, z, -jnp.inf), axis=(-2, -1))
  max_logit = jnp.where(jnp.isfinite(zmax), zmax, 0.0)

  lse = log_normalizer[..., 0]
  lse = jnp.where(has_key, jnp.where(jnp.isfinite(lse), lse, 0.0), empty_logsumexp)
  row_sum = row_mean(jnp.sum(w, axis=-1), has_key)
  return AttentionStats(
    sink_mass=sink_mass, entropy=entropy, max_logit=max_logit, logsumexp=lse, row_sum=row_sum
  )


def stats_from_rows(
  rows: dict, q_positions: Array, axis: Optional[str] = None, empty_logsumexp: float = 0.0
) -> tuple:
  """``(sink_mass, entropy, max_logit, logsumexp, row_sum)`` from the statistics rows.

  Args:
    rows: ``[B, N, T]`` per query row: ``entropy``, ``p0``, ``row_sum``, ``row_max``,
      ``lse`` (0 on a row without keys), and the masks ``normalisable`` and ``has_key``.
    q_positions: ``[T]`` global positions of the rows (``sink_mass`` leaves out position 0).
    axis: None, or a ``shard_map`` axis whose devices hold the other rows of the call (a
      sequence sharded over it): the means and the maximum are then over every device's
      rows (sums and counts summed over the axis), the same on every device.
    empty_logsumexp: the ``logsumexp`` of a row with no allowed key (the kernel's own count
      of the row's keys says which: ``has_key``).

  Returns:
    ``(sink_mass [B, N], entropy [B, N], max_logit [B, N], logsumexp [B, N, T],
    row_sum [B, N])``, the fields of :class:`.AttentionStats`.
  """
  later = (q_positions >= 1)[None, None, :]
  means = (
    (rows["entropy"], rows["normalisable"]),
    (rows["p0"], jnp.logical_and(rows["normalisable"], later)),
    (rows["row_sum"], rows["has_key"]),
  )
  sums = [
    (jnp.sum(jnp.where(keep, x, 0.0), axis=-1), jnp.sum(keep, axis=-1, dtype=jnp.float32))
    for x, keep in means
  ]
  row_max = jnp.max(rows["row_max"], axis=-1)
  if axis is not None:
    # One all-reduce for the sums, then one for the maximum (after it): collectives that do
    # not depend on each other may run in different orders on the devices of a CPU host,
    # which deadlocks its in-process communicator.
    sums = jax.lax.psum(sums, axis)
    row_max, _ = jax.lax.optimization_barrier((row_max, sums))
    row_max = jax.lax.pmax(row_max, axis)
  entropy, sink_mass, row_sum = (total / jnp.maximum(count, 1.0) for total, count in sums)
  max_logit = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  lse = rows["lse"]
  if empty_logsumexp != 0.0:
    lse = jnp.where(rows["has_key"], lse, empty_logsumexp)
  return sink_mass, entropy, max_logit, lse, row_sum


def stats_from_padded_rows(rows: dict, T: int, empty_logsumexp: float = 0.0) -> tuple:
  """:func:`.stats_from_rows` of a kernel's per-row outputs ``[B, N, Tp, 1]`` (``Tp >= T``
  padded rows; the masks as numbers, > 0 = True), rows at positions ``0`` to ``T - 1``.

  Args:
    rows: the kernel's ``[B, N, Tp, 1]`` rows (keys as :func:`.stats_from_rows`).
    T: the real number of rows.
    empty_logsumexp: the ``logsumexp`` of a row with no allowed key.

  Returns:
    As :func:`.stats_from_rows`.
  """
  cat = {key: val[:, :, :T, 0] for key, val in rows.items()}
  for key in ("normalisable", "has_key"):
    cat[key] = cat[key] > 0
  return stats_from_rows(cat, jnp.arange(T), empty_logsumexp=empty_logsumexp)
