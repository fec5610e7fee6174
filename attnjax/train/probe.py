"""The loop's bridge to ``attnjax.stats``: sink probe on a fixed batch and the spike score.

The metric definitions live in ``attnjax.stats`` only; this module calls them
and makes their output JSON-ready.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import numpy as np
from flax import nnx

from attnjax import stats


def run_probe(model: nnx.Module, inputs: jax.Array) -> dict:
  """All sink and stability statistics of ``model`` on the fixed probe batch ``inputs`` ``[B, T]``.

  One jitted ``attnjax.stats.probe`` pass (Sink_1^0.3 of Gu et al. on
  row-normalised weights, F-Attn of Qiu et al., entropy, max logit, q/k RMS
  and cosine, sink geometry, massive activations and M-Act of Sun et al.,
  null and gate mass, log Z drift, the probe loss), as JSON-ready values keyed
  ``"<metric>/<field>"``. Metrics a family cannot define are NaN (JSON null).
  """
  return stats.to_jsonable(stats.probe(model, inputs, length=None))


def spike_score(losses: Sequence[Optional[float]]) -> Optional[float]:
  """OLMo 2 spike score (percent of steps) of a per-step loss series, via ``attnjax.stats``.

  OLMo 2's window is the previous 1000 steps; a shorter run uses all steps so
  far and scores each step that has at least 50 steps of history.
  """
  if len(losses) < 3:
    return None
  values = np.asarray([math.nan if x is None else x for x in losses], np.float64)
  window = max(2, min(1000, len(values) - 1))
  score = stats.spike_score(values, window=window, min_history=min(window, 50))
  return float(score) if math.isfinite(score) else None
