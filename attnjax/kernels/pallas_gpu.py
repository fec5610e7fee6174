"""A Pallas GPU (Triton) flash-attention kernel for every normaliser: ``implementation="pallas_gpu"``.

:func:`attention` is the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it on any platform); :func:`compute` and :func:`unsupported` are the
engine the dense op runs (``run``, deprecated, is that engine on a validated call). The
forward kernel is in ``attnjax.kernels.pallas_gpu.kernel``, the backward kernels in
``attnjax.kernels.pallas_gpu.backward``, and the grid plan and tile helpers they share in
``attnjax.kernels.pallas_gpu.plan``.
"""

from attnjax._src.kernels.pallas_gpu import (
  BLOCK_SIZE_TABLE,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
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
  "TRITON_CALL_TARGET",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "unsupported",
]
