"""The differentiation rules of the block-wise kernel (:mod:`attnjax.kernels.blockwise`).

:func:`kernel` makes one function of the kernel's plain forward pass and its
hand-written block-wise backward pass that supports both modes of autodiff:

- a ``jax.custom_jvp`` whose tangent is the JVP of the plain forward pass (a
  ``lax.fori_loop`` over blocks: forward-mode stores nothing per block, so
  ``jax.jvp`` / ``jax.linearize`` keep O(T) memory);
- that tangent is a :func:`attnjax.kernels.linear_map.linear_map` (a primitive: a
  linear map with a custom transpose) whose transpose is the block-wise
  backward, so reverse mode (``jax.grad``, ``jax.vjp``) never transposes the
  loops: it saves the inputs and one row of residuals per query (O(T)) and
  runs the hand-written backward, exactly as a ``custom_vjp`` would (a
  ``custom_vjp`` alone raises under ``jax.jvp``).

Why this route: JAX allows one custom rule per function; a ``custom_jvp``
whose tangent is plain autodiff would make reverse mode transpose the loops
(saving every probability tile, O(T * S)). ``jax.custom_derivatives.linear_call``
gives the custom transpose but no derivative with respect to its residuals,
so Hessian-vector products through it fail; the primitive's JVP rule
differentiates the tangent and the backward with respect to the inputs by
plain forward mode. Second order therefore works in both orders:
``jax.jvp(jax.grad(f))`` stays O(T) (forward mode through the backward loops);
``jax.grad(jax.jvp(f))`` transposes that second-order term by plain autodiff
through the loops, which saves their tiles (O(T * S) memory, as the
reference): prefer forward-over-reverse for Hessian-vector products.

Statistics: the tangent of every :class:`attnjax.AttentionStats` field is exact
in forward mode; reverse mode propagates only ``logsumexp`` (the others are
diagnostics, as before).
"""

from __future__ import annotations

from typing import Callable

import jax

from attnjax.kernels.linear_map import linear_map


def custom_vjp_with_jvp(forward: Callable, backward: Callable, x: tuple, nondiff: tuple):
  """``(out, stats)`` of ``forward(x, nondiff)``, differentiable in both modes (see above).

  Args:
    forward: ``(x, nondiff) -> (out, stats, out_rows, residuals)``, plain JAX.
    backward: ``(x, nondiff, out_rows, residuals, (d_out, d_stats)) -> dx``,
      the cotangent of ``x`` (a tuple like ``x``).
    x: differentiable inputs (a tuple of arrays / None / tuples of arrays).
    nondiff: inputs without gradients (masks, ids, positions).
  """

  # nondiff is an argument, not a closure: a custom_jvp must not close over traced arrays.
  @jax.custom_jvp
  def core(x, nondiff):
    return forward(x, nondiff)[:2]

  @core.defjvp
  def core_jvp(primals, tangents):
    (x, nondiff), (tx, _) = primals, tangents
    out, stats, rows, res = forward(x, nondiff)

    def tangent(resid, t):
      x_, nondiff_ = resid[0], resid[1]
      return jax.jvp(lambda xx: forward(xx, nondiff_)[:2], (x_,), (t,))[1]

    def transpose(resid, ct):
      x_, nondiff_, rows_, res_ = resid
      return backward(x_, nondiff_, rows_, res_, ct)

    t_out = linear_map(tangent, transpose, (x, nondiff, rows, res), tx)
    return (out, stats), t_out

  return core(x, nondiff)
