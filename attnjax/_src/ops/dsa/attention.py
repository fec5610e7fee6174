"""DeepSeek Sparse Attention (DeepSeek-V3.2): a lightning indexer picks each query's top-k keys.

Implementation behind the public module :mod:`attnjax.dsa`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, empty, logits, normalizers, op, static
from attnjax._src.attention_stats import stats_from_weights
from attnjax._src.kernels.blockwise import selected

Array = jnp.ndarray

# Bytes of one indexer tile ([B, rows, NI, S] float32) of the block-wise selection.
INDEX_TILE_BYTES = 16 * 2**20


class DSAInputs(NamedTuple):
  """The arrays of a validated call.

  Attributes:
    q: ``[B, T, N, H]``.
    k: ``[B, S, K, H]``.
    v: ``[B, S, K, Hv]``.
    index_q: ``[B, T, NI, HI]`` the indexer's queries.
    index_k: ``[B, S, HI]`` the indexer's keys (one per token, shared by its heads).
    index_weights: ``[B, T, NI]`` the indexer's head weights.
    segment_ids: ``[B, T]`` int32, or None.
  """

  q: Array
  k: Array
  v: Array
  index_q: Array
  index_k: Array
  index_weights: Array
  segment_ids: Optional[Array]


@dataclasses.dataclass(frozen=True)
class DSAOptions:
  """Static options of a validated call.

  Attributes:
    top_k: keys kept per query (already clamped to ``S``).
    scale: the main attention's logit scale.
    normalizer: the main attention's normaliser.
    return_stats: also return :class:`attnjax.AttentionStats`.
  """

  top_k: int
  scale: float
  normalizer: str
  return_stats: bool = False


# ---------------------------------------------------------------------------
# The indexer and the selection (shared by every engine).


def index_scores(index_q: Array, index_k: Array, index_weights: Array) -> Array:
  """The lightning indexer ``I[t, s] = sum_h w[t, h] relu(<q_I[t, h], k_I[s]>)``.

  Args:
    index_q: ``[B, T, NI, HI]``.
    index_k: ``[B, S, HI]``.
    index_weights: ``[B, T, NI]``.

  Returns:
    ``[B, T, S]`` in float32 (float64 for float64 inputs).
  """
  work = jnp.promote_types(index_q.dtype, jnp.float32)
  dots = jnp.einsum("bthd,bsd->bths", index_q.astype(work), index_k.astype(work))
  return jnp.einsum("bth,bths->bts", index_weights.astype(work), jax.nn.relu(dots))


def allowed_keys(
  q_positions: Array, S: int, q_segments: Optional[Array], kv_segments: Optional[Array]
) -> Array:
  """``bool [B | 1, T, S]``: causal (key ``s <= t``, ``t`` the query's position) and, with
  segment ids, the query's own segment."""
  allowed = (jnp.arange(S)[None, :] <= q_positions[:, None])[None]
  if q_segments is not None:
    allowed = jnp.logical_and(allowed, q_segments[:, :, None] == kv_segments[:, None, :])
  return allowed


def top_keys(scores: Array, allowed: Array, top_k: int) -> Array:
  """The ``top_k`` allowed keys of each row by score: ``int32 [..., top_k]``.

  Masks are applied before the top-k; ties go to the lowest key index (``lax.top_k`` keeps
  equal scores in index order, whatever the row's length); slots past a row's allowed keys
  are ``-1``; indices ascend, ``-1`` last. No gradient.
  """
  S = scores.shape[-1]
  key = jnp.where(allowed, jax.lax.stop_gradient(scores), -jnp.inf)
  best, idx = jax.lax.top_k(key, top_k)
  idx = jnp.where(jnp.isneginf(best), S, idx.astype(jnp.int32))
  idx = jnp.sort(idx, axis=-1)
  return jnp.where(idx == S, -1, idx).astype(jnp.int32)


def select_keys(
  index_q: Array,
  index_k: Array,
  index_weights: Array,
  *,
  top_k: int,
  segment_ids: Optional[Array] = None,
  block_q: Optional[int] = None,
) -> Array:
  """Each query's top-k keys, ``int32 [B, T, top_k]`` (``-1`` = none), computed a block of
  query rows at a time (no ``[T, S]`` array); ``top_k`` clamped to ``S``. The blocks run in
  segments (:func:`~attnjax._src.kernels.blockwise.selected.causal_segments`), each scoring
  only the keys its rows can see (``s <= t``).

  Args:
    index_q, index_k, index_weights: the indexer's inputs (:func:`index_scores`).
    top_k: keys per query.
    segment_ids: ``[B, T]`` (self-attention), or None.
    block_q: query rows per step (None: from :data:`~attnjax._src.ops.dsa.attention.INDEX_TILE_BYTES`).
  """
  B, T, NI, _ = index_q.shape
  S = index_k.shape[1]
  kk = min(top_k, S)
  if block_q is None:
    block_q = max(8, min(512, INDEX_TILE_BYTES // max(1, 4 * B * (NI + 2) * S)))
    block_q = 1 << (block_q.bit_length() - 1)
  tq = max(1, min(block_q, T))
  nq = -(-T // tq)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, nq * tq - T)] + [(0, 0)] * (x.ndim - 2))
  iq, iw = pad(jax.lax.stop_gradient(index_q)), pad(jax.lax.stop_gradient(index_weights))
  ik = jax.lax.stop_gradient(index_k)
  seg = None if segment_ids is None else pad(segment_ids)

  def one(i, width: int):
    """Query block ``i`` against the first ``width`` keys (those its rows can see)."""
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * tq, tq, axis=1)
    pos = i * tq + jnp.arange(tq)
    scores = index_scores(sl(iq), ik[:, :width], sl(iw))
    kv_seg = None if segment_ids is None else segment_ids[:, :width]
    allowed = allowed_keys(pos, width, None if seg is None else sl(seg), kv_seg)
    idx = top_keys(scores, allowed, min(kk, width))
    return jnp.pad(idx, [(0, 0), (0, 0), (0, kk - idx.shape[-1])], constant_values=-1)

  # the keys up to a segment's last row
  idx = selected.causal_segments(one, nq, tq, lambda end: max(1, min(S, end)))  # [nq, B, tq, kk]
  return jnp.reshape(jnp.moveaxis(idx, 0, 1), (B, nq * tq, kk))[:, :T]


# ---------------------------------------------------------------------------
# Engines.


def _reference(inputs: DSAInputs, opts: DSAOptions):
  """The ``"reference"`` engine: the indexer's ``[B, T, S]`` scores, the top-k as a mask, and
  the main attention's materialised weights."""
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  work = jnp.promote_types(q.dtype, jnp.float32)
  scores = index_scores(inputs.index_q, inputs.index_k, inputs.index_weights)
  seg = inputs.segment_ids
  allowed = allowed_keys(jnp.arange(T), S, seg, seg)
  idx = top_keys(scores, allowed, opts.top_k)  # [B, T, kk]
  chosen = jnp.any(idx[..., None] == jnp.arange(S)[None, None, None, :], axis=-2)  # [B, T, S]
  chosen = jnp.logical_and(chosen, allowed)[:, None, None]  # [B, 1, 1, T, S]
  z = jnp.einsum("btkgh,bskh->bkgts", logits.group_queries(q.astype(work), K), k.astype(work))
  z = z * opts.scale
  mask = jnp.broadcast_to(chosen, z.shape)
  w, log_norm = normalizers.get(opts.normalizer).weights(z, mask)
  w = jnp.where(mask, w, 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", w, v.astype(work))
  out = jnp.reshape(out, (B, T, N, v.shape[3])).astype(q.dtype)
  if not opts.return_stats:
    return out
  flat = lambda x: jnp.reshape(x, (B, N) + x.shape[3:]).astype(jnp.float32)
  return out, stats_from_weights(flat(z), flat(w), flat(mask), flat(log_norm))


def _blockwise(inputs: DSAInputs, opts: DSAOptions):
  """The ``"blockwise"`` engine: the top-k per query block (:func:`select_keys`), then the
  selected keys gathered per query row (blocks of one key)."""
  q, k = inputs.q, inputs.k
  K = k.shape[2]
  idx = select_keys(
    inputs.index_q,
    inputs.index_k,
    inputs.index_weights,
    top_k=opts.top_k,
    segment_ids=inputs.segment_ids,
  )
  idx = jnp.broadcast_to(idx[:, :, None, :], idx.shape[:2] + (K, idx.shape[2]))
  out, _, stats = selected.run(
    q,
    k,
    inputs.v,
    idx,
    block_size=1,
    scale=opts.scale,
    normalizer=opts.normalizer,
    return_stats=opts.return_stats,
    distinct=True,  # top_keys names each key once
  )
  return (out, stats) if opts.return_stats else out


def _empty(inputs: DSAInputs, opts: DSAOptions):
  B, T, N, _ = inputs.q.shape
  out = jnp.zeros((B, T, N, inputs.v.shape[3]), inputs.q.dtype)
  return (out, empty.empty_stats(B, N, T)) if opts.return_stats else out


# The DSA op: its call is ``(DSAInputs, DSAOptions)``; auto-dispatch takes the block-wise
# engine everywhere.
ENGINES: dict[str, op.Engine] = {
  e.name: e
  for e in (
    op.Engine("reference", _reference, op.supports_everything),
    op.Engine("blockwise", _blockwise, op.supports_everything),
  )
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK: tuple[str, ...] = ("blockwise",)
OP = op.register(
  op.Op(
    "dsa",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=_empty,
    is_empty=lambda inputs, opts: empty.is_empty(inputs.q, inputs.k),
    samples=lambda: _samples(),
  )
)


# ---------------------------------------------------------------------------
# Validation and the public functions.


def _check_indexer(index_q, index_k, index_weights, B: int, T: int, S: int):
  for name, x, rank, letters in (
    ("index_q", index_q, 4, "[B, T, NI, HI]"),
    ("index_k", index_k, 3, "[B, S, HI]"),
    ("index_weights", index_weights, 3, "[B, T, NI]"),
  ):
    if np.ndim(x) != rank:
      raise ValueError(
        f"{name} must have rank {rank} {letters}, got shape {validators.shape_of(x)}"
      )
    validators.check_floating(name, x)
  _, Ti, NI, HI = validators.shape_of(index_q)
  if validators.shape_of(index_q)[:2] != (B, T):
    raise ValueError(
      f"index_q must be [B, T, NI, HI] with B={B}, T={T}, got {validators.shape_of(index_q)}"
    )
  if validators.shape_of(index_k) != (B, S, HI):
    raise ValueError(
      f"index_k must be [B, S, HI] = {(B, S, HI)} for index_q {validators.shape_of(index_q)} and "
      f"S={S}, got {validators.shape_of(index_k)}"
    )
  if validators.shape_of(index_weights) != (B, T, NI):
    raise ValueError(
      f"index_weights must be [B, T, NI] = {(B, T, NI)}: one weight per indexer head of "
      f"index_q {validators.shape_of(index_q)}, got {validators.shape_of(index_weights)}"
    )


def _check_top_k(top_k: Any) -> int:
  return validators.check_positive_int("top_k", top_k)


def validate(
  q, k, v, index_q, index_k, index_weights, *, top_k, scale, normalizer, segment_ids, return_stats
) -> tuple[DSAInputs, DSAOptions]:
  """The canonical call, or ValueError / TypeError naming the argument and the values."""
  B, T, S, N, K, H, Hv = validators.check_qkv(q, k, v)
  if T != S:
    raise ValueError(
      f"dsa_attention is causal self-attention: q and k need the same length, got "
      f"q {validators.shape_of(q)} and k {validators.shape_of(k)}"
    )
  _check_indexer(index_q, index_k, index_weights, B, T, S)
  top_k = _check_top_k(top_k)
  validators.check_choice("normalizer", normalizer, normalizers.NORMALIZERS)
  scale = H**-0.5 if scale is None else validators.check_positive_float("scale", scale)
  seg = None
  if segment_ids is not None:
    seg = jnp.asarray(segment_ids)
    if validators.shape_of(seg) != (B, T) or not jnp.issubdtype(seg.dtype, jnp.integer):
      raise ValueError(
        f"segment_ids must be an integer array [B, T] = {(B, T)}, got "
        f"{validators.shape_of(seg)} {seg.dtype}"
      )
    seg = seg.astype(jnp.int32)
  opts = DSAOptions(
    top_k=min(top_k, S) if S else top_k,
    scale=float(scale),
    normalizer=normalizer,
    return_stats=static.check_flag("return_stats", return_stats),
  )
  return DSAInputs(q, k, v, index_q, index_k, index_weights, seg), opts


_STATIC = ("top_k", "scale", "normalizer", "return_stats", "implementation")


def _dsa(q, k, v, index_q, index_k, index_weights, segment_ids, *, implementation, **kw):
  inputs, opts = validate(q, k, v, index_q, index_k, index_weights, segment_ids=segment_ids, **kw)
  return op.run(OP, (inputs, opts), implementation)


_dsa_jit = jax.jit(_dsa, static_argnames=_STATIC)


def _dsa_attention(
  q: Array,
  k: Array,
  v: Array,
  index_q: Array,
  index_k: Array,
  index_weights: Array,
  *,
  top_k: int = 2048,
  scale: Optional[float] = None,
  normalizer: str = "softmax",
  segment_ids: Optional[Array] = None,
  implementation: Optional[ImplementationName] = None,
  return_stats: bool = False,
):
  """Causal attention over each query's top-k keys by the lightning indexer (DSA).

  The indexer scores ``I[t, s] = sum_h w[t, h] relu(<q_I[t, h], k_I[s]>)``; causality
  (``s <= t``) and ``segment_ids`` are applied first, then each query keeps its ``top_k``
  highest-scoring keys, ties to the lowest key index (whatever the sequence's length); all
  heads attend to the same keys, with the normaliser over them. The selection carries no
  gradient: train the indexer with :func:`attnjax.dsa.indexer_loss`. ``top_k >= S`` keeps
  every allowed key (dense causal attention): ``top_k`` is clamped to ``S``.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``, ``S == T``, ``N % K == 0``.
    v: values ``[B, S, K, Hv]``.
    index_q: the indexer's queries ``[B, T, NI, HI]``.
    index_k: the indexer's keys ``[B, S, HI]``.
    index_weights: the indexer's head weights ``[B, T, NI]``.
    top_k: keys per query (>= 1; DeepSeek-V3.2 uses 2048).
    scale: the main attention's logit scale; None means ``H ** -0.5``.
    normalizer: a name of :data:`attnjax.normalizers.NORMALIZERS`.
    segment_ids: ``[B, T]`` integer ids of packed documents, or None.
    implementation: None (auto: ``"blockwise"``), ``"reference"`` or ``"blockwise"`` (the
      engines: :data:`~attnjax.dsa.IMPLEMENTATIONS`).
    return_stats: also return :class:`attnjax.AttentionStats` over the selected keys.

  Returns:
    ``out [B, T, N, Hv]`` in ``q``'s dtype, or ``(out, AttentionStats)``.

  References:
    DeepSeek-AI 2025, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek
    Sparse Attention".
  """
  implementation = op.check_implementation(OP, implementation, where="dsa_attention")
  return _dsa_jit(
    q,
    k,
    v,
    index_q,
    index_k,
    index_weights,
    segment_ids,
    top_k=top_k,
    scale=scale,
    normalizer=normalizer,
    return_stats=return_stats,
    implementation=implementation,
  )


dsa_attention = static.canonicalized(_dsa_attention, _STATIC)


def _indexer_loss(
  q, k, index_q, index_k, index_weights, segment_ids, *, top_k, scale, normalizer, block_q
):
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  _check_indexer(index_q, index_k, index_weights, B, T, S)
  validators.check_choice("normalizer", normalizer, normalizers.NORMALIZERS)
  scale = H**-0.5 if scale is None else validators.check_positive_float("scale", scale)
  kk = None if top_k is None else min(_check_top_k(top_k), S)
  work = jnp.promote_types(index_q.dtype, jnp.float32)
  q = jax.lax.stop_gradient(q).astype(work)
  k = jax.lax.stop_gradient(k).astype(work)
  nz = normalizers.get(normalizer)
  tq = max(1, min(block_q, T))
  nq = -(-T // tq)
  pad = lambda x: jnp.pad(x, [(0, 0), (0, nq * tq - T)] + [(0, 0)] * (x.ndim - 2))
  qp, iq, iw = pad(q), pad(index_q), pad(index_weights)
  seg = None if segment_ids is None else pad(jnp.asarray(segment_ids).astype(jnp.int32))

  @jax.checkpoint
  def one(carry, i):
    total, rows = carry
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * tq, tq, axis=1)
    pos = i * tq + jnp.arange(tq)
    allowed = allowed_keys(pos, S, None if seg is None else sl(seg), segment_ids)
    allowed = jnp.logical_and(allowed, (pos < T)[None, :, None])
    allowed = jnp.broadcast_to(allowed, (B, tq, S))
    scores = index_scores(sl(iq), index_k, sl(iw))  # [B, tq, S]
    if kk is not None:  # the sparse stage: the selected keys only
      idx = top_keys(scores, allowed, kk)
      allowed = jnp.logical_and(
        allowed, jnp.any(idx[..., None] == jnp.arange(S)[None, None, None, :], axis=-2)
      )
    z = jnp.einsum("btkgh,bskh->bkgts", logits.group_queries(sl(qp), K), k) * scale
    full = jnp.broadcast_to(allowed[:, None, None], z.shape)
    w, _ = nz.weights(z, full)
    w = jnp.abs(jnp.where(full, w, 0.0))
    target = jnp.reshape(jnp.sum(w, axis=(1, 2)), (B, tq, S))  # summed over the heads
    total_mass = jnp.sum(target, axis=-1, keepdims=True)
    target = target / jnp.where(total_mass > 0, total_mass, 1.0)
    log_q = jax.nn.log_softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    log_t = jnp.log(jnp.where(target > 0, target, 1.0))
    kl = jnp.sum(jnp.where(target > 0, target * (log_t - jnp.where(allowed, log_q, 0.0)), 0.0), -1)
    has = jnp.any(allowed, axis=-1)
    return (total + jnp.sum(jnp.where(has, kl, 0.0)), rows + jnp.sum(has)), None

  (total, rows), _ = jax.lax.scan(one, (jnp.zeros((), work), jnp.zeros((), work)), jnp.arange(nq))
  return total / jnp.maximum(rows, 1.0)


_indexer_loss_jit = jax.jit(
  _indexer_loss, static_argnames=("top_k", "scale", "normalizer", "block_q")
)


def indexer_loss(
  q: Array,
  k: Array,
  index_q: Array,
  index_k: Array,
  index_weights: Array,
  *,
  top_k: Optional[int] = None,
  scale: Optional[float] = None,
  normalizer: str = "softmax",
  segment_ids: Optional[Array] = None,
  block_q: int = 128,
) -> Array:
  """The indexer's KL loss, ``mean_t KL(p_t || softmax(I[t, :]))``: it trains the indexer only.

  ``p_t`` is the main attention's weights of query ``t`` summed over its heads and
  L1-normalised (the target, without gradient: ``q`` and ``k`` get none); ``I`` the indexer's
  scores over the same allowed keys (causal, ``segment_ids``). ``top_k=None`` is the dense
  warm-up stage (every allowed key); an int the sparse stage (both distributions over the
  query's top-k keys). Averaged over the queries that have a key; computed ``block_q`` query
  rows at a time (no ``[T, S]`` array).

  Args:
    q, k: the main attention's queries ``[B, T, N, H]`` and keys ``[B, S, K, H]``.
    index_q, index_k, index_weights: the indexer's inputs (:func:`attnjax.dsa_attention`).
    top_k: None (dense warm-up) or the sparse stage's keys per query.
    scale: the main attention's logit scale; None means ``H ** -0.5``.
    normalizer: the main attention's normaliser (its weights' magnitudes give the target).
    segment_ids: ``[B, T]``, or None.
    block_q: query rows per step.

  Returns:
    A scalar (float32; float64 for float64 indexer inputs).
  """
  if isinstance(block_q, bool) or not isinstance(block_q, int) or block_q < 1:
    raise ValueError(f"block_q must be a positive int, got {block_q!r}")
  validators.check_qkv(q, k, k)
  return _indexer_loss_jit(
    q,
    k,
    index_q,
    index_k,
    index_weights,
    segment_ids,
    top_k=top_k,
    scale=scale,
    normalizer=normalizer,
    block_q=block_q,
  )


def _sample_arrays(q, k, v):
  """A sample call's indexer: two heads of 4 dims, a deterministic draw from the shapes of
  ``q`` and ``k``."""
  B, T = tuple(np.shape(q))[:2]
  S = tuple(np.shape(k))[1] if np.ndim(k) > 1 else 0
  rng = np.random.default_rng([5, B, T, S])
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  index = {"index_q": draw(B, T, 2, 4), "index_k": draw(B, S, 4), "index_weights": draw(B, T, 2)}
  return q, k, v, index


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      dsa_attention,
      options=dict(top_k=3),
      arrays=_sample_arrays,
      self_only=True,
      stats=True,
      flags=("return_stats",),
      static=(("scale", 0.5), ("top_k", 2)),
      choices=(("top_k", (1, 2, 5, 100)), ("normalizer", normalizers.NORMALIZERS)),
      defects=(("top_k", (0, -1, 2.5)), ("normalizer", ("softmaxx",)), ("scale", (-1.0,))),
    ),
  )
