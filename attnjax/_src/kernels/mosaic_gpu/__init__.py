"""A Pallas Mosaic GPU flash-attention kernel for Hopper: ``implementation="mosaic_gpu"``.

Implementation behind the public module :mod:`attnjax.kernels.mosaic_gpu`.
"""

from attnjax._src.kernels.mosaic_gpu.kernel import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  ENGINE,
  MOSAIC_GPU_CALL_TARGET,
  BlockSizes,
  attention,
  block_sizes_for,
  compute,
  run,
  unsupported,
)
from attnjax._src.kernels.mosaic_gpu.plan import SMEM_LIMIT_BYTES, smem_bytes

__all__ = [
  "BLOCK_SIZE_TABLE",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "ENGINE",
  "MOSAIC_GPU_CALL_TARGET",
  "SMEM_LIMIT_BYTES",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "smem_bytes",
  "unsupported",
]
