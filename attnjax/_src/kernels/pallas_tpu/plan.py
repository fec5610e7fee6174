"""What the Pallas TPU kernels (:mod:`attnjax.kernels.pallas_tpu`) share: the plan and the block tables.

:class:`TpuPlan` (a call's shapes, block sizes and options); :class:`Tables`, the key
blocks each query block visits (and the transpose) from the static ``SKIP`` / ``FULL`` /
``MASKED`` structure, with run-time kinds (segment ids, traced ``mask_mod`` arguments)
read from SMEM; :class:`ScalarTable` for modifier arguments; and the pieces of a tile the
bodies share (logits, a partial tile's element mask, float32-accumulating matmuls).
Guide: docs/guides/kernels.md, section "Pallas Mosaic TPU".
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnjax._src import logits as logits_lib
from attnjax._src import layout as layout_lib
from attnjax._src.kernels._plan import KernelPlan
from attnjax._src.kernels.blockwise.kernel import index_use

Array = jnp.ndarray
SKIP, FULL, MASKED = layout_lib.SKIP, layout_lib.FULL, layout_lib.MASKED
LANES = 128  # a TPU vector register is [8 sublanes, 128 lanes]


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class TpuPlan(KernelPlan):
  """Everything a kernel body reads from Python: shapes, options, block sizes."""

  opts: object
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  Hv: int
  Tp: int  # T and S padded to whole blocks (of both passes' sizes)
  Sp: int
  bq: int
  bk: int
  bq_bwd: int
  bk_bwd: int
  has_sink: bool
  has_segments: bool
  mask_in_kernel: bool  # opts.mask_mod is evaluated on partial tiles
  score_in_kernel: bool  # opts.score_mod rewrites every tile's logits
  interpret: bool
  num_score_args: int = 0  # score_mod_args / mask_mod_args, in SMEM (ScalarTable)
  num_mask_args: int = 0
  # mask_mod's blocks classified per call: its arguments are data, or it reads the batch or
  # head index of a shard of the call
  mod_table: bool = False

  @property
  def has_mods(self) -> bool:
    """A modifier runs in the kernel: it gets the shard offsets and its arguments' refs."""
    return self.score_in_kernel or self.mask_in_kernel

  @property
  def G(self) -> int:
    return self.N // self.K


@dataclasses.dataclass(frozen=True)
class Tables:
  """Static visit lists of one block geometry (numpy; hashed by identity of the plan).

  Attributes:
    kinds: ``int8 [nq, nk]``: the static kind of every block pair.
    kv_index: ``int32 [nq, V]``: key blocks query block ``i`` visits (its
      ``V`` visits; shorter rows repeat their last block, kind ``SKIP``).
    q_index: ``int32 [nk, W]``: query blocks that visit key block ``j``.
    kv_count, q_count: the real visits of each row of ``kv_index`` / ``q_index``.
  """

  kinds: np.ndarray
  kv_index: np.ndarray
  q_index: np.ndarray
  kv_count: np.ndarray
  q_count: np.ndarray


def _lists(kinds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Per row, the columns with a kind other than SKIP, padded by repeating the last one; and
  the number of real ones per row."""
  rows = [np.flatnonzero(r != SKIP) for r in kinds]
  width = max([len(r) for r in rows] + [1])
  out = np.zeros((kinds.shape[0], width), np.int32)
  for i, r in enumerate(rows):
    if len(r):
      out[i, : len(r)] = r
      out[i, len(r) :] = r[-1]
  return out, np.array([len(r) for r in rows], np.int32)


def static_tables(c: TpuPlan, bq: int, bk: int, extra: Optional[layout_lib.BlockLayout]) -> Tables:
  """The tables of block geometry ``(bq, bk)`` from causal / window structure, the ragged last
  key block (masked: its padded keys) and ``extra`` (a ``mask_mod``'s static layout, or None)."""
  base = layout_lib.structural_layout(
    c.T, c.S, bq, bk, is_causal=c.opts.is_causal, window=c.opts.window
  )
  if extra is not None:
    base = layout_lib.intersect(base, extra)
  kept, full = layout_lib.kept_blocks(base), layout_lib.full_blocks(base)
  kinds = np.where(kept, np.where(full, FULL, MASKED), SKIP).astype(np.int8)
  if c.S % bk:
    kinds[:, -1] = np.where(kinds[:, -1] == SKIP, SKIP, MASKED)
  kv_index, kv_count = _lists(kinds)
  q_index, q_count = _lists(kinds.T)
  return Tables(kinds=kinds, kv_index=kv_index, q_index=q_index, kv_count=kv_count, q_count=q_count)


def run_time_kinds(static: np.ndarray, runtime: Optional[Array]) -> Array:
  """int32 ``[nq, nk]`` kinds: the static ones, tightened by a run-time table (or not)."""
  kinds = jnp.asarray(static, jnp.int32)
  if runtime is None:
    return kinds
  runtime = runtime.astype(jnp.int32)
  skip = (kinds == SKIP) | (runtime == SKIP)
  full = (kinds == FULL) & (runtime == FULL)
  return jnp.where(skip, SKIP, jnp.where(full, FULL, MASKED)).astype(jnp.int32)


def visit_tables(
  kinds: Array, index: np.ndarray, count: np.ndarray, transpose: bool
) -> tuple[Array, Array]:
  """``(kind [rows, V], fetch [rows, V])`` int32 of the visit lists ``index`` ``[rows, V]``
  (``count`` real visits per row).

  ``kind`` is the pair's kind (SKIP for the padding of short rows and for pairs
  the run-time table skips); ``fetch`` the block each step's index map names:
  the visited block, or for a skipped step the block fetched last (the first
  visited one before any), so a skipped step copies nothing.
  """
  rows, width = index.shape
  r = np.arange(rows)[:, None]
  kind = kinds[index, r] if transpose else kinds[r, index]
  pad = np.arange(width)[None, :] >= count[:, None]  # the repeated tail of a short row
  kind = jnp.where(pad, SKIP, kind).astype(jnp.int32)
  live = kind != SKIP
  step = jnp.arange(width, dtype=jnp.int32)[None, :]
  last_live = jax.lax.cummax(jnp.where(live, step, -1), axis=1)
  first_live = jnp.argmax(live, axis=1).astype(jnp.int32)[:, None]
  use = jnp.where(last_live >= 0, last_live, first_live)
  fetch = jnp.take_along_axis(jnp.asarray(index), use, axis=1).astype(jnp.int32)
  return kind, fetch


def run_time_table(
  c: TpuPlan, t: Tables, q_seg, kv_seg, bq: int, bk: int, mod: Optional[Array] = None
) -> Array:
  """int32 ``[nq, nk]`` kinds of a call: the static ones tightened by its segment ids and by
  ``mod`` (a ``mask_mod``'s kinds computed per call, or None)."""
  kinds = run_time_kinds(t.kinds, mod)
  if c.has_segments:
    nq = t.kinds.shape[0]
    geometry = layout_lib.BlockLayout.from_visits(c.T, c.S, bq, bk, [[] for _ in range(nq)])
    kinds = run_time_kinds(kinds, layout_lib.segment_block_relations(q_seg, kv_seg, geometry))
  return kinds


def heads_first(c: TpuPlan, q, k, v, q_seg, kv_seg):
  """Pads T / S to whole blocks and transposes to ``[B, N|K, T|S, H]``; segment ids as
  ``[B, Tp, 128]`` (a column per query: sublanes) and ``[B, 8, Sp]`` (a row per key: lanes)."""

  def pad(x, L):
    x = jnp.transpose(x, (0, 2, 1, 3))
    return jnp.pad(x, ((0, 0), (0, 0), (0, L - x.shape[2]), (0, 0)))

  qh, kh, vh = pad(q, c.Tp), pad(k, c.Sp), pad(v, c.Sp)
  if q_seg is not None:
    qs = jnp.pad(q_seg.astype(jnp.int32), ((0, 0), (0, c.Tp - c.T)), mode="edge")
    ks = jnp.pad(kv_seg.astype(jnp.int32), ((0, 0), (0, c.Sp - c.S)), mode="edge")
    q_seg = jnp.broadcast_to(qs[:, :, None], (c.B, c.Tp, LANES))
    kv_seg = jnp.broadcast_to(ks[:, None, :], (c.B, 8, c.Sp))
  return qh, kh, vh, q_seg, kv_seg


def logits(c: TpuPlan, q: Array, k: Array) -> tuple[Array, Array]:
  """``(z, s)`` float32 ``[tq, tk]``: the (soft-capped) logits and the scaled dots before the cap."""
  s = dot(q, k, trans_b=True) * c.opts.scale
  return logits_lib.softcap(s, c.opts.softcap), s


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """``a @ b`` with float32 accumulation; float32 operands at full precision (the MXU's
  multi-pass float32 product), others in their dtype (bf16 on the MXU)."""
  ca = 0 if trans_a else 1
  cb = 1 if trans_b else 0
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(
    a, b, (((ca,), (cb,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


# ---------------------------------------------------------------------------
# Modifier arguments inside a kernel.

MAX_ARG_SIZE = 8192  # elements of one modifier argument kept in SMEM


class ScalarTable:
  """A modifier argument as a kernel sees it: an SMEM array read by scalar index only.

  ``slopes[n]`` (ALiBi) or ``prefix_lengths[b]`` read one element through the
  kernel's scalar unit; anything else (an index array, arithmetic on the whole
  table) raises ``TypeError``, so :func:`attnjax.kernels.pallas_tpu.unsupported`
  can find, by tracing the modifier once, whether the kernel can evaluate it.
  """

  def __init__(self, shape, dtype, read: Callable[[tuple], Array]):
    self.shape, self.dtype, self.ndim = tuple(shape), jnp.dtype(dtype), len(shape)
    self._read = read

  def __getitem__(self, idx):
    idx = idx if isinstance(idx, tuple) else (idx,)
    if len(idx) != self.ndim or any(jnp.ndim(i) != 0 for i in idx):
      raise TypeError(
        f"a modifier argument of shape {self.shape} is read by scalar index only "
        f"in the Pallas TPU kernel, got an index of shapes "
        f"{[tuple(jnp.shape(i)) for i in idx]}"
      )
    return self._read(tuple(jnp.asarray(i, jnp.int32) for i in idx))

  def __len__(self) -> int:
    return self.shape[0]

  def __jax_array__(self):
    raise TypeError("a modifier argument is read by scalar index only in the Pallas TPU kernel")


def smem_dtype(dtype):
  """The dtype a modifier argument is held in SMEM with (32-bit words)."""
  return jnp.float32 if jnp.issubdtype(dtype, jnp.inexact) else jnp.int32


def tables_of_refs(refs) -> list:
  return [ScalarTable(r.shape, r.dtype, lambda idx, r=r: r[idx]) for r in refs]


def global_indices(c: TpuPlan, b, n, off_ref):
  """The batch row and query head of the whole call (shard offsets added)."""
  if off_ref is None:
    return b, n
  return b + off_ref[0], n + off_ref[1]


def mod_kinds(c: TpuPlan, opts, mask_args, bq: int, bk: int, offsets=None) -> Optional[Array]:
  """int32 ``[nq, nk]`` kinds of a ``mask_mod`` evaluated per call (XLA; with arguments, or
  reading the batch / head index of a shard), or None when its blocks are static.

  ``offsets``: the first batch row and query head of the call's arrays in the whole call
  (inside ``shard_map``), added to the indices the modifier is evaluated at.
  """
  if not c.mod_table:
    return None
  nq = -(-c.T // bq)
  geometry = layout_lib.BlockLayout.from_visits(c.T, c.S, bq, bk, [[] for _ in range(nq)])
  used_b, used_n = index_use(opts.mask_mod, mask_args)
  fn = opts.mask_mod
  if offsets is not None and getattr(fn, "block_table", None) is None:
    b0, n0 = offsets
    fn = lambda b, n, i, j, *a: opts.mask_mod(b + b0, n + n0, i, j, *a)
  return layout_lib.mask_mod_block_table(
    fn, mask_args, geometry, c.B if used_b else 1, c.N if used_n else 1
  )


def mod_inputs(c: TpuPlan, score_args, mask_args, offsets=None) -> tuple[list, list]:
  """``(arrays, specs)`` the kernels take for their modifiers: the shard's ``offsets`` (batch
  row, query head; None: 0, 0) and the modifiers'
  arguments, all in SMEM (:class:`ScalarTable` reads them)."""
  if not c.has_mods:
    return [], []
  b0, n0 = (0, 0) if offsets is None else offsets
  arrays = [jnp.stack([jnp.asarray(b0, jnp.int32), jnp.asarray(n0, jnp.int32)])]
  arrays += [
    jnp.asarray(a).astype(smem_dtype(jnp.result_type(a)))
    for a in tuple(score_args)[: c.num_score_args] + tuple(mask_args)[: c.num_mask_args]
  ]
  return arrays, [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(arrays)


def take_mods(c: TpuPlan, it, *, score_tables: bool = True):
  """``(offsets, score_mod tables, mask_mod tables)`` from a kernel's ref iterator.

  ``score_tables=False`` leaves the ``score_mod`` arguments as refs (the dq kernel reads
  them by index for their gradient).
  """
  if not c.has_mods:
    return None, [], []
  off = next(it)
  score = [next(it) for _ in range(c.num_score_args)]
  mask = [next(it) for _ in range(c.num_mask_args)]
  return off, tables_of_refs(score) if score_tables else score, tables_of_refs(mask)


def tile_allowed(
  c: TpuPlan,
  qpos: Array,
  kpos: Array,
  q_seg: Optional[Array],
  k_seg: Optional[Array],
  b,
  n,
  mask_args=(),
) -> Array:
  """Boolean ``[tq, tk]`` element mask of a partial tile from positions ``[tq, 1]``, ``[1, tk]``."""
  allowed = jnp.broadcast_to(kpos < c.S, (qpos.shape[0], kpos.shape[1]))
  if c.opts.is_causal:
    allowed = allowed & (kpos <= qpos)
  if c.opts.window is not None:
    left, right = c.opts.window
    allowed = allowed & (kpos >= qpos - left) & (kpos <= qpos + right)
  if q_seg is not None:
    allowed = allowed & (q_seg == k_seg)
  if c.mask_in_kernel:
    allowed = allowed & jnp.asarray(c.opts.mask_mod(b, n, qpos, kpos, *mask_args), bool)
  return allowed


def score_mod(c: TpuPlan, z: Array, qpos: Array, kpos: Array, b, n, score_args=()) -> Array:
  """The tile's logits after ``score_mod`` evaluated in the kernel (arguments: ScalarTables)."""
  if not c.score_in_kernel:
    return z
  return jnp.broadcast_to(
    jnp.asarray(c.opts.score_mod(z, b, n, qpos, kpos, *score_args), jnp.float32), z.shape
  )


def score_mod_vjp(c: TpuPlan, z: Array, qpos: Array, kpos: Array, b, n, arg_refs):
  """``(z', pullback)`` of the kernel's ``score_mod`` on a tile: ``pullback(dz') ->
  (dz, [(arg, index, d element)])``, the cotangents of the elements of floating arguments
  the tile read (each summed over the tile)."""
  reads: list = []  # (arg, index) of every float element read, in order

  def recording(a, r):
    def read(idx):
      if jnp.issubdtype(r.dtype, jnp.inexact):
        reads.append((a, idx))
      return r[idx]

    return read

  tables = [ScalarTable(r.shape, r.dtype, recording(a, r)) for a, r in enumerate(arg_refs)]
  score_mod(c, z, qpos, kpos, b, n, tables)  # finds the reads (its result is unused)
  values = [arg_refs[a][idx] for a, idx in reads]

  def replay(zz, *vals):
    it = iter(vals)

    def read(a, r):
      return lambda idx: next(it) if jnp.issubdtype(r.dtype, jnp.inexact) else r[idx]

    return score_mod(
      c,
      zz,
      qpos,
      kpos,
      b,
      n,
      [ScalarTable(r.shape, r.dtype, read(a, r)) for a, r in enumerate(arg_refs)],
    )

  out, pull = jax.vjp(replay, z, *values)

  def pullback(dz):
    grads = pull(dz)
    return grads[0], [(a, idx, g) for (a, idx), g in zip(reads, grads[1:])]

  return out, pullback
