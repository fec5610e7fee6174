"""Sparse attention: attention restricted to a :mod:`attnjax.patterns` pattern.

Two engines (:data:`~attnjax.sparse.OP`, ``implementation=``), tested equal in value and gradient:

- ``"reference"``: the pattern's exact dense mask handed to the dense
  reference (:func:`attnjax.dense.reference`); materialises ``[B, N, T, S]``.
- ``"blockwise"`` (formerly ``"block_sparse"``, which still works and warns once): the
  pattern's block layout drives the block-wise dense
  kernel (:mod:`attnjax.kernels.blockwise`), which visits, for each query block, only
  the key blocks the layout lists, applies the pattern's element rule only on
  the partial ones, and recomputes in its backward pass. Cost and memory follow
  the number of kept blocks. A banded pattern (a sliding window) on a long
  sequence runs chunk by chunk under ``lax.map`` with one layout shared by all
  chunks, so its compiled program and working memory do not grow with ``T``
  (not with ``bias`` or ``return_stats``, which take the whole-sequence layout).
  So does a band with a few global columns and rows
  (:meth:`attnjax.patterns.Pattern.band_parts`: ``sinks_window``,
  ``global_window``): the columns become gathered key slots of every chunk,
  the global rows are computed on their own.
  Patterns with scattered keys (``fixed``'s summary columns) visit a gathered
  copy of those keys rather than every block that holds one. ``strided`` with
  a normaliser that can merge partial results (softmax family; see
  ``Normalizer.mergeable``) runs as its two factors, a
  sliding window and the columns of the transposed sequence, merged exactly.
  ``dilated_window(w, d)`` runs as a sliding window of ``w`` keys on each of
  the ``d`` residue columns of the sequence (cost follows the kept keys).

Both go through :func:`attnjax.options.validate`, so every dense option is
validated the same way and means the same thing.
"""

from attnjax._src.ops.sparse.attention import (CHUNK_BLOCKS, DENSE_KEYWORDS, ENGINES,
                                               IMPLEMENTATIONS, OP, SPARSE_STATIC, banded_chunks,
                                               block_sparse, sparse_attention)

__all__ = ["CHUNK_BLOCKS", "DENSE_KEYWORDS", "ENGINES", "IMPLEMENTATIONS", "OP", "SPARSE_STATIC",
    "banded_chunks", "block_sparse", "sparse_attention"]
