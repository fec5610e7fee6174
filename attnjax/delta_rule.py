"""Delta-rule linear attention: the update of DeltaNet and Gated DeltaNet.

:func:`attnjax.delta_rule_attention` carries per query head an ``[H, Hv]`` state
``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T`` and returns
``o_t = scale * S_t^T q_t`` (Schlag et al. 2021; the gated delta rule of Yang et al.
2025 with ``g_t <= 0``). Its engines ``recurrent`` (= ``"reference"``,
:data:`~attnjax.delta_rule.REFERENCE_ENGINE`), ``quadratic`` and ``chunked`` (default,
the WY / UT-transform chunk computation of Yang et al. 2024) are tested equal in value, final
state and gradient. The layers ``deltanet`` / ``gated_deltanet`` live in :mod:`attnjax.nn`.

Guide: :doc:`/guides/linear`, sections "Delta rule" and "The delta rule's chunk computation".
"""

from attnjax._src.ops.delta_rule.attention import IMPLEMENTATIONS
from attnjax._src.ops.delta_rule.attention import (
  DELTA_STATIC,
  OP,
  REFERENCE_ENGINE,
  REFERENCE_FORM,
  chunked,
  delta_rule_attention,
  parallel,
  quadratic,
  recurrent,
  unit_lower_inverse,
  unit_lower_solve,
)

__all__ = [
  "DELTA_STATIC",
  "IMPLEMENTATIONS",
  "OP",
  "REFERENCE_ENGINE",
  "REFERENCE_FORM",
  "chunked",
  "delta_rule_attention",
  "parallel",
  "quadratic",
  "recurrent",
  "unit_lower_inverse",
  "unit_lower_solve",
]
