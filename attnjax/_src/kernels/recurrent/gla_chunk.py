"""One chunk of per-channel gated linear attention (GLA), with a hand-written backward.

:func:`attnjax.gated_linear.chunked` runs it on every chunk of ``C`` tokens when the decay
is per key channel. Two paths, chosen per chunk by a ``lax.cond``: :func:`direct_chunk`
(all pairs in one ``[C, C]`` matmul, exact while no channel decays by more than
:data:`DIRECT_MAX_DECAY` over the chunk) and :func:`sub_blocked_chunk` (secondary
chunking: no ``exp`` of a positive number); each has its own backward, whose decay
gradient leaves out the diagonal terms that would cancel in float32.
Guide: docs/guides/kernels.md, section "Recurrent chunk kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from attnjax._src.numerics import einsum
from attnjax._src.kernels import autodiff

Array = jnp.ndarray


def _running_sum(x: Array, axis: int, *, reverse: bool, inclusive: bool) -> Array:
  """Cumulative sum of ``x`` along ``axis`` as one matmul with a 0/1 triangle.

  ``reverse``: ``sum_{t >= j}`` (or ``t > j``) instead of ``t <= j`` (``t < j``);
  ``inclusive``: include ``t == j``. A matmul, not ``jnp.cumsum``: XLA's CPU
  cumulative sum along a middle axis is slower than the matmul by 2x here, and
  an exclusive sum never subtracts (``total - x`` would cancel an O(1) ``x``
  against a sum holding a tiny term).
  """
  n = x.shape[axis]
  t = jnp.arange(n)
  later, same = t[None, :] > t[:, None], t[None, :] == t[:, None]  # [j, t]
  mask = (later if reverse else jnp.logical_not(later | same)) | (same & inclusive)
  letters = "abcdefgh"[: x.ndim]
  spec = f"z{letters[axis]},{letters}->{letters.replace(letters[axis], 'z')}"
  return einsum(spec, mask.astype(x.dtype), x)


def sub_block(C: int, sub: int) -> int:
  """The sub-block length used for a chunk of ``C``: ``sub`` if it divides ``C``, else ``C``."""
  return sub if 0 < sub < C and C % sub == 0 else C


def _parts(q, k, g, reset, sub):
  """Everything of the forward that does not involve v or the state (head-major layout).

  ``q [B, C, K, G, H]``, ``k [B, C, K, H]``, ``g [B, C, K, G, H]``, ``reset [B, C]``.
  """
  B, C, K, G, H = q.shape
  s = sub_block(C, sub)
  n = C // s
  qh = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, K, G, C, H]
  gh = jnp.transpose(g, (0, 2, 3, 1, 4))
  kh = jnp.transpose(k, (0, 2, 1, 3))[:, :, None]  # [B, K, 1, C, H]
  d = jnp.cumsum(reset > 0.5, axis=1, dtype=jnp.int32)  # [B, C]
  causal = jnp.tril(jnp.ones((C, C), bool))
  keep = jnp.logical_and(causal[None], d[:, :, None] == d[:, None, :])[:, None, None]  # [B,1,1,C,C]

  gs = jnp.reshape(gh, (B, K, G, n, s, H))
  # b_i - b_r(I): from the sub-block's start to i; b_e(J) - b_j: from after j to its end.
  inside = _running_sum(gs, 4, reverse=False, inclusive=True)
  to_end = _running_sum(gs, 4, reverse=True, inclusive=False)
  totals = inside[:, :, :, :, -1]  # [B, K, G, n, H]
  before = _running_sum(totals, 3, reverse=False, inclusive=False)  # b_r(I)
  earlier = jnp.reshape(jnp.arange(n)[:, None] > jnp.arange(n)[None, :], (1, 1, 1, n, n, 1, 1))
  # Key factor exp(b_r(I) - b_j) for j in sub-block J < I: (b_r(I) - b_e(J)) + (b_e(J) - b_j).
  between = (before[:, :, :, :, None] - before[:, :, :, None, :] - totals[:, :, :, None, :])[
    :, :, :, :, :, None
  ]  # [B, K, G, I, J, 1, H]
  expo = between + to_end[:, :, :, None]  # [B, K, G, I, J, s, H]
  f_key = jnp.where(earlier, jnp.exp(jnp.where(earlier, expo, 0.0)), 0.0)
  f_key = jnp.reshape(f_key, (B, K, G, n, C, H))
  e_in = jnp.exp(inside)  # [B, K, G, n, s, H]
  q_b = jnp.reshape(qh, (B, K, G, n, s, H))
  k_b = jnp.reshape(jnp.broadcast_to(kh, (B, K, G, C, H)), (B, K, G, n, s, H))
  q_hat = q_b * e_in
  k_i = f_key * jnp.reshape(kh, (B, K, 1, 1, C, H))  # [B, K, G, n, C, H]
  # Diagonal sub-blocks: exp(inside_i - inside_j) for j < i (exponent <= 0), 0 on and above
  # the diagonal (the diagonal's factor 1 is added on its own).
  strict = jnp.reshape(jnp.tril(jnp.ones((s, s), bool), -1), (1, 1, 1, 1, s, s, 1))
  diff = inside[:, :, :, :, :, None] - inside[:, :, :, :, None, :]  # [B, K, G, n, i, j, H]
  dec = jnp.where(strict, jnp.exp(jnp.where(strict, diff, 0.0)), 0.0)
  b = jnp.reshape(inside + before[:, :, :, :, None], (B, K, G, C, H))  # b_i
  e_q, e_k, carry = _state_factors(gh, d, jnp.exp(b))
  return dict(
    qh=qh,
    kh=kh,
    q_b=q_b,
    k_b=k_b,
    q_hat=q_hat,
    k_i=k_i,
    f_key=f_key,
    e_in=e_in,
    dec=dec,
    keep=keep,
    e_q=e_q,
    e_k=e_k,
    carry=carry,
  )


def _state_factors(gh, d, e_b):
  """The state's decay factors, zero across a reset: ``(e_q, e_k, carry)``.

  ``e_q = exp(b_i)`` where no reset came before ``i`` (queries read the
  incoming state), ``e_k = exp(b_C - b_j)`` for keys of the last segment (they
  reach the outgoing state; a reverse exclusive sum, never a subtraction) and
  ``carry = exp(b_C)`` ``[B, K, G, H]`` when the chunk has no reset. ``gh``:
  log decays ``[B, K, G, C, H]``; ``d [B, C]``: resets so far; ``e_b = exp(b)``.
  """
  e_q = jnp.where((d == 0)[:, None, None, :, None], e_b, 0.0)
  same = (d == d[:, -1:])[:, None, None, :, None]
  to_go = _running_sum(gh, 3, reverse=True, inclusive=False)  # b_C - b_j
  e_k = jnp.where(same, jnp.exp(jnp.where(same, to_go, 0.0)), 0.0)
  carry = jnp.where((d[:, -1] == 0)[:, None, None, None], e_b[:, :, :, -1], 0.0)
  return e_q, e_k, carry


def _weights(p):
  """``w [B, K, G, C, C]``, masked by ``keep``."""
  B, K, G, n, s = p["q_b"].shape[:5]
  C = n * s
  off = einsum("bkgIih,bkgIjh->bkgIij", p["q_hat"], p["k_i"])  # [B, K, G, n, s, C]
  diag = einsum("bkgIih,bkgIjh,bkgIijh->bkgIij", p["q_b"], p["k_b"], p["dec"])
  self_w = jnp.sum(p["q_b"] * p["k_b"], -1)[..., None]  # the diagonal's factor is exactly 1
  diag = diag + jnp.reshape(jnp.eye(s), (1, 1, 1, 1, s, s)) * self_w  # [B, K, G, n, s, s]
  eye = jnp.reshape(jnp.eye(n, dtype=off.dtype), (1, 1, 1, n, 1, n, 1))
  w = jnp.reshape(off, (B, K, G, n, s, n, s)) + diag[:, :, :, :, :, None, :] * eye
  return jnp.where(p["keep"], jnp.reshape(w, (B, K, G, C, C)), 0.0)


def _forward(q, k, v, g, reset, state, sub):
  p = _parts(q, k, g, reset, sub)
  w = _weights(p)
  vh = jnp.transpose(v, (0, 2, 1, 3))  # [B, K, C, Hv]
  q_in = p["qh"] * p["e_q"]
  k_end = p["kh"] * p["e_k"]  # [B, K, G, C, H]
  out = einsum("bkgij,bkjv->bkgiv", w, vh) + einsum("bkgih,bkghv->bkgiv", q_in, state)
  new_state = p["carry"][..., None] * state + einsum("bkgjh,bkjv->bkghv", k_end, vh)
  return jnp.transpose(out, (0, 3, 1, 2, 4)), new_state, (p, w, vh, q_in, k_end)


def gla_chunk(q, k, v, g, reset, state, sub):
  """``(out [B, C, K, G, Hv], state after the chunk)`` of one chunk (module docstring).

  ``q [B, C, K, G, H]`` (scaled), ``k [B, C, K, H]``, ``v [B, C, K, Hv]``,
  ``g [B, C, K, G, H]`` log decays, ``reset [B, C]`` (1.0 where a segment
  starts), ``state [B, K, G, H, Hv]``; all float32. ``sub``: sub-block length.

  A chunk whose total decay is at most :data:`DIRECT_MAX_DECAY` in every
  channel runs :func:`direct_chunk` (one reference point, plain matmuls);
  any other runs :func:`sub_blocked_chunk`. Both are exact; the choice is made
  per chunk at run time (``lax.cond``: only the taken branch runs).
  """
  direct = jnp.max(-jnp.sum(g, axis=1)) <= DIRECT_MAX_DECAY
  return jax.lax.cond(
    direct,
    lambda: direct_chunk(q, k, v, g, reset, state),
    lambda: sub_blocked_chunk(q, k, v, g, reset, state, sub),
  )


@functools.partial(autodiff.custom_vjp, nondiff_argnums=(6,))
def sub_blocked_chunk(q, k, v, g, reset, state, sub):
  """One chunk through secondary chunking (module docstring); :func:`gla_chunk`'s arguments."""
  out, new_state, _ = _forward(q, k, v, g, reset, state, sub)
  return out, new_state


def _gla_chunk_fwd(q, k, v, g, reset, state, sub):
  out, new_state, saved = _forward(q, k, v, g, reset, state, sub)
  return (out, new_state), (saved, state, reset)


def _gla_chunk_bwd(sub, res, cts):
  (p, w, vh, q_in, k_end), state, reset = res
  d_out, d_new = cts
  B, K, G, n, s, H = p["q_b"].shape
  C = n * s
  do = jnp.transpose(d_out, (0, 2, 3, 1, 4))  # [B, K, G, C, Hv]
  dw = jnp.where(p["keep"], einsum("bkgiv,bkjv->bkgij", do, vh), 0.0)
  dv = einsum("bkgij,bkgiv->bkjv", w, do) + einsum("bkgjh,bkghv->bkjv", k_end, d_new)
  dq_in = einsum("bkgiv,bkghv->bkgih", do, state)
  d_state = einsum("bkgih,bkgiv->bkghv", q_in, do) + p["carry"][..., None] * d_new
  dk_end = einsum("bkjv,bkghv->bkgjh", vh, d_new)  # [B, K, G, C, H]
  # Pairs in earlier sub-blocks, through the reference token r(I).
  dw_b = jnp.reshape(dw, (B, K, G, n, s, C))
  dq_off = einsum("bkgIij,bkgIjh->bkgIih", dw_b, p["k_i"]) * p["e_in"]  # [B, K, G, n, s, H]
  dk_off = einsum(
    "bkgIjh,bkgIjh->bkgjh", einsum("bkgIij,bkgIih->bkgIjh", dw_b, p["q_hat"]), p["f_key"]
  )
  # Pairs inside a sub-block (strictly below the diagonal), and the diagonal itself.
  dwd = jnp.diagonal(jnp.reshape(dw_b, (B, K, G, n, s, n, s)), axis1=3, axis2=5)
  dwd = jnp.moveaxis(dwd, -1, 3)  # [B, K, G, n, i, j]
  dq_in_b = einsum("bkgIij,bkgIijh,bkgIjh->bkgIih", dwd, p["dec"], p["k_b"])  # [B, K, G, n, s, H]
  dk_in_b = einsum("bkgIij,bkgIijh,bkgIih->bkgIjh", dwd, p["dec"], p["q_b"])
  self_w = jnp.diagonal(dwd, axis1=4, axis2=5)[..., None]  # [B, K, G, n, s, 1]
  q_flat, k_flat = p["qh"], jnp.reshape(p["k_b"], (B, K, G, C, H))

  def flat(x):
    return jnp.reshape(x, (B, K, G, C, H))

  dq_pairs = flat(dq_off + dq_in_b)
  dk_pairs = dk_off + flat(dk_in_b)
  dq = dq_pairs + flat(self_w * p["k_b"]) + dq_in * p["e_q"]
  dk = dk_pairs + flat(self_w * p["q_b"]) + dk_end * p["e_k"]
  # Decays: each exponent's gradient summed onto the g's it is made of.
  # Pairs (i >= t > j) and exp(b_i) (g_t for t <= i): sums over i >= t.
  dg = _running_sum(
    q_flat * dq_pairs - k_flat * dk_pairs + q_in * dq_in, 3, reverse=True, inclusive=True
  )
  return _cotangents(dq, dk, dv, dg, k_end * dk_end, p["carry"], state, d_new, reset, d_state)


def _cotangents(dq, dk, dv, dg, k_dk_end, carry, state, d_new, reset, d_state):
  """Both chunk backwards' last step: the decays' state terms, then the inputs' layouts.

  ``dg`` holds the pairs' and the queries' state terms; this adds the keys'
  ``exp(b_C - b_j)`` (``g_t`` for ``t > j``: a forward exclusive sum of
  ``k_dk_end``) and the state's ``exp(b_C)`` (every ``g_t``).
  """
  dg = dg + _running_sum(k_dk_end, 3, reverse=False, inclusive=False)
  dg = dg + (carry * jnp.sum(state * d_new, axis=-1))[:, :, :, None]
  dq = jnp.transpose(dq, (0, 3, 1, 2, 4))
  dk = jnp.transpose(jnp.sum(dk, axis=2), (0, 2, 1, 3))
  dv = jnp.transpose(dv, (0, 2, 1, 3))
  dg = jnp.transpose(dg, (0, 3, 1, 2, 4))
  return dq, dk, dv, dg, jnp.zeros_like(reset), d_state


sub_blocked_chunk.defvjp(_gla_chunk_fwd, _gla_chunk_bwd)


# ---------------------------------------------------------------------------
# The direct chunk: one reference point (the chunk's start), for chunks whose decay is bounded.

# Largest total decay ``-sum_t g_t`` (over the chunk, in any channel) that :func:`gla_chunk`
# runs through :func:`direct_chunk`. There the key factor ``exp(-b_j)`` is at most
# ``exp(16) ~ 9e6`` and the weights' relative rounding about ``6e-8 * (|b_i| + |b_j|) <= 2e-6``.
# A GLA gate (``log_sigmoid(x) / 16``) decays a 64-token chunk by ~3; only strong gates
# (sub-blocks) go past it.
DIRECT_MAX_DECAY = 16.0


def _direct_forward(q, k, v, g, reset, state):
  """The chunk with ``exp(b_i - b_j) = exp(b_i) * exp(-b_j)`` (both from the chunk's start).

  Pairs ``j < i`` are one ``[C, C]`` matmul of ``q * exp(b)`` and ``k * exp(-b)``;
  the diagonal (factor exactly 1) is ``q_i . k_i`` on its own. Returns the
  outputs, the new state and what the backward reuses.
  """
  C = q.shape[1]
  qh = jnp.transpose(q, (0, 2, 3, 1, 4))  # [B, K, G, C, H]
  gh = jnp.transpose(g, (0, 2, 3, 1, 4))
  kh = jnp.transpose(k, (0, 2, 1, 3))[:, :, None]  # [B, K, 1, C, H]
  vh = jnp.transpose(v, (0, 2, 1, 3))  # [B, K, C, Hv]
  d = jnp.cumsum(reset > 0.5, axis=1, dtype=jnp.int32)  # [B, C]
  t = jnp.arange(C)
  strict = jnp.logical_and((t[:, None] > t[None, :])[None], d[:, :, None] == d[:, None, :])[
    :, None, None
  ]  # [B, 1, 1, C, C]
  b = _running_sum(gh, 3, reverse=False, inclusive=True)  # b_i <= 0
  e_b, e_nb = jnp.exp(b), jnp.exp(-b)
  q_hat, k_hat = qh * e_b, kh * e_nb
  w = jnp.where(strict, einsum("bkgih,bkgjh->bkgij", q_hat, k_hat), 0.0)
  self_w = jnp.sum(qh * kh, axis=-1)  # [B, K, G, C]
  e_q, e_k, carry = _state_factors(gh, d, e_b)
  q_in, k_end = qh * e_q, kh * e_k
  out = (
    einsum("bkgij,bkjv->bkgiv", w, vh)
    + self_w[..., None] * vh[:, :, None]
    + einsum("bkgih,bkghv->bkgiv", q_in, state)
  )
  new_state = carry[..., None] * state + einsum("bkgjh,bkjv->bkghv", k_end, vh)
  saved = (
    qh,
    kh,
    vh,
    e_b,
    e_nb,
    q_hat,
    k_hat,
    strict,
    w,
    self_w,
    e_q,
    q_in,
    e_k,
    k_end,
    carry,
    state,
  )
  return jnp.transpose(out, (0, 3, 1, 2, 4)), new_state, saved


@autodiff.custom_vjp
def direct_chunk(q, k, v, g, reset, state):
  """One chunk with a single reference point; exact while the chunk's decay is bounded
  (:data:`DIRECT_MAX_DECAY`); :func:`gla_chunk`'s arguments, without ``sub``."""
  out, new_state, _ = _direct_forward(q, k, v, g, reset, state)
  return out, new_state


def _direct_fwd(q, k, v, g, reset, state):
  out, new_state, saved = _direct_forward(q, k, v, g, reset, state)
  return (out, new_state), (saved, reset)


def _direct_bwd(res, cts):
  (
    (qh, kh, vh, e_b, e_nb, q_hat, k_hat, strict, w, self_w, e_q, q_in, e_k, k_end, carry, state),
    reset,
  ) = res
  d_out, d_new = cts
  do = jnp.transpose(d_out, (0, 2, 3, 1, 4))  # [B, K, G, C, Hv]
  dw = jnp.where(strict, einsum("bkgiv,bkjv->bkgij", do, vh), 0.0)
  d_self = jnp.sum(do * vh[:, :, None], axis=-1)  # [B, K, G, C]: the diagonal of do v^T
  dv = (
    einsum("bkgij,bkgiv->bkjv", w, do)
    + einsum("bkgi,bkgiv->bkiv", self_w, do)
    + einsum("bkgjh,bkghv->bkjv", k_end, d_new)
  )
  dq_in = einsum("bkgiv,bkghv->bkgih", do, state)
  d_state = einsum("bkgih,bkgiv->bkghv", q_in, do) + carry[..., None] * d_new
  dk_end = einsum("bkjv,bkghv->bkgjh", vh, d_new)
  dq_pairs = einsum("bkgij,bkgjh->bkgih", dw, k_hat) * e_b  # sum_j dw_ij k_j exp(b_i - b_j)
  dk_pairs = einsum("bkgij,bkgih->bkgjh", dw, q_hat) * e_nb
  dq = dq_pairs + d_self[..., None] * kh + dq_in * e_q
  dk = dk_pairs + d_self[..., None] * qh + dk_end * e_k
  # The decays: the pair-sum identity of the module docstring, and the state terms.
  dg = _running_sum(qh * dq_pairs - kh * dk_pairs + q_in * dq_in, 3, reverse=True, inclusive=True)
  return _cotangents(dq, dk, dv, dg, k_end * dk_end, carry, state, d_new, reset, d_state)


direct_chunk.defvjp(_direct_fwd, _direct_bwd)
