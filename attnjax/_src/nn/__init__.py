"""Flax NNX modules: one attention layer for every attnjax variant, and a decoder LM.

Implementation behind the public module :mod:`attnjax.nn`.
"""

from attnjax._src.nn import specs
from attnjax._src.nn.attention import Attention
from attnjax._src.nn.caches import CrossCache, FeatureProjection, GatedCache, KVCache, LinearCache
from attnjax._src.nn.caches import H2OCache, QuantizedKVCache, cache_bytes
from attnjax._src.nn.kv_policies import CACHE_POLICIES, cache_bytes_for
from attnjax._src.nn.config import AttentionConfig, EncoderConfig, ModelConfig
from attnjax._src.nn.specs import (
  AttentionSpec,
  CosineSpec,
  DenseSpec,
  LinearSpec,
  QKNormSpec,
  SparseSpec,
  register_family,
)
from attnjax._src.nn.decode import decode_step, generate, init_cache
from attnjax._src.nn.encoder import EncoderLM, padding_mask
from attnjax._src.nn.flax_interop import flax_attention_fn
from attnjax._src.nn.probe import layer_stats
from attnjax._src.nn.outliers import outlier_stats
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.transformer import (
  LOGICAL_AXIS_RULES,
  MLP,
  TransformerBlock,
  TransformerLM,
  collect_stats,
  log_normalizer,
  num_params,
  state_shardings,
)

__all__ = [
  "Attention",
  "CACHE_POLICIES",
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
  "LOGICAL_AXIS_RULES",
  "LinearCache",
  "LinearSpec",
  "MLP",
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
