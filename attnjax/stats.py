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

from attnjax._src.stats import (SINK_CURVE_EPS, AttentionEntropy, FirstTokenAttention, LayerMean,
                                LogitDrift, MassiveActivations, ProbeCapture, QKStatistics,
                                SinkGeometry, SinkRate, attention_entropy, attention_sparsity,
                                feature_map_attention_error, first_token_attention, flatten,
                                gate_mass, importance, kernel_approximation_error, kurtosis,
                                massive_activations, max_attention_logit, null_mass,
                                output_logit_drift, probe_statistics, qk_statistics, sink_geometry,
                                sink_rate, to_jsonable, value_state_drain)
from attnjax._src.stats import __getattr__ as __getattr__

__all__ = ["SINK_CURVE_EPS", "AttentionEntropy", "FirstTokenAttention", "LayerMean", "LogitDrift",
    "MassiveActivations", "ProbeCapture", "QKStatistics", "SinkGeometry", "SinkRate",
    "attention_entropy", "attention_sparsity", "feature_map_attention_error",
    "first_token_attention", "flatten", "gate_mass", "importance", "kernel_approximation_error",
    "kurtosis", "massive_activations", "max_attention_logit", "null_mass", "output_logit_drift",
    "probe_statistics", "qk_statistics", "sink_geometry", "sink_rate", "to_jsonable",
    "value_state_drain"]
