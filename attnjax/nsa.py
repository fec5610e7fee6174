"""Native Sparse Attention (Yuan et al. 2025): compressed, selected and window branches, gated.

>>> import jax, jax.numpy as jnp, attnjax
>>> q = jax.random.normal(jax.random.key(0), (1, 128, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (1, 128, 2, 8))
>>> gates = jnp.full((1, 128, 4, 3), 0.5)
>>> attnjax.nsa_attention(q, k, v, gates, block_length=16, stride=8, selection_block=16,
...                       num_selected=4, window=32).shape
(1, 128, 4, 8)

Guide: :doc:`/guides/sparse`, section "Native sparse attention".
"""

from attnjax._src.ops.nsa.attention import (
  ENGINES,
  FALLBACK,
  IMPLEMENTATIONS,
  OP,
  PREFERENCES,
  Compressor,
  NSAStats,
  compress,
  nsa_attention,
  selection_scores,
)

__all__ = [
  "ENGINES",
  "FALLBACK",
  "IMPLEMENTATIONS",
  "OP",
  "PREFERENCES",
  "Compressor",
  "NSAStats",
  "compress",
  "nsa_attention",
  "selection_scores",
]
