"""Gated linear attention: a linear-attention state that decays, per head or per key channel.

Implementation behind the public module :mod:`attnjax.gated_linear`.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, op, static
from attnjax._src.ops import recurrence
from attnjax._src.numerics import einsum
from attnjax._src.ops.recurrence import DEFAULT_CHUNK_SIZE
from attnjax._src.kernels.recurrent import chunks, gla_chunk

Array = jnp.ndarray

# The engine "reference" names: the recurrence, the family's definition.
REFERENCE_ENGINE = "recurrent"
# Query sub-block of the chunked engine's per-channel intra-chunk weights (secondary chunking).
SUB_BLOCK = 16


# ---------------------------------------------------------------------------
# The engines' computations. Each takes float32 grouped queries q [B, T, K, G, H] (already scaled),
# keys k [B, T, K, H], values v [B, T, K, Hv], decays g [B, T, K, G, D] with
# D = 1 (scalar per head) or D = H (per key channel), a boolean reset [B, T]
# (True where a new segment starts; never at t = 0) and the state
# [B, K, G, H, Hv]; each returns (out [B, T, K, G, Hv], final state).


def recurrent(q: Array, k: Array, v: Array, g: Array, reset: Array, state: Array):
  """The recurrent engine (the reference): ``lax.scan`` over time carrying ``S``; the decode engine.

  Args:
    q: queries ``[B, T, K, G, H]`` (``G = N // K`` query heads per key/value head).
    k: keys ``[B, T, K, H]``.
    v: values ``[B, T, K, Hv]``.
    g: log decays ``[B, T, K, G, D]`` (``D = 1``: one per head; ``D = H``: per key
      channel), ``<= 0``.
    reset: ``[B, T]``, true (1) where the state restarts before the token.
    state: float32 ``[B, K, G, H, Hv]``, the state before the first token.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """

  def step(s, xs):
    q_t, k_t, v_t, g_t, r_t = xs  # [B,K,G,H], [B,K,H], [B,K,Hv], [B,K,G,D], [B]
    decayed = jnp.exp(g_t)[..., None] * s  # [B,K,G,D,1] * [B,K,G,H,Hv]
    decayed = jnp.where(jnp.reshape(r_t, (-1, 1, 1, 1, 1)), 0.0, decayed)
    s = decayed + (k_t[:, :, :, None] * v_t[:, :, None, :])[:, :, None]
    return s, einsum("bkgh,bkghv->bkgv", q_t, s)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, reset))
  final, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), final


def _sum_after(g: Array, axis: int) -> Array:
  """``sum_{t > j} g_t`` along ``axis`` (an exclusive reverse cumulative sum; 0 at the end)."""
  total = jnp.flip(jnp.cumsum(jnp.flip(g, axis=axis), axis=axis), axis=axis)  # sum_{t >= j}
  rest = jax.lax.slice_in_dim(total, 1, None, axis=axis)
  return jnp.concatenate(
    [rest, jnp.zeros_like(jax.lax.slice_in_dim(total, 0, 1, axis=axis))], axis=axis
  )


def _decayed_scores(q: Array, k: Array, bq: Array, bk: Array, keep: Array) -> Array:
  """``sum_h q_ih k_jh exp(bq_ih - bk_jh)`` on ``keep`` (0 elsewhere), materialising ``[i, j, D]``.

  ``q [B, I, K, G, H]``, ``k [B, J, K, H]``, ``bq [B, I, K, G, D]``,
  ``bk [B, J, K, G, D]`` of the same positions (``I == J``), ``keep [B, I, J]``
  where ``bq_i <= bk_j``. Returns ``[B, K, G, I, J]``. Masked exponents are set
  to 0 before ``exp``; so is the diagonal's, which is 0 (its decay is 1 and
  passes no gradient to ``b``: otherwise two O(1) terms of opposite sign would
  cancel there, leaving float32 noise in the decays' gradient).
  """
  off_diag = jnp.logical_not(jnp.eye(keep.shape[1], keep.shape[2], dtype=bool))
  expo_keep = jnp.logical_and(keep, off_diag[None])[:, None, None, :, :, None]
  keep = keep[:, None, None, :, :, None]  # [B, 1, 1, i, j, 1]
  diff = (
    jnp.moveaxis(bq, 1, 3)[:, :, :, :, None, :] - jnp.moveaxis(bk, 1, 3)[:, :, :, None, :, :]
  )  # [B, K, G, i, j, D]
  decay = jnp.where(keep, jnp.exp(jnp.where(expo_keep, diff, 0.0)), 0.0)
  if bq.shape[-1] == 1:
    return einsum("bikgh,bjkh->bkgij", q, k) * decay[..., 0]
  return einsum("bikgh,bjkh,bkgijh->bkgij", q, k, decay)


def _block_terms(q: Array, k: Array, g: Array, reset: Array):
  """The state-independent terms of the masked quadratic form on one block of ``C`` tokens.

  ``b_i`` is the cumulative decay from the block's start to ``i`` (inclusive),
  ``d_i`` counts the resets in the block up to ``i``. Query ``i`` reads key
  ``j <= i`` of its own segment (``d_j == d_i``) with weight ``exp(b_i - b_j)``
  per channel, and the incoming state with ``exp(b_i)`` when no reset came
  before it in the block (``d_i == 0``). Every exponent is ``<= 0``: masked
  entries are set to 0 before ``exp`` (so neither values nor gradients see an
  overflow) and their weight to 0 after.

  Args:
    q, k, g, reset: one block, shapes as the engines take them (``T = C``).

  Returns:
    ``(w [B, K, G, C, C], q_in [B, C, K, G, H], k_end [B, C, K, G, H], carry
    [B, K, G, D])``: the intra-block weights, the queries decayed from the
    block's start (0 after a reset), the keys decayed to the block's end (0
    unless in the last segment), and the incoming state's decay to the end.
  """
  C = q.shape[1]
  b = jnp.cumsum(g, axis=1)  # [B, C, K, G, D]
  d = jnp.cumsum(reset.astype(jnp.int32), axis=1)  # [B, C]
  causal = jnp.tril(jnp.ones((C, C), bool))
  keep = jnp.logical_and(causal[None], d[:, :, None] == d[:, None, :])  # [B, i, j]
  w = _decayed_scores(q, k, b, b, keep)
  fresh = (d == 0)[:, :, None, None, None]  # [B, C, 1, 1, 1]: no reset so far in the block
  q_in = jnp.where(fresh, q * jnp.exp(b), 0.0)  # [B, C, K, G, H]
  # State after the block: keys of the last segment, decayed to the block's end.
  same = (d == d[:, -1:])[:, :, None, None, None]  # [B, C, 1, 1, 1]
  # Exponent of key j: sum_{t > j} g_t, an exclusive reverse cumulative sum (not
  # b_C - b_j): a key whose decay to the end is exp(0) = 1 (the last one, or the
  # last real one before padding) then sends no pair of cancelling O(1) terms to g's
  # gradient, which would bury its true, tiny value under a strong gate.
  to_go = _sum_after(g, axis=1)  # sum_{t > j} g_t
  to_end = jnp.where(same, jnp.exp(jnp.where(same, to_go, 0.0)), 0.0)
  k_end = to_end * k[:, :, :, None, :]  # [B, C, K, G, H]
  carry = jnp.where((d[:, -1] == 0)[:, None, None, None], jnp.exp(b[:, -1]), 0.0)
  return w, q_in, k_end, carry


def _block_state(xs, state: Array):
  """The state's part of one block: ``(out [B, C, K, G, Hv], state after the block)``."""
  w, q_in, k_end, carry, v = xs
  out = einsum("bkgij,bjkv->bikgv", w, v) + einsum("bikgh,bkghv->bikgv", q_in, state)
  new_state = carry[..., None] * state + einsum("bckgh,bckv->bkghv", k_end, v)
  return out, new_state


def quadratic(q: Array, k: Array, v: Array, g: Array, reset: Array, state: Array):
  """Masked quadratic form over the whole sequence (one block); O(T^2) (times H per channel).

  Args:
    q: queries ``[B, T, K, G, H]`` (``G = N // K`` query heads per key/value head).
    k: keys ``[B, T, K, H]``.
    v: values ``[B, T, K, Hv]``.
    g: log decays ``[B, T, K, G, D]`` (``D = 1``: one per head; ``D = H``: per key
      channel), ``<= 0``.
    reset: ``[B, T]``, true (1) where the state restarts before the token.
    state: float32 ``[B, K, G, H, Hv]``, the state before the first token.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """
  return _block_state(_block_terms(q, k, g, reset) + (v,), state)


def chunked(q: Array, k: Array, v: Array, g: Array, reset: Array, state: Array, *, chunk_size: int):
  """O(T): the quadratic form inside chunks, a scan carrying the state across them.

  The scan is ``attnjax._src.kernels.recurrent.chunks.chunk_scan``, whose backward keeps each
  chunk's inputs and incoming state and recomputes the chunk
  (``_block_terms``, then ``_block_state``). Time is padded up to a
  multiple of ``chunk_size`` with zero keys, zero decay and no reset, so padded
  tokens change neither the state nor any real output; padded output rows are
  dropped.

  The state-independent terms are computed inside the scan, one chunk at a
  time: computed for many chunks at once (``lax.map`` / ``vmap``), the extra
  batch axis makes rank-7/8 reductions with unit axes that crash jaxlib
  0.10.2's CPU backend (``chunk_size=32``: a segfault in its "ynn" fusion,
  jax-ml/jax#40412).

  Args:
    q: queries ``[B, T, K, G, H]``.
    k: keys ``[B, T, K, H]``.
    v: values ``[B, T, K, Hv]``.
    g: log decays ``[B, T, K, G, D]``, ``<= 0`` (``D`` 1 or ``H``).
    reset: ``[B, T]``, where the state restarts.
    state: float32 ``[B, K, G, H, Hv]``.
    chunk_size: tokens per chunk.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """
  C = min(chunk_size, q.shape[1])
  xs = tuple(chunks.to_chunks(x, C) for x in (q, k, v, g, reset.astype(jnp.float32)))
  out, final = chunks.chunk_scan(_chunk_block, state, xs)
  return chunks.from_chunks(out, q.shape[1]), final


def _chunk_block(xs, state):
  q, k, v, g, reset = xs
  if g.shape[-1] > 1:  # per key channel: the hand-written chunk and backward
    return gla_chunk.gla_chunk(q, k, v, g, reset, state, SUB_BLOCK)
  return _block_state(_block_terms(q, k, g, reset) + (v,), state)


# ---------------------------------------------------------------------------
# Public function.


def _check_log_decay(log_decay, B: int, T: int, N: int, H: int):
  """Returns ``log_decay`` as float32 ``[B, T, N, D]`` with ``D`` in ``{1, H}``."""
  if log_decay is None:
    raise TypeError(
      "log_decay is required: [B, T, N] (scalar per head) or [B, T, N, H] "
      "(per key channel), values <= 0"
    )
  validators.check_floating("log_decay", log_decay)
  shape = validators.shape_of(log_decay)
  if len(shape) <= 3:
    target, per_channel = (B, T, N), False
  elif len(shape) == 4:
    target, per_channel = (B, T, N, H), True
  else:
    raise ValueError(
      f"log_decay must broadcast to [B, T, N] = {(B, T, N)} or "
      f"[B, T, N, H] = {(B, T, N, H)}, got rank {len(shape)} shape {shape}"
    )
  if any(d != 1 and d != t for d, t in zip(shape[::-1], target[::-1])):
    letters = "[B, T, N, H]" if per_channel else "[B, T, N]"
    raise ValueError(f"log_decay of shape {shape} is not broadcastable to {letters} = {target}")
  g = jnp.asarray(log_decay, jnp.float32)
  g = jnp.broadcast_to(jnp.reshape(g, (1,) * (len(target) - g.ndim) + g.shape), target)
  return g if per_channel else g[..., None]


# The gated_linear op: its call is ``(x: recurrence.Inputs, extra, chunk_size)``; every engine
# returns ``(out [B, T, K, G, Hv], final state)``.
ENGINES: dict[str, op.Engine] = recurrence.engines(
  recurrent=recurrent, quadratic=quadratic, chunked=chunked, reference=REFERENCE_ENGINE
)
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES, FALLBACK = recurrence.PREFERENCES, recurrence.FALLBACK
OP = recurrence.state_passing_op("gated_linear", ENGINES, PREFERENCES, FALLBACK, lambda: _samples())


def _gated_linear_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  log_decay: Array,
  scale: Optional[float] = None,
  initial_state: Optional[Array] = None,
  return_state: bool = False,
  segment_ids: Optional[Array] = None,
  implementation: Optional[ImplementationName] = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  context_axis: Optional[str] = None,
):
  """Causal linear attention with a decaying state (RetNet, Mamba-2 decay, GLA).

  Per query head ``n`` (reading key/value head ``n // (N // K)``):

      S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,     o_t = scale * S_t^T q_t,

  ``S_0 = initial_state``, ``g = log_decay``. Decays are applied as ``exp`` of
  differences of cumulative sums of ``g`` that are ``<= 0`` (module
  docstring), so strong gates (``g = -20``) underflow to 0 and never overflow.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, T, K, H]``, ``N % K == 0`` (GQA; K/V are never repeated).
    v: values ``[B, T, K, Hv]``.
    log_decay: ``g <= 0`` (float; not checked, as values are traced). Rank <= 3
      broadcasts to ``[B, T, N]``, one decay per head (RetNet: a constant;
      Mamba-2: data-dependent); rank 4 broadcasts to ``[B, T, N, H]``, one
      gate per key channel (GLA).
    scale: output scale (a static positive float); None means ``H ** -0.5``.
    initial_state: ``[B, N, H, Hv]`` state before the first token (cast to
      float32); None = zeros.
    return_state: also return the final state ``[B, N, H, Hv]`` (float32).
    segment_ids: integer ``[B, T]``; where the id changes from ``t - 1`` to
      ``t`` the state is reset (``t`` sees no earlier key and no initial
      state). Position 0 never resets.
    implementation: ``"recurrent"`` (scan over time), ``"quadratic"`` (masked
      quadratic), ``"chunked"``, or ``"reference"``, the readable definition:
      here the recurrence (``"recurrent"``); None means ``"chunked"``. The
      names are the engines of :data:`~attnjax._src.ops.gated_linear.attention.OP`;
      ``"parallel"``, the old name of ``"quadratic"``, still works and warns once. They mean
      the same engine in every recurrent family (``attnjax._src.ops.recurrence``).
    chunk_size: chunk length of ``"chunked"``; any ``T`` works.
    context_axis: None, or the ``jax.shard_map`` mesh axis the sequence is sharded
      over (context parallelism, ``attnjax._src.parallel.recurrent``): called inside
      ``shard_map`` with q, k, v, the per-token arguments and ``segment_ids`` sharded
      along time (``initial_state`` whole), returns this device's shard of the output
      (and the final state of the whole sequence, on every device), equal to the
      unsharded call.

  Returns:
    ``out`` ``[B, T, N, Hv]`` in the input dtype, or ``(out, state)`` with
    ``return_state``.

  Raises:
    ValueError, TypeError: bad shapes, dtypes or options (message names the
      argument and the shapes seen).

  References:
    Sun et al. 2023, "Retentive Network: A Successor to Transformer for Large
    Language Models".
    Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient
    Algorithms Through Structured State Space Duality" (Mamba-2).
    Yang et al. 2024, "Gated Linear Attention Transformers with
    Hardware-Efficient Training".
  """
  x = recurrence.prepare(
    "gated_linear_attention",
    q,
    k,
    v,
    scale=scale,
    initial_state=initial_state,
    return_state=return_state,
    segment_ids=segment_ids,
    implementation=implementation,
    chunk_size=chunk_size,
    family=OP,
    context_axis=context_axis,
  )
  B, T, N, H = q.shape
  g = recurrence.by_kv_head(_check_log_decay(log_decay, B, T, N, H), k.shape[2])
  extra = (g,)
  out, final = op.run(OP, (x, extra, chunk_size), x.implementation)
  return recurrence.finish(out, final, q, return_state=return_state)


GATED_LINEAR_STATIC = ("scale", "return_state", "implementation", "chunk_size", "context_axis")

gated_linear_attention = static.jit(_gated_linear_attention, GATED_LINEAR_STATIC)


def _samples() -> tuple[op.Sample, ...]:
  def gates(q, k, v):
    # Decays in (-1, 0): a state that forgets over a few tokens, never all at once.
    log_decay = -np.logaddexp(0.0, recurrence.per_step(q, 1)).astype(np.float32) * 0.5
    return q, k, v, dict(log_decay=jnp.asarray(log_decay))

  return (recurrence.state_passing_sample(gated_linear_attention, gates),)
