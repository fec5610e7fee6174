"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Every attention- and model-level metric of the experiments, each docstring naming its
source and stating its definition, on arrays from anywhere or on the
:class:`~attnjax.AttentionStats` attention calls return: sinks and entropy
(:func:`sink_rate`, :func:`attention_entropy`, ...), q/k geometry, activations, kernel
approximation, the :class:`LayerCapture` of a forward pass, and the JSON rule
(:func:`to_jsonable`). This is the functions layer: it imports neither flax nor
``attnjax.nn`` / ``attnjax.train``. Per-layer statistics of a model: ``attnjax.nn.layer_stats``.

Guide: :doc:`/guides/diagnostics`, sections "Layouts" and "Indexing".
"""

from attnjax._src.stats.activations import kurtosis, massive_activations, output_logit_drift
from attnjax._src.stats.approximation import feature_map_attention_error, kernel_approximation_error
from attnjax._src.stats.capture import LayerCapture, SINK_CURVE_EPS
from attnjax._src.stats.geometry import qk_statistics, sink_geometry, value_state_drain
from attnjax._src.stats.jsonable import flatten, to_jsonable
from attnjax._src.stats.outliers import (
  OutlierStats,
  fake_quantize,
  masked_lm_loss,
  outlier_statistics,
  quantization_step,
)
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
from attnjax._src.old_names import stats as __getattr__  # noqa: F401 (PEP 562)

__all__ = [
  "AttentionEntropy",
  "FirstTokenAttention",
  "LayerCapture",
  "LayerMean",
  "LogitDrift",
  "MassiveActivations",
  "OutlierStats",
  "QKStatistics",
  "SINK_CURVE_EPS",
  "SinkGeometry",
  "SinkRate",
  "attention_entropy",
  "attention_sparsity",
  "fake_quantize",
  "feature_map_attention_error",
  "first_token_attention",
  "flatten",
  "gate_mass",
  "importance",
  "kernel_approximation_error",
  "kurtosis",
  "masked_lm_loss",
  "massive_activations",
  "max_attention_logit",
  "null_mass",
  "outlier_statistics",
  "output_logit_drift",
  "qk_statistics",
  "quantization_step",
  "sink_geometry",
  "sink_rate",
  "to_jsonable",
  "token_mass",
  "value_state_drain",
]
