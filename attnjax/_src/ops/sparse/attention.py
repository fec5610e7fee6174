"""Sparse attention: attention restricted to a :mod:`attnjax.patterns` pattern.

Implementation behind the public module :mod:`attnjax.sparse`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, empty, op, static, masks, mods, normalizers, options, patterns
from attnjax._src.ops.dense import attention as dense
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.layout import BlockLayout
from attnjax._src.parallel import strategies
from attnjax._src.patterns import Pattern

Array = jnp.ndarray

# The dense keywords sparse_attention takes and forwards (attnjax._src.options.KEYWORDS): the
# pattern stands for mask, is_causal and window; the block paths compute dot products.
DENSE_KEYWORDS = options.keywords(without=("mask", "is_causal", "window", "similarity"))


def _reference(
  inputs: options.DenseInputs, opts: options.DenseOptions, pattern: Pattern, block_size: int
):
  """The pattern's exact dense mask handed to the dense reference (``block_size`` unused)."""
  del block_size
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  mask = masks.combine_masks(inputs.mask, pattern.mask(T, S))
  return dense.reference(dataclasses.replace(inputs, mask=mask), opts)


def _extend_keys(x: Array, extra: Array, axis: int) -> Array:
  """Appends the gathered copies ``x[..., extra, ...]`` along the key axis."""
  return jnp.concatenate([x, jnp.take(x, extra, axis=axis)], axis=axis)


def block_sparse(
  inputs: options.DenseInputs, opts: options.DenseOptions, pattern: Pattern, block_size: int
):
  """The pattern's plan run by the shared block-wise kernel (:func:`.blockwise.run_layout`).

  Args:
    inputs: the validated call (:class:`attnjax.options.DenseInputs`).
    opts: its static options (:class:`attnjax.options.DenseOptions`).
    pattern: the :class:`attnjax.patterns.Pattern`.
    block_size: the block size of both axes.

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)`` when ``opts`` asks
    for statistics.
  """
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  plan = pattern.plan(T, S, block_size=block_size)
  positions, layout, mod_table = None, plan.layout, False
  has_mods = opts.score_mod is not None or opts.mask_mod is not None
  if plan.extra_keys.size and has_mods:
    # Gathered key slots: the modifiers see each slot's real key position, and the mask_mod
    # is evaluated per block at run time (its static layout is in sequence positions).
    positions = (
      jnp.arange(T, dtype=jnp.int32),
      jnp.concatenate([jnp.arange(S, dtype=jnp.int32), jnp.asarray(plan.extra_keys, jnp.int32)]),
    )
    mod_table = True
  elif opts.mask_mod is not None:
    geometry = (T, S, min(block_size, T), min(block_size, S))
    if (layout.q_len, layout.kv_len, layout.block_q, layout.block_k) == geometry:
      layout, mod_table = blockwise.layout_for(inputs, opts, geometry[2], geometry[3], layout)
    else:
      mod_table = True
  if plan.extra_keys.size:
    # Keys the pattern visits through gathered copies (e.g. fixed's summary
    # columns): their gradients flow back to the originals through the gather.
    extra = jnp.asarray(plan.extra_keys)
    bias = inputs.bias
    if bias is not None and bias.shape[3] != 1:
      bias = _extend_keys(bias, extra, axis=3)
    kv_seg = inputs.kv_segment_ids
    inputs = dataclasses.replace(
      inputs,
      k=_extend_keys(inputs.k, extra, 1),
      v=_extend_keys(inputs.v, extra, 1),
      bias=bias,
      kv_segment_ids=None if kv_seg is None else _extend_keys(kv_seg, extra, 1),
    )
  shape = (T, plan.layout.kv_len)
  rule = plan.rule

  def mask_fn(q_positions, k_positions):
    return rule.allowed(q_positions, k_positions, shape)[None, None]

  return blockwise.run_layout(
    inputs,
    opts,
    layout=layout,
    mask_fn=mask_fn,
    use_default_mask_fn=False,
    positions=positions,
    mod_table=mod_table,
    roll_query_blocks=True,  # one loop body for every row of the pattern: see the module
  )


# The strided pattern runs as its two merged factors (_strided_two_pass) from this length on:
# below it, its block plan (one rolled loop) computes little more and compiles in a fraction of
# the time of two attention programs and a merge (T=512: 4.2x dense-with-mask's compile time
# against ~2x; `experiments/bench.py --suite pattern_compile`).
STRIDED_TWO_PASS_MIN_LENGTH = 2048

# Query blocks per chunk of the banded path: bounds its working memory, whatever the length
# (the kernel unrolls a chunk's few query blocks; see blockwise.MAX_UNROLLED_Q_BLOCKS).
CHUNK_BLOCKS = 4


def banded_chunks(
  inputs: options.DenseInputs, opts: options.DenseOptions, pattern: Pattern, block_size: int
):
  """A banded pattern (e.g. a sliding window) run chunk by chunk under ``lax.map``.

  Every chunk of ``C`` queries sees the same ``C + left + right`` keys around
  it, so one layout and one compiled kernel serve all chunks; keys past the
  sequence ends are masked by a per-chunk key mask. Cost stays proportional to the kept blocks and
  compile time and memory no longer grow with ``T``.

  A pattern whose :meth:`~attnjax.patterns.Pattern.band_parts` adds global key
  columns (StreamingLLM's sinks, Longformer's global tokens) gives every chunk
  a gathered copy of those keys after its band keys, in key blocks of their own;
  the chunk's data mask applies the pattern's exact rule to them and drops
  them from the band, so each pair counts once. Global query rows (Longformer)
  are computed on their own against every key and replace their rows.

  Args:
    inputs: the validated call (:class:`attnjax.options.DenseInputs`).
    opts: its static options (:class:`attnjax.options.DenseOptions`).
    pattern: the :class:`attnjax.patterns.Pattern`.
    block_size: the block size of both axes.

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, lse)`` with the per-row logsumexp
    ``[B, N, T]`` when ``opts`` asks for statistics (the other statistics of chunks would not
    combine into the sequence's).
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, _ = q.shape
  S = k.shape[1]
  parts = pattern.band_parts()
  left = parts.band[0]
  cols = np.asarray([c for c in parts.columns if c < S], np.int32)
  E = cols.size
  C = CHUNK_BLOCKS * block_size
  num_chunks = -(-T // C)
  band_rule, KW, layout = _chunk_layout(pattern, parts, C, block_size, E)
  # Keys padded so that chunk c's band keys are padded[c * C : c * C + KW]
  # (global positions c * C - left ...); padding is masked by position.
  key_len = (num_chunks - 1) * C + KW
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
    q_seg, kv_seg_p = pad_queries(q_seg), pad_keys(kv_seg)
  else:
    kv_seg_p = None
  col_k = col_v = col_seg = None
  if E:
    col_k, col_v = jnp.take(k, cols, axis=1), jnp.take(v, cols, axis=1)
    col_seg = None if kv_seg is None else jnp.take(kv_seg, cols, axis=1)

  def mask_fn(q_local, k_local):
    allowed = band_rule.allowed(q_local, k_local, (C, KW))
    if E:  # column slots: the data mask holds their whole rule
      allowed = jnp.logical_or(allowed, (k_local >= KW)[None, :])
    return allowed[None, None]

  def one_chunk(c):
    start = c * C
    take = lambda x, n: jax.lax.dynamic_slice_in_dim(x, start, n, axis=1)
    # Keys outside [0, S) are padding: masked by a data mask (an argument of
    # the kernel, so its custom VJP closes over nothing traced). Padded
    # queries are sliced off; their zero cotangent gives no gradient.
    k_global = start - left + jnp.arange(KW)
    key_ok = jnp.logical_and(k_global >= 0, k_global < S)[None, :]
    chunk_k, chunk_v = take(kp, KW), take(vp, KW)
    chunk_seg = None if kv_seg_p is None else take(kv_seg_p, KW)
    if E:
      # Band slots holding a column key leave it to its column slot.
      key_ok = jnp.logical_and(key_ok, jnp.logical_not(jnp.isin(k_global, cols))[None, :])
      col_ok = pattern.allowed(start + jnp.arange(C), jnp.asarray(cols), (T, S))
      key_ok = jnp.concatenate([jnp.broadcast_to(key_ok, (C, KW)), col_ok], axis=1)
      chunk_k = jnp.concatenate([chunk_k, col_k], axis=1)
      chunk_v = jnp.concatenate([chunk_v, col_v], axis=1)
      if chunk_seg is not None:
        chunk_seg = jnp.concatenate([chunk_seg, col_seg], axis=1)
    chunk_inputs = dataclasses.replace(
      inputs,
      q=take(qp, C),
      k=chunk_k,
      v=chunk_v,
      mask=key_ok[None, None],
      q_segment_ids=None if q_seg is None else take(q_seg, C),
      kv_segment_ids=chunk_seg,
    )
    positions = None
    if opts.score_mod is not None or opts.mask_mod is not None:
      # The modifiers see global positions (padding slots are masked by key_ok).
      k_pos = k_global if not E else jnp.concatenate([k_global, jnp.asarray(cols)])
      positions = (start + jnp.arange(C, dtype=jnp.int32), k_pos.astype(jnp.int32))
    res = blockwise.run_layout(
      chunk_inputs,
      opts,
      layout=layout,
      mask_fn=mask_fn,
      use_default_mask_fn=False,
      positions=positions,
      mod_table=opts.mask_mod is not None,
    )
    # With statistics only the per-row logsumexp is kept: per-chunk means of
    # the other statistics would not combine into the sequence's.
    return (res[0], res[1].logsumexp) if opts.return_stats else res

  res = jax.lax.map(one_chunk, jnp.arange(num_chunks))
  out, lse = _stitch_chunks(res, opts, B, T, num_chunks * C)
  rows = np.asarray([r for r in parts.rows if r < T], np.int32)
  if rows.size:
    out, lse = _global_rows(inputs, opts, pattern, rows, out, lse)
  return (out, lse) if opts.return_stats else out


def _chunk_layout(pattern: Pattern, parts, C: int, block_size: int, E: int):
  """``(rule, KW, layout)`` shared by every chunk of :func:`banded_chunks`: the band's element
  rule on a chunk's ``[C, KW]`` band keys, their width ``KW``, and the chunk's block layout
  (with ``E`` global columns, ``KW`` is rounded up to whole blocks and the columns' own key
  blocks follow the band's in every query block's visits)."""
  left, right = parts.band
  # The band's element rule: the pattern's own when it is a plain band (its rule may keep
  # fewer pairs than the whole band), else the band of its decomposition.
  plain = not parts.columns and not parts.rows and pattern.band() is not None
  band = pattern if plain else patterns.sliding_window(left, right)
  plan = patterns.band_chunk_plan(band, C, block_size)
  KW = C + left + right
  if not E:
    return plan.rule, KW, plan.layout
  # Band keys rounded up to whole blocks, then the column slots in blocks of their own.
  KW = -(-KW // block_size) * block_size
  layout = BlockLayout.from_visits(
    C,
    KW + E,
    block_size,
    block_size,
    [
      plan.layout.visits(i) + [(KW // block_size + n, True) for n in range(-(-E // block_size))]
      for i in range(plan.layout.num_q_blocks)
    ],
  )
  return plan.rule, KW, layout


def _stitch_chunks(res, opts: options.DenseOptions, B: int, T: int, padded: int):
  """``(out [B, T, N, Hv], lse [B, N, T] or None)`` from the stacked chunk results of
  :func:`banded_chunks` (``out [chunks, B, C, N, Hv]``, and with statistics the logsumexp
  ``[chunks, B, N, C]``) covering ``padded`` query rows."""
  out = res[0] if opts.return_stats else res  # [chunks, B, C, N, Hv]
  out = jnp.moveaxis(out, 0, 1).reshape((B, padded) + out.shape[3:])[:, :T]
  lse = None
  if opts.return_stats:
    lse = jnp.moveaxis(res[1], 0, 2)  # [B, N, chunks, C]
    lse = lse.reshape(lse.shape[:2] + (padded,))[..., :T]
  return out, lse


def _global_rows(
  inputs: options.DenseInputs, opts: options.DenseOptions, pattern: Pattern, rows, out, lse
):
  """``(out, lse)`` with the global query ``rows`` replaced: they see (up to) every key, so
  the dense reference runs on those rows only (``lse`` None without statistics)."""
  q = inputs.q
  T, S = q.shape[1], inputs.k.shape[1]
  q_seg = inputs.q_segment_ids
  row_mask = pattern.allowed(jnp.asarray(rows), jnp.arange(S), (T, S))[None, None]
  row_inputs = dataclasses.replace(  # sparse_attention takes no mask array of its own
    inputs,
    q=jnp.take(q, rows, axis=1),
    mask=row_mask,
    q_segment_ids=None if q_seg is None else jnp.take(q_seg, rows, axis=1),
  )
  row_res = dense.reference(
    row_inputs, opts, positions=(jnp.asarray(rows), jnp.arange(S, dtype=jnp.int32))
  )
  row_out = row_res[0] if opts.return_stats else row_res
  out = out.at[:, rows].set(row_out)
  if opts.return_stats:
    lse = lse.at[:, :, rows].set(row_res[1].logsumexp)
  return out, lse


def _strided_two_pass(
  inputs: options.DenseInputs, opts: options.DenseOptions, stride: int, block_size: int
):
  """Child et al.'s strided pattern as its two factors, merged by their logsumexps.

  The column part (``j = i - m * stride``, ``m >= 2``) touches every key block
  in sequence order, but in residue order (position ``r + stride * p`` at row
  ``r``, column ``p``) it is a causal attention of length ``T / stride`` per
  residue. So: (a) the local part ``i - stride <= j <= i`` runs as a sliding
  window on the block-wise kernel; (b) the column part runs on the transposed
  sequence, ``p' <= p - 2``; (c) the two are merged exactly by the normaliser's
  :meth:`~attnjax.normalizers.Normalizer.merge` (softmax family: as the softmax
  of their union, with the null column of ``softmax_one`` / sink logits counted
  once). Mergeable normalisers only, no bias, segments or statistics (the
  caller checks).
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  K, Hv = k.shape[2], v.shape[3]
  nz = normalizers.get(opts.normalizer)
  plain = dataclasses.replace(
    opts, normalizer=normalizers.merge_part(opts.normalizer), return_stats=True
  )
  no_sink = dataclasses.replace(inputs, sink_logits=None)
  local = patterns.sliding_window(stride)
  if T > 2 * CHUNK_BLOCKS * block_size:
    out_a, lse_a = banded_chunks(no_sink, plain, local, block_size)
  else:
    out_a, stats_a = block_sparse(no_sink, plain, local, block_size)
    lse_a = stats_a.logsumexp
  # (b) Transposed: [B, P, stride, ...] -> [B * stride, P, ...]; padding sits
  # after every real position, so causality keeps it out of real rows.
  P = -(-T // stride)

  def to_columns(x):
    x = jnp.pad(x, [(0, 0), (0, P * stride - T), (0, 0), (0, 0)])
    x = jnp.reshape(x, (B, P, stride) + x.shape[2:])
    return jnp.reshape(jnp.swapaxes(x, 1, 2), (B * stride, P) + x.shape[3:])

  column_rule = masks.structural_mask(jnp.arange(P) - 2, jnp.arange(P), is_causal=True)
  out_b, stats_b = dense.reference(
    options.DenseInputs(to_columns(q), to_columns(k), to_columns(v), mask=column_rule), plain
  )

  def from_columns(x):  # [B * stride, P, N, X] -> [B, T, N, X]
    x = jnp.swapaxes(jnp.reshape(x, (B, stride, P) + x.shape[2:]), 1, 2)
    return jnp.reshape(x, (B, P * stride) + x.shape[3:])[:, :T]

  out_b = from_columns(out_b)
  lse_b = from_columns(jnp.swapaxes(stats_b.logsumexp, 1, 2)[..., None])  # [B, T, N, 1]
  lse_a = jnp.swapaxes(lse_a, 1, 2)[..., None]
  # Rows p < 2 have no column key; their (zero) logsumexp must weigh nothing.
  has_b = (jnp.arange(T) >= 2 * stride)[None, :, None, None]
  lse_b = jnp.where(has_b, lse_b, -jnp.inf)
  sink = None
  if inputs.sink_logits is not None:  # [1, N, 1, 1] -> [1, 1, N, 1]
    sink = jnp.swapaxes(inputs.sink_logits.astype(jnp.float32), 1, 2)
  out = nz.merge([(out_a, lse_a), (out_b, lse_b)], sink)
  del K, H, Hv
  return out.astype(q.dtype)


def _dilated_columns(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  pattern: patterns.DilatedWindow,
  block_size: int,
):
  """A dilated window run as a sliding window on the ``dilation`` residue columns.

  Query ``i`` keeps keys ``i - d * m``, all in its residue class ``i mod d``.
  Reordered as ``d`` sequences of ``P = ceil(T / d)`` positions (position
  ``r + d * p`` at column ``r``, index ``p``; as in ``_strided_two_pass``)
  the pattern is ``sliding_window(window - 1)`` inside each column, which the
  banded-chunk path (or, for short columns, the block-sparse path) runs at a
  cost that follows the ``window`` kept keys per query. Padding sits after
  every real position of its column, so causality keeps it out of real rows.
  Segment ids travel with their positions. No bias, statistics or modifiers
  (the caller checks).
  """
  q = inputs.q
  B, T = q.shape[0], q.shape[1]
  d = pattern.dilation
  P = -(-T // d)

  def to_columns(x):  # [B, T, ...] -> [B * d, P, ...]
    x = jnp.pad(x, [(0, 0), (0, P * d - T)] + [(0, 0)] * (x.ndim - 2))
    x = jnp.reshape(x, (B, P, d) + x.shape[2:])
    return jnp.reshape(jnp.swapaxes(x, 1, 2), (B * d, P) + x.shape[3:])

  def from_columns(x):  # [B * d, P, ...] -> [B, T, ...]
    x = jnp.swapaxes(jnp.reshape(x, (B, d, P) + x.shape[2:]), 1, 2)
    return jnp.reshape(x, (B, P * d) + x.shape[3:])[:, :T]

  seg = lambda x: None if x is None else to_columns(x)
  cols = dataclasses.replace(
    inputs,
    q=to_columns(q),
    k=to_columns(inputs.k),
    v=to_columns(inputs.v),
    q_segment_ids=seg(inputs.q_segment_ids),
    kv_segment_ids=seg(inputs.kv_segment_ids),
  )
  local = patterns.sliding_window(pattern.window - 1)
  if P > 2 * CHUNK_BLOCKS * block_size:
    out = banded_chunks(cols, opts, local, block_size)
  else:
    out = block_sparse(cols, opts, local, block_size)
  return from_columns(out)


@dataclasses.dataclass(frozen=True)
class _EveryPair(Pattern):
  """Every (query, key) pair: the pattern of a shard's call under context parallelism, where
  the family's pattern is a ``mask_mod`` on global positions."""

  def allowed(self, q_positions, k_positions, shape):
    del shape
    return jnp.ones((q_positions.shape[0], k_positions.shape[0]), bool)


def context(call: tuple, implementation: Optional[str], local):
  """This device's shard of a sparse call whose sequence is sharded over ``opts.context_axis``.

  Every pattern is a rule on global positions, so the call is the dense one with the
  pattern as a ``mask_mod`` (:class:`attnjax.mods.PatternMask` on the whole ``(T, T)``,
  intersected with the caller's ``mask_mod``) run by the dense strategies
  (:mod:`attnjax.parallel`). The pattern's causality and band
  (:meth:`~attnjax.patterns.Pattern.band`) also become the dense ``is_causal`` / ``window``
  (they keep every pair the pattern keeps), so the ring skips, when it is traced, the
  shard pairs outside them; inside a visited pair the pattern's blocks are classified per
  call and blocks it masks entirely are skipped. Each device's part of the all-gather and
  all-to-all strategies runs on ``local``, the sparse op's per-device computation, with
  every pair its pattern (the rule is in the ``mask_mod``).
  """
  inputs, opts, pattern, block_size = call
  axis = validators.check_mesh_axis("context_axis", opts.context_axis, "sparse_attention")
  P = jax.lax.axis_size(axis)
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  if T != S:
    raise ValueError(
      f"context_axis={axis!r}: queries and keys must be sharded alike (the same "
      f"local length), got q {tuple(inputs.q.shape)} and k "
      f"{tuple(inputs.k.shape)}"
    )
  if opts.block_layout is not None:
    raise ValueError(
      "block_layout describes one device's whole call; with context_axis pass "
      "the mask_mod alone (the pattern's blocks are found per shard at run time)"
    )
  whole = T * P
  rule = mods.pattern_mask(pattern, whole, whole)
  mask_mod = rule
  if opts.mask_mod is not None:
    mask_mod = mods.And((rule, opts.mask_mod), (0, len(inputs.mask_mod_args)))
  dense_opts = dataclasses.replace(
    opts, mask_mod=mask_mod, is_causal=pattern.is_causal, window=pattern.band()
  )
  return strategies.attention(
    inputs,
    dense_opts,
    implementation,
    lambda inputs, opts, implementation: local(
      (inputs, opts, _EveryPair(), block_size), implementation
    ),
  )


def _blockwise(
  inputs: options.DenseInputs, opts: options.DenseOptions, pattern: Pattern, block_size: int
):
  """The ``"blockwise"`` engine: the pattern's fastest block-wise plan for the call.

  The plans are this engine's internals, not engines of their own: each computes the same
  thing on the block-wise kernel, and which applies follows from the pattern and the call
  (never the platform): a dilated window as a sliding window on its residue columns
  (:func:`_dilated_columns`), a banded pattern longer than two chunks chunk by chunk
  (:func:`banded_chunks`), the strided pattern as two passes merged by their logsumexps
  (:func:`_strided_two_pass`), else every kept block at once (:func:`block_sparse`). Each
  is tested equal to the reference (tests/test_sparse.py).
  """
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  if (
    isinstance(pattern, patterns.DilatedWindow)
    and pattern.dilation > 1
    and T == S
    and inputs.bias is None
    and not opts.return_stats
    and opts.score_mod is None
    and opts.mask_mod is None
  ):
    return _dilated_columns(inputs, opts, pattern, block_size)
  if (
    pattern.band_parts() is not None
    and inputs.bias is None
    and not opts.return_stats
    and T > 2 * CHUNK_BLOCKS * block_size
  ):
    return banded_chunks(inputs, opts, pattern, block_size)
  if (
    isinstance(pattern, patterns.Strided)
    and T == S
    and T >= STRIDED_TWO_PASS_MIN_LENGTH
    and normalizers.merge_part(opts.normalizer) is not None  # merges only where it may
    and inputs.bias is None
    and inputs.q_segment_ids is None
    and not opts.return_stats
    and opts.score_mod is None
    and opts.mask_mod is None
  ):
    return _strided_two_pass(inputs, opts, pattern.stride, block_size)
  return block_sparse(inputs, opts, pattern, block_size)


# Auto-dispatch takes the block-wise engine from this sequence length on (the longer of T and
# S), as dense does (dense.BLOCKWISE_MIN_LENGTH_CPU): a shorter call has little to skip, and
# the pattern's mask on the reference compiles in a fraction of a block plan's time
# (`experiments/bench.py --suite pattern_compile`).
BLOCKWISE_MIN_LENGTH = 256

# The sparse op: its call is ``(inputs, opts, pattern, block_size)``; auto-dispatch takes the
# block-wise engine from BLOCKWISE_MIN_LENGTH on, the reference below.
ENGINES: dict[str, op.Engine] = {
  e.name: e
  for e in (
    op.Engine("reference", _reference, op.supports_everything),
    op.Engine("blockwise", _blockwise, op.supports_everything, min_length=BLOCKWISE_MIN_LENGTH),
  )
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK: tuple[str, ...] = ("blockwise", "reference")


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      sparse_attention,
      options=dict(pattern=patterns.sliding_window(9), block_size=8),
      stats=True,
      flags=("return_stats",),
      static=(("scale", 0.5), ("block_size", 2)),
      choices=(
        (
          "pattern",
          (
            patterns.causal(),
            patterns.sliding_window(2),
            patterns.sliding_window(3, 1),
            patterns.strided(2),
            patterns.sinks_window(1, 2),
          ),
        ),
        ("block_size", (1, 2, 3, 4)),
      ),
      defects=(("block_size", (0, -2, 2.0)),),
      dense_keywords=DENSE_KEYWORDS,
      context=True,
      extreme_values=True,
    ),
  )


OP = op.register(
  op.Op(
    "sparse",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=lambda inputs, opts, *_: empty.dense(inputs, opts),
    is_empty=lambda inputs, *_: empty.is_empty(inputs.q, inputs.k),
    context=context,
    context_axis=lambda inputs, opts, *_: opts.context_axis,
    length=lambda inputs, *_: max(inputs.q.shape[1], inputs.k.shape[1]),
    renamed={"block_sparse": "blockwise"},
    samples=_samples,
  )
)


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
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  segment_ids: Any = None,
  implementation: Optional[ImplementationName] = None,
  return_stats: bool = False,
  score_mod: Any = None,
  score_mod_args: Any = None,
  mask_mod: Any = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: Optional[options.ContextStrategy] = "ring",
  context_layout: Optional[options.ContextLayout] = None,
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
    normalizer: a registered normaliser's name (see the table in
      :mod:`attnjax.normalizers`); normalisers that count allowed keys
      (sigmoid's bias ``-log n``) count the keys the pattern allows in each row.
    normalizer_params: a weights-only normaliser's learned parameters by name (as
      :func:`attnjax.dot_product_attention`).
    sink_logits: ``[N]`` learned null-column logits (gpt-oss); softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` on the scaled logits (Gemma 2).
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``;
      intersected with the pattern.
    implementation: None (auto: ``"blockwise"`` from
      :data:`attnjax.sparse.BLOCKWISE_MIN_LENGTH` tokens on, ``"reference"`` below, as dense
      attention), ``"reference"`` or ``"blockwise"`` (the engines of
      :data:`~attnjax._src.ops.sparse.attention.OP`; the old name ``"block_sparse"`` still
      works and warns once).
    return_stats: also return :class:`attnjax.AttentionStats`.
    score_mod, score_mod_args, mask_mod, mask_mod_args: modifiers, as in
      :func:`attnjax.dot_product_attention` (see :mod:`attnjax.mods`); they
      see global query and key positions on every path (chunks and gathered
      keys included). A ``mask_mod`` is intersected with the pattern.
    block_layout: a :func:`attnjax.layout.from_mask_mod` layout of
      ``mask_mod`` with ``block_size`` blocks (used on the whole-sequence
      path; chunked and gathered paths skip the mask_mod's blocks at run time).
    context_axis, context_strategy, context_layout: context parallelism, as in
      :func:`attnjax.dot_product_attention` (called inside ``jax.shard_map``
      with q, k, v and segment ids sharded along time, returns this device's
      shard, equal to the unsharded call in value, gradient and statistics).
      The pattern is laid on the whole sequence (``P`` times the local
      length) and applied as a mask on global positions by the dense
      strategies: ``"ring"`` skips the shard pairs outside the pattern's
      causality / band and, inside the others, the blocks it masks;
      ``"all_gather"`` and ``"all_to_all"`` as for dense attention.
      ``implementation``: None (each strategy's default), ``"blockwise"``
      (the block-wise kernel) or ``"reference"`` (not with the ring). No
      ``bias`` or ``block_layout``.

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
      f"got {type(pattern).__name__}"
    )
  block_size = validators.check_positive_int("block_size", block_size)
  implementation = op.check_implementation(OP, implementation, where="sparse_attention")
  inputs, opts = options.validate(q, k, v, **options.forwarded(DENSE_KEYWORDS, locals()))
  if opts.context_axis is None:
    pattern.check_shape(q.shape[1], k.shape[1])
  return op.run(OP, (inputs, opts, pattern, block_size), implementation)


SPARSE_STATIC = ("pattern", "block_size", "implementation") + options.static(DENSE_KEYWORDS)

sparse_attention = static.jit(_sparse_attention, SPARSE_STATIC)
