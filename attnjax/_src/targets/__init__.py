"""Compile-only devices of real targets: compile for an H100, H200, A100 or a TPU slice from a CPU
host.

Implementation behind the public module :mod:`attnjax.targets`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
from typing import Optional, Sequence

import numpy as np

# GPU targets: name -> target description file beside this module.
GPU_TARGETS = {"h100": "h100.txtpb", "h200": "h200.txtpb", "a100": "a100.txtpb"}
# TPU generations libtpu describes without a TPU; the smallest slice of each is 2x2 (4 chips).
TPU_TARGETS = ("v5e", "v6e")
# The environment that lets the plugins describe devices this host does not have: no cuDNN
# constraints check (no GPU driver here), no TPU metadata server, and libtpu loaded by several
# processes at once (test workers: libtpu otherwise holds a machine-wide lock file).
ENVIRONMENT = {
  "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
  "TPU_SKIP_MDS_QUERY": "1",
  "TPU_WORKER_HOSTNAMES": "localhost",
  "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}

_HERE = pathlib.Path(__file__).resolve().parent


def configure_environment() -> None:
  """Sets :data:`.ENVIRONMENT` in ``os.environ`` where not already set.

  Call it before jax initialises its backends (the first array or device query).
  """
  for key, value in ENVIRONMENT.items():
    os.environ.setdefault(key, value)


def _installed(module: str) -> bool:
  """Whether ``module`` (a dotted name) can be imported; False when a parent package is absent
  (``importlib.util.find_spec`` of ``a.b`` imports ``a`` and raises without it)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def missing(platform: str) -> Optional[str]:
  """Why this host cannot compile for ``platform``, or None if it can.

  Args:
    platform: ``"cuda"`` or ``"tpu"``.

  Returns:
    None, or a sentence naming the missing package and the extra that installs it.

  Raises:
    ValueError: another platform.
  """
  if platform == "cuda":
    if not _installed("jax_plugins.xla_cuda12"):
      return (
        "jax's CUDA plugin is not installed (pip install 'attnjax[aot]': "
        "jax[cuda12-local] pinned to jaxlib, nvidia-cuda-runtime-cu12)"
      )
    return None
  if platform == "tpu":
    if not _installed("libtpu"):
      return "libtpu is not installed (pip install 'attnjax[aot]': jax[tpu] pinned to jaxlib)"
    return None
  raise ValueError(f"platform must be 'cuda' or 'tpu', got {platform!r}")


def target_config(name: str) -> str:
  """The target description of a GPU, read from the package's ``*.txtpb`` files.

  Args:
    name: a key of :data:`.GPU_TARGETS` (``"h100"``, ``"h200"``, ``"a100"``).

  Returns:
    The ``GpuTargetConfigProto`` text.

  Raises:
    ValueError: an unknown name.
  """
  if name not in GPU_TARGETS:
    raise ValueError(f"GPU target must be one of {sorted(GPU_TARGETS)}, got {name!r}")
  return (_HERE / GPU_TARGETS[name]).read_text()


@functools.lru_cache(maxsize=None)
def gpu_devices(name: str = "h200", num_devices: int = 1) -> tuple:
  """Compile-only GPUs of one host (cached: one topology per shape).

  Args:
    name: a key of :data:`.GPU_TARGETS`.
    num_devices: GPUs on the host.

  Returns:
    A tuple of ``num_devices`` jax devices that programs compile for (they run nothing).

  Raises:
    RuntimeError: jax's CUDA plugin is not installed (the ``aot`` extra).
    ValueError: an unknown name.
  """
  from jax.experimental import topologies

  configure_environment()
  reason = missing("cuda")
  if reason:
    raise RuntimeError(reason)
  topo = topologies.get_topology_desc(
    platform="cuda", target_config=target_config(name), topology=f"1x1x{num_devices}"
  )
  return tuple(topo.devices)


@functools.lru_cache(maxsize=None)
def tpu_devices(name: str = "v5e", shape: str = "2x2") -> tuple:
  """The compile-only chips of a TPU slice ``name:shape``.

  Args:
    name: a TPU generation of :data:`.TPU_TARGETS` (``"v5e"``, ``"v6e"``).
    shape: the slice's chip grid, e.g. ``"2x2"`` (4 chips).

  Returns:
    A tuple of jax devices that programs compile for.

  Raises:
    RuntimeError: libtpu is not installed (the ``aot`` extra).
    ValueError: an unknown generation.
  """
  from jax.experimental import topologies

  configure_environment()
  if name not in TPU_TARGETS:
    raise ValueError(f"TPU target must be one of {TPU_TARGETS}, got {name!r}")
  reason = missing("tpu")
  if reason:
    raise RuntimeError(reason)
  return tuple(topologies.get_topology_desc(f"{name}:{shape}", "tpu").devices)


def mesh(
  devices: Sequence, axis_names: Sequence[str] = ("data",), shape: Optional[Sequence[int]] = None
):
  """A ``jax.sharding.Mesh`` over compile-only (or real) devices.

  Args:
    devices: the devices, e.g. from :func:`.gpu_devices` or :func:`.tpu_devices`.
    axis_names: the mesh's axis names.
    shape: the mesh's shape; None puts every device on one axis.

  Returns:
    The mesh.
  """
  import jax

  shape = (len(devices),) if shape is None else tuple(shape)
  return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), tuple(axis_names))
