"""Linear (kernel-feature) attention: ``exp(q.k)`` replaced by ``phi(q) . phi(k)``.

With a feature map ``phi`` (:mod:`attnjax.feature_maps`) causal attention is a
recurrence over the running sums ``S_i = sum_{j <= i} phi(k_j) v_j^T`` and
``z_i = sum_{j <= i} phi(k_j)`` (Katharopoulos et al. 2020).
:func:`.linear_attention` has the engines ``quadratic`` (= ``"reference"``,
:data:`~attnjax.linear.REFERENCE_ENGINE`), ``recurrent`` and ``chunked`` (default), tested
equal in value, final state and gradient, and ``normalize`` ``"denominator"``, ``"none"``
or ``"output_rms"``. It returns ``out``, or ``(out, state)`` with ``return_state=True``;
``return_stats=True`` wraps either as ``(result, stats)``.
Guide: :doc:`/guides/linear`, sections "Engines: one vocabulary for the three families"
and "Linear attention".
"""

from attnjax._src.ops.linear.attention import IMPLEMENTATIONS
from attnjax._src.ops.linear.attention import (
  DEFAULT_EPS,
  LINEAR_STATIC,
  NORMALIZE,
  OP,
  REFERENCE_ENGINE,
  REFERENCE_FORM,
  LinearState,
  chunked,
  finish,
  linear_attention,
  linear_attention_weights,
  noncausal,
  parallel,
  quadratic,
  recurrent,
  zeros_state,
)

__all__ = [
  "DEFAULT_EPS",
  "IMPLEMENTATIONS",
  "LINEAR_STATIC",
  "NORMALIZE",
  "OP",
  "REFERENCE_ENGINE",
  "REFERENCE_FORM",
  "LinearState",
  "chunked",
  "finish",
  "linear_attention",
  "linear_attention_weights",
  "noncausal",
  "parallel",
  "quadratic",
  "recurrent",
  "zeros_state",
]
