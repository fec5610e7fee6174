"""Gated linear attention: a linear-attention state that decays, per head or per key channel.

:func:`attnjax.gated_linear_attention` carries per query head an ``[H, Hv]`` float32
state ``S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T`` and returns ``o_t = scale * S_t^T q_t``,
``g_t = log_decay_t <= 0``: one decay per head covers RetNet and Mamba-2 / SSD, one per
key channel GLA. Its engines ``recurrent`` (also ``"reference"``,
:data:`~attnjax.gated_linear.REFERENCE_ENGINE`), ``quadratic`` and ``chunked`` (default,
O(T) memory in training) are tested equal in value, final state and gradient, and only
ever exponentiate differences of cumulative log decays that are ``<= 0``.

Guide: :doc:`/guides/linear`, sections "Gated linear attention" and "Engines of the gated
and delta-rule families".
"""

from attnjax._src.ops.gated_linear.attention import (
  IMPLEMENTATIONS,
  REFERENCE_ENGINE,
  chunked,
  gated_linear_attention,
  quadratic,
  recurrent,
)
from attnjax._src.old_names import gated_linear as __getattr__  # noqa: F401 (PEP 562)

__all__ = [
  "IMPLEMENTATIONS",
  "REFERENCE_ENGINE",
  "chunked",
  "gated_linear_attention",
  "quadratic",
  "recurrent",
]
