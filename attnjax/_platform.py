"""Choosing code per platform when a program is lowered, and failing clearly on the wrong one.

A platform kernel (Pallas Triton for ``cuda``, Pallas Mosaic for ``tpu``) can
be traced on any host and lowered for its platform from any host (that is how
``jax.export(..., platforms=["cuda"])`` works on a CPU machine). What must not
happen is lowering it for another platform: :func:`on_platform` puts the kernel
in the named platform's branch of ``jax.lax.platform_dependent`` and, in every
other branch, :func:`fail` whose lowering raises a ``ValueError`` naming the
implementation and the platform the program is being lowered for.

A Triton kernel is lowered for a GPU model; on a host without a GPU,
:func:`gpu_lowering_target` supplies one (:data:`EXPORT_GPU`), so exporting for
``cuda`` outside a mesh needs no GPU and no setup from the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

PLATFORMS = ("cpu", "cuda", "tpu")
# The DenseOptions fields every platform kernel (cuDNN, splash, pallas_gpu) is written for. A
# field added later is reported by unknown_options until a kernel lists it, so auto-dispatch
# never drops it.
KERNEL_OPTIONS = ("is_causal", "window", "scale", "normalizer", "softcap", "similarity",
                  "return_stats")
# The DenseInputs fields the platform kernels are written for (reported the same way).
KERNEL_INPUTS = ("q", "k", "v", "bias", "mask", "sink_logits", "q_segment_ids", "kv_segment_ids")

# The GPU a Triton kernel is lowered for on a host without one (``jax.export(...,
# platforms=["cuda"])`` from a CPU host). From jax 0.11 the Triton lowering reads the GPU from
# the abstract mesh's abstract device and raises without one; jax 0.10 fell back to compute
# capability 9.0, which this keeps. The lowering uses the GPU only to check float8 casts (XLA
# compiles the Triton IR for the GPU the program runs on), so one Hopper GPU stands for any.
EXPORT_GPU = dict(device_kind="NVIDIA H100", num_cores=None, platform="cuda")
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")

_fail_p = Primitive("attnjax_wrong_platform")
_fail_p.multiple_results = True


def _fail_abstract(*args, message: str, out_avals: tuple):
  del args, message
  return list(out_avals)


def _fail_impl(*args, message: str, out_avals: tuple):
  del args, out_avals
  raise ValueError(message)


def _fail_lowering(ctx, *args, message: str, out_avals: tuple):
  del args, out_avals
  platforms = ", ".join(repr(p) for p in (ctx.module_context.platforms or ()))
  raise ValueError(f"{message} (this program is being lowered for {platforms})")


_fail_p.def_abstract_eval(_fail_abstract)
_fail_p.def_impl(_fail_impl)
mlir.register_lowering(_fail_p, _fail_lowering)


def fail(message: str, like: Any) -> Any:
  """Values shaped like ``like`` (a pytree of ShapeDtypeStructs) whose lowering raises ``message``."""
  leaves, tree = jax.tree.flatten(like)
  avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
  return jax.tree.unflatten(tree, _fail_p.bind(message=message, out_avals=avals))


def unknown_options(opts: Any, inputs: Any, known_options: Sequence[str],
                    known_inputs: Sequence[str], who: str) -> list[str]:
  """Reasons for every ``DenseOptions`` field outside ``known_options`` set away from its
  default and every ``DenseInputs`` field outside ``known_inputs`` that is given (set away
  from its default: None, or ``()`` for the modifiers' argument tuples).

  A platform kernel lists the fields it honours; a field added later (a new
  option of the dense call) is then reported until the kernel is taught it, so
  auto-dispatch never silently drops it.
  """
  reasons = []
  for f in dataclasses.fields(opts):
    value = getattr(opts, f.name)
    if f.name not in known_options and value != f.default:
      reasons.append(f"{f.name}={value!r} (an option {who} does not know)")
  for f in dataclasses.fields(inputs):
    value = getattr(inputs, f.name)
    # An input is given when it is set away from its default (None, or () for argument tuples).
    default = None if f.default is dataclasses.MISSING else f.default
    given = value is not default if default is None else value != default
    if f.name not in known_inputs and given:
      reasons.append(f"{f.name} (an input {who} does not know)")
  return reasons


def current_platform() -> str:
  """The default backend as a ``platform_dependent`` key (``"gpu"`` -> ``"cuda"``)."""
  backend = jax.default_backend()
  return "cuda" if backend == "gpu" else backend


def on_platform(platform: str, fn: Callable[[], Any], message: str) -> Any:
  """``fn()`` when lowered for ``platform``; lowering for any other platform raises ``message``."""
  like = jax.eval_shape(fn)
  return jax.lax.platform_dependent(**{platform: fn}, default=lambda: fail(message, like))


def array_refusals(name: str, inputs: Any, opts: Any, takes: str) -> list[str]:
  """What a fused dense kernel named ``name`` refuses in every call: a ``bias`` array, a
  ``mask`` array (the kernel ``takes`` its structure otherwise) and a non-dot similarity."""
  reasons = []
  if inputs.bias is not None:
    reasons.append(f"bias ({name} adds no bias array)")
  if inputs.mask is not None:
    reasons.append(f"an explicit mask array ({name} takes {takes})")
  if opts.similarity != "dot":
    reasons.append(f"similarity={opts.similarity!r} ({name} computes dot products)")
  return reasons


def kernel_engine(name: str, platform: str, unsupported: Callable, compute: Callable,
                  where: str) -> Callable:
  """The ``run(inputs, opts, *, block_sizes=None, interpret=False)`` of a Pallas kernel engine.

  It raises ``ValueError`` naming what ``unsupported(inputs, opts)`` lists, runs
  ``compute(inputs, opts, block_sizes=..., interpret=True)`` anywhere in interpret mode,
  and otherwise lowers only for ``platform`` (another platform raises ``ValueError``
  saying the kernel ``where``, e.g. "runs on a TPU only (a Mosaic kernel)").
  """
  def run(inputs, opts, *, block_sizes=None, interpret: bool = False):
    reasons = unsupported(inputs, opts)
    if reasons:
      raise ValueError(f"implementation={name!r} does not support " + "; ".join(reasons))
    if interpret:
      return compute(inputs, opts, block_sizes=block_sizes, interpret=True)
    return on_platform(
        platform, lambda: compute(inputs, opts, block_sizes=block_sizes),
        f"implementation={name!r} {where}; use implementation=None to pick per platform")

  run.__doc__ = (f"The ``implementation={name!r}`` engine: ``compute``, lowering for "
                 f"``{platform}`` only outside interpret mode (another platform raises "
                 f"``ValueError``); ``block_sizes`` None picks the target's row.")
  return run


# ---------------------------------------------------------------------------
# The target's generation and libraries, read when a program is traced.

# Compute capability (major) by GPU device kind, for targets known only by their abstract mesh
# (inside jit, jax exposes the ambient mesh's device kind, not the device itself).
_GPU_MAJOR_BY_KIND = (("H100", 9), ("H200", 9), ("H800", 9), ("H20", 9), ("GH200", 9),
                      ("B200", 10), ("B300", 10), ("GB200", 10), ("GB300", 10),
                      ("A100", 8), ("A800", 8), ("A10", 8), ("A30", 8), ("A40", 8),
                      ("A6000", 8), ("L4", 8), ("L40", 8))


def _major_of_kind(kind: str) -> Optional[int]:
  for name, major in _GPU_MAJOR_BY_KIND:
    if name in kind:
      return major
  return None


def cuda_major() -> Optional[int]:
  """The compute capability major of the GPU a program is traced for, or None if unknown.

  From the ambient mesh's device kind (``jax.set_mesh``: how a deviceless
  compile names its target), else this process's first GPU. Block-size tables
  use it; None means "any CUDA GPU" (the choices that fit the smallest).
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "platform", None) == "gpu":
    return _major_of_kind(device.device_kind)
  return local_gpu_major()


@functools.lru_cache(maxsize=1)
def cudnn_version() -> Optional[int]:
  """The cuDNN version jax's attention wrapper finds on this host, or None.

  ``jax.nn.dot_product_attention(implementation="cudnn")`` reads the local
  cuDNN's version while it traces, whatever platform the program is lowered
  for: a program holding it can be traced (and exported or compiled for
  ``cuda``) on any host with the cuDNN library, with or without a GPU.
  """
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    return int(cudnn_attention.check_cudnn_version())
  except Exception:  # no plugin, no library, or an older layout of jax's internals
    return None


def local_gpu_major() -> Optional[int]:
  """This process's first GPU's compute capability major, or None on a host without a GPU."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return None
  if not gpus:
    return None
  cc = getattr(gpus[0], "compute_capability", None)
  return int(str(cc).split(".")[0]) if cc else _major_of_kind(gpus[0].device_kind)


# ---------------------------------------------------------------------------
# Platform kernels inside shard_map.

# Mesh axes that shard attention heads (tensor parallelism); any other mesh axis, except those
# that shard the sequence, shards the batch when it divides it.
HEAD_AXES = ("tensor", "model", "heads")
SEQUENCE_AXES = ("context", "sequence")


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
  sizes = {name: (1 if kind == jax.sharding.AxisType.Manual else size)
           for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, mesh.axis_types)}
  heads, batch_axes, head_axes = kv_heads, [], []
  for name in mesh.axis_names:
    if sizes[name] > 1 and name in HEAD_AXES and heads % sizes[name] == 0:
      head_axes.append(name)
      heads //= sizes[name]
  left = batch
  for name in mesh.axis_names:
    if (sizes[name] > 1 and name not in HEAD_AXES and name not in SEQUENCE_AXES
        and left % sizes[name] == 0):
      batch_axes.append(name)
      left //= sizes[name]
  return tuple(batch_axes), tuple(head_axes)


def _axes(names: tuple[str, ...]):
  if not names:
    return None
  return names[0] if len(names) == 1 else names


_SHARD_OFFSETS: list = []


def shard_offsets() -> tuple[Any, Any]:
  """``(first batch row, first query head)`` of the shard a kernel is traced for inside
  :func:`per_shard` (traced int32 scalars), ``(0, 0)`` outside it: a kernel adds them to its
  local indices where a modifier reads the batch or head index."""
  return _SHARD_OFFSETS[-1] if _SHARD_OFFSETS else (0, 0)


def operand_mesh(inputs: Any) -> Any:
  """The mesh ``q``, ``k`` or ``v`` of a call are sharded on when several devices hold it, or
  None. Under ``jax.jit`` of arrays placed with a ``NamedSharding`` (no ``jax.set_mesh``, or
  the legacy ``with mesh:`` context) their types carry that mesh (its axes, sizes and device
  kind), and so do the values computed from them."""
  for x in (inputs.q, inputs.k, inputs.v):
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and mesh.size > 1:
      return mesh
  return None


def per_shard(fn: Callable[[Any], Any], inputs: Any) -> Any:
  """``fn(inputs)`` run on each device's shard when the call spans several devices.

  XLA cannot partition a Mosaic or Triton kernel (nor cuDNN's call) across
  devices, so under a multi-device mesh the kernel runs inside
  ``jax.shard_map`` over :func:`kernel_axes`: each device computes its batch
  rows and heads; nothing crosses devices. The mesh is the ambient one
  (``jax.set_mesh``), else the one the operands are sharded on
  (:func:`operand_mesh`: plain ``jax.jit`` of sharded arrays, the legacy
  ``with mesh:`` context). Without one (or with one device) ``fn`` runs as is.
  ``inputs`` is a ``DenseInputs``; ``fn`` returns ``[B, T, N, Hv]`` or
  ``(out, AttentionStats)`` (fields ``[B, N]`` / ``[B, N, T]``).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    mesh = operand_mesh(inputs)
    if mesh is None:
      return fn(inputs)
  from jax.sharding import PartitionSpec as P
  B, _, N, _ = inputs.q.shape
  K = inputs.k.shape[2]
  batch_axes, head_axes = kernel_axes(mesh, B, K)
  if not batch_axes and not head_axes:
    return fn(inputs)
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
    values = [None if x is None else jax.tree.map(jax.sharding.reshard, x, s)
              for x, s in zip(values, in_specs)]

  def out_spec(x):
    if x.ndim == 4:
      return P(b, None, h, None)
    return P(b, h, *([None] * (x.ndim - 2)))

  def local(*args, mapped=True):
    shard = dataclasses.replace(inputs, **dict(zip(fields, args)))
    # Where this shard's rows and heads start in the whole call (kernels evaluating a modifier
    # on batch / head indices read them: shard_offsets).
    b0 = jax.lax.axis_index(b) * shard.q.shape[0] if b is not None and mapped else 0
    n0 = jax.lax.axis_index(h) * shard.q.shape[2] if h is not None and mapped else 0
    _SHARD_OFFSETS.append((b0, n0))
    try:
      return fn(shard)
    finally:
      _SHARD_OFFSETS.pop()

  out_specs = jax.tree.map(out_spec, jax.eval_shape(functools.partial(local, mapped=False),
                                                    *values))
  return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*values)


@contextlib.contextmanager
def host_eval():
  """``jax.ensure_compile_time_eval()`` on this process's default device.

  Static structure (block layouts, a kernel's constant tables) is computed
  concretely even while a function is traced. Under ``jax.set_mesh(mesh)`` jax
  runs such eager work on the mesh's devices, and for a deviceless compile
  those are compile-only: they run nothing. jax has no public way to step out
  of the mesh inside a trace (``set_mesh`` refuses), so this swaps its
  concrete-mesh context for the duration; where jax's internals moved, only
  ``ensure_compile_time_eval`` applies.
  """
  state = _concrete_mesh_state()
  with jax.ensure_compile_time_eval():
    if state is None:
      yield
      return
    # What jax.set_mesh(None) sets: the empty concrete mesh.
    from jax._src import mesh as mesh_lib
    previous = state.swap_local(getattr(mesh_lib, "empty_concrete_mesh", None))
    try:
      yield
    finally:
      state.set_local(previous)


def _concrete_mesh_state():
  """jax's context state holding the concrete mesh of ``jax.set_mesh``, or None if not found
  (``jax._src.mesh.device_context`` from jax 0.11, ``jax._src.config.device_context`` before)."""
  import importlib
  for module in ("jax._src.mesh", "jax._src.config"):
    try:
      state = getattr(importlib.import_module(module), "device_context", None)
    except ImportError:
      state = None
    if state is not None and hasattr(state, "swap_local"):
      return state
  return None


@contextlib.contextmanager
def gpu_lowering_target(enabled: bool = True):
  """Lowers the Pallas Triton kernels traced inside for :data:`EXPORT_GPU` when no GPU is known.

  The Triton lowering reads its GPU from the abstract mesh that was current
  when the kernel was traced (``jax.sharding.use_abstract_mesh``); without an
  abstract GPU device it takes the local GPU and, on a host without one, fails.
  A GPU host, or a caller that set an abstract GPU device (to lower for a given
  GPU model), is left alone; otherwise an empty abstract mesh (no mesh axes in
  context) gains the abstract device :data:`EXPORT_GPU` for the kernels traced
  inside. A mesh with axes (inside ``shard_map``, under ``jax.set_mesh``) is
  left alone too: the arrays traced under it carry its device, and a kernel
  traced under another one fails jax's mesh checks. To lower such a program
  for ``cuda`` on a host without a GPU, trace it under a mesh whose abstract
  device is a GPU (``jax.sharding.AbstractMesh(..., abstract_device=...)``).

  Args:
    enabled: False for kernels in interpret mode, which lower to XLA ops, not Triton.
  """
  mesh = jax.sharding.get_abstract_mesh()
  device = mesh.abstract_device
  if (not enabled or not mesh.empty or (device is not None and device.platform in _GPU_PLATFORMS)
      or (device is None and jax.default_backend() == "gpu")):
    yield
    return
  target = jax.sharding.AbstractDevice(**EXPORT_GPU)
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=target)):
    yield
