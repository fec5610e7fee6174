"""Platform kernels under a mesh: which axes split their inputs, and the one wrapper that does it.

XLA cannot partition a Mosaic or Triton kernel (nor cuDNN's call) across
devices. :func:`per_shard` is the single place where a platform kernel is
wrapped for a mesh: under a multi-device ambient mesh it runs the kernel
inside ``jax.shard_map`` over :func:`kernel_axes` and tells it where its shard
starts in the whole call (:class:`ShardOffsets`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

# Mesh axes that shard attention heads (tensor parallelism); any other mesh axis, except those
# that shard the sequence, shards the batch when it divides it.
HEAD_AXES = ("tensor", "model", "heads")
SEQUENCE_AXES = ("context", "sequence")


class ShardOffsets(NamedTuple):
  """Where a kernel's shard starts in the whole call: its first batch row and first query head
  (int32 scalars, traced inside ``shard_map``; 0 outside it). A kernel evaluating a modifier
  on batch or head indices adds them to its local indices."""

  batch: Any = 0
  head: Any = 0


def kernel_axes(mesh: Any, batch: int, kv_heads: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """``(batch_axes, head_axes)``: the mesh axes a platform kernel's inputs are split over.

  Heads go over the :data:`HEAD_AXES` present whose sizes divide ``kv_heads``
  (so query heads of a group stay together: no key/value head is repeated),
  the batch over the other axes (not :data:`SEQUENCE_AXES`) whose sizes divide
  what is left of it. An axis used for neither replicates the kernel's work.
  Any split is correct (``shard_map`` moves the data where its specs say);
  these follow the training meshes' logical rules, so no data moves.
  """
  # Axes already manual (inside a shard_map over them) split nothing more.
  sizes = {
    name: (1 if kind == jax.sharding.AxisType.Manual else size)
    for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)
  }
  heads, batch_axes, head_axes = kv_heads, [], []
  for name in mesh.axis_names:
    if sizes[name] > 1 and name in HEAD_AXES and heads % sizes[name] == 0:
      head_axes.append(name)
      heads //= sizes[name]
  left = batch
  for name in mesh.axis_names:
    if (
      sizes[name] > 1
      and name not in HEAD_AXES
      and name not in SEQUENCE_AXES
      and left % sizes[name] == 0
    ):
      batch_axes.append(name)
      left //= sizes[name]
  return tuple(batch_axes), tuple(head_axes)


def _axes(names: tuple[str, ...]):
  if not names:
    return None
  return names[0] if len(names) == 1 else names


def operand_mesh(inputs: Any) -> Any:
  """The mesh ``q``, ``k`` or ``v`` of a call are sharded on when several devices hold it, or
  None.

  Under ``jax.jit`` of arrays placed with a ``NamedSharding`` (no ``jax.set_mesh``, or the
  legacy ``with mesh:`` context) their types carry that mesh (its axes, sizes and device
  kind), and so do the values computed from them.
  """
  for x in (inputs.q, inputs.k, inputs.v):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.size > 1:
      return mesh
  return None


def per_shard(fn: Callable[[Any, ShardOffsets], Any], inputs: Any) -> Any:
  """``fn(shard, offsets)`` run on each device's shard when the call spans several devices.

  XLA cannot partition a Mosaic or Triton kernel (nor cuDNN's call) across
  devices, so under a multi-device mesh the kernel runs inside ``jax.shard_map``
  over :func:`kernel_axes`: each device computes its batch rows and heads;
  nothing crosses devices. The mesh is the ambient one (``jax.set_mesh``), else
  the one the operands are sharded on (:func:`operand_mesh`: plain ``jax.jit`` of
  sharded arrays, the legacy ``with mesh:`` context). Without one (or with one
  device, or axes that split nothing) it is ``fn(inputs, ShardOffsets())``.

  Args:
    fn: the kernel on one shard: ``(DenseInputs, ShardOffsets) -> out``, ``out`` being
      ``[B, T, N, Hv]`` or ``(out, AttentionStats)`` (fields ``[B, N]`` / ``[B, N, T]``).
    inputs: the whole call's :class:`attnjax.options.DenseInputs`.

  Returns:
    ``fn``'s result for the whole call.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    mesh = operand_mesh(inputs)
    if mesh is None:
      return fn(inputs, ShardOffsets())
  B, _, N, _ = inputs.q.shape
  K = inputs.k.shape[2]
  batch_axes, head_axes = kernel_axes(mesh, B, K)
  if not batch_axes and not head_axes:
    return fn(inputs, ShardOffsets())
  b, h = _axes(batch_axes), _axes(head_axes)

  def spec(field: str, x: Any):
    if x is None:
      return None
    if field in ("q", "k", "v"):
      return P(b, None, h, None)
    if field in ("q_segment_ids", "kv_segment_ids"):
      return P(b, None)
    if field == "sink_logits":  # [1, N, 1, 1]
      return P(None, h, None, None)
    if field in ("bias", "mask"):  # [B|1, N|1, T, S]
      return P(b if x.shape[0] == B else None, h if x.shape[1] == N else None, None, None)
    return jax.tree.map(lambda _: P(), x)  # modifier arguments: replicated

  fields = [f.name for f in dataclasses.fields(inputs)]
  values = [getattr(inputs, f) for f in fields]
  in_specs = tuple(spec(f, x) for f, x in zip(fields, values))
  if any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    # Arrays typed with an explicit sharding enter shard_map only as its specs say: move them
    # there (a no-op where they already are).
    values = [
      None if x is None else jax.tree.map(jax.sharding.reshard, x, s)
      for x, s in zip(values, in_specs)
    ]

  def out_spec(x):
    if x.ndim == 4:
      return P(b, None, h, None)
    return P(b, h, *([None] * (x.ndim - 2)))

  def local(*args, mapped=True):
    shard = dataclasses.replace(inputs, **dict(zip(fields, args)))
    # Where this shard's rows and heads start in the whole call.
    b0 = jax.lax.axis_index(b) * shard.q.shape[0] if b is not None and mapped else 0
    n0 = jax.lax.axis_index(h) * shard.q.shape[2] if h is not None and mapped else 0
    return fn(shard, ShardOffsets(b0, n0))

  out_specs = jax.tree.map(
    out_spec, jax.eval_shape(functools.partial(local, mapped=False), *values)
  )
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *values
  )
