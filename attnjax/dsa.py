"""DeepSeek Sparse Attention (DeepSeek-V3.2): attention over each query's top-k keys.

:func:`attnjax.dsa_attention` scores keys with a lightning indexer,
``I[t, s] = sum_h w[t, h] relu(q_I[t, h] . k_I[s])``, keeps each query's ``top_k`` causal
keys (ties to the lowest index) and attends to them; :func:`indexer_loss` is the KL loss
that trains the indexer (dense warm-up, or over the selected keys):

>>> import jax, attnjax
>>> q = jax.random.normal(jax.random.key(0), (1, 64, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (1, 64, 1, 8))
>>> iq = jax.random.normal(jax.random.key(2), (1, 64, 2, 4))
>>> ik = jax.random.normal(jax.random.key(3), (1, 64, 4))
>>> w = jax.random.normal(jax.random.key(4), (1, 64, 2))
>>> attnjax.dsa_attention(q, k, v, iq, ik, w, top_k=16).shape
(1, 64, 4, 8)

Guide: :doc:`/guides/sparse`, section "DeepSeek sparse attention".
"""

from attnjax._src.ops.dsa.attention import (
  ENGINES,
  FALLBACK,
  IMPLEMENTATIONS,
  OP,
  PREFERENCES,
  dsa_attention,
  index_scores,
  indexer_loss,
  select_keys,
)

__all__ = [
  "ENGINES",
  "FALLBACK",
  "IMPLEMENTATIONS",
  "OP",
  "PREFERENCES",
  "dsa_attention",
  "index_scores",
  "indexer_loss",
  "select_keys",
]
