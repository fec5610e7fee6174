"""``jax.nn.dot_product_attention``'s own arguments, as attnjax's dense call takes them.

:func:`attnjax.dot_product_attention` keeps jax.nn's names, positions and
meanings; what jax.nn has and attnjax expresses otherwise is translated here:
``local_window_size`` becomes ``window`` (:func:`window_of`), ragged
``query_seq_lengths`` / ``key_value_seq_lengths`` become segment ids or a mask
(:func:`ragged`), and ``return_residual`` becomes the logsumexp statistic of
the engine that runs the call (:func:`residual_options`, :func:`residual`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, masks, normalizers
from attnjax._src.options import DenseInputs, DenseOptions

Array = jnp.ndarray

# jax.nn.dot_product_attention's value for masked logits: the residual of a row with no key.
JAX_NN_MASKED_LOGIT = -0.7 * float(jnp.finfo(jnp.float32).max)


def window_of(local_window_size: Any, window: Any) -> Any:
  """``window`` from jax.nn's ``local_window_size`` (an int ``w`` is ``(w, w)`` there)."""
  if local_window_size is None:
    return window
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    local = (int(local_window_size), int(local_window_size))
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    local = tuple(local_window_size)
  else:
    raise TypeError(
      f"local_window_size must be an int or a pair (left, right) of ints, got {local_window_size!r}"
    )
  local = validators.check_window(local)
  if window is not None and validators.check_window(window) != local:
    raise ValueError(
      f"local_window_size={local_window_size!r} (jax.nn's name, "
      f"(left, right) = {local}) and window={window!r} differ; pass one"
    )
  return local


def _lengths_ok(name: str, lengths: Any, B: int, L: int) -> Optional[Array]:
  """``[B, L]`` True at positions below ``lengths`` ``[B]``, or None."""
  if lengths is None:
    return None
  if validators.shape_of(lengths) != (B,):
    raise ValueError(f"{name} must have shape [B] = ({B},), got {validators.shape_of(lengths)}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise TypeError(f"{name} must be integer, got dtype {jnp.result_type(lengths)}")
  return jnp.arange(L)[None, :] < jnp.asarray(lengths)[:, None]


def ragged(q, k, query_seq_lengths, key_value_seq_lengths, dense_keywords: dict) -> dict:
  """The dense keywords with jax.nn's ragged lengths as segment ids (when none are given: every
  fast path takes them) or else as a mask intersected with the given one."""
  B, T, S = validators.shape_of(q)[0], validators.shape_of(q)[1], validators.shape_of(k)[1]
  q_ok = _lengths_ok("query_seq_lengths", query_seq_lengths, B, T)
  kv_ok = _lengths_ok("key_value_seq_lengths", key_value_seq_lengths, B, S)
  if q_ok is None and kv_ok is None:
    return dense_keywords
  q_ok = jnp.ones((B, T), bool) if q_ok is None else q_ok
  kv_ok = jnp.ones((B, S), bool) if kv_ok is None else kv_ok
  if dense_keywords["segment_ids"] is None:
    # Queries past their length match no key id, keys past theirs no query id.
    segments = (jnp.where(q_ok, 0, 1).astype(jnp.int32), jnp.where(kv_ok, 0, 2).astype(jnp.int32))
    return {**dense_keywords, "segment_ids": segments}
  ok = jnp.logical_and(q_ok[:, None, :, None], kv_ok[:, None, None, :])
  return {**dense_keywords, "mask": masks.combine_masks(dense_keywords["mask"], ok)}


def residual_options(opts: DenseOptions) -> DenseOptions:
  """The options that make an engine's statistics carry jax.nn's residual: the logsumexp, and
  :data:`JAX_NN_MASKED_LOGIT` on a row with no allowed key (the engine's own count of each
  row's keys says which; nothing is rebuilt from the masks)."""
  return dataclasses.replace(opts, return_stats=True, empty_row_logsumexp=JAX_NN_MASKED_LOGIT)


def residual(inputs: DenseInputs, stats) -> Array:
  """jax.nn's residual ``[B, T, N]`` in the input dtype from the statistics of a call run with
  :func:`residual_options`: the per-row log-normaliser (with a gradient)."""
  return jnp.swapaxes(stats.logsumexp, 1, 2).astype(inputs.q.dtype)


def check_residual(
  inputs: DenseInputs,
  opts: DenseOptions,
  implementation: Optional[str],
  unsupported: Optional[Callable[[DenseInputs, DenseOptions], list]],
) -> None:
  """Raises where ``return_residual=True`` cannot be honoured: a normaliser that is not
  softmax-like, or a named ``implementation`` (``unsupported``: its refusals) that runs the
  call but computes no statistics (jax.nn's own paths)."""
  if not normalizers.get(opts.normalizer).softmax_like:
    raise ValueError(
      f"return_residual=True returns the softmax log-normaliser, which "
      f"normalizer={opts.normalizer!r} does not have (its weights are not exp(z - r)); "
      f"use return_stats=True for its statistics (stats.logsumexp is the plain logsumexp "
      f"of the logits)"
    )
  if implementation is None:
    return
  plain = dataclasses.replace(opts, return_stats=False, empty_row_logsumexp=0.0)
  if unsupported(inputs, plain) == [] and unsupported(inputs, residual_options(opts)):
    raise ValueError(
      f"return_residual=True is computed by attnjax's own paths (the residual carries a "
      f"gradient there), which implementation={implementation!r} is not; use "
      f"implementation=None, 'reference' or 'blockwise'"
    )
