"""A Pallas GPU (Triton) flash-attention kernel for every normaliser:
``implementation="pallas_gpu"``.

Implementation behind the public module :mod:`attnjax.kernels.pallas_gpu`.
"""

from attnjax._src.kernels.pallas_gpu.kernel import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  ENGINE,
  TRITON_CALL_TARGET,
  BlockSizes,
  attention,
  block_sizes_for,
  compute,
  run,
  unsupported,
)

__all__ = [
  "BLOCK_SIZE_TABLE",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "ENGINE",
  "TRITON_CALL_TARGET",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "unsupported",
]
