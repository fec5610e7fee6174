"""What the Pallas TPU kernels (:mod:`attnjax.kernels.pallas_tpu`) share: the plan and the block tables.

A call's static description (:class:`TpuPlan`: shapes, block sizes, options),
its **block tables** and the pieces of a tile the kernel bodies share (logits,
the element mask of a partial tile, matmuls with float32 accumulation).

Block tables. The kernels' grids run over the key blocks each query block
visits (forward, dq) or the query blocks that visit each key block (dk/dv), not
over all blocks: the static structure (causal, window, a ``mask_mod``'s layout,
the ragged last key block) comes from :mod:`attnjax.layout` as a matrix of
``SKIP`` / ``FULL`` / ``MASKED`` per (query block, key block); only the visited
blocks get grid steps (:class:`Tables`). Run-time structure (segment ids: the
segments of a block pair cannot meet; a ``mask_mod`` with traced arguments) can
only turn a visited block into a skipped or a masked one: the table of kinds is
computed per call in XLA and read by the kernels from SMEM (scalar prefetch), and
a skipped step's block index repeats the last fetched block, so Pallas issues no
copy for it and the body computes nothing (``pl.when``). Blocks every row attends
entirely run without any element mask.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax import layout as layout_lib
from attnjax import normalizers

Array = jnp.ndarray
SKIP, FULL, MASKED = layout_lib.SKIP, layout_lib.FULL, layout_lib.MASKED
LANES = 128  # a TPU vector register is [8 sublanes, 128 lanes]


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class TpuPlan(normalizers.KernelPlan):
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
      out[i, :len(r)] = r
      out[i, len(r):] = r[-1]
  return out, np.array([len(r) for r in rows], np.int32)


def static_tables(c: TpuPlan, bq: int, bk: int, extra: Optional[layout_lib.BlockLayout]) -> Tables:
  """The tables of block geometry ``(bq, bk)`` from causal / window structure, the ragged last
  key block (masked: its padded keys) and ``extra`` (a ``mask_mod``'s static layout, or None)."""
  base = layout_lib.structural_layout(c.T, c.S, bq, bk, is_causal=c.opts.is_causal,
                                      window=c.opts.window)
  if extra is not None:
    base = layout_lib.intersect(base, extra)
  kept, full = layout_lib.kept_blocks(base), layout_lib.full_blocks(base)
  kinds = np.where(kept, np.where(full, FULL, MASKED), SKIP).astype(np.int8)
  if c.S % bk:
    kinds[:, -1] = np.where(kinds[:, -1] == SKIP, SKIP, MASKED)
  kv_index, kv_count = _lists(kinds)
  q_index, q_count = _lists(kinds.T)
  return Tables(kinds=kinds, kv_index=kv_index, q_index=q_index, kv_count=kv_count,
                q_count=q_count)


def run_time_kinds(static: np.ndarray, runtime: Optional[Array]) -> Array:
  """int32 ``[nq, nk]`` kinds: the static ones, tightened by a run-time table (or not)."""
  kinds = jnp.asarray(static, jnp.int32)
  if runtime is None:
    return kinds
  runtime = runtime.astype(jnp.int32)
  skip = (kinds == SKIP) | (runtime == SKIP)
  full = (kinds == FULL) & (runtime == FULL)
  return jnp.where(skip, SKIP, jnp.where(full, FULL, MASKED)).astype(jnp.int32)


def visit_tables(kinds: Array, index: np.ndarray, count: np.ndarray,
                 transpose: bool) -> tuple[Array, Array]:
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


def run_time_table(c: TpuPlan, t: Tables, q_seg, kv_seg, bq: int, bk: int) -> Array:
  """int32 ``[nq, nk]`` kinds of a call: the static ones tightened by its segment ids."""
  if not c.has_segments:
    return run_time_kinds(t.kinds, None)
  nq, nk = t.kinds.shape
  geometry = layout_lib.BlockLayout.from_visits(c.T, c.S, bq, bk, [[] for _ in range(nq)])
  rel = layout_lib.segment_block_relations(q_seg, kv_seg, geometry)
  return run_time_kinds(t.kinds, rel)


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
  if c.opts.softcap is None:
    return s, s
  return c.opts.softcap * jnp.tanh(s / c.opts.softcap), s


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """``a @ b`` with float32 accumulation; float32 operands at full precision (the MXU's
  multi-pass float32 product), others in their dtype (bf16 on the MXU)."""
  ca = 0 if trans_a else 1
  cb = 1 if trans_b else 0
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def tile_allowed(c: TpuPlan, qpos: Array, kpos: Array, q_seg: Optional[Array],
                 k_seg: Optional[Array], b, n) -> Array:
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
    allowed = allowed & jnp.asarray(c.opts.mask_mod(b, n, qpos, kpos), bool)
  return allowed


def score_mod(c: TpuPlan, z: Array, qpos: Array, kpos: Array, b, n) -> Array:
  """The tile's logits after an argument-free ``score_mod`` evaluated in the kernel."""
  if not c.score_in_kernel:
    return z
  return jnp.broadcast_to(jnp.asarray(c.opts.score_mod(z, b, n, qpos, kpos), jnp.float32),
                          z.shape)
