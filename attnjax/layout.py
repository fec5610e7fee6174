"""Block layouts: which (query block, key block) pairs a block-wise kernel computes.

Rules (:func:`attnjax.masks.structural_mask`, the patterns of :mod:`attnjax.patterns`)
say which pairs may attend; layouts (this module) classify blocks under a rule as
skipped, full or partial (:class:`.BlockLayout`; :func:`.structural_layout`,
:func:`.rule_layout`, and :func:`.segment_block_relations` at run time under segment
ids); kernels import layouts and visit what they list. Nothing here imports a kernel or
a pattern.

Guide: :doc:`/guides/sparse`, section "Positions, windows and layouts".
"""

from attnjax._src.layout import (
  BlockLayout,
  FULL,
  MASKED,
  SKIP,
  SparsePlan,
  classify_blocks,
  density,
  from_mask_mod,
  full_blocks,
  intersect,
  kept_blocks,
  rule_layout,
  segment_block_relations,
  structural_layout,
)

__all__ = [
  "BlockLayout",
  "FULL",
  "MASKED",
  "SKIP",
  "SparsePlan",
  "classify_blocks",
  "density",
  "from_mask_mod",
  "full_blocks",
  "intersect",
  "kept_blocks",
  "rule_layout",
  "segment_block_relations",
  "structural_layout",
]
