"""A Pallas Mosaic GPU flash-attention kernel for Hopper: ``implementation="mosaic_gpu"``.

:func:`attention` is the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it in jax's Mosaic GPU interpreter on the CPU); :func:`compute` and
:func:`unsupported` are the engine the dense op runs (``run``, deprecated, is that engine on a
validated call). The forward kernel is
in ``attnjax.kernels.mosaic_gpu.kernel``, the dq and dk/dv kernels in
``attnjax.kernels.mosaic_gpu.backward``; block sizes, the shared-memory budget and the row
lowering of the normalisers' state in ``attnjax.kernels.mosaic_gpu.plan``.
"""

from attnjax._src.kernels.mosaic_gpu import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  MOSAIC_GPU_CALL_TARGET,
  SMEM_LIMIT_BYTES,
  BlockSizes,
  attention,
  block_sizes_for,
  compute,
  run,
  smem_bytes,
  unsupported,
)

__all__ = [
  "BLOCK_SIZE_TABLE",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
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
