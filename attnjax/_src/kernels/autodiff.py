"""Custom-VJP kernels that every mode of autodiff can go through.

A ``jax.custom_vjp`` function raises under ``jax.jvp``. :func:`custom_vjp_with_jvp` (and
:class:`custom_vjp`, a drop-in for ``jax.custom_vjp``) builds a ``jax.custom_jvp`` whose
tangent is a :func:`attnjax._src.kernels.linear_map.linear_map`: evaluated, the JVP of a smooth
form of the forward; transposed, the engine's hand-written backward. Reverse mode runs
the backward as a custom VJP would; forward mode and second order go through the smooth
forms. :func:`custom_vjp_of` takes the smooth form from a ``twin`` (another engine of the
same maths) for a kernel JAX cannot differentiate, such as a ``pallas_call``.
Guide: docs/guides/forward_mode.md, section "How it works".
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src.kernels.linear_map import as_aval, linear_map, varying_axes, zeros_of


def tangent_like(x):
  """The abstract value of ``x``'s tangent (float0 for integer and boolean arrays); inside
  ``jax.shard_map`` it varies over the manual axes ``x`` varies over."""
  dtype = jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.inexact):
    return jax.ShapeDtypeStruct(jnp.shape(x), jax.dtypes.float0)
  if isinstance(x, np.ndarray):
    return jax.ShapeDtypeStruct(x.shape, dtype)
  return as_aval(x).to_tangent_aval()


def zeros_like_tangent(x):
  """Zeros in ``x``'s tangent type (float0 for integer and boolean arrays)."""
  t = tangent_like(x)
  return np.zeros(t.shape, t.dtype) if t.dtype == jax.dtypes.float0 else zeros_of(t)


def invariant_like(x, ct):
  """``ct`` summed over the manual mesh axes it varies over and ``x`` does not.

  Inside ``jax.shard_map`` a hand-written backward computes each device's part
  of an input's cotangent; an input the same on every device of an axis (sink
  logits, ``score_mod`` tables) gets the sum of the parts, as jax's own
  transpose of the implicit broadcast gives. ``x`` and ``ct`` are pytrees of the
  same structure; the sums over the same axes are one collective (independent
  collectives may run in different orders on different devices of a CPU host,
  which deadlocks its in-process communicator).
  """
  x_leaves, tree = jax.tree.flatten(x)
  ct_leaves = tree.flatten_up_to(ct)
  groups: dict = {}
  for i, (xi, ci) in enumerate(zip(x_leaves, ct_leaves)):
    if ci is None or isinstance(ci, np.ndarray) or isinstance(xi, np.ndarray):
      continue
    extra = tuple(a for a in varying_axes(as_aval(ci)) if a not in varying_axes(as_aval(xi)))
    if extra:
      groups.setdefault(extra, []).append(i)
  for axes, idx in groups.items():
    summed = jax.lax.psum([ct_leaves[i] for i in idx], axes)
    for i, total in zip(idx, summed):
      ct_leaves[i] = total
  return jax.tree.unflatten(tree, ct_leaves)


def custom_vjp_with_jvp(
  forward: Callable,
  backward: Callable,
  x,
  nondiff=(),
  *,
  primal: Optional[Callable] = None,
  twin: Optional[Callable] = None,
  name: str = "kernel",
):
  """``forward(x, nondiff)[0]`` with ``backward`` as its VJP, differentiable in every mode.

  Args:
    forward: ``(x, nondiff) -> (out, residuals)`` (pytrees of arrays).
    backward: ``(x, nondiff, residuals, ct_out) -> ct_x``, linear in ``ct_out``;
      ``ct_x`` is like ``x`` (entries of integer leaves are ignored).
    x: differentiable inputs (a pytree of arrays).
    nondiff: inputs without derivatives (masks, ids, positions, flags).
    primal: ``(x, nondiff) -> out`` when nothing is differentiated (default:
      ``forward``'s output; a cheaper form that keeps no residuals).
    twin: ``(x, nondiff) -> out``, differentiable in every mode and equal to the
      forward, for a ``forward`` / ``backward`` that JAX cannot differentiate.
      None: both are plain JAX (the smooth forms are themselves).
    name: the kernel's name in jaxprs (``linear_map[<name>.tangent]`` and
      ``linear_map[<name>.backward]``).
  """
  if twin is None:
    smooth_out = lambda x, nd: forward(x, nd)[0]
    smooth_vjp = lambda x, nd, ct: backward(x, nd, forward(x, nd)[1], ct)
  else:
    smooth_out = twin
    smooth_vjp = lambda x, nd, ct: jax.vjp(lambda xx: twin(xx, nd), x)[1](ct)[0]

  def tangent(resid, t):
    x_, nd_ = resid
    return jax.jvp(lambda xx: smooth_out(xx, nd_), (x_,), (t,))[1]

  def transpose(resid, own, ct):
    x_, nd_ = resid
    return invariant_like(x_, backward(x_, nd_, residuals(x_, own), ct))

  def rule(x, nondiff, tx):
    out, res = with_residuals(x, nondiff)
    t_out = linear_map(
      lambda r, _, t: tangent(r, t),
      transpose,
      (x, nondiff),
      tx,
      fixed=res,
      smooth=(tangent, lambda r, ct: smooth_vjp(*r, ct)),
      names=(f"{name}.tangent", f"{name}.backward"),
      out_like=jax.tree.map(tangent_like, out),
    )
    return out, res, t_out

  # The residuals pass as a list of arrays, less those that are inputs (the linear map holds
  # x already): ``layout`` keeps their tree (which may hold functions, jax.vjp's: equal in
  # every trace of forward but not the same objects, which a custom_jvp would refuse) and,
  # per leaf, the x leaf it is (or None).
  layout = []

  # x and nondiff are arguments, not closures: a custom_jvp must not close over traced arrays.
  @jax.custom_jvp
  def with_residuals(x, nondiff):
    out, res = forward(x, nondiff)
    leaves, tree = jax.tree.flatten(res)
    inputs = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(x))}
    layout[:] = [tree, [inputs.get(id(leaf)) for leaf in leaves]]
    return out, [leaf for leaf, i in zip(leaves, layout[1]) if i is None]

  def residuals(x, own):
    """``forward``'s residuals from their own leaves and the inputs."""
    tree, alias = layout
    x_leaves, it = jax.tree.leaves(x), iter(own)
    return jax.tree.unflatten(tree, [next(it) if i is None else x_leaves[i] for i in alias])

  # Symbolic zeros: inputs that are not differentiated add no zero tangents to the linear map
  # (they would be kept as residuals of reverse mode).
  @functools.partial(with_residuals.defjvp, symbolic_zeros=True)
  def with_residuals_jvp(primals, tangents):
    out, res, t_out = rule(*primals, tangents[0])
    return (out, res), (t_out, jax.tree.map(zeros_like_tangent, res))

  @jax.custom_jvp
  def core(x, nondiff):
    return forward(x, nondiff)[0] if primal is None else primal(x, nondiff)

  @functools.partial(core.defjvp, symbolic_zeros=True)
  def core_jvp(primals, tangents):
    out, _, t_out = rule(*primals, tangents[0])
    return out, t_out

  return core(x, nondiff)


class custom_vjp:  # named as the jax.custom_vjp it replaces
  """``jax.custom_vjp`` (positional arguments, static ``nondiff_argnums``) through
  :func:`custom_vjp_with_jvp`: the same ``fwd`` / ``bwd``, and ``jax.jvp`` works.

  ``defvjp(fwd, bwd, twin=None)``: ``fwd(*args) -> (out, residuals)``,
  ``bwd(*nondiff_args, residuals, ct) -> cotangents`` (None entries: zeros) as
  for ``jax.custom_vjp``; ``twin(*args)``: see :func:`custom_vjp_with_jvp`.
  """

  def __init__(self, fun: Callable, nondiff_argnums: tuple = ()):
    self.fun, self.nondiff_argnums = fun, tuple(nondiff_argnums)
    self.fwd = self.bwd = self.twin = None
    functools.update_wrapper(self, fun)

  def defvjp(self, fwd: Callable, bwd: Callable, *, twin: Optional[Callable] = None) -> None:
    self.fwd, self.bwd, self.twin = fwd, bwd, twin

  def __call__(self, *args):
    static = {i: args[i] for i in self.nondiff_argnums}
    x = tuple(a for i, a in enumerate(args) if i not in static)

    def full(x):
      it = iter(x)
      return [static[i] if i in static else next(it) for i in range(len(args))]

    def backward(x, _, res, ct):
      d = self.bwd(*(static[i] for i in sorted(static)), res, ct)
      return tuple(
        jax.tree.map(zeros_like_tangent, xi) if di is None else di for xi, di in zip(x, d)
      )

    twin = None if self.twin is None else (lambda x, _: self.twin(*full(x)))
    return custom_vjp_with_jvp(
      lambda x, _: self.fwd(*full(x)),
      backward,
      x,
      primal=lambda x, _: self.fun(*full(x)),
      twin=twin,
      name=self.fun.__qualname__,
    )


def custom_vjp_of(fn: Callable, x, nondiff=(), *, twin: Callable, name: str):
  """``fn(x, nondiff)``, a kernel with reverse mode only (a ``jax.custom_vjp`` of jax's own:
  splash, cuDNN), differentiable in every mode.

  Reverse mode is ``fn``'s own VJP (``jax.vjp``: its forward saves its residuals, its
  backward runs as before); forward mode and second order come from ``twin``
  (``(x, nondiff) -> out``, differentiable in every mode and equal to ``fn``), as in
  :func:`custom_vjp_with_jvp`.
  """
  return custom_vjp_with_jvp(
    lambda x, nd: jax.vjp(lambda xx: fn(xx, nd), x),
    lambda x, nd, pull, ct: pull(ct)[0],
    x,
    nondiff,
    primal=fn,
    twin=twin,
    name=name,
  )
