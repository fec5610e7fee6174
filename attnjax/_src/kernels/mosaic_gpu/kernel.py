"""A Pallas Mosaic GPU flash-attention kernel for Hopper (sm_90): ``implementation="mosaic_gpu"``.

The forward is warp-specialised as in FlashAttention-3: per program a producer warpgroup
issues the TMA copies of K/V tiles into a shared-memory ring and two consumer warpgroups
compute ``Q K^T`` and ``W V`` by wgmma in ping-pong, running the normaliser's online state
through :func:`attnjax._src.kernels.mosaic_gpu.plan.lower_rows`. Blocks are skipped, not
masked; q, k, v are read in place as ``[B, T, N, H]``. Backward:
:mod:`attnjax._src.kernels.mosaic_gpu.backward`; forward mode takes the block-wise twin's
tangent. Entry points: :func:`compute`, :func:`forward`, :func:`unsupported` (non-Hopper
targets, float32, other head dims, bias / mask arrays, modifiers); ``interpret=True``.
Guide: docs/guides/kernels.md, section "Pallas Mosaic GPU for Hopper".
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl

from attnjax._src import logits as logits_lib, op, target as target_lib, options
from attnjax._src.kernels import kernel_vjp
from attnjax._src.kernels.mosaic_gpu import backward, specialised
from attnjax._src.attention_stats import stats_from_padded_rows
from attnjax._src.kernels.mosaic_gpu.plan import (
  BLOCK_SIZE_TABLE,
  CONSUMERS,
  DEFAULT_BLOCK_SIZES,
  BlockSizes,
  Plan,
  block_sizes_for,
  heaviest_first,
  kv_bounds,
  padded,
  interpret_params,
  load_vector,
  lower_rows,
  make_plan,
  named_barrier,
  warpgroup_barrier,
  res_row_keys,
  segment_args,
  stat_row_keys,
  tile_allowed,
)

Array = jnp.ndarray

DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128, 256)
KNOWN_OPTIONS = options.KERNEL_OPTIONS
KNOWN_INPUTS = ("q", "k", "v", "sink_logits", "q_segment_ids", "kv_segment_ids")
# The custom-call target of a compiled Mosaic GPU kernel in optimised HLO.
MOSAIC_GPU_CALL_TARGET = "mosaic_gpu_v2"


def unsupported(inputs, opts, *, interpret: bool = False) -> list[str]:
  """Reasons ``mosaic_gpu`` cannot honour a call ([] = supported); lists unknown options too.

  Outside interpret mode the target must be a Hopper (compute capability 9, read as
  :func:`attnjax._src.target.cuda_major` does: the ambient mesh's device kind, else this
  process's GPU): the kernels are sm_90 instructions (wgmma, setmaxnreg), which Ampere and
  Blackwell GPUs do not run, and a GPU of unknown generation may be either.
  """
  reasons = options.array_refusals("mosaic_gpu", inputs, opts, "is_causal, window and segment ids")
  reasons += options.unknown_options(
    opts, inputs, KNOWN_OPTIONS, KNOWN_INPUTS + ("bias", "mask"), "mosaic_gpu"
  )
  major = None if interpret else target_lib.cuda_major()
  if not interpret and major != 9:
    target = "a GPU of unknown generation" if major is None else f"compute capability {major}"
    reasons.append(
      f"{target} (mosaic_gpu runs on Hopper, sm_90, only; trace under a mesh of "
      "H100 / H200 devices to compile for one from another host)"
    )
  H, Hv = inputs.q.shape[-1], inputs.v.shape[-1]
  if H != Hv or H not in HEAD_DIMS:
    reasons.append(
      f"head dims q {H}, v {Hv} (mosaic_gpu takes equal head dims, one of {HEAD_DIMS})"
    )
  dtypes = {inputs.q.dtype, inputs.k.dtype, inputs.v.dtype}
  if len(dtypes) != 1 or inputs.q.dtype not in DTYPES:
    reasons.append(
      f"dtypes {sorted(str(d) for d in dtypes)} (mosaic_gpu takes bfloat16 or "
      "float16 for q, k and v; float32 goes to pallas_gpu)"
    )
  return reasons


# Registers per thread after setmaxnreg: the consumers hold the accumulators, the producer
# only addresses (2 x 128 x 232 + 128 x 40 <= 64K registers per SM).
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 232, 40

# The consumers' turns (compiled): hardware named barriers SCHEDULE_BARRIER + w (w = 0, 1), 256
# threads each (both consumers), above Mosaic GPU's own (0, and 1 + warpgroup). Consumer w
# arrives on the other's barrier right after issuing its Q K^T (bar.arrive does not wait) and
# syncs on its own before its W V, so one's W V and next Q K^T issue while the other computes
# its weights (FlashAttention-3's ping-pong). In interpret mode two mbarriers stand in.
SCHEDULE_BARRIER = 8


def _kernel(c: Plan, row_keys, q_ref, k_ref, v_ref, sink_ref, seg_refs, o_ref, row_refs, scratch):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  (qo_smem, k_smem, v_smem, q_bars, k_bars, v_bars, k_consumed, v_consumed, schedule, rows_smem) = (
    scratch[:10]
  )
  consumed = (k_consumed, v_consumed)
  extra = list(scratch[10:])
  p_smem = extra.pop(0) if c.interpret else None
  if c.has_segments:
    qseg_smem, kseg_smem, kseg_one, qseg_bars, kseg_bars, kseg_one_bars = extra
  wg = lax.axis_index("wg")
  n = lax.axis_index("heads")
  i = heaviest_first(c, lax.axis_index("q_blocks"), c.Tp // (CONSUMERS * c.bq))
  b = lax.axis_index("batch")
  h = lax.div(n, jnp.int32(c.G))
  bq, bk = c.bq, c.bk
  # The program's rows (both consumers'): the key blocks any of them visits, [lo_u, hi_u)
  # (kv_bounds' lower bound follows the first row, its upper bound the last).
  q0_u = i * (CONSUMERS * bq)
  lo_u, hi_u, _, _ = kv_bounds(c, q0_u, jnp.minimum(q0_u + CONSUMERS * bq, c.T) - 1)

  def slot_of(j):
    return lax.rem(j - lo_u, jnp.int32(c.stages))

  @pl.when(wg == CONSUMERS)
  def _producer():
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    def fill(j, carry):
      slot = slot_of(j)
      rows = pl.ds(j * bk, bk)
      refill = j - lo_u >= c.stages
      # K and V of a slot are released separately (K right after a consumer's Q K^T, V
      # after its W V): the next K tile streams in while the slot's V is still being read

      @pl.when(refill)  # the slot's previous K tile consumed by both consumers
      def _():
        plgpu.barrier_wait(k_consumed.at[slot])

      plgpu.copy_gmem_to_smem(k_ref.at[b, rows, h], k_smem.at[slot], k_bars.at[slot])

      @pl.when(refill)
      def _():
        plgpu.barrier_wait(v_consumed.at[slot])

      plgpu.copy_gmem_to_smem(v_ref.at[b, rows, h], v_smem.at[slot], v_bars.at[slot])
      if c.has_segments:
        plgpu.copy_gmem_to_smem(seg_refs[1].at[b, rows], kseg_smem.at[slot], kseg_bars.at[slot])
      return carry

    lax.fori_loop(lo_u, hi_u, fill, None)
    # Wait for the last tiles' consumption too: every thread sees every phase of a barrier it
    # waits on (jax's interpreter checks it), and the program ends with its consumers.
    for s in range(c.stages):
      j = hi_u - c.stages + s

      @pl.when(j >= lo_u)
      def _():
        plgpu.barrier_wait(k_consumed.at[slot_of(j)])
        plgpu.barrier_wait(v_consumed.at[slot_of(j)])

  @pl.when(wg < CONSUMERS)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
    _consume(
      c,
      row_keys,
      wg,
      n,
      b,
      h,
      q0_u + wg * bq,
      i * CONSUMERS + wg,
      lo_u,
      hi_u,
      slot_of,
      q_ref,
      sink_ref,
      seg_refs,
      o_ref,
      row_refs,
      qo_smem.at[wg],
      k_smem,
      v_smem,
      q_bars.at[wg],
      k_bars,
      v_bars,
      consumed,
      schedule,
      rows_smem.at[wg],
      None if p_smem is None else p_smem.at[wg],
      (
        qseg_smem.at[wg],
        kseg_smem,
        kseg_one.at[wg],
        qseg_bars.at[wg],
        kseg_bars,
        kseg_one_bars.at[wg],
      )
      if c.has_segments
      else None,
    )


def _consume(
  c,
  row_keys,
  wg,
  n,
  b,
  h,
  q0,
  qb,
  lo_u,
  hi_u,
  slot_of,
  q_ref,
  sink_ref,
  seg_refs,
  o_ref,
  row_refs,
  q_smem,
  k_smem,
  v_smem,
  q_bar,
  k_bars,
  v_bars,
  consumed,
  schedule,
  rows_smem,
  p_smem,
  seg_scratch,
):
  """One consumer warpgroup: query rows ``q0 .. q0 + bq`` (query block ``qb``) over the
  program's key tiles ``[lo_u, hi_u)``, computing those its rows may attend (``[lo, hi)``) and
  releasing every tile to the producer. Its output tile is written into its Q tile."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  del h
  lo, hi, flo, fhi = _consumer_bounds(c, q0, lo_u, hi_u)
  plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, c.bq), n], q_smem, q_bar)
  if c.has_segments:
    plgpu.copy_gmem_to_smem(seg_refs[0].at[b, pl.ds(q0, c.bq)], seg_scratch[0], seg_scratch[3])
  plgpu.barrier_wait(q_bar)
  con = _Consumer(
    c,
    n,
    b,
    q0,
    qb,
    hi_u,
    slot_of,
    seg_refs,
    q_smem,
    k_smem,
    v_smem,
    k_bars,
    v_bars,
    consumed,
    schedule,
    p_smem,
    seg_scratch,
  )
  row = con.row_inputs(sink_ref, lo, hi)
  st = con.init()

  @pl.when(lo_u < hi_u)  # each tile's K is waited for one step ahead (see _Consumer.pv)
  def _():
    con.wait_k(slot_of(lo_u))

  @pl.when(wg == 1)  # the second consumer starts a turn behind the first
  def _():
    con.wait_turn()

  st = lax.fori_loop(lo_u, lo, con.pass_over, st)
  if c.needs_mask:
    st = lax.fori_loop(lo, flo, functools.partial(con.step, True), st)
    st = lax.fori_loop(flo, fhi, functools.partial(con.step, False), st)
    st = lax.fori_loop(fhi, hi, functools.partial(con.step, True), st)
  else:
    st = lax.fori_loop(lo, hi, functools.partial(con.step, False), st)
  st = lax.fori_loop(hi, hi_u, con.pass_over, st)

  @pl.when(wg == 0)  # and the first one ends a turn after it (the barriers' counts even)
  def _():
    con.signal()

  _write_rows(c, row_keys, b, n, q0, st, row, q_smem, o_ref, rows_smem, row_refs)


def _consumer_bounds(c, q0, lo_u, hi_u):
  """``(lo, hi, flo, fhi)``: the key blocks rows ``q0 .. q0 + bq`` may attend and those they
  attend whole (no element mask), within the program's tiles ``[lo_u, hi_u)`` (a block of
  padding rows past T may reach outside them)."""
  lo, hi, flo, fhi = kv_bounds(c, q0, jnp.minimum(q0 + c.bq, c.T) - 1)
  lo = jnp.clip(lo, lo_u, hi_u)
  hi = jnp.clip(hi, lo, hi_u)
  flo = jnp.clip(flo, lo, hi)
  fhi = jnp.clip(fhi, flo, hi)
  return lo, hi, flo, fhi


class _Consumer:
  """A consumer warpgroup's tile steps over the K/V ring (see :func:`_consume`): its query tile
  is in ``q_smem``, the producer fills ``k_smem`` / ``v_smem`` slot by slot."""

  def __init__(
    self,
    c,
    n,
    b,
    q0,
    qb,
    hi_u,
    slot_of,
    seg_refs,
    q_smem,
    k_smem,
    v_smem,
    k_bars,
    v_bars,
    consumed,
    schedule,
    p_smem,
    seg_scratch,
  ):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    self.plgpu = plgpu
    self.c, self.n, self.b, self.slot_of, self.seg_refs = c, n, b, slot_of, seg_refs
    self.wg, self.hi_u = lax.axis_index("wg"), hi_u
    self.q_smem, self.k_smem, self.v_smem, self.p_smem = q_smem, k_smem, v_smem, p_smem
    self.k_bars, self.v_bars, self.consumed, self.schedule = k_bars, v_bars, consumed, schedule
    self.seg_scratch = seg_scratch
    self.layout = plgpu.Layout.WGMMA
    # jax 0.10's interpreter has no rule for layout annotations (layout_cast, an iota's
    # layout): it runs the same values without them.
    if c.plain:
      self.any_iota = None
      self.cast = lambda x, lay: x
    else:
      self.any_iota = lambda dtype, shape, d: plgpu.broadcasted_iota(
        dtype, shape, d, layout=self.layout
      )
      self.cast = plgpu.layout_cast
    iota = lambda d: (self.any_iota or lax.broadcasted_iota)(jnp.int32, (c.bq, c.bk), d)
    self.qpos = q0 + iota(0)
    self.kcol = iota(1)
    self.q_seg = None
    if c.has_segments:
      self._segments(qb)

  def _segments(self, qb):
    """Segment ids: the query block's ids as rows, each key block's as columns (TMA'd into
    shared memory, the key tiles' ids with the K/V ring), and per-block ``[min, max]`` ranges
    read from global memory: a visited block whose ranges cannot meet is skipped at run time."""
    c, b = self.c, self.b
    qseg_smem, _, _, qseg_bar, _, _ = self.seg_scratch
    _, _, qrange_ref, self.krange_ref = self.seg_refs
    self.plgpu.barrier_wait(qseg_bar)
    self.q_seg = lax.broadcast_in_dim(self.load(qseg_smem, 1), (c.bq, c.bk), (0,))
    self.q_min, self.q_max = qrange_ref[b, qb, 0], qrange_ref[b, qb, 1]

  def load(self, ref, axis):
    """A segment-id vector from shared memory, laid out along ``axis`` of a tile."""
    if self.c.plain:  # jax 0.10's interpreter has no plgpu.load: a plain read
      return ref[...]
    return load_vector(ref, self.layout.reduce(axis))

  def meets(self, j):
    """Whether key block ``j``'s segment range can meet the query block's."""
    return (self.krange_ref[self.b, j, 1] >= self.q_min) & (
      self.krange_ref[self.b, j, 0] <= self.q_max
    )

  def allowed_of(self, j, kseg_tile=None):
    """The boolean ``[bq, bk]`` mask of key block ``j`` (``kseg_tile``: its segment ids)."""
    c = self.c
    k_seg = None
    if c.has_segments:
      k_seg = lax.broadcast_in_dim(self.load(kseg_tile, 0), (c.bq, c.bk), (1,))
    return tile_allowed(c, self.qpos, j * c.bk + self.kcol, self.q_seg, k_seg)

  def counts(self, lo, hi):
    """Allowed keys per row ``[bq]`` float32, or None where the normaliser needs none."""
    c, plgpu = self.c, self.plgpu
    if not c.needs_counts:
      return None
    if c.has_segments:  # a mask-only pre-pass over the blocks whose segments meet
      _, _, kseg_one, _, _, kseg_one_bar = self.seg_scratch

      def count(j, total):
        def add():  # the key block's ids, loaded synchronously (no K/V)
          if not c.interpret:  # every warp has read the previous block's ids (no auto barriers)
            warpgroup_barrier()
          plgpu.copy_gmem_to_smem(
            self.seg_refs[1].at[self.b, pl.ds(j * c.bk, c.bk)], kseg_one, kseg_one_bar
          )
          plgpu.barrier_wait(kseg_one_bar)
          return total + jnp.sum(self.allowed_of(j, kseg_one).astype(jnp.float32), axis=1)

        return lax.cond(self.meets(j), add, lambda: total)

      zeros = self.cast(jnp.zeros((c.bq,), jnp.float32), self.layout.reduce(1))
      return lax.fori_loop(lo, hi, count, zeros)
    # exact for causal / window / ragged keys
    r = jnp.max(self.qpos, axis=1)
    first = jnp.int32(0)
    last = jnp.full((c.bq,), c.S - 1, jnp.int32)
    if c.opts.is_causal:
      last = jnp.minimum(last, r)
    if c.opts.window is not None:
      left, right = c.opts.window
      first = jnp.maximum(first, r - left)
      last = jnp.minimum(last, r + right)
    return jnp.maximum(last - first + 1, 0).astype(jnp.float32)

  def row_inputs(self, sink_ref, lo, hi):
    """The normaliser's per-row inputs (sink logits, counts), in the row layout; kept as
    ``self.row`` for the visits."""
    c = self.c
    sink_rows = jnp.full((c.bq,), sink_ref[self.n], jnp.float32) if c.has_sink else None
    row = lower_rows(c.nz.row_inputs, c.bq)(sink_rows, self.counts(lo, hi))
    # Constant rows (a splat: e.g. every row's count without structure) take the row layout,
    # which the broadcasts against [bq, bk] tiles need.
    self.row = jax.tree.map(
      lambda x: self.cast(x, self.layout.reduce(1)) if jnp.ndim(x) == 1 else x, row
    )
    return self.row

  def init(self):
    """The normaliser's initial online state, rows in the row layout."""
    c = self.c
    st = c.nz.init((c.bq, 1), (c.bq, c.H), c.with_stats)
    return {
      key: (
        self.cast(jnp.reshape(x, (c.bq,)), self.layout.reduce(1))
        if x.shape[-1] == 1
        else self.cast(x, self.layout)
      )
      for key, x in st.items()
    }

  def signal(self):
    """Lets the other consumer take its turn (right after this one issued its ``Q K^T``):
    ``bar.arrive`` on the other's schedule barrier, which does not wait (see
    SCHEDULE_BARRIER)."""
    if self.c.interpret:
      self.plgpu.barrier_arrive(self.schedule.at[1 - self.wg])
    else:
      named_barrier("arrive", SCHEDULE_BARRIER + 1 - self.wg, CONSUMERS * 128)

  def wait_turn(self, after=()):
    """Waits for this consumer's turn (before its ``W V``): ``bar.sync`` on its own schedule
    barrier, complete once the other consumer has signalled; compiled, the rows ``after``
    (the tile's rescale factors) are computed before it (see ``named_barrier``)."""
    if self.c.interpret:
      self.plgpu.barrier_wait(self.schedule.at[self.wg])
    else:
      named_barrier("sync", SCHEDULE_BARRIER + self.wg, CONSUMERS * 128, after=after)

  def wait_next_k(self, j):
    """Waits for the next tile's K (while this tile's ``W V`` runs): every tile's K is waited
    for one step ahead, the first before the loops."""

    @pl.when(j + 1 < self.hi_u)
    def _():
      self.wait_k(self.slot_of(j + 1))

  def wait_k(self, slot):
    """Waits for the key tile (and its segment ids) of ``slot``."""
    self.plgpu.barrier_wait(self.k_bars.at[slot])
    if self.c.has_segments:
      self.plgpu.barrier_wait(self.seg_scratch[4].at[slot])

  def wait_v(self, slot):
    self.plgpu.barrier_wait(self.v_bars.at[slot])

  def release(self, slot, which):
    """Hands ``slot``'s K (``which=0``) or V (``1``) tile back to the producer."""
    self.plgpu.barrier_arrive(self.consumed[which].at[slot])

  def pass_over(self, j, st):
    """A program tile outside this consumer's rows' reach (its K already waited for): its
    turns, released."""
    slot = self.slot_of(j)
    self.signal()
    self.release(slot, 0)
    self.wait_v(slot)
    self.wait_turn()
    self.wait_next_k(j)
    self.release(slot, 1)
    return st

  def step(self, masked, j, st):
    """Key tile ``j`` (its K already waited for): its products and normaliser visit
    (``masked``: with the element mask). K is released once ``Q K^T`` is read, V after
    ``W V``."""
    slot = self.slot_of(j)
    if self.c.has_segments:
      # a block whose segments cannot meet: its products and normaliser work are skipped
      st = lax.cond(
        self.meets(j), lambda: self.compute(masked, j, slot, st), lambda: self.skip(j, slot, st)
      )
    else:
      st = self.compute(masked, j, slot, st)
    self.release(slot, 1)
    return st

  def skip(self, j, slot, st):
    """A visited tile whose segments cannot meet the rows': only its turns and barriers."""
    self.signal()
    self.release(slot, 0)
    self.wait_v(slot)
    self.wait_turn()
    self.wait_next_k(j)
    return st

  def scores(self, slot):
    """``q k^T`` of the tile in ``slot``, float32 ``[bq, bk]``; the other consumer is
    signalled as soon as the product is issued."""
    c, plgpu = self.c, self.plgpu
    if c.plain:  # jax 0.10's interpreter has no wgmma with a transposed operand
      self.signal()
      return lax.dot_general(
        self.q_smem[...],
        self.k_smem.at[slot][...],
        (((1,), (1,)), ((), ())),
        preferred_element_type=jnp.float32,
      )

    def qk(acc):
      plgpu.wgmma(acc, self.q_smem, self.k_smem.at[slot].transpose((1, 0)))
      self.signal()
      return acc[...]

    return pl.run_scoped(qk, plgpu.ACC((c.bq, c.bk), jnp.float32))

  def pv(self, j, slot, w, acc=None, rescale=()):
    """``acc + w v`` (``acc`` None: ``w v``) for the weights ``w [bq, bk]`` and the value tile
    in ``slot``: ``[bq, Hv]``, accumulated in place in the wgmma's accumulator. The tile's
    second turn: the value tile and this consumer's turn are waited for before the wgmma (the
    rows that rescaled ``acc``, ``rescale``, computed before the turn), the next tile's K
    after it."""
    plgpu, c = self.plgpu, self.c
    w16 = w.astype(self.q_smem.dtype)
    self.pv_calls += 1
    if acc is not None and not c.interpret:
      # the weights and the rescaled accumulator are computed before the turn is waited for
      # (ptxas otherwise sinks the last exponentials and the rescale past the bar.sync)
      w16, acc = lax.optimization_barrier((w16, acc))
    self.wait_v(slot)
    self.wait_turn(rescale)

    def issue(acc_ref):
      if c.interpret:  # the interpreter's wgmma reads its lhs from shared memory only
        self.p_smem[...] = w16
        plgpu.wgmma(acc_ref, self.p_smem, self.v_smem.at[slot])
      else:
        plgpu.wgmma(acc_ref, w16, self.v_smem.at[slot])

    if acc is not None and not c.interpret:
      out = pl.run_state(issue)(plgpu.ACC.init(acc))
    else:

      def fresh(acc_ref):
        issue(acc_ref)
        return acc_ref[...]

      out = pl.run_scoped(fresh, plgpu.ACC((c.bq, c.H), jnp.float32))
      # the interpreter cannot discharge run_state over swizzled shared-memory refs (jax
      # 0.12): there the sum is taken after the product
      out = out if acc is None else acc + out
    # Pallas's run_state cannot hold a barrier wait under pl.when between the issue and the
    # read (jax 0.12: "Shaped arrays must be represented by ir.Values"), so the next K is
    # waited for once W V is read
    self.wait_next_k(j)
    return out

  def compute(self, masked, j, slot, st):
    c = self.c
    s = self.scores(slot)
    self.release(slot, 0)  # Q K^T is read: the key tile's slot may be refilled
    allowed = None
    if masked:
      allowed = self.allowed_of(j, self.seg_scratch[1].at[slot] if c.has_segments else None)
    visit = functools.partial(c.nz.visit, stats=c.with_stats, first=j == 0)
    self.pv_calls = 0
    # the scale is applied inside the lowered visit, where it folds into the exponent's FFMA
    logits = lambda s: logits_lib.softcap(s * c.opts.scale, c.opts.softcap)
    st = lower_rows(
      lambda st, s, allowed, row, pv_: visit(st, logits(s), allowed, pv_, row),
      c.bq,
      pv=functools.partial(self.pv, j, slot),
      hv=c.H,
      iota=self.any_iota,
      fuse=True,
    )(st, s, allowed, self.row)
    if self.pv_calls != 1:  # the V barrier is waited on once per tile
      raise NotImplementedError(
        f"normalizer {c.nz.name!r}: visit called pv "
        f"{self.pv_calls} times (the kernel takes one W V per tile)"
      )
    return st


def _write_rows(c, row_keys, b, n, q0, st, row, q_smem, o_ref, rows_smem, row_refs):
  """Finishes the normaliser's state and writes the output tile (through the query tile's
  shared memory) and the residual / statistics rows."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  bq = c.bq
  out, res, srow = lower_rows(lambda st, row: c.nz.finish(st, row, c.with_stats), bq)(st, row)
  rows_out = dict(srow or {}, **{"res:" + key: x for key, x in res.items()})
  q_smem[...] = out.astype(q_smem.dtype)  # the output tile takes the query tile's place
  for idx, key in enumerate(row_keys):  # residual / statistics rows, [bq] float32 each
    rows_smem.at[idx][...] = jnp.broadcast_to(rows_out[key], (bq,)).astype(jnp.float32)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(q0, bq), n])
  for idx, ref in enumerate(row_refs):
    plgpu.copy_smem_to_gmem(rows_smem.at[idx], ref.at[b, n, pl.ds(q0, bq)])
  plgpu.wait_smem_to_gmem(0)


def forward(c: Plan, q, k, v, sink, q_seg, kv_seg, residuals: bool = False):
  """The kernel on ``[B, T, N, H]`` inputs: ``(out [B, T, N, H], rows)``, the statistics rows
  ``{name: [B, N, Tp, 1]}`` of :meth:`Normalizer.finish` (none without ``return_stats``) and,
  with ``residuals``, its residual rows ``{"res:" + name: ...}`` (for the backward kernels)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  qh, kh, vh = padded(q, c.Tp), padded(k, c.Sp), padded(v, c.Sp)
  dtype = q.dtype
  stat_keys = stat_row_keys(c.nz, c.with_stats, c.has_sink) if c.with_stats else ()
  res_keys = ()
  if residuals:
    res_keys = tuple(
      "res:" + key for key in res_row_keys(c.nz, c.with_stats, c.has_sink, c.needs_counts)
    )
  stat_keys = stat_keys + res_keys
  swizzle = 128
  transforms = (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )
  W = CONSUMERS
  scratch = [
    plgpu.SMEM((W, c.bq, c.H), dtype, transforms=transforms),  # Q, then the output
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=transforms),
    plgpu.SMEM((c.stages, c.bk, c.H), dtype, transforms=transforms),
    plgpu.Barrier(num_barriers=W),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_barriers=c.stages),
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a K tile consumed by both
    plgpu.Barrier(num_arrivals=W, num_barriers=c.stages),  # a V tile consumed by both
    plgpu.Barrier(num_barriers=W),  # the consumers' turns (interpret mode; see SCHEDULE_BARRIER)
    plgpu.SMEM((W, max(1, len(stat_keys)), c.bq), jnp.float32),
  ]
  if c.interpret:
    scratch.append(plgpu.SMEM((W, c.bq, c.bk), dtype, transforms=transforms))
  if c.has_segments:
    scratch += [
      plgpu.SMEM((W, c.bq), jnp.int32),
      plgpu.SMEM((c.stages, c.bk), jnp.int32),
      plgpu.SMEM((W, c.bk), jnp.int32),
      plgpu.Barrier(num_barriers=W),
      plgpu.Barrier(num_barriers=c.stages),
      plgpu.Barrier(num_barriers=W),
    ]
  sink_arr = sink.astype(jnp.float32).reshape(c.N) if c.has_sink else jnp.zeros((c.N,), jnp.float32)

  seg_args = segment_args(c, q_seg, kv_seg)

  def body(q_ref, k_ref, v_ref, sink_ref, *rest):
    seg_refs, rest = rest[: len(seg_args)], rest[len(seg_args) :]
    o_ref, rest = rest[0], rest[1:]
    stat_refs, scr = rest[: len(stat_keys)], rest[len(stat_keys) :]
    _kernel(
      c,
      stat_keys,
      q_ref,
      k_ref,
      v_ref,
      sink_ref if c.has_sink else None,
      seg_refs,
      o_ref,
      stat_refs,
      scr,
    )

  interpret = interpret_params(c.interpret)
  rows = jax.ShapeDtypeStruct((c.B, c.N, c.Tp), jnp.float32)
  outs = plgpu.kernel(
    body,
    out_type=[jax.ShapeDtypeStruct((c.B, c.Tp, c.N, c.H), dtype)] + [rows] * len(stat_keys),
    scratch_types=scratch,
    grid=(c.N, c.Tp // (CONSUMERS * c.bq), c.B),
    grid_names=("heads", "q_blocks", "batch"),
    num_threads=CONSUMERS + 1,
    thread_name="wg",
    interpret=interpret,
    # No automatic warpgroup barriers (before each TMA copy, around shared-memory stores and
    # inside every pl.when / cond): the kernel's own barriers order every access. Its threads
    # write shared memory only where nothing reads it by ld.shared (the output into the Q tile
    # after the last wgmma that read Q was waited, the row buffers; then commit_smem, which
    # fences and syncs the warpgroup, before the TMA store), and read only tiles a TMA copy
    # filled and an mbarrier wait published (segment ids), released to the producer after use;
    # the one buffer read and refilled by the same warpgroup (the counts pre-pass's key ids)
    # has an explicit warpgroup barrier before each refill (_Consumer.counts).
    compiler_params=plgpu.CompilerParams(
      approx_math=c.approx_math, unsafe_no_auto_barriers=True, reduction_scratch_bytes=0
    ),
    kernel_name="attnjax_forward",
  )(qh, kh, vh, sink_arr, *seg_args)
  srow = {key: x[..., None] for key, x in zip(stat_keys, outs[1:])}
  return outs[0][:, : c.T], srow


def compute(
  inputs,
  opts,
  *,
  block_sizes: Optional[BlockSizes] = None,
  interpret: bool = False,
  shard_offsets=None,
):
  """Mosaic GPU attention of a validated dense call (see the module docstring).

  The call is one :func:`unsupported` accepts (checked once, by :func:`attnjax._src.op.run_engine`).

  Args:
    inputs: :class:`attnjax.options.DenseInputs`.
    opts: :class:`attnjax.options.DenseOptions`.
    block_sizes: tiles and pipeline depth (None: the :data:`BLOCK_SIZE_TABLE` row).
    interpret: run the kernel in jax's Mosaic GPU interpreter (on the CPU).
    shard_offsets: a shard's place in a call split by :func:`attnjax._src.sharding.per_shard`;
      unused (this kernel takes no modifiers, so it reads no batch or head index).

  Returns:
    ``[B, T, N, H]`` in the input dtype, or ``(out, AttentionStats)``.
  """
  del shard_offsets
  if block_sizes is None:
    block_sizes = block_sizes_for(inputs.q.shape[-1])
  c = make_plan(inputs, opts, block_sizes, interpret)

  def run_forward(q, k, v, sink, q_seg, kv_seg, residuals):
    out, srow = forward(c, q, k, v, sink, q_seg, kv_seg, residuals=residuals)
    stats = stats_from_padded_rows(srow, c.T, opts.empty_row_logsumexp) if c.with_stats else None
    return (out, stats), srow

  def primal_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args):
    del shard, score_args, mask_args  # no modifiers
    # nothing differentiated: no residual rows are written
    return run_forward(q, k, v, sink, q_seg, kv_seg, residuals=False)[0]

  def fwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args):
    del shard, score_args, mask_args
    result, srow = run_forward(q, k, v, sink, q_seg, kv_seg, residuals=not c.interpret)
    res = {key[4:]: x[..., 0] for key, x in srow.items() if key.startswith("res:")}
    has_key = srow["has_key"][..., 0] if c.with_stats else None
    return result, (result[0], res, has_key)

  def bwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args, saved, d_out, d_lse):
    del shard, score_args, mask_args
    out, res, has_key = saved
    # the warp-specialised dq and dk/dv kernels where their tiles fit, else the one-warpgroup ones
    grads = backward.backward(
      c, q, k, v, sink, out, res, d_out, d_lse, has_key, q_seg, kv_seg, specialised.run
    )
    return (*grads, [])

  # The interpreter's kernels carry an ordered IO effect, which the custom-VJP machinery's
  # linear map cannot hold (KeyError on the effect): in interpret mode gradients take the
  # block-wise backward (the twin's), and tests call the backward kernels directly
  # (backward_direct).
  steps = kernel_vjp.Steps(
    f"mosaic_gpu_{opts.normalizer}", fwd_step, None if c.interpret else bwd_step, primal=primal_step
  )
  return kernel_vjp.differentiable(inputs, opts, steps)


# The engine as dispatch sees it (:class:`attnjax._src.op.Engine`): the dense op lists it.
ENGINE = op.platform_kernel(
  "mosaic_gpu", compute, unsupported, platform="cuda", where="runs on a CUDA GPU (sm_90) only"
)
run = op.deprecated_run(ENGINE, "attnjax.kernels.mosaic_gpu")
attention = options.engine_entry(
  op.dense_runner(ENGINE), "mosaic_gpu", ("block_sizes", "interpret")
)
attention.__doc__ = """The Mosaic GPU kernel called like :func:`attnjax.dot_product_attention`.

``attention(q, k, v, *, <dense options>, block_sizes=None, interpret=False)``: every keyword
of :func:`attnjax.dot_product_attention` but ``implementation`` (what the kernel refuses is
named by :func:`unsupported`), the kernel's :class:`BlockSizes`, and ``interpret=True`` to
run it in jax's Mosaic GPU interpreter on the CPU.
"""

__all__ = [
  "BLOCK_SIZE_TABLE",
  "DEFAULT_BLOCK_SIZES",
  "DTYPES",
  "ENGINE",
  "MOSAIC_GPU_CALL_TARGET",
  "BlockSizes",
  "attention",
  "block_sizes_for",
  "compute",
  "run",
  "unsupported",
]
