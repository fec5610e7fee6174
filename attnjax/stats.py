"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Every metric of ``EXPERIMENTS.md`` lives here, each docstring naming its source
and stating the definition it computes. The functions work on arrays a
researcher brings from anywhere, on the :class:`~attnjax.AttentionStats` that
attention calls return, and, through :func:`probe`, on a model in one pass.

Layout conventions (letters as ``ARCHITECTURE.md``; ``L`` = layers):

- attention weights or logits ``[L, B, N, T, S]``, or ``[B, N, T, S]`` for one
  layer, or a list of per-layer ``[B, N, T, S]`` arrays;
- ``AttentionStats`` with ``[B, N]`` fields (one layer), ``[L, B, N]`` fields
  (stacked layers) or a list with one per layer;
- queries ``[L, B, T, N, H]``, keys and values ``[L, B, S, K, H]`` (or without
  ``L`` for one layer); hidden states ``[L, B, T, D]`` (or ``[B, T, D]``).

Per-layer results always carry a leading ``L`` axis (``L = 1`` for one layer),
so a probe's output has the same keys for every model. :func:`probe` runs an
``attnjax.nn.TransformerLM`` once under ``nnx.jit`` and returns every statistic
as a flat dict of named arrays (:func:`to_jsonable` makes it JSON); any other
model can fill a :class:`ProbeCapture` and call :func:`probe_statistics`. Attention-level
functions are ``jax.jit``-wrapped with their static choices keyword-only; the
run-level functions (LR sensitivity, spike score, divergence) take small host
tables and run in NumPy, so a train loop can call them without compiling.

Indexing: arrays are 0-indexed. The papers index tokens from 1: the paper's
"first token" / key ``k = 1`` is array index ``0``, and the paper's queries
``i >= 2`` are array rows ``1 .. T-1``. Arguments named after a paper's
symbol (``k`` of ``Sink_k^eps``) use the paper's 1-indexing and say so.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from attnjax import _checks, dense, masks, normalizers
from attnjax import qk_norm as qk_norm_lib
from attnjax.attention_stats import AttentionStats, stats_from_weights
from attnjax.nn.rope import apply_rope
from attnjax.nn.transformer import TransformerLM

Array = jnp.ndarray

# ---------------------------------------------------------------------------
# Result types (NamedTuples: pytrees under jit, dicts through to_jsonable).


class SinkRate(NamedTuple):
  """Result of :func:`sink_rate`.

  Attributes:
    rate: scalar, percent of (layer, head) pairs with ``alpha_k > eps``,
      averaged over the batch (i.e. over all (sequence, layer, head) triples).
    per_layer: ``[L]`` the same percentage per layer.
    importance: ``[L, B, N]`` ``alpha_k`` of every sequence, layer and head.
    row_sum: ``[L]`` mean raw row sum ``sum_j w_ij`` of the weights (before any
      row normalisation): 1 for softmax, ``1 - null mass`` for softmax_one and
      sink logits, anything for sigmoid / softpick / unnormalised scores.
  """

  rate: Array
  per_layer: Array
  importance: Array
  row_sum: Array


class FirstTokenAttention(NamedTuple):
  """Result of :func:`first_token_attention`.

  ``f_attn`` scalar, ``per_layer`` ``[L]``, ``per_head`` ``[L, N]``.
  """

  f_attn: Array
  per_layer: Array
  per_head: Array


class AttentionEntropy(NamedTuple):
  """Result of :func:`attention_entropy`: ``mean``, ``min`` over heads ``[L]``; ``per_head``."""

  mean: Array
  min: Array
  per_head: Array


class QKStatistics(NamedTuple):
  """Result of :func:`qk_statistics`, each ``[L]``."""

  q_rms: Array
  k_rms: Array
  mean_cos: Array
  max_logit: Array


class SinkGeometry(NamedTuple):
  """Result of :func:`sink_geometry`, each ``[L]``.

  Attributes:
    key_norm_ratio: ``||k_1|| / mean_{j >= 2} ||k_j||``.
    value_norm_ratio: ``||v_1|| / mean_{j >= 2} ||v_j||``.
    cos_first_key: mean over queries ``i >= 2`` of ``cos(q_i, k_1)``.
    cos_other_keys: mean over allowed pairs ``(i, j)``, ``j >= 2``, of ``cos(q_i, k_j)``.
  """

  key_norm_ratio: Array
  value_norm_ratio: Array
  cos_first_key: Array
  cos_other_keys: Array


class LayerMean(NamedTuple):
  """A quantity over all layers (``mean``), per layer ``[L]`` and per head ``[L, N]`` if defined."""

  mean: Array
  per_layer: Array
  per_head: Optional[Array] = None


class MassiveActivations(NamedTuple):
  """Result of :func:`massive_activations`.

  Attributes:
    count: ``[L]`` number of massive entries per layer, summed over the batch.
    max_abs: ``[L]`` largest ``|h|`` per layer.
    median_abs: ``[L, B]`` median ``|h|`` of each hidden state.
    m_act: scalar, mean over layers of ``max_abs`` (Qiu et al.'s M-Act).
  """

  count: Array
  max_abs: Array
  median_abs: Array
  m_act: Array


class LogitDrift(NamedTuple):
  """Result of :func:`output_logit_drift`: ``mean_log_z`` and ``z_loss`` (scalars)."""

  mean_log_z: Array
  z_loss: Array


# ---------------------------------------------------------------------------
# Input handling shared by every attention-level metric.


def _shape(x) -> tuple[int, ...]:
  return _checks.shape_of(x)


def _nonempty(name: str, x) -> None:
  if int(np.prod(_shape(x))) == 0:
    raise ValueError(f"{name} is empty (shape {_shape(x)}); statistics need at least one entry")


def _stack_layers(name: str, x, rank: int, letters: str) -> Array:
  """One layer (rank ``rank``), stacked layers (``rank + 1``) or a list -> ``[L, ...]`` float32."""
  if isinstance(x, (list, tuple)):
    if not x:
      raise ValueError(f"{name} is an empty list; pass one {letters} array per layer")
    for i, xi in enumerate(x):
      if np.ndim(xi) != rank:
        raise ValueError(
            f"{name}[{i}] must have rank {rank} {letters}, got shape {_shape(xi)}")
    shapes = {_shape(xi) for xi in x}
    if len(shapes) != 1:
      raise ValueError(f"{name} layers differ in shape: {sorted(shapes)}")
    x = jnp.stack([jnp.asarray(xi) for xi in x])
  else:
    if np.ndim(x) not in (rank, rank + 1):
      raise ValueError(
          f"{name} must have rank {rank} {letters} or {rank + 1} [L, {letters[1:]}, "
          f"got shape {_shape(x)}")
    x = jnp.asarray(x)
    if x.ndim == rank:
      x = x[None]
  _checks.check_floating(name, x)
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
        f"positions), got shape {_shape(w)}")
  return w


def _is_stats(x) -> bool:
  if isinstance(x, AttentionStats):
    return True
  return isinstance(x, (list, tuple)) and len(x) > 0 and all(
      isinstance(s, AttentionStats) for s in x)


def _stats_layers(stats) -> AttentionStats:
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
            f"(stacked layers), got shape {_shape(v)}")
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
        f"pass the attention weights instead")
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
  return AttentionStats(sink_mass=per(s.sink_mass), entropy=per(s.entropy),
                        row_sum=per(s.row_sum))


def _allowed_pairs(target: tuple[int, int, int, int], *, is_causal: bool, window,
                   mask) -> Array:
  """``[B|1, N|1, T, S]`` booleans for ``target = (B, N, T, S)`` from the one mask rule."""
  T, S = target[2], target[3]
  if mask is not None:
    mask = _checks.as_rank4("mask", mask, target, kind="mask")
  allowed = masks.make_attention_mask(T, S, mask=mask, is_causal=is_causal, window=window)
  return jnp.ones((1, 1, T, S), bool) if allowed is None else allowed


def _check_probability(name: str, value: float, *, low: float = 0.0, high: float = 1.0) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
  if not (low <= value <= high):
    raise ValueError(f"{name} must lie in [{low}, {high}], got {value!r}")
  return float(value)


# ---------------------------------------------------------------------------
# Attention sinks (Gu et al. 2024; Qiu et al. 2025).


def _importance(weights: Array, *, row_normalize: bool = True) -> Array:
  """Importance ``alpha_k`` of every key (Gu et al. 2024, sec. 3.1).

  Definition (paper, 1-indexed): ``alpha_k^{l,h} = 1 / (T - k + 1) *
  sum_{i=k}^{T} A^{l,h}_{i,k}``, the mean attention that key ``k`` receives from
  the queries that can see it in causal attention. The divisor is always
  ``T - k + 1`` (as the authors' code divides the column sum), so windowed
  attention, whose early keys leave later queries' view, lowers ``alpha_k``.

  Indexing: entry ``[..., j]`` of the result is the paper's ``alpha_{j+1}``;
  ``[..., 0]`` is the first token's importance ``alpha_1``.

  Args:
    weights: ``[..., T, S]`` attention weights (query, key), e.g.
      ``[L, B, N, T, T]``; float. ``S > T``: keys ``T ..`` are slots appended
      after the sequence (a learned k/v bias); they count in the row
      normalisation and get no ``alpha``.
    row_normalize: use ``|w_ij| / sum_l |w_il|`` (Gu et al. compare normalisers
      whose rows do not sum to one this way); False uses the raw weights.

  Returns:
    ``[..., T]`` float32 ``alpha`` per sequence key.

  References:
    Gu et al. 2024, "When Attention Sink Emerges in Language Models: An
    Empirical View", sec. 3.1, and their ``compute_attention_sink``.
  """
  if np.ndim(weights) < 2:
    raise ValueError(f"weights must have rank >= 2 [..., T, S], got shape {_shape(weights)}")
  _checks.check_floating("weights", weights)
  _nonempty("weights", weights)
  T, S = _shape(weights)[-2:]
  if S < T:
    raise ValueError(f"weights must have S >= T for alpha_k, got shape {_shape(weights)}")
  w = jnp.asarray(weights, jnp.float32)
  p = (_row_normalize(w) if row_normalize else w)[..., :T]  # sequence keys only
  positions = jnp.arange(T)
  queries_see_key = _lift(positions[:, None] >= positions[None, :], p.ndim)  # i >= k
  column = jnp.sum(jnp.where(queries_see_key, p, 0.0), axis=-2)
  return column / _lift((T - positions).astype(jnp.float32), column.ndim)


importance = jax.jit(_importance, static_argnames=("row_normalize",))
importance.__doc__ = _importance.__doc__


def _sink_rate(attention, *, eps: float = 0.3, k: int = 1, row_normalize: bool = True) -> SinkRate:
  """Attention-sink rate ``Sink_k^eps`` (Gu et al. 2024, sec. 3.1).

  Definition: ``Sink_k^eps = 1/L sum_l 1/H sum_h 1[alpha_k^{l,h} > eps]``, in
  percent, with ``alpha_k`` from :func:`importance`. As in the authors' code,
  the indicator is taken per sequence and averaged over the batch (not
  thresholded on a batch-mean ``alpha``). Defaults are the paper's: ``eps =
  0.3``, ``k = 1`` (first token), probe sequences of length 64.

  For normalisers whose rows do not sum to one, ``alpha`` is measured on
  row-normalised weights ``|w_ij| / sum_l |w_il|`` (``row_normalize=True``) and
  the raw mean row sum is reported beside it in ``row_sum``.

  From ``AttentionStats`` (only ``k = 1``): ``alpha_1 = (p_{1,1} + (T - 1) *
  sink_mass) / T``, where ``sink_mass`` is the mean first-key weight over
  queries ``i >= 2`` and ``p_{1,1} = 1`` because in causal attention the first
  query sees only the first key. That holds for every normaliser once rows are
  normalised, except a softpick first row whose only logit is ``<= 0`` (all
  zero; the formula then overstates ``alpha_1`` by ``1/T``) and a layer with an
  appended k/v bias slot (the first row shares its mass with it): pass the
  weights for those. ``T`` comes from ``logsumexp``. The stats are always
  row-normalised.

  Args:
    attention: weights ``[L, B, N, T, S]`` / ``[B, N, T, S]`` / list per layer
      (``S >= T``, see :func:`importance`), or ``AttentionStats`` (one, stacked
      or a list per layer).
    eps: threshold on ``alpha_k``, in ``[0, 1]``.
    k: key index, **1-indexed as in the paper** (``k = 1`` is the first token).
    row_normalize: see above (weights only).

  Returns:
    :class:`SinkRate` (percentages in ``[0, 100]``).

  References:
    Gu et al. 2024, "When Attention Sink Emerges in Language Models: An
    Empirical View" (ICLR 2025), sec. 3.1.
  """
  eps = _check_probability("eps", eps)
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k is the paper's 1-indexed key (k = 1 is the first token), got {k!r}")
  if _is_stats(attention):
    if k != 1:
      raise ValueError(f"AttentionStats only carry the first key's mass; k={k} needs the weights")
    stats = _stats_layers(attention)
    sink_mass = _need(stats, "sink_mass", "sink_rate")
    T = _need(stats, "logsumexp", "sink_rate (for the sequence length T)").shape[-1]
    alpha = (1.0 + (T - 1) * sink_mass) / T
    row_sum = _need(stats, "row_sum", "sink_rate")
    row_sum = jnp.mean(row_sum, axis=(1, 2))
  else:
    w = _attention_layers("attention", attention)
    T = w.shape[-2]
    if k > T:
      raise ValueError(f"k={k} exceeds the sequence length T={T} (weights shape {_shape(w)})")
    alpha = _importance(w, row_normalize=row_normalize)[..., k - 1]
    row_sum = jnp.mean(jnp.sum(w, axis=-1), axis=(1, 2, 3))
  sink = (alpha > eps).astype(jnp.float32)
  return SinkRate(rate=100.0 * jnp.mean(sink), per_layer=100.0 * jnp.mean(sink, axis=(1, 2)),
                  importance=alpha, row_sum=row_sum)


sink_rate = jax.jit(_sink_rate, static_argnames=("eps", "k", "row_normalize"))
sink_rate.__doc__ = _sink_rate.__doc__


def _first_token_attention(attention) -> FirstTokenAttention:
  """First-token attention F-Attn (Qiu et al. 2025, table 4).

  Definition: ``F-Attn = mean over layers l, heads h and queries i >= 2
  (1-indexed) of A^{l,h}_{i,1}``, averaged over the batch. The first query is
  left out because causally it can only attend to the first token.

  Weights are row-normalised (``|w_ij| / sum_l |w_il|``; unchanged for
  softmax), and a row whose weights are all zero (a softpick row with no
  positive logit, a padded query) is left out of the mean, exactly as
  ``AttentionStats.sink_mass`` is defined: from weights this function runs
  that same statistics path, and from stats it averages ``sink_mass``.

  Args:
    attention: weights ``[L, B, N, T, T]`` / ``[B, N, T, T]`` / list per layer,
      or ``AttentionStats``.

  Returns:
    :class:`FirstTokenAttention`: ``f_attn`` scalar, ``per_layer`` ``[L]``,
    ``per_head`` ``[L, N]`` (each a mean over the batch).

  References:
    Qiu et al. 2025, "Gated Attention for Large Language Models:
    Non-linearity, Sparsity, and Attention-Sink-Free", table 4.
  """
  if _is_stats(attention):
    sink_mass = _need(_stats_layers(attention), "sink_mass", "first_token_attention")
  else:
    sink_mass = _weights_as_stats(_attention_layers("attention", attention)).sink_mass
  per_head = jnp.mean(sink_mass, axis=1)
  return FirstTokenAttention(f_attn=jnp.mean(per_head), per_layer=jnp.mean(per_head, axis=1),
                             per_head=per_head)


first_token_attention = jax.jit(_first_token_attention)
first_token_attention.__doc__ = _first_token_attention.__doc__


def _attention_entropy(attention) -> AttentionEntropy:
  """Attention entropy per layer: mean and min over heads (Zhai et al. 2023).

  Definition: ``H_i = -sum_j p_ij log p_ij`` of each query row on row-normalised
  weights (all-zero rows left out), averaged over queries and the batch to one
  value per head; then the mean and the min over heads of each layer. A
  collapsing head (Zhai et al.'s "entropy collapse") shows in ``min``. Same
  path as ``AttentionStats.entropy``.

  Args:
    attention: weights ``[L, B, N, T, S]`` (any ``S``) / ``[B, N, T, S]`` /
      list per layer, or ``AttentionStats``.

  Returns:
    :class:`AttentionEntropy` in nats: ``mean`` ``[L]``, ``min`` ``[L]``,
    ``per_head`` ``[L, N]``.

  References:
    Zhai et al. 2023, "Stabilizing Transformer Training by Preventing
    Attention Entropy Collapse".
  """
  if _is_stats(attention):
    entropy = _need(_stats_layers(attention), "entropy", "attention_entropy")
  else:
    w = _stack_layers("attention", attention, 4, "[B, N, T, S]")
    entropy = _weights_as_stats(w).entropy
  per_head = jnp.mean(entropy, axis=1)
  return AttentionEntropy(mean=jnp.mean(per_head, axis=1), min=jnp.min(per_head, axis=1),
                          per_head=per_head)


attention_entropy = jax.jit(_attention_entropy)
attention_entropy.__doc__ = _attention_entropy.__doc__


def _max_attention_logit(attention, *, is_causal: bool = True, window=None, mask=None) -> Array:
  """Maximum attention logit per layer (Wortsman et al. 2023, sec. 3.1).

  Definition: ``max over heads, batch and allowed (i, j) of z_ij``, the logit
  the normaliser sees. Wortsman et al. found that every run whose max logit
  passed about 1e4 diverged.

  Args:
    attention: logits ``[L, B, N, T, S]`` / ``[B, N, T, S]`` / list per layer
      (the mask arguments select the allowed pairs), or ``AttentionStats``
      (whose ``max_logit`` is already over allowed pairs).
    is_causal: logits only: query ``i`` sees keys ``j <= i``.
    window: logits only: ``(left, right)`` local window.
    mask: logits only: boolean, True = may attend, broadcastable to
      ``[B, N, T, S]``.

  Returns:
    ``[L]`` float32. A layer with no allowed pair gives 0.

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1.
  """
  if _is_stats(attention):
    return jnp.max(_need(_stats_layers(attention), "max_logit", "max_attention_logit"),
                   axis=(1, 2))
  z = _stack_layers("attention", attention, 4, "[B, N, T, S]")
  window = _checks.check_window(window)
  allowed = _allowed_pairs(z.shape[1:], is_causal=is_causal, window=window, mask=mask)
  zmax = jnp.max(jnp.where(allowed[None], z, -jnp.inf), axis=(1, 2, 3, 4))
  return jnp.where(jnp.isfinite(zmax), zmax, 0.0)


max_attention_logit = jax.jit(_max_attention_logit, static_argnames=("is_causal", "window"))
max_attention_logit.__doc__ = _max_attention_logit.__doc__


def _null_mass(attention, sink_logits=None, *, is_causal: bool = True, window=None,
               mask=None) -> LayerMean:
  """Null (sink-logit) mass: attention the normaliser sends nowhere.

  Definition: for a learned per-head sink logit ``s_h`` (gpt-oss), the null
  column takes ``e^{s_h} / (e^{s_h} + sum_j e^{z_ij})`` of each row;
  softmax_one (Miller 2023) is ``s_h = 0``. Averaged over query rows with at
  least one allowed key and over the batch.

  From ``AttentionStats`` this is ``1 - row_sum`` (its ``row_sum`` is the mean
  raw row sum, ``1 -`` the null mass for softmax_one and sink logits; for other
  normalisers ``1 - row_sum`` is only the deficit from a sum of one).

  Args:
    attention: logits ``[L, B, N, T, S]`` / ``[B, N, T, S]`` / list per layer,
      or ``AttentionStats``.
    sink_logits: logits only: ``[L, N]``, ``[N]`` or a scalar (0 for
      softmax_one).
    is_causal, window, mask: logits only: which pairs are allowed.

  Returns:
    :class:`LayerMean`: ``mean`` scalar, ``per_layer`` ``[L]``, ``per_head``
    ``[L, N]``.

  References:
    OpenAI 2025, gpt-oss model card (learned attention sinks); Miller 2023,
    "Attention Is Off By One".
  """
  if _is_stats(attention):
    per_head = 1.0 - jnp.mean(_need(_stats_layers(attention), "row_sum", "null_mass"), axis=1)
  else:
    z = _stack_layers("attention", attention, 4, "[B, N, T, S]")
    L, B, N, T, S = z.shape
    if sink_logits is None:
      raise ValueError("null_mass on logits needs sink_logits ([L, N], [N] or scalar; 0 for "
                       "softmax_one)")
    _checks.check_floating("sink_logits", sink_logits)
    s = jnp.asarray(sink_logits, jnp.float32)
    if _shape(s) not in ((), (N,), (L, N)):
      raise ValueError(f"sink_logits must have shape (), [N] = ({N},) or [L, N] = ({L}, {N}), "
                       f"got {_shape(s)}")
    s = jnp.reshape(jnp.broadcast_to(s, (L, N)), (L, 1, N, 1))
    window = _checks.check_window(window)
    allowed = _allowed_pairs((B, N, T, S), is_causal=is_causal, window=window, mask=mask)[None]
    lse_keys = jax.nn.logsumexp(jnp.where(allowed, z, -jnp.inf), axis=-1)  # [L, B, N, T]
    null = jnp.exp(s - jnp.logaddexp(s, lse_keys))
    has_key = jnp.broadcast_to(jnp.any(allowed, axis=-1), null.shape)
    count = jnp.sum(has_key, axis=(1, 3), dtype=jnp.float32)
    per_head = jnp.sum(jnp.where(has_key, null, 0.0), axis=(1, 3)) / jnp.maximum(count, 1.0)
  per_layer = jnp.mean(per_head, axis=1)
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


null_mass = jax.jit(_null_mass, static_argnames=("is_causal", "window"))
null_mass.__doc__ = _null_mass.__doc__


def _gate_mass(gates, *, from_logits: bool = False) -> LayerMean:
  """Mean output-gate value (Qiu et al. 2025).

  Definition: the mean over batch, tokens, heads and gated dims of the
  sigmoid gate ``sigmoid(x W_g)`` that multiplies each head's attention output
  (elementwise ``[.., Hg = H]`` or headwise ``[.., Hg = 1]``). Qiu et al. report
  sparse gates (low mean) together with the disappearance of sinks.

  Args:
    gates: ``[L, B, T, N, Hg]`` / ``[B, T, N, Hg]`` / list per layer: the gate
      values in ``[0, 1]``, or their logits with ``from_logits=True``.
    from_logits: apply the sigmoid first.

  Returns:
    :class:`LayerMean`: ``mean`` scalar, ``per_layer`` ``[L]``, ``per_head``
    ``[L, N]``.

  References:
    Qiu et al. 2025, "Gated Attention for Large Language Models", sec. 4.
  """
  g = _stack_layers("gates", gates, 4, "[B, T, N, Hg]")
  if from_logits:
    g = jax.nn.sigmoid(g)
  per_head = jnp.mean(g, axis=(1, 2, 4))
  per_layer = jnp.mean(per_head, axis=1)
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


gate_mass = jax.jit(_gate_mass, static_argnames=("from_logits",))
gate_mass.__doc__ = _gate_mass.__doc__


def _attention_sparsity(weights, *, threshold: float = 0.01, is_causal: bool = True,
                        window=None, mask=None) -> LayerMean:
  """Attention sparsity: fraction of allowed weights below ``threshold`` x the row maximum.

  Definition (Zhang et al. 2023, H2O, sec. 3.1): an allowed entry ``(i, j)`` is
  sparse when ``|w_ij| < threshold * max_l |w_il|`` (``threshold = 1%``); the
  sparsity is the fraction of allowed entries that are sparse, over rows whose
  maximum is positive, pooled over batch and queries per head. Relative to the
  row maximum, so it needs no row normalisation and compares normalisers.

  Args:
    weights: ``[L, B, N, T, S]`` / ``[B, N, T, S]`` / list per layer.
    threshold: fraction of the row maximum, in ``[0, 1]``.
    is_causal, window, mask: which entries are allowed (masked entries of
      materialised weights are zero and must not count as sparse).

  Returns:
    :class:`LayerMean` of fractions in ``[0, 1]``: ``mean`` scalar,
    ``per_layer`` ``[L]``, ``per_head`` ``[L, N]``.

  References:
    Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
    Inference of Large Language Models", sec. 3.1 ("sparse" = below 1% of the
    row's maximum).
  """
  threshold = _check_probability("threshold", threshold)
  w = jnp.abs(_stack_layers("weights", weights, 4, "[B, N, T, S]"))
  window = _checks.check_window(window)
  allowed = jnp.broadcast_to(
      _allowed_pairs(w.shape[1:], is_causal=is_causal, window=window, mask=mask)[None],
      w.shape)
  row_max = jnp.max(jnp.where(allowed, w, 0.0), axis=-1, keepdims=True)
  counted = jnp.logical_and(allowed, row_max > 0)
  sparse = jnp.logical_and(counted, w < threshold * row_max)
  per_head = (jnp.sum(sparse, axis=(1, 3, 4), dtype=jnp.float32)
              / jnp.maximum(jnp.sum(counted, axis=(1, 3, 4), dtype=jnp.float32), 1.0))
  per_layer = jnp.mean(per_head, axis=1)
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


attention_sparsity = jax.jit(_attention_sparsity,
                             static_argnames=("threshold", "is_causal", "window"))
attention_sparsity.__doc__ = _attention_sparsity.__doc__


# ---------------------------------------------------------------------------
# Query/key geometry (Wortsman et al. 2023; Gu et al. 2024).


def _qkv_layers(q, k, v=None):
  q = _stack_layers("q", q, 4, "[B, T, N, H]")
  k = _stack_layers("k", k, 4, "[B, S, K, H]")
  if v is not None:
    v = _stack_layers("v", v, 4, "[B, S, K, Hv]")
    if v.shape[:4] != k.shape[:4]:
      raise ValueError(f"k and v must agree on [L, B, S, K], got k {_shape(k)} and v {_shape(v)}")
  L, B, T, N, H = q.shape
  if k.shape[0] != L or k.shape[1] != B or k.shape[4] != H:
    raise ValueError(f"q [L, B, T, N, H] and k [L, B, S, K, H] disagree: q {_shape(q)}, "
                     f"k {_shape(k)}")
  if N % k.shape[3] != 0:
    raise ValueError(f"query heads N={N} must be a multiple of key heads K={k.shape[3]} "
                     f"(q {_shape(q)}, k {_shape(k)})")
  return q, k, v


def _unit(x: Array) -> Array:
  norm = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
  return x / jnp.where(norm > 0, norm, 1.0)


def _pair_cosines(q: Array, k: Array) -> Array:
  """``cos(q_i, k_j)`` ``[L, B, N, T, S]`` through the dense path's grouped scores."""
  L, B, T, N, H = q.shape
  S, K = k.shape[2], k.shape[3]
  qu = jnp.reshape(_unit(q), (L * B, T, N, H))
  ku = jnp.reshape(_unit(k), (L * B, S, K, H))
  cos = dense.scores(dense.group_queries(qu, K), ku, scale=1.0)  # [L*B, K, G, T, S]
  return jnp.reshape(cos, (L, B, N, T, S))


def _qk_statistics(q, k, *, scale: Optional[float] = None, is_causal: bool = True,
                   window=None, mask=None) -> QKStatistics:
  """RMS of queries and keys, mean ``cos(q_i, k_j)`` and max logit (Wortsman et al. 2023).

  Definitions, per layer: ``q_rms = sqrt(mean q^2)`` over batch, tokens, heads
  and head dims (likewise ``k_rms``); ``mean_cos`` = mean over the batch, query
  heads and allowed pairs ``(i, j)`` of ``cos(q_i, k_j)``; ``max_logit`` = max
  over the same of ``scale * <q_i, k_j>``. Wortsman et al. show the logit
  growth behind divergence comes from the norms, not the alignment: large
  ``q_rms * k_rms`` with a modest ``mean_cos``.

  Args:
    q: ``[L, B, T, N, H]`` / ``[B, T, N, H]`` / list per layer (as the
      attention function saw them, after any norm and RoPE).
    k: ``[L, B, S, K, H]`` / ``[B, S, K, H]``; ``N % K == 0`` (GQA).
    scale: logit scale; None means ``H ** -0.5``. (The max logit of a model
      with temperature, softcap or bias is best read from ``AttentionStats``
      with :func:`max_attention_logit`.)
    is_causal, window, mask: which pairs are allowed.

  Returns:
    :class:`QKStatistics`, each ``[L]``.

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1 (attention logit growth).
  """
  q, k, _ = _qkv_layers(q, k)
  H = q.shape[-1]
  scale = H ** -0.5 if scale is None else _checks.check_positive_float("scale", scale)
  window = _checks.check_window(window)
  L, B, T, N, _ = q.shape
  allowed = _allowed_pairs((B, N, T, k.shape[2]), is_causal=is_causal, window=window,
                           mask=mask)[None]
  cos = _pair_cosines(q, k)
  allowed = jnp.broadcast_to(allowed, cos.shape)
  count = jnp.sum(allowed, axis=(1, 2, 3, 4), dtype=jnp.float32)
  mean_cos = jnp.sum(jnp.where(allowed, cos, 0.0), axis=(1, 2, 3, 4)) / jnp.maximum(count, 1.0)
  K = k.shape[3]
  z = dense.scores(dense.group_queries(jnp.reshape(q, (L * B, T, N, H)), K),
                   jnp.reshape(k, (L * B, k.shape[2], K, H)), scale=scale)
  z = jnp.reshape(z, cos.shape)
  zmax = jnp.max(jnp.where(allowed, z, -jnp.inf), axis=(1, 2, 3, 4))
  rms = lambda x: jnp.sqrt(jnp.mean(x * x, axis=(1, 2, 3, 4)))
  return QKStatistics(q_rms=rms(q), k_rms=rms(k), mean_cos=mean_cos,
                      max_logit=jnp.where(jnp.isfinite(zmax), zmax, 0.0))


qk_statistics = jax.jit(_qk_statistics, static_argnames=("scale", "is_causal", "window"))
qk_statistics.__doc__ = _qk_statistics.__doc__


def _sink_geometry(q, k, v, *, is_causal: bool = True, window=None, mask=None) -> SinkGeometry:
  """Geometry of the first token's key and value (Gu et al. 2024, sec. 3).

  Definitions, per layer, averaged over the batch and heads (1-indexed tokens;
  ``j >= 2`` = every key but the first):

  - ``key_norm_ratio = ||k_1|| / mean_{j >= 2} ||k_j||`` per (sequence, kv head);
  - ``value_norm_ratio = ||v_1|| / mean_{j >= 2} ||v_j||``;
  - ``cos_first_key`` = mean over queries ``i >= 2`` allowed to see key 1 of
    ``cos(q_i, k_1)``;
  - ``cos_other_keys`` = mean over allowed pairs ``(i, j)``, ``j >= 2``, of
    ``cos(q_i, k_j)``.

  Gu et al. find the sink works as a key bias: ``k_1`` is aligned with the
  queries (``cos_first_key`` well above ``cos_other_keys``) while ``||k_1||``
  is not large and ``||v_1||`` is small, so the sink stores attention without
  adding much to the output.

  Args:
    q: ``[L, B, T, N, H]`` / ``[B, T, N, H]`` / list per layer.
    k: ``[L, B, S, K, H]`` / ``[B, S, K, H]``, ``S >= 2``.
    v: ``[L, B, S, K, Hv]`` / ``[B, S, K, Hv]``.
    is_causal, window, mask: which pairs are allowed.

  Returns:
    :class:`SinkGeometry`, each ``[L]``.

  References:
    Gu et al. 2024, "When Attention Sink Emerges in Language Models: An
    Empirical View", sec. 3 (the first token acts as a key bias).
  """
  q, k, v = _qkv_layers(q, k, v)
  S = k.shape[2]
  if S < 2:
    raise ValueError(f"sink geometry compares the first key with the others: needs S >= 2, "
                     f"got k {_shape(k)}")

  def norm_ratio(x):
    norms = jnp.sqrt(jnp.sum(x * x, axis=-1))  # [L, B, S, K]
    others = jnp.mean(norms[:, :, 1:], axis=2)
    ratio = norms[:, :, 0] / jnp.where(others > 0, others, 1.0)
    return jnp.mean(ratio, axis=(1, 2))

  window = _checks.check_window(window)
  _, B, T, N, _ = q.shape
  cos = _pair_cosines(q, k)
  allowed = jnp.broadcast_to(
      _allowed_pairs((B, N, T, S), is_causal=is_causal, window=window, mask=mask)[None],
      cos.shape)
  later_query = _lift((jnp.arange(T) >= 1)[:, None], cos.ndim)
  first_key = _lift((jnp.arange(S) == 0)[None, :], cos.ndim)
  sel_first = jnp.logical_and(allowed, jnp.logical_and(later_query, first_key))
  sel_other = jnp.logical_and(allowed, jnp.logical_not(first_key))

  def masked_mean(sel):
    count = jnp.sum(sel, axis=(1, 2, 3, 4), dtype=jnp.float32)
    return jnp.sum(jnp.where(sel, cos, 0.0), axis=(1, 2, 3, 4)) / jnp.maximum(count, 1.0)

  return SinkGeometry(key_norm_ratio=norm_ratio(k), value_norm_ratio=norm_ratio(v),
                      cos_first_key=masked_mean(sel_first),
                      cos_other_keys=masked_mean(sel_other))


sink_geometry = jax.jit(_sink_geometry, static_argnames=("is_causal", "window"))
sink_geometry.__doc__ = _sink_geometry.__doc__


# ---------------------------------------------------------------------------
# Hidden states (Sun et al. 2024; Bondarenko et al. 2023).


def _massive_activations(hidden, *, abs_threshold: float = 100.0,
                         ratio: float = 1000.0) -> MassiveActivations:
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
    :class:`MassiveActivations`.

  References:
    Sun et al. 2024, "Massive Activations in Large Language Models", sec. 2;
    Qiu et al. 2025, "Gated Attention for LLMs", table 4 (M-Act).
  """
  for name, x in (("abs_threshold", abs_threshold), ("ratio", ratio)):
    _checks.check_positive_float(name, x, allow_none=False)
  h = jnp.abs(_stack_layers("hidden", hidden, 3, "[B, T, D]"))
  L, B, T, D = h.shape
  median = jnp.median(jnp.reshape(h, (L, B, T * D)), axis=-1)  # [L, B]
  massive = jnp.logical_and(h > abs_threshold, h > ratio * median[:, :, None, None])
  max_abs = jnp.max(h, axis=(1, 2, 3))
  return MassiveActivations(count=jnp.sum(massive, axis=(1, 2, 3)), max_abs=max_abs,
                            median_abs=median, m_act=jnp.mean(max_abs))


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
    :class:`LayerMean`: ``mean`` over layers (scalar) and ``per_layer`` ``[L]``.

  References:
    Bondarenko et al. 2023, "Quantizable Transformers: Removing Outliers by
    Helping Attention Heads Do Nothing" (average kurtosis of activations).
  """
  h = _stack_layers("hidden", hidden, 3, "[B, T, D]")
  centred = h - jnp.mean(h, axis=-1, keepdims=True)
  var = jnp.mean(centred ** 2, axis=-1)
  m4 = jnp.mean(centred ** 4, axis=-1)
  ok = var > 0
  kurt = jnp.where(ok, m4 / jnp.where(ok, var, 1.0) ** 2, 0.0)
  per_layer = jnp.sum(kurt, axis=(1, 2)) / jnp.maximum(jnp.sum(ok, axis=(1, 2), dtype=jnp.float32),
                                                       1.0)
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
    :class:`LogitDrift` of scalars (0 when no token is counted).

  References:
    Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
    training instabilities", sec. 3.1.2; Chowdhery et al. 2022 (PaLM), z-loss.
  """
  if np.ndim(logits) < 1:
    raise ValueError(f"logits must have rank >= 1 [..., V], got shape {_shape(logits)}")
  _checks.check_floating("logits", logits)
  _nonempty("logits", logits)
  if isinstance(z_loss_coef, bool) or not isinstance(z_loss_coef, (int, float)) or z_loss_coef < 0:
    raise ValueError(f"z_loss_coef must be a non-negative float, got {z_loss_coef!r}")
  log_z = jax.nn.logsumexp(jnp.asarray(logits, jnp.float32), axis=-1)
  if mask is None:
    keep = jnp.ones(log_z.shape, bool)
  else:
    if _shape(mask) != log_z.shape:
      raise ValueError(f"mask must have the logits' shape without V, {log_z.shape}, "
                       f"got {_shape(mask)}")
    keep = jnp.asarray(mask, bool)
  count = jnp.maximum(jnp.sum(keep, dtype=jnp.float32), 1.0)
  mean_log_z = jnp.sum(jnp.where(keep, log_z, 0.0)) / count
  mean_sq = jnp.sum(jnp.where(keep, log_z ** 2, 0.0)) / count
  return LogitDrift(mean_log_z=mean_log_z, z_loss=z_loss_coef * mean_sq)


output_logit_drift = jax.jit(_output_logit_drift, static_argnames=("z_loss_coef",))
output_logit_drift.__doc__ = _output_logit_drift.__doc__


# ---------------------------------------------------------------------------
# Kernel approximation (Choromanski et al. 2021).


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
      raise ValueError(f"{name} must have rank >= 2 [..., T, S], got shape {_shape(x)}")
    _checks.check_floating(name, x)
    _nonempty(name, x)
  if _shape(approx_weights) != _shape(exact_weights):
    raise ValueError(f"approx_weights {_shape(approx_weights)} and exact_weights "
                     f"{_shape(exact_weights)} must have the same shape")
  a = jnp.asarray(exact_weights, jnp.float32)
  diff = jnp.asarray(approx_weights, jnp.float32) - a
  num = jnp.sqrt(jnp.sum(diff * diff, axis=(-2, -1)))
  den = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1)))
  return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0),
                   jnp.where(num > 0, jnp.inf, 0.0))


kernel_approximation_error = jax.jit(_kernel_approximation_error)
kernel_approximation_error.__doc__ = _kernel_approximation_error.__doc__


def _features(feature_map, x: Array, *, is_query: bool) -> Array:
  """``phi(x)`` float32; passes ``is_query`` to maps that take it (``attnjax.feature_maps``)."""
  try:
    params = inspect.signature(feature_map).parameters
  except (TypeError, ValueError):
    params = {}
  takes_role = "is_query" in params or any(
      p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
  phi = feature_map(x, is_query=is_query) if takes_role else feature_map(x)
  return jnp.asarray(phi, jnp.float32)


def _feature_map_error(q, k, feature_map, *, is_causal: bool, scale: Optional[float]) -> Array:
  B, T, S, N, K, H, _ = _checks.check_qkv(q, k, k)
  scale = H ** -0.5 if scale is None else _checks.check_positive_float("scale", scale)
  allowed = _allowed_pairs((B, N, T, S), is_causal=is_causal, window=None, mask=None)
  z = jnp.reshape(dense.scores(dense.group_queries(q, K), k, scale=scale), (B, N, T, S))
  exact, _ = normalizers.normalize(z, allowed, normalizer="softmax")
  phi_q = _features(feature_map, q.astype(jnp.float32), is_query=True)
  phi_k = _features(feature_map, k.astype(jnp.float32), is_query=False)
  kernel = jnp.reshape(dense.scores(dense.group_queries(phi_q, K), phi_k, scale=1.0),
                       (B, N, T, S))
  kernel = jnp.where(allowed, kernel, 0.0)
  denom = jnp.sum(kernel, axis=-1, keepdims=True)
  approx = jnp.where(denom != 0, kernel / jnp.where(denom != 0, denom, 1.0), 0.0)
  return _kernel_approximation_error(approx, exact)


# A map carrying arrays (a random projection) is a traced argument, so redrawing
# features does not recompile; a plain function is a static argument.
_feature_map_error_traced = jax.jit(_feature_map_error, static_argnames=("is_causal", "scale"))
_feature_map_error_static = jax.jit(_feature_map_error,
                                    static_argnames=("feature_map", "is_causal", "scale"))


def feature_map_attention_error(q, k, *, feature_map: Callable[..., Array],
                                is_causal: bool = True, scale: Optional[float] = None) -> Array:
  """Relative error of kernel-feature attention against exact softmax attention.

  Builds ``A`` = softmax of ``scale * <q_i, k_j>`` (the dense reference path and
  normaliser table) and ``A_hat_ij = phi(q_i).phi(k_j) / sum_l phi(q_i).phi(k_l)``
  over the same allowed keys, then returns
  :func:`kernel_approximation_error` per (batch, head). ``feature_map`` must
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


# ---------------------------------------------------------------------------
# Run level: learning-rate sweeps, spikes, divergence (host NumPy).


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
    raise ValueError(f"learning_rates {lrs.shape} and final_losses {losses.shape} must have "
                     f"the same length")
  if not np.all(np.isfinite(lrs)) or np.any(lrs <= 0):
    raise ValueError(f"learning_rates must be positive and finite, got {lrs.tolist()}")
  loss_0 = np.asarray(initial_loss, dtype=np.float64)
  if loss_0.ndim == 0:
    loss_0 = np.full(lrs.shape, float(loss_0))
  elif loss_0.shape != lrs.shape:
    raise ValueError(f"initial_loss must be a scalar or one per learning rate {lrs.shape}, "
                     f"got shape {loss_0.shape}")
  if not np.all(np.isfinite(loss_0)):
    raise ValueError(f"initial_loss must be finite, got {loss_0.tolist()}")
  return lrs, losses, loss_0


def lr_sensitivity(learning_rates: Sequence[float], final_losses: Sequence[float],
                   initial_loss: float | Sequence[float]) -> float:
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


def max_stable_lr(learning_rates: Sequence[float], final_losses: Sequence[float],
                  initial_loss: float | Sequence[float], *,
                  diverged: Optional[Sequence[bool]] = None) -> Optional[float]:
  """Largest learning rate whose run neither produced NaN/Inf nor ended above ``loss_0``.

  Definition (``EXPERIMENTS.md``): over the grid, the largest ``eta`` with a
  finite final loss ``<= loss_0`` and, when the train loop recorded it, no
  divergence during the run.

  Args:
    learning_rates: ``[G]`` positive peak LRs.
    final_losses: ``[G]`` final losses (NaN/Inf allowed).
    initial_loss: ``loss_0``, a scalar or ``[G]``.
    diverged: optional ``[G]`` booleans, True where the run stopped as diverged
      (e.g. by :func:`is_diverged`) even if its last logged loss is finite.

  Returns:
    The LR as a float, or None when no run was stable.
  """
  lrs, losses, loss_0 = _sweep_table(learning_rates, final_losses, initial_loss)
  stable = np.logical_and(np.isfinite(losses), losses <= loss_0)
  if diverged is not None:
    flags = np.asarray(diverged, dtype=bool)
    if flags.shape != lrs.shape:
      raise ValueError(f"diverged must have one flag per learning rate {lrs.shape}, "
                       f"got shape {flags.shape}")
    stable = np.logical_and(stable, np.logical_not(flags))
  return float(np.max(lrs[stable])) if np.any(stable) else None


def spike_score(series: Sequence[float], *, window: int = 1000, sigmas: float = 7.0,
                min_history: Optional[int] = None, two_sided: bool = False) -> float:
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
  if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 2:
    raise ValueError(f"window must be an int >= 2, got {window!r}")
  min_history = window if min_history is None else min_history
  if (isinstance(min_history, bool) or not isinstance(min_history, (int, np.integer))
      or not 2 <= min_history <= window):
    raise ValueError(f"min_history must be an int in [2, window={window}], got {min_history!r}")
  _checks.check_positive_float("sigmas", sigmas, allow_none=False)
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
  unstable for :func:`max_stable_lr`). Works on Python/NumPy numbers (returns
  a NumPy bool) and on JAX arrays, including inside ``jax.jit`` (returns a JAX
  bool), elementwise.

  Args:
    loss: current loss (scalar or array).
    initial_loss: loss at initialisation.
    factor: multiple of ``initial_loss`` above which the run counts as diverged.

  Returns:
    True where diverged.
  """
  _checks.check_positive_float("factor", factor, allow_none=False)
  xp = jnp if isinstance(loss, jax.Array) or isinstance(initial_loss, jax.Array) else np
  loss = xp.asarray(loss, dtype=xp.float32 if xp is jnp else np.float64)
  bad = xp.logical_not(xp.isfinite(loss))
  with np.errstate(invalid="ignore"):
    return xp.logical_or(bad, loss > factor * xp.asarray(initial_loss))


# ---------------------------------------------------------------------------
# Probe: every statistic of one forward pass.


class ProbeCapture(NamedTuple):
  """What one forward pass exposes, stacked over ``L`` layers; None where not available.

  Any model can be probed by filling this in (see :func:`probe_statistics`);
  :func:`probe` fills it from an ``attnjax.nn.TransformerLM``.

  Attributes:
    logits: ``[B, T, V]`` output logits.
    attention_stats: ``AttentionStats`` with ``[L, B, N]`` fields (``logsumexp``
      ``[L, B, N, T]``).
    weights: ``[L, B, N, T, S]`` attention weights, ``S >= T`` (appended k/v
      bias slots last; zero columns pad layers with fewer keys).
    allowed: ``[L, 1, 1, T, S]`` bool, the pairs each layer may attend to;
      None means causal.
    q: ``[L, B, T, N, H]`` queries as the attention function compares them
      (after any QK norm and RoPE).
    k: ``[L, B, T, K, H]`` keys (sequence keys only), likewise.
    v: ``[L, B, T, K, Hv]`` values.
    hidden: ``[L, B, T, D]`` each block's output hidden state.
    gate_mean: ``[L, B, N]`` mean output-gate value; NaN for ungated layers.
    null_column: ``[L]`` bool, True where the normaliser has a null column
      (softmax_one or sink logits), so ``1 - row_sum`` is its null mass.
  """

  logits: Optional[Array] = None
  attention_stats: Optional[AttentionStats] = None
  weights: Optional[Array] = None
  allowed: Optional[Array] = None
  q: Optional[Array] = None
  k: Optional[Array] = None
  v: Optional[Array] = None
  hidden: Optional[Array] = None
  gate_mean: Optional[Array] = None
  null_column: Optional[Array] = None


def _per_layer(fn, L: int, allowed: Optional[Array], *arrays):
  """Runs a per-layer metric layer by layer (each with its own mask) and stacks the results."""
  results = []
  for l in range(L):
    mask = None if allowed is None else allowed[l]
    results.append(fn(*(a[l] for a in arrays), mask=mask))
  # Each result is per layer with L = 1 ([1, ...] arrays); scalars (means over
  # the one layer) stack to [L] and are recomputed by the caller.
  return jax.tree.map(lambda *xs: jnp.stack(xs) if xs[0].ndim == 0 else jnp.concatenate(xs),
                      *results)


def _probe_statistics(capture: ProbeCapture, *, eps: float = 0.3,
                      sparsity_threshold: float = 0.01, z_loss_coef: float = 1e-4,
                      massive_abs: float = 100.0, massive_ratio: float = 1000.0) -> dict:
  """All statistics of one forward pass as a flat dict of named arrays and scalars.

  Keys are ``"<metric>/<field>"`` from this module's functions (per-layer
  arrays ``[L]``, per-head ``[L, N]``, scalars over the model), computed from
  whatever ``capture`` holds:

  - ``output/*``: :func:`output_logit_drift` (logits);
  - ``sink_rate/*``: :func:`sink_rate` (weights if present, else stats), with
    ``sink_rate/importance`` averaged over the batch to ``[L, N]``;
  - ``f_attn/*``, ``entropy/*``: :func:`first_token_attention`,
    :func:`attention_entropy` (stats if present, else weights);
  - ``max_logit``: :func:`max_attention_logit` ``[L]`` (stats);
  - ``null_mass/*``: ``1 - row_sum`` where ``null_column``, else 0 (stats);
  - ``sparsity/*``: :func:`attention_sparsity` (weights);
  - ``qk/*``: :func:`qk_statistics` without its max logit (q, k), and
    ``sink_geometry/*``: :func:`sink_geometry` (q, k, v), over each layer's
    allowed pairs. q and k are those the attention compares, so after a QK
    norm their RMS is that of the norm's output (the pre-norm projection RMS
    is in ``attnjax.nn.collect_stats``);
  - ``massive/*``, ``kurtosis/*``: :func:`massive_activations`,
    :func:`kurtosis` (hidden);
  - ``gate/*``: mean gate per head, layer and overall (gate_mean).

  Args:
    capture: a :class:`ProbeCapture`.
    eps: ``Sink_1^eps`` threshold.
    sparsity_threshold: H2O threshold (fraction of the row maximum).
    z_loss_coef: z-loss coefficient for ``output/z_loss``.
    massive_abs, massive_ratio: massive-activation thresholds.

  Returns:
    ``dict[str, Array]``; :func:`to_jsonable` makes it JSON-ready.
  """
  out: dict[str, Any] = {}
  st = None if capture.attention_stats is None else _stats_layers(capture.attention_stats)
  w = capture.weights
  if capture.logits is not None:
    out.update(flatten(_output_logit_drift(capture.logits, z_loss_coef=z_loss_coef), "output"))
  if w is not None or st is not None:
    sink = _sink_rate(w if w is not None else st, eps=eps)
    out.update(flatten(sink._replace(importance=jnp.mean(sink.importance, axis=1)), "sink_rate"))
  for key, field, metric in (("f_attn", "sink_mass", _first_token_attention),
                             ("entropy", "entropy", _attention_entropy)):
    source = st if st is not None and getattr(st, field) is not None else w
    if source is not None:
      out.update(flatten(metric(source), key))
  if st is not None and st.max_logit is not None:
    out["max_logit"] = _max_attention_logit(st)
  if st is not None and st.row_sum is not None and capture.null_column is not None:
    nm = _null_mass(st)
    has = jnp.reshape(jnp.asarray(capture.null_column, bool), (-1, 1))
    per_head = jnp.where(has, nm.per_head, 0.0)
    out.update(flatten(LayerMean(mean=jnp.mean(per_head), per_layer=jnp.mean(per_head, axis=1),
                                 per_head=per_head), "null_mass"))
  allowed = capture.allowed
  if w is not None:
    sparsity = _per_layer(
        lambda wl, mask: _attention_sparsity(wl, threshold=sparsity_threshold,
                                             is_causal=mask is None, mask=mask),
        w.shape[0], allowed, w)
    sparsity = sparsity._replace(mean=jnp.mean(sparsity.per_layer))
    out.update(flatten(sparsity, "sparsity"))
  if capture.q is not None and capture.k is not None:
    Tk = capture.k.shape[2]
    seq_allowed = None if allowed is None else allowed[..., :Tk]
    qk = _per_layer(lambda q, k, mask: _qk_statistics(q, k, is_causal=mask is None, mask=mask),
                    capture.q.shape[0], seq_allowed, capture.q, capture.k)
    out.update(flatten(qk._asdict() | {"max_logit": None}, "qk"))
    if capture.v is not None and Tk >= 2:
      geometry = _per_layer(
          lambda q, k, v, mask: _sink_geometry(q, k, v, is_causal=mask is None, mask=mask),
          capture.q.shape[0], seq_allowed, capture.q, capture.k, capture.v)
      out.update(flatten(geometry, "sink_geometry"))
  if capture.hidden is not None:
    out.update(flatten(_massive_activations(capture.hidden, abs_threshold=massive_abs,
                                            ratio=massive_ratio), "massive"))
    out.update(flatten(_kurtosis(capture.hidden), "kurtosis"))
  if capture.gate_mean is not None:
    per_head = jnp.mean(jnp.asarray(capture.gate_mean, jnp.float32), axis=1)
    per_layer = jnp.mean(per_head, axis=1)
    out.update(flatten(LayerMean(mean=jnp.nanmean(per_layer), per_layer=per_layer,
                                 per_head=per_head), "gate"))
  return out


probe_statistics = jax.jit(
    _probe_statistics,
    static_argnames=("eps", "sparsity_threshold", "z_loss_coef", "massive_abs", "massive_ratio"))
probe_statistics.__doc__ = _probe_statistics.__doc__


def _last(x):
  """A sown value: ``sow`` appends to a tuple; one forward pass sows each name once."""
  return x[-1] if isinstance(x, tuple) else x


def _layer_allowed(config, T: int, S: int) -> Array:
  """``[1, 1, T, S]`` pairs an ``attnjax.nn.Attention`` layer allows in its training forward.

  Built from :func:`attnjax.masks.structural_mask` as the layer builds it:
  causal, the sliding window, StreamingLLM sink tokens, and the k/v bias slot
  (key ``T``) open to every query; columns beyond are padding. A sparse-family
  layer allows exactly its pattern (``config.make_pattern()``, causal).
  """
  pos = jnp.arange(T)
  window = None if config.window is None else (config.window, 0)
  if config.family == "sparse":
    allowed = config.make_pattern().mask(T, T)
  else:
    allowed = masks.structural_mask(pos, pos, is_causal=True, window=window)
  if config.num_sinks:
    causal = masks.structural_mask(pos, pos, is_causal=True)
    sinks = jnp.reshape(pos < config.num_sinks, (1, 1, 1, T))
    allowed = jnp.logical_or(allowed, jnp.logical_and(causal, sinks))
  extra = jnp.zeros((1, 1, T, S - T), bool)
  if config.kv_bias and S > T:
    extra = extra.at[..., 0].set(True)
  return jnp.concatenate([allowed, extra], axis=-1)


def _compared_qk(attention, q: Array, k: Array):
  """q and k ``[B, T, heads, H]`` as the layer's attention function compares them.

  Applies the layer's QK norm and gains (family ``qk_norm``, in its placement)
  and RoPE, with the library's own ``normalize_head`` and ``apply_rope``.
  Cosine attention normalises inside the function; cosines are invariant to
  that (but not to the per-dim scale of the ``ngpt`` convention, ignored here).
  For linear attention these are the inputs of the feature map.
  """
  c = attention.config
  T = q.shape[1]

  def rope(x):
    return x if c.rope_theta is None else apply_rope(x, jnp.arange(T), c.rope_theta)

  if c.family != "qk_norm":
    return rope(q), rope(k)

  def norm(x, gain):
    y = qk_norm_lib.normalize_head(x, c.qk_norm, c.qk_norm_eps)
    if gain is not None:
      y = y * jnp.reshape(gain[...].astype(jnp.float32), (1, 1, 1, -1))
    return y

  q_gain = attention.q_gain if c.qk_norm_gain else None
  k_gain = attention.k_gain if c.qk_norm_gain else None
  if c.qk_norm_placement == "before_rope":
    return rope(norm(q, q_gain)), rope(norm(k, k_gain))
  return norm(rope(q), q_gain), norm(rope(k), k_gain)


def _fill_missing_fields(stats: list) -> list:
  """Layers of different families may lack a field others have: NaN there (not defined)."""
  for field in AttentionStats._fields:
    present = [getattr(st, field) for st in stats if getattr(st, field) is not None]
    if present and len(present) < len(stats):
      nan = jnp.full(jnp.shape(present[0]), jnp.nan, jnp.float32)
      stats = [st if getattr(st, field) is not None else st._replace(**{field: nan})
               for st in stats]
  return stats


def capture_from_model(model, tokens: Array, *, weights: bool = True) -> ProbeCapture:
  """Runs ``model`` (an ``attnjax.nn.TransformerLM``) once and gathers a :class:`ProbeCapture`.

  Uses ``nnx.capture``: the layers' sown ``nnx.Intermediate`` values
  (``AttentionStats``, gate means, weights with ``weights=True``) and, through
  ``method_outputs``, each module's call output: the q/k/v projections and
  every block's output hidden state, so no model code changes. Traceable:
  :func:`probe` runs it inside ``nnx.jit``.

  Args:
    model: an ``attnjax.nn.TransformerLM``.
    tokens: ``[B, T]`` integer tokens.
    weights: also collect the attention weights ``[B, N, T, S]`` per layer.

  Returns:
    A :class:`ProbeCapture`.
  """
  def forward(m, t):
    return m(t, sow_weights=True if weights else None)

  logits, inter = nnx.capture(forward, nnx.Intermediate,
                              method_outputs=nnx.Intermediate)(model, tokens)
  pure = nnx.to_pure_dict(inter)
  B, T = tokens.shape
  layers = pure["blocks"]
  stats, ws, qs, ks, vs, hidden, gates, nulls, configs = [], [], [], [], [], [], [], [], []
  for l, block in enumerate(model.blocks):
    d = layers[l]
    a = d["attention"]
    attention = block.attention
    c = attention.config
    configs.append(c)
    N, K, H = attention.num_heads, attention.num_kv_heads, attention.head_dim
    stats.append(_last(a.get("attention_stats", AttentionStats())))
    if weights:
      ws.append(_last(a["weights"]))
    q = jnp.reshape(_last(a["q_proj"]["__call__"]), (B, T, N, H))
    k = jnp.reshape(_last(a["k_proj"]["__call__"]), (B, T, K, H))
    v = jnp.reshape(_last(a["v_proj"]["__call__"]), (B, T, K, -1))
    q, k = _compared_qk(attention, q, k)
    qs.append(q.astype(jnp.float32))
    ks.append(k.astype(jnp.float32))
    vs.append(v.astype(jnp.float32))
    hidden.append(_last(d["__call__"]).astype(jnp.float32))
    gate = a.get("gate_mean")
    gates.append(jnp.full((B, N), jnp.nan, jnp.float32) if gate is None else _last(gate))
    nulls.append(bool(c.sink_logits or c.normalizer == "softmax_one"))
  if len({q.shape for q in qs}) > 1 or len({k.shape for k in ks}) > 1:
    raise ValueError("probe needs the same head layout in every layer (N, K, H); got "
                     f"q shapes {[q.shape for q in qs]}, k shapes {[k.shape for k in ks]}")
  # Layers with a k/v bias slot have one more key: pad the others with zero columns.
  S = max(w.shape[-1] for w in ws) if ws else T
  padded = [jnp.pad(w.astype(jnp.float32), ((0, 0), (0, 0), (0, 0), (0, S - w.shape[-1])))
            for w in ws]
  return ProbeCapture(
      logits=logits,
      attention_stats=_stats_layers(_fill_missing_fields(stats)),
      weights=jnp.stack(padded) if padded else None,
      allowed=jnp.stack([_layer_allowed(c, T, S) for c in configs]),
      q=jnp.stack(qs), k=jnp.stack(ks), v=jnp.stack(vs), hidden=jnp.stack(hidden),
      gate_mean=jnp.stack(gates) if any("gate_mean" in layers[l]["attention"]
                                        for l in range(len(configs))) else None,
      null_column=jnp.asarray(nulls))


def _probe_pass(model, tokens, *, weights: bool, options: tuple) -> dict:
  capture = capture_from_model(model, tokens, weights=weights)
  out = _probe_statistics(capture, **dict(options))
  # Next-token cross-entropy of the probe batch (nats), beside the statistics.
  logp = jax.nn.log_softmax(capture.logits[:, :-1].astype(jnp.float32), axis=-1)
  target = tokens[:, 1:]
  out["loss"] = -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
  return out


_probe_jit = nnx.jit(_probe_pass, static_argnames=("weights", "options"))


def probe(model, tokens, *, length: Optional[int] = 64, weights: bool = True,
          eps: float = 0.3, sparsity_threshold: float = 0.01, z_loss_coef: float = 1e-4,
          massive_abs: float = 100.0, massive_ratio: float = 1000.0) -> dict:
  """Every per-layer / per-head statistic of a model on a fixed probe batch, in one jitted pass.

  Runs :func:`capture_from_model` and :func:`probe_statistics` under one
  ``nnx.jit`` and adds ``loss``, the next-token cross-entropy of the batch.
  Gu et al. measure sinks on held-out sequences of length 64; ``length``
  keeps the first ``length`` tokens of each sequence (None: all).

  Example::

    out = stats.probe(model, probe_tokens)          # probe_tokens [B, >= 64]
    json.dumps(stats.to_jsonable(out))
    out["sink_rate/rate"], out["f_attn/per_layer"], out["massive/m_act"]

  Args:
    model: an ``attnjax.nn.TransformerLM``.
    tokens: ``[B, T]`` integer tokens (a fixed batch: the same every time).
    length: probe length (``T >= length`` required), or None.
    weights: collect full attention weights (needed for exact ``alpha_k`` with
      k/v bias slots and for sparsity; ``O(L B N T^2)``).
    eps, sparsity_threshold, z_loss_coef, massive_abs, massive_ratio: see
      :func:`probe_statistics`.

  Returns:
    ``dict[str, Array]``: the keys of :func:`probe_statistics` plus ``loss``.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(
        f"probe takes an attnjax.nn.TransformerLM, got {type(model).__name__}; for another "
        f"model fill a ProbeCapture from its forward pass and call probe_statistics")
  if np.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be integer [B, T], got shape {_shape(tokens)} and dtype "
                     f"{jnp.result_type(tokens)}")
  if length is not None:
    if np.shape(tokens)[1] < length:
      raise ValueError(f"tokens have T={np.shape(tokens)[1]} < length={length}; pass a longer "
                       f"probe batch or length=None")
    tokens = tokens[:, :length]
  if np.shape(tokens)[1] < 2 or np.shape(tokens)[0] < 1:
    raise ValueError(f"probe needs at least one sequence of two tokens, got {_shape(tokens)}")
  eps = _check_probability("eps", eps)
  sparsity_threshold = _check_probability("sparsity_threshold", sparsity_threshold)
  options = (("eps", eps), ("sparsity_threshold", sparsity_threshold),
             ("z_loss_coef", float(z_loss_coef)), ("massive_abs", float(massive_abs)),
             ("massive_ratio", float(massive_ratio)))
  return _probe_jit(model, jnp.asarray(tokens), weights=bool(weights), options=options)


# ---------------------------------------------------------------------------
# Output helpers.


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Flattens nested dicts / NamedTuples into ``{"a/b": leaf}`` (None leaves dropped)."""
  out: dict[str, Any] = {}

  def visit(node, path):
    if node is None:
      return
    if isinstance(node, tuple) and hasattr(node, "_asdict"):
      node = node._asdict()
    if isinstance(node, Mapping):
      for key, value in node.items():
        visit(value, f"{path}/{key}" if path else str(key))
    else:
      out[path] = node

  visit(tree, prefix)
  return out


def to_jsonable(tree: Any) -> Any:
  """Converts arrays, NamedTuples and dicts to JSON-ready Python values.

  Arrays become (nested) lists of floats/ints/bools, NamedTuples become dicts;
  non-finite floats become None (JSON has no NaN), so ``json.dumps`` succeeds
  with ``allow_nan=False``.
  """
  if tree is None or isinstance(tree, (str, bool)):
    return tree
  if isinstance(tree, tuple) and hasattr(tree, "_asdict"):
    return {k: to_jsonable(v) for k, v in tree._asdict().items()}
  if isinstance(tree, Mapping):
    return {str(k): to_jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [to_jsonable(v) for v in tree]
  if isinstance(tree, (int, np.integer)):
    return int(tree)
  if isinstance(tree, (float, np.floating)):
    value = float(tree)
    return value if math.isfinite(value) else None
  arr = np.asarray(tree)
  if arr.dtype == np.bool_:
    return arr.tolist()
  if np.issubdtype(arr.dtype, np.integer):
    return arr.tolist()
  if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
    arr = arr.astype(np.float64)
    if arr.ndim == 0:
      return to_jsonable(float(arr))
    return [to_jsonable(v) for v in arr]
  raise TypeError(f"to_jsonable cannot convert {type(tree).__name__} of dtype {arr.dtype}")
