"""Rotary position embedding (Su et al. 2021), by explicit positions, with frequency scalings.

Positions are an argument (not ``arange(T)``), so a decode cache can rotate keys stored
before RoPE by their sequence position or by their slot in a StreamingLLM cache. A
scaling (``"linear"``, ``"llama3"``, ``"yarn"``, as ``transformers`` names them) is a
hashable tuple of ``(key, value)`` pairs sorted by key; :func:`normalize_scaling` makes
one from a dict and checks it.

Guide: docs/guides/layers.md, section "RoPE and its scalings". Implementation behind the
public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

Array = jnp.ndarray

SCALINGS = ("linear", "llama3", "yarn")
_REQUIRED = {
  "linear": ("factor",),
  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
  "yarn": ("factor", "original_max_position_embeddings"),
}
_OPTIONAL = {
  "linear": (),
  "llama3": (),
  "yarn": ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim"),
}


def normalize_scaling(scaling: Any) -> Optional[tuple]:
  """A RoPE scaling as a sorted tuple of ``(key, value)`` pairs, checked; None stays None.

  Args:
    scaling: None, a mapping or a tuple of pairs with ``"type"`` (one of
      ``SCALINGS``) and that type's keys (see the module docstring).

  Raises:
    TypeError / ValueError naming ``rope_scaling`` and the key.
  """
  if scaling is None:
    return None
  if isinstance(scaling, Mapping):
    items = dict(scaling)
  elif isinstance(scaling, (tuple, list)) and all(
    isinstance(p, (tuple, list)) and len(p) == 2 for p in scaling
  ):
    items = {k: v for k, v in scaling}
  else:
    raise TypeError(
      f"rope_scaling must be a dict or a tuple of (key, value) pairs, got {scaling!r}"
    )
  kind = items.get("type")
  if kind not in SCALINGS:
    raise ValueError(f"rope_scaling['type'] must be one of {SCALINGS}, got {kind!r}")
  allowed = ("type",) + _REQUIRED[kind] + _OPTIONAL[kind]
  unknown = sorted(set(items) - set(allowed))
  if unknown:
    raise ValueError(f"rope_scaling of type {kind!r} takes {allowed}; unknown keys {unknown}")
  for key in _REQUIRED[kind]:
    if items.get(key) is None:
      raise ValueError(f"rope_scaling of type {kind!r} needs {key!r}")
  for key, value in items.items():
    if key == "type" or value is None:
      continue
    if key == "truncate":
      if not isinstance(value, bool):
        raise TypeError(f"rope_scaling['truncate'] must be a bool, got {value!r}")
      continue
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
      raise TypeError(f"rope_scaling[{key!r}] must be a finite number, got {value!r}")
    if value <= 0 and key not in ("mscale", "mscale_all_dim"):
      raise ValueError(f"rope_scaling[{key!r}] must be positive, got {value!r}")
  if kind == "llama3" and items["high_freq_factor"] <= items["low_freq_factor"]:
    raise ValueError(
      f"rope_scaling: high_freq_factor={items['high_freq_factor']} must exceed "
      f"low_freq_factor={items['low_freq_factor']}"
    )
  return tuple(sorted((k, v) for k, v in items.items() if v is not None))


def rope_frequencies(
  head_dim: int, theta: float, scaling: Optional[tuple] = None
) -> tuple[np.ndarray, float]:
  """``(inv_freq [head_dim / 2] float32, attention_factor)`` of RoPE with ``scaling``.

  Without scaling, ``inv_freq[d] = theta ** (-2 d / head_dim)`` and the factor is 1.
  """
  half = head_dim // 2
  exponent = np.arange(half, dtype=np.float64) * 2.0 / head_dim
  base = theta**exponent  # wavelength / 2 pi of each pair
  inv_freq = 1.0 / base
  s = dict(scaling or ())
  kind = s.get("type")
  factor = 1.0
  if kind == "linear":
    inv_freq = inv_freq / s["factor"]
  elif kind == "llama3":
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2.0 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = np.logical_and(wavelen >= old / high, wavelen <= old / low)
    inv_freq = np.where(medium, smoothed, scaled)
    factor = 1.0
  elif kind == "yarn":
    factor = s["factor"]
    original = s["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
      if s.get("mscale") and s.get("mscale_all_dim"):
        attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
      else:
        attention = mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32.0, s.get("beta_slow") or 1.0

    def correction_dim(rotations):
      return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(half, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = (1.0 / (factor * base)) * (1.0 - keep) + (1.0 / base) * keep
    factor = float(attention)
  return inv_freq.astype(np.float32), float(factor)


def apply_rope(
  x: Array,
  positions: Array,
  theta: float,
  *,
  scaling: Optional[tuple] = None,
  rotary_dim: Optional[int] = None,
) -> Array:
  """Rotates ``x`` ``[B, T, N, H]`` by ``positions`` ``[T]``, ``[B, T]`` or ``[B, T, N]``.

  Uses the half-split pairing (dimension ``d`` with ``d + H/2``, as GPT-NeoX and
  Llama in JAX, and Hugging Face's ``rotate_half``) with frequencies
  ``theta ** (-2d / H)``, or those of ``scaling``. Computed in float32 and
  returned in ``x``'s dtype. The dot product of a query rotated by ``p`` and a key
  rotated by ``p'`` depends only on ``p - p'``.

  Args:
    x: ``[B, T, N, H]`` with even ``H``.
    positions: integer or float positions ``[T]`` (shared by the batch), ``[B, T]``,
      or ``[B, T, N]`` (one per head: a cache whose key/value heads keep
      different tokens, :class:`~.H2OCache`).
    theta: the RoPE base.
    scaling: None, or a scaling of ``attnjax._src.nn.rope.normalize_scaling`` (linear, llama3,
      yarn); yarn's attention factor multiplies the result.
    rotary_dim: partial RoPE (Qwen3-Next's ``partial_rotary_factor``): only the first
      ``rotary_dim`` (even) dimensions are rotated, with the frequencies of a head of that
      width; the rest pass unchanged. None = every dimension.

  Returns:
    The rotated ``x``, same shape and dtype.
  """
  if rotary_dim is not None and rotary_dim != x.shape[-1]:
    if rotary_dim % 2 or not 0 < rotary_dim < x.shape[-1]:
      raise ValueError(
        f"rotary_dim={rotary_dim} must be even and at most the head dim of x {x.shape}"
      )
    rotated = apply_rope(x[..., :rotary_dim], positions, theta, scaling=scaling)
    return jnp.concatenate([rotated, x[..., rotary_dim:]], axis=-1)
  B, T, N, H = x.shape
  if H % 2:
    raise ValueError(f"RoPE needs an even head dim, got x of shape {x.shape}")
  positions = jnp.asarray(positions, jnp.float32)
  shape = positions.shape
  if positions.ndim == 1:
    positions = positions[None, :]
  if positions.ndim == 2:
    positions = positions[:, :, None]
  if positions.ndim != 3 or positions.shape[1] != T or positions.shape[2] not in (1, N):
    raise ValueError(f"positions must be [T], [B, T] or [B, T, N] with T={T}, N={N}, got {shape}")
  half = H // 2
  if scaling is None:
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / H)
    factor = 1.0
  else:
    inv_freq, factor = rope_frequencies(H, theta, normalize_scaling(scaling))
    freqs = jnp.asarray(inv_freq)
  angles = positions[..., None] * jnp.reshape(freqs, (1, 1, 1, half))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if factor != 1.0:
    cos, sin = cos * factor, sin * factor
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
