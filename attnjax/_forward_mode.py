"""The differentiation rules of the block-wise kernel (:mod:`attnjax.blockwise`).

:func:`kernel` wraps the kernel's plain forward pass and its hand-written
block-wise backward pass into one differentiable function.
"""

from __future__ import annotations

from typing import Callable

import jax


def kernel(forward: Callable, backward: Callable, x: tuple, nondiff: tuple):
  """``(out, stats)`` of ``forward(x, nondiff)`` with ``backward`` as its VJP.

  Args:
    forward: ``(x, nondiff) -> (out, stats, out_rows, residuals)``, plain JAX.
    backward: ``(x, nondiff, out_rows, residuals, (d_out, d_stats)) -> dx``,
      the cotangent of ``x`` (a tuple like ``x``).
    x: differentiable inputs (a tuple of arrays / None / tuples of arrays).
    nondiff: inputs without gradients (masks, ids, positions).
  """

  @jax.custom_vjp
  def core(x, nondiff):
    return forward(x, nondiff)[:2]

  def fwd(x, nondiff):
    out, stats, rows, res = forward(x, nondiff)
    return (out, stats), (x, nondiff, rows, res)

  def bwd(saved, cts):
    x, nondiff, rows, res = saved
    return backward(x, nondiff, rows, res, cts), None

  core.defvjp(fwd, bwd)
  return core(x, nondiff)
