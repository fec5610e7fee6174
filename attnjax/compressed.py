"""Memory-compressed attention: queries attend to keys and values pooled along the sequence.

:func:`attnjax.compressed_attention` pools keys and values in blocks of ``stride`` (Liu
et al. 2018); ``window`` adds the raw keys of a local window in one normalisation (NSA):

>>> import jax, attnjax
>>> q = jax.random.normal(jax.random.key(0), (2, 64, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (2, 64, 2, 8))
>>> attnjax.compressed_attention(q, k, v, stride=4, is_causal=True, window=16).shape
(2, 64, 4, 8)

Guide: :doc:`/guides/sparse`, section "Memory-compressed attention and the dilated window".
"""

from attnjax._src.ops.compressed.attention import (
  IMPLEMENTATIONS,
  POOLS,
  compressed_attention,
  num_blocks,
  pool_keys,
)

__all__ = ["IMPLEMENTATIONS", "POOLS", "compressed_attention", "num_blocks", "pool_keys"]
