"""Memory-compressed attention: queries attend to keys and values pooled along the sequence.

Implementation behind the public module :mod:`attnjax.compressed`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators, empty, op, static, normalizers, options
from attnjax._src.ops.dense import attention as dense
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.layout import key_block_candidates, rule_layout

Array = jnp.ndarray

POOLS: tuple[str, ...] = ("mean", "max")
# The dense keywords compressed_attention forwards (attnjax._src.options.KEYWORDS); its is_causal
# and window are its own rule's (CompressedRule), not the dense ones.
DENSE_KEYWORDS = options.keywords(
  without=(
    "bias",
    "mask",
    "is_causal",
    "window",
    "similarity",
    "score_mod",
    "score_mod_args",
    "mask_mod",
    "mask_mod_args",
    "block_layout",
    "context_axis",
    "context_strategy",
    "context_layout",
  )
)

# Segment id of a compressed block whose keys span several segments: matches no query
# (queries must not use this id).
STRADDLING_SEGMENT = int(np.iinfo(np.int32).min)


def num_blocks(S: int, stride: int) -> int:
  """Number of compressed keys for ``S`` raw keys: ``ceil(S / stride)``.

  Args:
    S: raw keys.
    stride: keys per block.

  Returns:
    ``C``.
  """
  return -(-S // stride)


def pool_keys(x: Array, stride: int, pool: str = "mean") -> Array:
  """``x [B, S, K, X]`` pooled in blocks of ``stride`` along ``S``: ``[B, ceil(S / stride), K, X]``.

  The last block, when partial, is pooled over the keys it has (its mean
  divides by their number). Computed in float32, returned in ``x``'s dtype.

  Args:
    x: ``[B, S, K, X]`` keys or values.
    stride: keys per block.
    pool: ``"mean"`` or ``"max"``.

  Returns:
    ``[B, ceil(S / stride), K, X]``.

  Raises:
    ValueError: another ``pool``.
  """
  B, S = x.shape[:2]
  C = num_blocks(S, stride)
  pad = C * stride - S
  x32 = x.astype(jnp.float32)
  if pool == "mean":
    x32 = jnp.pad(x32, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    total = jnp.sum(jnp.reshape(x32, (B, C, stride) + x.shape[2:]), axis=2)
    count = jnp.minimum(stride, S - stride * jnp.arange(C)).astype(jnp.float32)
    out = total / jnp.reshape(count, (1, C) + (1,) * (x.ndim - 2))
  elif pool == "max":
    x32 = jnp.pad(x32, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=-jnp.inf)
    out = jnp.max(jnp.reshape(x32, (B, C, stride) + x.shape[2:]), axis=2)
  else:
    raise ValueError(f"pool must be one of {POOLS} or a pair (k_c, v_c), got pool={pool!r}")
  return out.astype(x.dtype)


def block_segments(kv_segment_ids: Array, stride: int) -> Array:
  """The segment id of each compressed block.

  Args:
    kv_segment_ids: integer ``[B, S]``.
    stride: keys per block.

  Returns:
    ``[B, C]``: the id its keys share, or ``STRADDLING_SEGMENT`` when they span
    more than one segment.
  """
  B, S = kv_segment_ids.shape
  C = num_blocks(S, stride)
  seg = jnp.pad(kv_segment_ids, [(0, 0), (0, C * stride - S)], mode="edge")
  seg = jnp.reshape(seg, (B, C, stride))
  uniform = jnp.all(seg == seg[:, :, :1], axis=2)
  return jnp.where(uniform, seg[:, :, 0], STRADDLING_SEGMENT).astype(kv_segment_ids.dtype)


@dataclasses.dataclass(frozen=True)
class CompressedRule:
  """The element rule over the key slots ``[compressed (padded to C_pad) ; raw (S)]`` (hashable).

  Slot ``s < C`` is compressed block ``s``; slots ``C <= s < C_pad`` are
  padding (never allowed); slot ``C_pad + j`` is raw key ``j``. With
  ``C_pad == C`` it is the reference's concatenation.
  """

  T: int
  S: int
  stride: int
  is_causal: bool
  window: Optional[tuple[int, int]]  # (left, right) of the raw keys
  C_pad: int

  @property
  def C(self) -> int:
    return num_blocks(self.S, self.stride)

  def allowed(self, q_positions: Array, k_slots: Array, shape=None) -> Array:
    """``bool [Tq, Sk]``: may query ``q_positions`` attend slot ``k_slots``."""
    del shape
    i = q_positions[:, None]
    s = k_slots[None, :]
    is_block = s < self.C
    if self.is_causal:
      block_end = (s + 1) * self.stride - 1
      is_block = jnp.logical_and(is_block, block_end <= i)
    if self.window is None:
      return jnp.broadcast_to(is_block, (q_positions.shape[0], k_slots.shape[0]))
    j = s - self.C_pad
    is_raw = jnp.logical_and(j >= 0, j < self.S)
    left, right = self.window
    near = jnp.logical_and(j >= i - left, j <= (i if self.is_causal else i + right))
    return jnp.logical_or(is_block, jnp.logical_and(is_raw, near))

  def candidate_key_blocks(self, q_lo: int, q_hi: int, shape, block_size: int) -> np.ndarray:
    """Key blocks queries ``[q_lo, q_hi)`` may touch: the visible compressed blocks and the window."""
    seen = min(self.C, q_hi // self.stride + 1) if self.is_causal else self.C
    ranges = [(0, seen)]
    if self.window is not None:
      left, right = self.window
      hi = q_hi if self.is_causal else q_hi + right
      ranges.append((self.C_pad + q_lo - left, self.C_pad + hi))
    return key_block_candidates(ranges, shape[1], block_size)


def _mask(rule: CompressedRule, T: int) -> Array:
  """The rule as an explicit ``bool [1, 1, T, C + S]`` mask (reference concatenation)."""
  slots = rule.C_pad + (rule.S if rule.window is not None else 0)
  return rule.allowed(jnp.arange(T), jnp.arange(slots))[None, None]


def _concat_inputs(
  inputs: options.DenseInputs, k_c: Array, v_c: Array, rule: CompressedRule
) -> options.DenseInputs:
  """Keys ``[compressed (padded to C_pad) ; raw]`` (raw only with a window), segment ids alike."""
  pad = rule.C_pad - rule.C

  def padded(x, value=0):
    return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=value)

  k, v = padded(k_c), padded(v_c)
  kv_seg = inputs.kv_segment_ids
  if kv_seg is not None:
    seg = padded(block_segments(kv_seg, rule.stride), STRADDLING_SEGMENT)
  if rule.window is not None:
    k = jnp.concatenate([k, inputs.k], axis=1)
    v = jnp.concatenate([v, inputs.v], axis=1)
    if kv_seg is not None:
      seg = jnp.concatenate([seg, kv_seg], axis=1)
  return dataclasses.replace(inputs, k=k, v=v, kv_segment_ids=None if kv_seg is None else seg)


def _grouped_queries(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  k_c: Array,
  v_c: Array,
  stride: int,
  window: Optional[tuple[int, int]],
  block_size: int,
):
  """The causal fast path (``T == S``): queries grouped by the blocks they see.

  Queries ``i = p * stride - 1 .. p * stride + stride - 2`` all see exactly the
  compressed blocks ``c < p``: stacked as ``stride`` extra query heads (GQA
  over the same compressed key heads), group ``p`` becomes row ``p - 1`` of a
  plain causal attention of ``C`` rows over the ``C`` compressed keys, run by
  the block-wise dense kernel at causal block efficiency. The first
  ``stride - 1`` queries see no block. With a window, the raw keys ``i - left
  <= j <= i`` run as a sliding window (:mod:`attnjax.sparse`'s banded chunks)
  and the two parts are merged exactly by their logsumexps (mergeable
  normalisers only; the caller checks), with the null column counted once.
  """
  from attnjax._src import patterns
  from attnjax._src.ops.sparse import attention as sparse

  q = inputs.q
  B, T, N, H = q.shape
  C, s = k_c.shape[1], stride
  Hv = v_c.shape[3]
  nz = normalizers.get(opts.normalizer)
  part_opts = (
    opts
    if window is None
    else dataclasses.replace(
      opts, normalizer=normalizers.merge_part(opts.normalizer), return_stats=True
    )
  )
  # Query i at padded row i + 1; rows (p * s .. p * s + s - 1) form group p; group 0 is dropped.
  qp = jnp.pad(q, [(0, 0), (1, (C + 1) * s - T - 1), (0, 0), (0, 0)])
  qp = jnp.reshape(qp, (B, C + 1, s, N, H))[:, 1:]
  qp = jnp.reshape(jnp.swapaxes(qp, 2, 3), (B, C, N * s, H))  # head n * s + r
  grouped = options.DenseInputs(
    qp,
    k_c,
    v_c,
    sink_logits=None
    if window is not None
    else (None if inputs.sink_logits is None else jnp.repeat(inputs.sink_logits, s, axis=1)),
  )
  # Query blocks of block_size / 2 and key blocks of 4 * block_size (64 and 512 by default):
  # a tile then stacks stride * N / K query heads of 64 rows (256 at stride 4, MHA), enough
  # for XLA:CPU to split its products over cores (from ~256 rows and ~512 keys), while the
  # short query blocks keep the causal diagonal's waste small. T=4096, stride 4, MHA, 2 CPU
  # cores, forward without window: 52-63 ms against 67-83 with square 128-blocks (and ~4x
  # slower with the kernel's default 512-blocks); T=16384 with window 64: 711-748 vs 1028-1237.
  res = blockwise.run(
    grouped,
    dataclasses.replace(part_opts, is_causal=True),
    block_q=max(1, block_size // 2),
    block_k=4 * block_size,
  )
  out_a, stats_a = res if part_opts.return_stats else (res, None)

  def ungroup(x, fill):  # [B, C, N * s, X] -> [B, T, N, X], rows before the first group = fill
    x = jnp.swapaxes(jnp.reshape(x, (B, C, N, s) + x.shape[3:]), 2, 3)
    x = jnp.reshape(x, (B, C * s, N) + x.shape[4:])
    head = jnp.full((B, s - 1) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([head, x], axis=1)[:, :T]

  out_a = ungroup(out_a, 0)
  if window is None:
    return out_a
  lse_a = ungroup(jnp.swapaxes(stats_a.logsumexp, 1, 2)[..., None], -jnp.inf)  # [B, T, N, 1]
  no_sink = dataclasses.replace(inputs, sink_logits=None)
  left = window[0]
  local = patterns.sliding_window(left)
  # Window blocks about the window's size (the smallest power of two >= left, 16 ..
  # block_size): window 64 runs in 64-blocks, a query block's keys i - 64 .. i then span two
  # of them, 128 keys per query rather than 256 with 128-blocks.
  wb = min(block_size, max(16, 1 << max(left - 1, 0).bit_length()))
  if T > 2 * sparse.CHUNK_BLOCKS * wb:
    out_b, lse_b = sparse.banded_chunks(no_sink, part_opts, local, wb)
  else:
    out_b, stats_b = sparse.block_sparse(no_sink, part_opts, local, wb)
    lse_b = stats_b.logsumexp
  lse_b = jnp.swapaxes(lse_b, 1, 2)[..., None]
  sink = None
  if inputs.sink_logits is not None:  # [1, N, 1, 1] -> [1, 1, N, 1]
    sink = jnp.swapaxes(inputs.sink_logits.astype(jnp.float32), 1, 2)
  del Hv
  return nz.merge([(out_a, lse_a), (out_b, lse_b)], sink).astype(q.dtype)


def _one_call(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  k_c: Array,
  v_c: Array,
  stride: int,
  is_causal: bool,
  window: Optional[tuple[int, int]],
  block_size: int,
):
  """The ``"blockwise"`` path: ``[compressed ; raw]`` keys through one block-wise kernel call."""
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  C = num_blocks(S, stride)
  # The compressed keys padded to whole key blocks: the raw window then starts on a block edge.
  bs = min(block_size, T)
  rule = CompressedRule(T, S, stride, is_causal, window, C if window is None else -(-C // bs) * bs)
  cat = _concat_inputs(inputs, k_c, v_c, rule)
  layout = rule_layout(rule, T, cat.k.shape[1], bs)

  def mask_fn(q_positions, k_slots):
    return rule.allowed(q_positions, k_slots)[None, None]

  return blockwise.run_layout(cat, opts, layout=layout, mask_fn=mask_fn, use_default_mask_fn=False)


def _grouped_forward(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  k_c: Array,
  v_c: Array,
  stride: int,
  window: Optional[tuple[int, int]],
  block_size: int,
):
  """Causal self-attention: ``_grouped_queries`` when evaluated, ``_one_call`` when differentiated.

  A ``jax.custom_jvp`` whose primal is the grouped-query path and whose JVP
  is the one-call path's (so ``jax.grad`` transposes the one-call path, and
  forward mode and second order work as there). The two agree to float
  rounding (both are tested against the reference).
  """

  # Fresh inputs inside (the path has no segment ids, bias or mask): a custom_jvp must not
  # close over traced arrays.
  @jax.custom_jvp
  def call(q, k, v, k_c, v_c, sink_logits):
    x = options.DenseInputs(q, k, v, sink_logits=sink_logits)
    return _grouped_queries(x, opts, k_c, v_c, stride, window, block_size)

  def one_call(q, k, v, k_c, v_c, sink_logits):
    x = options.DenseInputs(q, k, v, sink_logits=sink_logits)
    return _one_call(x, opts, k_c, v_c, stride, True, window, block_size)

  @call.defjvp
  def call_jvp(primals, tangents):
    return jax.jvp(one_call, primals, tangents)

  return call(inputs.q, inputs.k, inputs.v, k_c, v_c, inputs.sink_logits)


class _Rule(NamedTuple):
  """The compression of a call (the third element of the op's call).

  Attributes:
    k_c, v_c: the caller's compressed keys and values, or None: pooled by ``pool``.
    pool: ``"mean"``, ``"max"`` or ``"given"``.
    stride, is_causal, window, block_size: as :func:`compressed_attention` takes them.
  """

  k_c: Optional[Array]
  v_c: Optional[Array]
  pool: str
  stride: int
  is_causal: bool
  window: Optional[tuple[int, int]]
  block_size: int


def _pooled(inputs: options.DenseInputs, c: _Rule) -> tuple[Array, Array]:
  if c.k_c is not None:
    return c.k_c, c.v_c
  return pool_keys(inputs.k, c.stride, c.pool), pool_keys(inputs.v, c.stride, c.pool)


def _reference(inputs: options.DenseInputs, opts: options.DenseOptions, c: _Rule):
  """The ``"reference"`` engine: ``[compressed ; raw]`` keys and the rule's explicit mask
  through :func:`attnjax.dense.reference`."""
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  k_c, v_c = _pooled(inputs, c)
  rule = CompressedRule(T, S, c.stride, c.is_causal, c.window, num_blocks(S, c.stride))
  cat = _concat_inputs(inputs, k_c, v_c, rule)
  return dense.reference(dataclasses.replace(cat, mask=_mask(rule, T)), opts)


def _blockwise(inputs: options.DenseInputs, opts: options.DenseOptions, c: _Rule):
  """The ``"blockwise"`` engine: the grouped-query path where it applies, else one call."""
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  k_c, v_c = _pooled(inputs, c)
  if (
    c.is_causal
    and T == S
    and inputs.q_segment_ids is None
    and not opts.return_stats
    and not inputs.normalizer_params  # the grouped rows stack heads: learned ones take one call
    and (c.window is None or normalizers.merge_part(opts.normalizer) is not None)
  ):
    return _grouped_forward(inputs, opts, k_c, v_c, c.stride, c.window, c.block_size)
  return _one_call(inputs, opts, k_c, v_c, c.stride, c.is_causal, c.window, c.block_size)


# The compressed op: its call is ``(inputs, opts, rule)``; auto-dispatch takes the block-wise
# engine everywhere.
ENGINES: dict[str, op.Engine] = {
  e.name: e
  for e in (
    op.Engine("reference", _reference, op.supports_everything),
    op.Engine("blockwise", _blockwise, op.supports_everything),
  )
}
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK: tuple[str, ...] = ("blockwise",)
OP = op.register(
  op.Op(
    "compressed",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=lambda inputs, opts, c: empty.dense(inputs, opts),
    is_empty=lambda inputs, opts, c: empty.is_empty(inputs.q, inputs.k),
    samples=lambda: _samples(),
  )
)


def _compressed(
  q,
  k,
  v,
  k_c,
  v_c,
  *,
  stride,
  pool,
  is_causal,
  window,
  scale,
  normalizer,
  normalizer_params,
  sink_logits,
  softcap,
  segment_ids,
  implementation,
  return_stats,
  block_size,
):
  inputs, opts = options.validate(q, k, v, **options.forwarded(DENSE_KEYWORDS, locals()))
  rule = _Rule(k_c, v_c, pool, stride, is_causal, window, block_size)
  return op.run(OP, (inputs, opts, rule), implementation)


_compressed_jit = jax.jit(
  _compressed,
  static_argnames=("stride", "pool", "is_causal", "window", "implementation", "block_size")
  + options.static(DENSE_KEYWORDS),
)


def _check_compressed_kv(pool: Any, k: Array, v: Array, stride: int) -> tuple[Array, Array]:
  if len(pool) != 2:
    raise ValueError(
      f"pool as compressed keys and values must be a pair (k_c, v_c), got a "
      f"sequence of length {len(pool)}"
    )
  k_c, v_c = pool
  B, S, K, H = k.shape
  Hv = v.shape[3]
  C = num_blocks(S, stride)
  for name, x, want in (("k_c", k_c, (B, C, K, H)), ("v_c", v_c, (B, C, K, Hv))):
    if validators.shape_of(x) != want:
      raise ValueError(
        f"pool=(k_c, v_c): {name} must have shape {want} ([B, ceil(S / stride), K, "
        f"{'H' if name == 'k_c' else 'Hv'}] for k {tuple(k.shape)}, stride={stride}), "
        f"got {validators.shape_of(x)}"
      )
  return jnp.asarray(k_c), jnp.asarray(v_c)


def _compressed_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  stride: int,
  pool: Union[str, tuple[Array, Array]] = "mean",
  is_causal: bool = False,
  window: Union[int, tuple[int, int], None] = None,
  scale: Optional[float] = None,
  normalizer: str = "softmax",
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  segment_ids: Any = None,
  implementation: Optional[ImplementationName] = None,
  return_stats: bool = False,
  block_size: int = 128,
):
  """Attention to keys and values pooled in blocks of ``stride``, plus an optional raw window.

  See the module docstring for the exact rules. Jitted inside (the options
  are static); callable under ``jax.jit`` and differentiable in ``q``, ``k``,
  ``v``, ``sink_logits`` and caller-given compressed keys and values.

  Args:
    q: queries ``[B, T, N, H]``.
    k: raw keys ``[B, S, K, H]``; ``N % K == 0`` (GQA/MQA).
    v: raw values ``[B, S, K, Hv]``.
    stride: positions per compressed block (a positive int).
    pool: ``"mean"`` or ``"max"`` pooling of ``k`` and ``v`` per block, or a
      pair ``(k_c [B, C, K, H], v_c [B, C, K, Hv])`` of compressed keys and
      values made by the caller (``C = ceil(S / stride)``; block ``c`` stands
      for raw keys ``c * stride ..``, which fixes the causal rule); ``k`` and
      ``v`` then serve only the window.
    is_causal: a query ``i`` sees only the compressed blocks ``c`` that end at or
      before it, ``(c + 1) * stride - 1 <= i``.
    window: None, or the raw keys also attended to, in the same
      normalisation: ``(left, right)`` keeps ``i - left <= j <= i + right``
      (cut at ``j <= i`` when causal), an int ``w >= 0`` means ``(w, 0)``:
      keys ``i - w .. i``, as ``window`` everywhere.
    scale: logit scale; None means ``H ** -0.5``.
    normalizer: a registered normaliser's name; normalisers that
      count allowed keys count the compressed and raw keys a row sees.
    normalizer_params: a weights-only normaliser's learned parameters by name (as
      :func:`attnjax.dot_product_attention`).
    sink_logits: ``[N]`` learned null-column logits; softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` on the scaled logits.
    segment_ids: ``[B, T]`` when ``T == S`` or a pair ``([B, T], [B, S])``; a
      compressed block is seen only by queries of the one segment holding all
      its keys (ids must not be ``STRADDLING_SEGMENT``, int32's minimum).
    implementation: None (auto: ``"blockwise"``), ``"reference"`` or ``"blockwise"`` (the
      engines of :data:`~attnjax._src.ops.compressed.attention.OP`).
    return_stats: also return :class:`attnjax.AttentionStats` over the key slots
      ``[compressed ; raw]`` (``sink_mass`` is the weight on compressed block 0).
    block_size: edge of the blockwise path's square blocks (static).

  Returns:
    ``[B, T, N, Hv]`` in ``q``'s dtype, or ``(out, AttentionStats)``. Rows with
    no allowed key are zero, with finite gradients.
  """
  stride = validators.check_positive_int("stride", stride)
  window = validators.check_window(window)
  if window is not None and is_causal is True:
    window = (window[0], 0)  # the raw keys after the query are cut anyway: one compile
  block_size = validators.check_positive_int("block_size", block_size)
  if not isinstance(is_causal, bool):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  implementation = op.check_implementation(OP, implementation, where="compressed_attention")
  validators.check_qkv(q, k, v)
  k_c = v_c = None
  if isinstance(pool, (tuple, list)):
    k_c, v_c = _check_compressed_kv(pool, k, v, stride)
    pool = "given"
  elif pool not in POOLS:
    raise ValueError(f"pool must be one of {POOLS} or a pair (k_c, v_c), got pool={pool!r}")
  return _compressed_jit(
    q,
    k,
    v,
    k_c,
    v_c,
    stride=stride,
    pool=pool,
    is_causal=is_causal,
    window=window,
    implementation=implementation,
    block_size=block_size,
    **options.forwarded(DENSE_KEYWORDS, locals()),
  )


compressed_attention = static.canonicalized(
  _compressed_attention,
  ("stride", "is_causal", "window", "implementation", "block_size")
  + options.static(DENSE_KEYWORDS),
)


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      compressed_attention,
      options=dict(stride=4, is_causal=True, window=4, block_size=8),
      stats=True,
      flags=("is_causal", "return_stats"),
      static=(("scale", 0.5), ("stride", 2), ("window", (1, 0)), ("block_size", 2)),
      choices=(
        ("stride", (1, 2, 3)),
        ("pool", POOLS),
        ("block_size", (2, 3, 128)),
        ("window", (None, 0, 2, 3)),
      ),
      defects=(("stride", (0, -1, 1.5)),),
      dense_keywords=DENSE_KEYWORDS,
      own_keywords=("is_causal", "window"),
    ),
  )
