"""Memory-compressed attention: queries attend to keys and values pooled along the sequence.

Keys and values are reduced in blocks of ``stride`` positions (Liu et al.
2018): compressed key ``c`` summarises raw keys ``c * stride .. min((c + 1) *
stride, S) - 1`` (the last block may be partial and is pooled over the keys
it has). Optionally each query also sees the raw keys of a local window (the
compression + window branches of NSA, Yuan et al. 2025), in ONE normalisation
over both: the keys of the call are ``[compressed ; raw]``, ``C + S`` slots.

Rules (positions top-left aligned, query ``i`` at position ``i``):

- causal: query ``i`` sees compressed block ``c`` iff the block ends at or
  before it, ``(c + 1) * stride - 1 <= i`` (a partial last block counts as
  ending where a whole one would, so no output depends on the sequence's
  length and decoding equals the full forward); with ``window=w`` it also
  sees the raw keys ``i - w <= j <= i`` (its own key and the ``w`` before, as
  ``patterns.sliding_window(w)``; ``window=(left, right)`` is cut at ``j <= i``).
  The first ``stride - 1`` queries see no compressed block; without a window
  their rows are empty and return zeros.
- not causal: every query sees every compressed block; with ``window=(left,
  right)`` also the raw keys ``i - left <= j <= i + right`` (an int ``w`` is
  ``(w, 0)``, the convention of every window: ``attnjax._checks.check_window``).
- segment ids: a compressed block is seen only by queries of the segment that
  holds all of its keys (a block straddling a boundary is seen by nobody);
  raw window keys follow the usual rule.

Two engines (:data:`~attnjax.compressed.OP`, ``implementation=``), tested equal in value and gradient:

- ``"reference"``: builds the compressed keys, concatenates ``[compressed ;
  raw]`` and runs :func:`attnjax.dense.reference` with the explicit mask.
- ``"blockwise"`` (default): the concatenation runs through ONE block-wise
  kernel call (:func:`attnjax.kernels.blockwise.run_layout`) over a block layout of
  the rule, so blocks with no allowed pair are never computed (the
  compressed part padded to whole key blocks, so the raw window starts on a
  block edge); ``_one_call``. Causal self-attention (``T == S``, no
  segment ids or statistics; with a window, a mergeable normaliser) is
  *evaluated* faster another way, ``_grouped_queries``: the ``stride``
  queries that see the same compressed blocks become extra heads of one
  causal call over ``T / stride`` rows (tiles with ``stride`` times more
  rows, whose products XLA:CPU spreads over cores), the window a sliding-window
  call merged by logsumexp. That path is a ``jax.custom_jvp`` whose
  derivative is the one call's (``_grouped_forward``): differentiating
  the two-call path held twice the memory (fwd+bwd at T=16384, stride 4,
  window 64: XLA temporaries 499 vs 233 MiB), while its forward is ~30%
  faster (T=4096: 84-86 vs 121 ms on 2 CPU cores). Cost ``O(T * (T / stride
  + w))``, memory linear in ``T``.

For example:

>>> import jax
>>> import attnjax
>>> q = jax.random.normal(jax.random.key(0), (2, 64, 4, 8))
>>> k = v = jax.random.normal(jax.random.key(1), (2, 64, 2, 8))
>>> attnjax.compressed_attention(q, k, v, stride=4, is_causal=True, window=16).shape
(2, 64, 4, 8)
>>> k_c = attnjax.compressed.pool_keys(k, 4, "max")
>>> v_c = attnjax.compressed.pool_keys(v, 4, "max")
>>> k_c.shape                                  # [B, S / stride, K, H]
(2, 16, 2, 8)
>>> attnjax.compressed_attention(q, k, v, stride=4, pool=(k_c, v_c)).shape  # your own pooling
(2, 64, 4, 8)

References:
  Liu et al. 2018, "Generating Wikipedia by Summarizing Long Sequences"
  (memory-compressed attention), arXiv:1801.10198.
  Yuan et al. 2025, "Native Sparse Attention" (compressed + window
  branches), arXiv:2502.11089.
"""

from attnjax._src.ops.compressed.attention import (DENSE_KEYWORDS, ENGINES, IMPLEMENTATIONS, OP,
                                                   POOLS, STRADDLING_SEGMENT, CompressedRule,
                                                   block_segments, compressed_attention,
                                                   num_blocks, pool_keys)

__all__ = ["DENSE_KEYWORDS", "ENGINES", "IMPLEMENTATIONS", "OP", "POOLS", "STRADDLING_SEGMENT",
    "CompressedRule", "block_segments", "compressed_attention", "num_blocks", "pool_keys"]
