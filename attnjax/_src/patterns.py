"""Sparse attention patterns: which keys each query may see, element by element and block by block.

Implementation behind the public module :mod:`attnjax.patterns`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax.numpy as jnp
import numpy as np

from attnjax._src import masks, validators

# Layouts are built in attnjax.layout from these rules.
from attnjax._src.layout import BlockLayout, SparsePlan, kept_blocks
from attnjax._src.layout import key_block_candidates, rule_layout

Array = jnp.ndarray


# ---------------------------------------------------------------------------
# Argument validation.


def _check_int(name: str, value, *, minimum: int, pattern: str) -> int:
  return validators.check_positive_int(name, value, minimum=minimum, where=pattern)


def check_lengths(T, S, block_size) -> tuple[int, int, int]:
  """Validates a sequence shape and block size for a mask or layout."""
  T = _check_int("T", T, minimum=1, pattern="layout")
  S = _check_int("S", S, minimum=1, pattern="layout")
  block_size = _check_int("block_size", block_size, minimum=1, pattern="layout")
  return T, S, block_size


# ---------------------------------------------------------------------------
# Pattern base class.


class Pattern:
  """Base class: subclasses are frozen dataclasses defining ``allowed``.

  Subclasses may override ``candidate_key_blocks`` with a cheap superset
  of the key blocks a query range can touch; the layout then evaluates the
  rule only on those blocks, so building it costs in proportion to the kept
  blocks rather than to ``T * S``.
  """

  def allowed(self, q_positions: Array, k_positions: Array, shape: tuple[int, int]) -> Array:
    """The element rule: ``bool [Tq, Sk]``, True where query may attend key.

    Args:
      q_positions: ``[Tq]`` integer query positions (a block or all of them).
      k_positions: ``[Sk]`` integer key positions.
      shape: ``(T, S)`` of the whole problem (only patterns whose choice depends
        on the length, e.g. BigBird's random blocks, read it).
    """
    raise NotImplementedError

  def candidate_key_blocks(
    self, q_lo: int, q_hi: int, shape: tuple[int, int], block_size: int
  ) -> np.ndarray:
    """``bool [num_k_blocks]``: a superset of the key blocks queries ``[q_lo, q_hi)`` may see."""
    del q_lo, q_hi
    return np.ones(-(-shape[1] // block_size), bool)

  def check_shape(self, T: int, S: int) -> None:
    """Raises ValueError if the pattern cannot be laid on ``(T, S)``."""
    del T, S

  @property
  def is_causal(self) -> bool:
    """True when the rule never allows ``j > i`` (then ``& causal()`` changes nothing)."""
    return False

  def band(self) -> Optional[tuple[int, int]]:
    """``(left, right)`` if the rule depends only on ``j - i`` and allows only
    ``-left <= j - i <= right``; None otherwise. Banded patterns can be run
    chunk by chunk with one layout for every chunk."""
    return None

  def band_parts(self) -> Optional["BandParts"]:
    """A band plus a few global key columns and query rows, or None.

    When not None, ``allowed(i, j)`` is exactly ``sliding_window(*band)``'s rule,
    or ``j`` in ``columns`` with ``allowed(i, j)``, or ``i`` in ``rows`` with
    ``allowed(i, j)``. Such a pattern runs chunk by chunk like a band, with the
    columns as gathered key slots of every chunk and the rows computed on
    their own (a StreamingLLM or Longformer pattern at any length). The
    default is the plain band, if any.
    """
    band = self.band()
    return None if band is None else BandParts(band, (), ())

  # -- extra keys: a second, gathered copy of some keys ------------------------
  #
  # A pattern whose allowed keys are scattered (e.g. the summary columns of
  # ``fixed``) touches every key block although it keeps few keys. It can
  # instead name those keys in ``extra_key_positions``; the block-sparse
  # path appends a gathered copy of them after the ``S`` keys ("slots"
  # ``S, S + 1, ...``), and ``allowed_slots`` splits the rule between the
  # original keys and the copies so that every allowed pair is counted once.

  def extra_key_positions(self, S: int) -> np.ndarray:
    """``int32 [E]``: key positions appended, gathered, after the ``S`` keys (default none)."""
    del S
    return np.zeros((0,), np.int32)

  def allowed_slots(self, q_positions: Array, k_slots: Array, shape: tuple[int, int]) -> Array:
    """The rule over slots ``0 .. S + E - 1`` (``shape`` is the real ``(T, S)``).

    Must allow each pair of ``allowed`` through exactly one slot.
    """
    return self.allowed(q_positions, k_slots, shape)

  def candidate_slot_blocks(
    self, q_lo: int, q_hi: int, shape: tuple[int, int], block_size: int
  ) -> np.ndarray:
    """Like ``candidate_key_blocks``, over the ``S + E`` slots."""
    return self.candidate_key_blocks(q_lo, q_hi, shape, block_size)

  def plan(self, T: int, S: Optional[int] = None, *, block_size: int) -> "SparsePlan":
    """What the block-sparse path runs: extra keys, the layout over slots and the slot rule."""
    S = T if S is None else S
    T, S, block_size = check_lengths(T, S, block_size)
    self.check_shape(T, S)
    extra = self.extra_key_positions(S)
    if extra.size == 0:
      return SparsePlan(extra, rule_layout(self, T, S, block_size), self)
    view = _SlotView(self, S)
    return SparsePlan(extra, rule_layout(view, T, S + extra.size, block_size), view)

  # -- derived ---------------------------------------------------------------

  def mask(self, T: int, S: Optional[int] = None) -> Array:
    """The exact dense mask ``bool [1, 1, T, S]`` (``S`` defaults to ``T``); the reference."""
    S = T if S is None else S
    T, S, _ = check_lengths(T, S, 1)
    self.check_shape(T, S)
    return self.allowed(jnp.arange(T), jnp.arange(S), (T, S))[None, None]

  def layout(self, T: int, S: Optional[int] = None, *, block_size: int) -> BlockLayout:
    """The block layout for square blocks of ``block_size`` (cached per shape)."""
    S = T if S is None else S
    T, S, block_size = check_lengths(T, S, block_size)
    self.check_shape(T, S)
    return rule_layout(self, T, S, block_size)

  def block_mask(self, T: int, block_size: int, S: Optional[int] = None) -> np.ndarray:
    """``numpy bool [num_q_blocks, num_k_blocks]`` of kept blocks, for drawing (``plt.imshow``)."""
    return kept_blocks(self.layout(T, S, block_size=block_size))

  def __or__(self, other: "Pattern") -> "Pattern":
    return union(self, other)

  def __and__(self, other: "Pattern") -> "Pattern":
    return intersection(self, other)


@dataclasses.dataclass(frozen=True)
class BandParts:
  """A pattern as a band ``(left, right)``, global key ``columns`` and global query ``rows``
  (see :meth:`.Pattern.band_parts`)."""

  band: tuple[int, int]
  columns: tuple[int, ...]
  rows: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _SlotView:
  """A pattern seen over its ``S + E`` key slots (hashable: static under jit)."""

  pattern: "Pattern"
  S: int

  def allowed(self, q_positions, k_slots, shape):
    return self.pattern.allowed_slots(q_positions, k_slots, (shape[0], self.S))

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    return self.pattern.candidate_slot_blocks(q_lo, q_hi, (shape[0], self.S), block_size)


@dataclasses.dataclass(frozen=True)
class _BandChunk:
  """A banded pattern on one chunk: local query ``t`` is global ``c + t`` and
  local key ``u`` is global ``c - left + u``; by translation invariance the rule
  is the pattern's at positions ``(t + left, u)``."""

  pattern: "Pattern"

  def allowed(self, q_positions, k_positions, shape):
    return self.pattern.allowed(q_positions + self.pattern.band()[0], k_positions, shape)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    left, right = self.pattern.band()
    return key_block_candidates([(q_lo, q_hi + left + right)], shape[1], block_size)


@functools.lru_cache(maxsize=64)
def band_chunk_plan(pattern: "Pattern", chunk: int, block_size: int) -> SparsePlan:
  """The plan of one chunk of ``chunk`` queries of a banded pattern, shared by every chunk.

  Keys are the ``chunk + left + right`` positions around the chunk; at the
  ends of the sequence some fall outside ``[0, S)``, which the caller masks
  with a data mask (applied on every visit).
  """
  left, right = pattern.band()
  view = _BandChunk(pattern)
  return SparsePlan(
    np.zeros((0,), np.int32), rule_layout(view, chunk, chunk + left + right, block_size), view
  )


def _structure(qp, kp, **kwargs) -> Array:
  """``bool [Tq, Sk]`` from :func:`attnjax.masks.structural_mask` (the one mask rule)."""
  return masks.structural_mask(qp, kp, **kwargs)[0, 0]


# ---------------------------------------------------------------------------
# Patterns.


@dataclasses.dataclass(frozen=True)
class Causal(Pattern):
  """Query ``i`` sees keys ``j <= i``."""

  @property
  def is_causal(self) -> bool:
    return True

  def allowed(self, q_positions, k_positions, shape):
    del shape
    return _structure(q_positions, k_positions, is_causal=True)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    return key_block_candidates([(0, q_hi)], S, block_size)


@dataclasses.dataclass(frozen=True)
class SlidingWindow(Pattern):
  """Query ``i`` sees keys ``i - left <= j <= i + right`` (causal when ``right == 0``)."""

  left: int
  right: int = 0

  def __post_init__(self):
    _check_int("left", self.left, minimum=0, pattern="sliding_window")
    _check_int("right", self.right, minimum=0, pattern="sliding_window")

  def allowed(self, q_positions, k_positions, shape):
    del shape
    return _structure(q_positions, k_positions, window=(self.left, self.right))

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    return key_block_candidates([(q_lo - self.left, q_hi + self.right)], S, block_size)

  def band(self):
    return (self.left, self.right)

  @property
  def is_causal(self) -> bool:
    return self.right == 0


@dataclasses.dataclass(frozen=True)
class Strided(Pattern):
  """Child et al. strided pattern (causal).

  Query ``i`` sees the previous ``stride`` positions, ``max(0, i - stride) <= j
  <= i`` (the paper's A(1)), and every earlier ``j`` with ``(i - j) % stride == 0``
  (A(2)): a row and a column of the ``[T / stride, stride]`` image of the sequence.

  The column part touches every causal key block whenever ``block_size <=
  stride``, so this pattern's own layout is block-dense; for the softmax
  family :func:`attnjax.sparse_attention` computes it instead as a sliding
  window plus the columns of the transposed sequence (see ``sparse.py``).
  """

  stride: int

  def __post_init__(self):
    _check_int("stride", self.stride, minimum=1, pattern="strided")

  @property
  def is_causal(self) -> bool:
    return True

  def allowed(self, q_positions, k_positions, shape):
    del shape
    local = _structure(q_positions, k_positions, is_causal=True, window=(self.stride, 0))
    causal = _structure(q_positions, k_positions, is_causal=True)
    offset = q_positions[:, None] - k_positions[None, :]
    column = jnp.logical_and(causal, offset % self.stride == 0)
    return jnp.logical_or(local, column)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    return key_block_candidates([(0, q_hi)], S, block_size)


@dataclasses.dataclass(frozen=True)
class Fixed(Pattern):
  """Child et al. fixed pattern (causal).

  Query ``i`` sees the earlier keys of its own block of ``stride`` positions,
  ``j // stride == i // stride`` (the paper's A(1)), and the last ``summary``
  positions of every block, ``j % stride >= stride - summary`` (A(2), ``c`` in
  the paper), always with ``j <= i``.
  """

  stride: int
  summary: int

  def __post_init__(self):
    _check_int("stride", self.stride, minimum=1, pattern="fixed")
    _check_int("summary", self.summary, minimum=1, pattern="fixed")
    if self.summary > self.stride:
      raise ValueError(
        f"fixed: summary must be <= stride (the summary is the last positions of each "
        f"block), got summary={self.summary}, stride={self.stride}"
      )

  @property
  def is_causal(self) -> bool:
    return True

  def allowed(self, q_positions, k_positions, shape):
    del shape
    causal = _structure(q_positions, k_positions, is_causal=True)
    same_block = (q_positions[:, None] // self.stride) == (k_positions[None, :] // self.stride)
    summary = (k_positions % self.stride >= self.stride - self.summary)[None, :]
    return jnp.logical_and(causal, jnp.logical_or(same_block, summary))

  # The summary columns hit every key block; the block-sparse path visits a
  # gathered copy of them instead (summary keys of earlier blocks), and the
  # original keys only for the query's own block.

  def extra_key_positions(self, S):
    if self.summary == self.stride:  # every key is a summary key: plain causal
      return np.zeros((0,), np.int32)
    j = np.arange(S, dtype=np.int32)
    return j[j % self.stride >= self.stride - self.summary]

  def allowed_slots(self, q_positions, k_slots, shape):
    T, S = shape
    extra = self.extra_key_positions(S)
    if extra.size == 0:
      return self.allowed(q_positions, k_slots, shape)
    is_copy = k_slots >= S
    pos = jnp.where(is_copy, jnp.asarray(extra)[jnp.clip(k_slots - S, 0, extra.size - 1)], k_slots)
    q_block = (q_positions // self.stride)[:, None]
    k_block = (pos // self.stride)[None, :]
    own_block = jnp.logical_and(_structure(q_positions, pos, is_causal=True), q_block == k_block)
    return jnp.where(is_copy[None, :], k_block < q_block, own_block)

  def candidate_slot_blocks(self, q_lo, q_hi, shape, block_size):
    T, S = shape
    extra = self.extra_key_positions(S)
    if extra.size == 0:
      return self.candidate_key_blocks(q_lo, q_hi, shape, block_size)
    own_start = (q_lo // self.stride) * self.stride
    last_block_start = ((q_hi - 1) // self.stride) * self.stride
    copies = int(np.searchsorted(extra, last_block_start))
    return key_block_candidates([(own_start, q_hi), (S, S + copies)], S + extra.size, block_size)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    return key_block_candidates([(0, q_hi)], S, block_size)


@dataclasses.dataclass(frozen=True)
class GlobalWindow(Pattern):
  """Longformer: the first ``num_global`` tokens see and are seen by all; others use a window.

  ``window`` is a pair ``(left, right)`` (keys ``i - left .. i + right``;
  Longformer's symmetric window of ``2w + 1`` keys is ``(w, w)``) or an int
  ``w``, meaning ``(w, 0)`` (keys ``i - w .. i``) as everywhere. The global
  part is bidirectional, as in Longformer; intersect with :func:`.causal` for a
  decoder.
  """

  num_global: int
  window: Union[int, tuple[int, int]]

  def __post_init__(self):
    _check_int("num_global", self.num_global, minimum=0, pattern="global_window")
    window = self.window
    if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
      window = (_check_int("window", window, minimum=0, pattern="global_window"), 0)
    elif isinstance(window, tuple) and len(window) == 2:
      window = (
        _check_int("window[0] (left)", window[0], minimum=0, pattern="global_window"),
        _check_int("window[1] (right)", window[1], minimum=0, pattern="global_window"),
      )
    else:
      raise TypeError(
        f"global_window: window must be an int or a (left, right) tuple of ints, got {window!r}"
      )
    object.__setattr__(self, "window", window)

  def allowed(self, q_positions, k_positions, shape):
    del shape
    local = _structure(q_positions, k_positions, window=self.window)
    is_global = jnp.logical_or(
      (q_positions < self.num_global)[:, None], (k_positions < self.num_global)[None, :]
    )
    return jnp.logical_or(local, is_global)

  def band_parts(self):
    everyone = tuple(range(self.num_global))
    return BandParts(self.window, everyone, everyone)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    if q_lo < self.num_global:
      return np.ones(-(-S // block_size), bool)
    left, right = self.window
    return key_block_candidates([(0, self.num_global), (q_lo - left, q_hi + right)], S, block_size)


@functools.lru_cache(maxsize=64)
def _bigbird_table(
  block: int,
  num_global: int,
  window_blocks: int,
  num_random: int,
  seed: int,
  num_q_blocks: int,
  num_k_blocks: int,
) -> np.ndarray:
  """``bool [num_q_blocks, num_k_blocks]``: BigBird's allowed blocks, random part from ``seed``."""
  del block
  qb = np.arange(num_q_blocks)[:, None]
  kb = np.arange(num_k_blocks)[None, :]
  table = np.logical_or.reduce(
    [
      np.broadcast_to(qb < num_global, (num_q_blocks, num_k_blocks)),
      np.broadcast_to(kb < num_global, (num_q_blocks, num_k_blocks)),
      np.abs(qb - kb) <= window_blocks,
    ]
  )
  for row in range(num_global, num_q_blocks):
    free = np.flatnonzero(np.logical_not(table[row]))
    if num_random and free.size:
      # One generator per (seed, row): a row's draw does not depend on other rows.
      rng = np.random.default_rng([seed, row])
      table[row, rng.choice(free, size=min(num_random, free.size), replace=False)] = True
  table.setflags(write=False)
  return table


@dataclasses.dataclass(frozen=True)
class BigBird(Pattern):
  """BigBird (ITC): global, sliding and random attention over blocks of ``block`` positions.

  With query block ``a = i // block`` and key block ``b = j // block``, the pair
  is allowed if ``a < num_global`` or ``b < num_global`` (global blocks attend
  to and are attended by all), ``|a - b| <= window_blocks`` (the window: BigBird
  uses 3 blocks, ``window_blocks=1``), or ``b`` is one of ``num_random`` key
  blocks drawn for row ``a`` among those not already allowed. The draw uses
  ``numpy.random.default_rng([seed, a])``, so equal seeds give equal patterns
  for a given ``(T, S)``. Bidirectional, as in the paper; intersect with
  :func:`.causal` for a decoder (random blocks in the future are then dropped).
  """

  block: int
  num_global: int
  window_blocks: int
  num_random: int
  seed: int

  def __post_init__(self):
    _check_int("block", self.block, minimum=1, pattern="bigbird")
    _check_int("num_global", self.num_global, minimum=0, pattern="bigbird")
    _check_int("window_blocks", self.window_blocks, minimum=0, pattern="bigbird")
    _check_int("num_random", self.num_random, minimum=0, pattern="bigbird")
    _check_int("seed", self.seed, minimum=0, pattern="bigbird")

  def check_shape(self, T, S):
    if self.block > max(T, S):
      raise ValueError(
        f"bigbird: block={self.block} is longer than the sequence (T={T}, S={S}); "
        f"use a block of at most {max(T, S)}"
      )

  def table(self, T: int, S: Optional[int] = None) -> np.ndarray:
    """``numpy bool [ceil(T / block), ceil(S / block)]``: allowed BigBird blocks."""
    S = T if S is None else S
    return _bigbird_table(
      self.block,
      self.num_global,
      self.window_blocks,
      self.num_random,
      self.seed,
      -(-T // self.block),
      -(-S // self.block),
    )

  def allowed(self, q_positions, k_positions, shape):
    table = jnp.asarray(self.table(*shape))
    qb = jnp.clip(q_positions // self.block, 0, table.shape[0] - 1)
    kb = jnp.clip(k_positions // self.block, 0, table.shape[1] - 1)
    return table[qb[:, None], kb[None, :]]

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    rows = self.table(*shape)[q_lo // self.block : (q_hi - 1) // self.block + 1]
    blocks = np.flatnonzero(rows.any(axis=0))
    return key_block_candidates(
      [(b * self.block, (b + 1) * self.block) for b in blocks], S, block_size
    )


@dataclasses.dataclass(frozen=True)
class SinksWindow(Pattern):
  """StreamingLLM: the first ``num_sinks`` keys plus a causal sliding window.

  Query ``i`` sees ``j < num_sinks`` and ``i - window <= j <= i`` (its own
  position and the ``window`` before it, as ``sliding_window(window)``),
  always with ``j <= i``: the keys a decode cache of ``num_sinks + window``
  earlier entries holds beside the query's own key when it evicts the oldest
  non-sink entry (:mod:`attnjax.nn`'s sinks + window layer).
  """

  num_sinks: int
  window: int

  def __post_init__(self):
    _check_int("num_sinks", self.num_sinks, minimum=0, pattern="sinks_window")
    _check_int("window", self.window, minimum=0, pattern="sinks_window")

  @property
  def is_causal(self) -> bool:
    return True

  def allowed(self, q_positions, k_positions, shape):
    del shape
    recent = _structure(q_positions, k_positions, is_causal=True, window=(self.window, 0))
    causal = _structure(q_positions, k_positions, is_causal=True)
    sinks = jnp.logical_and(causal, (k_positions < self.num_sinks)[None, :])
    return jnp.logical_or(recent, sinks)

  def band_parts(self):
    return BandParts((self.window, 0), tuple(range(self.num_sinks)), ())

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    return key_block_candidates(
      [(0, min(self.num_sinks, q_hi)), (q_lo - self.window, q_hi)], S, block_size
    )


@dataclasses.dataclass(frozen=True)
class DilatedWindow(Pattern):
  """Longformer's dilated sliding window (causal).

  Query ``i`` sees keys ``j = i - dilation * m`` for ``m = 0 .. window - 1``
  with ``j >= 0``: itself and the ``window - 1`` keys before it at a stride of
  ``dilation``, spanning ``dilation * (window - 1) + 1`` positions. With
  ``dilation=1`` it is ``sliding_window(window - 1)``.

  Its kept keys are scattered over the span, so its own block layout visits
  every block of the span; :func:`attnjax.sparse_attention` runs it instead
  on the ``dilation`` residue columns of the sequence (positions ``r, r + d,
  r + 2d, ...``), where it is a causal sliding window of ``window`` keys, so
  the cost follows the ``T * window`` kept pairs (see ``sparse.py``).
  """

  window: int
  dilation: int

  def __post_init__(self):
    _check_int("window", self.window, minimum=1, pattern="dilated_window")
    _check_int("dilation", self.dilation, minimum=1, pattern="dilated_window")

  @property
  def is_causal(self) -> bool:
    return True

  def allowed(self, q_positions, k_positions, shape):
    del shape
    offset = q_positions[:, None] - k_positions[None, :]
    span = self.dilation * (self.window - 1)
    return (offset >= 0) & (offset <= span) & (offset % self.dilation == 0)

  def band(self):
    # Translation invariant inside the band (j - i in [-span, 0]): the banded chunk path
    # applies this rule on every chunk.
    return (self.dilation * (self.window - 1), 0)

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    S = shape[1]
    span = self.dilation * (self.window - 1)
    return key_block_candidates([(q_lo - span, q_hi)], S, block_size)


@dataclasses.dataclass(frozen=True)
class PatternUnion(Pattern):
  """Pairs allowed by any of ``parts``."""

  parts: tuple

  @property
  def is_causal(self) -> bool:
    return all(p.is_causal for p in self.parts)

  def allowed(self, q_positions, k_positions, shape):
    out = self.parts[0].allowed(q_positions, k_positions, shape)
    for p in self.parts[1:]:
      out = jnp.logical_or(out, p.allowed(q_positions, k_positions, shape))
    return out

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    return np.logical_or.reduce(
      [p.candidate_key_blocks(q_lo, q_hi, shape, block_size) for p in self.parts]
    )

  def check_shape(self, T, S):
    for p in self.parts:
      p.check_shape(T, S)


@dataclasses.dataclass(frozen=True)
class PatternIntersection(Pattern):
  """Pairs allowed by every one of ``parts``."""

  parts: tuple

  @property
  def is_causal(self) -> bool:
    return any(p.is_causal for p in self.parts)

  def allowed(self, q_positions, k_positions, shape):
    out = self.parts[0].allowed(q_positions, k_positions, shape)
    for p in self.parts[1:]:
      out = jnp.logical_and(out, p.allowed(q_positions, k_positions, shape))
    return out

  def band_parts(self):
    # A banded pattern (with global columns / rows) cut to causal: the band loses its right side.
    if len(self.parts) == 2 and any(isinstance(p, Causal) for p in self.parts):
      other = self.parts[1] if isinstance(self.parts[0], Causal) else self.parts[0]
      parts = other.band_parts()
      if parts is not None:
        left, right = parts.band
        return BandParts((left, min(right, 0)), parts.columns, parts.rows)
    return None

  def candidate_key_blocks(self, q_lo, q_hi, shape, block_size):
    # A block non-empty for the intersection is non-empty for every part.
    return np.logical_and.reduce(
      [p.candidate_key_blocks(q_lo, q_hi, shape, block_size) for p in self.parts]
    )

  def check_shape(self, T, S):
    for p in self.parts:
      p.check_shape(T, S)


# ---------------------------------------------------------------------------
# Constructors (the public names).


def causal() -> Causal:
  """The causal pattern: query ``i`` sees keys ``j <= i``.

  Returns:
    A :class:`.Causal` pattern.
  """
  return Causal()


def sliding_window(left: int, right: int = 0) -> SlidingWindow:
  """A sliding window: query ``i`` sees keys ``i - left <= j <= i + right``.

  Args:
    left: keys before the query (``>= 0``).
    right: keys after it (``>= 0``); ``right=0`` is a causal window of ``left + 1`` keys.

  Returns:
    A :class:`.SlidingWindow` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return SlidingWindow(left, right)


def strided(stride: int) -> Strided:
  """Child et al. 2019's strided pattern (causal).

  Query ``i`` sees the previous ``stride`` positions (``i - stride <= j <= i``) and every
  earlier ``j`` with ``(i - j) % stride == 0``.

  Args:
    stride: ``l`` in the paper (``>= 1``).

  Returns:
    A :class:`.Strided` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return Strided(stride)


def fixed(stride: int, summary: int) -> Fixed:
  """Child et al. 2019's fixed pattern (causal).

  Query ``i`` sees the earlier keys of its own block of ``stride`` positions and the last
  ``summary`` positions of every earlier block.

  Args:
    stride: block length ``l``.
    summary: summary positions ``c`` per block (``1 <= c <= l``).

  Returns:
    A :class:`.Fixed` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return Fixed(stride, summary)


def global_window(num_global: int, window: Union[int, tuple[int, int]]) -> GlobalWindow:
  """Longformer: ``num_global`` global tokens plus a local window.

  The first ``num_global`` tokens see and are seen by every token; every other query sees
  keys ``i - left <= j <= i + right`` (Longformer's symmetric window is ``(w, w)``).

  Args:
    num_global: global tokens at the start of the sequence.
    window: ``(left, right)``, or an int ``w`` meaning ``(w, 0)``.

  Returns:
    A :class:`.GlobalWindow` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return GlobalWindow(num_global, window)


def bigbird(block: int, num_global: int, window_blocks: int, num_random: int, seed: int) -> BigBird:
  """BigBird over blocks of ``block`` tokens: global, window and random blocks.

  Args:
    block: block length ``b``; ``T`` and ``S`` must be multiples of it.
    num_global: global blocks ``g`` at the start (they see and are seen by all).
    window_blocks: neighbour blocks ``w`` on each side of a block's own.
    num_random: random key blocks ``r`` per query block, drawn with numpy from ``seed``.
    seed: the random blocks' seed (the pattern is a pure function of it and the length).

  Returns:
    A :class:`.BigBird` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return BigBird(block, num_global, window_blocks, num_random, seed)


def sinks_window(num_sinks: int, window: int) -> SinksWindow:
  """StreamingLLM: the first ``num_sinks`` keys and keys ``i - window`` to ``i`` (causal).

  Args:
    num_sinks: sink keys at the start of the sequence.
    window: keys before the query (``window + 1`` keys with the query's own).

  Returns:
    A :class:`.SinksWindow` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return SinksWindow(num_sinks, window)


def dilated_window(window: int, dilation: int) -> DilatedWindow:
  """Longformer's dilated window (causal): keys ``i - dilation * m`` for ``0 <= m < window``.

  Args:
    window: keys per query, its own included (``>= 1``).
    dilation: spacing between them (``>= 1``).

  Returns:
    A :class:`.DilatedWindow` pattern.

  Raises:
    TypeError: an argument that is not an int.
    ValueError: an argument out of its range (the message names it).
  """
  return DilatedWindow(window, dilation)


def _check_parts(name: str, patterns) -> tuple:
  if len(patterns) < 1:
    raise ValueError(f"{name} needs at least one pattern")
  for p in patterns:
    if not isinstance(p, Pattern):
      raise TypeError(f"{name} takes Pattern objects, got {type(p).__name__}")
  return tuple(patterns)


def union(*patterns: Pattern) -> Pattern:
  """Pairs allowed by any pattern (also ``a | b``); nested unions are flattened.

  Args:
    *patterns: one or more :class:`.Pattern`.

  Returns:
    The pattern itself for one, else a :class:`.PatternUnion`.

  Raises:
    ValueError: no pattern.
    TypeError: an argument that is not a :class:`.Pattern`.
  """
  parts = []
  for p in _check_parts("union", patterns):
    parts.extend(p.parts if isinstance(p, PatternUnion) else (p,))
  return parts[0] if len(parts) == 1 else PatternUnion(tuple(parts))


def intersection(*patterns: Pattern) -> Pattern:
  """Pairs allowed by every pattern (also ``a & b``).

  Nested intersections are flattened, repeated parts kept once, and ``causal()`` is dropped
  next to a pattern that is causal already (:attr:`.Pattern.is_causal`), so that e.g.
  ``strided(64) & causal()`` is ``strided(64)`` and keeps its fast paths.

  Args:
    *patterns: one or more :class:`.Pattern`.

  Returns:
    The pattern itself when one part is left, else a :class:`.PatternIntersection`.

  Raises:
    ValueError: no pattern.
    TypeError: an argument that is not a :class:`.Pattern`.
  """
  parts = []
  for p in _check_parts("intersection", patterns):
    parts.extend(p.parts if isinstance(p, PatternIntersection) else (p,))
  parts = [p for n, p in enumerate(parts) if p not in parts[:n]]  # a & a is a
  if any(p.is_causal and not isinstance(p, Causal) for p in parts):
    parts = [p for p in parts if not isinstance(p, Causal)]
  return parts[0] if len(parts) == 1 else PatternIntersection(tuple(parts))
