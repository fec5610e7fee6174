"""A linear map with a custom transpose that can itself be differentiated (a primitive).

``jax.custom_derivatives.linear_call`` has no derivative with respect to its residuals, so
a Hessian-vector product through it fails. :func:`linear_map` is the same idea as a
primitive with JVP, transpose and batching rules, the derivative in the residuals taken
through the map's smooth form; a map may also read *fixed* residuals that get no
derivative. Used by :mod:`attnjax._src.kernels.autodiff` for every custom-VJP kernel's tangent.
Guide: docs/guides/forward_mode.md, section "How it works".
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import api_util
from jax.custom_derivatives import SymbolicZero
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

linear_map_p = Primitive("attnjax_linear_map")
linear_map_p.multiple_results = True


class _Map:
  """One direction of a linear map on flat lists: ``fun(res, fixed, lin) -> out``, its
  ``transpose(res, fixed, ct) -> lin`` and their smooth forms (same arguments; the
  derivatives with respect to ``res`` are theirs).

  ``name`` says which of the two directions ``fun`` is (seen in jaxprs). Hashed
  by identity (a primitive parameter).
  """

  def __init__(
    self,
    fun: Callable,
    transpose: Callable,
    smooth: Callable,
    smooth_transpose: Callable,
    out_avals: tuple,
    lin_avals: tuple,
    name: str,
    transpose_name: str,
  ):
    self.fun, self.transpose = fun, transpose
    self.smooth, self.smooth_transpose = smooth, smooth_transpose
    self.out_avals, self.lin_avals = tuple(out_avals), tuple(lin_avals)
    self.name, self.transpose_name = name, transpose_name

  def transposed(self) -> "_Map":
    return _Map(
      self.transpose,
      self.fun,
      self.smooth_transpose,
      self.smooth,
      self.lin_avals,
      self.out_avals,
      self.transpose_name,
      self.name,
    )

  def __repr__(self) -> str:
    return f"linear_map[{self.name}]"


def _split(args, n_res: int, n_fixed: int):
  args = list(args)
  return args[:n_res], args[n_res : n_res + n_fixed], args[n_res + n_fixed :]


def _impl(*args, m: _Map, n_res: int, n_fixed: int):
  return list(m.fun(*_split(args, n_res, n_fixed)))


linear_map_p.def_impl(_impl)
linear_map_p.def_abstract_eval(lambda *args, m, n_res, n_fixed: list(m.out_avals))
mlir.register_lowering(linear_map_p, mlir.lower_fun(_impl, multiple_results=True))


def _is_zero(t) -> bool:
  return type(t) is ad.Zero


def _jvp(primals, tangents, *, m: _Map, n_res: int, n_fixed: int):
  res, fixed, lin = _split(primals, n_res, n_fixed)
  d_res, _, d_lin = _split(tangents, n_res, n_fixed)  # fixed residuals have no derivative
  out = linear_map_p.bind(*primals, m=m, n_res=n_res, n_fixed=n_fixed)
  total = None
  if not all(_is_zero(t) for t in d_lin):
    d_lin = [ad.instantiate_zeros(t) for t in d_lin]
    total = linear_map_p.bind(*res, *fixed, *d_lin, m=m, n_res=n_res, n_fixed=n_fixed)
  moving = [
    i
    for i, t in enumerate(d_res)
    if not _is_zero(t) and jnp.issubdtype(jnp.result_type(res[i]), jnp.inexact)
  ]
  if moving:

    def of_res(*moved):
      r = list(res)
      for i, x in zip(moving, moved):
        r[i] = x
      return m.smooth(r, fixed, lin)

    term = jax.jvp(of_res, tuple(res[i] for i in moving), tuple(d_res[i] for i in moving))[1]
    total = list(term) if total is None else [a + b for a, b in zip(total, term)]
  if total is None:
    return out, [ad.Zero(a.to_tangent_aval()) for a in m.out_avals]
  return out, list(total)


def varying_axes(aval) -> tuple:
  """The manual mesh axes (inside ``jax.shard_map``) an abstract value varies over, sorted."""
  mat = getattr(aval, "manual_axis_type", None)
  return tuple(sorted(getattr(mat, "varying", ()) or ()))


def zeros_of(aval):
  """Zeros of ``aval``'s shape and dtype, varying over the manual axes it varies over."""
  z = jnp.zeros(aval.shape, aval.dtype)
  axes = varying_axes(aval)
  return jax.lax.pcast(z, axes, to="varying") if axes else z


def as_aval(x) -> jax.core.ShapedArray:
  """The abstract value of an array, tracer, aval or ``jax.ShapeDtypeStruct``, with its
  sharding and the manual axes it varies over (inside ``jax.shard_map`` they are its type)."""
  if isinstance(x, jax.core.ShapedArray):
    return x
  return api_util.shaped_abstractify(x)


def _transpose(cts, *args, m: _Map, n_res: int, n_fixed: int):
  res, fixed, _ = _split(args, n_res, n_fixed)
  assert not any(ad.is_undefined_primal(x) for x in res + fixed)
  cts = [zeros_of(a) if _is_zero(ct) else ct for ct, a in zip(cts, m.out_avals)]
  lin_cts = linear_map_p.bind(*res, *fixed, *cts, m=m.transposed(), n_res=n_res, n_fixed=n_fixed)
  return [None] * (n_res + n_fixed) + list(lin_cts)


def _batch(args, dims, *, m: _Map, n_res: int, n_fixed: int):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  n_const = n_res + n_fixed
  res_dims, fixed_dims = list(dims[:n_res]), list(dims[n_res:n_const])
  lin = [
    jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
    for x, d in zip(args[n_const:], dims[n_const:])
  ]

  def batched(f):
    def g(res, fixed, lin_or_ct):
      return jax.vmap(
        lambda r, c, l: list(f(list(r), list(c), list(l))),
        in_axes=(res_dims, fixed_dims, [0] * len(lin_or_ct)),
      )(list(res), list(fixed), list(lin_or_ct))

    return g

  grow = lambda avals: tuple(a.update(shape=(size,) + a.shape) for a in avals)
  bm = _Map(
    batched(m.fun),
    batched(m.transpose),
    batched(m.smooth),
    batched(m.smooth_transpose),
    grow(m.out_avals),
    grow(m.lin_avals),
    m.name,
    m.transpose_name,
  )
  out = linear_map_p.bind(*args[:n_const], *lin, m=bm, n_res=n_res, n_fixed=n_fixed)
  return out, [0] * len(out)


ad.primitive_jvps[linear_map_p] = _jvp
ad.primitive_transposes[linear_map_p] = _transpose
batching.primitive_batchers[linear_map_p] = _batch


def _left_out(x) -> bool:
  """A linear leaf that is not an argument of the primitive: a symbolic zero or a float0."""
  return isinstance(x, SymbolicZero) or jnp.result_type(x) == jax.dtypes.float0


def _zeros(x):
  """A left-out linear leaf as the map reads it (zeros made inside, never kept as residuals)."""
  if not isinstance(x, SymbolicZero):
    return x  # a float0 array
  return np.zeros(x.shape, x.dtype) if x.dtype == jax.dtypes.float0 else jnp.zeros(x.shape, x.dtype)


def linear_map(
  fun: Callable,
  transpose: Callable,
  residuals,
  linear,
  *,
  fixed=(),
  smooth: Optional[tuple[Callable, Callable]] = None,
  names: tuple[str, str] = ("map", "transpose"),
  out_like=None,
):
  """``fun(residuals, fixed, linear)``, linear in ``linear``, transposed by ``transpose``.

  Args:
    fun: ``(residuals, fixed, linear) -> out`` (pytrees), linear in ``linear``.
    transpose: ``(residuals, fixed, ct_out) -> ct_linear`` (``ct_linear`` like
      ``linear``; entries for integer leaves are ignored).
    residuals: a pytree of arrays (integer ones allowed), differentiated.
    linear: a pytree of arrays; float0 (integer tangent) leaves and
      ``jax.custom_derivatives.SymbolicZero`` leaves are left out (the map reads
      zeros there; their transposes are dropped).
    fixed: a pytree of arrays the map reads but that get no derivative.
    smooth: None (``fun`` / ``transpose`` are differentiated, ``fixed`` held
      constant), or ``(fun_s, transpose_s)``: ``(residuals, linear) -> out`` and
      ``(residuals, ct_out) -> ct_linear``, the same map without ``fixed``, whose
      derivatives with respect to ``residuals`` are the map's.
    names: what ``fun`` and ``transpose`` are, for jaxprs (``linear_map[name]``).
    out_like: None, or a pytree of ``jax.ShapeDtypeStruct`` (or arrays) shaped as
      ``fun``'s output (saves tracing ``fun`` for it).

  Returns:
    ``fun(residuals, fixed, linear)``.
  """
  res_flat, res_tree = jax.tree.flatten(residuals)
  fixed_flat, fixed_tree = jax.tree.flatten(fixed)
  lin_all, lin_tree = jax.tree.flatten(linear)
  keep = [not _left_out(x) for x in lin_all]
  lin_flat = [x for x, k in zip(lin_all, keep) if k]

  def full_linear(kept):
    it = iter(kept)
    return jax.tree.unflatten(
      lin_tree, [next(it) if k else _zeros(x) for x, k in zip(lin_all, keep)]
    )

  out_tree_box = []

  def forward(f):
    def flat(r, c, l):
      out = f(jax.tree.unflatten(res_tree, r), c, full_linear(l))
      flat_out, tree = jax.tree.flatten(out)
      if not out_tree_box:
        out_tree_box.append(tree)
      return flat_out

    return flat

  def backward(f):
    def flat(r, c, ct):
      d = jax.tree.flatten(
        f(jax.tree.unflatten(res_tree, r), c, jax.tree.unflatten(out_tree_box[0], ct))
      )[0]
      return [x for x, k in zip(d, keep) if k]

    return flat

  def on_fixed(f):  # (residuals, fixed, x) -> ... on flat lists
    return lambda r, c, x: f(r, jax.tree.unflatten(fixed_tree, c), x)

  def ignore_fixed(f):
    return lambda r, c, x: f(r, x)

  fun_s, transpose_s = (
    (on_fixed(fun), on_fixed(transpose))
    if smooth is None
    else (ignore_fixed(smooth[0]), ignore_fixed(smooth[1]))
  )
  if out_like is None:  # trace the map once for its output's shapes
    out_shapes = jax.eval_shape(forward(fun_s), res_flat, fixed_flat, lin_flat)
  else:
    out_shapes, tree = jax.tree.flatten(out_like)
    out_tree_box.append(tree)
  out_avals = tuple(as_aval(s) for s in out_shapes)
  lin_avals = tuple(as_aval(x) for x in lin_flat)
  m = _Map(
    forward(on_fixed(fun)),
    backward(on_fixed(transpose)),
    forward(fun_s),
    backward(transpose_s),
    out_avals,
    lin_avals,
    *names,
  )
  out = linear_map_p.bind(
    *res_flat, *fixed_flat, *lin_flat, m=m, n_res=len(res_flat), n_fixed=len(fixed_flat)
  )
  return jax.tree.unflatten(out_tree_box[0], out)
