"""Start several local processes of one command under ``jax.distributed`` (multi-process on a host).

``python -m attnjax.train.launch --processes 2 --devices-per-process 4 -- <command>``
gives every process the coordinator, process count and id (and, on the CPU, its devices
with gloo collectives), so :func:`attnjax.train.init_distributed` joins them into one
run. Output lines are prefixed ``[p<i>]``; if one process fails, the others are stopped
and the launcher exits with its status. On a cluster its own launcher (``srun``,
``gcloud ... --worker=all``) takes this role and the entry points run unchanged.

Guide: :doc:`/guides/training`, section "Meshes and multi-host runs".
"""

from attnjax._src.train.launch import environments, free_port, launch

__all__ = ["environments", "free_port", "launch"]

if __name__ == "__main__":
  import sys

  from attnjax._src.train.launch import main

  sys.exit(main())
