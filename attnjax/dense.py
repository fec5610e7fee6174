"""Dense scaled dot-product attention with every normaliser, and its dispatch.

:func:`attnjax.dot_product_attention` validates its arguments once (the
:class:`~attnjax.options.DenseInputs` arrays and :class:`~attnjax.options.DenseOptions`
static choices), then runs the engine ``implementation=`` names (:data:`IMPLEMENTATIONS`)
or, with ``implementation=None``, each platform's first engine that honours the call,
chosen when the program is lowered (:func:`dispatch_table`, :func:`select_implementation`).
Every engine is tested equal to the readable :func:`reference`.

Guide: :doc:`/guides/dense`; engines and dispatch: :doc:`/guides/kernels`.
"""

from attnjax._src.ops.dense.attention import (
  BLOCKWISE_MIN_LENGTH_CPU,
  IMPLEMENTATIONS,
  SIMILARITIES,
  dispatch_table,
  dot_product_attention,
  reference,
  select_implementation,
)

__all__ = [
  "BLOCKWISE_MIN_LENGTH_CPU",
  "IMPLEMENTATIONS",
  "SIMILARITIES",
  "dispatch_table",
  "dot_product_attention",
  "reference",
  "select_implementation",
]
