"""The answer to a call with no queries or no keys, given before any engine is chosen.

With ``T = 0`` there is nothing to compute: the output is the empty ``[B, 0, N, Hv]``. With
``S = 0`` every query row has no allowed key, so by the rule every family shares (a row
with no allowed key is zero, its statistics finite) the output is zeros and the statistics
are those of empty rows: ``sink_mass``, ``entropy``, ``max_logit`` and ``row_sum`` zero,
``logsumexp`` the options' value for an empty row. A recurrent family over ``T = 0`` steps
leaves its state as it was. The families answer these calls here, so that every
implementation (the reference included) gives the same answer and no engine sees a
zero-length axis.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from attnjax._src.attention_stats import AttentionStats

Array = jnp.ndarray


def is_empty(q: Any, k: Any) -> bool:
  """True when ``q [B, T, N, H]`` has no queries or ``k [B, S, K, H]`` no keys."""
  return q.shape[1] == 0 or k.shape[1] == 0


def empty_stats(B: int, N: int, T: int, empty_logsumexp: float = 0.0) -> AttentionStats:
  """:class:`attnjax.AttentionStats` of ``T`` rows that have no allowed key."""
  zeros = jnp.zeros((B, N), jnp.float32)
  return AttentionStats(
    sink_mass=zeros,
    entropy=zeros,
    max_logit=zeros,
    logsumexp=jnp.full((B, N, T), empty_logsumexp, jnp.float32),
    row_sum=zeros,
  )


def dense(inputs: Any, opts: Any):
  """A dense call (:class:`attnjax.options.DenseInputs`, :class:`attnjax.options.DenseOptions`)
  with ``T = 0`` or ``S = 0``: zeros ``[B, T, N, Hv]`` in ``q``'s dtype, with
  :func:`empty_stats` when ``opts.return_stats``."""
  B, T, N, _ = inputs.q.shape
  out = jnp.zeros((B, T, N, inputs.v.shape[3]), inputs.q.dtype)
  if not opts.return_stats:
    return out
  return out, empty_stats(B, N, T, opts.empty_row_logsumexp)


def no_steps(v: Array, state: Array) -> tuple[Array, Array]:
  """A recurrent scan over ``T = 0`` steps: the empty output ``[B, 0, K, G, Hv]`` (float32)
  for values ``v [B, 0, K, Hv]`` and state ``[B, K, G, H, Hv]``, and the state unchanged."""
  B, _, K, G, _, Hv = (v.shape[0], 0) + state.shape[1:]
  return jnp.zeros((B, 0, K, G, Hv), jnp.float32), state
