"""The backward kernels of :mod:`attnjax.kernels.mosaic_gpu` (FlashAttention-2/3 style, tiles
recomputed): a dq kernel and a dk/dv kernel; here one warpgroup per program with a TMA ring
(head dim 256), warp-specialised in :mod:`.specialised` (head dims 64, 128).

Row terms in one XLA pass (``D_i`` only for a normaliser that ``reads_row_dot``; summed
from the tiles in float32 for softpick in half precision), then dq over the forward's key
blocks and dk/dv over blocks of ``DKDV_BLOCK_K`` = 64 keys with the tiles transposed (keys
as rows), GQA summed in registers. Entry point: :func:`backward`.
Guide: docs/guides/kernels.md, section "Pallas Mosaic GPU for Hopper".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl

from attnjax._src import logits as logits_lib
from attnjax._src.kernels.mosaic_gpu.plan import (
  dkdv_plan,
  heaviest_first,
  interpret_params,
  kv_bounds,
  load_vector,
  lower_rows,
  padded,
  segment_args,
  tile_allowed,
)

Array = jnp.ndarray


def q_block_bounds(c, k0, k_last, nq: int):
  """``(lo, hi, full_lo, full_hi)`` query blocks that may attend keys ``k0 .. k_last``, and
  those whose rows all attend every one of them (no element mask)."""
  bq = c.bq
  lo, hi = jnp.int32(0), jnp.int32(pl.cdiv(c.T, bq))
  full_hi = jnp.where(k_last + 1 - k0 == c.bk, hi, jnp.int32(0))  # a ragged key block: masked
  full_lo = jnp.int32(0)
  if c.opts.is_causal:
    lo = k0 // bq
    full_lo = pl.cdiv(k_last, bq)
  if c.opts.window is not None:
    left, right = c.opts.window
    lo = jnp.maximum(lo, jnp.maximum(0, k0 - right) // bq)
    hi = jnp.minimum(hi, (k_last + left) // bq + 1)
    full_lo = jnp.maximum(full_lo, pl.cdiv(jnp.maximum(0, k_last - right), bq))
    full_hi = jnp.minimum(full_hi, (k0 + left + 1) // bq)
  # the last query block holds padded rows (rows >= T): masked as a ragged block
  if c.T % bq:
    full_hi = jnp.minimum(full_hi, c.T // bq)
  hi = jnp.maximum(hi, lo)
  if c.has_segments:  # the mask is data: every visited block is masked
    full_lo, full_hi = lo, lo
  full_lo = jnp.clip(full_lo, lo, hi)
  full_hi = jnp.clip(full_hi, full_lo, hi)
  return lo, hi, full_lo, full_hi


def _layout_tools(c, plgpu, shape):
  """``(iota(d), any_iota, load(ref, axis), layout)`` of a kernel's ``shape`` tiles: an int32
  index tile along ``d``, an iota with the tile layout named (for the row lowering), a vector
  loaded from shared memory in the layout of a reduction over ``axis``, and the tile layout."""
  layout = plgpu.Layout.WGMMA
  if c.plain:
    return (
      lambda d: lax.broadcasted_iota(jnp.int32, shape, d),
      None,
      lambda ref, axis: ref[...],
      layout,
    )

  def iota(d):
    # a vector broadcast: a thread holds 2 rows and 16 columns of a [64, 64] tile, so the
    # index tile costs their registers, not 32 (a tile iota held in the walk spilled)
    vec = plgpu.broadcasted_iota(jnp.int32, (shape[d],), 0, layout=layout.reduce(1 - d))
    return lax.broadcast_in_dim(vec, shape, (d,))

  return (
    iota,
    lambda dtype, shp, d: plgpu.broadcasted_iota(dtype, shp, d, layout=layout),
    lambda ref, axis: load_vector(ref, layout.reduce(axis)),
    layout,
  )


def _mm(c, plgpu, shape, a, b_ref, staging=None, trans_b=False, a_ref=None, acc=None):
  """``a @ b`` (float32) by wgmma: ``a`` a register tile (or ``a_ref`` in shared memory),
  ``b_ref`` shared memory (``trans_b``: its transpose); with ``acc`` (float32 ``shape``),
  ``acc + a @ b`` accumulated in place in the wgmma's accumulator (no third tile of
  registers for a fresh product; compiled only). In interpret mode a register lhs is staged through
  ``staging``, and under jax 0.10's interpreter (``Plan.plain``) a transposed operand is a
  register ``dot``."""
  if c.plain and trans_b:
    lhs = a if a_ref is None else a_ref[...]
    out = lax.dot_general(
      lhs, b_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return out if acc is None else acc + out

  def issue(acc_ref):
    if a_ref is not None:
      lhs = a_ref
    elif c.interpret:
      staging[...] = a
      lhs = staging
    else:
      lhs = a
    rhs = b_ref.transpose((1, 0)) if trans_b else b_ref
    plgpu.wgmma(acc_ref, lhs, rhs)

  if acc is not None and not c.interpret:
    return pl.run_state(issue)(plgpu.ACC.init(acc))

  def fresh(acc_ref):
    issue(acc_ref)
    return acc_ref[...]

  out = pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
  # the interpreter cannot discharge run_state over swizzled shared-memory refs
  # (NotImplementedError: UnswizzleRef, jax 0.12): there the sum is taken after the product
  return out if acc is None else acc + out


def _num_rows(c, res_keys, has_g: bool) -> int:
  """Row vectors a backward kernel loads per query block: ``row_dot`` (where the normaliser
  reads it), ``g`` (with a logsumexp cotangent) and the residuals."""
  return int(c.nz.reads_row_dot) + int(has_g) + len(res_keys)


def _row_args(rows, res_keys, has_g: bool, has_dot: bool):
  """``(res, row_dot, g)`` of the loaded row vectors ``[row_dot?, g?, *residuals]``
  (``row_dot`` None without ``has_dot``)."""
  k = int(has_dot)
  return (
    dict(zip(res_keys, rows[k + int(has_g) :])),
    rows[0] if has_dot else None,
    rows[k] if has_g else None,
  )


def _lowered_rule(c, fn, R: int, *, transposed: bool = False, iota=None):
  """``fn(z, allowed, dp, *rows)`` (:meth:`Normalizer.tile_backward`, or a rows-only visit)
  through the row lowering, taking the raw tile ``a b^T``: the logits ``softcap(scale * raw)``
  are formed inside the lowering, where the scale folds into the exponent's FFMA
  (``lower_rows(fuse=True)``: ``exp(scale * raw - r)`` is one FFMA and one MUFU op)."""
  logits = lambda raw: logits_lib.softcap(raw * c.opts.scale, c.opts.softcap)
  return lower_rows(
    lambda raw, *args: fn(logits(raw), *args), R, iota=iota, transposed=transposed, fuse=True
  )


def _tile_rule(c, plgpu, a_ref, b_ref, do_a_ref, do_b_ref, mask, row_args, lowered):
  """``(raw, w, dz)`` of one tile: ``raw = a b^T`` (float32, unscaled), then with
  ``dp = do_a do_b^T`` the tile rule ``lowered`` (from :func:`_lowered_rule`) on the tile's
  mask ``mask()`` (None: unmasked) and ``row_args``, or ``row_args()`` (a callable: the row
  inputs loaded only once ``raw`` is read, so that their registers are not held while the
  products run)."""
  shape = (a_ref.shape[0], b_ref.shape[0])
  rows = row_args if callable(row_args) else lambda: row_args
  if c.plain:  # jax 0.10's interpreter: register dots (see _mm)
    raw = _mm(c, plgpu, shape, None, b_ref, trans_b=True, a_ref=a_ref)
    allowed = mask()
    dp = _mm(c, plgpu, shape, None, do_b_ref, trans_b=True, a_ref=do_a_ref)
    args = rows()
  else:

    def products(acc_s, acc_dp):
      # both wgmmas issued back to back; the tile rule's work before it reads dp (the
      # weights, mask) runs while dP is still on the tensor cores (wait_n=1: S's group, the
      # older, is done)
      plgpu.wgmma(acc_s, a_ref, b_ref.transpose((1, 0)))
      plgpu.wgmma(acc_dp, do_a_ref, do_b_ref.transpose((1, 0)))
      raw = plgpu.wgmma_accumulator_load(acc_s, wait_n=1)
      return raw, mask(), rows(), acc_dp[...]

    acc = plgpu.ACC(shape, jnp.float32)
    raw, allowed, args, dp = pl.run_scoped(products, acc, acc)
  w, dz = lowered(raw, allowed, dp, *args)
  return raw, w, dz


def _ds(c, dz, raw, dtype):
  """The similarity's cotangent ``dS`` (through the soft cap; ``raw`` the unscaled tile) in
  ``dtype``."""
  if c.opts.softcap is None:
    return dz.astype(dtype)
  return logits_lib.softcap_grad(dz, c.opts.softcap, s=raw * c.opts.scale).astype(dtype)


def _scratch_tail(c, scratch):
  """``(staging, seg_scratch)`` after a backward kernel's nine common scratch entries: the
  interpret-mode staging buffer of a register lhs (None compiled) and the four segment-id
  buffers and barriers (all None without segments)."""
  extra = list(scratch[9:])
  staging = extra.pop(0) if c.interpret else None
  return staging, (tuple(extra) if c.has_segments else (None,) * 4)


def _dq_mask(c, load, qpos, kcol, q_seg, kseg_ring, slot, j):
  """The dq kernel's ``[bq, bk]`` element mask of key block ``j``: rows at ``qpos`` (segment
  ids ``q_seg``), the block's key ids in ring slot ``slot`` of ``kseg_ring`` (with segments)."""
  k_seg = None
  if c.has_segments:
    k_seg = lax.broadcast_in_dim(load(kseg_ring.at[slot], 0), (c.bq, c.bk), (1,))
  return tile_allowed(c, qpos, j * c.bk + kcol, q_seg, k_seg)


def _dkdv_mask(c, load, i, qcol, kpos, qseg_ring, slot, k_seg):
  """The dk/dv kernel's ``[bk, bq]`` element mask (keys as rows at ``kpos``, segment ids
  ``k_seg``) of query block ``i`` (column offsets ``qcol``), its query ids in ring slot
  ``slot`` of ``qseg_ring`` (with segments); padded query rows attend nothing."""
  q_seg = None
  if c.has_segments:
    q_seg = lax.broadcast_in_dim(load(qseg_ring.at[slot], 0), (c.bk, c.bq), (1,))
  return tile_allowed(c, i * c.bq + qcol, kpos, q_seg, k_seg) & (i * c.bq + qcol < c.T)


def _fetch_q_tile(c, plgpu, refs, scratch, nrows, b, n, i, slot):
  """The dk/dv kernel's ring fill: starts the copies of query block ``i`` of head ``n`` (Q, dO,
  the ``nrows`` row inputs and, with segments, the query ids) into ring slot ``slot``."""
  q_ref, _, _, do_ref, rows_ref = refs[:5]
  q_smem, do_smem, rows_smem, _, q_bars, do_bars, rows_bars = scratch[2:9]
  qrows = pl.ds(i * c.bq, c.bq)
  plgpu.copy_gmem_to_smem(q_ref.at[b, qrows, n], q_smem.at[slot], q_bars.at[slot])
  plgpu.copy_gmem_to_smem(do_ref.at[b, qrows, n], do_smem.at[slot], do_bars.at[slot])
  for r in range(nrows):
    plgpu.copy_gmem_to_smem(
      rows_ref.at[r, b, n, qrows], rows_smem.at[slot, r], rows_bars.at[slot * nrows + r]
    )
  if c.has_segments:
    _, qseg_smem, _, qseg_bars = _scratch_tail(c, scratch)[1]
    plgpu.copy_gmem_to_smem(refs[5].at[b, qrows], qseg_smem.at[slot], qseg_bars.at[slot])


def _wait_q_tile(plgpu, scratch, nrows, slot):
  """Waits for the Q, dO and row-input copies of the dk/dv kernel's ring slot ``slot`` (not
  the query ids')."""
  q_bars, do_bars, rows_bars = scratch[6:9]
  plgpu.barrier_wait(q_bars.at[slot])
  plgpu.barrier_wait(do_bars.at[slot])
  for r in range(nrows):
    plgpu.barrier_wait(rows_bars.at[slot * nrows + r])


def _zeros(c, plgpu, shape, layout):
  """A float32 accumulator of zeros in the wgmma layout (plain under jax 0.10's interpreter)."""
  zeros = jnp.zeros(shape, jnp.float32)
  return zeros if c.plain else plgpu.layout_cast(zeros, layout)


def _store(plgpu, pairs):
  """Copies each ``(shared memory tile, global memory ref)`` out and waits for the copies."""
  plgpu.commit_smem()
  for smem, ref in pairs:
    plgpu.copy_smem_to_gmem(smem, ref)
  plgpu.wait_smem_to_gmem(0)


def _dq_kernel(c, res_keys, has_g, refs, scratch, rows_only=False):
  """One dq program: query block ``q_blocks`` of head ``heads`` over the key blocks it may
  attend, K/V tiles through a ``c.stages``-deep TMA ring (see the module docstring). With
  ``rows_only`` the same walk writes ``D_i = sum_j w_ij dp_ij`` (float32, the forward's online
  pass with ``dp`` for V) to ``refs[-1]`` ``[B, N, Tp]`` instead (:func:`_row_dot_rule`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  q_ref, k_ref, v_ref, do_ref, rows_ref = refs[:5]
  seg_refs, dq_ref = refs[5:-1], refs[-1]
  (q_smem, do_smem, k_smem, v_smem, rows_smem, q_bar, rows_bars, k_bars, v_bars) = scratch[:9]
  staging, (qseg_smem, kseg_smem, qseg_bar, kseg_bars) = _scratch_tail(c, scratch)
  dq_smem = q_smem  # Q is read by the last wgmma before dq is written: its buffer is reused
  n, b = lax.axis_index("heads"), lax.axis_index("batch")
  i = heaviest_first(c, lax.axis_index("q_blocks"), c.Tp // c.bq)
  h = lax.div(n, jnp.int32(c.G))
  bq, bk, H = c.bq, c.bk, c.H
  q0 = i * bq
  q_last = jnp.minimum(q0 + bq, c.T) - 1
  lo, hi, flo, fhi = kv_bounds(c, q0, q_last)
  nrows = 0 if rows_only else _num_rows(c, res_keys, has_g)

  plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), n], q_smem, q_bar.at[0])
  plgpu.copy_gmem_to_smem(do_ref.at[b, pl.ds(q0, bq), n], do_smem, q_bar.at[1])
  for r in range(nrows):
    plgpu.copy_gmem_to_smem(rows_ref.at[r, b, n, pl.ds(q0, bq)], rows_smem.at[r], rows_bars.at[r])

  def fetch(j):
    slot = lax.rem(j - lo, jnp.int32(c.stages))
    keys = pl.ds(j * bk, bk)
    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bars.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bars.at[slot])
    if c.has_segments:
      plgpu.copy_gmem_to_smem(seg_refs[1].at[b, keys], kseg_smem.at[slot], kseg_bars.at[slot])

  if c.has_segments:
    plgpu.copy_gmem_to_smem(seg_refs[0].at[b, pl.ds(q0, bq)], qseg_smem, qseg_bar.at[0])

  for s in range(c.stages - 1):

    @pl.when(lo + s < hi)
    def _():
      fetch(lo + s)

  iota, any_iota, load, layout = _layout_tools(c, plgpu, (bq, bk))
  qpos = q0 + iota(0)
  kcol = iota(1)
  plgpu.barrier_wait(q_bar.at[0])
  plgpu.barrier_wait(q_bar.at[1])
  rows = []
  for r in range(nrows):
    plgpu.barrier_wait(rows_bars.at[r])
    rows.append(load(rows_smem.at[r], 1))
  row_args = None if rows_only else _row_args(rows, res_keys, has_g, c.nz.reads_row_dot)
  q_seg = None
  if c.has_segments:
    plgpu.barrier_wait(qseg_bar.at[0])
    q_seg = lax.broadcast_in_dim(load(qseg_smem, 1), (bq, bk), (0,))
    q_min, q_max = seg_refs[2][b, i, 0], seg_refs[2][b, i, 1]

  def step(masked, j, dq):
    slot = lax.rem(j - lo, jnp.int32(c.stages))

    @pl.when(j + c.stages - 1 < hi)
    def _():
      fetch(j + c.stages - 1)

    plgpu.barrier_wait(k_bars.at[slot])
    plgpu.barrier_wait(v_bars.at[slot])
    if not c.has_segments:
      return compute(masked, j, slot, dq)
    plgpu.barrier_wait(kseg_bars.at[slot])
    meets = (seg_refs[3][b, j, 1] >= q_min) & (seg_refs[3][b, j, 0] <= q_max)
    return lax.cond(meets, lambda: compute(masked, j, slot, dq), lambda: dq)

  def compute(masked, j, slot, dq):
    mask = lambda: _dq_mask(c, load, qpos, kcol, q_seg, kseg_smem, slot, j) if masked else None
    if rows_only:  # dq is the online state here
      return _tile_rule(
        c,
        plgpu,
        q_smem,
        k_smem.at[slot],
        do_smem,
        v_smem.at[slot],
        mask,
        (dq,),
        _row_dot_rule(c, j, any_iota),
      )[2]
    s, _, dz = _tile_rule(
      c,
      plgpu,
      q_smem,
      k_smem.at[slot],
      do_smem,
      v_smem.at[slot],
      mask,
      row_args,
      _lowered_rule(c, c.nz.tile_backward, bq, iota=any_iota),
    )
    ds = _ds(c, dz, s, q_smem.dtype)
    return _mm(c, plgpu, (bq, H), ds, k_smem.at[slot], staging=staging, acc=dq)

  dq = _row_state(c, plgpu, layout) if rows_only else _zeros(c, plgpu, (bq, H), layout)
  dq = lax.fori_loop(lo, flo, lambda j, a: step(True, j, a), dq)
  dq = lax.fori_loop(flo, fhi, lambda j, a: step(False, j, a), dq)
  dq = lax.fori_loop(fhi, hi, lambda j, a: step(True, j, a), dq)
  if rows_only:  # D_i, through the first row buffer
    rows_smem.at[0][...] = lower_rows(lambda st: c.nz.finish(st, {}, False)[0], bq)(dq)
    return _store(plgpu, [(rows_smem.at[0], dq_ref.at[b, n, pl.ds(q0, bq)])])
  dq_smem[...] = (dq * c.opts.scale).astype(dq_smem.dtype)
  _store(plgpu, [(dq_smem, dq_ref.at[b, pl.ds(q0, bq), n])])


def _row_state(c, plgpu, layout):
  """The rows-only dq walk's initial online state (``[bq]`` rows in the row layout)."""
  st = c.nz.init((c.bq, 1), (c.bq, 1), False)
  cast = (lambda x: x) if c.plain else (lambda x: plgpu.layout_cast(x, layout.reduce(1)))
  return {key: cast(jnp.reshape(x, (c.bq,))) for key, x in st.items()}


def _row_dot_rule(c, j, iota):
  """The rows-only dq walk's tile rule (see _lowered_rule): ``(raw, allowed, dp, st) ->
  (None, st')``, the normaliser's online visit with ``dp`` for V (``D_i``'s terms
  ``w_ij dp_ij`` in float32)."""

  def visit(z, allowed, dp, st):
    pv = lambda w: jnp.sum(w * dp, axis=-1, keepdims=True)
    return None, c.nz.visit(st, z, allowed, pv, {}, False, j == 0)

  return _lowered_rule(c, visit, c.bq, iota=iota)


def _dkdv_kernel(c, res_keys, has_g, refs, scratch):
  """One dk/dv program: key block ``k_blocks`` of K/V head ``heads`` over the query blocks of
  its group's ``G`` query heads that may attend it, Q/dO tiles through a ``c.stages``-deep TMA
  ring (see the module docstring)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  k_ref, v_ref = refs[1:3]
  seg_refs, (dk_ref, dv_ref) = refs[5:-2], refs[-2:]
  k_smem, v_smem, q_smem, do_smem, rows_smem, k_bar = scratch[:6]
  staging, (kseg_smem, qseg_smem, kseg_bar, qseg_bars) = _scratch_tail(c, scratch)
  dk_smem, dv_smem = k_smem, v_smem  # K and V are done with when dk and dv are written
  h, j, b = lax.axis_index("heads"), lax.axis_index("k_blocks"), lax.axis_index("batch")
  bq, bk, H = c.bq, c.bk, c.H
  k0 = j * bk
  lo, hi, flo, fhi = q_block_bounds(c, k0, jnp.minimum(k0 + bk, c.S) - 1, c.Tp // bq)
  per_head = hi - lo
  total = per_head * c.G  # steps: (query head of the group, query block)
  nrows = _num_rows(c, res_keys, has_g)

  plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), h], k_smem, k_bar.at[0])
  plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), h], v_smem, k_bar.at[1])

  def where(t):
    gi = lax.div(t, jnp.maximum(per_head, 1))
    return h * c.G + gi, lo + t - gi * per_head  # query head, query block

  def fetch(t):
    slot = lax.rem(t, jnp.int32(c.stages))
    n, i = where(t)
    _fetch_q_tile(c, plgpu, refs, scratch, nrows, b, n, i, slot)

  if c.has_segments:
    plgpu.copy_gmem_to_smem(seg_refs[1].at[b, pl.ds(k0, bk)], kseg_smem, kseg_bar.at[0])

  for s in range(c.stages - 1):

    @pl.when(s < total)
    def _():
      fetch(jnp.int32(s))

  iota, _, load, layout = _layout_tools(c, plgpu, (bk, bq))
  kpos = k0 + iota(0)  # tiles are [keys, queries]
  qcol = iota(1)
  plgpu.barrier_wait(k_bar.at[0])
  plgpu.barrier_wait(k_bar.at[1])
  k_seg = None
  if c.has_segments:
    plgpu.barrier_wait(kseg_bar.at[0])
    k_seg = lax.broadcast_in_dim(load(kseg_smem, 1), (bk, bq), (0,))
    k_min, k_max = seg_refs[3][b, j, 0], seg_refs[3][b, j, 1]

  def compute(masked, t, slot, carry):
    dk, dv = carry
    _, i = where(t)
    rows = [load(rows_smem.at[slot, r], 0) for r in range(nrows)]
    mask = lambda: _dkdv_mask(c, load, i, qcol, kpos, qseg_smem, slot, k_seg) if masked else None
    s, w, dz = _tile_rule(
      c,
      plgpu,
      k_smem,
      q_smem.at[slot],
      v_smem,
      do_smem.at[slot],
      mask,
      _row_args(rows, res_keys, has_g, c.nz.reads_row_dot),
      _lowered_rule(c, c.nz.tile_backward, bq, transposed=True),
    )
    dv = _mm(c, plgpu, (bk, H), w.astype(do_smem.dtype), do_smem.at[slot], staging=staging, acc=dv)
    ds = _ds(c, dz, s, q_smem.dtype)
    dk = _mm(c, plgpu, (bk, H), ds, q_smem.at[slot], staging=staging, acc=dk)
    return dk, dv

  def step(t, carry):
    slot = lax.rem(t, jnp.int32(c.stages))

    @pl.when(t + c.stages - 1 < total)
    def _():
      fetch(t + c.stages - 1)

    _wait_q_tile(plgpu, scratch, nrows, slot)
    _, i = where(t)
    if c.has_segments:  # every block masked; one whose segments cannot meet is skipped
      plgpu.barrier_wait(qseg_bars.at[slot])
      meets = (seg_refs[2][b, i, 1] >= k_min) & (seg_refs[2][b, i, 0] <= k_max)
      return lax.cond(meets, lambda: compute(True, t, slot, carry), lambda: carry)
    full = (i >= flo) & (i < fhi)
    return lax.cond(
      full, lambda: compute(False, t, slot, carry), lambda: compute(True, t, slot, carry)
    )

  zeros = _zeros(c, plgpu, (bk, H), layout)
  dk, dv = lax.fori_loop(0, total, step, (zeros, zeros))
  dk_smem[...] = (dk * c.opts.scale).astype(dk_smem.dtype)
  dv_smem[...] = dv.astype(dv_smem.dtype)
  _store(
    plgpu, [(dk_smem, dk_ref.at[b, pl.ds(k0, bk), h]), (dv_smem, dv_ref.at[b, pl.ds(k0, bk), h])]
  )


def _rows_in(c, d_out, out, res, d_lse, has_key, row_dot=None):
  """``(row_dot, g, res_keys, rows)``: the backward's row inputs ``[B, N, Tp]`` float32
  (``row_dot`` None where the normaliser does not read it, ``g`` None without a logsumexp
  cotangent) and their stack ``rows`` ``[nrows, B, N, Tp]`` in the kernels' order; a given
  ``row_dot`` (from the tiles, :func:`_tile_row_dot`) is taken as it is."""
  if row_dot is None and c.nz.reads_row_dot:  # D_i = <dO_i, O_i>: a pass the others skip
    row_dot = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    row_dot = jnp.pad(jnp.transpose(row_dot, (0, 2, 1)), ((0, 0), (0, 0), (0, c.Tp - c.T)))
  g = None
  if d_lse is not None:
    g = jnp.pad(d_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, c.Tp - c.T)))
    g = jnp.where(has_key > 0, g, 0.0)
  res_keys = tuple(sorted(res))
  row_list = (
    ([row_dot] if row_dot is not None else [])
    + ([g] if g is not None else [])
    + [res[key] for key in res_keys]
  )
  # the kernels load _num_rows(...) rows; with none (normalizer="none", no statistics) one
  # zero row stands in for the operand and is never read
  rows = jnp.stack(row_list) if row_list else jnp.zeros((1, c.B, c.N, c.Tp), jnp.float32)
  return row_dot, g, res_keys, rows


def _dq_scratch(c, dtype, tr, nrows: int) -> list:
  """The dq kernel's scratch: Q, dO, the K/V rings, ``nrows`` row buffers, their barriers
  (then the interpret-mode staging tile and the segment-id buffers, see _scratch_tail)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  scratch = [
    plgpu.SMEM((c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((nrows, c.bq), jnp.float32),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=nrows),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages),
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((c.bq, c.bk), dtype, transforms=tr))
  if c.has_segments:
    scratch += [
      plgpu.SMEM((c.bq,), jnp.int32),
      plgpu.SMEM((c.stages, c.bk), jnp.int32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=c.stages),
    ]
  return scratch


def _tile_row_dot(c, arrays, seg_args, scratch, run_params):
  """``D_i = sum_j w_ij dp_ij`` ``[B, N, Tp]`` in float32 from the recomputed tiles (the dq
  kernel's walk, rows only), where :meth:`~Normalizer.row_dot_from_tiles` finds
  ``<dO_i, O_i>`` too coarse (softpick in bfloat16 / float16): one more launch, two tile
  products per dq tile."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if c.has_sink or c.nz.needs_counts:
    raise NotImplementedError(
      f"mosaic_gpu: normalizer {c.nz.name!r} sums D_i from the tiles, which here takes no "
      "sink_logits and no allowed-key counts"
    )
  nseg = len(seg_args)
  dummy = jnp.zeros((1, c.B, c.N, c.Tp), jnp.float32)  # the row operand, never loaded
  interpret, params = run_params
  return plgpu.kernel(
    lambda *a: _dq_kernel(c, (), False, a[: 6 + nseg], a[6 + nseg :], rows_only=True),
    out_type=jax.ShapeDtypeStruct((c.B, c.N, c.Tp), jnp.float32),
    scratch_types=scratch,
    grid=(c.N, c.Tp // c.bq, c.B),
    grid_names=("heads", "q_blocks", "batch"),
    interpret=interpret,
    compiler_params=params,
    kernel_name="attnjax_row_dot",
  )(*arrays, dummy, *seg_args)


def backward(
  c, q, k, v, sink, out, res, d_out, d_lse, has_key, q_seg=None, kv_seg=None, specialised=None
):
  """Cotangents ``(dq, dk, dv, dsink)`` of the kernel's core.

  ``out`` ``[B, T, N, H]``; ``res`` the forward's residual rows ``{name: [B, N, Tp]}``;
  ``d_out`` ``[B, T, N, H]``; ``d_lse`` the logsumexp statistic's cotangent ``[B, N, T]``
  or None; ``has_key`` ``[B, N, Tp]`` (rows with an allowed key; with ``d_lse``);
  ``specialised``: the warp-specialised kernels' entry (:func:`.specialised.run`, which
  returns None where their tiles do not fit), else the one-warpgroup kernels run.
  """
  import jax.experimental.pallas.mosaic_gpu as plgpu

  nz = c.nz
  dtype = q.dtype
  seg_args = segment_args(c, q_seg, kv_seg)
  nseg = len(seg_args)

  # [B, T, N, H] read in place by the kernels' TMA copies (no transposes)
  qh, kh, vh = padded(q, c.Tp), padded(k, c.Sp), padded(v, c.Sp)
  doh = padded(d_out.astype(dtype), c.Tp)
  swizzle = 128
  tr = (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
  interpret = interpret_params(c.interpret)
  params = plgpu.CompilerParams(approx_math=c.approx_math)
  row_dot = None
  if nz.row_dot_from_tiles(dtype):
    row_dot = _tile_row_dot(
      c, (qh, kh, vh, doh), seg_args, _dq_scratch(c, dtype, tr, 1), (interpret, params)
    )
  row_dot, g, res_keys, rows = _rows_in(c, d_out, out, res, d_lse, has_key, row_dot)

  dsink = None
  if c.has_sink:
    floor = jnp.reshape(sink.astype(jnp.float32), (1, c.N, 1, 1))
    rs = {key: res[key][..., None] for key in res_keys}
    term = nz.null_grad(floor, rs, row_dot[..., None], None if g is None else g[..., None])
    dsink = jnp.reshape(jnp.sum(term[:, :, : c.T, 0], axis=(0, 2)), sink.shape).astype(sink.dtype)

  has_g = g is not None
  nrows = max(1, _num_rows(c, res_keys, has_g))  # buffers and barriers: at least one
  if specialised is not None:  # a producer and two compute warpgroups per program
    grads = specialised(c, (qh, kh, vh, doh, rows), res_keys, has_g, nrows, tr, q_seg, kv_seg)
    if grads is not None:
      return grads + (dsink,)
  dq_scratch = _dq_scratch(c, dtype, tr, nrows)
  dq = plgpu.kernel(
    lambda *a: _dq_kernel(c, res_keys, has_g, a[: 6 + nseg], a[6 + nseg :]),
    out_type=jax.ShapeDtypeStruct((c.B, c.Tp, c.N, c.H), dtype),
    scratch_types=dq_scratch,
    grid=(c.N, c.Tp // c.bq, c.B),
    grid_names=("heads", "q_blocks", "batch"),
    interpret=interpret,
    compiler_params=params,
    kernel_name="attnjax_dq",
  )(qh, kh, vh, doh, rows, *seg_args)

  ckv = dkdv_plan(c)
  kv_seg_args = segment_args(ckv, q_seg, kv_seg)
  kv_scratch = [
    plgpu.SMEM((ckv.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((ckv.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, nrows, c.bq), jnp.float32),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages * nrows),
  ]
  if c.interpret:
    kv_scratch.append(plgpu.SMEM((ckv.bk, c.bq), dtype, transforms=tr))
  if c.has_segments:
    kv_scratch += [
      plgpu.SMEM((ckv.bk,), jnp.int32),
      plgpu.SMEM((c.stages, c.bq), jnp.int32),
      plgpu.Barrier(num_barriers=1),
      plgpu.Barrier(num_barriers=c.stages),
    ]
  kv_out = jax.ShapeDtypeStruct((c.B, c.Sp, c.K, c.H), dtype)
  dk, dv = plgpu.kernel(
    lambda *a: _dkdv_kernel(ckv, res_keys, has_g, a[: 7 + nseg], a[7 + nseg :]),
    out_type=[kv_out, kv_out],
    scratch_types=kv_scratch,
    grid=(c.K, c.Sp // ckv.bk, c.B),
    grid_names=("heads", "k_blocks", "batch"),
    interpret=interpret,
    compiler_params=params,
    kernel_name="attnjax_dkdv",
  )(qh, kh, vh, doh, rows, *kv_seg_args)

  return dq[:, : c.T], dk[:, : c.S], dv[:, : c.S], dsink
