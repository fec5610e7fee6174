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
from typing import Any, Callable, Sequence

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

PLATFORMS = ("cpu", "cuda", "tpu")
# The DenseOptions fields every platform kernel (cuDNN, splash, pallas_gpu) is written for. A
# field added later is reported by unknown_options until a kernel lists it, so auto-dispatch
# never drops it.
KERNEL_OPTIONS = ("is_causal", "window", "scale", "normalizer", "softcap", "similarity",
                  "return_stats")

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
