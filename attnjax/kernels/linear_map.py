"""A linear map with a custom transpose that can itself be differentiated (a primitive).

``jax.custom_derivatives.linear_call`` gives a linear function a custom
transpose, but has no derivative with respect to its residuals, so a
Hessian-vector product through it fails. :func:`linear_map` is the same idea
as a primitive with three rules:

- JVP: with respect to the linear arguments, the map itself (linear); with
  respect to the residuals, plain ``jax.jvp`` of ``fun`` (forward mode: no
  memory per block);
- transpose (linear arguments only): the same primitive with ``fun`` and
  ``transpose`` swapped;
- batching: the same primitive over ``jax.vmap`` of both functions (linear
  arguments broadcast to the batch).

Used by :mod:`attnjax.kernels.autodiff` for the block-wise kernel's tangent.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

linear_map_p = Primitive("attnjax_linear_map")
linear_map_p.multiple_results = True


class _Map:
  """``fun(res_flat, lin_flat) -> out_flat`` and its transpose ``(res_flat, ct_flat) -> lin_flat``.

  Hashed by identity (a primitive parameter).
  """

  def __init__(self, fun: Callable, transpose: Callable, out_avals: tuple, lin_avals: tuple):
    self.fun, self.transpose = fun, transpose
    self.out_avals, self.lin_avals = tuple(out_avals), tuple(lin_avals)

  def transposed(self) -> "_Map":
    return _Map(self.transpose, self.fun, self.lin_avals, self.out_avals)


def _impl(*args, m: _Map, n_res: int):
  return list(m.fun(list(args[:n_res]), list(args[n_res:])))


linear_map_p.def_impl(_impl)
linear_map_p.def_abstract_eval(lambda *args, m, n_res: list(m.out_avals))
mlir.register_lowering(linear_map_p, mlir.lower_fun(_impl, multiple_results=True))


def _is_zero(t) -> bool:
  return type(t) is ad.Zero


def _jvp(primals, tangents, *, m: _Map, n_res: int):
  res, lin = list(primals[:n_res]), list(primals[n_res:])
  d_res, d_lin = tangents[:n_res], tangents[n_res:]
  out = linear_map_p.bind(*primals, m=m, n_res=n_res)
  total = None
  if not all(_is_zero(t) for t in d_lin):
    d_lin = [ad.instantiate_zeros(t) for t in d_lin]
    total = linear_map_p.bind(*res, *d_lin, m=m, n_res=n_res)
  moving = [i for i, t in enumerate(d_res) if not _is_zero(t)
            and jnp.issubdtype(jnp.result_type(res[i]), jnp.inexact)]
  if moving:
    def of_res(*moved):
      r = list(res)
      for i, x in zip(moving, moved):
        r[i] = x
      return m.fun(r, lin)
    term = jax.jvp(of_res, tuple(res[i] for i in moving), tuple(d_res[i] for i in moving))[1]
    total = list(term) if total is None else [a + b for a, b in zip(total, term)]
  if total is None:
    return out, [ad.Zero(a.to_tangent_aval()) for a in m.out_avals]
  return out, list(total)


def _transpose(cts, *args, m: _Map, n_res: int):
  res = list(args[:n_res])
  assert not any(ad.is_undefined_primal(x) for x in res)
  cts = [jnp.zeros(a.shape, a.dtype) if _is_zero(ct) else ct for ct, a in zip(cts, m.out_avals)]
  lin_cts = linear_map_p.bind(*res, *cts, m=m.transposed(), n_res=n_res)
  return [None] * n_res + list(lin_cts)


def _batch(args, dims, *, m: _Map, n_res: int):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  res_dims = list(dims[:n_res])
  lin = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
         for x, d in zip(args[n_res:], dims[n_res:])]

  def batched(f):
    def g(res, lin_or_ct):
      return jax.vmap(lambda r, l: list(f(list(r), list(l))),
                      in_axes=(res_dims, [0] * len(lin_or_ct)))(list(res), list(lin_or_ct))
    return g

  grow = lambda avals: tuple(a.update(shape=(size,) + a.shape) for a in avals)
  bm = _Map(batched(m.fun), batched(m.transpose), grow(m.out_avals), grow(m.lin_avals))
  out = linear_map_p.bind(*args[:n_res], *lin, m=bm, n_res=n_res)
  return out, [0] * len(out)


ad.primitive_jvps[linear_map_p] = _jvp
ad.primitive_transposes[linear_map_p] = _transpose
batching.primitive_batchers[linear_map_p] = _batch


def linear_map(fun: Callable, transpose: Callable, residuals, linear):
  """``fun(residuals, linear)``, linear in ``linear``, transposed by ``transpose(residuals, ct)``.

  Args:
    fun: ``(residuals, linear) -> out`` (pytrees), linear in ``linear``.
    transpose: ``(residuals, ct_out) -> ct_linear`` (``ct_linear`` like ``linear``;
      entries for integer leaves are ignored).
    residuals: a pytree of arrays (integer ones allowed).
    linear: a pytree of arrays; float0 (integer tangent) leaves are left out.

  Returns:
    ``fun(residuals, linear)``.
  """
  res_flat, res_tree = jax.tree.flatten(residuals)
  lin_all, lin_tree = jax.tree.flatten(linear)
  keep = [jnp.result_type(x) != jax.dtypes.float0 for x in lin_all]
  lin_flat = [x for x, k in zip(lin_all, keep) if k]

  def full_linear(kept):
    it = iter(kept)
    return jax.tree.unflatten(lin_tree, [next(it) if k else x for x, k in zip(lin_all, keep)])

  out_tree_box = []

  def fun_flat(r, l):
    out = fun(jax.tree.unflatten(res_tree, r), full_linear(l))
    flat, tree = jax.tree.flatten(out)
    if not out_tree_box:
      out_tree_box.append(tree)
    return flat

  def transpose_flat(r, ct):
    ct_tree = jax.tree.unflatten(out_tree_box[0], ct)
    d = jax.tree.flatten(transpose(jax.tree.unflatten(res_tree, r), ct_tree))[0]
    d_all = list(d)
    return [x for x, k in zip(d_all, keep) if k]

  out_shapes = jax.eval_shape(fun_flat, res_flat, lin_flat)
  out_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in out_shapes)
  lin_avals = tuple(jax.core.ShapedArray(jnp.shape(x), jnp.result_type(x)) for x in lin_flat)
  m = _Map(fun_flat, transpose_flat, out_avals, lin_avals)
  out = linear_map_p.bind(*res_flat, *lin_flat, m=m, n_res=len(res_flat))
  return jax.tree.unflatten(out_tree_box[0], out)
