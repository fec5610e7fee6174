"""Choosing code per platform when a program is lowered, and failing clearly on the wrong one.

:func:`on_platform` puts a platform kernel in its platform's branch of
``jax.lax.platform_dependent`` and :func:`fail` in every other, whose lowering (and
derivatives) raise a ``ValueError`` naming the implementation and the platform.
:func:`gpu_lowering_target` supplies a GPU model (:data:`EXPORT_GPU`) to lower Triton
kernels on a host without one; :func:`host_eval` computes static tables on this host
while tracing for a mesh of other devices.
Guide: docs/guides/architecture.md, section "Platforms and lowering".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

# The platforms auto-dispatch chooses for (jax.lax.platform_dependent keys).
PLATFORMS = ("cpu", "cuda", "tpu")

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
  del message
  vma = frozenset().union(*(getattr(a, "vma", None) or frozenset() for a in args))
  return [a.update(vma=vma) for a in out_avals] if vma else list(out_avals)


def _fail_impl(*args, message: str, out_avals: tuple):
  del args, out_avals
  raise ValueError(message)


def _fail_lowering(ctx, *args, message: str, out_avals: tuple):
  del args, out_avals
  platforms = ", ".join(repr(p) for p in (ctx.module_context.platforms or ()))
  raise ValueError(f"{message} (this program is being lowered for {platforms})")


def _fail_jvp(primals, tangents, *, message: str, out_avals: tuple):
  # The tangent fails too, reading the primals as well as the tangents (linear in these, the
  # transpose failing in turn): a derivative of any order kept without the primal (a loss
  # linear in the output, whose forward XLA drops) still reaches the failure.
  out = _fail_p.bind(*primals, message=message, out_avals=out_avals)
  live = [t for t in tangents if type(t) is not ad.Zero]
  t_avals = tuple(a.to_tangent_aval() for a in out_avals)
  if not live:
    return out, [ad.Zero(a) for a in t_avals]
  return out, _fail_p.bind(*primals, *live, message=message, out_avals=t_avals)


def _fail_transpose(cts, *args, message: str, out_avals: tuple):
  del out_avals
  live = [ct for ct in cts if type(ct) is not ad.Zero]
  known = [a for a in args if not ad.is_undefined_primal(a)]
  undefined = tuple(a.aval for a in args if ad.is_undefined_primal(a))
  if not live or not undefined:
    return [None] * len(args)
  failed = iter(_fail_p.bind(*known, *live, message=message, out_avals=undefined))
  return [next(failed) if ad.is_undefined_primal(a) else None for a in args]


def _fail_batch(args, dims, *, message: str, out_avals: tuple):
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  avals = tuple(a.update(shape=(size,) + a.shape) for a in out_avals)
  out = _fail_p.bind(*args, message=message, out_avals=avals)
  return out, [0] * len(out)


_fail_p.def_abstract_eval(_fail_abstract)
_fail_p.def_impl(_fail_impl)
mlir.register_lowering(_fail_p, _fail_lowering)
ad.primitive_jvps[_fail_p] = _fail_jvp
ad.primitive_transposes[_fail_p] = _fail_transpose
batching.primitive_batchers[_fail_p] = _fail_batch


def fail(message: str, like: Any, operands: Any = ()) -> Any:
  """Values shaped like ``like`` (a pytree of ShapeDtypeStructs) whose lowering raises ``message``.

  ``operands`` (a pytree of arrays, e.g. the inputs of the computation this stands for):
  the values' derivatives with respect to them are values that fail in the same way.
  """
  leaves, tree = jax.tree.flatten(like)
  avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
  args = [
    x
    for x in jax.tree.leaves(operands)
    if isinstance(x, jax.core.Tracer) and jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return jax.tree.unflatten(tree, _fail_p.bind(*args, message=message, out_avals=avals))


def current_platform() -> str:
  """The default backend as a ``platform_dependent`` key (``"gpu"`` -> ``"cuda"``)."""
  backend = jax.default_backend()
  return "cuda" if backend == "gpu" else backend


def on_platform(platform: str, fn: Callable[[], Any], message: str) -> Any:
  """``fn()`` when lowered for ``platform``; lowering for any other platform raises ``message``.

  The other platforms' branch reads the traced arrays ``fn`` closes over (its inputs), so
  the derivatives of ``fn()`` raise there too (:func:`fail`).
  """
  closed, like = jax.make_jaxpr(fn, return_shape=True)()
  return jax.lax.platform_dependent(
    **{platform: fn}, default=lambda: fail(message, like, closed.consts)
  )


def wrong_platform(name: str, where: str) -> str:
  """The message of an engine lowered for another platform than its own: ``where`` says where it
  runs (e.g. "runs on a TPU only (a Mosaic kernel)")."""
  return f"implementation={name!r} {where}; use implementation=None to pick per platform"


@contextlib.contextmanager
def host_eval():
  """``jax.ensure_compile_time_eval()`` on this process's default device.

  Static structure (block layouts, a kernel's constant tables) is computed
  concretely even while a function is traced. Under ``jax.set_mesh(mesh)`` jax
  runs such eager work on the mesh's devices, and for a deviceless compile
  those are compile-only: they run nothing. jax has no public way to step out
  of the mesh inside a trace (``set_mesh`` refuses), so this swaps its
  concrete-mesh context for the duration (:func:`_concrete_mesh_context`); where
  jax's internals moved, only ``ensure_compile_time_eval`` applies.
  """
  state, empty = _concrete_mesh_context()
  with jax.ensure_compile_time_eval():
    if state is None:
      yield
      return
    previous = state.swap_local(empty)
    try:
      yield
    finally:
      state.set_local(previous)


def _concrete_mesh_context() -> tuple[Any, Any]:
  """``(state, empty mesh)``: jax's context state holding the concrete mesh of
  ``jax.set_mesh`` and the value ``jax.set_mesh(None)`` puts there; ``(None, None)`` where
  jax's internals are not found.

  Why private jax: :func:`host_eval` must run eager work on this host inside a trace under
  ``jax.set_mesh`` (which runs it on the mesh's devices, compile-only ones for a deviceless
  compile), and jax offers no public way out of the mesh there. Needed on every jax this
  project supports (0.10.2 to 0.12): the state is ``jax._src.config.device_context`` on
  jax 0.10.2 and ``jax._src.mesh.device_context`` on jax 0.12, the empty mesh
  ``jax._src.mesh.empty_concrete_mesh`` on both.
  """
  try:
    from jax._src import config as config_lib
    from jax._src import mesh as mesh_lib
  except ImportError:
    return None, None
  for module in (mesh_lib, config_lib):
    state = getattr(module, "device_context", None)
    if state is not None and hasattr(state, "swap_local"):
      return state, getattr(mesh_lib, "empty_concrete_mesh", None)
  return None, None


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
  if (
    not enabled
    or not mesh.empty
    or (device is not None and device.platform in _GPU_PLATFORMS)
    or (device is None and jax.default_backend() == "gpu")
  ):
    yield
    return
  target = jax.sharding.AbstractDevice(**EXPORT_GPU)
  with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=target)):
    yield
