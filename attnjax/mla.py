"""Multi-head latent attention (DeepSeek V2/V3, Kimi): one cached latent per token.

:func:`attnjax.mla_attention` rebuilds each head's keys and values from a latent
(expanded) or attends over it with the up-projections folded in (absorbed, decode):

>>> import jax.numpy as jnp, attnjax
>>> q, k_rope, c = (jnp.ones(s) for s in ((2, 16, 4, 12), (2, 16, 1, 4), (2, 16, 1, 32)))
>>> w_uk, w_uv = jnp.ones((32, 4, 8)), jnp.ones((32, 4, 8))
>>> attnjax.mla_attention(q, k_rope, c, w_uk, w_uv, is_causal=True).shape
(2, 16, 4, 8)

Guide: :doc:`/guides/mla`.
"""

from attnjax._src.ops.mla.attention import (
  DENSE_KEYWORDS,
  ENGINES,
  FALLBACK,
  IMPLEMENTATIONS,
  OP,
  PREFERENCES,
  LatentCall,
  absorbed_inputs,
  absorbed_is_cheaper,
  check_shapes,
  expanded_inputs,
  mla_attention,
)

__all__ = [
  "DENSE_KEYWORDS",
  "ENGINES",
  "FALLBACK",
  "IMPLEMENTATIONS",
  "OP",
  "PREFERENCES",
  "LatentCall",
  "absorbed_inputs",
  "absorbed_is_cheaper",
  "check_shapes",
  "expanded_inputs",
  "mla_attention",
]
