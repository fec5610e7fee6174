"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Every attention- and model-level metric of the experiments (docs/guides/diagnostics.md)
lives in this package, each docstring naming its source and stating the definition it
computes. The functions work on arrays a researcher brings from anywhere and
on the :class:`~attnjax.AttentionStats` that attention calls return. This is
the functions layer: it imports neither flax nor ``attnjax.nn`` /
``attnjax.train``.

Modules (every public name is re-exported here, so ``attnjax.stats.sink_rate``
etc. work as before):

- ``attnjax.stats.sinks``: ``importance``, ``sink_rate``,
  ``first_token_attention``, ``attention_entropy``, ``max_attention_logit``,
  ``null_mass``, ``gate_mass``, ``attention_sparsity``;
- ``attnjax.stats.geometry``: ``qk_statistics``, ``sink_geometry``,
  ``value_state_drain``;
- ``attnjax.stats.activations``: ``massive_activations``, ``kurtosis``,
  ``output_logit_drift``;
- ``attnjax.stats.approximation``: ``kernel_approximation_error``,
  ``feature_map_attention_error``;
- ``attnjax.stats.capture``: ``ProbeCapture``, what one forward pass exposes,
  and the pure computation of every statistic from it (``probe_statistics``
  is a deprecated alias of ``attnjax.nn.layer_stats(capture)``);
- ``attnjax.stats.results``: the result NamedTuples;
- ``attnjax.stats.jsonable``: ``flatten`` and ``to_jsonable``, the one
  JSON sanitiser (NaN and Inf become null).

Elsewhere: statistics per layer of a model, the one entry point, are
``attnjax.nn.layer_stats`` (an ``attnjax.nn.TransformerLM`` and tokens, or a
filled ``ProbeCapture``);
run-level metrics over a training run or a sweep (``lr_sensitivity``,
``max_stable_lr``, ``spike_score``, ``is_diverged``) are in
``attnjax.train.metrics``.

Layout conventions (letters as in docs/guides/dense.md; ``L`` = layers):

- attention weights or logits ``[L, B, N, T, S]``, or ``[B, N, T, S]`` for one
  layer, or a list of per-layer ``[B, N, T, S]`` arrays;
- ``AttentionStats`` with ``[B, N]`` fields (one layer), ``[L, B, N]`` fields
  (stacked layers) or a list with one per layer;
- queries ``[L, B, T, N, H]``, keys and values ``[L, B, S, K, H]`` (or without
  ``L`` for one layer); hidden states ``[L, B, T, D]`` (or ``[B, T, D]``).

Per-layer results always carry a leading ``L`` axis (``L = 1`` for one layer),
so a probe's output has the same keys for every model. The functions are
``jax.jit``-wrapped with their static choices keyword-only.

Indexing: arrays are 0-indexed. The papers index tokens from 1: the paper's
"first token" / key ``k = 1`` is array index ``0``, and the paper's queries
``i >= 2`` are array rows ``1 .. T-1``. Arguments named after a paper's
symbol (``k`` of ``Sink_k^eps``) use the paper's 1-indexing and say so.
"""

from __future__ import annotations

from attnjax.stats.activations import kurtosis, massive_activations, output_logit_drift
from attnjax.stats.capture import ProbeCapture, probe_statistics
from attnjax.stats.geometry import qk_statistics, sink_geometry, value_state_drain
from attnjax.stats.jsonable import flatten, to_jsonable
from attnjax.stats.approximation import feature_map_attention_error, kernel_approximation_error
from attnjax.stats.results import (AttentionEntropy, FirstTokenAttention, LayerMean, LogitDrift,
                                   MassiveActivations, QKStatistics, SinkGeometry, SinkRate)
from attnjax.stats.sinks import (attention_entropy, attention_sparsity, first_token_attention,
                                 gate_mass, importance, max_attention_logit, null_mass, sink_rate)

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
        f"and imports neither flax nor attnjax.nn / attnjax.train)")
  raise AttributeError(f"module 'attnjax.stats' has no attribute {name!r}")


__all__ = [
    "AttentionEntropy", "FirstTokenAttention", "LayerMean", "LogitDrift", "MassiveActivations",
    "ProbeCapture", "QKStatistics", "SinkGeometry", "SinkRate", "attention_entropy",
    "attention_sparsity", "feature_map_attention_error", "first_token_attention", "flatten",
    "gate_mass", "importance", "kernel_approximation_error", "kurtosis", "massive_activations",
    "max_attention_logit", "null_mass", "output_logit_drift", "probe_statistics", "qk_statistics",
    "sink_geometry", "sink_rate", "to_jsonable", "value_state_drain",
]
