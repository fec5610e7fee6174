"""The warp-specialised backward kernels of :mod:`attnjax.kernels.mosaic_gpu` (head dims 64 and
128): per program a producer warpgroup fills one TMA ring that two compute warpgroups share.

dq: a program takes two query blocks of one head; the producer streams the K/V tiles any of
their rows attends, each compute warpgroup computes its own block's (V released once ``dP`` is
read, K once ``dS K`` is). dk/dv: a program takes two blocks of ``DKDV_BLOCK_K`` keys; the
producer streams the Q / dO tiles (and row inputs) of the group's query heads that attend
either. Tiles outside a warpgroup's reach are waited for and released, so the ring's barriers
stay in phase; each compute warpgroup's code is traced for its own static index, so its
tiles' addresses (and wgmma descriptors) are constants. :func:`fits` says when a call's tiles
fit shared memory (else the one-warpgroup kernels of ``backward.py`` run). Guide:
docs/guides/kernels.md, "Pallas Mosaic GPU for Hopper".
"""

from __future__ import annotations

import dataclasses
import functools

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
  padded,
  segment_args,
)

# setmaxnreg after the split (FlashAttention-3's backward split: 2 x 128 x 240 + 128 x 24 <= 64K
# registers per SM): the producer only addresses, and the dk/dv compute warpgroups hold two
# [64, H] float32 accumulators (128 registers at H = 128) beside the [64, 64] S and dP tiles
# (64): at 232 / 40 ptxas spilled 12 B a step in a deviceless H200 compile, at 240 / 24 none.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 240, 24
# Keys per dq tile: [64, 64] float32 S and dP tiles (32 registers each per thread) beside the
# [64, H] dq accumulator, within the compute warpgroups' registers.
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
  """Whether both kernels' tiles fit shared memory (head dims 64, 128: yes; 256: no)."""
  margin = 8 * 1024  # barriers, alignment
  return max(smem_bytes(c, "dq", nrows), smem_bytes(c, "dkdv", nrows)) + margin <= SMEM_LIMIT_BYTES


def _clip(lo, hi, flo, fhi, lo_u, hi_u):
  lo = jnp.clip(lo, lo_u, hi_u)
  hi = jnp.clip(hi, lo, hi_u)
  flo = jnp.clip(flo, lo, hi)
  return lo, hi, flo, jnp.clip(fhi, flo, hi)


def dq_scratch(c, dtype, tr, nrows: int, loaded: int) -> list:
  """The dq kernel's scratch: ``nrows`` row buffers (at least one), ``loaded`` of them copied
  (each copy an arrival on its group's barrier)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  W, seg = CONSUMERS, int(c.has_segments)
  scratch = [
    plgpu.SMEM((W, c.bq, c.H), dtype, transforms=tr),  # Q, then dq
    plgpu.SMEM((W, c.bq, c.H), dtype, transforms=tr),  # dO
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=tr),
    plgpu.SMEM((W, nrows, c.bq), jnp.float32),
    # one barrier per copy group (a warpgroup's Q, dO, rows and query ids; a ring slot's K, V
    # and key ids), each copy one arrival: one wait and one phase register per group
    plgpu.Barrier(num_arrivals=2 + loaded + seg, num_barriers=W),
    plgpu.Barrier(num_arrivals=2 + seg, num_barriers=c.stages),
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a K tile done with by both
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a V tile done with by both
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((W, c.bq, c.bk), dtype, transforms=tr))
  if c.has_segments:
    scratch += [plgpu.SMEM((W, c.bq), jnp.int32), plgpu.SMEM((c.stages, c.bk), jnp.int32)]
  return scratch


def dq_kernel(c, res_keys, has_g, refs, scratch):
  """One dq program (see the module docstring); ``c`` the :func:`dq_plan`. Each compute
  warpgroup's code is traced for its static index (``_consumer(w)``), so that the addresses of
  its own tiles, and their wgmma descriptors, are constants rather than registers."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  q_ref, k_ref, v_ref, do_ref, rows_ref = refs[:5]
  seg_refs, dq_ref = refs[5:-1], refs[-1]
  (q_smem, do_smem, k_smem, v_smem, rows_smem, q_bars, kv_bars, k_done, v_done) = scratch[:9]
  extra = list(scratch[9:])
  staging = extra.pop(0) if c.interpret else None
  qseg_smem, kseg_smem = extra if c.has_segments else (None, None)
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

      plgpu.copy_gmem_to_smem(k_ref.at[b, keys, h], k_smem.at[slot], kv_bars.at[slot])
      if c.has_segments:
        plgpu.copy_gmem_to_smem(seg_refs[1].at[b, keys], kseg_smem.at[slot], kv_bars.at[slot])

      @pl.when(refill)
      def _():
        plgpu.barrier_wait(v_done.at[slot])

      plgpu.copy_gmem_to_smem(v_ref.at[b, keys, h], v_smem.at[slot], kv_bars.at[slot])
      return carry

    lax.fori_loop(lo_u, hi_u, fill, None)
    for s in range(c.stages):  # the last tiles' releases (every phase is waited on)
      j = hi_u - c.stages + s

      @pl.when(j >= lo_u)
      def _():
        plgpu.barrier_wait(k_done.at[slot_of(j)])
        plgpu.barrier_wait(v_done.at[slot_of(j)])

  def _consumer(wg):
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    qb = pair * W + wg
    q0 = qb * bq
    bounds = kv_bounds(c, q0, jnp.minimum(q0 + bq, c.T) - 1)
    lo, hi, flo, fhi = _clip(*bounds, lo_u, hi_u)
    my_q, my_do, my_rows, my_bar = q_smem.at[wg], do_smem.at[wg], rows_smem.at[wg], q_bars.at[wg]
    qrows = pl.ds(q0, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, qrows, n], my_q, my_bar)
    plgpu.copy_gmem_to_smem(do_ref.at[b, qrows, n], my_do, my_bar)
    for r in range(nrows):
      plgpu.copy_gmem_to_smem(rows_ref.at[r, b, n, qrows], my_rows.at[r], my_bar)
    if c.has_segments:
      plgpu.copy_gmem_to_smem(seg_refs[0].at[b, qrows], qseg_smem.at[wg], my_bar)
    iota, any_iota, load, layout = backward._layout_tools(c, plgpu, (bq, bk))
    qpos, kcol = q0 + iota(0), iota(1)
    plgpu.barrier_wait(my_bar)
    rows = [load(my_rows.at[r], 1) for r in range(nrows)]
    row_args = backward._row_args(rows, res_keys, has_g, c.nz.reads_row_dot)
    q_seg = None
    if c.has_segments:
      q_seg = lax.broadcast_in_dim(load(qseg_smem.at[wg], 1), (bq, bk), (0,))
      q_min, q_max = seg_refs[2][b, qb, 0], seg_refs[2][b, qb, 1]
    rule = backward._lowered_rule(c, c.nz.tile_backward, bq, iota=any_iota)
    my_staging = None if staging is None else staging.at[wg]

    def release(slot, which):
      plgpu.barrier_arrive((k_done, v_done)[which].at[slot])

    def pass_over(j, dq):
      slot = slot_of(j)
      plgpu.barrier_wait(kv_bars.at[slot])
      release(slot, 1)
      release(slot, 0)
      return dq

    def compute(masked, j, slot, dq):
      mask = lambda: (
        backward._dq_mask(c, load, qpos, kcol, q_seg, kseg_smem, slot, j) if masked else None
      )
      raw, _, dz = backward._tile_rule(
        c, plgpu, my_q, k_smem.at[slot], my_do, v_smem.at[slot], mask, row_args, rule
      )
      release(slot, 1)  # dP is read: V is done with
      ds = backward._ds(c, dz, raw, my_q.dtype)
      return backward._mm(c, plgpu, (bq, c.H), ds, k_smem.at[slot], staging=my_staging, acc=dq)

    def step(masked, j, dq):
      slot = slot_of(j)
      plgpu.barrier_wait(kv_bars.at[slot])
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

  for w in range(W):  # each compute warpgroup traced with its static index
    pl.when(wg == w)(functools.partial(_consumer, w))


def dkdv_scratch(c, dtype, tr, nrows: int, loaded: int) -> list:
  """The dk/dv kernel's scratch (``nrows`` and ``loaded`` as :func:`dq_scratch`'s)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  W, seg = CONSUMERS, int(c.has_segments)
  scratch = [
    plgpu.SMEM((W, c.bk, c.H), dtype, transforms=tr),  # K, then dk
    plgpu.SMEM((W, c.bk, c.H), dtype, transforms=tr),  # V, then dv
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, c.bq, c.H), dtype, transforms=tr),
    plgpu.SMEM((c.stages, nrows, c.bq), jnp.float32),
    # one barrier per copy group (a warpgroup's K, V and key ids; a ring slot's Q, dO, rows and
    # query ids), each copy one arrival: one wait and one phase register per group
    plgpu.Barrier(num_arrivals=2 + seg, num_barriers=W),
    plgpu.Barrier(num_arrivals=2 + loaded + seg, num_barriers=c.stages),
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a query tile done with by both
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((W, c.bk, c.bq), dtype, transforms=tr))
  if c.has_segments:
    scratch += [plgpu.SMEM((W, c.bk), jnp.int32), plgpu.SMEM((c.stages, c.bq), jnp.int32)]
  return scratch


def dkdv_kernel(c, res_keys, has_g, refs, scratch):
  """One dk/dv program (see the module docstring); ``c`` the ``dkdv_plan`` (64 keys a
  warpgroup).

  Per query tile a compute warpgroup issues ``S^T = K Q^T`` and ``dP^T = V dO^T`` back to
  back, runs the tile rule on ``S^T`` while ``dP^T`` is on the tensor cores, then issues
  ``dV += W^T dO`` and ``dK += dS^T Q`` back to back into accumulators held across the whole
  walk (never read until the end, so never waited for between the two) and waits once, before
  the tile's slot goes back to the producer. The row inputs are loaded from shared memory
  only once ``S^T`` is read (16 registers per row vector in the transposed tile's layout), and
  each compute warpgroup is traced for its static index (as in :func:`dq_kernel`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  q_ref, k_ref, v_ref, do_ref, rows_ref = refs[:5]
  seg_refs, (dk_ref, dv_ref) = refs[5:-2], refs[-2:]
  (k_smem, v_smem, q_smem, do_smem, rows_smem, kv_bars, in_bars, done) = scratch[:8]
  extra = list(scratch[8:])
  staging = extra.pop(0) if c.interpret else None
  kseg_smem, qseg_smem = extra if c.has_segments else (None, None)
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

      bar = in_bars.at[slot]
      plgpu.copy_gmem_to_smem(q_ref.at[b, qrows, n], q_smem.at[slot], bar)
      plgpu.copy_gmem_to_smem(do_ref.at[b, qrows, n], do_smem.at[slot], bar)
      for r in range(nrows):
        plgpu.copy_gmem_to_smem(rows_ref.at[r, b, n, qrows], rows_smem.at[slot, r], bar)
      if c.has_segments:
        plgpu.copy_gmem_to_smem(seg_refs[0].at[b, qrows], qseg_smem.at[slot], bar)
      return carry

    lax.fori_loop(0, total, fill, None)
    for s in range(c.stages):
      t = total - c.stages + s

      @pl.when(t >= 0)
      def _():
        plgpu.barrier_wait(done.at[slot_of(t)])

  def _consumer(wg):
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    kb = pair * W + wg
    k0 = kb * bk
    bounds = backward.q_block_bounds(c, k0, jnp.minimum(k0 + bk, c.S) - 1, c.Tp // bq)
    lo, hi, flo, fhi = _clip(*bounds, lo_u, hi_u)
    my_k, my_v = k_smem.at[wg], v_smem.at[wg]
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(k0, bk), h], my_k, kv_bars.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(k0, bk), h], my_v, kv_bars.at[wg])
    if c.has_segments:
      plgpu.copy_gmem_to_smem(seg_refs[1].at[b, pl.ds(k0, bk)], kseg_smem.at[wg], kv_bars.at[wg])
      k_min, k_max = seg_refs[3][b, kb, 0], seg_refs[3][b, kb, 1]
    iota, _, load, layout = backward._layout_tools(c, plgpu, (bk, bq))
    plgpu.barrier_wait(kv_bars.at[wg])
    rule = backward._lowered_rule(c, c.nz.tile_backward, bq, transposed=True)
    my_staging = None if staging is None else staging.at[wg]

    def mask(i, slot):
      # built in the masked steps only (an iota tile held across the walk takes 32 registers)
      k_seg = None
      if c.has_segments:
        k_seg = lax.broadcast_in_dim(load(kseg_smem.at[wg], 1), (bk, bq), (0,))
      return backward._dkdv_mask(c, load, i, iota(1), k0 + iota(0), qseg_smem, slot, k_seg)

    def accumulate(acc, a, b_ref):
      """``acc += a @ b_ref`` issued (not waited for); ``a`` a register tile."""
      if c.interpret:  # the interpreter's wgmma reads its lhs from shared memory only
        my_staging[...] = a
        plgpu.wgmma(acc, my_staging, b_ref)
        plgpu.wgmma_wait(0)
      else:
        plgpu.wgmma(acc, a, b_ref)

    def compute(masked, i, slot, dk_acc, dv_acc):
      rows = lambda: backward._row_args(
        [load(rows_smem.at[slot, r], 0) for r in range(nrows)], res_keys, has_g, c.nz.reads_row_dot
      )
      s, w, dz = backward._tile_rule(
        c,
        plgpu,
        my_k,
        q_smem.at[slot],
        my_v,
        do_smem.at[slot],
        (lambda: mask(i, slot)) if masked else (lambda: None),
        rows,
        rule,
      )
      # both low-precision operands made before either product is issued: the float32 tiles
      # end here, not beside an operand held for a wgmma in flight
      w16, ds = w.astype(my_k.dtype), backward._ds(c, dz, s, my_k.dtype)
      accumulate(dv_acc, w16, do_smem.at[slot])
      accumulate(dk_acc, ds, q_smem.at[slot])
      plgpu.wgmma_wait(0)  # both products have read the slot's Q and dO

    def walk(dk_acc, dv_acc):
      def head(g, carry):
        base = g * per_head - lo_u  # step t of query block i: base + i

        def pass_over(i, carry):
          slot = slot_of(base + i)
          plgpu.barrier_wait(in_bars.at[slot])
          plgpu.barrier_arrive(done.at[slot])
          return carry

        def step(masked, i, carry):
          slot = slot_of(base + i)
          plgpu.barrier_wait(in_bars.at[slot])
          if c.has_segments:  # every block masked; one whose segments cannot meet is skipped
            meets = (seg_refs[2][b, i, 1] >= k_min) & (seg_refs[2][b, i, 0] <= k_max)

            @pl.when(meets)
            def _():
              compute(True, i, slot, dk_acc, dv_acc)

          else:
            compute(masked, i, slot, dk_acc, dv_acc)
          plgpu.barrier_arrive(done.at[slot])
          return carry

        carry = lax.fori_loop(lo_u, lo, pass_over, carry)
        carry = lax.fori_loop(lo, flo, lambda i, a: step(True, i, a), carry)
        carry = lax.fori_loop(flo, fhi, lambda i, a: step(False, i, a), carry)
        carry = lax.fori_loop(fhi, hi, lambda i, a: step(True, i, a), carry)
        return lax.fori_loop(hi, hi_u, pass_over, carry)

      lax.fori_loop(0, c.G, head, None)
      return dk_acc[...], dv_acc[...]

    acc = plgpu.ACC((bk, c.H), jnp.float32)
    dk, dv = pl.run_scoped(walk, acc, acc)
    my_k[...] = (dk * c.opts.scale).astype(my_k.dtype)
    my_v[...] = dv.astype(my_v.dtype)
    backward._store(
      plgpu, [(my_k, dk_ref.at[b, pl.ds(k0, bk), h]), (my_v, dv_ref.at[b, pl.ds(k0, bk), h])]
    )

  for w in range(W):  # each compute warpgroup traced with its static index
    pl.when(wg == w)(functools.partial(_consumer, w))


def run(c, arrays, res_keys, has_g, nrows, tr, q_seg, kv_seg):
  """``(dq, dk, dv)`` by the warp-specialised kernels, or None where their tiles do not fit
  (:func:`fits`): the row terms and arrays as ``backward.backward`` prepares them."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if not fits(c, nrows) or c.plain:  # (jax 0.10's interpreter: the one-warpgroup kernels)
    return None
  dtype = arrays[0].dtype
  W = CONSUMERS
  loaded = backward._num_rows(c, res_keys, has_g)  # row copies (nrows >= 1 buffers)
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
    scratch_types=dq_scratch(cq, dtype, tr, nrows, loaded),
    grid=(c.N, c.Tp // (W * c.bq), c.B),
    grid_names=("heads", "q_blocks", "batch"),
    kernel_name="attnjax_dq",
    **common,
  )(*arrays, *seg)
  # whole programs of two key blocks: K and V padded to a multiple of their keys (a block past
  # S is masked everywhere, so its dk and dv are zeros, sliced off)
  ckv = dkdv_plan(c)
  ckv = dataclasses.replace(ckv, Sp=-(-c.Sp // (W * ckv.bk)) * (W * ckv.bk))
  qh, kh, vh, doh, rows = arrays
  kv_arrays = (qh, padded(kh, ckv.Sp), padded(vh, ckv.Sp), doh, rows)
  seg = segment_args(ckv, q_seg, kv_seg)
  kv_out = jax.ShapeDtypeStruct((c.B, ckv.Sp, c.K, c.H), dtype)
  dk, dv = plgpu.kernel(
    lambda *a: dkdv_kernel(ckv, res_keys, has_g, a[: nin + 2], a[nin + 2 :]),
    out_type=[kv_out, kv_out],
    scratch_types=dkdv_scratch(ckv, dtype, tr, nrows, loaded),
    grid=(c.K, ckv.Sp // (W * ckv.bk), c.B),
    grid_names=("heads", "k_blocks", "batch"),
    kernel_name="attnjax_dkdv",
    **common,
  )(*kv_arrays, *seg)
  return dq[:, : c.T], dk[:, : c.S], dv[:, : c.S]
