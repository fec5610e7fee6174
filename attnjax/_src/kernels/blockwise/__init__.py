"""The block-wise dense kernel (online normaliser over key blocks, skipped blocks, O(T) memory).

Implementation behind the public module :mod:`attnjax.kernels.blockwise`.
"""

from attnjax._src.kernels.blockwise.kernel import (
  CPU_BLOCK_K,
  CPU_BLOCK_Q,
  GPU_BLOCK_K,
  GPU_BLOCK_Q,
  MAX_UNROLLED_FULL_VISITS,
  MAX_UNROLLED_Q_BLOCKS,
  attention,
  default_block_sizes,
  index_use,
  join_inputs,
  layout_for,
  run,
  run_layout,
  run_shard,
  split_inputs,
  structural_mask_fn,
  twin,
  unsupported,
)

__all__ = [
  "CPU_BLOCK_K",
  "CPU_BLOCK_Q",
  "GPU_BLOCK_K",
  "GPU_BLOCK_Q",
  "MAX_UNROLLED_FULL_VISITS",
  "MAX_UNROLLED_Q_BLOCKS",
  "attention",
  "default_block_sizes",
  "index_use",
  "join_inputs",
  "layout_for",
  "run",
  "run_layout",
  "run_shard",
  "split_inputs",
  "structural_mask_fn",
  "twin",
  "unsupported",
]
