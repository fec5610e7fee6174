"""Compile-only devices of real targets: compile for an H100, H200, A100 or a TPU slice from a CPU host.

Lowering a program for a platform validates nothing about its kernels (a
Triton kernel that overflows shared memory lowers fine); only a compile does.
jax can compile for devices this host does not have ("deviceless" ahead-of-time
compilation, ``jax.experimental.topologies``), given the platform's compiler:

- CUDA: jax's CUDA plugin pinned to the installed jaxlib, ``nvidia-cuda-runtime-cu12``
  and, for jax's cuDNN attention (whose wrapper reads the cuDNN version while
  tracing), ``nvidia-cudnn-cu12``; the device is described by a GPU target
  description (a ``stream_executor.GpuTargetConfigProto`` text proto; the ones
  here keep the fields of XLA's own device specs that the compiler reads).
- TPU: ``libtpu`` pinned to jax (``jax[tpu]``).

``pip install 'attnjax[aot]'`` installs both. Then::

    from attnjax import targets
    targets.configure_environment()      # before jax initialises its backends
    mesh = targets.mesh(targets.gpu_devices("h200", 4), ("data",))
    x = jax.ShapeDtypeStruct((8, 1024, 8, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data")))
    with jax.set_mesh(mesh):             # dispatch reads the mesh (shard_map over kernels)
      compiled = jax.jit(fn).lower(x, x, x).compile()

Set the mesh while tracing: :func:`attnjax.dot_product_attention` reads the
ambient mesh to put platform kernels inside ``shard_map`` and the device kind
to pick block sizes.
"""

from attnjax._src.targets import (ENVIRONMENT, GPU_TARGETS, TPU_TARGETS, configure_environment,
                                  gpu_devices, mesh, missing, target_config, tpu_devices)

__all__ = ["ENVIRONMENT", "GPU_TARGETS", "TPU_TARGETS", "configure_environment", "gpu_devices",
    "mesh", "missing", "target_config", "tpu_devices"]
