"""Ready score and mask modifiers (FlexAttention-style ``score_mod`` / ``mask_mod``).

>>> import jax, attnjax
>>> from attnjax import mods
>>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
>>> attnjax.dot_product_attention(q, k, v, score_mod=mods.alibi,
...     score_mod_args=(mods.alibi_slopes(4),), mask_mod=mods.causal_mask).shape
(2, 16, 4, 8)

Modifiers are hashable static arguments; arrays they read go in ``score_mod_args`` /
``mask_mod_args``. Conventions and the ready modifiers: :doc:`/guides/modifiers`.
"""

from attnjax._src.mods import (
  And,
  ChunkedMask,
  PatternMask,
  PositionTemperature,
  ScoreChain,
  SlidingWindowMask,
  SoftCap,
  T5RelativeBias,
  alibi,
  alibi_slopes,
  causal_document_mask,
  causal_mask,
  chunked_mask,
  document_mask,
  pattern_mask,
  position_temperature_factor,
  prefix_lm_mask,
  sliding_window_mask,
  t5_bucket,
  t5_relative_bias,
)
from attnjax._src.mods import __getattr__ as __getattr__

__all__ = [
  "And",
  "ChunkedMask",
  "PatternMask",
  "PositionTemperature",
  "ScoreChain",
  "SlidingWindowMask",
  "SoftCap",
  "T5RelativeBias",
  "alibi",
  "alibi_slopes",
  "causal_document_mask",
  "causal_mask",
  "chunked_mask",
  "document_mask",
  "pattern_mask",
  "position_temperature_factor",
  "prefix_lm_mask",
  "sliding_window_mask",
  "t5_bucket",
  "t5_relative_bias",
]
