"""Boolean attention masks: True = the query may attend to the key.

Every family builds its masks from one function, :func:`.structural_mask`, on *position
vectors*: the dense reference calls it with all positions, block-wise paths with one
block's, so a block is masked by exactly the reference's rule. Conventions are
``jax.nn.dot_product_attention``'s: query ``i`` at position ``i + offset`` (a decoder
with ``S`` cached keys and ``T`` new queries passes ``offset=S - T``),
``window=(left, right)`` keeps ``pos_q - left <= pos_k <= pos_q + right`` (an int ``w``
is ``(w, 0)``), equal segment ids attend; every builder returns a rank-4 array
broadcastable to ``[B, N, T, S]``.

Guide: :doc:`/guides/sparse`, section "Positions, windows and layouts".
"""

from attnjax._src.masks import (
  causal_mask,
  combine_masks,
  make_attention_mask,
  padding_mask,
  segment_mask,
  segment_resets,
  structural_mask,
  window_mask,
)

__all__ = [
  "causal_mask",
  "combine_masks",
  "make_attention_mask",
  "padding_mask",
  "segment_mask",
  "segment_resets",
  "structural_mask",
  "window_mask",
]
