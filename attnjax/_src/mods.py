"""Ready score and mask modifiers (FlexAttention-style ``score_mod`` / ``mask_mod``).

Implementation behind the public module :mod:`attnjax.mods`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from attnjax._src import logits, validators
from attnjax._src.layout import FULL, MASKED, SKIP, segment_block_relations

Array = jnp.ndarray


# ---------------------------------------------------------------------------
# Score modifiers.


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's per-head slopes (Press et al. 2022), float32 ``[num_heads]``.

  For ``N`` a power of two, ``2 ** (-8 k / N)`` for ``k = 1 .. N``; otherwise
  the slopes of the power of two below ``N`` followed by every other slope of
  twice that power (the paper's reference implementation).

  Args:
    num_heads: ``N``.

  Returns:
    numpy float32 ``[N]``.

  Raises:
    TypeError, ValueError: ``num_heads`` is not a positive int.
  """
  validators.check_positive_int("num_heads", num_heads)

  def power_of_two(n):
    return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

  p = 1 << (int(num_heads).bit_length() - 1)
  slopes = power_of_two(p)
  if p < num_heads:
    slopes += power_of_two(2 * p)[0::2][: num_heads - p]
  return np.asarray(slopes, np.float32)


def alibi(z: Array, b: Array, n: Array, i: Array, j: Array, slopes: Array) -> Array:
  """ALiBi: ``z - slopes[n] * |i - j|`` (``score_mod_args=(slopes [N],)``).

  On causal attention this is the paper's ``slope * (j - i)``; off the
  diagonal in both directions it is the symmetric form. Slopes may be learned.

  Args:
    z: float32 logits.
    b: int32 batch index, broadcastable against ``z``.
    n: int32 query-head index.
    i: int32 query position.
    j: int32 key position.
    slopes: ``[N]`` per-head slopes (:func:`.alibi_slopes`, or learned).

  Returns:
    The penalised logits, shaped as ``z``.
  """
  del b
  return z - slopes[n].astype(jnp.float32) * jnp.abs(i - j).astype(jnp.float32)


def t5_bucket(
  relative_position: Array,
  *,
  num_buckets: int = 32,
  max_distance: int = 128,
  bidirectional: bool = True,
) -> Array:
  """T5's bucket of ``relative_position = j - i`` (Raffel et al. 2020), int32.

  Half the buckets (per direction when ``bidirectional``) hold exact
  distances ``0 .. num_buckets/2 - 1``; the rest are logarithmic up to
  ``max_distance`` and saturate beyond it. Unidirectional buckets see only
  ``i - j >= 0`` (later keys share bucket 0).

  Args:
    relative_position: integer array of ``j - i``, any shape.
    num_buckets: buckets in all (both directions together when ``bidirectional``).
    max_distance: distance from which every position shares the last bucket.
    bidirectional: separate buckets for keys after the query.

  Returns:
    int32 bucket ids in ``[0, num_buckets)``, shaped as ``relative_position``.
  """
  rel = jnp.asarray(relative_position, jnp.int32)
  out = jnp.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    out = out + jnp.where(rel > 0, num_buckets, 0)
    dist = jnp.abs(rel)
  else:
    dist = jnp.maximum(-rel, 0)
  max_exact = num_buckets // 2
  safe = jnp.maximum(dist, 1).astype(jnp.float32)
  large = max_exact + (
    jnp.log(safe / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  ).astype(jnp.int32)
  large = jnp.minimum(large, num_buckets - 1)
  return out + jnp.where(dist < max_exact, dist, large)


@dataclasses.dataclass(frozen=True)
class T5RelativeBias:
  """T5 bucketed relative bias: ``z + table[bucket(j - i), n]`` (``score_mod_args=(table,)``).

  ``table`` is ``[num_buckets, N]`` (learned, owned by the layer). See :func:`.t5_bucket`.

  Attributes:
    num_buckets: buckets in all.
    max_distance: distance from which positions share the last bucket.
    bidirectional: separate buckets for keys after the query.
  """

  num_buckets: int = 32
  max_distance: int = 128
  bidirectional: bool = True

  def __call__(self, z, b, n, i, j, table):
    del b
    bucket = t5_bucket(
      j - i,
      num_buckets=self.num_buckets,
      max_distance=self.max_distance,
      bidirectional=self.bidirectional,
    )
    return z + table[bucket, n].astype(jnp.float32)


def t5_relative_bias(
  num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> T5RelativeBias:
  """A :class:`.T5RelativeBias` score modifier (its ``table`` goes in ``score_mod_args``).

  Args:
    num_buckets: see :func:`.t5_bucket`.
    max_distance: see :func:`.t5_bucket`.
    bidirectional: see :func:`.t5_bucket`.

  Returns:
    The modifier.

  Raises:
    ValueError: ``num_buckets < 4`` or ``max_distance < 2``.
  """
  if num_buckets < 4 or max_distance < 2:
    raise ValueError(
      f"t5_relative_bias needs num_buckets >= 4 and max_distance >= 2, got "
      f"{num_buckets}, {max_distance}"
    )
  return T5RelativeBias(int(num_buckets), int(max_distance), bool(bidirectional))


@dataclasses.dataclass(frozen=True)
class SoftCap:
  """Soft-capping ``cap * tanh(z / cap)`` (Gemma 2) as a score modifier.

  Unlike the ``softcap=`` option (applied before ``bias``) it caps the final
  logits, bias and earlier modifiers included.

  Attributes:
    cap: ``c > 0``.

  Raises:
    ValueError: a cap that is not positive.
  """

  cap: float

  def __post_init__(self):
    if not self.cap > 0:
      raise ValueError(f"SoftCap.cap must be positive, got {self.cap!r}")

  def __call__(self, z, b, n, i, j):
    del b, n, i, j
    return logits.softcap(z, self.cap)


def position_temperature_factor(
  i: Array, floor_scale: float = 8192.0, attn_scale: float = 0.1
) -> Array:
  """Llama 4's query temperature ``1 + attn_scale * log(floor((i + 1) / floor_scale) + 1)``.

  Args:
    i: query positions, any shape.
    floor_scale: positions per step of the logarithm.
    attn_scale: the logarithm's weight.

  Returns:
    float32 factors, shaped as ``i``.
  """
  i = jnp.asarray(i).astype(jnp.float32)
  return 1.0 + attn_scale * jnp.log(jnp.floor((i + 1.0) / floor_scale) + 1.0)


@dataclasses.dataclass(frozen=True)
class PositionTemperature:
  """Llama-4-style position temperature: ``z * factor(i)``, growing with log position.

  Llama 4 scales the queries of its NoPE layers by
  :func:`.position_temperature_factor`, which multiplies every dot-product
  logit of row ``i``; this applies the same factor to the logits (equal when
  there is no ``bias`` or ``softcap``).

  Attributes:
    floor_scale: positions per step of the logarithm.
    attn_scale: the logarithm's weight.
  """

  floor_scale: float = 8192.0
  attn_scale: float = 0.1

  def __call__(self, z, b, n, i, j):
    del b, n, j
    return z * position_temperature_factor(i, self.floor_scale, self.attn_scale)


# ---------------------------------------------------------------------------
# Mask modifiers.


def causal_mask(b: Array, n: Array, i: Array, j: Array) -> Array:
  """Causal mask: key ``j <= i``.

  Args:
    b: int32 batch index, broadcastable against the logits ``[B, N, T, S]``.
    n: int32 query-head index.
    i: int32 query position.
    j: int32 key position.

  Returns:
    Boolean, broadcast of ``i`` and ``j``.
  """
  del b, n
  return j <= i


@dataclasses.dataclass(frozen=True)
class SlidingWindowMask:
  """Keys ``i - left`` to ``i + right`` (as ``window=(left, right)``).

  Attributes:
    left: keys before the query.
    right: keys after it.
  """

  left: int
  right: int = 0

  def __call__(self, b, n, i, j):
    del b, n
    return jnp.logical_and(j >= i - self.left, j <= i + self.right)


def sliding_window_mask(left: int, right: int = 0) -> SlidingWindowMask:
  """A :class:`.SlidingWindowMask` mask modifier: keys ``i - left`` to ``i + right``.

  Args:
    left: keys before the query.
    right: keys after it.

  Returns:
    The modifier.

  Raises:
    ValueError: a negative ``left`` or ``right``.
  """
  if left < 0 or right < 0:
    raise ValueError(f"sliding_window_mask needs left, right >= 0, got ({left}, {right})")
  return SlidingWindowMask(int(left), int(right))


@dataclasses.dataclass(frozen=True)
class ChunkedMask:
  """Chunked attention (Llama 4): queries see keys of their own chunk of ``size`` positions.

  ``causal=True`` (the default) keeps only ``j <= i`` inside the chunk.

  Attributes:
    size: positions per chunk.
    causal: keep only ``j <= i`` inside the chunk.
  """

  size: int
  causal: bool = True

  def __post_init__(self):
    if self.size < 1:
      raise ValueError(f"ChunkedMask.size must be positive, got {self.size!r}")

  def __call__(self, b, n, i, j):
    del b, n
    same = (i // self.size) == (j // self.size)
    return jnp.logical_and(same, j <= i) if self.causal else same


def chunked_mask(size: int, causal: bool = True) -> ChunkedMask:
  """A :class:`.ChunkedMask` mask modifier (Llama 4's chunked attention).

  Args:
    size: positions per chunk.
    causal: also keep only ``j <= i`` inside the chunk.

  Returns:
    The modifier.

  Raises:
    ValueError: a non-positive ``size``.
  """
  return ChunkedMask(int(size), bool(causal))


def prefix_lm_mask(b: Array, n: Array, i: Array, j: Array, prefix_lengths: Array) -> Array:
  """Prefix-LM: causal, plus every key of the prefix (``mask_mod_args=(prefix_lengths [B],)``).

  Row ``b`` has a bidirectional prefix of ``prefix_lengths[b]`` positions.

  Args:
    b: int32 batch index, broadcastable against the logits ``[B, N, T, S]``.
    n: int32 query-head index.
    i: int32 query position.
    j: int32 key position.
    prefix_lengths: integer ``[B]``.

  Returns:
    Boolean, True where ``j <= i`` or ``j`` is in the prefix.
  """
  del n
  return jnp.logical_or(j <= i, j < prefix_lengths[b])


def document_mask(b: Array, n: Array, i: Array, j: Array, doc_ids: Array) -> Array:
  """Document (segment) mask: same id (``mask_mod_args=(doc_ids [B, T],)``; ``T == S``).

  For packed documents the equivalent ``segment_ids=`` option also skips blocks
  from the ids' ranges; as a ``mask_mod`` the blocks are found by evaluating
  the mask (:func:`attnjax.layout.from_mask_mod` with concrete ids, or per call).

  Args:
    b: int32 batch index, broadcastable against the logits ``[B, N, T, S]``.
    n: int32 query-head index.
    i: int32 query position.
    j: int32 key position.
    doc_ids: integer ``[B, T]`` document id of every position.

  Returns:
    Boolean, True where query and key belong to the same document.
  """
  del n
  return doc_ids[b, i] == doc_ids[b, j]


def causal_document_mask(b: Array, n: Array, i: Array, j: Array, doc_ids: Array) -> Array:
  """:func:`.document_mask` and causal: the same document and ``j <= i``.

  Args:
    b: int32 batch index, broadcastable against the logits ``[B, N, T, S]``.
    n: int32 query-head index.
    i: int32 query position.
    j: int32 key position.
    doc_ids: integer ``[B, T]`` document id of every position.

  Returns:
    Boolean.
  """
  return jnp.logical_and(document_mask(b, n, i, j, doc_ids), j <= i)


def _document_block_table(block_layout, doc_ids):
  """Blocks of a document mask from each block's id range (as ``segment_ids``).

  Exact for sorted ids; otherwise a block may be computed that holds no pair.
  """
  return segment_block_relations(doc_ids, doc_ids, block_layout)


def _causal_document_block_table(block_layout, doc_ids):
  """``_document_block_table`` joined with the causal relation of each block pair.

  A pair is skipped when either rule skips it, full only when both say full
  (a block inside one document that also crosses the diagonal needs the mask).
  """
  q = [block_layout.q_range(i) for i in range(block_layout.num_q_blocks)]
  kv = [block_layout.kv_range(j) for j in range(block_layout.num_kv_blocks)]
  q_first, q_last = np.array([a for a, _ in q])[:, None], np.array([b - 1 for _, b in q])[:, None]
  k_first, k_last = np.array([a for a, _ in kv])[None], np.array([b - 1 for _, b in kv])[None]
  causal = np.where(k_first > q_last, SKIP, np.where(k_last <= q_first, FULL, MASKED))
  docs = _document_block_table(block_layout, doc_ids)
  return jnp.where((docs == SKIP) | (causal == SKIP), SKIP, jnp.maximum(docs, causal)).astype(
    jnp.int32
  )


# With traced ids the kernel classifies blocks per call: from id ranges, O(T) instead of O(T S).
document_mask.block_table = _document_block_table
causal_document_mask.block_table = _causal_document_block_table


@dataclasses.dataclass(frozen=True)
class PatternMask:
  """A :mod:`attnjax.patterns` pattern as a mask modifier on a ``(T, S)`` problem.

  Relies on the calling convention (``i`` varies along axis -2 only, ``j``
  along axis -1 only), which every attnjax path follows.

  Attributes:
    pattern: the :class:`attnjax.patterns.Pattern`.
    q_len: ``T``.
    kv_len: ``S``.
  """

  pattern: Any
  q_len: int
  kv_len: int

  def __call__(self, b, n, i, j):
    del b, n
    i, j = jnp.asarray(i), jnp.asarray(j)
    rank = max(i.ndim, j.ndim, 2)
    allowed = self.pattern.allowed(jnp.ravel(i), jnp.ravel(j), (self.q_len, self.kv_len))
    return jnp.reshape(allowed, (1,) * (rank - 2) + allowed.shape)


def pattern_mask(pattern: Any, q_len: int, kv_len: int) -> PatternMask:
  """The mask modifier of an :mod:`attnjax.patterns` pattern on a ``(q_len, kv_len)`` problem.

  Args:
    pattern: a :class:`attnjax.patterns.Pattern` (e.g. ``patterns.bigbird(...)``).
    q_len: ``T``.
    kv_len: ``S``.

  Returns:
    A :class:`.PatternMask`.

  Raises:
    ValueError: a pattern that cannot be laid on ``(q_len, kv_len)``.
  """
  pattern.check_shape(q_len, kv_len)
  return PatternMask(pattern, int(q_len), int(kv_len))


@dataclasses.dataclass(frozen=True)
class And:
  """Intersection of mask modifiers.

  Attributes:
    mods: the mask modifiers.
    args_split: how many of the call's ``mask_mod_args`` each one takes, in order
      (empty: none takes any).
  """

  mods: tuple[Callable[..., Any], ...]
  args_split: tuple[int, ...] = ()

  def __call__(self, b, n, i, j, *args):
    split = self.args_split or (0,) * len(self.mods)
    out, start = None, 0
    for mod, count in zip(self.mods, split):
      m = mod(b, n, i, j, *args[start : start + count])
      start += count
      out = m if out is None else jnp.logical_and(out, m)
    return out


@dataclasses.dataclass(frozen=True)
class ScoreChain:
  """Score modifiers applied in order.

  Attributes:
    mods: the score modifiers.
    args_split: how many of the call's ``score_mod_args`` each one takes, in order
      (empty: none takes any).
  """

  mods: tuple[Callable[..., Any], ...]
  args_split: tuple[int, ...] = ()

  def __call__(self, z, b, n, i, j, *args):
    split = self.args_split or (0,) * len(self.mods)
    start = 0
    for mod, count in zip(self.mods, split):
      z = mod(z, b, n, i, j, *args[start : start + count])
      start += count
    return z


def layer_kwargs(
  *, num_heads: int, alibi: bool = False, relative_bias=None, score_mod=None, mask_mod=None
) -> dict[str, Any]:
  """Attention keywords of a layer's modifiers (used by :mod:`attnjax.nn` specs).

  Args:
    num_heads: query heads (ALiBi slopes).
    alibi: add :func:`.alibi` with :func:`.alibi_slopes`.
    relative_bias: None or ``(T5RelativeBias, table [buckets, N])``.
    score_mod: a further argument-free score modifier, applied last.
    mask_mod: an argument-free mask modifier.

  Returns:
    ``score_mod`` / ``score_mod_args`` / ``mask_mod`` entries (empty without modifiers).
  """
  chain, args, split = [], [], []
  if alibi:
    chain.append(_alibi_mod)
    args.append(jnp.asarray(alibi_slopes(num_heads)))
    split.append(1)
  if relative_bias is not None:
    chain.append(relative_bias[0])
    args.append(relative_bias[1])
    split.append(1)
  if score_mod is not None:
    chain.append(score_mod)
    split.append(0)
  out: dict[str, Any] = {}
  if chain:
    out["score_mod"] = chain[0] if len(chain) == 1 else ScoreChain(tuple(chain), tuple(split))
    out["score_mod_args"] = tuple(args)
  if mask_mod is not None:
    out["mask_mod"] = mask_mod
  return out


_alibi_mod = alibi  # layer_kwargs' parameter ``alibi`` shadows the function


# Names of the mask modifiers before they took the ``_mask`` suffix (which keeps them apart
# from the patterns of :mod:`attnjax.patterns`); they keep working for one release.
_RENAMED = {
  "causal": "causal_mask",
  "sliding_window": "sliding_window_mask",
  "chunked": "chunked_mask",
  "prefix_lm": "prefix_lm_mask",
  "SlidingWindow": "SlidingWindowMask",
  "Chunked": "ChunkedMask",
}


def __getattr__(name: str):
  if name in _RENAMED:
    import warnings  # only on a deprecated name

    warnings.warn(
      f"attnjax.mods.{name} is now attnjax.mods.{_RENAMED[name]} (mask modifiers "
      f"end in _mask, apart from the patterns of attnjax.patterns)",
      DeprecationWarning,
      stacklevel=2,
    )
    return globals()[_RENAMED[name]]
  raise AttributeError(f"module 'attnjax.mods' has no attribute {name!r}")
