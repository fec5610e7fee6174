"""Pallas kernels of selected-block attention (NSA's selected branch): TPU and Hopper GPU.

:func:`pallas_tpu` and :func:`mosaic_gpu` take ``(q, k, v, block_idx, *, block_size, scale,
normalizer, interpret, return_lse)`` (plus ``order`` and ``rows`` to override the plan;
:func:`selected_attention` picks one by ``implementation``);
:func:`unsupported` and :func:`case_class` answer dispatch and the kernel-trust rule
(:data:`TRUST_NAMES`). Guide: docs/guides/kernels.md, section "Selected-block attention
kernels".
"""

from attnjax._src.kernels.selected.attention import (
  IMPLEMENTATIONS,
  TRUST_NAMES,
  case_class,
  mosaic_gpu,
  pallas_tpu,
  plan_call,
  selected_attention,
  unsupported,
)
from attnjax._src.kernels.selected.plan import ORDERS, QUERY_MAJOR_MIN_GROUP, loop_order

__all__ = [
  "IMPLEMENTATIONS",
  "ORDERS",
  "QUERY_MAJOR_MIN_GROUP",
  "TRUST_NAMES",
  "case_class",
  "loop_order",
  "mosaic_gpu",
  "pallas_tpu",
  "plan_call",
  "selected_attention",
  "unsupported",
]
