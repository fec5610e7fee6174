"""attnjax: pure, jitted, differentiable attention variants for research in JAX.

>>> import jax
>>> import attnjax
>>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))   # [B, T, N, H]
>>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))  # [B, S, K, H]
>>> out, stats = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
>>> out.shape, stats.sink_mass.shape
((2, 16, 4, 8), (2, 4))

Flat, as optax: ``__all__`` is what ``dir(attnjax)`` offers. ``import attnjax`` loads no
flax: ``nn``, ``models``, ``train``, ``data``, ``kernels``, ``targets``, ``check`` load on use.
"""

from attnjax import attention_stats
from attnjax import block_select
from attnjax import compressed
from attnjax import cosine
from attnjax import delta_rule
from attnjax import dense
from attnjax import dsa
from attnjax import feature_maps
from attnjax import gated_linear
from attnjax import layout
from attnjax import linear
from attnjax import masks
from attnjax import mla
from attnjax import mods
from attnjax import normalizers
from attnjax import nsa
from attnjax import options
from attnjax import parallel
from attnjax import patterns
from attnjax import qk_norm
from attnjax import sparse
from attnjax import stats
from attnjax.attention_stats import AttentionStats
from attnjax.block_select import block_select_attention
from attnjax.compressed import compressed_attention
from attnjax.dsa import dsa_attention
from attnjax.delta_rule import delta_rule_attention
from attnjax.dense import dot_product_attention
from attnjax.gated_linear import gated_linear_attention
from attnjax.linear import linear_attention
from attnjax.cosine import cosine_attention
from attnjax.mla import mla_attention
from attnjax.nsa import nsa_attention
from attnjax.qk_norm import qk_norm_attention
from attnjax.sparse import sparse_attention
from attnjax._src.config import config
from attnjax._version import __version__ as __version__

# Packages that load on first access (PEP 562): the Flax-backed layers, the training loop and
# its data, the engines, the compile-only targets and the device check. ``import attnjax``
# loads only the functions layer and never flax; ``attnjax.nn.Attention`` works after it all
# the same.
_LAZY = ("check", "data", "kernels", "models", "nn", "targets", "train")


def __getattr__(name: str):
  if name in _LAZY:
    import importlib

    return importlib.import_module(f"attnjax.{name}")
  raise AttributeError(f"module 'attnjax' has no attribute {name!r}")


def __dir__():
  return sorted(__all__ + [n for n in globals() if n.startswith("__") and n.endswith("__")])


__all__ = [
  "AttentionStats",
  "attention_stats",
  "block_select",
  "block_select_attention",
  "check",
  "compressed",
  "compressed_attention",
  "config",
  "cosine",
  "cosine_attention",
  "data",
  "delta_rule",
  "delta_rule_attention",
  "dense",
  "dot_product_attention",
  "dsa",
  "dsa_attention",
  "feature_maps",
  "gated_linear",
  "gated_linear_attention",
  "kernels",
  "layout",
  "linear",
  "linear_attention",
  "masks",
  "mla",
  "mla_attention",
  "models",
  "mods",
  "nn",
  "normalizers",
  "nsa",
  "nsa_attention",
  "options",
  "parallel",
  "patterns",
  "qk_norm",
  "qk_norm_attention",
  "sparse",
  "sparse_attention",
  "stats",
  "targets",
  "train",
]
