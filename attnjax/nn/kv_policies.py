"""Decode-cache policies of the softmax-style layers: what the :class:`.KVCache` stores.

Set on the layer's config; the training forward is the same for every policy:

>>> from attnjax import nn
>>> streaming = nn.AttentionConfig(cache_policy="sinks_window", cache_budget=64)  # 4 sinks + 60 recent
>>> streaming.cache_policy, streaming.cache_budget
('sinks_window', 64)

``"full"``, ``"int8"`` / ``"fp8"`` (:class:`.QuantizedKVCache`), ``"h2o"`` (heavy hitters,
:class:`.H2OCache`) and ``"sinks_window"`` (StreamingLLM).
Guide: :doc:`/guides/kv_caches`, section "Compressed KV caches (``cache_policy``)".
"""

from attnjax._src.nn.kv_policies import (
  CACHE_POLICIES,
  DEFAULT_SINKS,
  EVICTING,
  QUANTIZED,
  bytes_per_layer,
  cache_bytes_for,
  dequantize,
  fp8_supported,
  h2o_keep,
  init_cache,
  quantize,
)

__all__ = [
  "CACHE_POLICIES",
  "DEFAULT_SINKS",
  "EVICTING",
  "QUANTIZED",
  "bytes_per_layer",
  "cache_bytes_for",
  "dequantize",
  "fp8_supported",
  "h2o_keep",
  "init_cache",
  "quantize",
]
