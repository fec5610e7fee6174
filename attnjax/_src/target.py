"""The device a program is traced for: its kind, a GPU's generation, the host's cuDNN.

Inside ``jax.jit`` a kernel cannot see the device it will run on; what it can
read while tracing is the ambient mesh (``jax.set_mesh``: how a deviceless
compile names its target, :mod:`attnjax.targets`) and this process's own
devices. Block-size tables, the engines' ``unsupported`` and the kernel-trust
rule of auto-dispatch read the target through these functions.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

# jax's device platform names by platform_dependent key.
_DEVICE_PLATFORMS = {"cuda": ("gpu", "cuda"), "tpu": ("tpu",), "cpu": ("cpu",)}

# Compute capability (major) by GPU device kind, for targets known only by their abstract mesh
# (inside jit, jax exposes the ambient mesh's device kind, not the device itself).
_GPU_MAJOR_BY_KIND = (
  ("H100", 9),
  ("H200", 9),
  ("H800", 9),
  ("H20", 9),
  ("GH200", 9),
  ("B200", 10),
  ("B300", 10),
  ("GB200", 10),
  ("GB300", 10),
  ("A100", 8),
  ("A800", 8),
  ("A10", 8),
  ("A30", 8),
  ("A40", 8),
  ("A6000", 8),
  ("L4", 8),
  ("L40", 8),
)


def _local_devices(platform: str) -> list:
  """This process's devices of ``platform`` (a ``platform_dependent`` key), or []."""
  try:
    return jax.devices("gpu" if platform == "cuda" else platform)
  except RuntimeError:  # no such backend in this process
    return []


def device_kind(platform: str) -> Optional[str]:
  """The kind of device (``jax.Device.device_kind``) a program traced now runs on when it is
  lowered for ``platform`` (``"cuda"``, ``"tpu"``, ``"cpu"``), or None where unknown.

  The ambient mesh's device when it is of that platform (``jax.set_mesh``: a
  deviceless compile's target), else this process's first device of that
  platform, else None (e.g. a CPU host exporting for ``cuda``).
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  if device is not None and getattr(device, "platform", None) in _DEVICE_PLATFORMS.get(
    platform, (platform,)
  ):
    return device.device_kind
  devices = _local_devices(platform)
  return devices[0].device_kind if devices else None


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


def local_gpu_major() -> Optional[int]:
  """This process's first GPU's compute capability major, or None on a host without a GPU."""
  gpus = _local_devices("cuda")
  if not gpus:
    return None
  cc = getattr(gpus[0], "compute_capability", None)
  return int(str(cc).split(".")[0]) if cc else _major_of_kind(gpus[0].device_kind)


@functools.lru_cache(maxsize=1)
def cudnn_version() -> Optional[int]:
  """The cuDNN version jax's attention wrapper finds on this host, or None.

  ``jax.nn.dot_product_attention(implementation="cudnn")`` reads the local
  cuDNN's version while it traces, whatever platform the program is lowered
  for: a program holding it can be traced (and exported or compiled for
  ``cuda``) on any host with the cuDNN library, with or without a GPU.
  """
  try:
    return _jax_cudnn_version()
  except Exception:  # no plugin, no library, or an older layout of jax's internals
    return None


def _jax_cudnn_version() -> int:
  """The version jax's own cuDNN attention reads (raises where it finds no library).

  Why private jax: whether jax can trace its cuDNN call on this host is exactly
  whether this succeeds, and jax exposes no public query for it. Needed on every
  jax this project supports (0.10.2 to 0.12, where it is
  ``jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version``).
  """
  from jax._src.cudnn import fused_attention_stablehlo

  return int(fused_attention_stablehlo.check_cudnn_version())
