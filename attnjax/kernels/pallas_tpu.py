"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser: ``implementation="pallas_tpu"``.

:func:`attention` is the kernel called like :func:`attnjax.dot_product_attention`
(``interpret=True`` runs it on any platform); :func:`compute` and :func:`unsupported` are the
engine the dense op runs (``run``, deprecated, is that engine on a validated call). The
forward and count kernels, the backward kernels, and the plan, block tables and tile helpers
they share are the files of ``attnjax/_src/kernels/pallas_tpu/`` (``kernel.py``,
``backward.py``, ``plan.py``).
"""

from attnjax._src.kernels.pallas_tpu.kernel import (
  BLOCK_SIZE_TABLE,
  BlockSizes,
  DEFAULT_BLOCK_SIZES,
  DTYPES,
  MOSAIC_CALL_TARGET,
  attention,
  block_sizes_for,
  compute,
  run,
  unsupported,
)

__all__ = [
  "BLOCK_SIZE_TABLE",
  "BlockSizes",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "MOSAIC_CALL_TARGET",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "unsupported",
]
