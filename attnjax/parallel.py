"""Context parallelism: attention over a sequence sharded across devices.

Called inside ``jax.shard_map`` with the token axis of every input sharded over one
mesh axis (``context_axis=`` of the attention functions), each call returns its shard
of the output, equal to the unsharded call. The dense family takes
``context_strategy="ring"`` (default), ``"all_gather"`` or ``"all_to_all"`` (Ulysses);
the recurrent families pass their state from shard to shard. ``context_layout=`` is
``"contiguous"`` or ``"zigzag"`` (:func:`.zigzag` / :func:`.unzigzag` reorder a token
axis; :func:`.shard_positions` says which tokens a shard holds).

Guide: :doc:`/guides/context_parallel`.
"""

from attnjax._src.kernels.blockwise.ring import plan as ring_plan, shard_positions
from attnjax._src.options import CONTEXT_LAYOUTS, CONTEXT_STRATEGIES
from attnjax._src.parallel.tokens import unzigzag, zigzag

__all__ = [
  "CONTEXT_LAYOUTS",
  "CONTEXT_STRATEGIES",
  "ring_plan",
  "shard_positions",
  "unzigzag",
  "zigzag",
]
