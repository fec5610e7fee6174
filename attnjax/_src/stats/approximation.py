"""Kernel approximation error of feature-map attention against softmax (Choromanski et al. 2021)."""

from __future__ import annotations

import inspect
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, logits, normalizers
from attnjax._src.stats.inputs import _allowed_pairs, _nonempty, shape_of

Array = jnp.ndarray


def _kernel_approximation_error(approx_weights, exact_weights) -> Array:
  """Relative Frobenius error ``||A_hat - A||_F / ||A||_F`` of an approximate attention matrix.

  Definition: per attention matrix (the last two axes ``[T, S]``), the
  Frobenius norm of the difference over that of the exact matrix; Choromanski
  et al. measure random-feature (FAVOR+) attention ``A_hat`` against exact
  softmax attention ``A`` this way, as a function of the number of features.

  Args:
    approx_weights: ``[..., T, S]`` approximate weights (e.g. linear attention).
    exact_weights: the exact weights, same shape.

  Returns:
    ``[...]`` float32 errors, one per matrix (0 where ``A`` is all zero and
    ``A_hat`` equals it; ``inf`` where only ``A`` is zero).

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers", sec. 4.
  """
  for name, x in (("approx_weights", approx_weights), ("exact_weights", exact_weights)):
    if np.ndim(x) < 2:
      raise ValueError(f"{name} must have rank >= 2 [..., T, S], got shape {shape_of(x)}")
    validators.check_floating(name, x)
    _nonempty(name, x)
  if shape_of(approx_weights) != shape_of(exact_weights):
    raise ValueError(
      f"approx_weights {shape_of(approx_weights)} and exact_weights "
      f"{shape_of(exact_weights)} must have the same shape"
    )
  a = jnp.asarray(exact_weights, jnp.float32)
  diff = jnp.asarray(approx_weights, jnp.float32) - a
  num = jnp.sqrt(jnp.sum(diff * diff, axis=(-2, -1)))
  den = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1)))
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), jnp.where(num > 0, jnp.inf, 0.0))


kernel_approximation_error = jax.jit(_kernel_approximation_error)
kernel_approximation_error.__doc__ = _kernel_approximation_error.__doc__


def _features(feature_map, x: Array, *, is_query: bool) -> Array:
  """``phi(x)`` float32; passes ``is_query`` to maps that take it (``attnjax.feature_maps``)."""
  try:
    params = inspect.signature(feature_map).parameters
  except (TypeError, ValueError):
    params = {}
  takes_role = "is_query" in params or any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
  )
  phi = feature_map(x, is_query=is_query) if takes_role else feature_map(x)
  return jnp.asarray(phi, jnp.float32)


def _feature_map_error(q, k, feature_map, *, is_causal: bool, scale: Optional[float]) -> Array:
  B, T, S, N, K, H, _ = validators.check_qkv(q, k, k)
  scale = H**-0.5 if scale is None else validators.check_positive_float("scale", scale)
  allowed = _allowed_pairs((B, N, T, S), is_causal=is_causal, window=None, mask=None)
  z = jnp.reshape(logits.scores(logits.group_queries(q, K), k, scale=scale), (B, N, T, S))
  exact, _ = normalizers.normalize(z, allowed, normalizer="softmax")
  phi_q = _features(feature_map, q.astype(jnp.float32), is_query=True)
  phi_k = _features(feature_map, k.astype(jnp.float32), is_query=False)
  kernel = jnp.reshape(
    logits.scores(logits.group_queries(phi_q, K), phi_k, scale=1.0), (B, N, T, S)
  )
  kernel = jnp.where(allowed, kernel, 0.0)
  denom = jnp.sum(kernel, axis=-1, keepdims=True)
  approx = jnp.where(denom != 0, kernel / jnp.where(denom != 0, denom, 1.0), 0.0)
  return _kernel_approximation_error(approx, exact)


# A map carrying arrays (a random projection) is a traced argument, so redrawing
# features does not recompile; a plain function is a static argument.
_feature_map_error_traced = jax.jit(_feature_map_error, static_argnames=("is_causal", "scale"))
_feature_map_error_static = jax.jit(
  _feature_map_error, static_argnames=("feature_map", "is_causal", "scale")
)


def feature_map_attention_error(
  q, k, *, feature_map: Callable[..., Array], is_causal: bool = True, scale: Optional[float] = None
) -> Array:
  """Relative error of kernel-feature attention against exact softmax attention.

  Builds ``A`` = softmax of ``scale * <q_i, k_j>`` (the dense reference path and
  normaliser table) and ``A_hat_ij = phi(q_i).phi(k_j) / sum_l phi(q_i).phi(k_l)``
  over the same allowed keys, then returns
  :func:`.kernel_approximation_error` per (batch, head). ``feature_map`` must
  approximate that kernel: ``phi(q).phi(k) ~ c_i exp(scale <q, k>)`` with any
  per-query constant ``c_i`` (row normalisation cancels it), as FAVOR+ maps do
  for the default ``scale``, scaling their input by ``H ** -1/4``. Rows whose
  denominator is 0 give zeros. Runs under ``jax.jit``.

  Args:
    q: ``[B, T, N, H]``; k: ``[B, S, K, H]`` (GQA: ``N % K == 0``).
    feature_map: ``phi``: ``[..., H] -> [..., M]``; a function (static) or a
      pytree callable carrying its projection, such as an
      ``attnjax.feature_maps`` map (traced; called with ``is_query``).
    is_causal: causal mask for both matrices.
    scale: softmax logit scale; None means ``H ** -0.5``.

  Returns:
    ``[B, N]`` float32 relative Frobenius errors.

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers", sec. 4.
  """
  if not callable(feature_map):
    raise TypeError(f"feature_map must be a callable [..., H] -> [..., M], got {feature_map!r}")
  leaves = jax.tree.leaves(feature_map)
  if leaves and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
    return _feature_map_error_traced(q, k, feature_map, is_causal=is_causal, scale=scale)
  return _feature_map_error_static(q, k, feature_map, is_causal=is_causal, scale=scale)
