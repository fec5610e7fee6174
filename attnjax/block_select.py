"""Content-selected block-sparse attention (MoBA, Lu et al. 2025; NSA's selection branch).

:func:`attnjax.block_select_attention` cuts the sequence into blocks of ``block_size``;
each query block scores the key blocks by its pooled query against their mean key, keeps
the ``top_k`` best candidates plus its own block, and attends to them in one
normalisation (any normaliser). :func:`.select_blocks` is the selection rule every
implementation shares; ``"reference"`` (an explicit mask) and ``"gathered"`` (default:
the selected blocks gathered per KV head, cost following ``top_k``, not ``T``) are
tested equal in value and gradient.

Guide: :doc:`/guides/sparse`, section "Content-selected blocks (MoBA)".
"""

from attnjax._src.ops.block_select.attention import (
  IMPLEMENTATIONS,
  QUERY_POOLS,
  block_select_attention,
  select_blocks,
  selection_mask,
)

__all__ = [
  "IMPLEMENTATIONS",
  "QUERY_POOLS",
  "block_select_attention",
  "select_blocks",
  "selection_mask",
]
