"""The warp-specialised backward kernels of :mod:`attnjax.kernels.mosaic_gpu` (head dims 64 and
128): per program a producer warpgroup fills one TMA ring that two compute warpgroups share.

dq: a program takes two query blocks of one head; the producer streams the K/V tiles any of
their rows attends, each compute warpgroup computes its own block's (V released once ``dP`` is
read, K once ``dS K`` is). dk/dv: a program takes two blocks of ``DKDV_BLOCK_K`` keys; the
producer streams the Q / dO tiles (and row inputs) of the group's query heads that attend
either. Tiles outside a warpgroup's reach are waited for and released, so the ring's barriers
stay in phase. :func:`fits` says when a call's tiles fit shared memory (else the one-warpgroup
kernels of ``backward.py`` run). Guide: docs/guides/kernels.md, "Pallas Mosaic GPU for Hopper".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl

from attnjax._src.kernels.mosaic_gpu import backward
from attnjax._src.kernels.mosaic_gpu.plan import (
  CONSUMERS,
  DKDV_BLOCK_K,
  SMEM_LIMIT_BYTES,
  dkdv_plan,
  heaviest_first,
  interpret_params,
  kv_bounds,
  lower_rows,
  segment_args,
)

# setmaxnreg after the split: the producer only addresses (as the forward's).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40
# Keys per dq tile: [64, 64] float32 S and dP tiles (32 registers each per thread) beside the
# [64, H] dq accumulator, within the compute warpgroups' 232 registers.
DQ_BLOCK_K = 64


def dq_plan(c):
  """The warp-specialised dq kernel's plan: ``DQ_BLOCK_K`` keys per tile."""
  return dataclasses.replace(c, bk=min(c.bk, DQ_BLOCK_K))


def smem_bytes(c, kernel: str, nrows: int) -> int:
  """Shared memory of a warp-specialised kernel's tiles (plan ``c``, 2-byte inputs)."""
  W, H, st = CONSUMERS, c.H, c.stages
  if kernel == "dq":
    return 2 * (W * 2 * c.bq * H + st * 2 * DQ_BLOCK_K * H) + 4 * W * nrows * c.bq
  return 2 * (W * 2 * DKDV_BLOCK_K * H + st * 2 * c.bq * H) + 4 * st * nrows * c.bq


def fits(c, nrows: int) -> bool:
  """Whether both kernels' tiles fit (head dims 64, 128: yes; 256: no) and the padded key
  length holds whole dk/dv programs (``CONSUMERS * DKDV_BLOCK_K`` keys)."""
  margin = 8 * 1024  # barriers, alignment
  return (
    max(smem_bytes(c, "dq", nrows), smem_bytes(c, "dkdv", nrows)) + margin <= SMEM_LIMIT_BYTES
    and c.Sp % (CONSUMERS * DKDV_BLOCK_K) == 0
  )


def _clip(lo, hi, flo, fhi, lo_u, hi_u):
  lo = jnp.clip(lo, lo_u, hi_u)
  hi = jnp.clip(hi, lo, hi_u)
  flo = jnp.clip(flo, lo, hi)
  return lo, hi, flo, jnp.clip(fhi, flo, hi)


def dq_scratch(c, dtype, tr, nrows: int) -> list:
  import jax.experimental.pallas.mosaic_gpu as plgpu

  W = CONSUMERS
  scratch = [
    plgpu.SMEM((W, c.bq, c.H), dtype, transforms=tr),  # Q, then dq
    plgpu.SMEM((W, c.bq, c.H), dtype, transforms=tr),  # dO
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((W, nrows, c.bq), jnp.float32),
    plgpu.Barrier(num_barriers=2 * W),
    plgpu.Barrier(num_barriers=W * nrows),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a K tile done with by both
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a V tile done with by both
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((W, c.bq, c.bk), dtype, transforms=tr))
  if c.has_segments:
    scratch += [
      plgpu.SMEM((W, c.bq), jnp.int32),
      plgpu.SMEM((c.stages, c.bk), jnp.int32),
      plgpu.Barrier(num_barriers=W),
      plgpu.Barrier(num_barriers=c.stages),
    ]
  return scratch


def dq_kernel(c, res_keys, has_g, refs, scratch):
  """One dq program (see the module docstring); ``c`` the :func:`dq_plan`."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  q_ref, k_ref, v_ref, do_ref, rows_ref = refs[:5]
  seg_refs, dq_ref = refs[5:-1], refs[-1]
  (q_smem, do_smem, k_smem, v_smem, rows_smem, q_bars, rows_bars, k_bars, v_bars) = scratch[:9]
  k_done, v_done = scratch[9:11]
  extra = list(scratch[11:])
  staging = extra.pop(0) if c.interpret else None
  qseg_smem, kseg_smem, qseg_bars, kseg_bars = extra if c.has_segments else (None,) * 4
  W, bq, bk = CONSUMERS, c.bq, c.bk
  wg, n, b = lax.axis_index("wg"), lax.axis_index("heads"), lax.axis_index("batch")
  pair = heaviest_first(c, lax.axis_index("q_blocks"), c.Tp // (W * bq))
  h = lax.div(n, jnp.int32(c.G))
  q0_u = pair * (W * bq)
  lo_u, hi_u, _, _ = kv_bounds(c, q0_u, jnp.minimum(q0_u + W * bq, c.T) - 1)
  slot_of = lambda j: lax.rem(j - lo_u, jnp.int32(c.stages))
  nrows = backward._num_rows(c, res_keys, has_g)

  @pl.when(wg == W)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def fill(j, carry):
      slot, keys = slot_of(j), pl.ds(j * bk, bk)
      refill = j - lo_u >= c.stages

      @pl.when(refill)  # the slot's previous K tile done with by both
      def _():
        plgpu.barrier_wait(k_done.at[slot])

      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], k_bars.at[slot])
      if c.has_segments:
        plgpu.copy_gmem_to_smem(seg_refs[1].at[b, keys], kseg_smem.at[slot], kseg_bars.at[slot])

      @pl.when(refill)
      def _():
        plgpu.barrier_wait(v_done.at[slot])

      plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], v_bars.at[slot])
      return carry

    lax.fori_loop(lo_u, hi_u, fill, None)
    for s in range(c.stages):  # the last tiles' releases (every phase is waited on)
      j = hi_u - c.stages + s

      @pl.when(j >= lo_u)
      def _():
        plgpu.barrier_wait(k_done.at[slot_of(j)])
        plgpu.barrier_wait(v_done.at[slot_of(j)])

  @pl.when(wg < W)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    qb = pair * W + wg
    q0 = qb * bq
    bounds = kv_bounds(c, q0, jnp.minimum(q0 + bq, c.T) - 1)
    lo, hi, flo, fhi = _clip(*bounds, lo_u, hi_u)
    my_q, my_do, my_rows = q_smem.at[wg], do_smem.at[wg], rows_smem.at[wg]
    qrows = pl.ds(q0, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, qrows, n], my_q, q_bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(do_ref.at[b, qrows, n], my_do, q_bars.at[2 * wg + 1])
    for r in range(nrows):
      plgpu.copy_gmem_to_smem(
        rows_ref.at[r, b, n, qrows], my_rows.at[r], rows_bars.at[wg * nrows + r]
      )
    if c.has_segments:
      plgpu.copy_gmem_to_smem(seg_refs[0].at[b, qrows], qseg_smem.at[wg], qseg_bars.at[wg])
    iota, any_iota, load, layout = backward._layout_tools(c, plgpu, (bq, bk))
    qpos, kcol = q0 + iota(0), iota(1)
    plgpu.barrier_wait(q_bars.at[2 * wg])
    plgpu.barrier_wait(q_bars.at[2 * wg + 1])
    rows = []
    for r in range(nrows):
      plgpu.barrier_wait(rows_bars.at[wg * nrows + r])
      rows.append(load(my_rows.at[r], 1))
    row_args = backward._row_args(rows, res_keys, has_g, c.nz.reads_row_dot)
    q_seg = None
    if c.has_segments:
      plgpu.barrier_wait(qseg_bars.at[wg])
      q_seg = lax.broadcast_in_dim(load(qseg_smem.at[wg], 1), (bq, bk), (0,))
      q_min, q_max = seg_refs[2][b, qb, 0], seg_refs[2][b, qb, 1]
    rule = lower_rows(c.nz.tile_backward, bq, iota=any_iota)
    my_staging = None if staging is None else staging.at[wg]

    def wait(slot):
      plgpu.barrier_wait(k_bars.at[slot])
      if c.has_segments:
        plgpu.barrier_wait(kseg_bars.at[slot])
      plgpu.barrier_wait(v_bars.at[slot])

    def release(slot, which):
      plgpu.barrier_arrive((k_done, v_done)[which].at[slot])

    def pass_over(j, dq):
      slot = slot_of(j)
      wait(slot)
      release(slot, 1)
      release(slot, 0)
      return dq

    def compute(masked, j, slot, dq):
      mask = lambda: (
        backward._dq_mask(c, load, qpos, kcol, q_seg, kseg_smem, slot, j) if masked else None
      )
      s, _, dz = backward._tile_rule(
        c, plgpu, my_q, k_smem.at[slot], my_do, v_smem.at[slot], mask, row_args, rule
      )
      release(slot, 1)  # dP is read: V is done with
      ds = backward._ds(c, dz, s, my_q.dtype)
      return backward._mm(c, plgpu, (bq, c.H), ds, k_smem.at[slot], staging=my_staging, acc=dq)

    def step(masked, j, dq):
      slot = slot_of(j)
      wait(slot)
      if c.has_segments:  # a block whose segments cannot meet is skipped
        meets = (seg_refs[3][b, j, 1] >= q_min) & (seg_refs[3][b, j, 0] <= q_max)

        def skip():
          release(slot, 1)
          return dq

        dq = lax.cond(meets, lambda: compute(masked, j, slot, dq), skip)
      else:
        dq = compute(masked, j, slot, dq)
      release(slot, 0)  # dS K is read: K is done with
      return dq

    dq = backward._zeros(c, plgpu, (bq, c.H), layout)
    dq = lax.fori_loop(lo_u, lo, pass_over, dq)
    dq = lax.fori_loop(lo, flo, lambda j, a: step(True, j, a), dq)
    dq = lax.fori_loop(flo, fhi, lambda j, a: step(False, j, a), dq)
    dq = lax.fori_loop(fhi, hi, lambda j, a: step(True, j, a), dq)
    dq = lax.fori_loop(hi, hi_u, pass_over, dq)
    my_q[...] = (dq * c.opts.scale).astype(my_q.dtype)
    backward._store(plgpu, [(my_q, dq_ref.at[b, pl.ds(q0, bq), n])])


def dkdv_scratch(c, dtype, tr, nrows: int) -> list:
  import jax.experimental.pallas.mosaic_gpu as plgpu

  W = CONSUMERS
  scratch = [
    plgpu.SMEM((W, c.bk, c.H), dtype, transforms=tr),  # K, then dk
    plgpu.SMEM((W, c.bk, c.H), dtype, transforms=tr),  # V, then dv
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, nrows, c.bq), jnp.float32),
    plgpu.Barrier(num_barriers=2 * W),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages * nrows),
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a query tile done with by both
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((W, c.bk, c.bq), dtype, transforms=tr))
  if c.has_segments:
    scratch += [
      plgpu.SMEM((W, c.bk), jnp.int32),
      plgpu.SMEM((c.stages, c.bq), jnp.int32),
      plgpu.Barrier(num_barriers=W),
      plgpu.Barrier(num_barriers=c.stages),
    ]
  return scratch


def dkdv_kernel(c, res_keys, has_g, refs, scratch):
  """One dk/dv program (see the module docstring); ``c`` the ``dkdv_plan`` (64 keys a
  warpgroup)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  q_ref, k_ref, v_ref, do_ref, rows_ref = refs[:5]
  seg_refs, (dk_ref, dv_ref) = refs[5:-2], refs[-2:]
  (k_smem, v_smem, q_smem, do_smem, rows_smem, kv_bars, q_bars, do_bars, rows_bars) = scratch[:9]
  done = scratch[9]
  extra = list(scratch[10:])
  staging = extra.pop(0) if c.interpret else None
  kseg_smem, qseg_smem, kseg_bars, qseg_bars = extra if c.has_segments else (None,) * 4
  W, bq, bk = CONSUMERS, c.bq, c.bk
  wg, h, b = lax.axis_index("wg"), lax.axis_index("heads"), lax.axis_index("batch")
  pair = lax.axis_index("k_blocks")
  k0_u = pair * (W * bk)
  lo_u, hi_u, _, _ = backward.q_block_bounds(
    c, k0_u, jnp.minimum(k0_u + W * bk, c.S) - 1, c.Tp // bq
  )
  per_head = hi_u - lo_u
  total = per_head * c.G  # steps: (query head of the group, query block)
  nrows = backward._num_rows(c, res_keys, has_g)
  slot_of = lambda t: lax.rem(t, jnp.int32(c.stages))

  @pl.when(wg == W)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def fill(t, carry):
      slot = slot_of(t)
      g = lax.div(t, jnp.maximum(per_head, 1))
      n, i = h * c.G + g, lo_u + t - g * per_head
      qrows = pl.ds(i * bq, bq)

      @pl.when(t >= c.stages)  # the slot's previous query tile done with by both
      def _():
        plgpu.barrier_wait(done.at[slot])

      plgpu.copy_gmem_to_smem(q_ref.at[b, qrows, n], q_smem.at[slot], q_bars.at[slot])
      plgpu.copy_gmem_to_smem(do_ref.at[b, qrows, n], do_smem.at[slot], do_bars.at[slot])
      for r in range(nrows):
        plgpu.copy_gmem_to_smem(
          rows_ref.at[r, b, n, qrows], rows_smem.at[slot, r], rows_bars.at[slot * nrows + r]
        )
      if c.has_segments:
        plgpu.copy_gmem_to_smem(seg_refs[0].at[b, qrows], qseg_smem.at[slot], qseg_bars.at[slot])
      return carry

    lax.fori_loop(0, total, fill, None)
    for s in range(c.stages):
      t = total - c.stages + s

      @pl.when(t >= 0)
      def _():
        plgpu.barrier_wait(done.at[slot_of(t)])

  @pl.when(wg < W)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    kb = pair * W + wg
    k0 = kb * bk
    bounds = backward.q_block_bounds(c, k0, jnp.minimum(k0 + bk, c.S) - 1, c.Tp // bq)
    lo, hi, flo, fhi = _clip(*bounds, lo_u, hi_u)
    my_k, my_v = k_smem.at[wg], v_smem.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), h], my_k, kv_bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), h], my_v, kv_bars.at[2 * wg + 1])
    if c.has_segments:
      plgpu.copy_gmem_to_smem(seg_refs[1].at[b, pl.ds(k0, bk)], kseg_smem.at[wg], kseg_bars.at[wg])
    iota, _, load, layout = backward._layout_tools(c, plgpu, (bk, bq))
    kpos, qcol = k0 + iota(0), iota(1)  # tiles are [keys, queries]
    plgpu.barrier_wait(kv_bars.at[2 * wg])
    plgpu.barrier_wait(kv_bars.at[2 * wg + 1])
    k_seg = None
    if c.has_segments:
      plgpu.barrier_wait(kseg_bars.at[wg])
      k_seg = lax.broadcast_in_dim(load(kseg_smem.at[wg], 1), (bk, bq), (0,))
      k_min, k_max = seg_refs[3][b, kb, 0], seg_refs[3][b, kb, 1]
    rule = lower_rows(c.nz.tile_backward, bq, transposed=True)
    my_staging = None if staging is None else staging.at[wg]

    def wait(slot):
      plgpu.barrier_wait(q_bars.at[slot])
      plgpu.barrier_wait(do_bars.at[slot])
      for r in range(nrows):
        plgpu.barrier_wait(rows_bars.at[slot * nrows + r])
      if c.has_segments:
        plgpu.barrier_wait(qseg_bars.at[slot])

    def compute(masked, i, slot, carry):
      dk, dv = carry
      rows = [load(rows_smem.at[slot, r], 0) for r in range(nrows)]
      mask = lambda: (
        backward._dkdv_mask(c, load, i, qcol, kpos, qseg_smem, slot, k_seg) if masked else None
      )
      s, w, dz = backward._tile_rule(
        c,
        plgpu,
        my_k,
        q_smem.at[slot],
        my_v,
        do_smem.at[slot],
        mask,
        backward._row_args(rows, res_keys, has_g, c.nz.reads_row_dot),
        rule,
      )
      do_tile = do_smem.at[slot]
      dv = backward._mm(
        c, plgpu, (bk, c.H), w.astype(do_tile.dtype), do_tile, staging=my_staging, acc=dv
      )
      ds = backward._ds(c, dz, s, my_k.dtype)
      dk = backward._mm(c, plgpu, (bk, c.H), ds, q_smem.at[slot], staging=my_staging, acc=dk)
      return dk, dv

    def head(g, carry):
      base = g * per_head - lo_u  # step t of query block i: base + i

      def pass_over(i, carry):
        slot = slot_of(base + i)
        wait(slot)
        plgpu.barrier_arrive(done.at[slot])
        return carry

      def step(masked, i, carry):
        slot = slot_of(base + i)
        wait(slot)
        if c.has_segments:  # every block masked; one whose segments cannot meet is skipped
          meets = (seg_refs[2][b, i, 1] >= k_min) & (seg_refs[2][b, i, 0] <= k_max)
          carry = lax.cond(meets, lambda: compute(True, i, slot, carry), lambda: carry)
        else:
          carry = compute(masked, i, slot, carry)
        plgpu.barrier_arrive(done.at[slot])
        return carry

      carry = lax.fori_loop(lo_u, lo, pass_over, carry)
      carry = lax.fori_loop(lo, flo, lambda i, a: step(True, i, a), carry)
      carry = lax.fori_loop(flo, fhi, lambda i, a: step(False, i, a), carry)
      carry = lax.fori_loop(fhi, hi, lambda i, a: step(True, i, a), carry)
      return lax.fori_loop(hi, hi_u, pass_over, carry)

    zeros = backward._zeros(c, plgpu, (bk, c.H), layout)
    dk, dv = lax.fori_loop(0, c.G, head, (zeros, zeros))
    my_k[...] = (dk * c.opts.scale).astype(my_k.dtype)
    my_v[...] = dv.astype(my_v.dtype)
    backward._store(
      plgpu, [(my_k, dk_ref.at[b, pl.ds(k0, bk), h]), (my_v, dv_ref.at[b, pl.ds(k0, bk), h])]
    )


def run(c, arrays, res_keys, has_g, nrows, tr, q_seg, kv_seg):
  """``(dq, dk, dv)`` by the warp-specialised kernels, or None where their tiles do not fit
  (:func:`fits`): the row terms and arrays as ``backward.backward`` prepares them."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if not fits(c, nrows):
    return None
  dtype = arrays[0].dtype
  W = CONSUMERS
  # No automatic warpgroup barriers: no buffer is read by a compute warpgroup's threads and
  # refilled by that warpgroup (the producer refills the rings after every thread's mbarrier
  # arrival, each a release of its reads), and their results are written where only wgmmas
  # (waited for) and TMA read, then commit_smem fences and syncs before the TMA store.
  params = plgpu.CompilerParams(
    approx_math=c.approx_math, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0
  )
  common = dict(
    num_threads=W + 1,
    thread_name="wg",
    interpret=interpret_params(c.interpret),
    compiler_params=params,
  )
  cq = dq_plan(c)
  seg = segment_args(cq, q_seg, kv_seg)
  nin = 5 + len(seg)
  dq = plgpu.kernel(
    lambda *a: dq_kernel(cq, res_keys, has_g, a[: nin + 1], a[nin + 1 :]),
    out_type=jax.ShapeDtypeStruct((c.B, c.Tp, c.N, c.H), dtype),
    scratch_types=dq_scratch(cq, dtype, tr, nrows),
    grid=(c.N, c.Tp // (W * c.bq), c.B),
    grid_names=("heads", "q_blocks", "batch"),
    kernel_name="attnjax_dq",
    **common,
  )(*arrays, *seg)
  ckv = dkdv_plan(c)
  seg = segment_args(ckv, q_seg, kv_seg)
  kv_out = jax.ShapeDtypeStruct((c.B, c.Sp, c.K, c.H), dtype)
  dk, dv = plgpu.kernel(
    lambda *a: dkdv_kernel(ckv, res_keys, has_g, a[: nin + 2], a[nin + 2 :]),
    out_type=[kv_out, kv_out],
    scratch_types=dkdv_scratch(ckv, dtype, tr, nrows),
    grid=(c.K, c.Sp // (W * ckv.bk), c.B),
    grid_names=("heads", "k_blocks", "batch"),
    kernel_name="attnjax_dkdv",
    **common,
  )(*arrays, *seg)
  return dq[:, : c.T], dk[:, : c.S], dv[:, : c.S]
