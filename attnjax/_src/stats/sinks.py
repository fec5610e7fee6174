"""Attention-sink metrics on weights or ``AttentionStats`` (Gu et al. 2024; Qiu et al. 2025).

Importance ``alpha_k`` and the sink rate ``Sink_k^eps``, first-token attention
(F-Attn), entropy, max logit, null mass, gate mass and sparsity. Conventions
(layouts, 0- vs 1-indexing) as in :mod:`attnjax.stats`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators
from attnjax._src.stats.inputs import (
  _allowed_pairs,
  _attention_layers,
  check_probability,
  _is_stats,
  _lift,
  _need,
  _nonempty,
  _row_normalize,
  shape_of,
  _stack_layers,
  stats_layers,
  _weights_as_stats,
)
from attnjax._src.stats.results import AttentionEntropy, FirstTokenAttention, LayerMean, SinkRate

Array = jnp.ndarray


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
    raise ValueError(f"weights must have rank >= 2 [..., T, S], got shape {shape_of(weights)}")
  validators.check_floating("weights", weights)
  _nonempty("weights", weights)
  T, S = shape_of(weights)[-2:]
  if S < T:
    raise ValueError(f"weights must have S >= T for alpha_k, got shape {shape_of(weights)}")
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
  percent, with ``alpha_k`` from :func:`.importance`. As in the authors' code,
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
      (``S >= T``, see :func:`.importance`), or ``AttentionStats`` (one, stacked
      or a list per layer).
    eps: threshold on ``alpha_k``, in ``[0, 1]``.
    k: key index, **1-indexed as in the paper** (``k = 1`` is the first token).
    row_normalize: see above (weights only).

  Returns:
    :class:`.SinkRate` (percentages in ``[0, 100]``).

  References:
    Gu et al. 2024, "When Attention Sink Emerges in Language Models: An
    Empirical View" (ICLR 2025), sec. 3.1.
  """
  eps = check_probability("eps", eps)
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"k is the paper's 1-indexed key (k = 1 is the first token), got {k!r}")
  if _is_stats(attention):
    if k != 1:
      raise ValueError(f"AttentionStats only carry the first key's mass; k={k} needs the weights")
    stats = stats_layers(attention)
    sink_mass = _need(stats, "sink_mass", "sink_rate")
    T = _need(stats, "logsumexp", "sink_rate (for the sequence length T)").shape[-1]
    alpha = (1.0 + (T - 1) * sink_mass) / T
    row_sum = _need(stats, "row_sum", "sink_rate")
    row_sum = jnp.mean(row_sum, axis=(1, 2))
  else:
    w = _attention_layers("attention", attention)
    T = w.shape[-2]
    if k > T:
      raise ValueError(f"k={k} exceeds the sequence length T={T} (weights shape {shape_of(w)})")
    alpha = _importance(w, row_normalize=row_normalize)[..., k - 1]
    row_sum = jnp.mean(jnp.sum(w, axis=-1), axis=(1, 2, 3))
  sink = (alpha > eps).astype(jnp.float32)
  return SinkRate(
    rate=100.0 * jnp.mean(sink),
    per_layer=100.0 * jnp.mean(sink, axis=(1, 2)),
    importance=alpha,
    row_sum=row_sum,
  )


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
    :class:`.FirstTokenAttention`: ``f_attn`` scalar, ``per_layer`` ``[L]``,
    ``per_head`` ``[L, N]`` (each a mean over the batch).

  References:
    Qiu et al. 2025, "Gated Attention for Large Language Models:
    Non-linearity, Sparsity, and Attention-Sink-Free", table 4.
  """
  if _is_stats(attention):
    sink_mass = _need(stats_layers(attention), "sink_mass", "first_token_attention")
  else:
    sink_mass = _weights_as_stats(_attention_layers("attention", attention)).sink_mass
  per_head = jnp.mean(sink_mass, axis=1)
  return FirstTokenAttention(
    f_attn=jnp.mean(per_head), per_layer=jnp.mean(per_head, axis=1), per_head=per_head
  )


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
    :class:`.AttentionEntropy` in nats: ``mean`` ``[L]``, ``min`` ``[L]``,
    ``per_head`` ``[L, N]``.

  References:
    Zhai et al. 2023, "Stabilizing Transformer Training by Preventing
    Attention Entropy Collapse".
  """
  if _is_stats(attention):
    entropy = _need(stats_layers(attention), "entropy", "attention_entropy")
  else:
    w = _stack_layers("attention", attention, 4, "[B, N, T, S]")
    entropy = _weights_as_stats(w).entropy
  per_head = jnp.mean(entropy, axis=1)
  return AttentionEntropy(
    mean=jnp.mean(per_head, axis=1), min=jnp.min(per_head, axis=1), per_head=per_head
  )


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
    return jnp.max(_need(stats_layers(attention), "max_logit", "max_attention_logit"), axis=(1, 2))
  z = _stack_layers("attention", attention, 4, "[B, N, T, S]")
  window = validators.check_window(window)
  allowed = _allowed_pairs(z.shape[1:], is_causal=is_causal, window=window, mask=mask)
  zmax = jnp.max(jnp.where(allowed[None], z, -jnp.inf), axis=(1, 2, 3, 4))
  return jnp.where(jnp.isfinite(zmax), zmax, 0.0)


max_attention_logit = jax.jit(_max_attention_logit, static_argnames=("is_causal", "window"))
max_attention_logit.__doc__ = _max_attention_logit.__doc__


def _null_mass(
  attention, sink_logits=None, *, is_causal: bool = True, window=None, mask=None
) -> LayerMean:
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
    :class:`.LayerMean`: ``mean`` scalar, ``per_layer`` ``[L]``, ``per_head``
    ``[L, N]``.

  References:
    OpenAI 2025, gpt-oss model card (learned attention sinks); Miller 2023,
    "Attention Is Off By One".
  """
  if _is_stats(attention):
    per_head = 1.0 - jnp.mean(_need(stats_layers(attention), "row_sum", "null_mass"), axis=1)
  else:
    z = _stack_layers("attention", attention, 4, "[B, N, T, S]")
    L, B, N, T, S = z.shape
    if sink_logits is None:
      raise ValueError(
        "null_mass on logits needs sink_logits ([L, N], [N] or scalar; 0 for softmax_one)"
      )
    validators.check_floating("sink_logits", sink_logits)
    s = jnp.asarray(sink_logits, jnp.float32)
    if shape_of(s) not in ((), (N,), (L, N)):
      raise ValueError(
        f"sink_logits must have shape (), [N] = ({N},) or [L, N] = ({L}, {N}), got {shape_of(s)}"
      )
    s = jnp.reshape(jnp.broadcast_to(s, (L, N)), (L, 1, N, 1))
    window = validators.check_window(window)
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
    :class:`.LayerMean`: ``mean`` scalar, ``per_layer`` ``[L]``, ``per_head``
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


def _attention_sparsity(
  weights, *, threshold: float = 0.01, is_causal: bool = True, window=None, mask=None
) -> LayerMean:
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
    :class:`.LayerMean` of fractions in ``[0, 1]``: ``mean`` scalar,
    ``per_layer`` ``[L]``, ``per_head`` ``[L, N]``.

  References:
    Zhang et al. 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative
    Inference of Large Language Models", sec. 3.1 ("sparse" = below 1% of the
    row's maximum).
  """
  threshold = check_probability("threshold", threshold)
  w = jnp.abs(_stack_layers("weights", weights, 4, "[B, N, T, S]"))
  window = validators.check_window(window)
  allowed = jnp.broadcast_to(
    _allowed_pairs(w.shape[1:], is_causal=is_causal, window=window, mask=mask)[None], w.shape
  )
  row_max = jnp.max(jnp.where(allowed, w, 0.0), axis=-1, keepdims=True)
  counted = jnp.logical_and(allowed, row_max > 0)
  sparse = jnp.logical_and(counted, w < threshold * row_max)
  per_head = jnp.sum(sparse, axis=(1, 3, 4), dtype=jnp.float32) / jnp.maximum(
    jnp.sum(counted, axis=(1, 3, 4), dtype=jnp.float32), 1.0
  )
  per_layer = jnp.mean(per_head, axis=1)
  return LayerMean(mean=jnp.mean(per_layer), per_layer=per_layer, per_head=per_head)


attention_sparsity = jax.jit(
  _attention_sparsity, static_argnames=("threshold", "is_causal", "window")
)
attention_sparsity.__doc__ = _attention_sparsity.__doc__


def _token_mass(weights, tokens, token_ids: tuple[int, ...], attention_mask=None) -> Array:
  w = jnp.asarray(weights)
  if w.ndim == 4:
    w = w[None]
  if w.ndim != 5:
    raise ValueError(
      f"weights must be [B, N, T, S] or [L, B, N, T, S], got shape {shape_of(weights)}"
    )
  L, B, N, T, S = w.shape
  tokens = jnp.asarray(tokens)
  if tokens.shape != (B, S):
    raise ValueError(
      f"tokens must be [B, S] = {(B, S)} like the weights' keys, got {shape_of(tokens)}"
    )
  hit = jnp.isin(tokens, jnp.asarray(token_ids, tokens.dtype)).astype(jnp.float32)  # [B, S]
  mass = jnp.einsum("lbnts,bs->lbnt", w.astype(jnp.float32), hit)
  rows = jnp.ones((B, T), jnp.float32)
  if attention_mask is not None:
    rows = jnp.asarray(attention_mask).astype(jnp.float32)[:, :T]
  return (
    jnp.sum(mass * rows[None, :, None, :], axis=-1)
    / jnp.maximum(jnp.sum(rows, axis=-1), 1.0)[None, :, None]
  )


_token_mass_jit = jax.jit(_token_mass, static_argnames=("token_ids",))


def token_mass(weights, tokens, token_ids, *, attention_mask=None) -> Array:
  """Mean attention weight on the keys whose token is one of ``token_ids``, per layer and head.

  Definition: ``sum_{j: tokens_j in ids} A_ij``, averaged over the queries ``i`` that are
  not padding. Clark et al. 2019 ("What does BERT look at?") found BERT's heads putting most
  of their mass on ``[CLS]``, ``[SEP]`` and punctuation; Bondarenko et al. 2023 tie it to
  heads that learn to do nothing. With ``token_ids`` the ``[CLS]`` id this is the
  first-token mass of an encoder (every query, not only ``i >= 1``).

  Args:
    weights: ``[L, B, N, T, S]`` (or ``[B, N, T, S]``) attention weights.
    tokens: ``[B, S]`` int: the keys' token ids.
    token_ids: the tokens whose mass is counted (e.g. ``[SEP]``, ``.``, ``,``).
    attention_mask: ``[B, T]`` 1 for tokens, 0 for padding queries (None = none).

  Returns:
    ``[L, B, N]`` float32.
  """
  ids = tuple(int(i) for i in token_ids)
  return _token_mass_jit(weights, tokens, ids, attention_mask)
