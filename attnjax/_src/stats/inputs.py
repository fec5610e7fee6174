"""Input handling shared by every metric of :mod:`attnjax.stats`: layer stacking, checks, masks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, masks
from attnjax._src.attention_stats import AttentionStats, stats_from_weights

Array = jnp.ndarray


def shape_of(x) -> tuple[int, ...]:
  return validators.shape_of(x)


def _nonempty(name: str, x) -> None:
  if int(np.prod(shape_of(x))) == 0:
    raise ValueError(f"{name} is empty (shape {shape_of(x)}); statistics need at least one entry")


def _stack_layers(name: str, x, rank: int, letters: str) -> Array:
  """One layer (rank ``rank``), stacked layers (``rank + 1``) or a list -> ``[L, ...]`` float32."""
  if isinstance(x, (list, tuple)):
    if not x:
      raise ValueError(f"{name} is an empty list; pass one {letters} array per layer")
    for i, xi in enumerate(x):
      if np.ndim(xi) != rank:
        raise ValueError(f"{name}[{i}] must have rank {rank} {letters}, got shape {shape_of(xi)}")
    shapes = {shape_of(xi) for xi in x}
    if len(shapes) != 1:
      raise ValueError(f"{name} layers differ in shape: {sorted(shapes)}")
    x = jnp.stack([jnp.asarray(xi) for xi in x])
  else:
    if np.ndim(x) not in (rank, rank + 1):
      raise ValueError(
        f"{name} must have rank {rank} {letters} or {rank + 1} [L, {letters[1:]}, "
        f"got shape {shape_of(x)}"
      )
    x = jnp.asarray(x)
    if x.ndim == rank:
      x = x[None]
  validators.check_floating(name, x)
  _nonempty(name, x)
  return x.astype(jnp.float32)


def _attention_layers(name: str, weights) -> Array:
  """Self-attention weights as ``[L, B, N, T, S]`` float32 with ``S >= T``.

  Keys ``0 .. T-1`` are the sequence (key ``j`` at the position of query ``j``);
  any further keys are slots appended after it (a learned key/value bias, as
  ``attnjax.nn``'s ``kv_bias``), which take part in row normalisation only.
  """
  w = _stack_layers(name, weights, 4, "[B, N, T, S]")
  if w.shape[-1] < w.shape[-2]:
    raise ValueError(
      f"{name} must be self-attention weights with S >= T (keys 0..T-1 at the queries' "
      f"positions), got shape {shape_of(w)}"
    )
  return w


def _is_stats(x) -> bool:
  if isinstance(x, AttentionStats):
    return True
  return (
    isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(s, AttentionStats) for s in x)
  )


def stats_layers(stats) -> AttentionStats:
  """``AttentionStats`` (one, stacked ``[L, ...]`` or a list per layer) -> fields ``[L, B, N]``."""
  if isinstance(stats, AttentionStats):
    layers = [stats]
  else:
    layers = list(stats)
  fields = {}
  for field in AttentionStats._fields:
    values = [getattr(s, field) for s in layers]
    present = [v is not None for v in values]
    if not any(present):
      fields[field] = None
      continue
    if not all(present):
      raise ValueError(f"AttentionStats.{field} is None in some layers but not others")
    base = 3 if field == "logsumexp" else 2  # [B, N, T] vs [B, N]
    stacked = []
    for v in values:
      if np.ndim(v) not in (base, base + 1):
        raise ValueError(
          f"AttentionStats.{field} must have rank {base} (one layer) or {base + 1} "
          f"(stacked layers), got shape {shape_of(v)}"
        )
      v = jnp.asarray(v, jnp.float32)
      stacked.append(v[None] if v.ndim == base else v)
    value = jnp.concatenate(stacked, axis=0)
    _nonempty(f"AttentionStats.{field}", value)
    fields[field] = value
  return AttentionStats(**fields)


def _need(stats: AttentionStats, field: str, metric: str) -> Array:
  value = getattr(stats, field)
  if value is None:
    raise ValueError(
      f"{metric} needs AttentionStats.{field}, which this family does not report; "
      f"pass the attention weights instead"
    )
  return value


def _lift(x: Array, ndim: int) -> Array:
  """Prepends unit axes up to ``ndim`` (rank promotion is explicit in this project)."""
  return jnp.reshape(x, (1,) * (ndim - x.ndim) + x.shape)


def _row_normalize(w: Array) -> Array:
  """``|w_ij| / sum_l |w_il|``; all-zero rows stay zero (the rule of ``stats_from_weights``)."""
  mag = jnp.abs(w)
  total = jnp.sum(mag, axis=-1, keepdims=True)
  return mag / jnp.where(total > 0, total, 1.0)


def _weights_as_stats(w: Array) -> AttentionStats:
  """Runs the shared ``stats_from_weights`` path on ``[L, B, N, T, S]`` weights.

  Only the weight-derived fields (``sink_mass``, ``entropy``, ``row_sum``) are
  meaningful: no logits are given. Masked entries of materialised weights are
  zero, so every key counts as allowed; a row is then left out exactly when
  its weights are all zero, as ``stats_from_weights`` does for empty rows.
  """
  L, B, N, T, S = w.shape
  flat = jnp.reshape(w, (L * B, N, T, S))
  zeros = jnp.zeros_like(flat)
  s = stats_from_weights(zeros, flat, jnp.ones((1, 1, 1, 1), bool), zeros[..., :1])
  per = lambda x: jnp.reshape(x, (L, B, N))
  return AttentionStats(sink_mass=per(s.sink_mass), entropy=per(s.entropy), row_sum=per(s.row_sum))


def _allowed_pairs(target: tuple[int, int, int, int], *, is_causal: bool, window, mask) -> Array:
  """``[B|1, N|1, T, S]`` booleans for ``target = (B, N, T, S)`` from the one mask rule."""
  T, S = target[2], target[3]
  if mask is not None:
    mask = validators.as_rank4("mask", mask, target, kind="mask")
  allowed = masks.make_attention_mask(T, S, mask=mask, is_causal=is_causal, window=window)
  return jnp.ones((1, 1, T, S), bool) if allowed is None else allowed


def check_probability(name: str, value: float, *, low: float = 0.0, high: float = 1.0) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
  if not (low <= value <= high):
    raise ValueError(f"{name} must lie in [{low}, {high}], got {value!r}")
  return float(value)
