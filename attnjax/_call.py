"""The canonical form of a dense attention call, shared by every dense path.

:func:`validate` checks the arguments of a dense call once and returns a
:class:`DenseInputs` (arrays) and a :class:`DenseOptions` (static choices).
:mod:`attnjax.dense` (reference and dispatch), :mod:`attnjax.blockwise` and
:mod:`attnjax.sparse` all take this form, so it lives below them: kernels import
it, and nothing here imports a kernel (no import cycles).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

import jax.numpy as jnp

from attnjax import _checks, normalizers

Array = jnp.ndarray

Similarity = Literal["dot", "neg_sq_euclidean"]
SIMILARITIES: tuple[str, ...] = get_args(Similarity)


@dataclasses.dataclass(frozen=True)
class DenseOptions:
  """Static, validated options of a dense attention call (hashable)."""

  is_causal: bool = False
  window: Optional[tuple[int, int]] = None
  scale: float = 1.0
  normalizer: str = "softmax"
  softcap: Optional[float] = None
  similarity: str = "dot"
  return_stats: bool = False


@dataclasses.dataclass(frozen=True)
class DenseInputs:
  """Canonical array arguments: bias and mask are rank 4 or None, sink logits ``[1, N, 1, 1]``."""

  q: Array
  k: Array
  v: Array
  bias: Optional[Array] = None
  mask: Optional[Array] = None
  sink_logits: Optional[Array] = None
  q_segment_ids: Optional[Array] = None
  kv_segment_ids: Optional[Array] = None


def validate(q, k, v, *, bias=None, mask=None, is_causal=False, scale=None,
             normalizer="softmax", sink_logits=None, softcap=None, window=None,
             segment_ids=None, similarity="dot",
             return_stats=False) -> tuple[DenseInputs, DenseOptions]:
  """Validates a dense call (every argument but ``implementation``); see ``dense.prepare``."""
  B, T, S, N, K, H, _ = _checks.check_qkv(q, k, v)
  _checks.check_choice("normalizer", normalizer, normalizers.NORMALIZERS)
  _checks.check_choice("similarity", similarity, SIMILARITIES)
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  window = _checks.check_window(window)
  scale = H ** -0.5 if scale is None else scale
  if isinstance(scale, bool) or not isinstance(scale, (int, float)):
    raise TypeError(f"scale must be a Python float or None, got {type(scale).__name__}")
  softcap = _checks.check_positive_float("softcap", softcap)
  target = (B, N, T, S)
  if sink_logits is not None:
    if not normalizers.REGISTRY[normalizer].accepts_sink_logits:
      raise ValueError(
          f"sink_logits adds a learned null column to softmax; it cannot be combined "
          f"with normalizer={normalizer!r}")
    sink_logits = jnp.reshape(_checks.check_per_head("sink_logits", sink_logits, N),
                              (1, N, 1, 1))
  bias = None if bias is None else _checks.as_rank4("bias", bias, target, kind="bias")
  mask = None if mask is None else _checks.as_rank4("mask", mask, target, kind="mask")
  q_seg, kv_seg = _checks.check_segment_ids(segment_ids, B, T, S)
  inputs = DenseInputs(q, k, v, bias, mask, sink_logits, q_seg, kv_seg)
  opts = DenseOptions(is_causal=is_causal, window=window, scale=float(scale),
                      normalizer=normalizer, softcap=softcap, similarity=similarity,
                      return_stats=bool(return_stats))
  return inputs, opts
