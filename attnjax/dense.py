"""Dense scaled dot-product attention with every normaliser, and its dispatch.

``dot_product_attention`` validates its arguments once, puts the static choices
in a :class:`~attnjax.options.DenseOptions`, and hands the arrays to one :class:`Engine` of
:data:`ENGINES` (with ``implementation=None``, one per platform from its list in
:data:`PREFERENCES`, chosen when the program is lowered). Every
engine takes the same canonical arguments, so the fast paths (block-wise,
platform kernels) plug in beside the readable ``reference`` below and are
tested against it.
"""

from attnjax._src.op import Engine
from attnjax._src.ops.dense.attention import (
  BLOCKWISE_MIN_LENGTH_CPU,
  DENSE_STATIC,
  ENGINES,
  FALLBACK,
  IMPLEMENTATIONS,
  JAX_NN_MASKED_LOGIT,
  OP,
  PREFERENCES,
  SIMILARITIES,
  dispatch_table,
  dot_product_attention,
  prepare,
  reference,
  select_implementation,
)

__all__ = [
  "BLOCKWISE_MIN_LENGTH_CPU",
  "DENSE_STATIC",
  "ENGINES",
  "FALLBACK",
  "IMPLEMENTATIONS",
  "JAX_NN_MASKED_LOGIT",
  "OP",
  "PREFERENCES",
  "SIMILARITIES",
  "Engine",
  "dispatch_table",
  "dot_product_attention",
  "prepare",
  "reference",
  "select_implementation",
]
