"""DeepSeek Sparse Attention (DeepSeek-V3.2): each query's top-k keys by a lightning indexer.

>>> import jax, jax.numpy as jnp, attnjax
>>> q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
>>> iq, ik, w = jnp.ones((1, 64, 2, 4)), jnp.ones((1, 64, 4)), jnp.ones((1, 64, 2))
>>> attnjax.dsa_attention(q, k, v, iq, ik, w, top_k=16).shape
(1, 64, 2, 8)

:func:`indexer_loss` is the KL loss that trains the indexer (dense warm-up or sparse stage).
Guide: :doc:`/guides/sparse`, section "DeepSeek sparse attention".
"""

from attnjax._src.ops.dsa.attention import (
  IMPLEMENTATIONS,
  dsa_attention,
  index_scores,
  indexer_loss,
  select_keys,
)

__all__ = ["IMPLEMENTATIONS", "dsa_attention", "index_scores", "indexer_loss", "select_keys"]
