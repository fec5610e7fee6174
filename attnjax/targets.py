"""Compile-only devices of real targets: compile for an H100, H200, A100 or a TPU slice from a CPU host.

Only a compile validates a kernel for a platform (a lowering does not). With the ``aot``
extra (``pip install 'attnjax[aot]'``: jax's CUDA plugin, CUDA runtime and cuDNN, and
``libtpu``), :func:`configure_environment` (before jax starts its backends),
:func:`gpu_devices` / :func:`tpu_devices` and :func:`mesh` give devices to compile for
without having them. Set the mesh while tracing (``jax.set_mesh``): dispatch reads it
to put platform kernels inside ``shard_map``, and the device kind to pick block sizes.

Guide: :doc:`/guides/targets`.
"""

from attnjax._src.targets import (
  ENVIRONMENT,
  GPU_TARGETS,
  TPU_TARGETS,
  configure_environment,
  gpu_devices,
  mesh,
  missing,
  target_config,
  tpu_devices,
)

__all__ = [
  "ENVIRONMENT",
  "GPU_TARGETS",
  "TPU_TARGETS",
  "configure_environment",
  "gpu_devices",
  "mesh",
  "missing",
  "target_config",
  "tpu_devices",
]
