"""Linear (kernel-feature) attention: ``exp(q.k)`` replaced by ``phi(q) . phi(k)``.

With a feature map ``phi`` (:mod:`attnjax.feature_maps`) causal attention is a
recurrence over the running sums ``S_i = sum_{j <= i} phi(k_j) v_j^T`` and
``z_i = sum_{j <= i} phi(k_j)`` (Katharopoulos et al. 2020).
:func:`.linear_attention` has the engines ``quadratic`` (also ``"reference"``,
:data:`~attnjax.linear.REFERENCE_ENGINE`), ``recurrent`` and ``chunked`` (default), tested
equal in value, final state and gradient, and ``normalize`` ``"denominator"``, ``"none"``
or ``"output_rms"``. It returns ``out``, or ``(out, state)`` with ``return_state=True``;
``return_stats=True`` wraps either as ``(result, stats)``.
Guide: :doc:`/guides/linear`, sections "Engines: one vocabulary for the three families"
and "Linear attention".
"""

from attnjax._src.ops.linear.attention import (
  DEFAULT_EPS,
  IMPLEMENTATIONS,
  REFERENCE_ENGINE,
  LinearState,
  NORMALIZE,
  chunked,
  linear_attention,
  linear_attention_weights,
  noncausal,
  quadratic,
  recurrent,
  zeros_state,
)
from attnjax._src.old_names import linear as __getattr__  # noqa: F401 (PEP 562)

__all__ = [
  "DEFAULT_EPS",
  "IMPLEMENTATIONS",
  "LinearState",
  "NORMALIZE",
  "REFERENCE_ENGINE",
  "chunked",
  "linear_attention",
  "linear_attention_weights",
  "noncausal",
  "quadratic",
  "recurrent",
  "zeros_state",
]
