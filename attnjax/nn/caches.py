"""Decode caches of :class:`attnjax.nn.Attention`: pytrees threaded through pure calls.

- :class:`KVCache`: keys and values of a softmax-style layer, stored before
  RoPE, with each slot's sequence position, RoPE position and segment id.
- :class:`LinearCache`: the recurrent state of a linear-attention layer.
- :class:`GatedCache`: the recurrent state of a gated or delta-rule layer
  (``retnet``, ``mamba2_decay``, ``gla``, ``deltanet``, ``gated_deltanet``),
  with the tail of its short convolution.
- :class:`CrossCache`: the projected keys and values of a cross-attention
  layer's second sequence, filled on the first call and reused after it.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax.numpy as jnp
from flax import nnx

from attnjax import linear as linear_lib

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


class LinearCache(NamedTuple):
  """Decode state of a linear-attention layer.

  Attributes:
    state: :class:`attnjax.linear.LinearState` (``kv_sum [B, K, F, Hv]``,
      ``k_sum [B, K, F]``), the sums over every key seen.
    index: ``[]`` int32, tokens seen so far.
  """

  state: linear_lib.LinearState
  index: Array


class GatedCache(NamedTuple):
  """Decode state of a gated or delta-rule linear-attention layer (:mod:`attnjax.nn.gated_spec`).

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


Cache = Union[KVCache, LinearCache, GatedCache, CrossCache]


class FeatureProjection(nnx.Variable):
  """Random-feature directions ``[m, H]`` of FAVOR+ / trig maps: state, not a trained ``Param``."""
