"""The training mesh: data, FSDP, tensor and context parallelism from ``config.mesh``.

Implementation behind the public module :mod:`attnjax.train.mesh`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor", "context")
# Logical parameter dimension -> mesh axis (attnjax.nn names its dimensions with these).
LOGICAL_AXIS_RULES = (
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
)
BATCH_AXES = ("data", "fsdp")
LENGTH_AXIS = "context"


def mesh_sizes(mesh_cfg: Any, num_devices: int) -> dict[str, int]:
  """The mesh's axis sizes for ``num_devices`` devices (one ``-1`` takes the rest).

  Args:
    mesh_cfg: ``config.mesh`` (``data``, ``fsdp``, ``tensor``, ``context``; missing = 1).
    num_devices: the run's devices.

  Returns:
    ``{axis: size}`` over :data:`.AXES`, whose product is ``num_devices``.

  Raises:
    ValueError: sizes that do not multiply to the device count (named), a size of 0 or
      below -1, or more than one -1.
  """
  sizes = {a: int(mesh_cfg.get(a, 1)) for a in AXES}
  free = [a for a, s in sizes.items() if s == -1]
  bad = [f"mesh.{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
  if bad or len(free) > 1:
    raise ValueError(
      "config.mesh: sizes must be >= 1 with at most one -1, got "
      + ", ".join(f"{a}={s}" for a, s in sizes.items())
    )
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(
        f"config.mesh: {', '.join(f'{a}={s}' for a, s in sizes.items())} cannot fill "
        f"{num_devices} devices ({num_devices} is not a multiple of {fixed})"
      )
    sizes[free[0]] = num_devices // fixed
  want = math.prod(sizes.values())
  if want != num_devices:
    hint = (
      f" (a CPU host makes {want} devices with "
      f"XLA_FLAGS=--xla_force_host_platform_device_count={want} set before jax starts)"
      if want > num_devices
      else ""
    )
    raise ValueError(
      f"config.mesh: {' x '.join(f'{a}={s}' for a, s in sizes.items())} = "
      f"{want} devices, but the run has {num_devices}{hint}"
    )
  return sizes


def check_shapes(cfg: Any, sizes: dict[str, int]) -> None:
  """Clear errors, before any compile, for shapes the mesh cannot split.

  Args:
    cfg: the run config.
    sizes: the mesh's ``{axis: size}`` (:func:`.mesh_sizes`).

  Raises:
    ValueError: heads or the MLP width not divisible by ``tensor``, ``d_model`` by
      ``fsdp``, the sequence by ``context``, or a batch by ``data x fsdp`` (named).
  """
  m, d, t = cfg.model, cfg.data, cfg.train
  kv = m.num_kv_heads or m.num_heads
  if m.num_heads % sizes["tensor"] or kv % sizes["tensor"]:
    raise ValueError(
      f"model.num_heads={m.num_heads} (key/value heads {kv}) is not divisible "
      f"by mesh.tensor={sizes['tensor']}"
    )
  if (m.mlp_ratio * m.d_model) % sizes["tensor"]:
    raise ValueError(
      f"the MLP width {m.mlp_ratio * m.d_model} is not divisible by mesh.tensor={sizes['tensor']}"
    )
  if m.d_model % sizes["fsdp"]:
    raise ValueError(f"model.d_model={m.d_model} is not divisible by mesh.fsdp={sizes['fsdp']}")
  if d.seq_len % sizes["context"]:
    raise ValueError(
      f"data.seq_len={d.seq_len} is not divisible by mesh.context={sizes['context']}"
    )
  rows = sizes["data"] * sizes["fsdp"]
  for name, value in (
    ("data.batch_size", d.batch_size),
    ("data.batch_size / train.microbatches", d.batch_size // t.microbatches),
    ("train.probe_batch", t.probe_batch),
  ):
    if value % rows:
      raise ValueError(f"{name}={value} is not divisible by mesh.data x mesh.fsdp = {rows}")


class RunMesh:
  """The run's mesh, its shardings, and the host <-> device moves of batches and state.

  Args:
    cfg: the run config (``config.mesh``, ``train.num_devices`` and the shapes are read).

  Attributes:
    sizes: ``{axis: size}`` of the mesh.
    mesh: the ``jax.sharding.Mesh`` over every process's devices, axes :data:`.AXES`.

  Raises:
    ValueError: sizes or shapes the devices cannot hold (:func:`.mesh_sizes`,
      :func:`.check_shapes`), or ``train.num_devices`` on several hosts.
  """

  def __init__(self, cfg: Any):
    devices = jax.devices()
    if cfg.train.num_devices:
      if jax.process_count() > 1:
        raise ValueError("train.num_devices must be 0 (all devices) on more than one host")
      devices = devices[: cfg.train.num_devices]
    self.sizes = mesh_sizes(cfg.get("mesh", {}), len(devices))
    check_shapes(cfg, self.sizes)
    shape = tuple(self.sizes[a] for a in AXES)
    # Devices in process order, the last axes fastest: each process holds whole batch rows.
    self.mesh = jax.sharding.Mesh(np.asarray(devices).reshape(shape), AXES)
    length = LENGTH_AXIS if self.sizes[LENGTH_AXIS] > 1 else None
    self.batch = NamedSharding(self.mesh, P(BATCH_AXES, length))
    self.rows = NamedSharding(self.mesh, P(BATCH_AXES))
    self.replicated = NamedSharding(self.mesh, P())

  # -- batches -----------------------------------------------------------------

  def put_batch(self, array: np.ndarray) -> jax.Array:
    """A global ``[B, ...]`` host array -> a device array sharded over the batch (and length).

    Every host computes the same global batch (a function of the step) and
    places only the pieces its own devices hold: whole rows on a data / FSDP
    mesh, and a slice of the tokens where ``context`` spans processes. The copy is explicit:
    a ``jax.transfer_guard`` that disallows implicit host-to-device copies lets it through.
    """
    sharding = self.batch if array.ndim >= 2 else self.rows
    with jax.transfer_guard_host_to_device("allow"):
      return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  def batch_args(self, b) -> tuple:
    """``(inputs, targets)`` of a Batch on the devices, plus its packing dict when packed."""
    args = (self.put_batch(b.inputs), self.put_batch(b.targets))
    packing = b.packing()
    if packing is None:
      return args
    return args + ({k: self.put_batch(v) for k, v in packing.items()},)

  def replicate(self, tree: Any) -> Any:
    return jax.device_put(tree, self.replicated)

  # -- model and optimizer state -------------------------------------------------

  def init_model(self, build: Any) -> tuple[Any, Any, Any]:
    """``(graphdef, params, rest)`` of ``build()`` (an NNX module), created sharded by the
    logical rules: one jitted construction whose outputs land on their devices."""
    with nnx.logical_axis_rules(LOGICAL_AXIS_RULES):
      abstract = nnx.eval_shape(build)
      graphdef, abs_params, abs_rest = nnx.split(abstract, nnx.Param, ...)
      named = nnx.get_named_sharding(abs_params, self.mesh)
    shardings = (
      jax.tree.map(self._divisible, named, abs_params),
      jax.tree.map(lambda _: self.replicated, abs_rest),
    )

    def make():
      _, params, rest = nnx.split(build(), nnx.Param, ...)
      return params, rest

    params, rest = jax.jit(make, out_shardings=shardings)()
    return graphdef, params, rest

  def _divisible(self, sharding: NamedSharding, x: Any) -> NamedSharding:
    """``sharding`` without the mesh axes that do not divide their dimension of ``x`` (e.g. a
    65-character vocabulary on ``tensor=2``: that dimension stays whole)."""
    spec = []
    for dim, axes in zip(
      x.shape, tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
    ):
      names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
      ways = math.prod(self.sizes[a] for a in names)
      spec.append(axes if dim % ways == 0 else None)
    return NamedSharding(self.mesh, P(*spec))

  def init_optimizer(self, optimizer: optax.GradientTransformation, params: Any) -> Any:
    """The optimizer state, each leaf that mirrors a parameter sharded like it."""
    param_shardings = jax.tree.map(lambda x: x.sharding, params)
    abstract = jax.eval_shape(optimizer.init, params)
    shardings = optax.tree_map_params(
      optimizer,
      lambda _, sharding: sharding,
      abstract,
      param_shardings,
      transform_non_params=lambda _: self.replicated,
    )
    return jax.jit(optimizer.init, out_shardings=shardings)(params)

  def state_shardings(self, state: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, state)

  def keep_shardings(self, step_fn: Any, state: Any) -> Any:
    """``step_fn`` whose returned state keeps ``state``'s shardings (no silent regathering)."""
    shardings = self.state_shardings(state)

    def step(state, *args):
      new_state, metrics = step_fn(state, *args)
      return jax.lax.with_sharding_constraint(new_state, shardings), metrics

    return step


def to_host(tree: Any) -> Any:
  """``jax.device_get`` that also reads arrays spread over several processes' devices.

  Each process gathers the whole array (metrics, probe statistics, validation sums). The
  copies of every array this process holds whole are started together before any is read,
  so a tree of many small arrays (a flush of the loop's metrics) waits for the device
  once, not once per array.

  Args:
    tree: a pytree of arrays.

  Returns:
    The same pytree of numpy arrays.
  """
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and x.is_fully_addressable:
      x.copy_to_host_async()

  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      from jax.experimental import multihost_utils

      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return jax.device_get(x)

  return jax.tree.map(one, tree)


def bytes_per_device(tree: Any) -> dict[Any, int]:
  """Bytes of ``tree``'s arrays held on each device of this process (from their shardings).

  Args:
    tree: a pytree of ``jax.Array``.

  Returns:
    ``{device: bytes}``.
  """
  out: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
  return out
