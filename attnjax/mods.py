"""Ready score and mask modifiers (FlexAttention-style ``score_mod`` / ``mask_mod``).

Pass them to :func:`attnjax.dot_product_attention`, :func:`attnjax.sparse_attention`,
:func:`attnjax.qk_norm_attention` or :func:`attnjax.cosine_attention`:

>>> import jax
>>> import attnjax
>>> from attnjax import mods
>>> N = 4
>>> q = jax.random.normal(jax.random.key(0), (2, 16, N, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
>>> out = attnjax.dot_product_attention(
...     q, k, v, score_mod=mods.alibi, score_mod_args=(mods.alibi_slopes(N),),
...     mask_mod=mods.causal_mask)
>>> out.shape
(2, 16, 4, 8)

Conventions (every path calls modifiers the same way):

- ``score_mod(z, b, n, i, j, *args) -> z'``: ``z`` float32 logits after
  ``scale``, ``softcap`` and ``bias``, just before the normaliser; ``b, n, i,
  j`` int32 arrays (batch, query head, query position, key position)
  broadcastable against ``z``, with ``i`` varying along axis -2 and ``j``
  along axis -1. Write modifiers with elementwise ``jnp`` operations.
- ``mask_mod(b, n, i, j, *args) -> bool`` (True = may attend), intersected
  with every other mask.
- Modifiers are static arguments: they must be hashable. Module-level
  functions are; the factories here return frozen dataclasses, so two equal
  configurations share one compiled program. Arrays a modifier reads go in
  ``score_mod_args`` / ``mask_mod_args`` (``score_mod_args`` receive
  gradients), never in a closure.

Score modifiers: :func:`.alibi` (+ :func:`.alibi_slopes`), :class:`.T5RelativeBias`
(:func:`.t5_relative_bias`, learned table), :class:`.SoftCap`,
:class:`.PositionTemperature` (Llama 4). Mask modifiers: :func:`~attnjax.mods.causal_mask`,
:class:`.SlidingWindowMask`, :class:`.ChunkedMask`, :func:`.prefix_lm_mask`,
:func:`.document_mask`, :func:`.causal_document_mask`, and any
:mod:`attnjax.patterns` pattern through :class:`.PatternMask`. Combine mask
modifiers with :class:`.And`, score modifiers with :class:`.ScoreChain`.
"""

from attnjax._src.mods import (And, ChunkedMask, PatternMask, PositionTemperature, ScoreChain,
                               SlidingWindowMask, SoftCap, T5RelativeBias, alibi, alibi_slopes,
                               causal_document_mask, causal_mask, chunked_mask, document_mask,
                               pattern_mask, position_temperature_factor, prefix_lm_mask,
                               sliding_window_mask, t5_bucket, t5_relative_bias)
from attnjax._src.mods import __getattr__ as __getattr__

__all__ = ["And", "ChunkedMask", "PatternMask", "PositionTemperature", "ScoreChain",
    "SlidingWindowMask", "SoftCap", "T5RelativeBias", "alibi", "alibi_slopes",
    "causal_document_mask", "causal_mask", "chunked_mask", "document_mask", "pattern_mask",
    "position_temperature_factor", "prefix_lm_mask", "sliding_window_mask", "t5_bucket",
    "t5_relative_bias"]
