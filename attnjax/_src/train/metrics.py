"""Run-level metrics over a training run or a learning-rate sweep (host NumPy; no compiling).

Implementation behind the public module :mod:`attnjax.train.metrics`.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators


def _host_1d(name: str, x) -> np.ndarray:
  arr = np.asarray(x, dtype=np.float64)
  if arr.ndim != 1:
    raise ValueError(f"{name} must be a 1-D sequence, got shape {arr.shape}")
  if arr.size == 0:
    raise ValueError(f"{name} is empty")
  return arr


def _sweep_table(learning_rates, final_losses, initial_loss):
  lrs = _host_1d("learning_rates", learning_rates)
  losses = _host_1d("final_losses", final_losses)
  if losses.shape != lrs.shape:
    raise ValueError(
      f"learning_rates {lrs.shape} and final_losses {losses.shape} must have the same length"
    )
  if not np.all(np.isfinite(lrs)) or np.any(lrs <= 0):
    raise ValueError(f"learning_rates must be positive and finite, got {lrs.tolist()}")
  loss_0 = np.asarray(initial_loss, dtype=np.float64)
  if loss_0.ndim == 0:
    loss_0 = np.full(lrs.shape, float(loss_0))
  elif loss_0.shape != lrs.shape:
    raise ValueError(
      f"initial_loss must be a scalar or one per learning rate {lrs.shape}, "
      f"got shape {loss_0.shape}"
    )
  if not np.all(np.isfinite(loss_0)):
    raise ValueError(f"initial_loss must be finite, got {loss_0.tolist()}")
  return lrs, losses, loss_0


def lr_sensitivity(
  learning_rates: Sequence[float],
  final_losses: Sequence[float],
  initial_loss: float | Sequence[float],
) -> float:
  """Learning-rate sensitivity (Wortsman et al. 2023, sec. 2.2).

  Definition: ``E_eta[min(loss(eta), loss_0) - loss*]`` over a grid of learning
  rates, where ``loss(eta)`` is the final loss of the run at peak LR ``eta``,
  ``loss_0`` the loss at initialisation and ``loss*`` the best final loss over
  the grid. The expectation is the mean over the grid points, so the grid
  should be uniform in ``log eta`` (e.g. 3e-4, 1e-3, 3e-3, ...). A run whose
  final loss is NaN or Inf has diverged and counts as ``loss_0``.

  ``loss*`` is the best of the clipped losses ``min(loss(eta), loss_0)``; this
  is the paper's ``loss*`` whenever some run ends below ``loss_0``, and makes a
  model that never learns score 0 (not a negative number). Report the value
  with the loss-vs-LR curve, which tells "stable" from "never learns".

  Args:
    learning_rates: ``[G]`` positive peak LRs.
    final_losses: ``[G]`` final losses (NaN/Inf allowed: diverged).
    initial_loss: ``loss_0``, a scalar or one per LR ``[G]`` (e.g. per seed).

  Returns:
    The sensitivity, a float ``>= 0`` (lower is more robust).

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 2.2.
  """
  _, losses, loss_0 = _sweep_table(learning_rates, final_losses, initial_loss)
  clipped = np.where(np.isfinite(losses), np.minimum(losses, loss_0), loss_0)
  return float(np.mean(clipped - np.min(clipped)))


def max_stable_lr(
  learning_rates: Sequence[float],
  final_losses: Sequence[float],
  initial_loss: float | Sequence[float],
  *,
  diverged: Optional[Sequence[bool]] = None,
) -> Optional[float]:
  """Largest learning rate whose run neither produced NaN/Inf nor ended above ``loss_0``.

  Definition: over the grid, the largest ``eta`` with a
  finite final loss ``<= loss_0`` and, when the train loop recorded it, no
  divergence during the run.

  Args:
    learning_rates: ``[G]`` positive peak LRs.
    final_losses: ``[G]`` final losses (NaN/Inf allowed).
    initial_loss: ``loss_0``, a scalar or ``[G]``.
    diverged: optional ``[G]`` booleans, True where the run stopped as diverged
      (e.g. by :func:`.is_diverged`) even if its last logged loss is finite.

  Returns:
    The LR as a float, or None when no run was stable.
  """
  lrs, losses, loss_0 = _sweep_table(learning_rates, final_losses, initial_loss)
  stable = np.logical_and(np.isfinite(losses), losses <= loss_0)
  if diverged is not None:
    flags = np.asarray(diverged, dtype=bool)
    if flags.shape != lrs.shape:
      raise ValueError(
        f"diverged must have one flag per learning rate {lrs.shape}, got shape {flags.shape}"
      )
    stable = np.logical_and(stable, np.logical_not(flags))
  return float(np.max(lrs[stable])) if np.any(stable) else None


def spike_score(
  series: Sequence[float],
  *,
  window: int = 1000,
  sigmas: float = 7.0,
  min_history: Optional[int] = None,
  two_sided: bool = False,
) -> float:
  """Spike score of a loss or gradient-norm series (OLMo 2, 2025).

  Definition: the percentage of steps whose value lies at least ``sigmas``
  (7) standard deviations above the rolling mean of the previous ``window``
  (1000) values: step ``t`` is a spike when ``x_t - mu_t >= sigmas * sd_t`` and
  ``x_t > mu_t``, with ``mu_t`` and ``sd_t`` (population) over the previous
  ``window`` finite values (``x_{t-window} .. x_{t-1}`` when all are
  finite). ``two_sided=True`` also counts drops ``mu_t - x_t >= sigmas *
  sd_t`` ("away from" the mean).

  First steps: a step is scored only when at least ``min_history`` (default:
  ``window``, i.e. a full window) finite previous values exist; earlier steps
  are neither spikes nor counted in the denominator. Set ``min_history`` lower
  for short runs. Non-finite values are skipped by the rolling statistics; a
  non-finite value at a scored step counts as a spike (the loss blew up).

  Args:
    series: ``[steps]`` values in step order.
    window: rolling window length (>= 2).
    sigmas: threshold in standard deviations (> 0).
    min_history: finite previous values needed to score a step, in
      ``[2, window]``; None means ``window``.
    two_sided: count drops as well as rises.

  Returns:
    Percent of scored steps that are spikes, or NaN when no step could be
    scored (the series is not longer than ``min_history``).

  References:
    OLMo et al. 2025, "2 OLMo 2 Furious", sec. 3 (training stability; spike
    score over the previous 1000 steps).
  """
  x = _host_1d("series", series)
  validators.check_positive_int("window", window, minimum=2)
  min_history = window if min_history is None else min_history
  if (
    isinstance(min_history, bool)
    or not isinstance(min_history, (int, np.integer))
    or not 2 <= min_history <= window
  ):
    raise ValueError(f"min_history must be an int in [2, window={window}], got {min_history!r}")
  validators.check_positive_float("sigmas", sigmas, allow_none=False)
  finite = np.isfinite(x)
  # Rolling sums over the previous `window` finite values: cumulative sums over
  # the finite values only, indexed by how many came before each step. Centred
  # on the median to keep E[x^2] - E[x]^2 well conditioned.
  centre = float(np.median(x[finite])) if np.any(finite) else 0.0
  y = np.where(finite, x - centre, 0.0)
  zero = np.zeros(1)
  c_1 = np.concatenate([zero, np.cumsum(y[finite])])
  c_2 = np.concatenate([zero, np.cumsum(y[finite] ** 2)])
  before = np.concatenate([[0], np.cumsum(finite)[:-1]])  # finite values before step t
  lo = np.maximum(before - window, 0)
  n = (before - lo).astype(np.float64)
  scored = n >= min_history
  if not np.any(scored):
    return float("nan")
  n_safe = np.maximum(n, 1.0)
  mean = (c_1[before] - c_1[lo]) / n_safe
  var = np.maximum((c_2[before] - c_2[lo]) / n_safe - mean * mean, 0.0)
  sd = np.sqrt(var)
  dev = y - mean
  up = np.logical_and(dev > 0, dev >= sigmas * sd)
  if two_sided:
    up = np.logical_or(up, np.logical_and(dev < 0, -dev >= sigmas * sd))
  spike = np.logical_and(scored, np.logical_or(up, np.logical_not(finite)))
  return float(100.0 * np.sum(spike) / np.sum(scored))


def is_diverged(loss, initial_loss, *, factor: float = 2.0):
  """Divergence test for a train loop: NaN/Inf loss, or loss > ``factor`` x the initial loss.

  Not from a paper: a practical stop rule (a diverged run records its LR as
  unstable for :func:`.max_stable_lr`). Works on Python/NumPy numbers (returns
  a NumPy bool) and on JAX arrays, including inside ``jax.jit`` (returns a JAX
  bool), elementwise.

  Args:
    loss: current loss (scalar or array).
    initial_loss: loss at initialisation.
    factor: multiple of ``initial_loss`` above which the run counts as diverged.

  Returns:
    True where diverged.
  """
  validators.check_positive_float("factor", factor, allow_none=False)
  xp = jnp if isinstance(loss, jax.Array) or isinstance(initial_loss, jax.Array) else np
  loss = xp.asarray(loss, dtype=xp.float32 if xp is jnp else np.float64)
  bad = xp.logical_not(xp.isfinite(loss))
  with np.errstate(invalid="ignore"):
    return xp.logical_or(bad, loss > factor * xp.asarray(initial_loss))


def loss_spike_score(losses: Sequence[Optional[float]]) -> Optional[float]:
  """The train loop's :func:`.spike_score` of a per-step loss series, or None when undefined.

  OLMo 2's window is the previous 1000 steps; a shorter run uses all steps so
  far (``window = min(1000, steps - 1)``) and scores each step that has at
  least ``min(window, 50)`` steps of history. ``None`` entries (NaN or Inf
  written as JSON null) are non-finite losses.

  Args:
    losses: the training loss of every step, in order (None = non-finite).

  Returns:
    The percentage of spiking steps, or None for fewer than 3 steps or when no step
    could be scored.
  """
  if len(losses) < 3:
    return None
  values = np.asarray([math.nan if x is None else x for x in losses], np.float64)
  window = max(2, min(1000, len(values) - 1))
  score = spike_score(values, window=window, min_history=min(window, 50))
  return float(score) if math.isfinite(score) else None
