"""The normaliser table: how a row of logits becomes attention weights.

One function per normaliser, each taking float32 logits ``z`` ``[B, N, T, S]``
and the boolean ``allowed`` mask (broadcastable to it), and returning
``(weights, log_normalizer)`` where ``log_normalizer`` ``[B, N, T, 1]`` is the
log of the softmax-style partition (including a null column when there is one).

Masked keys get weight exactly 0 and a row with no allowed key gets all zeros.
Every form is written so that neither value nor gradient can be NaN for finite
logits: masked logits are replaced by -inf before ``exp`` and the running
maximum is a ``stop_gradient`` shift (the result does not depend on it).

=============  ===========================================================  ======================
name           weight of key j in row i                                     source
=============  ===========================================================  ======================
softmax        exp(z_ij) / sum_l exp(z_il)                                  Vaswani et al. 2017
softmax_one    exp(z_ij) / (1 + sum_l exp(z_il))                            Miller 2023 ("off by one")
(sink_logits)  exp(z_ij) / (exp(s_h) + sum_l exp(z_il)), learned s_h         gpt-oss (2025)
sigmoid        sigmoid(z_ij + b_i), b_i = -log(number of allowed keys)      Ramapuram et al. 2024
softpick       relu(exp(z_ij) - 1) / (sum_l |exp(z_il) - 1| + eps)          Zuhri et al. 2025
none           z_ij (raw scores)                                             -
=============  ===========================================================  ======================
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

Array = jnp.ndarray

NORMALIZERS = ("softmax", "softmax_one", "sigmoid", "softpick", "none")
# Normalisers whose rows sum to one (softmax_one and sink logits sum to <= 1).
SUMS_TO_ONE = ("softmax",)
SOFTPICK_EPS = 1e-6


def _masked(z: Array, allowed: Array) -> Array:
  return jnp.where(allowed, z, -jnp.inf)


def _shift(z_masked: Array, floor: Optional[Array] = None) -> Array:
  """Row maximum used as an exp shift; finite, and with no gradient."""
  m = jnp.max(z_masked, axis=-1, keepdims=True)
  if floor is not None:
    m = jnp.maximum(m, floor)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  return jax.lax.stop_gradient(m)


def _softmax_with_null(z: Array, allowed: Array, null_logit: Optional[Array]):
  zm = _masked(z, allowed)
  m = _shift(zm, null_logit)
  e = jnp.exp(zm - m)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  if null_logit is not None:
    denom = denom + jnp.exp(null_logit - m)
  safe = jnp.where(denom > 0, denom, 1.0)
  return e / safe, m + jnp.log(safe)


def _lse(z: Array, allowed: Array) -> Array:
  return _softmax_with_null(z, allowed, None)[1]


def softmax(z, allowed, sink_logits=None):
  return _softmax_with_null(z, allowed, sink_logits)


def softmax_one(z, allowed, sink_logits=None):
  del sink_logits  # validated away upstream
  return _softmax_with_null(z, allowed, jnp.zeros((1, 1, 1, 1), z.dtype))


def num_allowed(allowed: Array, shape: tuple[int, ...]) -> Array:
  """Number of allowed keys per row, ``[..., T, 1]`` float32 (at least 1)."""
  n = jnp.sum(jnp.broadcast_to(allowed, shape), axis=-1, keepdims=True, dtype=jnp.float32)
  return jnp.maximum(n, 1.0)


def sigmoid(z, allowed, sink_logits=None):
  del sink_logits
  b = -jnp.log(num_allowed(allowed, z.shape))
  w = jnp.where(allowed, jax.nn.sigmoid(jnp.where(allowed, z, 0.0) + b), 0.0)
  return w, _lse(z, allowed)


def softpick(z, allowed, sink_logits=None):
  del sink_logits
  # relu(e^z - 1) / (sum|e^z - 1| + eps), multiplied through by e^-m, m >= 0.
  zm = _masked(z, allowed)
  m = _shift(zm, jnp.zeros((1, 1, 1, 1), z.dtype))
  e = jnp.exp(zm - m)
  one = jnp.exp(-m)
  centred = jnp.where(allowed, e - one, 0.0)
  num = jax.nn.relu(centred)
  denom = jnp.sum(jnp.abs(centred), axis=-1, keepdims=True) + SOFTPICK_EPS * one
  return num / denom, _lse(z, allowed)


def none(z, allowed, sink_logits=None):
  del sink_logits
  return jnp.where(allowed, z, 0.0), _lse(z, allowed)


TABLE: dict[str, Callable] = {
    "softmax": softmax,
    "softmax_one": softmax_one,
    "sigmoid": sigmoid,
    "softpick": softpick,
    "none": none,
}


def normalize(z: Array, allowed: Array, *, normalizer: str,
              sink_logits: Optional[Array] = None) -> tuple[Array, Array]:
  """Applies a normaliser from the table. ``sink_logits`` is ``[1, N, 1, 1]`` or None."""
  return TABLE[normalizer](z, allowed, sink_logits)
