"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser:
``implementation="pallas_tpu"``.

Implementation behind the public module :mod:`attnjax.kernels.pallas_tpu`.
"""

from attnjax._src.kernels.pallas_tpu.kernel import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  ENGINE,
  MOSAIC_CALL_TARGET,
  BlockSizes,
  attention,
  block_sizes_for,
  compute,
  generation,
  run,
  unsupported,
)

__all__ = [
  "BLOCK_SIZE_TABLE",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "ENGINE",
  "MOSAIC_CALL_TARGET",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "generation",
  "run",
  "unsupported",
]
