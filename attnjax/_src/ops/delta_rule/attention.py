"""Delta-rule linear attention: the update of DeltaNet and Gated DeltaNet.

Implementation behind the public module :mod:`attnjax.delta_rule`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, op, static
from attnjax._src.ops import recurrence
from attnjax._src.numerics import einsum
from attnjax._src.ops.recurrence import DEFAULT_CHUNK_SIZE
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.recurrent import chunks

Array = jnp.ndarray

# The engine "reference" names: the recurrence, the family's definition.
REFERENCE_ENGINE = "recurrent"


# ---------------------------------------------------------------------------
# The engines' computations. Each takes float32 q [B, T, K, Gq, H] (already scaled; Gq = G,
# or 1 where a key head's query serves its G value heads), k [B, T, K, H], v [B, T, K Gv, Hv]
# (Gv = 1: one value per key head, GQA; Gv = G: one per state, value-head grouping), beta
# [B, T, K, G], the log decay g [B, T, K, G] (one per state) or [B, T, K, G, H] (per key channel, KDA), a
# boolean reset [B, T] (True: the state is zeroed before token t) and the state
# [B, K, G, H, Hv]; each returns (out [B, T, K, G, Hv], final state).


def _by_key_head(v: Array, K: int) -> Array:
  """Values ``[..., K Gv, Hv]`` as ``[..., K, Gv, Hv]`` (``Gv`` 1 or the group size)."""
  return jnp.reshape(v, v.shape[:-2] + (K, v.shape[-2] // K, v.shape[-1]))


def _decay_shape(decay: Array) -> Array:
  """A per-state factor ``[B, K, G]`` (or per channel ``[B, K, G, H]``) shaped to multiply
  a state ``[B, K, G, H, Hv]``."""
  return decay[..., None, None] if decay.ndim == 3 else decay[..., None]


def recurrent(q, k, v, beta, g, reset, state):
  """The decode engine (the reference): ``lax.scan`` over time, one delta-rule update per token.

  Args:
    q: queries ``[B, T, K, Gq, H]`` (``Gq = G``, or 1: shared by the group's value heads).
    k: keys ``[B, T, K, H]`` (L2-normalised by the caller).
    v: values ``[B, T, K Gv, Hv]`` (``Gv`` 1 or ``G``).
    beta: write strengths ``[B, T, K, G]`` in ``(0, 1)``.
    g: log decays ``[B, T, K, G]`` or per key channel ``[B, T, K, G, H]``, ``<= 0``.
    reset: ``[B, T]``, true (1) where the state restarts before the token.
    state: float32 ``[B, K, G, H, Hv]``, the state before the first token.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """
  K = k.shape[2]

  def step(s, xs):
    q_t, k_t, v_t, b_t, g_t, r_t = xs  # [B,K,Gq,H], [B,K,H], [B,K Gv,Hv], [B,K,G](,H), [B]
    keep = jnp.where(r_t, 0.0, 1.0)
    a_t = jnp.exp(g_t) * jnp.reshape(keep, (-1,) + (1,) * (g_t.ndim - 1))
    s = _decay_shape(a_t) * s
    k_s = einsum("bkh,bkghv->bkgv", k_t, s)  # S_{t-1}^T k_t (decayed)
    delta = b_t[..., None] * (_by_key_head(v_t, K) - k_s)  # [B, K, G, Hv]
    s = s + k_t[:, :, None, :, None] * delta[..., None, :]
    q_t = jnp.broadcast_to(q_t, s.shape[:-1])
    return s, einsum("bkgh,bkghv->bkgv", q_t, s)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, g, reset))
  final, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), final


def quadratic(q, k, v, beta, g, reset, state):
  """The chunk computation over the whole sequence as one chunk (``_chunk_block``, no scan).

  Args:
    q: queries ``[B, T, K, Gq, H]`` (``Gq = G``, or 1: shared by the group's value heads).
    k: keys ``[B, T, K, H]`` (L2-normalised by the caller).
    v: values ``[B, T, K Gv, Hv]`` (``Gv`` 1 or ``G``).
    beta: write strengths ``[B, T, K, G]`` in ``(0, 1)``.
    g: log decays ``[B, T, K, G]`` or per key channel ``[B, T, K, G, H]``, ``<= 0``.
    reset: ``[B, T]``, true (1) where the state restarts before the token.
    state: float32 ``[B, K, G, H, Hv]``, the state before the first token.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """
  return _chunk_block((q, k, v, beta, g, reset.astype(jnp.float32)), state)


def chunked(q, k, v, beta, g, reset, state, *, chunk_size: int):
  """The WY / UT-transform chunk computation (module docstring): a scan over chunks carrying the state.

  Each chunk (``_chunk_block``) computes its state-independent terms (the
  decays, the triangular solve for ``U`` and ``W``, the decayed ``Q K^T``) and
  then the matmuls that read the state. The scan is
  ``attnjax._src.kernels.recurrent.chunks.chunk_scan``, whose backward keeps each chunk's inputs
  and incoming state and recomputes the chunk, so memory for the backward is
  O(T), about 1.7 inputs' worth (``tests/test_chunks.py``); the solve has its
  own VJP (``unit_lower_solve``). Computing the terms one chunk at a time
  inside the scan is also faster here than batching them over chunks
  (``lax.map`` / ``vmap``), whose batched small matmuls XLA's CPU backend lays
  out worse: T=4096 forward+backward 331 ms against 399 ms. Time is padded to a
  multiple of ``chunk_size`` with ``k = v = beta = g = 0`` (those steps leave
  the state unchanged) and padded rows are dropped.

  Args:
    q: queries ``[B, T, K, Gq, H]``.
    k: keys ``[B, T, K, H]``.
    v: values ``[B, T, K Gv, Hv]``.
    beta: ``[B, T, K, G]``.
    g: log decays ``[B, T, K, G]`` or ``[B, T, K, G, H]``.
    reset: ``[B, T]``, where the state restarts.
    state: float32 ``[B, K, G, H, Hv]``.
    chunk_size: tokens per chunk.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """
  C = min(chunk_size, q.shape[1])
  xs = tuple(chunks.to_chunks(x, C) for x in (q, k, v, beta, g, reset.astype(jnp.float32)))
  out, final = chunks.chunk_scan(_chunk_block, state, xs)
  return chunks.from_chunks(out, q.shape[1]), final


def unit_lower_inverse(a: Array) -> Array:
  """``(I + a)^{-1}`` for strictly lower-triangular ``a [..., C, C]``, by block doubling.

  Diagonal blocks of size ``s`` are inverted for ``s = 1, 2, 4, ...``: a block
  of ``2s`` is ``[[L11, 0], [L21, L22]]`` with inverse ``[[X11, 0], [-X22 L21
  X11, X22]]``, so ``log2(C)`` rounds of batched matmuls (``C`` padded to a
  power of two with the identity). This replaces LAPACK's batched ``trsm``,
  which on jaxlib 0.10.2's CPU backend takes the XLA thread pool for its batch
  and deadlocks when two solves run at once (both pool threads wait for
  subtasks that no free thread can run), as the chunk-parallel forward and
  backward solves do; block doubling is plain matmuls, which also vectorise
  better than a row-by-row substitution.

  Args:
    a: strictly lower-triangular ``[..., C, C]``.

  Returns:
    ``(I + a)^{-1}``, ``[..., C, C]`` (unit lower-triangular).
  """
  C = a.shape[-1]
  P = 1 << max(C - 1, 0).bit_length()
  lead = a.shape[:-2]
  eye = jnp.reshape(jnp.eye(P, dtype=a.dtype), (1,) * len(lead) + (P, P))
  m = eye + jnp.pad(a, [(0, 0)] * len(lead) + [(0, P - C), (0, P - C)])
  inv = jnp.ones(lead + (P, 1, 1), a.dtype)  # the 1 x 1 diagonal blocks of a unit diagonal
  s = 1
  while s < P:
    n = P // (2 * s)
    pairs = jnp.reshape(m, lead + (n, 2 * s, n, 2 * s))
    blocks = jnp.moveaxis(jnp.diagonal(pairs, axis1=-4, axis2=-2), -1, -3)  # [..., n, 2s, 2s]
    low = blocks[..., s:, :s]
    inv = jnp.reshape(inv, lead + (n, 2, s, s))
    x11, x22 = inv[..., 0, :, :], inv[..., 1, :, :]
    x21 = -einsum("...ij,...jk,...kl->...il", x22, low, x11)
    top = jnp.concatenate([x11, jnp.zeros_like(x11)], axis=-1)
    bottom = jnp.concatenate([x21, x22], axis=-1)
    inv = jnp.concatenate([top, bottom], axis=-2)  # [..., n, 2s, 2s]
    s *= 2
  return jnp.reshape(inv, lead + (P, P))[..., :C, :C]


@autodiff.custom_vjp
def unit_lower_solve(a: Array, rhs: Array) -> Array:
  """``(I + a)^{-1} rhs`` for strictly lower-triangular ``a [..., C, C]``, ``rhs [..., C, D]``.

  The inverse comes from :func:`.unit_lower_inverse`. The VJP is the solve's own
  (with ``X`` the solution): ``d rhs = (I + a)^{-T} dX`` and ``da = -tril(d rhs
  X^T, -1)``, two matmuls with the kept inverse, instead of differentiating
  the ``log2(C)`` rounds of block doubling.

  Args:
    a: strictly lower-triangular ``[..., C, C]``.
    rhs: ``[..., C, D]``.

  Returns:
    ``X = (I + a)^{-1} rhs``, ``[..., C, D]``.
  """
  return einsum("...cd,...de->...ce", unit_lower_inverse(a), rhs)


def _unit_lower_solve_fwd(a, rhs):
  inv = unit_lower_inverse(a)
  x = einsum("...cd,...de->...ce", inv, rhs)
  return x, (inv, x)


def _unit_lower_solve_bwd(res, dx):
  inv, x = res
  d_rhs = einsum("...dc,...de->...ce", inv, dx)
  C = inv.shape[-1]
  strict = jnp.reshape(jnp.tril(jnp.ones((C, C), bool), -1), (1,) * (inv.ndim - 2) + (C, C))
  da = jnp.where(strict, -einsum("...ce,...de->...cd", d_rhs, x), 0.0)
  return da, d_rhs


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def _chunk_terms(q_c, k_c, v_c, b_c, g_c, r_c):
  """One chunk's state-independent terms: ``(U, W, Q K^T * Gamma, queries reading S_0, keys
  reaching the next state, the state's decay over the chunk)``.

  With a scalar decay per state, ``K K^T`` is computed once per key head and ``Q K^T`` once
  per query (``Gq = 1``: once per key head, for the ``G`` value heads it serves); with a
  per-channel decay (KDA) the pairs carry ``exp(G_t - G_j)`` per channel, ``[C, C, H]``,
  exponents ``<= 0`` only.
  """
  B, C, K, _, H = q_c.shape
  G = b_c.shape[-1]
  Hv = v_c.shape[-1]
  per_channel = g_c.ndim == 5
  idx = jnp.arange(C)
  strict = jnp.reshape(idx[:, None] > idx[None, :], (1, 1, 1, C, C))  # j < t
  causal = jnp.reshape(idx[:, None] >= idx[None, :], (1, 1, 1, C, C))  # j <= t
  b_c = jnp.transpose(b_c, (0, 2, 3, 1))  # [B, K, G, C]
  doc = jnp.cumsum(r_c.astype(jnp.int32), axis=1)  # resets so far in the chunk, [B, C]
  from_start = (doc == 0)[:, None, None, :]  # S_0 reaches token t
  same = (doc[:, :, None] == doc[:, None, :])[:, None, None]  # [B, 1, 1, C, C]
  live = jnp.logical_and(same, causal)
  kh = jnp.transpose(k_c, (0, 2, 1, 3))  # [B, K, C, H]
  qh = jnp.transpose(q_c, (0, 2, 3, 1, 4))  # [B, K, Gq, C, H]
  vh = jnp.transpose(_by_key_head(v_c, K), (0, 2, 3, 1, 4))  # [B, K, Gv, C, Hv]
  if per_channel:
    gam = jnp.cumsum(jnp.transpose(g_c, (0, 2, 3, 1, 4)), axis=3)  # G_t, [B, K, G, C, H]
    on = live[..., None]
    diff = gam[..., :, None, :] - gam[..., None, :, :]  # [B, K, G, C, C, H]
    dec = jnp.where(on, jnp.exp(jnp.where(on, diff, 0.0)), 0.0)
    kk = einsum("bkch,bkdh,bkgcdh->bkgcd", kh, kh, dec)
    qb = jnp.broadcast_to(qh, (B, K, G, C, H))
    qk = einsum("bkgch,bkdh,bkgcdh->bkgcd", qb, kh, dec)
    decay0 = jnp.where(from_start[..., None], jnp.exp(gam), 0.0)  # [B, K, G, C, H]
    rhs_k = b_c[..., None] * decay0 * kh[:, :, None]
    q_s0 = decay0 * qb
    k_end = dec[..., -1, :, :] * kh[:, :, None]  # exp(G_C - G_j) k_j, last document
    carry = decay0[..., -1, :]  # [B, K, G, H]
  else:
    gam = jnp.cumsum(jnp.transpose(g_c, (0, 2, 3, 1)), axis=-1)  # G_t, [B, K, G, C]
    diff = gam[..., :, None] - gam[..., None, :]
    gamma = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # [B, K, G, C, C]
    kk = gamma * einsum("bkch,bkdh->bkcd", kh, kh)[:, :, None]
    qk = einsum("bkgch,bkdh->bkgcd", qh, kh) * gamma
    decay0 = jnp.where(from_start, jnp.exp(gam), 0.0)  # [B, K, G, C]
    rhs_k = (b_c * decay0)[..., None] * kh[:, :, None]
    q_s0 = decay0[..., None] * qh
    k_end = gamma[..., -1, :][..., None] * kh[:, :, None]  # exp(G_C - G_j) k_j
    carry = decay0[..., -1]  # [B, K, G]
  a = jnp.where(strict, b_c[..., None] * kk, 0.0)
  rhs_v = jnp.broadcast_to(b_c[..., None] * vh, (B, K, G, C, Hv))
  rhs = jnp.concatenate([rhs_v, jnp.broadcast_to(rhs_k, (B, K, G, C, H))], axis=-1)
  sol = unit_lower_solve(a, rhs)
  u, w = sol[..., :Hv], sol[..., Hv:]
  return u, w, qk, q_s0, k_end, carry


def _chunk_block(xs, s):
  """One chunk: ``(out [B, C, K, G, Hv], state after the chunk)``."""
  q_c, k_c, v_c, b_c, g_c, r_c = xs
  u, w, qk, q_s0, k_end, carry = _chunk_terms(q_c, k_c, v_c, b_c, g_c, r_c > 0.5)
  u = u - einsum("bkgch,bkghv->bkgcv", w, s)  # U' = U - W S_0
  q_s0 = jnp.broadcast_to(q_s0, w.shape)
  out = einsum("bkgch,bkghv->bkgcv", q_s0, s) + einsum("bkgcd,bkgdv->bkgcv", qk, u)
  s = _decay_shape(carry) * s + einsum("bkgdh,bkgdv->bkghv", k_end, u)
  return jnp.transpose(out, (0, 3, 1, 2, 4)), s  # [B, C, K, G, Hv]


# ---------------------------------------------------------------------------
# Public function.


def _check_per_step(name: str, x, B: int, T: int, N: int, H: Optional[int] = None) -> None:
  validators.check_floating(name, x)
  shape = validators.shape_of(x)
  if shape == (B, T, N) or (H is not None and shape == (B, T, N, H)):
    return
  if H is None:
    raise ValueError(f"{name} must have shape [B, T, N] = {(B, T, N)}, got {shape}")
  raise ValueError(
    f"{name} must have shape [B, T, N] = {(B, T, N)} (one decay per head) or "
    f"[B, T, N, H] = {(B, T, N, H)} (per key channel, KDA), got {shape}"
  )


# The delta_rule op: its call is ``(x: recurrence.Inputs, extra, chunk_size)``; every engine
# returns ``(out [B, T, K, G, Hv], final state)``.
ENGINES: dict[str, op.Engine] = recurrence.engines(
  recurrent=recurrent, quadratic=quadratic, chunked=chunked, reference=REFERENCE_ENGINE
)
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES, FALLBACK = recurrence.PREFERENCES, recurrence.FALLBACK
OP = recurrence.state_passing_op("delta_rule", ENGINES, PREFERENCES, FALLBACK, lambda: _samples())


def _delta_rule_attention(
  q: Array,
  k: Array,
  v: Array,
  beta: Array,
  *,
  log_decay: Optional[Array] = None,
  scale: Optional[float] = None,
  initial_state: Optional[Array] = None,
  return_state: bool = False,
  segment_ids: Optional[Array] = None,
  implementation: Optional[ImplementationName] = None,
  chunk_size: int = DEFAULT_CHUNK_SIZE,
  context_axis: Optional[str] = None,
):
  """Attention by the delta rule (with ``log_decay``: the gated delta rule), causal.

  The update of DeltaNet (Gated DeltaNet with ``log_decay``); their layers are the
  ``attnjax.nn`` families ``deltanet`` and ``gated_deltanet``.

  Per head: ``S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T``,
  ``o_t = scale * S_t^T q_t``, with ``D_t = exp(g_t)`` (one decay per head: Gated DeltaNet)
  or ``diag(exp(g_t))`` (one per key channel: Kimi Delta Attention, KDA) (module
  docstring for the chunk computation).

  Heads: ``N`` query heads over ``K`` key/value heads (GQA: head ``n`` reads key/value head
  ``n // (N // K)``), or ``M > K`` value heads over ``K`` query/key heads (Qwen3-Next's
  value-head grouping: value head ``m`` reads query and key head ``m // (M // K)``; ``q``
  has ``K`` heads, or ``M``). Each of the call's heads (``N``, or ``M``) has a state, a beta
  and a decay; a query shared by several value heads is compared with its keys once per
  chunk, not once per value head.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, T, K, H]``, ``N % K == 0``; taken as given (callers L2-normalise).
    v: values ``[B, T, K, Hv]``, or ``[B, T, M, Hv]`` with ``M % K == 0`` value heads
      (``q`` then has ``K`` or ``M`` heads); ``Hv`` may differ from ``H``.
    beta: write strengths ``[B, T, N]`` in (0, 1), per head of the call.
    log_decay: ``g`` with values ``<= 0``: ``[B, T, N]`` (per head), ``[B, T, N, H]`` (per
      head and key channel, KDA), or None (no decay: the plain delta rule).
    scale: output scale, a static float; None means ``H ** -0.5``.
    initial_state: ``[B, N, H, Hv]`` state before token 0 (float32 is kept; other
      float dtypes are cast); None = zeros.
    return_state: the result becomes ``(out, final state [B, N, H, Hv] float32)``.
    segment_ids: integer ``[B, T]``; the state is reset before every token whose
      id differs from the previous token's (the initial state belongs to token 0's
      document).
    implementation: ``"recurrent"`` (scan over time), ``"quadratic"`` (one chunk
      of ``T``), ``"chunked"``, or ``"reference"``, the readable definition:
      here the recurrence (``"recurrent"``); None means ``"chunked"``. The
      names are the engines of :data:`~attnjax._src.ops.delta_rule.attention.OP`;
      ``"parallel"``, the old name of ``"quadratic"``, still works and warns once. They mean
      the same engine in every recurrent family (``attnjax._src.ops.recurrence``).
    chunk_size: chunk length of the chunked engine (any ``T``; the last chunk is
      padded).
    context_axis: None, or the ``jax.shard_map`` mesh axis the sequence is sharded
      over (context parallelism, ``attnjax._src.parallel.recurrent``): called inside
      ``shard_map`` with q, k, v, the per-token arguments and ``segment_ids`` sharded
      along time (``initial_state`` whole), returns this device's shard of the output
      (and the final state of the whole sequence, on every device), equal to the
      unsharded call.

  Returns:
    ``out`` ``[B, T, N, Hv]`` (``N`` the call's heads) in ``q``'s dtype, or ``(out, state)``
    with ``return_state``. Internals are float32.

  References:
    Schlag et al. 2021; Yang et al. 2024 (WY / UT chunk form); Yang et al. 2025
    (Gated DeltaNet); Kimi Team 2025 (Kimi Linear: KDA).
  """
  x = recurrence.prepare(
    "delta_rule_attention",
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
    grouped_values=True,
  )
  B, T, _, H = q.shape
  K = k.shape[2]
  N = K * x.state.shape[2]  # the call's heads: the queries', or the values' when more
  _check_per_step("beta", beta, B, T, N)
  if log_decay is None:
    log_decay = jnp.zeros((B, T, N), jnp.float32)
  _check_per_step("log_decay", log_decay, B, T, N, H)
  extra = (recurrence.by_kv_head(beta, K), recurrence.by_kv_head(log_decay, K))
  out, final = op.run(OP, (x, extra, chunk_size), x.implementation)
  return recurrence.finish(out, final, q, return_state=return_state)


DELTA_STATIC = ("scale", "return_state", "implementation", "chunk_size", "context_axis")

delta_rule_attention = static.jit(_delta_rule_attention, DELTA_STATIC)


def _samples() -> tuple[op.Sample, ...]:
  def unit_keys_and_gates(q, k, v):
    # The delta rule wants keys of unit norm (its update is then a contraction).
    k32 = k.astype(jnp.float32)
    norm = jnp.maximum(jnp.linalg.norm(k32, axis=-1, keepdims=True), 1e-6)
    beta = 1.0 / (1.0 + np.exp(-recurrence.per_step(q, 2)))
    log_decay = -np.logaddexp(0.0, recurrence.per_step(q, 3)) * 0.5
    arrays = dict(
      beta=jnp.asarray(beta, jnp.float32), log_decay=jnp.asarray(log_decay, jnp.float32)
    )
    return q, (k32 / norm).astype(k.dtype), v, arrays

  def per_channel_decay(q, k, v):
    # KDA: one log decay per head and key channel, [B, T, N, H], in (-1, 0).
    q, k, v, arrays = unit_keys_and_gates(q, k, v)
    rng = np.random.default_rng([4, *q.shape])
    draw = rng.standard_normal(q.shape).astype(np.float32)
    arrays["log_decay"] = jnp.asarray(-np.logaddexp(0.0, draw) * 0.5, jnp.float32)
    return q, k, v, arrays

  gated = recurrence.state_passing_sample(delta_rule_attention, unit_keys_and_gates)
  kda = recurrence.state_passing_sample(delta_rule_attention, per_channel_decay)
  return (gated, dataclasses.replace(kda, label="delta_rule_attention/kda"))
