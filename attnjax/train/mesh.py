"""The training mesh: data, FSDP, tensor and context parallelism from ``config.mesh``.

A run's devices (every process's) form one mesh with axes ``("data", "fsdp",
"tensor", "context")`` whose sizes come from ``config.mesh`` (one of them may be
``-1``: the devices left). Logical axis rules (as MaxText's and levanter's) map
the model's named dimensions onto it:

=============  ======================  ===============================================
logical name   mesh axis               what it shards
=============  ======================  ===============================================
``embed``      ``fsdp``                every matrix's model-width dimension (FSDP)
``heads``      ``tensor``              attention heads (Megatron tensor parallelism)
``mlp``        ``tensor``              the MLP's hidden width
``vocab``      ``tensor``              the embedding / output vocabulary
batch          (``data``, ``fsdp``)    the activations' batch rows
length         ``context``             the activations' sequence (context parallelism)
=============  ======================  ===============================================

The model is initialised directly sharded (``jax.jit`` of its construction with
the parameters' shardings as outputs: no device ever holds the whole model), the
optimizer state is sharded like the parameters it mirrors, and the train step
keeps both where they are. Platform attention kernels run inside ``shard_map``
over the batch and head axes (``attnjax._sharding.per_shard``); with
``context`` > 1 every attention layer runs sequence-sharded inside ``shard_map``
(``attnjax.nn._context``: the ring for the dense family, state passing for the
recurrent ones).
"""

from attnjax._src.train.mesh import (AXES, BATCH_AXES, LENGTH_AXIS, LOGICAL_AXIS_RULES,
                                     MeshParallel, bytes_per_device, check_shapes, mesh_sizes,
                                     to_host)

__all__ = ["AXES", "BATCH_AXES", "LENGTH_AXIS", "LOGICAL_AXIS_RULES", "MeshParallel",
    "bytes_per_device", "check_shapes", "mesh_sizes", "to_host"]
