"""Boolean attention masks: True = the query may attend to the key.

Every family builds its masks here, from one function, :func:`.structural_mask`,
that works on *position vectors*. The dense reference calls it with all
positions; block-wise and block-sparse paths call it with the positions of one
block, so a block is masked by exactly the rule the reference uses.

Conventions (as ``jax.nn.dot_product_attention``):

- Query ``i`` sits at position ``i + offset`` and key ``j`` at position ``j``;
  with the default ``offset=0`` causal masks are aligned top-left (query ``i``
  sees keys ``j <= i``), as in ``jax.nn``. A decoder that holds ``S`` cached
  keys and asks ``T`` new queries passes ``offset=S - T``.
- ``window=(left, right)`` allows keys with
  ``pos_q - left <= pos_k <= pos_q + right``; an int ``w`` means ``(w, 0)``
  (keys ``pos_q - w .. pos_q``), the convention of every family
  (``attnjax._checks.check_window``).
- Segment ids (packed sequences) allow pairs with equal ids.
- Every builder returns a rank-4 array broadcastable to ``[B, N, T, S]``.
"""

from attnjax._src.masks import (causal_mask, combine_masks, make_attention_mask, padding_mask,
                                segment_mask, segment_resets, structural_mask, window_mask)

__all__ = ["causal_mask", "combine_masks", "make_attention_mask", "padding_mask", "segment_mask",
    "segment_resets", "structural_mask", "window_mask"]
