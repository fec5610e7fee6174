"""Sparse attention patterns: which keys each query may see, element by element and block by block.

A pattern is a frozen, hashable object (so it can be a static argument of
``jax.jit``) with one element rule, :meth:`.Pattern.allowed`, evaluated on
*position vectors*. The same rule builds

- the exact dense ``[1, 1, T, S]`` boolean mask (:meth:`.Pattern.mask`), which
  the reference path hands to dense attention, and
- the block layout (:meth:`.Pattern.layout`): for each query block, the key
  blocks holding at least one allowed pair, and which of them are entirely
  allowed (visited without an element mask). The block-sparse path computes
  only those blocks, and masks the partial ones with the same rule.

Positions are top-left aligned as in ``jax.nn.dot_product_attention``: query
``i`` sits at position ``i`` and key ``j`` at position ``j``. Causal and window
parts of every rule come from :func:`attnjax.masks.structural_mask`. A
``window`` follows the convention of every family: ``(left, right)`` keeps keys
``i - left .. i + right`` and an int ``w`` means ``(w, 0)``, keys ``i - w .. i``
(``w + 1`` keys): ``sliding_window(w)``, ``sinks_window(s, w)`` minus its
sinks and ``global_window(g, w)`` minus its globals keep the same keys.
(``dilated_window(window, dilation)`` counts keys instead: ``window`` of them,
``dilation`` apart.)

Patterns combine with ``|`` (union) and ``&`` (intersection), e.g.
``global_window(2, 64) & causal()`` is a causal Longformer pattern.

Block layouts are built from these rules in :mod:`attnjax.layout` (this module
only re-exports the layout names its API returns). The module is longer than
the project's ~600-line guideline because each pattern keeps its element rule,
candidate blocks and band / slot decompositions together in one class.

For example:

>>> import attnjax
>>> pattern = attnjax.patterns.sliding_window(256)
>>> pattern.mask(1024).shape                        # bool
(1, 1, 1024, 1024)
>>> pattern.block_mask(1024, block_size=128).shape  # numpy bool of kept blocks
(8, 8)
>>> layout = pattern.layout(1024, block_size=128)   # an attnjax.layout.BlockLayout
>>> layout.visits(3)              # (key_block, needs_mask) of query block 3
[(1, True), (2, False), (3, True)]

References:
  Child et al. 2019, "Generating Long Sequences with Sparse Transformers"
  (strided and fixed patterns), arXiv:1904.10509.
  Beltagy et al. 2020, "Longformer: The Long-Document Transformer"
  (global + sliding window), arXiv:2004.05150.
  Zaheer et al. 2020, "Big Bird: Transformers for Longer Sequences"
  (global + window + random blocks), arXiv:2007.14062.
  Xiao et al. 2024, "Efficient Streaming Language Models with Attention
  Sinks" (StreamingLLM: sink tokens + rolling window), arXiv:2309.17453.
  Beltagy et al. 2020 also define the dilated sliding window
  (:func:`.dilated_window`).
"""

from attnjax._src.patterns import (BandParts, BigBird, BlockLayout, Causal, DilatedWindow, Fixed,
                                   GlobalWindow, Pattern, PatternIntersection, PatternUnion,
                                   SinksWindow, SlidingWindow, SparsePlan, Strided, bigbird,
                                   causal, density, dilated_window, fixed, full_blocks,
                                   global_window, intersection, kept_blocks, sinks_window,
                                   sliding_window, strided, union)

__all__ = ["BandParts", "BigBird", "BlockLayout", "Causal", "DilatedWindow", "Fixed",
    "GlobalWindow", "Pattern", "PatternIntersection", "PatternUnion", "SinksWindow",
    "SlidingWindow", "SparsePlan", "Strided", "bigbird", "causal", "density", "dilated_window",
    "fixed", "full_blocks", "global_window", "intersection", "kept_blocks", "sinks_window",
    "sliding_window", "strided", "union"]
