"""Start several local processes of one command under ``jax.distributed`` (multi-process on a host).

    python -m attnjax.train.launch --processes 2 --devices-per-process 4 -- \\
        python experiments/train.py --config experiments/configs/shakespeare.py:preset=cpu \\
        --out runs/train/two_procs

Every process gets ``JAX_COORDINATOR_ADDRESS=127.0.0.1:<port>``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and, on the CPU (the default platform
here), ``JAX_NUM_CPU_DEVICES`` devices with gloo collectives; the entry points'
:func:`attnjax.train.init_distributed` joins them into one run over all
``processes x devices-per-process`` devices (the mesh of ``config.mesh``), each
process feeding its own rows of every batch and writing its shards of every
checkpoint. Output lines are prefixed ``[p<i>]``. If one process exits with an
error or is killed, the others are stopped (a collective would wait for it
forever) and the launcher exits with that status; running the same command
again resumes the run from its last checkpoint.

On a GPU cluster or a TPU pod the cluster's own launcher (SLURM's ``srun``, a
TPU VM's ``gcloud ... --worker=all``) starts one process per host instead and
sets the coordinator (``JAX_COORDINATOR_ADDRESS`` or the cluster's variables
jax reads), and the same entry points run unchanged.
"""

from attnjax._src.train.launch import environments, free_port, launch, main

__all__ = ["environments", "free_port", "launch", "main"]

if __name__ == "__main__":
  import sys

  from attnjax._src.train.launch import main

  sys.exit(main())
