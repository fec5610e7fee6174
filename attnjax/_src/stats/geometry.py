"""Query/key geometry: q/k RMS, cosines, max logit, sink geometry, value-state drain.

References: Wortsman et al. 2023 (q/k growth, max logit); Gu et al. 2024 (sink geometry);
Guo et al. 2024 (value-state drain).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attnjax._src import validators, logits
from attnjax._src.stats.inputs import _allowed_pairs, _lift, shape_of, _stack_layers
from attnjax._src.stats.results import LayerMean, QKStatistics, SinkGeometry

Array = jnp.ndarray


def _qkv_layers(q, k, v=None):
  q = _stack_layers("q", q, 4, "[B, T, N, H]")
  k = _stack_layers("k", k, 4, "[B, S, K, H]")
  if v is not None:
    v = _stack_layers("v", v, 4, "[B, S, K, Hv]")
    if v.shape[:4] != k.shape[:4]:
      raise ValueError(
        f"k and v must agree on [L, B, S, K], got k {shape_of(k)} and v {shape_of(v)}"
      )
  L, B, T, N, H = q.shape
  if k.shape[0] != L or k.shape[1] != B or k.shape[4] != H:
    raise ValueError(
      f"q [L, B, T, N, H] and k [L, B, S, K, H] disagree: q {shape_of(q)}, k {shape_of(k)}"
    )
  if N % k.shape[3] != 0:
    raise ValueError(
      f"query heads N={N} must be a multiple of key heads K={k.shape[3]} "
      f"(q {shape_of(q)}, k {shape_of(k)})"
    )
  return q, k, v


def _unit(x: Array) -> Array:
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return x / jnp.where(norm > 0, norm, 1.0)


def _pair_cosines(q: Array, k: Array) -> Array:
  """``cos(q_i, k_j)`` ``[L, B, N, T, S]`` through the dense path's grouped scores."""
  L, B, T, N, H = q.shape
  S, K = k.shape[2], k.shape[3]
  qu = jnp.reshape(_unit(q), (L * B, T, N, H))
  ku = jnp.reshape(_unit(k), (L * B, S, K, H))
  cos = logits.scores(logits.group_queries(qu, K), ku, scale=1.0)  # [L*B, K, G, T, S]
  return jnp.reshape(cos, (L, B, N, T, S))


def _qk_statistics(
  q, k, *, scale: Optional[float] = None, is_causal: bool = True, window=None, mask=None
) -> QKStatistics:
  """RMS of queries and keys, mean ``cos(q_i, k_j)`` and max logit (Wortsman et al. 2023).

  Definitions, per layer: ``q_rms = sqrt(mean q^2)`` over batch, tokens, heads
  and head dims (likewise ``k_rms``); ``mean_cos`` = mean over the batch, query
  heads and allowed pairs ``(i, j)`` of ``cos(q_i, k_j)``; ``max_logit`` = max
  over the same of ``scale * <q_i, k_j>``. Wortsman et al. show the logit
  growth behind divergence comes from the norms, not the alignment: large
  ``q_rms * k_rms`` with a modest ``mean_cos``.

  Args:
    q: ``[L, B, T, N, H]`` / ``[B, T, N, H]`` / list per layer (as the
      attention function saw them, after any norm and RoPE).
    k: ``[L, B, S, K, H]`` / ``[B, S, K, H]``; ``N % K == 0`` (GQA).
    scale: logit scale; None means ``H ** -0.5``. (The max logit of a model
      with temperature, softcap or bias is best read from ``AttentionStats``
      with :func:`.max_attention_logit`.)
    is_causal, window, mask: which pairs are allowed.

  Returns:
    :class:`.QKStatistics`, each ``[L]``.

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1 (attention logit growth).
  """
  q, k, _ = _qkv_layers(q, k)
  H = q.shape[-1]
  scale = H**-0.5 if scale is None else validators.check_positive_float("scale", scale)
  window = validators.check_window(window)
  L, B, T, N, _ = q.shape
  allowed = _allowed_pairs((B, N, T, k.shape[2]), is_causal=is_causal, window=window, mask=mask)[
    None
  ]
  cos = _pair_cosines(q, k)
  allowed = jnp.broadcast_to(allowed, cos.shape)
  count = jnp.sum(allowed, axis=(1, 2, 3, 4), dtype=jnp.float32)
  mean_cos = jnp.sum(jnp.where(allowed, cos, 0.0), axis=(1, 2, 3, 4)) / jnp.maximum(count, 1.0)
  K = k.shape[3]
  z = logits.scores(
    logits.group_queries(jnp.reshape(q, (L * B, T, N, H)), K),
    jnp.reshape(k, (L * B, k.shape[2], K, H)),
    scale=scale,
  )
  z = jnp.reshape(z, cos.shape)
  zmax = jnp.max(jnp.where(allowed, z, -jnp.inf), axis=(1, 2, 3, 4))
  rms = lambda x: jnp.sqrt(jnp.mean(x * x, axis=(1, 2, 3, 4)))
  return QKStatistics(
    q_rms=rms(q),
    k_rms=rms(k),
    mean_cos=mean_cos,
    max_logit=jnp.where(jnp.isfinite(zmax), zmax, 0.0),
  )


qk_statistics = jax.jit(_qk_statistics, static_argnames=("scale", "is_causal", "window"))
qk_statistics.__doc__ = _qk_statistics.__doc__


def _sink_geometry(q, k, v, *, is_causal: bool = True, window=None, mask=None) -> SinkGeometry:
  """Geometry of the first token's key and value (Gu et al. 2024, sec. 3).

  Definitions, per layer, averaged over the batch and heads (1-indexed tokens;
  ``j >= 2`` = every key but the first):

  - ``key_norm_ratio = ||k_1|| / mean_{j >= 2} ||k_j||`` per (sequence, kv head);
  - ``value_norm_ratio = ||v_1|| / mean_{j >= 2} ||v_j||``;
  - ``cos_first_key`` = mean over queries ``i >= 2`` allowed to see key 1 of
    ``cos(q_i, k_1)``;
  - ``cos_other_keys`` = mean over allowed pairs ``(i, j)``, ``j >= 2``, of
    ``cos(q_i, k_j)``.

  Gu et al. find the sink works as a key bias: ``k_1`` is aligned with the
  queries (``cos_first_key`` well above ``cos_other_keys``) while ``||k_1||``
  is not large and ``||v_1||`` is small, so the sink stores attention without
  adding much to the output.

  Args:
    q: ``[L, B, T, N, H]`` / ``[B, T, N, H]`` / list per layer.
    k: ``[L, B, S, K, H]`` / ``[B, S, K, H]``, ``S >= 2``.
    v: ``[L, B, S, K, Hv]`` / ``[B, S, K, Hv]``.
    is_causal, window, mask: which pairs are allowed.

  Returns:
    :class:`.SinkGeometry`, each ``[L]``.

  References:
    Gu et al. 2024, "When Attention Sink Emerges in Language Models: An
    Empirical View", sec. 3 (the first token acts as a key bias).
  """
  q, k, v = _qkv_layers(q, k, v)
  S = k.shape[2]
  if S < 2:
    raise ValueError(
      f"sink geometry compares the first key with the others: needs S >= 2, got k {shape_of(k)}"
    )

  def norm_ratio(x):
    norms = jnp.sqrt(jnp.sum(x * x, axis=-1))  # [L, B, S, K]
    others = jnp.mean(norms[:, :, 1:], axis=2)
    ratio = norms[:, :, 0] / jnp.where(others > 0, others, 1.0)
    return jnp.mean(ratio, axis=(1, 2))

  window = validators.check_window(window)
  _, B, T, N, _ = q.shape
  cos = _pair_cosines(q, k)
  allowed = jnp.broadcast_to(
    _allowed_pairs((B, N, T, S), is_causal=is_causal, window=window, mask=mask)[None], cos.shape
  )
  later_query = _lift((jnp.arange(T) >= 1)[:, None], cos.ndim)
  first_key = _lift((jnp.arange(S) == 0)[None, :], cos.ndim)
  sel_first = jnp.logical_and(allowed, jnp.logical_and(later_query, first_key))
  sel_other = jnp.logical_and(allowed, jnp.logical_not(first_key))

  def masked_mean(sel):
    count = jnp.sum(sel, axis=(1, 2, 3, 4), dtype=jnp.float32)
    return jnp.sum(jnp.where(sel, cos, 0.0), axis=(1, 2, 3, 4)) / jnp.maximum(count, 1.0)

  return SinkGeometry(
    key_norm_ratio=norm_ratio(k),
    value_norm_ratio=norm_ratio(v),
    cos_first_key=masked_mean(sel_first),
    cos_other_keys=masked_mean(sel_other),
  )


sink_geometry = jax.jit(_sink_geometry, static_argnames=("is_causal", "window"))
sink_geometry.__doc__ = _sink_geometry.__doc__


def _value_state_drain(v) -> LayerMean:
  """Value-state drain of the first token, per layer and head (Guo et al. 2024).

  Definition: per sequence and kv head, ``||v_1|| / mean_{j >= 2} ||v_j||``
  (1-indexed tokens: ``v_1`` is the first token's value, BOS in the
  experiments), averaged over the batch. Guo et al. find that a head parking
  its attention on BOS drives ``||v_BOS||`` towards zero (a ratio well below
  one), so the dormant head adds almost nothing to the residual stream; the
  per-layer mean is :func:`.sink_geometry`'s ``value_norm_ratio``.

  Args:
    v: values ``[L, B, S, K, Hv]`` / ``[B, S, K, Hv]`` / list per layer, ``S >= 2``.

  Returns:
    :class:`.LayerMean`: ``mean`` scalar, ``per_layer`` ``[L]``, ``per_head``
    ``[L, K]`` (kv heads).

  References:
    Guo et al. 2024, "Active-Dormant Attention Heads: Mechanistically
    Demystifying Extreme-Token Phenomena in LLMs", sec. 2 (value-state drains).
  """
  v = _stack_layers("v", v, 4, "[B, S, K, Hv]")
  if v.shape[2] < 2:
    raise ValueError(
      f"value-state drain compares the first value with the others: needs "
      f"S >= 2, got v {shape_of(v)}"
    )
  validators.check_floating("v", v)
  norms = jnp.sqrt(jnp.sum(jnp.square(v.astype(jnp.float32)), axis=-1))  # [L, B, S, K]
  others = jnp.mean(norms[:, :, 1:], axis=2)
  ratio = norms[:, :, 0] / jnp.where(others > 0, others, 1.0)
  per_head = jnp.mean(ratio, axis=1)
  per_layer = jnp.mean(per_head, axis=1)
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


value_state_drain = jax.jit(_value_state_drain)
value_state_drain.__doc__ = _value_state_drain.__doc__
