"""Kernels traced when the program is lowered, for the device it is compiled for.

A Pallas kernel's tiles and Mosaic's lowering read the chip, which tracing knows only
under a mesh. :func:`call` runs one kernel step as the primitive ``attnjax_kernel_call``,
whose lowering traces the step under an abstract mesh of the device lowered for: the
mesh's, else the compiling backend's, else :data:`EXPORT_TPU`. A step reads where its
shard starts in the whole call from :class:`Shard`; a Mosaic kernel partitioned by XLA
raises ``ValueError``.
Guide: docs/guides/architecture.md, section "Platforms and lowering".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

# The TPU a kernel is lowered for where the program names none of its own (``jax.export`` for
# ``tpu`` from a CPU host): Mosaic's lowering reads the chip only to choose among equivalent
# instruction sequences, and the v5e tiles fit every TPU from v5e on.
EXPORT_TPU = dict(device_kind="TPU v5 lite", num_cores=1, platform="tpu")


@dataclasses.dataclass(frozen=True)
class Shard:
  """Where the arrays of a kernel step start in the whole call.

  Attributes:
    batch_offset: int32 scalar, the first batch row.
    head_offset: int32 scalar, the first query head.
  """

  batch_offset: Any
  head_offset: Any


kernel_call_p = Primitive("attnjax_kernel_call")
kernel_call_p.multiple_results = True


class _Kernel:
  """A kernel step on flat arrays: ``fun(batch_offset, head_offset, *leaves) -> [outputs]``
  and its result types. Hashed by identity (a primitive parameter)."""

  def __init__(self, fun: Callable, out_avals: Sequence[Any], name: str, mosaic: bool):
    self.fun, self.out_avals, self.name, self.mosaic = fun, tuple(out_avals), name, mosaic

  def __repr__(self) -> str:
    return f"kernel[{self.name}]"


def _abstract_eval(*avals, kernel: _Kernel):
  vma = frozenset().union(*(getattr(a, "vma", None) or frozenset() for a in avals))
  if vma:
    return [a.update(vma=vma) for a in kernel.out_avals]
  return list(kernel.out_avals)


def _impl(*args, kernel: _Kernel):
  return jax.jit(lambda *a: kernel_call_p.bind(*a, kernel=kernel))(*args)


def _batch(args, dims, *, kernel: _Kernel):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
  axes = [None if d is None else 0 for d in dims]
  fun = kernel.fun
  batched = _Kernel(
    lambda *a: list(jax.vmap(lambda *x: list(fun(*x)), in_axes=axes)(*a)),
    [a.update(shape=(size,) + a.shape) for a in kernel.out_avals],
    kernel.name,
    kernel.mosaic,
  )
  out = kernel_call_p.bind(*args, kernel=batched)
  return out, [0] * len(out)


def _lowering(ctx, *args, kernel: _Kernel):
  if kernel.mosaic and _partitioned(ctx):
    raise ValueError(
      f"{kernel.name}: a Mosaic kernel in a program that XLA partitions over several devices; "
      "it runs inside jax.shard_map over its operands' batch and heads: call it through "
      "attnjax.dot_product_attention or the engine's attention() with arrays sharded on a "
      "jax.sharding.Mesh, or under jax.set_mesh(mesh)"
    )
  mesh = jax.sharding.get_abstract_mesh()
  # A mesh with axes (jax.set_mesh, shard_map) names the target: the arrays traced under it
  # carry it, and a kernel traced under another one fails jax's mesh checks.
  device = _target_of(ctx) if mesh.empty else None
  if device is None or mesh.abstract_device == device:
    return mlir.lower_fun(_checked(kernel), multiple_results=True)(ctx, *args)
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device)):
    return mlir.lower_fun(_checked(kernel), multiple_results=True)(ctx, *args)


def _checked(kernel: _Kernel) -> Callable:
  """``kernel.fun``, raising where its results' types differ from those it was called with."""

  def fun(*args):
    outs = list(kernel.fun(*args))
    got = [(tuple(o.shape), jnp.dtype(o.dtype)) for o in outs]
    want = [(tuple(a.shape), jnp.dtype(a.dtype)) for a in kernel.out_avals]
    if got != want:
      raise ValueError(
        f"{kernel.name}: traced for the target, the kernel returns {got}, not "
        f"the {want} it was called with"
      )
    return outs

  return fun


kernel_call_p.def_abstract_eval(_abstract_eval)
kernel_call_p.def_impl(_impl)
batching.primitive_batchers[kernel_call_p] = _batch
mlir.register_lowering(kernel_call_p, _lowering)


def call(
  fn: Callable,
  args: Sequence[Any],
  *,
  offsets: tuple = (0, 0),
  name: str = "kernel",
  mosaic: bool = False,
  out_like: Any = None,
) -> Any:
  """``fn(shard, *args)``, one step of a platform kernel, traced when lowered for its target.

  Args:
    fn: ``(shard: Shard, *args) -> outputs`` (a pytree of arrays). Traced once now
      for its outputs' types and again when the program is lowered, under the
      target's device; the types must not depend on the target.
    args: the operands, pytrees of arrays (None for absent ones).
    offsets: ``(batch row, query head)`` where ``args`` start in the whole call
      (inside ``shard_map``: the :class:`attnjax._src.sharding.ShardOffsets` of the shard).
    name: the step's name, in jaxprs and errors.
    mosaic: the step lowers to Mosaic custom calls (which XLA cannot partition).
    out_like: None, or ``fn``'s outputs as a pytree of ``jax.ShapeDtypeStruct`` (or arrays):
      saves tracing ``fn`` now for them.

  Returns:
    ``fn``'s outputs.
  """
  leaves, in_tree = jax.tree.flatten(tuple(args))
  out_tree = []

  def flat_fn(b0, n0, *flat):
    out = fn(Shard(b0, n0), *jax.tree.unflatten(in_tree, flat))
    flat_out, tree = jax.tree.flatten(out)
    out_tree[:] = [tree]
    return flat_out

  b0, n0 = (jnp.asarray(o, jnp.int32) for o in offsets)
  if out_like is None:
    out_avals = jax.eval_shape(flat_fn, b0, n0, *leaves)
    (tree,) = out_tree
  else:
    out_avals, tree = jax.tree.flatten(out_like)
  kernel = _Kernel(
    flat_fn, [jax.core.ShapedArray(a.shape, a.dtype) for a in out_avals], name, mosaic
  )
  return jax.tree.unflatten(tree, kernel_call_p.bind(b0, n0, *leaves, kernel=kernel))


# ---------------------------------------------------------------------------
# The target.


def _partitioned(ctx) -> bool:
  """Whether XLA partitions the program being lowered over several devices (outside
  ``shard_map``, or inside one over some of the mesh's axes only)."""
  axis_context = ctx.module_context.axis_context
  manual = getattr(axis_context, "manual_axes", None)
  if manual is not None:  # inside shard_map
    mesh = axis_context.mesh
    return any(n not in manual and s > 1 for n, s in zip(mesh.axis_names, mesh.axis_sizes))
  return (getattr(axis_context, "num_devices", None) or 1) > 1


def _abstract(device) -> Optional[Any]:
  """A ``jax.sharding.AbstractDevice`` for a device (or an abstract one), None if unknown."""
  if device is None or isinstance(device, jax.sharding.AbstractDevice):
    return device
  platform = getattr(device, "platform", None)
  kind = getattr(device, "device_kind", None)
  if platform is None or kind is None:
    return None
  cores = (
    getattr(device, "num_cores", None)
    if platform == "tpu"
    else getattr(device, "core_count", None)
    if platform == "gpu"
    else None
  )
  return jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)


def _same_platform(device, platforms) -> bool:
  platform = {"gpu": "cuda"}.get(device.platform, device.platform)
  return not platforms or platform in platforms or device.platform in platforms


def _target_of(ctx) -> Optional[Any]:
  """The device a program is lowered for: the first of the mesh's (ambient, or
  ``shard_map``'s) and the compiling backend's that is of the platform lowered for, else
  :data:`EXPORT_TPU` for ``tpu``; None where unknown (jax's default device)."""
  platforms = tuple(ctx.platforms or ctx.module_context.platforms or ())

  def candidates():
    yield jax.sharding.get_abstract_mesh().abstract_device
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
      yield _abstract(mesh.devices.flat[0]) if mesh.devices.size else None
    else:
      yield getattr(mesh, "abstract_device", None)
    backend = ctx.module_context.backend
    try:
      yield _abstract(backend.devices()[0]) if backend is not None else None
    except Exception:  # a backend that lists no devices
      pass

  for device in candidates():
    if device is not None and _same_platform(device, platforms):
      return device
  if platforms == ("tpu",):
    return jax.sharding.AbstractDevice(**EXPORT_TPU)
  return None
