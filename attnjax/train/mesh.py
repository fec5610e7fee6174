"""The training mesh: data, FSDP, tensor and context parallelism from ``config.mesh``.

A run's devices (every process's) form one mesh with axes ``("data", "fsdp", "tensor",
"context")`` sized by ``config.mesh`` (one may be ``-1``: the devices left); logical axis
rules map the model's named dimensions onto it (``embed`` -> ``fsdp``; ``heads``,
``mlp``, ``vocab`` -> ``tensor``; the batch -> ``data`` and ``fsdp``; the sequence ->
``context``). The model is initialised directly sharded, the optimizer state is sharded
like its parameters, and :func:`to_host` starts every array's copy to the host at once.

Guide: :doc:`/guides/training`, section "Meshes and multi-host runs".
"""

from attnjax._src.train.mesh import (
  AXES,
  BATCH_AXES,
  LENGTH_AXIS,
  LOGICAL_AXIS_RULES,
  RunMesh,
  bytes_per_device,
  check_shapes,
  mesh_sizes,
  to_host,
)
from attnjax._src.old_names import train_mesh as __getattr__  # noqa: F401 (PEP 562)

__all__ = [
  "AXES",
  "BATCH_AXES",
  "LENGTH_AXIS",
  "LOGICAL_AXIS_RULES",
  "RunMesh",
  "bytes_per_device",
  "check_shapes",
  "mesh_sizes",
  "to_host",
]
