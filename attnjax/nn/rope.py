"""Rotary position embedding (Su et al. 2021), by explicit positions.

Positions are an argument rather than ``arange(T)`` so a decode cache can
rotate keys stored before RoPE by any position it chooses: their sequence
position, or their slot in a StreamingLLM cache.
"""

from __future__ import annotations

import jax.numpy as jnp

Array = jnp.ndarray


def apply_rope(x: Array, positions: Array, theta: float) -> Array:
  """Rotates ``x`` ``[B, T, N, H]`` by ``positions`` ``[T]``, ``[B, T]`` or ``[B, T, N]``.

  Uses the half-split pairing (dimension ``d`` with ``d + H/2``, as GPT-NeoX and
  Llama in JAX) with frequencies ``theta ** (-2d / H)``. Computed in float32 and
  returned in ``x``'s dtype. The dot product of a query rotated by ``p`` and a key
  rotated by ``p'`` depends only on ``p - p'``.

  Args:
    x: ``[B, T, N, H]`` with even ``H``.
    positions: integer or float positions ``[T]`` (shared by the batch), ``[B, T]``,
      or ``[B, T, N]`` (one per head: a cache whose key/value heads keep
      different tokens, :class:`~.H2OCache`).
    theta: the RoPE base.

  Returns:
    The rotated ``x``, same shape and dtype.
  """
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
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / H)
  angles = positions[..., None] * jnp.reshape(freqs, (1, 1, 1, half))
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., :half], x32[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
