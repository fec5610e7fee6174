"""Decode-cache policies of the softmax-style layers: what the :class:`.KVCache` stores.

Set on the layer's config (every family on the dense kernel: ``dense``,
``qk_norm``, ``cosine``; ``sparse`` takes the non-evicting ones):

>>> from attnjax import nn
>>> quantised = nn.AttentionConfig(cache_policy="int8")
>>> h2o = nn.AttentionConfig(cache_policy="h2o", cache_budget=64)              # 32 heavy + 32 recent
>>> streaming = nn.AttentionConfig(cache_policy="sinks_window", cache_budget=64)  # 4 sinks + 60 recent
>>> streaming.cache_policy, streaming.cache_budget
('sinks_window', 64)

The training forward is the same for every policy; only what a decode keeps
between calls changes. A call's new tokens attend to the cache and, causally,
to each other (a prefill sees its whole prompt); the policy then decides what
is written back.

- ``"full"``: every key (today's cache; a layer ``window`` / ``num_sinks``
  keeps its rolling cache).
- ``"int8"`` / ``"fp8"``: keys and values quantised per token and key/value
  head, ``x ~ s * round(x / s)`` with ``s = max|x| / 127`` in int8, or ``x / s``
  cast to float8_e4m3fn with ``s = max|x| / 448``; scales are float32. The new
  tokens are quantised before they attend, so a decode does not depend on how
  the sequence is split into calls (:class:`.QuantizedKVCache`).
- ``"h2o"`` (Zhang et al. 2023, "H2O: Heavy-Hitter Oracle"): ``cache_budget``
  slots per sequence and key/value head: the ``cache_recent`` latest tokens
  plus the ``cache_budget - cache_recent`` others with the largest accumulated
  attention. Each slot accumulates ``sum_t sum_{n in group(k)} |w[b, n, t, j]|``:
  the absolute weight (the weight itself for softmax) given to it by every query
  token ``t`` of every call since it was written, summed over the query heads
  ``n`` that share its key/value head ``k``. Weights of the layer's null
  column (``sink_logits``, ``softmax_one``) and of the ``kv_bias`` slot are not
  slots and are not counted. When more than the budget is held, the slots with
  the smallest score outside the recent window are evicted
  (:class:`.H2OCache`). The weights come from the layer's own function applied
  to identity values (``implementation="reference"``; an injected
  ``attention_fn`` receives them too), ``O(T (C + T)^2)`` per call: cheap for
  one-token steps; the output is those weights times the values.
- ``"sinks_window"`` (StreamingLLM, Xiao et al. 2024): the first
  ``cache_budget - cache_recent`` tokens plus the ``cache_recent`` latest; keys
  are rotated by their position in the cache (``streaming_rope="cache"``) or in
  the sequence (``"absolute"``), as the layer's ``window`` + ``num_sinks``
  cache does, which stays available (it also windows the training forward).

With ``cache_budget`` >= the tokens decoded, ``h2o`` and ``sinks_window`` evict
nothing and equal the full forward.
"""

from attnjax._src.nn.kv_policies import (CACHE_POLICIES, DEFAULT_SINKS, EVICTING, QUANTIZED,
                                         bytes_per_layer, cache_bytes_for, cache_type,
                                         check_budget, check_fp8, dequantize, fp8_supported,
                                         h2o_decode, h2o_keep, init_cache, quantize, recent_slots,
                                         validate)

__all__ = ["CACHE_POLICIES", "DEFAULT_SINKS", "EVICTING", "QUANTIZED", "bytes_per_layer",
    "cache_bytes_for", "cache_type", "check_budget", "check_fp8", "dequantize", "fp8_supported",
    "h2o_decode", "h2o_keep", "init_cache", "quantize", "recent_slots", "validate"]
