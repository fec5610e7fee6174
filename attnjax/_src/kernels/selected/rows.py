"""The normalisers' per-row state in a Mosaic GPU kernel body: ``[R, 1]`` rows held as ``[R]``.

A normaliser keeps its row state as ``[R, 1]`` arrays broadcasting against ``[R, X]`` tiles;
Mosaic GPU's register layouts have none for ``[R, 1]``, only the ``[R]`` vectors a reduction
of a tile leaves. :func:`on_rows` traces a normaliser function at its logical shapes and
evaluates the trace with each ``[R, 1]`` value as an ``[R]`` vector (``transposed``: tiles
held as their transposes, rows along the columns); the visit's ``w @ V`` is a placeholder
primitive the kernel evaluates (its wgmma).
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

Array = jnp.ndarray

# ``pv(w)`` of ``Normalizer.visit``, traced as itself and evaluated by the kernel.
pv_p = jcore.Primitive("attnjax_selected_pv")
pv_p.def_abstract_eval(lambda w, *, width: jax.core.ShapedArray((w.shape[0], width), jnp.float32))

# Elementwise primitives whose rank-0 operands are broadcast to the result's shape first
# (Mosaic GPU lowers no implicit broadcast of a scalar against a vector).
_BINARY = frozenset(
  "add sub mul div max min pow rem atan2 select_n eq ne lt le gt ge and or xor".split()
)
_CALLS = ("pjit", "jit", "closed_call", "core_call")


def on_rows(
  fn: Callable,
  R: int,
  *,
  pv: Optional[Callable] = None,
  width: int = 0,
  iota: Optional[Callable] = None,
  transposed: bool = False,
) -> Callable:
  """``fn`` on arguments whose ``[R]`` leaves stand for ``[R, 1]`` rows.

  Args:
    fn: a function of pytrees of arrays (rows ``[R, 1]``, tiles ``[R, X]``), returning one;
      with ``pv``, called with a last argument ``pv`` (``[R, X] -> [R, width]``).
    R: the rows.
    pv: evaluates ``w @ V`` for the tile ``w`` (the kernel's product), or None.
    width: the columns of ``pv``'s result.
    iota: ``(dtype, shape, dimension) -> array`` for iotas (a laid-out iota), or None.
    transposed: tiles are held ``[X, R]`` (rows along the columns): ``fn`` may only do
      elementwise work on them (:meth:`Normalizer.tile_backward`); a reduction, product or
      reshape of a tile raises ``NotImplementedError``.

  Returns:
    ``fn`` taking and returning the held forms (``[R]`` rows, tiles as held).
  """

  def run(*args):
    leaves, tree = jax.tree.flatten(args)
    logical = [jax.ShapeDtypeStruct(_logical(x, R, transposed), jnp.result_type(x)) for x in leaves]

    def traced(*flat):
      a = jax.tree.unflatten(tree, flat)
      if pv is None:
        return fn(*a)
      return fn(*a, lambda w: pv_p.bind(w, width=width))

    closed, shape = jax.make_jaxpr(traced, return_shape=True)(*logical)
    ev = _Eval(R, pv, iota, transposed)
    outs = ev.jaxpr(closed.jaxpr, closed.consts, leaves)
    return jax.tree.unflatten(jax.tree.structure(shape), outs)

  return run


def _logical(x, R: int, transposed: bool) -> tuple:
  shape = tuple(jnp.shape(x))
  if shape == (R,):
    return (R, 1)
  if transposed and len(shape) == 2:
    return shape[::-1]
  return shape


def _is_row(aval, R: int) -> bool:
  return tuple(getattr(aval, "shape", ())) == (R, 1)


class _Eval:
  """Evaluates a jaxpr on held values: ``[R, 1]`` avals as ``[R]``, tiles as held."""

  def __init__(self, R, pv, iota, transposed):
    self.R, self.pv, self.iota, self.transposed = R, pv, iota, transposed

  def jaxpr(self, jaxpr, consts, args):
    env = {}
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for var, val in zip(jaxpr.constvars, consts):
      env[var] = jnp.reshape(val, (self.R,)) if _is_row(var.aval, self.R) else val
    for var, val in zip(jaxpr.invars, args):
      env[var] = val
    for eqn in jaxpr.eqns:
      outs = self.eqn(eqn, [read(v) for v in eqn.invars])
      for var, val in zip(eqn.outvars, outs):
        env[var] = val
    return [read(v) for v in jaxpr.outvars]

  def held(self, aval) -> tuple:
    """The held shape of a value of logical ``aval``."""
    shape = tuple(aval.shape)
    if _is_row(aval, self.R):
      return (self.R,)
    if self.transposed and len(shape) == 2:
      return shape[::-1]
    return shape

  def row_to(self, x, shape):
    """An ``[R]`` row broadcast to the held tile ``shape`` (rows along dim 0, or along dim 1
    when transposed)."""
    return lax.broadcast_in_dim(x, shape, (1,) if self.transposed else (0,))

  def eqn(self, eqn, args):
    prim, params, name, R = eqn.primitive, eqn.params, eqn.primitive.name, self.R
    rows_in = [_is_row(v.aval, R) for v in eqn.invars]
    rows_out = [_is_row(v.aval, R) for v in eqn.outvars]
    if prim is pv_p:
      return [self.pv(args[0])]
    if name in _CALLS:
      inner = params["jaxpr"]
      return self.jaxpr(inner.jaxpr, inner.consts, args)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
      inner = params.get("call_jaxpr", params.get("fun_jaxpr"))
      return self.jaxpr(inner.jaxpr, inner.consts, args)
    if name == "is_finite":  # no Mosaic GPU rule; the same for floats (NaN: False)
      return [jnp.abs(args[0]) < jnp.inf]
    out_shape = self.held(eqn.outvars[0].aval)
    if name == "iota":
      if self.transposed:
        raise NotImplementedError("an iota of a transposed tile")
      make = self.iota or (lambda d, s, dim: lax.broadcasted_iota(d, s, dim))
      return [make(params["dtype"], tuple(params["shape"]), params["dimension"])]
    if name == "broadcast_in_dim":
      x = args[0]
      if rows_out[0]:  # [R] -> [R, 1], a row to a row, or a scalar splat
        if jnp.ndim(x) == 1 and jnp.shape(x)[0] == R:
          return [x]
        return [lax.broadcast_in_dim(jnp.reshape(x, ()), (R,), ())]
      if rows_in[0]:
        return [self.row_to(x, out_shape)]
      if jnp.ndim(x) == 0:
        return [lax.broadcast_in_dim(x, out_shape, ())]
      if self.transposed:
        raise NotImplementedError(f"{name} of a transposed tile ({eqn})")
    if name in ("reshape", "squeeze", "expand_dims") and (rows_in[0] or rows_out[0]):
      x = args[0]
      return [jnp.reshape(x, out_shape)]
    if self.transposed and (
      name.startswith("reduce") or name in ("dot_general", "transpose", "reshape", "squeeze")
    ):
      raise NotImplementedError(f"{name} of a transposed tile ({eqn})")
    if any(rows_in) and not all(rows_out):  # rows meet a tile: broadcast them to it
      args = [self.row_to(x, out_shape) if r else x for x, r in zip(args, rows_in)]
    if name in _BINARY and out_shape:
      args = [lax.broadcast_in_dim(x, out_shape, ()) if jnp.ndim(x) == 0 else x for x in args]
    out = prim.bind(*args, **params)
    return list(out) if prim.multiple_results else [out]
