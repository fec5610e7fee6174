"""The normalisers: how a row of logits becomes attention weights, defined once each.

Each built-in normaliser (``softmax``, ``softmax_one``, ``sigmoid``, ``softpick``, ``none``,
``relu``, ``clipped_softmax``) is one :class:`Normalizer` in :data:`REGISTRY`, written in pure
``jnp`` on blocks: materialised weights, online accumulation over key tiles, merge, backward
rule, statistics, and the capabilities kernels read instead of names. A normaliser of your own
is one class, :func:`register`-ed and then used by name everywhere: a :class:`WeightsOnly`
(its weights given a few row quantities, with learned :class:`Param`-s) or the full online
interface. Claims that send a call to a softmax-only kernel are never inherited (:data:`CLAIMS`).

Guide: :doc:`/guides/dense`, sections "Normalisers" and "Writing a normaliser".
"""

from attnjax._src.normalizers import (
  CLAIMS,
  NORMALIZERS,
  PLATFORM_KERNELS,
  PV,
  REGISTRY,
  ROW_QUANTITIES,
  SOFTPICK_EPS,
  SUMS_TO_ONE,
  TABLE,
  ClippedSoftmax,
  Elementwise,
  Identity,
  Normalizer,
  Param,
  ReLU,
  Sigmoid,
  SoftmaxFamily,
  Softpick,
  WeightsOnly,
  first_logit,
  get,
  names,
  normalize,
  num_allowed,
  register,
  registered,
  unregister,
)

__all__ = [
  "CLAIMS",
  "NORMALIZERS",
  "PLATFORM_KERNELS",
  "PV",
  "REGISTRY",
  "ROW_QUANTITIES",
  "SOFTPICK_EPS",
  "SUMS_TO_ONE",
  "TABLE",
  "ClippedSoftmax",
  "Elementwise",
  "Identity",
  "Normalizer",
  "Param",
  "ReLU",
  "Sigmoid",
  "SoftmaxFamily",
  "Softpick",
  "WeightsOnly",
  "first_logit",
  "get",
  "names",
  "normalize",
  "num_allowed",
  "register",
  "registered",
  "unregister",
]
