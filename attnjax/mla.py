"""Multi-head latent attention (DeepSeek V2/V3, Kimi): one cached latent per token.

:func:`attnjax.mla_attention` rebuilds each head's keys and values from a latent ``c`` and
one shared RoPE key, or (``absorb=True``, decode) attends over ``[c | k_rope]`` with the
up-projections folded into the queries and the output:

>>> import jax, attnjax
>>> B, T, N, R, d_n, d_r, d_v = 2, 16, 4, 32, 8, 4, 8
>>> ks = jax.random.split(jax.random.key(0), 5)
>>> q = jax.random.normal(ks[0], (B, T, N, d_n + d_r))
>>> k_rope = jax.random.normal(ks[1], (B, T, 1, d_r))
>>> c = jax.random.normal(ks[2], (B, T, 1, R))
>>> w_uk, w_uv = jax.random.normal(ks[3], (R, N, d_n)), jax.random.normal(ks[4], (R, N, d_v))
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
