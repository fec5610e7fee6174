"""The tile machinery of the block-wise kernel (:mod:`attnjax.kernels.blockwise`).

A call is described statically by :class:`TilePlan`; its arrays are laid out once by
:class:`Arrays` (float32, query heads grouped under their key/value head, time on axis -2,
``scale`` folded into ``q``). One tile is a query block's rows (``G * tq`` rows: every
query head of a group stacked, so GQA costs no copies) against ``tk`` keys:
:func:`tile_logits` gives its float32 logits and :func:`tile_allowed` its boolean mask
(static structure on partial blocks, segment ids, the explicit mask), or None when every
pair is allowed; what the logits become is the normaliser's business. :func:`gpu_block_sizes`
chooses a GPU target's tiles from its memory (:func:`target_platform`, :func:`gpu_memory_bytes`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from attnjax._src import logits, target, options
from attnjax._src.kernels._plan import KernelPlan
from attnjax._src.kernels.linear_map import as_aval, varying_axes
from attnjax._src.layout import FULL, SKIP, BlockLayout, segment_block_relations

Array = jnp.ndarray
MaskFn = Callable[[Array, Array], Optional[Array]]


# ---------------------------------------------------------------------------
# Tile sizes for the target.

# Default tiles on a GPU whose rows are not known (a ring step), and the smallest tiles a
# GPU gets: XLA runs every visit as its own kernels.
GPU_BLOCK_Q = 128
GPU_BLOCK_K = 128
# A GPU's float32 score tile [B, N, block_q, block_k] takes at most this fraction of the
# device's memory; the backward keeps about 9 tiles alive (XLA's memory analysis of an H200
# compile), so the kernel's temporaries stay under 2% of the device's memory.
GPU_TILE_FRACTION = 1 / 512
# Memory assumed for a GPU whose kind names none and whose memory cannot be read.
GPU_DEFAULT_MEMORY = 16 * 2**30
# Memory (10^9 bytes) of known GPU kinds, most specific first: the smallest model of a family
# ("NVIDIA H200" names no size; "NVIDIA GH200 480GB" names the CPU's memory too).
_GPU_MEMORY_GB = (
  ("GH200", 96),
  ("H200", 141),
  ("H100", 80),
  ("H800", 80),
  ("H20", 96),
  ("B200", 180),
  ("B300", 288),
  ("A100", 40),
  ("A800", 40),
  ("L40", 48),
  ("L4", 24),
  ("A10", 24),
)
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def target_platform() -> str:
  """``"cpu"``, ``"cuda"`` or ``"tpu"``: what a program traced now is compiled for.

  The ambient mesh's device (``jax.set_mesh``: how a deviceless compile names its
  target, :mod:`attnjax.targets`), else this process's default backend.
  """
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None)
  if platform is None:
    platform = jax.default_backend()
  return "cuda" if platform in _GPU_PLATFORMS else platform


def gpu_memory_bytes(kind: Optional[str] = None) -> int:
  """The memory of the GPU a program is traced for, in bytes.

  From its kind, so a deviceless compile plans as the device does: a known
  family's smallest model (``"NVIDIA H200"``: 141 GB; ``"NVIDIA A100-SXM4-80GB"``:
  40 GB), else the size the kind names (``"... 32GB"``); else this process's
  first GPU's allocator limit; else :data:`GPU_DEFAULT_MEMORY`.

  Args:
    kind: a device kind; None: the target's (:func:`attnjax._src.target.device_kind`).
  """
  kind = target.device_kind("cuda") if kind is None else kind
  if kind:
    for name, gb in _GPU_MEMORY_GB:
      if name in kind:
        return gb * 10**9
    named = re.search(r"(\d+)\s*GB", kind)
    if named:
      return int(named.group(1)) * 10**9
  try:
    stats = jax.devices("gpu")[0].memory_stats() or {}
  except Exception:  # no GPU backend in this process, or a device without statistics
    stats = {}
  return int(stats.get("bytes_limit", GPU_DEFAULT_MEMORY))


def _pow2_floor(n: float) -> int:
  return 1 << max(0, int(n).bit_length() - 1)


def gpu_block_sizes(
  T: int, S: int, rows: int, memory: int, *, is_causal: bool = False
) -> tuple[int, int]:
  """``(block_q, block_k)`` of a call on a GPU with ``memory`` bytes (before capping at T, S).

  XLA runs each visit of a tile as a few kernels (and a loop step); with
  128 x 128 tiles an H200 spent ~65 us per visit (measured: 7.8 TFLOP/s
  at T=4096, 528 visits), so a GPU wants few visits of large matmuls. The tiles
  double, the smaller side first, from 128 x 128 while the float32 score tile
  ``rows * block_q * block_k`` fits ``memory * GPU_TILE_FRACTION`` (a power of
  two of elements): memory stays O(T) and the budget is fixed by the device,
  not the length. Causal calls keep at least 4 blocks a side, so the diagonal
  blocks compute at most 1.25x the allowed pairs.

  Args:
    T, S: query and key lengths.
    rows: batch times query heads (the score tile's leading size).
    memory: the device's memory in bytes (:func:`gpu_memory_bytes`).
    is_causal: the call is causal.
  """
  budget = _pow2_floor(memory * GPU_TILE_FRACTION / 4)  # float32 elements
  cap_q = max(GPU_BLOCK_Q, _pow2_floor(T // 4)) if is_causal else T
  cap_k = max(GPU_BLOCK_K, _pow2_floor(S // 4)) if is_causal else S
  bq, bk = GPU_BLOCK_Q, GPU_BLOCK_K
  while rows * 2 * bq * bk <= budget:  # doubling either side still fits
    if bq < cap_q and (bq <= bk or bk >= cap_k):
      bq *= 2
    elif bk < cap_k:
      bk *= 2
    else:
      break
  return bq, bk


# ---------------------------------------------------------------------------
# Static description of one call.


@dataclasses.dataclass(frozen=True)
class TilePlan(KernelPlan):
  opts: Any
  layout: BlockLayout
  mask_fn: Optional[MaskFn]
  B: int
  T: int
  S: int
  K: int
  G: int
  H: int
  Hv: int
  has_sink: bool
  has_segments: bool
  # mask_mod with traced args (no static layout): its blocks are classified per call into a
  # table (SKIP / FULL / MASKED, joined with the segment relation); MASKED visits evaluate it.
  mod_table: bool = False
  # The call's key 0 is this call's key 0 (its first column feeds ``sink_mass``). False for a
  # ring step (:mod:`attnjax._src.kernels.blockwise.ring`) whose keys start later in the sequence.
  holds_key0: bool = True
  # The shard_map axis whose devices hold the call's other query rows (context parallelism,
  # all-gather): statistics are taken over every device's rows. None: this call's rows only.
  stats_axis: Optional[str] = None
  # Every full-size query block runs in one loop over tables of its visits, however few there
  # are (a pattern's layout, whose rows differ: unrolled, each row compiled its own visits).
  roll_query_blocks: bool = False

  @property
  def runtime_skip(self) -> bool:
    """Whether visits are chosen at run time (segment ids or a mask_mod table)."""
    return self.has_segments or self.mod_table


def _grouped5(x: Array, K: int) -> Array:
  """A rank-4 ``[Bx, Nx, Tx, Sx]`` mask/bias as ``[Bx, K|1, G|1, Tx, Sx]``."""
  Bx, Nx, Tx, Sx = x.shape
  if Nx == 1:
    return jnp.reshape(x, (Bx, 1, 1, Tx, Sx))
  return jnp.reshape(x, (Bx, K, Nx // K, Tx, Sx))


def span(x: Array, start, size: int, axis: int) -> Array:
  """``size`` entries from ``start`` along ``axis``; ``start`` is an int or, inside a loop over
  key blocks (``k0``) or query blocks (``q0``), a traced index."""
  if isinstance(start, int):
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def tile_of(x: Array, q0, tq: int, k0, tk: int) -> Array:
  """Slices the ``[.., Tx, Sx]`` tile of a broadcastable 5-d array (size-1 axes kept)."""
  if x.shape[3] != 1:
    x = span(x, q0, tq, 3)
  return x if x.shape[4] == 1 else span(x, k0, tk, 4)


def add_tile(acc: Array, tile: Array, starts: tuple) -> Array:
  """``acc[starts : starts + tile.shape] += tile`` (in place under XLA; starts may be traced)."""
  starts = tuple(jnp.asarray(s, jnp.int32) for s in starts)
  current = jax.lax.dynamic_slice(acc, starts, tile.shape)
  return jax.lax.dynamic_update_slice(acc, current + tile, starts)


def as_rows(x: Array, G: int, tq: int) -> Array:
  """``[X, Kx, G|1, tq|1, Y]`` -> ``[X, Kx, G * tq | 1, Y]``: the kernel's row axis is (group, time).

  Every matmul of the kernel is a rank-4 batched matmul over ``(B, K)`` with all
  ``G`` query heads of a group stacked along its rows, so GQA costs no copies of
  K or V and XLA's CPU dot needs no layout changes.
  """
  X, Kx, Gx, Tx, Y = x.shape
  if Gx == 1 and Tx == 1:
    return jnp.reshape(x, (X, Kx, 1, Y))
  if G == 1:
    return jnp.reshape(x, (X, Kx, Tx, Y))
  return jnp.reshape(jnp.broadcast_to(x, (X, Kx, G, tq, Y)), (X, Kx, G * tq, Y))


def from_rows(x: Array, G: int) -> Array:
  """``[B, K, G * tq, Y]`` -> ``[B, K, G, tq, Y]``."""
  B, K, R, Y = x.shape
  return jnp.reshape(x, (B, K, G, R // G, Y))


def _and(a: Optional[Array], b: Optional[Array]) -> Optional[Array]:
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


class Arrays:
  """The call's arrays in the kernel's layout (float32, heads grouped, time axis -2)."""

  def __init__(
    self,
    c: TilePlan,
    q,
    k,
    v,
    bias,
    sink,
    mask,
    q_seg,
    kv_seg,
    score_args=(),
    mask_args=(),
    positions=None,
    mod_any=None,
  ):
    B, T, K, G = c.B, c.T, c.K, c.G
    q32 = jnp.transpose(jnp.reshape(q.astype(jnp.float32), (B, T, K, G, c.H)), (0, 2, 3, 1, 4))
    self.k = jnp.transpose(k.astype(jnp.float32), (0, 2, 1, 3))  # [B, K, S, H]
    self.v = jnp.transpose(v.astype(jnp.float32), (0, 2, 1, 3))  # [B, K, S, Hv]
    if c.opts.similarity == "dot":
      self.q = q32 * c.opts.scale  # [B, K, G, T, H]; scale folded into q once
      self.q_sq = self.k_sq = None
    else:
      self.q = q32
      self.q_sq = jnp.sum(q32 * q32, axis=-1, keepdims=True)  # [B, K, G, T, 1]
      self.k_sq = jnp.sum(self.k * self.k, axis=-1)[:, :, None, :]  # [B, K, 1, S]
    self.bias = None if bias is None else _grouped5(bias.astype(jnp.float32), K)
    self.mask = None if mask is None else _grouped5(mask, K)
    self.sink = None if sink is None else jnp.reshape(sink.astype(jnp.float32), (1, K, G, 1, 1))
    self.q_seg, self.kv_seg = q_seg, kv_seg
    self.score_args, self.mask_args = tuple(score_args), tuple(mask_args)
    # Global positions of the rows / key slots (sparse paths with chunks or gathered keys).
    self.q_pos, self.k_pos = (None, None) if positions is None else positions
    self.mod_any = mod_any  # int32 [num_q_blocks, num_kv_blocks] SKIP / FULL / MASKED, or None
    # Inside jax.shard_map: the manual axes the inputs vary over (loop carries started from
    # zeros must be typed as varying over them too).
    self.varying = tuple(sorted({axis for x in (q, k, v) for axis in varying_axes(as_aval(x))}))

  def vary(self, x: Array) -> Array:
    """``x`` (made here, e.g. zeros) typed as varying over the manual axes the inputs vary over."""
    missing = tuple(axis for axis in self.varying if axis not in varying_axes(as_aval(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  def q_rows(self, c: TilePlan, q0, tq: int) -> Array:
    """Query rows ``q0 .. q0 + tq`` as ``[B, K, G * tq, H]`` (``q0`` may be traced)."""
    return as_rows(span(self.q, q0, tq, 3), c.G, tq)


def sink_rows(c: TilePlan, a: Arrays, tq: int) -> Optional[Array]:
  """The learned null logits in rows ``[1, K, G*tq|1, 1]``, or None."""
  return as_rows(a.sink, c.G, tq) if c.has_sink else None


def _index5(c: TilePlan, a: Arrays, q0, tq: int, k0, tk: int):
  """int32 index arrays of a tile, laid out ``[B, K, G, tq, tk]`` (:func:`attnjax._src.logits.index_grid`);
  ``i`` / ``j`` are global positions when the call has them."""
  i = q0 + jnp.arange(tq, dtype=jnp.int32) if a.q_pos is None else span(a.q_pos, q0, tq, 0)
  j = k0 + jnp.arange(tk, dtype=jnp.int32) if a.k_pos is None else span(a.k_pos, k0, tk, 0)
  return logits.index_grid(c.B, (c.K, c.G), i, j)


def tile_score_mod(
  c: TilePlan, a: Arrays, z: Array, score_args: tuple, q0, tq: int, k0, tk: int
) -> Array:
  """The rows ``z [B, K, G*tq, tk]`` after ``opts.score_mod`` (identity without one)."""
  if c.opts.score_mod is None:
    return z
  z5 = jnp.reshape(jnp.broadcast_to(z, (c.B, c.K, c.G * tq, tk)), (c.B, c.K, c.G, tq, tk))
  out = options.apply_score_mod(c.opts, score_args, z5, *_index5(c, a, q0, tq, k0, tk))
  return jnp.reshape(out, (c.B, c.K, c.G * tq, tk))


def tile_logits(c: TilePlan, a: Arrays, qb: Array, q0, tq, k0, tk):
  """Float32 logits of one tile ``[B, K, G*tq, tk]`` and the pre-bias capped similarity.

  The logits are before ``score_mod`` (see :func:`tile_score_mod`).
  """
  kb = span(a.k, k0, tk, 2)
  s = jnp.einsum("bkrh,bksh->bkrs", qb, kb, preferred_element_type=jnp.float32)
  if c.opts.similarity != "dot":  # for "dot" the scale is folded into the rows
    s = logits.from_dots(
      s,
      scale=c.opts.scale,
      similarity=c.opts.similarity,
      q_sq=as_rows(span(a.q_sq, q0, tq, 3), c.G, tq),
      k_sq=span(a.k_sq, k0, tk, 3),
    )
  bias = None if a.bias is None else as_rows(tile_of(a.bias, q0, tq, k0, tk), c.G, tq)
  return logits.capped_logits(s, c.opts.softcap, bias)


def tile_allowed(c: TilePlan, a: Arrays, q0, tq, k0, tk, needs_mask: bool, seg_mask: bool):
  """Boolean ``[B|1, K|1, G*tq|1, tk]`` of the tile, or None when all is allowed."""
  out = None  # built as [X, K|1, G|1, tq, tk], then laid out as rows
  if needs_mask and c.mask_fn is not None:  # q0 / k0 are traced inside the loops over blocks
    m = c.mask_fn(q0 + jnp.arange(tq), k0 + jnp.arange(tk))
    if m is not None:
      out = jnp.reshape(m, (m.shape[0], 1, 1, tq, tk))
  if c.opts.mask_mod is not None and (needs_mask or (c.mod_table and seg_mask)):
    m = options.apply_mask_mod(c.opts, a.mask_args, *_index5(c, a, q0, tq, k0, tk))
    out = _and(out, jnp.broadcast_to(m, jnp.broadcast_shapes(jnp.shape(m), (1, c.K, c.G, tq, tk))))
  if seg_mask and c.has_segments:
    seg = span(a.q_seg, q0, tq, 1)[:, :, None] == span(a.kv_seg, k0, tk, 1)[:, None, :]
    out = _and(out, jnp.reshape(seg, (c.B, 1, 1, tq, tk)))
  if a.mask is not None:
    out = _and(out, tile_of(a.mask, q0, tq, k0, tk))
  return None if out is None else as_rows(out, c.G, tq)


def segment_relations(c: TilePlan, a: Arrays):
  """``relation(i, j)``: ``SKIP`` / ``FULL`` / ``MASKED`` of a visit at run time (see layout)."""
  if c.has_segments:
    table = segment_block_relations(a.q_seg, a.kv_seg, c.layout)
  else:
    table = jnp.full((c.layout.num_q_blocks, c.layout.num_kv_blocks), FULL, jnp.int32)
  if c.mod_table:  # SKIP if either skips, FULL if both are full, else MASKED
    table = jnp.where((table == SKIP) | (a.mod_any == SKIP), SKIP, jnp.maximum(table, a.mod_any))
  return lambda i, j: table[i, j]
