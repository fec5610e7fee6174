"""Splash attention (jax's Pallas TPU kernel) as a dense engine: ``implementation="splash"``.

Softmax with causal / window / segment structure, softcap, sink logits (where
this jax's kernel takes them) and GQA, for ``T`` and ``S`` multiples of 128.
:func:`compute` is the kernel without its platform guard (a ``platform_dependent``
branch) and :func:`unsupported` what it cannot honour: the engine
:func:`attnjax.dot_product_attention` runs with ``implementation="splash"`` (``run``,
deprecated, is that engine on a validated call).
"""

from attnjax._src.kernels.splash import (
  BLOCKS,
  DTYPES,
  block_length,
  compute,
  make_mask,
  run,
  unsupported,
)

__all__ = ["BLOCKS", "DTYPES", "block_length", "compute", "make_mask", "run", "unsupported"]
