"""Sparse attention: attention restricted to a :mod:`attnjax.patterns` pattern.

Two implementations, tested equal in value and gradient:

- ``"reference"``: the pattern's exact dense mask handed to the dense
  reference (:func:`attnjax.dense.reference`); materialises ``[B, N, T, S]``.
- ``"block_sparse"``: the pattern's block layout drives the block-wise dense
  kernel (:mod:`attnjax.blockwise`), which visits, for each query block, only
  the key blocks the layout lists, applies the pattern's element rule only on
  the partial ones, and recomputes in its backward pass. Cost and memory follow
  the number of kept blocks. A banded pattern (a sliding window) on a long
  sequence runs chunk by chunk under ``lax.map`` with one layout shared by all
  chunks, so its compiled program and working memory do not grow with ``T``
  (not with ``bias`` or ``return_stats``, which take the whole-sequence layout).
  Patterns with scattered keys (``fixed``'s summary columns) visit a gathered
  copy of those keys rather than every block that holds one.

Both go through :func:`attnjax.dense.prepare`, so every dense option is
validated the same way and means the same thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from attnjax import _checks, blockwise, dense, masks, patterns
from attnjax.patterns import Pattern

Array = jnp.ndarray

IMPLEMENTATIONS = ("reference", "block_sparse")


def _reference(inputs: dense.DenseInputs, opts: dense.DenseOptions, pattern: Pattern):
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  mask = masks.combine_masks(inputs.mask, pattern.mask(T, S))
  return dense.reference(dataclasses.replace(inputs, mask=mask), opts)


def _extend_keys(x: Array, extra: Array, axis: int) -> Array:
  """Appends the gathered copies ``x[..., extra, ...]`` along the key axis."""
  return jnp.concatenate([x, jnp.take(x, extra, axis=axis)], axis=axis)


def _block_sparse(inputs: dense.DenseInputs, opts: dense.DenseOptions, pattern: Pattern,
                  block_size: int):
  """The pattern's plan run by the shared block-wise kernel (:func:`blockwise.attention`)."""
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  plan = pattern.plan(T, S, block_size=block_size)
  if plan.extra_keys.size:
    # Keys the pattern visits through gathered copies (e.g. fixed's summary
    # columns): their gradients flow back to the originals through the gather.
    extra = jnp.asarray(plan.extra_keys)
    bias = inputs.bias
    if bias is not None and bias.shape[3] != 1:
      bias = _extend_keys(bias, extra, axis=3)
    kv_seg = inputs.kv_segment_ids
    inputs = dataclasses.replace(
        inputs, k=_extend_keys(inputs.k, extra, 1), v=_extend_keys(inputs.v, extra, 1),
        bias=bias, kv_segment_ids=None if kv_seg is None else _extend_keys(kv_seg, extra, 1))
  shape = (T, plan.layout.kv_len)
  rule = plan.rule

  def mask_fn(q_positions, k_positions):
    return rule.allowed(q_positions, k_positions, shape)[None, None]

  return blockwise.attention(inputs, opts, layout=plan.layout, mask_fn=mask_fn,
                             use_default_mask_fn=False)


# Query blocks per chunk of the banded path: bounds its compiled program (the
# kernel unrolls its visits) and its working memory, whatever the length.
CHUNK_BLOCKS = 4


def _banded_chunks(inputs: dense.DenseInputs, opts: dense.DenseOptions, pattern: Pattern,
                   block_size: int):
  """A banded pattern (e.g. a sliding window) run chunk by chunk under ``lax.map``.

  Every chunk of ``C`` queries sees the same ``C + left + right`` keys around
  it, so one layout and one compiled kernel serve all chunks; keys past the
  sequence ends are masked by a per-chunk key mask. Cost stays proportional to the kept blocks and
  compile time and memory no longer grow with ``T``.
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, _ = q.shape
  S = k.shape[1]
  left, right = pattern.band()
  C = CHUNK_BLOCKS * block_size
  num_chunks = -(-T // C)
  KW = C + left + right
  plan = patterns.band_chunk_plan(pattern, C, block_size)
  # Keys padded so that chunk c's keys are padded[c * C : c * C + KW]
  # (global positions c * C - left ...); padding is masked by position.
  key_len = num_chunks * C + left + right
  kept = min(S, key_len - left)

  def pad_keys(x):
    x = x[:, :kept]
    widths = [(0, 0)] * x.ndim
    widths[1] = (left, key_len - left - kept)
    return jnp.pad(x, widths)

  def pad_queries(x):
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, num_chunks * C - T)
    return jnp.pad(x, widths)

  qp, kp, vp = pad_queries(q), pad_keys(k), pad_keys(v)
  q_seg, kv_seg = inputs.q_segment_ids, inputs.kv_segment_ids
  if q_seg is not None:
    q_seg, kv_seg = pad_queries(q_seg), pad_keys(kv_seg)
  rule = plan.rule

  def mask_fn(q_local, k_local):
    return rule.allowed(q_local, k_local, (C, KW))[None, None]

  def one_chunk(c):
    start = c * C
    take = lambda x, n: jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)
    # Keys outside [0, S) are padding: masked by a [1, 1, 1, KW] data mask (an
    # argument of the kernel, so its custom VJP closes over nothing traced).
    # Padded queries are sliced off; their zero cotangent gives no gradient.
    k_global = start - left + jnp.arange(KW)
    key_ok = jnp.logical_and(k_global >= 0, k_global < S)[None, None, None, :]
    chunk_inputs = dataclasses.replace(
        inputs, q=take(qp, C), k=take(kp, KW), v=take(vp, KW), mask=key_ok,
        q_segment_ids=None if q_seg is None else take(q_seg, C),
        kv_segment_ids=None if kv_seg is None else take(kv_seg, KW))
    return blockwise.attention(chunk_inputs, opts, layout=plan.layout, mask_fn=mask_fn,
                               use_default_mask_fn=False)

  out = jax.lax.map(one_chunk, jnp.arange(num_chunks))  # [chunks, B, C, N, Hv]
  out = jnp.moveaxis(out, 0, 1).reshape((B, num_chunks * C) + out.shape[3:])
  return out[:, :T]


def _sparse_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    pattern: Pattern,
    block_size: int = 128,
    bias: Optional[Array] = None,
    scale: Optional[float] = None,
    normalizer: str = "softmax",
    sink_logits: Optional[Array] = None,
    softcap: Optional[float] = None,
    segment_ids: Any = None,
    implementation: Optional[str] = None,
    return_stats: bool = False,
):
  """Attention restricted to a sparse pattern, computed over the pattern's kept blocks.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``; ``N % K == 0`` (GQA/MQA).
    v: values ``[B, S, K, Hv]``.
    pattern: a :class:`attnjax.patterns.Pattern` (static), e.g.
      ``attnjax.patterns.sliding_window(256)``.
    block_size: edge of the square ``[block_size, block_size]`` blocks of the
      layout (static); ``T`` and ``S`` need not be multiples of it.
    bias: float, added to the logits; broadcastable to ``[B, N, T, S]`` (the
      block-sparse path slices it per visited block).
    scale: logit scale; None means ``H ** -0.5``.
    normalizer: ``"softmax"``, ``"softmax_one"``, ``"sigmoid"``, ``"softpick"``
      or ``"none"`` (see :mod:`attnjax.normalizers`); sigmoid's bias
      ``-log n`` counts the keys the pattern allows in each row.
    sink_logits: ``[N]`` learned null-column logits (gpt-oss); softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` on the scaled logits (Gemma 2).
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``;
      intersected with the pattern.
    implementation: None (auto: ``"block_sparse"``), ``"reference"`` or
      ``"block_sparse"``.
    return_stats: also return :class:`attnjax.AttentionStats`.

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)``. A query
    row the pattern leaves without keys is zero.

  References:
    Child et al. 2019, "Generating Long Sequences with Sparse Transformers".
    Dong et al. 2024, "Flex Attention: A Programming Model for Generating
    Optimized Attention Kernels" (block masks with full and partial blocks).
  """
  if not isinstance(pattern, Pattern):
    raise TypeError(
        f"pattern must be an attnjax.patterns.Pattern (e.g. patterns.sliding_window(256)), "
        f"got {type(pattern).__name__}")
  if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
    raise ValueError(f"block_size must be a positive int, got block_size={block_size!r}")
  _checks.check_choice("implementation", implementation, (None, *IMPLEMENTATIONS))
  implementation = "block_sparse" if implementation is None else implementation
  inputs, opts = dense.prepare(
      q, k, v, bias=bias, scale=scale, normalizer=normalizer, sink_logits=sink_logits,
      softcap=softcap, segment_ids=segment_ids, implementation="reference",
      return_stats=return_stats)
  T, S = q.shape[1], k.shape[1]
  pattern.check_shape(T, S)
  if implementation == "reference":
    return _reference(inputs, opts, pattern)
  if (pattern.band() is not None and inputs.bias is None and not opts.return_stats
      and T > 2 * CHUNK_BLOCKS * block_size):
    return _banded_chunks(inputs, opts, pattern, block_size)
  return _block_sparse(inputs, opts, pattern, block_size)


SPARSE_STATIC = ("pattern", "block_size", "scale", "normalizer", "softcap", "implementation",
                 "return_stats")

sparse_attention = jax.jit(_sparse_attention, static_argnames=SPARSE_STATIC)
sparse_attention.__doc__ = _sparse_attention.__doc__
