"""A Pallas Mosaic GPU flash-attention kernel for Hopper: ``implementation="mosaic_gpu"``.

:func:`attention` is the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it in jax's Mosaic GPU interpreter on the CPU); :func:`compute` and
:func:`unsupported` are the engine the dense op runs (``run``, deprecated, is that engine on a
validated call). The forward kernel, the dq and dk/dv kernels, and the block sizes,
shared-memory budget and row lowering of the normalisers' state are the files of
``attnjax/_src/kernels/mosaic_gpu/`` (``kernel.py``, ``backward.py``, ``plan.py``).
"""

from attnjax._src.kernels.mosaic_gpu.kernel import (
  BLOCK_SIZE_TABLE,
  BlockSizes,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  MOSAIC_GPU_CALL_TARGET,
  attention,
  block_sizes_for,
  compute,
  run,
  unsupported,
)
from attnjax._src.kernels.mosaic_gpu.plan import SMEM_LIMIT_BYTES, smem_bytes

__all__ = [
  "BLOCK_SIZE_TABLE",
  "BlockSizes",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "MOSAIC_GPU_CALL_TARGET",
  "SMEM_LIMIT_BYTES",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "smem_bytes",
  "unsupported",
]
