"""What uniform attention gives each sink metric at a probe's length and mask (exact).

A sink metric means little without its value for attention that prefers no key: F-Attn is
about 0.06 for uniform causal attention over 64 tokens, not 0. :func:`uniform_baselines`
builds those weights from the mask and runs the ``attnjax.stats`` definitions on them.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np

# Families whose mask is the causal one (optionally a sliding window): uniform attention over
# it is a defined baseline. Sparse patterns, compressed and content-selected blocks have none.
CAUSAL_FAMILIES = (
  "dense",
  "qk_norm",
  "cosine",
  "linear",
  "retnet",
  "mamba2_decay",
  "gla",
  "deltanet",
  "gated_deltanet",
)


@functools.lru_cache(maxsize=64)
def uniform_baselines(length: int, window: Optional[int] = None, eps: float = 0.3) -> dict:
  """Sink metrics of uniform attention over a causal (sliding-window) mask of ``length``.

  Each query ``i`` spreads its weight evenly over the keys it may see (``j <= i``, and
  ``i - j <= window`` with a window); the metrics are the ``attnjax.stats`` functions on
  those weights, so they follow the same definitions as the probes.

  Args:
    length: the probe's sequence length T.
    window: keys ``i - window .. i`` (None: all earlier keys).
    eps: the threshold of ``Sink_1^eps``.

  Returns:
    ``{"f_attn", "first_token", "sink_rate" (percent), "entropy" (nats, mean over
    queries), "alpha_1"}`` as floats; ``first_token`` (the raw weight) equals F-Attn
    because the rows sum to one.
  """
  import jax.numpy as jnp

  from attnjax._src.stats import sinks

  i = np.arange(length)[:, None]
  j = np.arange(length)[None, :]
  allowed = j <= i
  if window is not None:
    allowed &= i - j <= window
  w = allowed / allowed.sum(axis=-1, keepdims=True)
  w = jnp.asarray(w[None, None, None], jnp.float32)  # [L=1, B=1, N=1, T, T]
  f_attn = float(sinks.first_token_attention(w).f_attn)
  return {
    "f_attn": f_attn,
    "first_token": f_attn,
    "sink_rate": float(sinks.sink_rate(w, eps=eps).rate),
    "entropy": float(sinks.attention_entropy(w).mean[0]),
    "alpha_1": float(sinks.importance(w)[0, 0, 0, 0]),
  }


def mask_of(config: dict) -> tuple[bool, Optional[int]]:
  """``(defined, window)``: whether a run's attention mask is causal (uniform attention over
  it is a baseline) and its sliding window, from its ``config.json``."""
  from attnjax._src.train.variants import VARIANTS

  fields = VARIANTS.get(config.get("variant"), ({}, ""))[0]
  if fields.get("family", "dense") not in CAUSAL_FAMILIES or "pattern" in fields:
    return False, None
  window = fields.get("window") or (config.get("model") or {}).get("window") or None
  if isinstance(window, (tuple, list)):
    window = window[0]
  return True, (int(window) if window else None)


def run_baselines(config: dict) -> Optional[dict]:
  """:func:`.uniform_baselines` at a run's probe length and mask; None where undefined."""
  defined, window = mask_of(config)
  length = (config.get("train") or {}).get("probe_len")
  if not defined or not length:
    return None
  return dict(uniform_baselines(int(length), window), length=int(length), window=window)


def describe_mask(base: Any) -> str:
  """``"causal, T = 64"`` or ``"causal window 16, T = 64"`` of a :func:`.run_baselines` dict."""
  w = base.get("window")
  return f"causal{'' if w is None else f' window {w}'}, T = {base['length']}"
