"""Decode caches of :class:`attnjax.nn.Attention`: pytrees threaded through pure calls.

:class:`.KVCache` (keys and values stored before RoPE, with each slot's positions and
segment id), :class:`.QuantizedKVCache` (int8 / fp8 with a scale per token and KV head),
:class:`.H2OCache` (a budget of slots with the attention each received),
:class:`.LinearCache` and :class:`.GatedCache` (recurrent states) and
:class:`.CrossCache` (a cross-attention layer's projected memory).

Guide: docs/guides/kv_caches.md. Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.ops.linear.attention import LinearState

Array = jnp.ndarray


class KVCache(NamedTuple):
  """Decode cache of a softmax-style (dense-kernel or sparse) layer.

  Attributes:
    k: ``[B, C, K, H]`` keys before RoPE (after any pre-RoPE QK norm).
    v: ``[B, C, K, Hv]`` values.
    positions: ``[C]`` int32 sequence position held by each slot; -1 = empty.
    index: ``[]`` int32, tokens seen so far (the position of the next token).
    rope_positions: ``[B, C]`` int32 RoPE position of each slot (the
      ``positions`` argument of the call that wrote it; its sequence position
      by default).
    segment_ids: ``[B, C]`` int32 segment of each slot (0 by default).
  """

  k: Array
  v: Array
  positions: Array
  index: Array
  rope_positions: Array
  segment_ids: Array


class QuantizedKVCache(NamedTuple):
  """:class:`.KVCache` with quantised keys and values (``cache_policy="int8"`` or ``"fp8"``).

  Each key (value) vector ``x`` of one token and key/value head is stored as
  ``round(x / s)`` in int8 with ``s = max|x| / 127``, or as ``x / s`` cast to
  float8_e4m3fn with ``s = max|x| / 448``; attention reads ``stored * s``.

  Attributes:
    k: ``[B, C, K, H]`` int8 or float8_e4m3fn keys before RoPE.
    v: ``[B, C, K, Hv]`` values, same dtype.
    k_scale: ``[B, C, K]`` float32 scale of each stored key.
    v_scale: ``[B, C, K]`` float32 scale of each stored value.
    positions, index, rope_positions, segment_ids: as :class:`.KVCache`.
  """

  k: Array
  v: Array
  k_scale: Array
  v_scale: Array
  positions: Array
  index: Array
  rope_positions: Array
  segment_ids: Array


class H2OCache(NamedTuple):
  """Heavy-hitter cache (``cache_policy="h2o"``, Zhang et al. 2023).

  Every sequence and key/value head keeps its own ``C = cache_budget`` slots,
  so positions are per slot, sequence and head. ``scores`` holds, for each
  slot, the sum of the absolute attention weights it has received since it
  was written: over every query token of every call and over the query heads
  of its key/value head's group (see :mod:`attnjax.nn.kv_policies`).

  Attributes:
    k: ``[B, C, K, H]`` keys before RoPE.
    v: ``[B, C, K, Hv]`` values.
    scores: ``[B, C, K]`` float32 accumulated attention of each slot.
    positions: ``[B, C, K]`` int32 sequence position of each slot; -1 = empty.
    index: ``[]`` int32, tokens seen so far.
    rope_positions: ``[B, C, K]`` int32 RoPE position of each slot.
    segment_ids: ``[B, C, K]`` int32 segment of each slot.
  """

  k: Array
  v: Array
  scores: Array
  positions: Array
  index: Array
  rope_positions: Array
  segment_ids: Array


class LinearCache(NamedTuple):
  """Decode state of a linear-attention layer.

  Attributes:
    state: :class:`attnjax.linear.LinearState` (``kv_sum [B, K, F, Hv]``,
      ``k_sum [B, K, F]``), the sums over every key seen.
    index: ``[]`` int32, tokens seen so far.
  """

  state: LinearState
  index: Array


class GatedCache(NamedTuple):
  """Decode state of a gated or delta-rule linear-attention layer (``attnjax._src.nn.gated_spec``).

  Attributes:
    state: ``[B, N, H, Hv]`` float32 recurrent state (the ``initial_state`` of
      :func:`attnjax.gated_linear_attention` / :func:`attnjax.delta_rule_attention`).
    index: ``[]`` int32, tokens seen so far.
    segment_id: ``[B]`` int32 segment of the last token seen (0 before any):
      a call whose first token starts another segment resets the state.
    conv: with a short convolution, the last ``W - 1`` inputs of the q, k and v
      convolutions, ``([B, W-1, N*H], [B, W-1, K*H], [B, W-1, K*Hv])``; else None.
    conv_segment_ids: ``[B, W - 1]`` int32 segments of those inputs; else None.
  """

  state: Array
  index: Array
  segment_id: Array
  conv: Optional[tuple[Array, Array, Array]] = None
  conv_segment_ids: Optional[Array] = None


class CrossCache(NamedTuple):
  """Cross-attention cache: the keys and values projected from ``inputs_kv``.

  Attributes:
    k: ``[B, S, K, H]`` projected keys of the second sequence.
    v: ``[B, S, K, Hv]`` projected values.
  """

  k: Array
  v: Array


Cache = Union[KVCache, QuantizedKVCache, H2OCache, LinearCache, GatedCache, CrossCache]


def cache_bytes(cache: Any) -> int:
  """Bytes the arrays of ``cache`` hold: every leaf (keys, values, scales, scores, positions).

  Args:
    cache: one layer's cache, a model's list of them, or any pytree of arrays
      (``jax.ShapeDtypeStruct`` leaves count too, so an abstract ``jax.eval_shape``
      cache costs nothing to measure).

  Returns:
    The sum over leaves of their element count times item size.

  Raises:
    TypeError: a leaf that is not an array (no ``shape`` and ``dtype``).
  """
  total = 0
  for leaf in jax.tree.leaves(cache):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      raise TypeError(f"cache must hold arrays, got a leaf of type {type(leaf).__name__}")
    total += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
  return int(total)


class FeatureProjection(nnx.Variable):
  """Random-feature directions ``[m, H]`` of FAVOR+ / trig maps: state, not a trained ``Param``."""
