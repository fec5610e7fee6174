"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser: ``implementation="pallas_tpu"``.

:func:`run` is the engine of a validated dense call, :func:`compute` the kernel without its
platform guard, :func:`attention` the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it on any backend). The forward and count kernels are in
``attnjax.kernels.pallas_tpu.kernel``, the backward kernels in
``attnjax.kernels.pallas_tpu.backward``, and the plan, block tables and tile helpers they
share in ``attnjax.kernels.pallas_tpu.plan``.
"""

from attnjax._src.kernels.pallas_tpu import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
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
  "MOSAIC_CALL_TARGET",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "generation",
  "run",
  "unsupported",
]
