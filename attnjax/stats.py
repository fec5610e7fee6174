"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Every attention- and model-level metric of the experiments, each docstring naming its
source and stating its definition, on arrays from anywhere or on the
:class:`~attnjax.AttentionStats` attention calls return: sinks and entropy
(``attnjax.stats.sinks``), q/k geometry, activations, kernel approximation, the
:class:`ProbeCapture` of a forward pass, and the JSON rule (:func:`to_jsonable`). This is
the functions layer: it imports neither flax nor ``attnjax.nn`` / ``attnjax.train``.
Per-layer statistics of a model: ``attnjax.nn.layer_stats``.

Guide: :doc:`/guides/diagnostics`, sections "Layouts" and "Indexing".
"""

from attnjax._src.stats import (
  SINK_CURVE_EPS,
  AttentionEntropy,
  FirstTokenAttention,
  LayerMean,
  OutlierStats,
  LogitDrift,
  MassiveActivations,
  ProbeCapture,
  QKStatistics,
  SinkGeometry,
  SinkRate,
  attention_entropy,
  attention_sparsity,
  fake_quantize,
  feature_map_attention_error,
  first_token_attention,
  flatten,
  gate_mass,
  importance,
  kernel_approximation_error,
  kurtosis,
  masked_lm_loss,
  massive_activations,
  max_attention_logit,
  null_mass,
  outlier_statistics,
  output_logit_drift,
  probe_statistics,
  qk_statistics,
  quantization_step,
  sink_geometry,
  sink_rate,
  to_jsonable,
  token_mass,
  value_state_drain,
)
from attnjax._src.stats import __getattr__ as __getattr__

__all__ = [
  "SINK_CURVE_EPS",
  "AttentionEntropy",
  "FirstTokenAttention",
  "LayerMean",
  "LogitDrift",
  "MassiveActivations",
  "ProbeCapture",
  "QKStatistics",
  "SinkGeometry",
  "SinkRate",
  "attention_entropy",
  "attention_sparsity",
  "feature_map_attention_error",
  "first_token_attention",
  "flatten",
  "gate_mass",
  "importance",
  "kernel_approximation_error",
  "kurtosis",
  "massive_activations",
  "max_attention_logit",
  "null_mass",
  "output_logit_drift",
  "probe_statistics",
  "qk_statistics",
  "sink_geometry",
  "sink_rate",
  "to_jsonable",
  "value_state_drain",
  "OutlierStats",
  "fake_quantize",
  "masked_lm_loss",
  "outlier_statistics",
  "quantization_step",
  "token_mass",
]
