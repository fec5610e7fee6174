"""The block-wise dense kernel (online normaliser over key blocks, skipped blocks, O(T) memory).

:func:`run` is the ``implementation="blockwise"`` engine of a validated dense call;
:func:`run_layout` the kernel over a given :class:`attnjax.layout.BlockLayout` (the sparse,
compressed and block-select families call it with their own layouts); :func:`attention`
the same engine called like :func:`attnjax.dot_product_attention`, with explicit block
sizes. The algorithm and its tiles: the kernels guide (docs/guides/kernels.md).
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
  run,
  run_layout,
  structural_mask_fn,
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
  "run",
  "run_layout",
  "structural_mask_fn",
  "unsupported",
]
