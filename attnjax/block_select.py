"""Content-selected block-sparse attention (MoBA, Lu et al. 2025; NSA's selection branch).

The sequence is cut into blocks of ``block_size`` positions. Each query block
scores key blocks by the dot product of its pooled query with each block's
mean-pooled key, keeps the ``top_k`` best candidates plus its own block, and
attends to the union of those blocks in ONE normalisation (any normaliser of
:mod:`attnjax.normalizers`).

Selection rule (shared by every implementation, :func:`.select_blocks`):

- pooled key of block ``j``: the mean of its keys (a partial last block: the
  mean of the keys it has);
- pooled query of block ``i``: ``query_pool="mean"`` the mean of its queries
  (one gate per block; MoBA itself gates each query token separately);
  ``"first"`` its first query. Causal calls take ``"first"`` (the default
  when ``is_causal``) and refuse ``"mean"``: a block's mean query holds its
  later queries, so which blocks an early query sees would depend on future
  tokens (no value crosses, but the choice does). ``"first"`` is strictly
  causal, which is also what a decoder with a KV cache needs; ``"mean"`` is
  the default for ``is_causal=False``;
- GQA: the query heads of a KV group share one selection, scored by the sum of
  their dot products over the group's heads (NSA sums its heads' compressed
  attention probabilities), so the selected keys are gathered once per KV
  head; with ``K == N`` the selection is per head (as MoBA);
- candidates: ``is_causal=True`` the strictly earlier blocks ``j < i``; the own
  block is always kept, under the causal mask. ``is_causal=False``: every
  other block ``j != i``; the own block is always kept, whole. A block with
  fewer than ``top_k`` candidates keeps all it has;
- ties go to the lower block index (``lax.top_k``); the selection is discrete
  (``stop_gradient``): gradients reach ``q``, ``k``, ``v`` through the
  attended keys only. ``segment_ids`` mask pairs after the selection (the
  selection ignores them).

Implementations (tested equal in value and gradient):

- ``"reference"``: the selection as an explicit ``[B, N, T, S]`` mask handed to
  :func:`attnjax.dense.reference`;
- ``"gathered"`` (default): per query block, the selected key and value blocks
  and the own block are gathered per KV head (``[B, K, (top_k + 1) *
  block_size, H]``) and the normaliser (:mod:`attnjax.normalizers`: its
  one-tile online form, or its materialised weights when statistics are asked
  for) runs on that ``[G * block_size, (top_k + 1) * block_size]`` tile (the
  query heads of a KV group stacked as rows), under ``lax.map`` with a
  checkpointed body: cost follows ``top_k``, not ``T``, and the backward
  recomputes one query block at a time. The tile's mask is a per-key validity
  and a constant causal triangle on the own block's columns. On CPU (B=1,
  N=8, H=64, block 64, top_k 8) the forward at T=8192 takes about 0.19x the
  block-wise dense causal kernel's time on one core and 0.27-0.28x on two:
  XLA:CPU runs the tile's ``[64, 64] x [64, 576]`` products on one thread
  (its dot library splits a product across threads only from about 256 rows),
  so they take ~104 ms of a ~140 ms forward with one core or two, while
  dense's 512-row tiles use both; the strided key/value gathers take most of
  the rest. Forward + backward at T=16384 peaks at about 580-700 MiB resident
  memory.
"""

from attnjax._src.ops.block_select.attention import (BLOCK_SELECT_STATIC, DENSE_KEYWORDS, ENGINES,
                                                     IMPLEMENTATIONS, OP, QUERY_POOLS,
                                                     block_scores, block_select_attention,
                                                     num_slots, select_blocks, selection_mask,
                                                     top_blocks)

__all__ = ["BLOCK_SELECT_STATIC", "DENSE_KEYWORDS", "ENGINES", "IMPLEMENTATIONS", "OP",
    "QUERY_POOLS", "block_scores", "block_select_attention", "num_slots", "select_blocks",
    "selection_mask", "top_blocks"]
