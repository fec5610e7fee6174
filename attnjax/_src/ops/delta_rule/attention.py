"""Delta-rule linear attention: the update of DeltaNet and Gated DeltaNet.

Implementation behind the public module :mod:`attnjax.delta_rule`.
"""

from __future__ import annotations

from typing import Literal, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, deprecation as _deprecation, op as _op, static as _static
from attnjax._src.ops import recurrence
from attnjax._src.numerics import einsum as _einsum
from attnjax._src.ops.recurrence import DEFAULT_CHUNK_SIZE
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.recurrent import chunks

Array = jnp.ndarray

# The engine "reference" names: the recurrence, the family's definition.
REFERENCE_ENGINE = "recurrent"
REFERENCE_FORM = REFERENCE_ENGINE  # its old name


# ---------------------------------------------------------------------------
# The engines' computations. Each takes float32 q [B, T, K, G, H] (already scaled), k [B, T, K, H],
# v [B, T, K, Hv], beta and log decay g [B, T, K, G], a boolean reset [B, T]
# (True: the state is zeroed before token t) and the state [B, K, G, H, Hv];
# each returns (out [B, T, K, G, Hv], final state).


def recurrent(q, k, v, beta, g, reset, state):
  """The decode engine (the reference): ``lax.scan`` over time, one delta-rule update per token.

  Args:
    q: queries ``[B, T, K, G, H]`` (``G = N // K`` query heads per key/value head).
    k: keys ``[B, T, K, H]`` (L2-normalised by the caller).
    v: values ``[B, T, K, Hv]``.
    beta: write strengths ``[B, T, K, G]`` in ``(0, 1)``.
    g: log decays ``[B, T, K, G]``, ``<= 0`` (zeros without a decay).
    reset: ``[B, T]``, true (1) where the state restarts before the token.
    state: float32 ``[B, K, G, H, Hv]``, the state before the first token.

  Returns:
    ``(out [B, T, K, G, Hv] float32, final state [B, K, G, H, Hv])`` (the output before
    ``scale``).
  """

  def step(s, xs):
    q_t, k_t, v_t, b_t, g_t, r_t = xs  # [B,K,G,H], [B,K,H], [B,K,Hv], [B,K,G] x2, [B]
    keep = jnp.where(r_t, 0.0, 1.0)[:, None, None]
    a_t = jnp.exp(g_t) * keep  # [B, K, G]
    s = a_t[..., None, None] * s
    k_s = _einsum("bkh,bkghv->bkgv", k_t, s)  # S_{t-1}^T k_t (decayed)
    delta = b_t[..., None] * (v_t[:, :, None, :] - k_s)  # [B, K, G, Hv]
    s = s + k_t[:, :, None, :, None] * delta[..., None, :]
    return s, _einsum("bkgh,bkghv->bkgv", q_t, s)

  xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, beta, g, reset))
  final, out = jax.lax.scan(step, state, xs)
  return jnp.moveaxis(out, 0, 1), final


def quadratic(q, k, v, beta, g, reset, state):
  """The chunk computation over the whole sequence as one chunk (``_chunk_block``, no scan).

  Args:
    q: queries ``[B, T, K, G, H]`` (``G = N // K`` query heads per key/value head).
    k: keys ``[B, T, K, H]`` (L2-normalised by the caller).
    v: values ``[B, T, K, Hv]``.
    beta: write strengths ``[B, T, K, G]`` in ``(0, 1)``.
    g: log decays ``[B, T, K, G]``, ``<= 0`` (zeros without a decay).
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
  ``attnjax.kernels.recurrent.chunks.chunk_scan``, whose backward keeps each chunk's inputs
  and incoming state and recomputes the chunk, so memory for the backward is
  O(T), about 1.7 inputs' worth (``tests/test_chunks.py``); the solve has its
  own VJP (:func:`.unit_lower_solve`). Computing the terms one chunk at a time
  inside the scan is also faster here than batching them over chunks
  (``lax.map`` / ``vmap``), whose batched small matmuls XLA's CPU backend lays
  out worse: T=4096 forward+backward 331 ms against 399 ms. Time is padded to a
  multiple of ``chunk_size`` with ``k = v = beta = g = 0`` (those steps leave
  the state unchanged) and padded rows are dropped.

  Args:
    q: queries ``[B, T, K, G, H]``.
    k: keys ``[B, T, K, H]``.
    v: values ``[B, T, K, Hv]``.
    beta: ``[B, T, K, G]``.
    g: log decays ``[B, T, K, G]``.
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
    x21 = -_einsum("...ij,...jk,...kl->...il", x22, low, x11)
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
  return _einsum("...cd,...de->...ce", unit_lower_inverse(a), rhs)


def _unit_lower_solve_fwd(a, rhs):
  inv = unit_lower_inverse(a)
  x = _einsum("...cd,...de->...ce", inv, rhs)
  return x, (inv, x)


def _unit_lower_solve_bwd(res, dx):
  inv, x = res
  d_rhs = _einsum("...dc,...de->...ce", inv, dx)
  C = inv.shape[-1]
  strict = jnp.reshape(jnp.tril(jnp.ones((C, C), bool), -1), (1,) * (inv.ndim - 2) + (C, C))
  da = jnp.where(strict, -_einsum("...ce,...de->...cd", d_rhs, x), 0.0)
  return da, d_rhs


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def _chunk_terms(q_c, k_c, v_c, b_c, g_c, r_c):
  """One chunk's state-independent terms: ``(U, W, Q K^T * Gamma, exp(G) from S_0, exp(G_C - G_j))``."""
  B, C, K, G, H = q_c.shape
  Hv = v_c.shape[-1]
  idx = jnp.arange(C)
  strict = jnp.reshape(idx[:, None] > idx[None, :], (1, 1, 1, C, C))  # j < t
  causal = jnp.reshape(idx[:, None] >= idx[None, :], (1, 1, 1, C, C))  # j <= t
  b_c = jnp.transpose(b_c, (0, 2, 3, 1))  # [B, K, G, C]
  gam = jnp.cumsum(jnp.transpose(g_c, (0, 2, 3, 1)), axis=-1)  # G_t, [B, K, G, C]
  doc = jnp.cumsum(r_c.astype(jnp.int32), axis=1)  # resets so far in the chunk, [B, C]
  from_start = (doc == 0)[:, None, None, :]  # S_0 reaches token t
  same = (doc[:, :, None] == doc[:, None, :])[:, None, None]  # [B, 1, 1, C, C]
  live = jnp.logical_and(same, causal)
  diff = gam[..., :, None] - gam[..., None, :]
  gamma = jnp.where(live, jnp.exp(jnp.where(live, diff, 0.0)), 0.0)  # [B, K, G, C, C]
  decay0 = jnp.where(from_start, jnp.exp(gam), 0.0)  # [B, K, G, C]

  kk = _einsum("bckh,bdkh->bkcd", k_c, k_c)
  a = jnp.where(strict, b_c[..., None] * gamma * kk[:, :, None], 0.0)
  rhs_v = b_c[..., None] * jnp.transpose(v_c, (0, 2, 1, 3))[:, :, None]  # [B, K, G, C, Hv]
  rhs_k = (b_c * decay0)[..., None] * jnp.transpose(k_c, (0, 2, 1, 3))[:, :, None]
  rhs = jnp.concatenate([rhs_v, jnp.broadcast_to(rhs_k, (B, K, G, C, H))], axis=-1)
  sol = unit_lower_solve(a, rhs)
  u, w = sol[..., :Hv], sol[..., Hv:]
  qk = _einsum("bckgh,bdkh->bkgcd", q_c, k_c) * gamma
  last = gamma[..., -1, :]  # exp(G_C - G_j) within the last document, [B, K, G, C]
  return u, w, qk, decay0, last


def _chunk_block(xs, s):
  """One chunk: ``(out [B, C, K, G, Hv], state after the chunk)``."""
  q_c, k_c, v_c, b_c, g_c, r_c = xs
  u, w, qk, decay0, last = _chunk_terms(q_c, k_c, v_c, b_c, g_c, r_c > 0.5)
  u = u - _einsum("bkgch,bkghv->bkgcv", w, s)  # U' = U - W S_0
  out = decay0[..., None] * _einsum("bckgh,bkghv->bkgcv", q_c, s) + _einsum(
    "bkgcd,bkgdv->bkgcv", qk, u
  )
  s = decay0[..., -1][..., None, None] * s + _einsum("bdkh,bkgd,bkgdv->bkghv", k_c, last, u)
  return jnp.transpose(out, (0, 3, 1, 2, 4)), s  # [B, C, K, G, Hv]


# ---------------------------------------------------------------------------
# Public function.


def _check_per_step(name: str, x, B: int, T: int, N: int) -> None:
  validators.check_floating(name, x)
  if validators.shape_of(x) != (B, T, N):
    raise ValueError(
      f"{name} must have shape [B, T, N] = {(B, T, N)}, got {validators.shape_of(x)}"
    )


def parallel(*args, **kwargs):
  """Deprecated name of :func:`quadratic` (warns once)."""
  _deprecation.warn_once("attnjax.delta_rule.parallel", "attnjax.delta_rule.quadratic")
  return quadratic(*args, **kwargs)


# The delta_rule op: its call is ``(x: recurrence.Inputs, extra, chunk_size)``; every engine
# returns ``(out [B, T, K, G, Hv], final state)``.
ENGINES: dict[str, _op.Engine] = recurrence.engines(
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

  Per query head: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``,
  ``o_t = scale * S_t^T q_t`` (module docstring for the chunk computation).

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, T, K, H]``, ``N % K == 0`` (GQA: query head ``n`` reads key/value
      head ``n // (N // K)``); taken as given (callers L2-normalise).
    v: values ``[B, T, K, Hv]``.
    beta: write strengths ``[B, T, N]`` in (0, 1), per query head.
    log_decay: ``g`` ``[B, T, N]`` with values ``<= 0``, per query head, or None
      (no decay: the plain delta rule).
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
      names are the engines of :data:`~attnjax.delta_rule.OP`; ``"parallel"``, the old name of
      ``"quadratic"``, still works and warns once. They mean the same engine in every
      recurrent family
      (``attnjax._recurrent``).
    chunk_size: chunk length of the chunked engine (any ``T``; the last chunk is
      padded).
    context_axis: None, or the ``jax.shard_map`` mesh axis the sequence is sharded
      over (context parallelism, ``attnjax.parallel.recurrent``): called inside
      ``shard_map`` with q, k, v, the per-token arguments and ``segment_ids`` sharded
      along time (``initial_state`` whole), returns this device's shard of the output
      (and the final state of the whole sequence, on every device), equal to the
      unsharded call.

  Returns:
    ``out`` ``[B, T, N, Hv]`` in ``q``'s dtype, or ``(out, state)`` with
    ``return_state``. Internals are float32.

  References:
    Schlag et al. 2021; Yang et al. 2024 (WY / UT chunk form); Yang et al. 2025
    (Gated DeltaNet).
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
  )
  B, T, N, _ = q.shape
  K = k.shape[2]
  _check_per_step("beta", beta, B, T, N)
  if log_decay is None:
    log_decay = jnp.zeros((B, T, N), jnp.float32)
  _check_per_step("log_decay", log_decay, B, T, N)
  extra = (recurrence.by_kv_head(beta, K), recurrence.by_kv_head(log_decay, K))
  out, final = _op.run(OP, (x, extra, chunk_size), x.implementation)
  return recurrence.finish(out, final, q, return_state=return_state)


DELTA_STATIC = ("scale", "return_state", "implementation", "chunk_size", "context_axis")

delta_rule_attention = _static.jit(_delta_rule_attention, DELTA_STATIC)


def _samples() -> tuple[_op.Sample, ...]:
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

  return (recurrence.state_passing_sample(delta_rule_attention, unit_keys_and_gates),)
