"""Sparse attention: attention restricted to a :mod:`attnjax.patterns` pattern.

:func:`attnjax.sparse_attention` has two engines (:data:`~attnjax.sparse.OP`,
``implementation=``), tested equal in value and gradient: ``"reference"`` (the pattern's
exact dense mask, ``[B, N, T, S]``) and ``"blockwise"`` (auto-dispatch's from
:data:`BLOCKWISE_MIN_LENGTH` tokens on; formerly ``"block_sparse"``): the pattern's block
layout drives the block-wise kernel, so cost and memory follow the kept blocks. Every dense option is validated by
:func:`attnjax.options.validate` and means what it means for dense attention.

Guide: :doc:`/guides/sparse`, section "Patterns".
"""

from attnjax._src.ops.sparse.attention import (
  BLOCKWISE_MIN_LENGTH,
  CHUNK_BLOCKS,
  DENSE_KEYWORDS,
  ENGINES,
  IMPLEMENTATIONS,
  OP,
  SPARSE_STATIC,
  STRIDED_TWO_PASS_MIN_LENGTH,
  banded_chunks,
  block_sparse,
  sparse_attention,
)

__all__ = [
  "BLOCKWISE_MIN_LENGTH",
  "CHUNK_BLOCKS",
  "DENSE_KEYWORDS",
  "ENGINES",
  "IMPLEMENTATIONS",
  "OP",
  "SPARSE_STATIC",
  "STRIDED_TWO_PASS_MIN_LENGTH",
  "banded_chunks",
  "block_sparse",
  "sparse_attention",
]
