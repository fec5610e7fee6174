"""Sparse attention patterns: which keys each query may see, element by element and block by block.

A frozen, hashable pattern's one element rule (:meth:`.Pattern.allowed`) gives both:

>>> import attnjax
>>> pattern = attnjax.patterns.sliding_window(256)
>>> pattern.mask(1024).shape, pattern.block_mask(1024, block_size=128).shape
((1, 1, 1024, 1024), (8, 8))
>>> pattern.layout(1024, block_size=128).visits(3)   # (key_block, needs_mask)
[(1, True), (2, False), (3, True)]

Guide: :doc:`/guides/sparse`, sections "Patterns" and "Positions, windows and layouts".
"""

# Layout helpers, for callers of the pattern API (notebooks draw kept / full blocks).
from attnjax._src.layout import BlockLayout, SparsePlan, density, full_blocks, kept_blocks
from attnjax._src.patterns import (
  BandParts,
  BigBird,
  Causal,
  DilatedWindow,
  Fixed,
  GlobalWindow,
  Pattern,
  PatternIntersection,
  PatternUnion,
  SinksWindow,
  SlidingWindow,
  Strided,
  bigbird,
  causal,
  dilated_window,
  fixed,
  global_window,
  intersection,
  sinks_window,
  sliding_window,
  strided,
  union,
)

__all__ = [
  "BandParts",
  "BigBird",
  "BlockLayout",
  "Causal",
  "DilatedWindow",
  "Fixed",
  "GlobalWindow",
  "Pattern",
  "PatternIntersection",
  "PatternUnion",
  "SinksWindow",
  "SlidingWindow",
  "SparsePlan",
  "Strided",
  "bigbird",
  "causal",
  "density",
  "dilated_window",
  "fixed",
  "full_blocks",
  "global_window",
  "intersection",
  "kept_blocks",
  "sinks_window",
  "sliding_window",
  "strided",
  "union",
]
