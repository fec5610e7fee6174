"""Hidden-state and output-logit metrics: massive activations, kurtosis, log Z drift.

References: Sun et al. 2024 (massive activations), Bondarenko et al. 2023
(kurtosis), Wortsman et al. 2023 sec. 3.1.2 (output logit drift, z-loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators
from attnjax._src.stats.inputs import _nonempty, shape_of, _stack_layers
from attnjax._src.stats.results import LayerMean, LogitDrift, MassiveActivations

Array = jnp.ndarray


def _massive_activations(
  hidden, *, abs_threshold: float = 100.0, ratio: float = 1000.0
) -> MassiveActivations:
  """Massive activations and M-Act (Sun et al. 2024; Qiu et al. 2025).

  Definition: an entry ``h`` of a hidden state is massive when ``|h| >
  abs_threshold`` (100) **and** ``|h| > ratio`` (1000) times the median ``|h|``
  of that hidden state, i.e. of the ``[T, D]`` residual-stream output of that
  layer for that sequence. ``M-Act`` is the mean over layers of the largest
  ``|h|`` of the layer (over the batch), as Qiu et al. report it.

  Args:
    hidden: ``[L, B, T, D]`` / ``[B, T, D]`` / list per layer.
    abs_threshold: absolute floor (Sun et al.: 100).
    ratio: multiple of the median (Sun et al.: about 1000).

  Returns:
    :class:`.MassiveActivations`.

  References:
    Sun et al. 2024, "Massive Activations in Large Language Models", sec. 2;
    Qiu et al. 2025, "Gated Attention for LLMs", table 4 (M-Act).
  """
  for name, x in (("abs_threshold", abs_threshold), ("ratio", ratio)):
    validators.check_positive_float(name, x, allow_none=False)
  h = jnp.abs(_stack_layers("hidden", hidden, 3, "[B, T, D]"))
  L, B, T, D = h.shape
  median = jnp.median(jnp.reshape(h, (L, B, T * D)), axis=-1)  # [L, B]
  massive = jnp.logical_and(h > abs_threshold, h > ratio * median[:, :, None, None])
  max_abs = jnp.max(h, axis=(1, 2, 3))
  return MassiveActivations(
    count=jnp.sum(massive, axis=(1, 2, 3)),
    max_abs=max_abs,
    median_abs=median,
    m_act=jnp.mean(max_abs),
  )


massive_activations = jax.jit(_massive_activations, static_argnames=("abs_threshold", "ratio"))
massive_activations.__doc__ = _massive_activations.__doc__


def _kurtosis(hidden) -> LayerMean:
  """Kurtosis of hidden states across the model dim (Bondarenko et al. 2023).

  Definition: for each token's hidden vector ``x`` ``[D]``, the Pearson
  kurtosis ``E[(x - mu)^4] / sigma^4`` (3 for a Gaussian; large when a few
  dims carry outliers); averaged over tokens and the batch per layer. Tokens
  with zero variance have no kurtosis and are left out.

  Args:
    hidden: ``[L, B, T, D]`` / ``[B, T, D]`` / list per layer.

  Returns:
    :class:`.LayerMean`: ``mean`` over layers (scalar) and ``per_layer`` ``[L]``.

  References:
    Bondarenko et al. 2023, "Quantizable Transformers: Removing Outliers by
    Helping Attention Heads Do Nothing" (average kurtosis of activations).
  """
  h = _stack_layers("hidden", hidden, 3, "[B, T, D]")
  centred = h - jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean(centred**2, axis=-1)
  m4 = jnp.mean(centred**4, axis=-1)
  ok = var > 0
  kurt = jnp.where(ok, m4 / jnp.where(ok, var, 1.0) ** 2, 0.0)
  per_layer = jnp.sum(kurt, axis=(1, 2)) / jnp.maximum(
    jnp.sum(ok, axis=(1, 2), dtype=jnp.float32), 1.0
  )
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer)


kurtosis = jax.jit(_kurtosis)
kurtosis.__doc__ = _kurtosis.__doc__


# ---------------------------------------------------------------------------
# Output logits (Wortsman et al. 2023, sec. 3.1.2).


def _output_logit_drift(logits, *, mask=None, z_loss_coef: float = 1e-4) -> LogitDrift:
  """Output-logit drift ``mean log Z`` and the z-loss value (Wortsman et al. 2023, sec. 3.1.2).

  Definitions: ``log Z = logsumexp_v y_v`` of each token's output logits;
  ``mean_log_z`` is its mean over tokens; ``z_loss = coef * mean(log^2 Z)``
  (PaLM's auxiliary loss, coef 1e-4). Without z-loss or weight decay,
  Wortsman et al. see ``log Z`` drift strongly negative at high LR.

  Args:
    logits: ``[..., V]`` output logits (e.g. ``[B, T, V]``).
    mask: optional boolean ``[...]`` (the logits' shape without ``V``): True =
      count this token.
    z_loss_coef: the z-loss coefficient (>= 0).

  Returns:
    :class:`.LogitDrift` of scalars (0 when no token is counted).

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1.2; Chowdhery et al. 2022 (PaLM), z-loss.
  """
  if np.ndim(logits) < 1:
    raise ValueError(f"logits must have rank >= 1 [..., V], got shape {shape_of(logits)}")
  validators.check_floating("logits", logits)
  _nonempty("logits", logits)
  if isinstance(z_loss_coef, bool) or not isinstance(z_loss_coef, (int, float)) or z_loss_coef < 0:
    raise ValueError(f"z_loss_coef must be a non-negative float, got {z_loss_coef!r}")
  log_z = jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=-1)
  if mask is None:
    keep = jnp.ones(log_z.shape, bool)
  else:
    if shape_of(mask) != log_z.shape:
      raise ValueError(
        f"mask must have the logits' shape without V, {log_z.shape}, got {shape_of(mask)}"
      )
    keep = jnp.asarray(mask, bool)
  count = jnp.maximum(jnp.sum(keep, dtype=jnp.float32), 1.0)
  mean_log_z = jnp.sum(jnp.where(keep, log_z, 0.0)) / count
  mean_sq = jnp.sum(jnp.where(keep, log_z**2, 0.0)) / count
  return LogitDrift(mean_log_z=mean_log_z, z_loss=z_loss_coef * mean_sq)


output_logit_drift = jax.jit(_output_logit_drift, static_argnames=("z_loss_coef",))
output_logit_drift.__doc__ = _output_logit_drift.__doc__
