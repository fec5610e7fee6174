"""The loop's bridge to ``attnjax.stats``: sink probe on a fixed batch, spike score, LR sensitivity.

The metric definitions live in ``attnjax.stats`` only; this module calls them
and flattens their output into JSON-ready scalars and per-layer lists.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import numpy as np
from flax import nnx

from attnjax.train.step import attention_stats_by_layer, summarize_attention


def _stats_module():
  try:
    from attnjax import stats
  except ImportError:
    return None
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

  Uses ``attnjax.stats.probe`` (Sink_1^0.3, F-Attn, M-Act, entropy, max
  logit, ...). Without it, records only the per-layer attention summary the
  layers sow (max logit, entropy, F-Attn).
  """
  stats = _stats_module()
  if stats is not None and hasattr(stats, "probe"):
    return _flatten(stats.probe(model, inputs))
  model(inputs)
  summary = summarize_attention(attention_stats_by_layer(nnx.pop(model, nnx.Intermediate)))
  record = {f"{k}_per_layer": v for k, v in summary.items()}
  if "f_attn" in summary:
    record["f_attn"] = float(np.nanmean(np.asarray(summary["f_attn"])))
  return _flatten(record)


def spike_score(losses: Sequence[float]) -> Optional[float]:
  """OLMo 2 spike score of a loss series through ``attnjax.stats``; None without it."""
  stats = _stats_module()
  if stats is None or not hasattr(stats, "spike_score") or len(losses) < 2:
    return None
  values = np.asarray([x if x is not None else math.nan for x in losses], np.float64)
  return float(stats.spike_score(values))
