"""Block layouts: which (query block, key block) pairs a block-wise kernel computes.

Three concerns are kept apart, as splash attention separates mask rules, block
classification and kernel:

- **rules** say which (query, key) pairs may attend: :func:`attnjax.masks.structural_mask`
  (causal, window, segments) and the patterns of :mod:`attnjax.patterns`;
- **layouts** (this module) classify blocks under a rule: skipped, full
  (every pair allowed: no element mask) or partial (the rule is evaluated in
  the block). :class:`.BlockLayout` is the static result; :func:`.structural_layout`
  builds it for causal / window structure, :func:`.rule_layout` for any element
  rule (a pattern), and :func:`.segment_block_relations` classifies blocks at run
  time under segment ids (packed sequences);
- **kernels** (:mod:`attnjax.kernels.blockwise`, :mod:`attnjax.sparse`) import layouts
  and visit what they list. Nothing here imports a kernel or a pattern.
"""

from attnjax._src.layout import (FULL, MASKED, SKIP, BlockLayout, SparsePlan, classify_blocks,
                                 density, from_mask_mod, full_blocks, intersect, kept_blocks,
                                 key_block_candidates, mask_mod_block_table, rule_layout,
                                 segment_block_relations, structural_layout)

__all__ = ["FULL", "MASKED", "SKIP", "BlockLayout", "SparsePlan", "classify_blocks", "density",
    "from_mask_mod", "full_blocks", "intersect", "kept_blocks", "key_block_candidates",
    "mask_mod_block_table", "rule_layout", "segment_block_relations", "structural_layout"]
