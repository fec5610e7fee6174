"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser: ``implementation="pallas_tpu"``.

:func:`attention` is the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it on any platform); :func:`compute` and :func:`unsupported` are the
engine the dense op runs (``run``, deprecated, is that engine on a validated call). The
forward and count kernels are in ``attnjax.kernels.pallas_tpu.kernel``, the backward kernels
in ``attnjax.kernels.pallas_tpu.backward``, and the plan, block tables and tile helpers they
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
