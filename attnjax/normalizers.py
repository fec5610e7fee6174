"""The normalisers: how a row of logits becomes attention weights, defined once each.

Each normaliser (``softmax``, ``softmax_one``, ``sigmoid``, ``softpick``, ``none``,
``relu``, ``clipped_softmax``) is one :class:`Normalizer` in :data:`REGISTRY`, written in pure ``jnp`` on
blocks: its materialised weights, its online accumulation over key tiles, the merge of
partial results, the backward rule per tile, statistics rows, and the capabilities
kernels and dispatch read instead of names. The same definition drives the dense
reference, the block-wise kernel, the sparse paths and the Pallas kernel bodies.
Masked keys get weight exactly 0; neither value nor gradient is NaN for finite logits.

Guide: :doc:`/guides/dense`, sections "Normalisers" and "How a normaliser is written".
"""

from attnjax._src.normalizers import (
  NORMALIZERS,
  PV,
  REGISTRY,
  SOFTPICK_EPS,
  SUMS_TO_ONE,
  TABLE,
  ClippedSoftmax,
  Elementwise,
  Identity,
  Normalizer,
  ReLU,
  Sigmoid,
  SoftmaxFamily,
  Softpick,
  first_logit,
  get,
  normalize,
  num_allowed,
)

__all__ = [
  "NORMALIZERS",
  "PV",
  "REGISTRY",
  "SOFTPICK_EPS",
  "SUMS_TO_ONE",
  "TABLE",
  "ClippedSoftmax",
  "Elementwise",
  "Identity",
  "Normalizer",
  "ReLU",
  "Sigmoid",
  "SoftmaxFamily",
  "Softpick",
  "first_logit",
  "get",
  "normalize",
  "num_allowed",
]
