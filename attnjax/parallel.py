"""Context parallelism: attention over a sequence sharded across devices.

Called inside ``jax.shard_map`` with the token axis of every input sharded
over one mesh axis (``context_axis=`` of the attention functions), each call
returns its shard of the output, equal to the unsharded call.

Dense family (:func:`~attnjax.parallel.attention`, ``context_strategy=``):

- ``"ring"`` (default): keys/values travel around the ring, the normaliser's
  online state stays (``attnjax.kernels.blockwise.ring``); O(T / P) memory.
- ``"all_gather"``: keys/values (and their segment ids) are gathered, the
  queries stay sharded and run the single-device path at their global
  positions (with ``return_stats``: the block-wise kernel, statistics over
  every device's rows).
- ``"all_to_all"`` (Ulysses, Jacobs et al. 2023): heads <-> sequence, any
  single-device implementation on the whole sequence for ``N / P`` heads,
  then back.

``sparse_attention(context_axis=)``: the pattern as a ``mask_mod`` on global
positions over the dense strategies (its causality and band let the ring skip
shard pairs out of reach).

Every family's strategy is declared on its op (``attnjax._op.Op.context``) and run by
``attnjax._op.run``, which hands it the op's per-device computation.

Recurrent families (:func:`.state_passing`, ``context_axis=`` of
``gated_linear_attention`` and ``delta_rule_attention``): each device's
affine state map ``S -> A S + B`` over its tokens, summed to every device,
composed into its entering state, then its own pass from there.
``linear_attention(context_axis=)``: its map is ``S -> S + phi(K)^T V``, so
only the sums travel (``attnjax.parallel.recurrent.every_shard``, the
same one all-reduce): causal, the earlier shards' sums (an exclusive scan);
non-causal, the global ``K^T V`` and normaliser.

Layouts of the sequence (``context_layout=``): ``"contiguous"`` (shard ``p``
holds tokens ``p * T / P ..``) or ``"zigzag"`` (shard ``p`` holds chunks
``p`` and ``2P - 1 - p`` of ``2P``; under a causal mask every device does the
same work). :func:`.zigzag` / :func:`.unzigzag` reorder a token axis between
the natural order and the order whose contiguous shards are the zigzag ones.
"""

from attnjax._src.parallel import (CONTEXT_LAYOUTS, CONTEXT_STRATEGIES, attention, ring_plan,
                                   shard_positions, state_passing, unzigzag, zigzag)

__all__ = ["CONTEXT_LAYOUTS", "CONTEXT_STRATEGIES", "attention", "ring_plan", "shard_positions",
    "state_passing", "unzigzag", "zigzag"]
