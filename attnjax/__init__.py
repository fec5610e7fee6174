"""attnjax: pure, jitted, differentiable attention variants for research in JAX.

The public API is flat, as in optax::

  import attnjax
  out, stats = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)

Shapes follow ``jax.nn.dot_product_attention``: q ``[B, T, N, H]``, k and v
``[B, S, K, H]`` with ``N % K == 0``; the output is ``[B, T, N, H]``.
"""

from attnjax import feature_maps
from attnjax import masks
from attnjax import normalizers
from attnjax import patterns
from attnjax.attention_stats import AttentionStats
from attnjax.dense import dot_product_attention
from attnjax.linear import linear_attention
from attnjax.qk_norm import cosine_attention
from attnjax.qk_norm import qk_norm_attention
from attnjax.sparse import sparse_attention
from attnjax import nn  # noqa: E402  (after the functions it wraps)
from attnjax import stats  # noqa: E402  (its probe reads attnjax.nn models)

__version__ = "0.1.0"

__all__ = [
    "AttentionStats",
    "cosine_attention",
    "dot_product_attention",
    "feature_maps",
    "linear_attention",
    "masks",
    "nn",
    "normalizers",
    "patterns",
    "qk_norm_attention",
    "stats",
    "sparse_attention",
]
