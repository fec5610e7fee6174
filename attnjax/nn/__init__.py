"""Flax NNX modules: one attention layer for every attnjax variant, and a decoder LM.

>>> import jax
>>> from flax import nnx
>>> from attnjax import nn
>>> cfg = nn.ModelConfig(vocab_size=64, d_model=32, num_layers=2,
...                      attention=nn.AttentionConfig(family="qk_norm", num_heads=4))
>>> model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
>>> model(jax.random.randint(jax.random.key(0), (2, 16), 0, 64)).shape   # [B, T, V]
(2, 16, 64)

Guides: :doc:`/guides/layers`, :doc:`/guides/kv_caches`, :doc:`/guides/diagnostics`.
"""

from attnjax.nn import specs
from attnjax._src.nn import (
  CACHE_POLICIES,
  LOGICAL_AXIS_RULES,
  MLP,
  Attention,
  AttentionConfig,
  AttentionSpec,
  CosineSpec,
  CrossCache,
  DenseSpec,
  EncoderConfig,
  EncoderLM,
  FeatureProjection,
  GatedCache,
  H2OCache,
  KVCache,
  LinearCache,
  LinearSpec,
  ModelConfig,
  QKNormSpec,
  QuantizedKVCache,
  SparseSpec,
  TransformerBlock,
  TransformerLM,
  apply_rope,
  cache_bytes,
  cache_bytes_for,
  collect_stats,
  decode_step,
  flax_attention_fn,
  generate,
  init_cache,
  layer_stats,
  log_normalizer,
  num_params,
  outlier_stats,
  padding_mask,
  register_family,
  state_shardings,
)

__all__ = [
  "CACHE_POLICIES",
  "LOGICAL_AXIS_RULES",
  "MLP",
  "Attention",
  "AttentionConfig",
  "AttentionSpec",
  "CosineSpec",
  "CrossCache",
  "DenseSpec",
  "EncoderConfig",
  "EncoderLM",
  "FeatureProjection",
  "GatedCache",
  "H2OCache",
  "KVCache",
  "LinearCache",
  "LinearSpec",
  "ModelConfig",
  "QKNormSpec",
  "QuantizedKVCache",
  "SparseSpec",
  "TransformerBlock",
  "TransformerLM",
  "apply_rope",
  "cache_bytes",
  "cache_bytes_for",
  "collect_stats",
  "decode_step",
  "flax_attention_fn",
  "generate",
  "init_cache",
  "layer_stats",
  "log_normalizer",
  "num_params",
  "padding_mask",
  "register_family",
  "specs",
  "state_shardings",
  "outlier_stats",
]
