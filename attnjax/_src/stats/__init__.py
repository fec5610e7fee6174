"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Implementation behind the public module :mod:`attnjax.stats`.
"""

from __future__ import annotations

from attnjax._src.stats.activations import kurtosis, massive_activations, output_logit_drift
from attnjax._src.stats.capture import SINK_CURVE_EPS, ProbeCapture, probe_statistics
from attnjax._src.stats.geometry import qk_statistics, sink_geometry, value_state_drain
from attnjax._src.stats.jsonable import flatten, to_jsonable
from attnjax._src.stats.outliers import (
  OutlierStats,
  fake_quantize,
  masked_lm_loss,
  outlier_statistics,
  quantization_step,
)
from attnjax._src.stats.approximation import feature_map_attention_error, kernel_approximation_error
from attnjax._src.stats.results import (
  AttentionEntropy,
  FirstTokenAttention,
  LayerMean,
  LogitDrift,
  MassiveActivations,
  QKStatistics,
  SinkGeometry,
  SinkRate,
)
from attnjax._src.stats.sinks import (
  attention_entropy,
  attention_sparsity,
  first_token_attention,
  gate_mass,
  importance,
  max_attention_logit,
  null_mass,
  sink_rate,
  token_mass,
)

# Names that moved out of the functions layer (they run a model or read a
# training run); reading them here says where they went.
_MOVED = {
  "probe": "attnjax.nn.layer_stats",
  "capture_from_model": "attnjax.nn.layer_stats(model, tokens, view='capture')",
  "lr_sensitivity": "attnjax.train.metrics.lr_sensitivity",
  "max_stable_lr": "attnjax.train.metrics.max_stable_lr",
  "spike_score": "attnjax.train.metrics.spike_score",
  "is_diverged": "attnjax.train.metrics.is_diverged",
}


def __getattr__(name: str):
  if name in _MOVED:
    raise AttributeError(
      f"attnjax.stats.{name} moved to {_MOVED[name]} (attnjax.stats is the functions layer "
      f"and imports neither flax nor attnjax.nn / attnjax.train)"
    )
  raise AttributeError(f"module 'attnjax.stats' has no attribute {name!r}")


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
