"""Linear (kernel-feature) attention: ``exp(q.k)`` replaced by ``phi(q) . phi(k)``.

Implementation behind the public module :mod:`attnjax.linear`.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple, Optional, Union, get_args

import jax
import jax.numpy as jnp

from attnjax._src import validators, empty, op, static, feature_maps, masks
from attnjax._src.ops import recurrence
from attnjax._src.numerics import einsum
from attnjax._src.ops.recurrence import DEFAULT_CHUNK_SIZE
from attnjax._src.attention_stats import AttentionStats, stats_from_weights
from attnjax._src.logits import group_queries
from attnjax._src.kernels.blockwise.ring import varying
from attnjax._src.parallel.recurrent import every_shard

Array = jnp.ndarray

Normalize = Literal["denominator", "none", "output_rms"]

NORMALIZE: tuple[str, ...] = get_args(Normalize)
# The engine "reference" names: the masked weight matrix, the family's definition.
REFERENCE_ENGINE = "quadratic"
DEFAULT_EPS = 1e-6


class LinearState(NamedTuple):
  """Recurrent state of linear attention, per batch element and key/value head.

  Attributes:
    kv_sum: ``[B, K, F, Hv]`` ``S = sum_j phi(k_j) v_j^T`` (float32).
    k_sum: ``[B, K, F]`` ``z = sum_j phi(k_j)`` (float32).
  """

  kv_sum: Array
  k_sum: Array


def zeros_state(batch: int, num_kv_heads: int, num_features: int, value_dim: int) -> LinearState:
  """The empty state (no keys seen).

  Args:
    batch: ``B``.
    num_kv_heads: ``K``.
    num_features: ``F``, the feature map's output dimension.
    value_dim: ``Hv``.

  Returns:
    A :class:`.LinearState` of float32 zeros: ``kv_sum [B, K, F, Hv]``, ``k_sum [B, K, F]``.
  """
  return LinearState(
    jnp.zeros((batch, num_kv_heads, num_features, value_dim), jnp.float32),
    jnp.zeros((batch, num_kv_heads, num_features), jnp.float32),
  )


# ---------------------------------------------------------------------------
# The engines' computations. Each takes float32 features phi_q [B, T, K, G, F], phi_k [B, S, K, F],
# values v [B, S, K, Hv] and a LinearState; each returns the numerator
# phi(q_i).S_i [B, T, K, G, Hv], the denominator phi(q_i).z_i [B, T, K, G] and
# the final state.


def _causal_keep(T: int, S: int) -> Array:
  """``[1, 1, 1, T, S]`` causal mask from the one mask rule, for grouped scores."""
  return jnp.reshape(masks.causal_mask(T, S), (1, 1, 1, T, S))


def quadratic(phi_q: Array, phi_k: Array, v: Array, state: LinearState, *, is_causal: bool):
  """The masked quadratic form ``(phi(Q) phi(K)^T * M) V`` (the reference); O(T S).

  Args:
    phi_q: float32 query features ``[B, T, K, G, F]`` (``G = N // K`` query heads per
      key/value head).
    phi_k: float32 key features ``[B, S, K, F]``.
    v: values ``[B, S, K, Hv]``.
    state: the :class:`.LinearState` before the first key.
    is_causal: mask keys after the query (``M``; needs ``T == S``).

  Returns:
    ``(numerator [B, T, K, G, Hv], denominator [B, T, K, G], final state)``: the
    numerator ``phi(q_i).S_i``, the denominator ``phi(q_i).z_i`` and the state after
    every key (``finish`` turns the first two into the output).
  """
  T, S = phi_q.shape[1], phi_k.shape[1]
  w = einsum("btkgf,bskf->bkgts", phi_q, phi_k)
  if is_causal:
    w = jnp.where(_causal_keep(T, S), w, 0.0)
  num = einsum("bkgts,bskh->btkgh", w, v) + einsum("btkgf,bkfh->btkgh", phi_q, state.kv_sum)
  den = jnp.transpose(jnp.sum(w, axis=-1), (0, 3, 1, 2)) + einsum(
    "btkgf,bkf->btkg", phi_q, state.k_sum
  )
  final = LinearState(
    state.kv_sum + einsum("bskf,bskh->bkfh", phi_k, v), state.k_sum + jnp.sum(phi_k, axis=1)
  )
  return num, den, final


def recurrent(phi_q: Array, phi_k: Array, v: Array, state: LinearState):
  """The causal decode engine: ``lax.scan`` over time carrying ``(S, z)``; O(T) time, O(1) state.

  Args:
    phi_q: float32 query features ``[B, T, K, G, F]`` (``G = N // K`` query heads per
      key/value head).
    phi_k: float32 key features ``[B, S, K, F]``.
    v: values ``[B, S, K, Hv]``.
    state: the :class:`.LinearState` before the first key.

  Returns:
    ``(numerator [B, T, K, G, Hv], denominator [B, T, K, G], final state)``: the
    numerator ``phi(q_i).S_i``, the denominator ``phi(q_i).z_i`` and the state after
    every key (``finish`` turns the first two into the output).
  """

  def step(carry: LinearState, xs):
    q_t, k_t, v_t = xs  # [B, K, G, F], [B, K, F], [B, K, Hv]
    kv_sum = carry.kv_sum + k_t[..., :, None] * v_t[..., None, :]
    k_sum = carry.k_sum + k_t
    num_t = einsum("bkgf,bkfh->bkgh", q_t, kv_sum)
    den_t = einsum("bkgf,bkf->bkg", q_t, k_sum)
    return LinearState(kv_sum, k_sum), (num_t, den_t)

  time_major = (jnp.moveaxis(phi_q, 1, 0), jnp.moveaxis(phi_k, 1, 0), jnp.moveaxis(v, 1, 0))
  final, (num, den) = jax.lax.scan(step, state, time_major)
  return jnp.moveaxis(num, 0, 1), jnp.moveaxis(den, 0, 1), final


def chunked(
  q: Array,
  k: Array,
  v: Array,
  state: LinearState,
  *,
  chunk_size: int,
  finish_fn: Optional[Callable[[Array, Array], Array]] = None,
):
  """The causal chunked engine: intra-chunk masked quadratic + the state of the earlier chunks.

  A ``lax.scan`` over chunks of ``chunk_size`` carries ``(S, z)``; each step does
  four batched matmuls over ``(B, K)``: ``phi(Q_c) phi(K_c)^T`` (masked), its
  product with ``V_c``, ``phi(Q_c) S`` and the update ``S += phi(K_c)^T V_c``.
  Cost ``O(T (C (F + Hv) + F Hv))`` with a working set of one chunk, so time
  grows linearly in ``T``. (Materialising every chunk's state with a prefix sum
  instead was several times slower on the CPU: the states do not stay in cache.)

  Time is padded up to a multiple of ``chunk_size``; padded keys are zeroed (they
  add nothing to any sum) and padded query rows are dropped.

  The feature maps are applied before the scan, in one pass over the whole
  sequence: measured on the CPU (T=4096, C=32, elu+1, interleaved best of 7),
  that ran 0.86-0.96x the time of applying them to each chunk inside the step,
  where they add two small operations to every one of the T / C steps.

  Args:
    q: ``[B, T, K, G, F]`` query features.
    k: ``[B, T, K, F]`` key features.
    v: ``[B, T, K, Hv]`` float32 values.
    state: the state before the first chunk.
    chunk_size: ``C``.
    finish_fn: optional ``(num, den) -> out`` applied inside the step; then the
      first result is the finished output and the second is None.

  Returns:
    ``(num [B, T, K, G, Hv], den [B, T, K, G], final state)``, or
    ``(out, None, final state)`` with ``finish_fn``.
  """
  B, T, K, G = q.shape[:4]
  Hv = v.shape[-1]
  C = min(chunk_size, T)
  num_chunks = -(-T // C)
  pad = num_chunks * C - T
  if pad:
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
  # Chunk-major in the inputs' own layout: [n, B, C, ...]. For B = 1 this is a
  # reshape, not a copy; the per-step einsums transpose one chunk in cache.
  qc = jnp.swapaxes(jnp.reshape(q, (B, num_chunks, C) + q.shape[2:]), 0, 1)
  kc = jnp.swapaxes(jnp.reshape(k, (B, num_chunks, C) + k.shape[2:]), 0, 1)
  vc = jnp.swapaxes(jnp.reshape(v, (B, num_chunks, C, K, Hv)), 0, 1)
  keep = jnp.reshape(masks.causal_mask(C, C), (1, 1, 1, C, C))

  def step(carry: LinearState, xs):
    q_c, k_c, v_c, index = xs  # [B, C, K, G, F], [B, C, K, F], [B, C, K, Hv], []
    if pad:
      real = (index * C + jnp.arange(C)) < T
      k_c = jnp.where(jnp.reshape(real, (1, C, 1, 1)), k_c, 0.0)
    w = jnp.where(keep, einsum("bckgf,bdkf->bkgcd", q_c, k_c), 0.0)
    num = einsum("bkgcd,bdkh->bckgh", w, v_c) + einsum("bckgf,bkfh->bckgh", q_c, carry.kv_sum)
    den = jnp.transpose(jnp.sum(w, axis=-1), (0, 3, 1, 2)) + einsum(
      "bckgf,bkf->bckg", q_c, carry.k_sum
    )
    new = LinearState(
      carry.kv_sum + einsum("bckf,bckh->bkfh", k_c, v_c), carry.k_sum + jnp.sum(k_c, axis=1)
    )
    if finish_fn is not None:
      return new, finish_fn(num, den)
    return new, (num, den)

  final, ys = jax.lax.scan(step, state, (qc, kc, vc, jnp.arange(num_chunks)))

  def unchunk(x):  # [n, B, C, ...] -> [B, T, ...]
    x = jnp.swapaxes(x, 0, 1)
    return jnp.reshape(x, (B, num_chunks * C) + x.shape[3:])[:, :T]

  if finish_fn is not None:
    return unchunk(ys), None, final
  return unchunk(ys[0]), unchunk(ys[1]), final


def noncausal(phi_q: Array, phi_k: Array, v: Array, state: LinearState):
  """Non-causal O(T): every query reads the same ``S = S_0 + phi(K)^T V``.

  Args:
    phi_q: float32 query features ``[B, T, K, G, F]`` (``G = N // K`` query heads per
      key/value head).
    phi_k: float32 key features ``[B, S, K, F]``.
    v: values ``[B, S, K, Hv]``.
    state: the :class:`.LinearState` before the first key.

  Returns:
    ``(numerator [B, T, K, G, Hv], denominator [B, T, K, G], final state)``: the
    numerator ``phi(q_i).S_i``, the denominator ``phi(q_i).z_i`` and the state after
    every key (``finish`` turns the first two into the output).
  """
  final = LinearState(
    state.kv_sum + einsum("bskf,bskh->bkfh", phi_k, v), state.k_sum + jnp.sum(phi_k, axis=1)
  )
  num = einsum("btkgf,bkfh->btkgh", phi_q, final.kv_sum)
  den = einsum("btkgf,bkf->btkg", phi_q, final.k_sum)
  return num, den, final


def finish(num: Array, den: Array, *, normalize: str, eps: float) -> Array:
  """Turns numerator and denominator into the output under ``normalize``.

  Args:
    num: ``[..., Hv]`` numerators ``phi(q_i).S_i``.
    den: ``[...]`` denominators ``phi(q_i).z_i``.
    normalize: ``"denominator"`` (``num / (den + eps)``), ``"output_rms"`` (an RMSNorm
      of ``num`` over ``Hv``) or ``"none"`` (``num``).
    eps: added to the denominator, or inside the RMS.

  Returns:
    ``[..., Hv]``.
  """
  if normalize == "denominator":
    return num / (den[..., None] + eps)
  if normalize == "output_rms":
    return num * jax.lax.rsqrt(jnp.mean(jnp.square(num), axis=-1, keepdims=True) + eps)
  return num


# ---------------------------------------------------------------------------
# Statistics.


def _reference_stats(phi_q: Array, phi_k: Array, *, is_causal: bool) -> AttentionStats:
  """Stats from the materialised implied weights ``phi(q_i).phi(k_j)`` (O(T S) memory)."""
  B, T, K, G, _ = phi_q.shape
  S = phi_k.shape[1]
  w = einsum("btkgf,bskf->bkgts", phi_q, phi_k)
  w = jnp.reshape(w, (B, K * G, T, S))
  allowed = masks.causal_mask(T, S) if is_causal else jnp.ones((1, 1, 1, 1), bool)
  w = jnp.where(allowed, w, 0.0)
  stats = stats_from_weights(w, w, allowed, jnp.zeros((B, K * G, T, 1), jnp.float32))
  return stats._replace(max_logit=None, logsumexp=None)


def _blocked_stats(
  phi_q: Array,
  phi_k: Array,
  *,
  is_causal: bool,
  nonnegative: bool,
  block: int,
  axis: Optional[str] = None,
) -> AttentionStats:
  """The same statistics without the ``[T, S]`` matrix.

  ``row_sum`` is ``phi(q_i).z_i``: O(T). For a nonnegative feature map the
  row-normalised weight on key 0 is ``phi(q_i).phi(k_0) / phi(q_i).z_i``, also
  O(T). The entropy needs ``log(phi(q_i).phi(k_j))``, which does not factor
  through the features, so it (and, for signed maps, the ``|w|`` row sums of
  ``sink_mass``) is computed by a scan over query blocks: O(T S) time, O(block S)
  memory.

  With ``axis`` (context parallelism, contiguous shards) ``phi_q`` holds this device's
  rows and ``phi_k`` every key of the sequence (gathered): the rows sit at their global
  positions, and the means over rows are over every device's (sums and counts summed
  over the axis), the same on every device.
  """
  B, T, K, G, F = phi_q.shape
  S = phi_k.shape[1]
  N = K * G
  offset = 0 if axis is None else jax.lax.axis_index(axis) * T

  def per_head(x):  # [B, T, K, G] -> [B, N, T]
    return jnp.reshape(jnp.transpose(x, (0, 2, 3, 1)), (B, N, T))

  def mean_over_rows(x, rows):
    total = jnp.sum(jnp.where(rows, x, 0.0), axis=-1)
    count = jnp.sum(rows, axis=-1, dtype=jnp.float32)
    if axis is not None:
      total, count = jax.lax.psum((total, count), axis)
    return total / jnp.maximum(count, 1.0)

  if is_causal:
    k_prefix = jax.lax.dynamic_slice_in_dim(jnp.cumsum(phi_k, axis=1), offset, T, axis=1)
  else:
    k_prefix = jnp.sum(phi_k, axis=1, keepdims=True)
  raw_total = einsum("btkgf,btkf->btkg", phi_q, jnp.broadcast_to(k_prefix, (B, T, K, F)))
  row_sum = mean_over_rows(per_head(raw_total), jnp.ones((1, 1, T), bool))

  num_blocks = -(-T // block)
  pad = num_blocks * block - T
  q_blocks = jnp.pad(phi_q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
  q_blocks = jnp.moveaxis(jnp.reshape(q_blocks, (B, num_blocks, block, K, G, F)), 1, 0)
  positions = jnp.reshape(jnp.arange(num_blocks * block) + offset, (num_blocks, block))

  def one_block(xs):
    q_blk, pos = xs
    w = einsum("btkgf,bskf->bkgts", q_blk, phi_k)
    if is_causal:
      keep = masks.structural_mask(pos, jnp.arange(S), is_causal=True)
      w = jnp.where(jnp.reshape(keep, (1, 1, 1, block, S)), w, 0.0)
    mag = jnp.abs(w)
    total = jnp.sum(mag, axis=-1)
    p = mag / jnp.where(total > 0, total, 1.0)[..., None]
    plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)
    return total, p[..., 0], -jnp.sum(plogp, axis=-1)  # each [B, K, G, block]

  total, p0, ent = jax.lax.map(one_block, (q_blocks, positions))

  def rows(x):  # [n, B, K, G, block] -> [B, N, T]
    x = jnp.transpose(x, (1, 2, 3, 0, 4))
    return jnp.reshape(x, (B, N, num_blocks * block))[..., :T]

  total, p0, ent = rows(total), rows(p0), rows(ent)
  normalisable = total > 0
  if nonnegative:
    w0 = einsum("btkgf,bkf->btkg", phi_q, phi_k[:, 0])
    p0 = per_head(w0) / jnp.where(normalisable, per_head(raw_total), 1.0)
  later = (jnp.arange(T) + offset >= 1)[None, None, :]
  return AttentionStats(
    sink_mass=mean_over_rows(p0, jnp.logical_and(normalisable, later)),
    entropy=mean_over_rows(ent, normalisable),
    row_sum=row_sum,
  )


# ---------------------------------------------------------------------------
# Context parallelism.


def _context_states(
  phi_k: Array, v: Array, state: LinearState, *, is_causal: bool, axis: str
) -> tuple[LinearState, LinearState]:
  """``(entering, final)`` states of this device's shard of a sequence sharded over ``axis``.

  The state update is ``S -> S + phi(K)^T V`` (the transition's decay is the identity),
  so a shard's whole contribution is one product of its own features and values; every
  device's is stacked on every device (``attnjax._src.parallel.recurrent.every_shard``, one
  all-reduce). A causal shard ``p`` enters with ``state`` plus shards ``0 .. p - 1`` (an
  exclusive scan over the axis); a non-causal one with ``state`` plus every *other* shard
  (its own keys are added by its local pass). ``final`` is ``state`` plus every shard, the
  same on every device.
  """
  own = LinearState(einsum("bskf,bskh->bkfh", phi_k, v), jnp.sum(phi_k, axis=1))
  every = every_shard(own, axis)  # each [P, ...]
  p = jax.lax.axis_index(axis)
  total = jax.tree.map(lambda x: jnp.sum(x, axis=0), every)
  if is_causal:
    before = jax.tree.map(lambda x: jnp.take(jnp.cumsum(x, axis=0) - x, p, axis=0), every)
  else:
    before = jax.tree.map(lambda t, x: t - jnp.take(x, p, axis=0), total, every)
  entering = jax.tree.map(lambda s, b: varying(s + b, axis), state, before)
  final = jax.tree.map(jnp.add, state, total)
  return LinearState(*entering), LinearState(*final)


def _check_context(context_axis, *, feature_map, q, k) -> None:
  validators.check_mesh_axis("context_axis", context_axis, "linear_attention")
  if q.shape[1] != k.shape[1]:
    raise ValueError(
      f"context_axis={context_axis!r}: queries and keys must be sharded alike "
      f"(the same local length), got q {validators.shape_of(q)} and k "
      f"{validators.shape_of(k)}"
    )
  if feature_map.needs_consistent_scale:
    raise ValueError(
      f"feature_map {feature_map.kind!r} with stabilize=True takes its key "
      f"constant from the call's keys, which differ per shard with "
      f"context_axis={context_axis!r}; draw it with stabilize=False"
    )


# ---------------------------------------------------------------------------
# Public functions.


def _canonical_normalize(normalize: Union[Normalize, bool]) -> str:
  if normalize is True:
    return "denominator"
  if normalize is False:
    return "none"
  if not isinstance(normalize, str):
    raise TypeError(
      f"normalize must be one of {NORMALIZE} or a bool (True: 'denominator', "
      f"False: 'none'), got {type(normalize).__name__} {normalize!r}"
    )
  validators.check_choice("normalize", normalize, NORMALIZE + (True, False))
  return normalize


def _check_feature_map(feature_map: object, H: int) -> feature_maps.FeatureMap:
  if not isinstance(feature_map, feature_maps.FeatureMap):
    raise TypeError(
      f"feature_map must be an attnjax.feature_maps.FeatureMap (e.g. feature_maps.elu_plus_one "
      f"or feature_maps.favor_plus(key, m)), got {type(feature_map).__name__}"
    )
  feature_map.check(H)
  return feature_map


def _check_state(
  initial_state: object, expected: tuple[tuple[int, ...], tuple[int, ...]]
) -> LinearState:
  if not isinstance(initial_state, (tuple, list)) or len(initial_state) != 2:
    raise TypeError(
      f"initial_state must be a LinearState (kv_sum [B, K, F, Hv], k_sum [B, K, F]), "
      f"got {type(initial_state).__name__}"
    )
  state = LinearState(*initial_state)
  for name, x, shape in (
    ("initial_state.kv_sum", state.kv_sum, expected[0]),
    ("initial_state.k_sum", state.k_sum, expected[1]),
  ):
    validators.check_floating(name, x)
    if validators.shape_of(x) != shape:
      letters = "[B, K, F, Hv]" if name.endswith("kv_sum") else "[B, K, F]"
      raise ValueError(f"{name} must have shape {letters} = {shape}, got {validators.shape_of(x)}")
  return LinearState(state.kv_sum.astype(jnp.float32), state.k_sum.astype(jnp.float32))


class _Call(NamedTuple):
  """A validated linear-attention call, as the engines of the linear op take it.

  Attributes:
    phi_q: float32 query features ``[B, T, K, G, F]``.
    phi_k: float32 key features ``[B, S, K, F]``.
    v: float32 values ``[B, S, K, Hv]``.
    state: the :class:`.LinearState` before the first key.
    is_causal: the causal mask.
    chunk_size: the chunked engine's chunk length (and the statistics' query block).
    finish_fn: ``(numerator, denominator) -> out`` (:func:`finish` of the call's options).
    return_stats: also return the implied weights' :class:`attnjax.AttentionStats`.
    nonnegative: the feature map's values are >= 0 (the O(T) sink mass applies).
    context_axis: the ``shard_map`` axis the sequence is sharded over, or None.
  """

  phi_q: Array
  phi_k: Array
  v: Array
  state: LinearState
  is_causal: bool
  chunk_size: int
  finish_fn: Callable[[Array, Array], Array]
  return_stats: bool = False
  nonnegative: bool = True
  context_axis: Optional[str] = None


def _empty_stats(c: _Call) -> AttentionStats:
  B, T, K, G, _ = c.phi_q.shape
  return empty.empty_stats(B, K * G, T)._replace(max_logit=None, logsumexp=None)


def _stats(c: _Call, materialised: bool) -> Optional[AttentionStats]:
  """The call's statistics (None unless asked): from the materialised weights (the quadratic
  engine) or without them (the others)."""
  if not c.return_stats:
    return None
  if c.phi_k.shape[1] == 0:
    return _empty_stats(c)
  if materialised:
    return _reference_stats(c.phi_q, c.phi_k, is_causal=c.is_causal)
  return _blocked_stats(
    c.phi_q, c.phi_k, is_causal=c.is_causal, nonnegative=c.nonnegative, block=c.chunk_size
  )


def _quadratic_engine(c: _Call):
  num, den, final = quadratic(c.phi_q, c.phi_k, c.v, c.state, is_causal=c.is_causal)
  return c.finish_fn(num, den), final, _stats(c, materialised=True)


def _recurrent_engine(c: _Call):
  num, den, final = recurrent(c.phi_q, c.phi_k, c.v, c.state)
  return c.finish_fn(num, den), final, _stats(c, materialised=False)


def _recurrent_unsupported(c: _Call) -> list[str]:
  if c.is_causal:
    return []
  return [
    "is_causal=False (it is the causal decode engine; use 'chunked', O(T) through "
    "phi(K)^T V, or 'quadratic' (= 'reference'), the masked quadratic product)"
  ]


def _chunked_engine(c: _Call):
  if c.is_causal:
    # The output is finished inside the chunk loop (no [B, T, ...] denominator array).
    out, _, final = chunked(
      c.phi_q, c.phi_k, c.v, c.state, chunk_size=c.chunk_size, finish_fn=c.finish_fn
    )
  else:
    num, den, final = noncausal(c.phi_q, c.phi_k, c.v, c.state)
    out = c.finish_fn(num, den)
  return out, final, _stats(c, materialised=False)


def _no_queries(c: _Call):
  """No queries: the empty output; the state still takes in the call's keys (non-causal)."""
  _, final, _ = _chunked_engine(c._replace(is_causal=False, return_stats=False))
  B, T, K, G, _ = c.phi_q.shape
  out = jnp.zeros((B, T, K, G, c.v.shape[-1]), jnp.float32)
  return out, final, _empty_stats(c) if c.return_stats else None


def context(call: tuple[_Call], implementation: Optional[str], local):
  """The linear op's context strategy: this device's shard enters with the sums of the shards
  before it (:func:`_context_states`) and runs ``local`` (the op's per-device computation)
  from there; the final state is the whole sequence's, on every device. Statistics: this
  device's rows against every key's features (gathered, O(T F)), the means over every
  device's rows."""
  (c,) = call
  entering, final = _context_states(
    c.phi_k, c.v, c.state, is_causal=c.is_causal, axis=c.context_axis
  )
  shard = c._replace(state=entering, context_axis=None, return_stats=False)
  out, _, _ = local((shard,), implementation)
  stats = None
  if c.return_stats:
    keys = jax.lax.all_gather(c.phi_k, c.context_axis, axis=1, tiled=True)
    stats = _blocked_stats(
      c.phi_q,
      keys,
      is_causal=c.is_causal,
      nonnegative=c.nonnegative,
      block=c.chunk_size,
      axis=c.context_axis,
    )
  return out, final, stats


# The longest call (max(T, S)) auto-dispatch gives the quadratic engine on a CPU. Measured with
# interleaved timing of both engines (causal, B=1, N=8, H=64, fp32, CPU under load;
# quadratic / chunked time): forward 0.93x at T=16, 0.47x at 64, 0.62x at 128, 1.55x at 256;
# gradient 0.92x, 0.83x, 0.81x, 1.25x. GPUs and TPUs keep the chunked engine (not measured).
QUADRATIC_MAX_LENGTH_CPU = 128

# The linear op: its call is ``(_Call,)``; every engine returns ``(out [B, T, K, G, Hv], final
# state, statistics or None)``.
ENGINES: dict[str, op.Engine] = recurrence.with_reference(
  {
    "recurrent": op.Engine("recurrent", _recurrent_engine, _recurrent_unsupported),
    "quadratic": op.Engine(
      "quadratic", _quadratic_engine, op.supports_everything, max_length=QUADRATIC_MAX_LENGTH_CPU
    ),
    "chunked": op.Engine("chunked", _chunked_engine, op.supports_everything),
  },
  REFERENCE_ENGINE,
)
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES: dict[str, tuple[str, ...]] = {"cpu": ("quadratic",)}
FALLBACK: tuple[str, ...] = ("chunked",)
OP = op.register(
  op.Op(
    "linear",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=_no_queries,
    is_empty=lambda c: c.phi_q.shape[1] == 0,
    context=context,
    context_axis=lambda c: c.context_axis,
    length=lambda c: max(c.phi_q.shape[1], c.phi_k.shape[1]),
    renamed=recurrence.RENAMED,
    samples=lambda: _samples(),
  )
)


def _prepare(
  q,
  k,
  v,
  *,
  feature_map,
  is_causal,
  normalize,
  implementation,
  chunk_size,
  initial_state,
  return_state,
  eps,
):
  B, T, S, N, K, H, Hv = validators.check_qkv(q, k, v)
  feature_map = _check_feature_map(feature_map, H)
  normalize = _canonical_normalize(normalize)
  implementation = op.check_implementation(OP, implementation, where="linear_attention")
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  validators.check_positive_int("chunk_size", chunk_size)
  validators.check_positive_float("eps", eps, allow_none=False)
  if is_causal and T != S:
    raise ValueError(
      f"causal linear attention needs as many queries as keys (a state carries earlier "
      f"keys), got q {validators.shape_of(q)} and k {validators.shape_of(k)}"
    )
  if feature_map.needs_consistent_scale:
    if normalize == "none":
      raise ValueError(
        f"feature_map {feature_map.kind!r} with stabilize=True scales rows by constants that "
        f"only a normalised output cancels; with normalize='none' draw it with stabilize=False"
      )
    if initial_state is not None or return_state:
      raise ValueError(
        f"feature_map {feature_map.kind!r} with stabilize=True takes its key constant from this "
        f"call's keys, so a state cannot be carried across calls; draw it with stabilize=False"
      )
  F = feature_map.num_features(H)
  state = (
    zeros_state(B, K, F, Hv)
    if initial_state is None
    else _check_state(initial_state, ((B, K, F, Hv), (B, K, F)))
  )
  return feature_map, normalize, implementation, state


def _linear_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  feature_map: feature_maps.FeatureMap = feature_maps.elu_plus_one,
  is_causal: bool = False,
  normalize: Union[Normalize, bool] = "denominator",
  implementation: Optional[ImplementationName] = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  initial_state: Optional[LinearState] = None,
  return_state: bool = False,
  return_stats: bool = False,
  eps: float = DEFAULT_EPS,
  context_axis: Optional[str] = None,
):
  """Kernel-feature (linear) attention.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``; ``N % K == 0`` (GQA: query head ``n`` reads
      key/value head ``n // (N // K)``; K/V are never repeated).
    v: values ``[B, S, K, Hv]``.
    feature_map: a :class:`attnjax.feature_maps.FeatureMap` (a pytree: its
      kind is static, a random projection is a traced array).
    is_causal: query ``i`` sees keys ``j <= i`` (needs ``T == S``).
    normalize: ``"denominator"`` (or True), ``"none"`` (or False),
      ``"output_rms"`` (module docstring).
    implementation: ``"quadratic"`` (the masked quadratic product), ``"recurrent"``
      (causal only), ``"chunked"``, or ``"reference"``, the readable
      definition: here ``"quadratic"``; None: auto, chosen per platform when the
      program is lowered (``"chunked"``, O(T); on a CPU, ``"quadratic"`` for calls up
      to 128 tokens). The names are the linear op's engines;
      ``"parallel"``, the old name of ``"quadratic"``, still works and warns once.
      They mean the same engine in every recurrent family.
    chunk_size: chunk length of the chunked engine.
    initial_state: a :class:`.LinearState` (``kv_sum [B, K, F, Hv]``,
      ``k_sum [B, K, F]``) of keys seen before this call; None = empty.
    return_state: the primary result becomes ``(out, final state)``, the
      final :class:`.LinearState` in float32.
    return_stats: return ``(primary result, stats)``, where ``stats`` is the
      :class:`.AttentionStats` of the implied weights
      ``w_ij = phi(q_i).phi(k_j)`` over this call's keys (the initial state is
      not included): ``row_sum`` (mean raw row sum, O(T)), ``sink_mass`` and
      ``entropy`` on the row-normalised ``|w|``; ``max_logit`` and
      ``logsumexp`` are None (there are no logits). Where the quadratic engine runs
      (``"quadratic"``, ``"reference"``) they come from the materialised matrix; otherwise
      ``row_sum`` (and ``sink_mass`` for nonnegative maps) are O(T) and the
      entropy is a scan over query blocks, O(T S) time and O(chunk_size S)
      memory.
    eps: added to the denominator (``"denominator"``) or inside the RMS
      (``"output_rms"``).
    context_axis: None, or the ``jax.shard_map`` mesh axis the sequence is
      sharded over (context parallelism): called inside ``shard_map`` with q,
      k, v sharded along time in contiguous shards (``initial_state`` and
      the feature map whole on every device), returns this device's shard of
      the output, equal to the unsharded call in value and gradient (q, k, v,
      the feature map's arrays, ``initial_state``). Each device's
      ``phi(K)^T V`` and ``sum phi(K)`` are stacked on every device (one
      all-reduce); causal: shard ``p`` enters with ``initial_state`` plus
      shards ``0 .. p - 1`` and runs its own pass (any ``implementation``)
      from there; non-causal: with every other shard's sums (the global
      ``K^T V`` and normaliser). ``return_state`` gives the whole sequence's
      final state on every device. ``return_stats``: this device's rows
      against every key's features (gathered, O(T F)), the means over every
      device's rows, the same on every device. Not with a ``stabilize=True``
      feature map (its key constant comes from every key of the sequence).

  Returns:
    ``out`` ``[B, T, N, Hv]`` in the input dtype; ``(out, state)`` with
    ``return_state``; ``(out, stats)`` with ``return_stats``;
    ``((out, state), stats)`` with both (module docstring: ``return_stats``
    wraps the primary result, as in every family).

  References:
    Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive
    Transformers with Linear Attention".
    Qin et al. 2022, "The Devil in Linear Transformer" (output normalisation).
    Choromanski et al. 2021, "Rethinking Attention with Performers".
  """
  feature_map, normalize, implementation, state = _prepare(
    q,
    k,
    v,
    feature_map=feature_map,
    is_causal=is_causal,
    normalize=normalize,
    implementation=implementation,
    chunk_size=chunk_size,
    initial_state=initial_state,
    return_state=return_state,
    eps=eps,
  )
  if context_axis is not None:
    _check_context(context_axis, feature_map=feature_map, q=q, k=k)
  B, T, N, _ = q.shape
  K, Hv = k.shape[2], v.shape[3]
  call = _Call(
    phi_q=group_queries(feature_map(q, is_query=True), K),
    phi_k=feature_map(k, is_query=False),
    v=v.astype(jnp.float32),
    state=state,
    is_causal=is_causal,
    chunk_size=chunk_size,
    finish_fn=functools.partial(finish, normalize=normalize, eps=eps),
    return_stats=return_stats,
    nonnegative=feature_map.nonnegative,
    context_axis=context_axis,
  )
  out, final, stats = op.run(OP, (call,), implementation)
  out = jnp.reshape(out, (B, T, N, Hv)).astype(q.dtype)
  result = (out, final) if return_state else out
  return (result, stats) if return_stats else result


LINEAR_STATIC = (
  "is_causal",
  "normalize",
  "implementation",
  "chunk_size",
  "return_state",
  "return_stats",
  "eps",
  "context_axis",
)

linear_attention = static.jit(_linear_attention, LINEAR_STATIC)


def _linear_attention_weights(
  q: Array,
  k: Array,
  *,
  feature_map: feature_maps.FeatureMap = feature_maps.elu_plus_one,
  is_causal: bool = False,
  normalize: Union[Normalize, bool] = "denominator",
  eps: float = DEFAULT_EPS,
) -> Array:
  """The implied attention matrix ``[B, N, T, S]`` (float32), for small ``T``.

  ``"denominator"``: ``w_ij / (sum_l w_il + eps)`` with ``w_ij = phi(q_i).phi(k_j)``
  (masked keys 0), so ``out = weights @ v``. ``"none"`` and ``"output_rms"``:
  the raw ``w_ij`` (``output_rms`` then normalises ``w @ v`` per row, which no
  weight matrix expresses). Materialises ``T x S``: notebooks and the
  approximation experiment, not long sequences.

  Args:
    q: ``[B, T, N, H]``.
    k: ``[B, S, K, H]``.
    feature_map: as :func:`.linear_attention`.
    is_causal: mask keys after the query.
    normalize: as :func:`.linear_attention`.
    eps: as :func:`.linear_attention`.

  Returns:
    float32 ``[B, N, T, S]``.

  Raises:
    ValueError, TypeError: bad shapes or options (as :func:`attnjax.linear_attention`).
  """
  validators.check_qkv(q, k, k)
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  feature_map = _check_feature_map(feature_map, H)
  normalize = _canonical_normalize(normalize)
  phi_q = group_queries(feature_map(q, is_query=True), K)
  phi_k = feature_map(k, is_query=False)
  w = jnp.reshape(einsum("btkgf,bskf->bkgts", phi_q, phi_k), (B, N, T, S))
  if is_causal:
    w = jnp.where(masks.causal_mask(T, S), w, 0.0)
  if normalize == "denominator":
    w = w / (jnp.sum(w, axis=-1, keepdims=True) + eps)
  return w


linear_attention_weights = static.jit(_linear_attention_weights, ("is_causal", "normalize", "eps"))


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      linear_attention,
      options=dict(is_causal=True, chunk_size=8),
      self_only=True,
      stats=True,
      state=True,
      flags=("is_causal", "return_stats", "return_state"),
      static=(("chunk_size", 2),),
      choices=(("normalize", NORMALIZE + (True, False)), ("chunk_size", (1, 2, 3, 64))),
      defects=(("normalize", (1, 0, "denom")), ("chunk_size", (0,))),
      context=True,
    ),
  )
