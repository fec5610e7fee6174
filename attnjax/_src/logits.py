"""The logits of attention, defined once for every engine and family.

On float32: the similarity (:func:`scores`, :func:`from_dots`; ``"dot"`` or
``"neg_sq_euclidean"``), the softcap (:func:`softcap`, derivative :func:`softcap_grad`),
the additive bias (:func:`capped_logits`), then ``score_mod`` over :func:`index_grid`.
Query head ``n`` uses key/value head ``n // G`` (:func:`group_queries`). This module
imports nothing from attnjax, so kernels and families share it.
Guide: docs/guides/architecture.md, section "Shared vocabulary".
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax.numpy as jnp

Array = jnp.ndarray


def group_queries(q: Array, num_kv_heads: int) -> Array:
  """``[B, T, N, H] -> [B, T, K, G, H]``: query head ``n`` uses kv head ``n // G``."""
  B, T, N, H = q.shape
  return jnp.reshape(q, (B, T, num_kv_heads, N // num_kv_heads, H))


def softcap(z: Array, cap: Optional[float]) -> Array:
  """``cap * tanh(z / cap)``, or ``z`` when ``cap`` is None."""
  if cap is None:
    return z
  return cap * jnp.tanh(z / cap)


def softcap_grad(
  dz: Array, cap: Optional[float], *, s: Optional[Array] = None, capped: Optional[Array] = None
) -> Array:
  """The cotangent of ``s`` given ``dz``, the cotangent of ``capped = softcap(s, cap)``.

  ``d/ds [c tanh(s / c)] = 1 - tanh(s / c)^2``, from ``capped`` when given (no second
  ``tanh``: ``tanh(s / c) = capped / c``), else from ``s``. ``dz`` unchanged when ``cap``
  is None.
  """
  if cap is None:
    return dz
  t = capped / cap if capped is not None else jnp.tanh(s / cap)
  return dz * (1.0 - t * t)


def from_dots(
  dots: Array,
  *,
  scale: float,
  similarity: str = "dot",
  q_sq: Optional[Array] = None,
  k_sq: Optional[Array] = None,
) -> Array:
  """The similarity from the float32 dot products ``<q_i, k_j>``.

  ``"dot"``: ``scale * dots``. ``"neg_sq_euclidean"``: ``-scale * (q_sq - 2 dots + k_sq)``
  with ``q_sq`` / ``k_sq`` the squared norms of the rows / keys, broadcastable to ``dots``.
  """
  if similarity == "dot":
    return dots * scale
  return -scale * (q_sq - 2.0 * dots + k_sq)


def scores(
  q: Array, k: Array, *, scale: float, similarity: str = "dot", cap: Optional[float] = None
) -> Array:
  """Float32 logits ``[B, K, G, T, S]`` from grouped ``q`` ``[B, T, K, G, H]`` and ``k`` ``[B, S, K, H]``.

  The similarity (:func:`from_dots`), then the softcap ``cap``; no bias.
  """
  q32 = q.astype(jnp.float32)
  k32 = k.astype(jnp.float32)
  dots = jnp.einsum("btkgh,bskh->bkgts", q32, k32, preferred_element_type=jnp.float32)
  q_sq = k_sq = None
  if similarity != "dot":
    q_sq = jnp.einsum("btkgh,btkgh->bkgt", q32, q32)[..., None]
    k_sq = jnp.einsum("bskh,bskh->bks", k32, k32)[:, :, None, None, :]
  s = from_dots(dots, scale=scale, similarity=similarity, q_sq=q_sq, k_sq=k_sq)
  return s if cap is None else softcap(s, cap)


def capped_logits(
  s: Array, cap: Optional[float], bias: Optional[Array] = None
) -> tuple[Array, Array]:
  """``(z, capped)``: the logits before ``score_mod`` and the capped similarity.

  ``capped = softcap(s, cap)`` and ``z = capped + bias`` (float32): the bias is added
  after the softcap, so a mask-like bias is never squashed by it.
  """
  capped = s if cap is None else softcap(s, cap)
  if bias is None:
    return capped, capped
  return capped + bias.astype(jnp.float32), capped


def index_grid(
  B: int, heads: Sequence[int], i: Array, j: Array
) -> tuple[Array, Array, Array, Array]:
  """int32 indices ``(b, n, i, j)`` of logits laid out ``[B, *heads, Tq, Sk]``.

  ``b`` numbers the batch, ``n`` the query heads (row-major over ``heads``: with
  ``heads = (K, G)`` query head ``k * G + g``), ``i`` / ``j`` are the positions of the
  rows and keys (1-d, length ``Tq`` / ``Sk``). Each is shaped to broadcast against the
  logits: ``b [B, 1, ...]``, ``n [1, *heads, 1, 1]``, ``i [1, ..., Tq, 1]``,
  ``j [1, ..., 1, Sk]``.
  """
  heads = tuple(heads)
  ones = (1,) * len(heads)
  b = jnp.reshape(jnp.arange(B, dtype=jnp.int32), (B,) + ones + (1, 1))
  n = jnp.reshape(jnp.arange(math.prod(heads), dtype=jnp.int32), (1,) + heads + (1, 1))
  i = jnp.asarray(i).astype(jnp.int32)
  j = jnp.asarray(j).astype(jnp.int32)
  return (
    b,
    n,
    jnp.reshape(i, (1,) + ones + (i.shape[0], 1)),
    jnp.reshape(j, (1,) + ones + (1, j.shape[0])),
  )
