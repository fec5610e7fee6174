"""Gated linear attention: a linear-attention state that decays, per head or per key channel.

:func:`attnjax.gated_linear_attention` carries per query head an ``[H, Hv]`` float32
state ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T`` and returns ``o_t = scale * S_t^T q_t``,
``g_t = log_decay_t <= 0``: one decay per head covers RetNet and Mamba-2 / SSD, one per
key channel GLA. Its engines ``recurrent`` (= ``"reference"``,
:data:`~attnjax.gated_linear.REFERENCE_ENGINE`), ``quadratic`` and ``chunked`` (default,
O(T) memory in training) are tested equal in value, final state and gradient, and only
ever exponentiate differences of cumulative log decays that are ``<= 0``.

Guide: :doc:`/guides/linear`, sections "Gated linear attention" and "Engines of the gated
and delta-rule families".
"""

from attnjax._src.ops.gated_linear.attention import IMPLEMENTATIONS
from attnjax._src.ops.gated_linear.attention import (
  GATED_LINEAR_STATIC,
  OP,
  REFERENCE_ENGINE,
  REFERENCE_FORM,
  SUB_BLOCK,
  chunked,
  gated_linear_attention,
  parallel,
  quadratic,
  recurrent,
)

__all__ = [
  "GATED_LINEAR_STATIC",
  "IMPLEMENTATIONS",
  "OP",
  "REFERENCE_ENGINE",
  "REFERENCE_FORM",
  "SUB_BLOCK",
  "chunked",
  "gated_linear_attention",
  "parallel",
  "quadratic",
  "recurrent",
]
