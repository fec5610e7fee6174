"""attnjax: pure, jitted, differentiable attention variants for research in JAX.

>>> import jax
>>> import attnjax
>>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))   # [B, T, N, H]
>>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))  # [B, S, K, H]
>>> out, stats = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
>>> out.shape, stats.sink_mass.shape
((2, 16, 4, 8), (2, 4))

The API is flat, as in optax. ``import attnjax`` loads no flax: ``attnjax.nn``,
``attnjax.models``, ``attnjax.train`` and ``attnjax.data`` load on first access.
"""

from __future__ import annotations

from attnjax import feature_maps
from attnjax import masks
from attnjax import mods
from attnjax import normalizers
from attnjax import patterns

# The families' and the vocabulary's public modules, as attributes (attnjax.dense.ENGINES).
from attnjax import attention_stats as attention_stats, block_select as block_select
from attnjax import compressed as compressed, cosine as cosine, delta_rule as delta_rule
from attnjax import dense as dense, dsa as dsa, nsa as nsa
from attnjax import gated_linear as gated_linear, layout as layout, linear as linear
from attnjax import mla as mla
from attnjax import options as options, parallel as parallel, qk_norm as qk_norm
from attnjax import sparse as sparse
from attnjax.attention_stats import AttentionStats
from attnjax.block_select import block_select_attention
from attnjax.compressed import compressed_attention
from attnjax.dense import dot_product_attention
from attnjax.dsa import dsa_attention
from attnjax.delta_rule import delta_rule_attention
from attnjax.gated_linear import gated_linear_attention
from attnjax.linear import linear_attention
from attnjax.cosine import cosine_attention
from attnjax.mla import mla_attention
from attnjax.nsa import nsa_attention
from attnjax.qk_norm import qk_norm_attention
from attnjax.sparse import sparse_attention
from attnjax import stats
from attnjax._src.config import config
from attnjax._version import __version__ as __version__


# Flax-backed layers load on first access (PEP 562), so ``import attnjax``
# loads only the functions layer and never flax: ``attnjax.nn.Attention``
# works after ``import attnjax`` all the same.
_LAZY = ("data", "models", "nn", "targets", "train")


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    return importlib.import_module(f"attnjax.{name}")
  raise AttributeError(f"module 'attnjax' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
  "AttentionStats",
  "block_select_attention",
  "compressed_attention",
  "config",
  "cosine_attention",
  "delta_rule_attention",
  "dot_product_attention",
  "dsa_attention",
  "feature_maps",
  "gated_linear_attention",
  "linear_attention",
  "masks",
  "mla_attention",
  "models",
  "mods",
  "nn",
  "normalizers",
  "nsa_attention",
  "patterns",
  "qk_norm_attention",
  "sparse_attention",
  "stats",
  "targets",
]
