"""The loop's bridge to ``attnjax.stats``: sink probe on a fixed batch, spike score, LR sensitivity.

The metric definitions live in ``attnjax.stats`` only; this module calls them
and flattens their output into JSON-ready scalars and per-layer lists.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx



def _stats_module():
  from attnjax import stats
  return stats


def _flatten(record: dict) -> dict:
  out = {}
  for k, v in jax.device_get(record).items():
    if v is None:
      continue
    arr = np.asarray(v, dtype=np.float64) if not isinstance(v, str) else v
    if isinstance(arr, str):
      out[k] = arr
    elif arr.ndim == 0:
      out[k] = float(arr)
    else:
      out[k] = [float(x) for x in arr.ravel()]
  return out


def run_probe(model: nnx.Module, inputs: jax.Array) -> dict:
  """All sink statistics of ``model`` on the probe batch ``inputs`` ``[B, T]`` (T = 64 by default).

  Uses ``attnjax.stats.probe`` when it exists; otherwise composes the same
  ``attnjax.stats`` metrics over ``attnjax.nn.collect_stats``: Sink_1^0.3
  (Gu et al.), F-Attn (Qiu et al.), entropy, max logit, massive activations
  and M-Act (Sun et al.), mean log Z. Metrics a family cannot define (no
  attention weights for unnormalised linear attention) are left out.
  """
  from attnjax import nn
  from attnjax.attention_stats import AttentionStats

  stats = _stats_module()
  if hasattr(stats, "probe"):
    return _flatten(stats.flatten(stats.probe(model, inputs)) if hasattr(stats, "flatten")
                    else stats.probe(model, inputs))
  out = nn.collect_stats(model, inputs, hidden=True)
  layers = out["layers"]
  record: dict = {"log_z": jnp.mean(out["log_z"])}
  fields = AttentionStats._fields
  if all(l.get("sink_mass") is not None and l.get("logsumexp") is not None for l in layers):
    att = [AttentionStats(**{f: l.get(f) for f in fields}) for l in layers]
    sink = stats.sink_rate(att)
    record.update(sink_rate=sink.rate, sink_rate_per_layer=sink.per_layer)
    f_attn = stats.first_token_attention(att)
    record.update(f_attn=f_attn.f_attn, f_attn_per_layer=f_attn.per_layer)
  if all(l.get("entropy") is not None for l in layers):
    entropy = stats.attention_entropy([AttentionStats(**{f: l.get(f) for f in fields})
                                       for l in layers])
    record.update(entropy=jnp.mean(entropy.mean), entropy_per_layer=entropy.mean)
  if all(l.get("max_logit") is not None for l in layers):
    record["max_logit_per_layer"] = jnp.stack([jnp.max(l["max_logit"]) for l in layers])
    record["max_logit"] = jnp.max(record["max_logit_per_layer"])
  massive = stats.massive_activations([l["hidden"] for l in layers])
  record.update(m_act=massive.m_act, massive_count=jnp.sum(massive.count),
                max_abs_per_layer=massive.max_abs)
  return _flatten(record)


def spike_score(losses: Sequence[float]) -> Optional[float]:
  """OLMo 2 spike score (percent) of a per-step loss series, via ``attnjax.stats.spike_score``."""
  if len(losses) < 3:
    return None
  values = np.asarray([x if x is not None else math.nan for x in losses], np.float64)
  # OLMo 2's window is the previous 1000 steps; a short run scores every step
  # that has at least 50 steps of history (or all but the first few).
  window = max(2, min(1000, len(values) - 1))
  min_history = min(window, 50)
  score = _stats_module().spike_score(values, window=window, min_history=min_history)
  return None if not math.isfinite(score) else float(score)
