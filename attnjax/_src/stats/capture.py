"""Every statistic of one forward pass from a :class:`.ProbeCapture` (pure; no model code).

Any model fills a :class:`.ProbeCapture` from its forward pass and calls
``attnjax.nn.layer_stats(capture)``; for an ``attnjax.nn.TransformerLM``,
``attnjax.nn.layer_stats(model, tokens)`` fills it, asking each layer for its
mask and for the q/k its attention function compares. ``capture_statistics``
is the pure computation both run (it imports no flax).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from attnjax._src.deprecation import warn_once
from attnjax._src.attention_stats import AttentionStats
from attnjax._src.stats.inputs import stats_layers
from attnjax._src.stats.activations import _kurtosis, _massive_activations, _output_logit_drift
from attnjax._src.stats.geometry import _qk_statistics, _sink_geometry, _value_state_drain
from attnjax._src.stats.jsonable import flatten
from attnjax._src.stats.results import LayerMean
from attnjax._src.stats.sinks import (
  _attention_entropy,
  _attention_sparsity,
  _first_token_attention,
  _max_attention_logit,
  _null_mass,
  _sink_rate,
)

Array = jnp.ndarray

# Thresholds of the ``sink_curve/*`` probe keys: Sink_1^eps against eps (Gu et al. 2024, fig. 3).
SINK_CURVE_EPS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class ProbeCapture(NamedTuple):
  """What one forward pass exposes, stacked over ``L`` layers; None where not available.

  Any model can be probed by filling this in and calling
  ``attnjax.nn.layer_stats(capture)``; ``attnjax.nn.layer_stats(model, tokens,
  view="capture")`` fills it from an ``attnjax.nn.TransformerLM``.

  Attributes:
    logits: ``[B, T, V]`` output logits.
    attention_stats: ``AttentionStats`` with ``[L, B, N]`` fields (``logsumexp``
      ``[L, B, N, T]``).
    weights: ``[L, B, N, T, S]`` attention weights, ``S >= T`` (appended k/v
      bias slots last; zero columns pad layers with fewer keys).
    allowed: ``[L, 1, 1, T, S]`` bool, the pairs each layer may attend to;
      None means causal.
    q: ``[L, B, T, N, H]`` queries as the attention function compares them
      (after any QK norm and RoPE); where layers differ in their head layout (an MLA
      layer beside GQA ones), a tuple of ``L`` arrays ``[B, T, N, H]``, as k and v.
    k: ``[L, B, T, K, H]`` keys (sequence keys only), likewise.
    v: ``[L, B, T, K, Hv]`` values.
    hidden: ``[L, B, T, D]`` each block's output hidden state.
    gate_mean: ``[L, B, N]`` mean output-gate value; NaN for ungated layers.
    null_column: ``[L]`` bool, True where the normaliser has a null column
      (softmax_one or sink logits), so ``1 - row_sum`` is its null mass.
  """

  logits: Optional[Array] = None
  attention_stats: Optional[AttentionStats] = None
  weights: Optional[Array] = None
  allowed: Optional[Array] = None
  q: Optional[Array] = None
  k: Optional[Array] = None
  v: Optional[Array] = None
  hidden: Optional[Array] = None
  gate_mean: Optional[Array] = None
  null_column: Optional[Array] = None


def _per_layer(fn, L: int, allowed: Optional[Array], *arrays):
  """Runs a per-layer metric layer by layer (each with its own mask) and stacks the results."""
  results = []
  for l in range(L):
    mask = None if allowed is None else allowed[l]
    results.append(fn(*(a[l] for a in arrays), mask=mask))
  # Each result is per layer with L = 1 ([1, ...] arrays); scalars (means over
  # the one layer) stack to [L] and are recomputed by the caller.
  return jax.tree.map(
    lambda *xs: jnp.stack(xs) if xs[0].ndim == 0 else jnp.concatenate(xs), *results
  )


def _value_drain_of_layers(v) -> LayerMean:
  """:func:`.value_state_drain` of stacked values, or of a tuple of per-layer values whose
  KV heads differ: ``per_head`` ``[L, max K]``, NaN (not defined) past a layer's heads."""
  if not isinstance(v, (tuple, list)):
    return _value_state_drain(v)
  drains = [_value_state_drain(x) for x in v]
  width = max(d.per_head.shape[1] for d in drains)
  per_head = jnp.concatenate(
    [
      jnp.pad(d.per_head, ((0, 0), (0, width - d.per_head.shape[1])), constant_values=jnp.nan)
      for d in drains
    ]
  )
  per_layer = jnp.concatenate([d.per_layer for d in drains])
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


def capture_statistics(
  capture: ProbeCapture,
  *,
  eps: float = 0.3,
  sparsity_threshold: float = 0.01,
  z_loss_coef: float = 1e-4,
  massive_abs: float = 100.0,
  massive_ratio: float = 1000.0,
) -> dict:
  """All statistics of one forward pass as a flat dict of named arrays and scalars.

  The pure computation of ``attnjax.nn.layer_stats``'s ``"summary"`` view (call
  that: ``layer_stats(capture)`` for a filled capture).

  Keys are ``"<metric>/<field>"`` from the ``attnjax.stats`` functions (per-layer
  arrays ``[L]``, per-head ``[L, N]``, scalars over the model), computed from
  whatever ``capture`` holds:

  - ``output/*``: :func:`.output_logit_drift` (logits);
  - ``sink_rate/*``: :func:`.sink_rate` (weights if present, else stats), with
    ``sink_rate/importance`` averaged over the batch to ``[L, N]``;
    ``sink_curve/rate`` ``[E]`` and ``sink_curve/per_layer`` ``[E, L]``:
    ``Sink_1^eps`` (percent) at each ``eps`` of ``SINK_CURVE_EPS``;
  - ``f_attn/*``, ``entropy/*``: :func:`.first_token_attention`,
    :func:`.attention_entropy` (stats if present, else weights); ``f_attn/raw`` and
    ``f_attn/raw_per_layer`` ``[L]``: the same mean first-token weight over queries
    ``i >= 1`` (0-based) without row normalisation (weights), which for softmax_one and sink
    logits leaves out the mass sent to the null column;
  - ``max_logit``: :func:`.max_attention_logit` ``[L]`` (stats);
  - ``null_mass/*``: ``1 - row_sum`` where ``null_column``, else 0 (stats);
  - ``sparsity/*``: :func:`.attention_sparsity` (weights);
  - ``qk/*``: :func:`.qk_statistics` without its max logit (q, k), and
    ``sink_geometry/*``: :func:`.sink_geometry` (q, k, v), over each layer's
    allowed pairs. q and k are those the attention compares, so after a QK
    norm their RMS is that of the norm's output (the pre-norm projection RMS
    is in the ``"sown"`` view of ``attnjax.nn.layer_stats``); ``value_drain/*``:
    :func:`.value_state_drain` (v), ``per_head`` ``[L, K]``;
  - ``massive/*``, ``kurtosis/*``: :func:`.massive_activations`,
    :func:`.kurtosis` (hidden);
  - ``gate/*``: mean gate per head, layer and overall (gate_mean).

  Args:
    capture: a :class:`.ProbeCapture`.
    eps: ``Sink_1^eps`` threshold.
    sparsity_threshold: H2O threshold (fraction of the row maximum).
    z_loss_coef: z-loss coefficient for ``output/z_loss``.
    massive_abs, massive_ratio: massive-activation thresholds.

  Returns:
    ``dict[str, Array]``; :func:`.to_jsonable` makes it JSON-ready.
  """
  out: dict[str, Any] = {}
  st = None if capture.attention_stats is None else stats_layers(capture.attention_stats)
  w = capture.weights
  if capture.logits is not None:
    out.update(flatten(_output_logit_drift(capture.logits, z_loss_coef=z_loss_coef), "output"))
  if w is not None or st is not None:
    sink = _sink_rate(w if w is not None else st, eps=eps)
    out.update(flatten(sink._replace(importance=jnp.mean(sink.importance, axis=1)), "sink_rate"))
    above = sink.importance[None] > jnp.asarray(SINK_CURVE_EPS)[:, None, None, None]
    out["sink_curve/rate"] = 100.0 * jnp.mean(above, axis=(1, 2, 3))
    out["sink_curve/per_layer"] = 100.0 * jnp.mean(above, axis=(2, 3))
  for key, field, metric in (
    ("f_attn", "sink_mass", _first_token_attention),
    ("entropy", "entropy", _attention_entropy),
  ):
    source = st if st is not None and getattr(st, field) is not None else w
    if source is not None:
      out.update(flatten(metric(source), key))
  if w is not None and w.shape[-2] >= 2:
    # The first-token weight as the normaliser gives it (no row normalisation): F-Attn's
    # average without renormalising rows, so a null column's mass counts as not on BOS.
    raw = jnp.mean(jnp.asarray(w[..., 1 : w.shape[-2], 0], jnp.float32), axis=(1, 2, 3))
    out["f_attn/raw"] = jnp.mean(raw)
    out["f_attn/raw_per_layer"] = raw
  if st is not None and st.max_logit is not None:
    out["max_logit"] = _max_attention_logit(st)
  if st is not None and st.row_sum is not None and capture.null_column is not None:
    nm = _null_mass(st)
    has = jnp.reshape(jnp.asarray(capture.null_column, bool), (-1, 1))
    per_head = jnp.where(has, nm.per_head, 0.0)
    out.update(
      flatten(
        LayerMean(mean=jnp.mean(per_head), per_layer=jnp.mean(per_head, axis=1), per_head=per_head),
        "null_mass",
      )
    )
  allowed = capture.allowed
  if w is not None:
    sparsity = _per_layer(
      lambda wl, mask: _attention_sparsity(
        wl, threshold=sparsity_threshold, is_causal=mask is None, mask=mask
      ),
      w.shape[0],
      allowed,
      w,
    )
    sparsity = sparsity._replace(mean=jnp.mean(sparsity.per_layer))
    out.update(flatten(sparsity, "sparsity"))
  if capture.q is not None and capture.k is not None:
    L, Tk = len(capture.q), capture.k[0].shape[1]  # stacked [L, ...] or a tuple per layer
    seq_allowed = None if allowed is None else allowed[..., :Tk]
    qk = _per_layer(
      lambda q, k, mask: _qk_statistics(q, k, is_causal=mask is None, mask=mask),
      L,
      seq_allowed,
      capture.q,
      capture.k,
    )
    out.update(flatten(qk._asdict() | {"max_logit": None}, "qk"))
    if capture.v is not None and Tk >= 2:
      geometry = _per_layer(
        lambda q, k, v, mask: _sink_geometry(q, k, v, is_causal=mask is None, mask=mask),
        L,
        seq_allowed,
        capture.q,
        capture.k,
        capture.v,
      )
      out.update(flatten(geometry, "sink_geometry"))
      out.update(flatten(_value_drain_of_layers(capture.v), "value_drain"))
  if capture.hidden is not None:
    out.update(
      flatten(
        _massive_activations(capture.hidden, abs_threshold=massive_abs, ratio=massive_ratio),
        "massive",
      )
    )
    out.update(flatten(_kurtosis(capture.hidden), "kurtosis"))
  if capture.gate_mean is not None:
    per_head = jnp.mean(jnp.asarray(capture.gate_mean, jnp.float32), axis=1)
    per_layer = jnp.mean(per_head, axis=1)
    out.update(
      flatten(
        LayerMean(mean=jnp.nanmean(per_layer), per_layer=per_layer, per_head=per_head), "gate"
      )
    )
  return out


capture_statistics = jax.jit(
  capture_statistics,
  static_argnames=("eps", "sparsity_threshold", "z_loss_coef", "massive_abs", "massive_ratio"),
)


def probe_statistics(
  capture: ProbeCapture,
  *,
  eps: float = 0.3,
  sparsity_threshold: float = 0.01,
  z_loss_coef: float = 1e-4,
  massive_abs: float = 100.0,
  massive_ratio: float = 1000.0,
) -> dict:
  """Deprecated: ``attnjax.nn.layer_stats(capture)``, which returns the same.

  All statistics of one forward pass from a :class:`.ProbeCapture`
  (``attnjax.stats.capture.capture_statistics``).
  """
  warn_once("attnjax.stats.probe_statistics", "attnjax.nn.layer_stats(capture)")
  return capture_statistics(
    capture,
    eps=eps,
    sparsity_threshold=sparsity_threshold,
    z_loss_coef=z_loss_coef,
    massive_abs=massive_abs,
    massive_ratio=massive_ratio,
  )
