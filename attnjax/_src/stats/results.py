"""Result types of the metrics in :mod:`attnjax.stats` (NamedTuples: pytrees under ``jax.jit``).

:func:`attnjax.stats.flatten` and :func:`attnjax.stats.to_jsonable` turn them
into flat ``{"metric/field": value}`` dicts and JSON.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp

Array = jnp.ndarray


class SinkRate(NamedTuple):
  """Result of :func:`.sink_rate`.

  Attributes:
    rate: scalar, percent of (layer, head) pairs with ``alpha_k > eps``,
      averaged over the batch (i.e. over all (sequence, layer, head) triples).
    per_layer: ``[L]`` the same percentage per layer.
    importance: ``[L, B, N]`` ``alpha_k`` of every sequence, layer and head.
    row_sum: ``[L]`` mean raw row sum ``sum_j w_ij`` of the weights (before any
      row normalisation): 1 for softmax, ``1 - null mass`` for softmax_one and
      sink logits, anything for sigmoid / softpick / unnormalised scores.
  """

  rate: Array
  per_layer: Array
  importance: Array
  row_sum: Array


class FirstTokenAttention(NamedTuple):
  """Result of :func:`.first_token_attention`, each a mean over the batch.

  Attributes:
    f_attn: scalar, the mean over layers, heads and queries ``i >= 2``.
    per_layer: ``[L]``.
    per_head: ``[L, N]``.
  """

  f_attn: Array
  per_layer: Array
  per_head: Array


class AttentionEntropy(NamedTuple):
  """Result of :func:`.attention_entropy`.

  Attributes:
    mean: ``[L]`` mean entropy over heads.
    min: ``[L]`` lowest head's entropy.
    per_head: ``[L, N]``.
  """

  mean: Array
  min: Array
  per_head: Array


class QKStatistics(NamedTuple):
  """Result of :func:`.qk_statistics`, each ``[L]``.

  Attributes:
    q_rms: root mean square of the queries.
    k_rms: root mean square of the keys.
    mean_cos: mean cosine of the allowed (query, key) pairs.
    max_logit: largest scaled logit of an allowed pair.
  """

  q_rms: Array
  k_rms: Array
  mean_cos: Array
  max_logit: Array


class SinkGeometry(NamedTuple):
  """Result of :func:`.sink_geometry`, each ``[L]``.

  Attributes:
    key_norm_ratio: ``||k_1|| / mean_{j >= 2} ||k_j||``.
    value_norm_ratio: ``||v_1|| / mean_{j >= 2} ||v_j||``.
    cos_first_key: mean over queries ``i >= 2`` of ``cos(q_i, k_1)``.
    cos_other_keys: mean over allowed pairs ``(i, j)``, ``j >= 2``, of ``cos(q_i, k_j)``.
  """

  key_norm_ratio: Array
  value_norm_ratio: Array
  cos_first_key: Array
  cos_other_keys: Array


class LayerMean(NamedTuple):
  """A quantity over all layers, per layer and per head.

  Attributes:
    mean: scalar, over every layer.
    per_layer: ``[L]``.
    per_head: ``[L, N]``, or None where the quantity has no head axis.
  """

  mean: Array
  per_layer: Array
  per_head: Optional[Array] = None


class MassiveActivations(NamedTuple):
  """Result of :func:`.massive_activations`.

  Attributes:
    count: ``[L]`` number of massive entries per layer, summed over the batch.
    max_abs: ``[L]`` largest ``|h|`` per layer.
    median_abs: ``[L, B]`` median ``|h|`` of each hidden state.
    m_act: scalar, mean over layers of ``max_abs`` (Qiu et al.'s M-Act).
  """

  count: Array
  max_abs: Array
  median_abs: Array
  m_act: Array


class LogitDrift(NamedTuple):
  """Result of :func:`.output_logit_drift`.

  Attributes:
    mean_log_z: scalar, mean of ``log Z`` of the output logits (the drift).
    z_loss: scalar, ``coef * mean(log Z ** 2)``.
  """

  mean_log_z: Array
  z_loss: Array
