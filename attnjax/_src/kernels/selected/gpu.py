"""Selected-block attention as Pallas Mosaic GPU kernels for Hopper (sm_90): forward and backward.

One warpgroup per program, a two-stage TMA ring, wgmma into float32 accumulators, the
normaliser's rows through :func:`attnjax._src.kernels.selected.rows.on_rows`. Query-token-major
(``"query"``): a program per (token, key/value head, batch row) holds the token's G heads as
the first rows of a 64-row wgmma tile and walks its blocks (only the last one masked).
Key-block-major (``"kv"``): a program per (key block, key/value head, batch row) loads the
block once and walks its work items of 64 rows; the forward writes each part, the backward
holds dk and dv in registers with the tiles transposed (keys as rows) and writes dq parts.
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl

from attnjax._src import target
from attnjax._src.kernels.selected import tiles
from attnjax._src.kernels.selected.plan import Plan
from attnjax._src.kernels.selected.rows import on_rows

Array = jnp.ndarray

# One wgmma M: the rows of every tile (a "kv" work item's rows; a token's heads, padded).
ROWS = 64
ALIGN = 64
DTYPES = (jnp.bfloat16, jnp.float16)
HEAD_DIMS = (64, 128)
BLOCK_SIZES = (64,)
STAGES = 2
# jax 0.12's Mosaic GPU interpreter runs layouts and transposed wgmma operands; jax 0.10's runs
# neither (there the kernels drop layouts and take transposed products as register dots).
INTERPRETER_RUNS_LAYOUTS = jax.__version_info__ >= (0, 12)


def unsupported(plan: Plan, dtype) -> list[str]:
  """Reasons the Mosaic GPU kernels cannot run a call ([] = they can). Outside interpret mode
  the target must be a Hopper (compute capability 9 as :func:`attnjax._src.target.cuda_major`
  reads it: the ambient mesh's device kind, else this process's GPU): the kernels are sm_90
  instructions (wgmma)."""
  reasons = []
  major = None if plan.interpret else target.cuda_major()
  if not plan.interpret and major != 9:
    where = "a GPU of unknown generation" if major is None else f"compute capability {major}"
    reasons.append(
      f"{where} (the Mosaic GPU kernels run on Hopper, sm_90, only; trace under a mesh of "
      "H100 / H200 devices to compile for one from another host)"
    )
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    reasons.append(
      f"dtype {jnp.dtype(dtype).name} (the Mosaic GPU kernels take bfloat16 or float16)"
    )
  if plan.H != plan.Hv or plan.H not in HEAD_DIMS:
    reasons.append(f"head dims q {plan.H}, v {plan.Hv} (equal, one of {HEAD_DIMS})")
  if plan.block_size not in BLOCK_SIZES:
    reasons.append(f"block_size={plan.block_size} (one wgmma tile of keys: {BLOCK_SIZES})")
  if plan.G > ROWS:
    reasons.append(f"{plan.G} query heads per group (a tile holds at most {ROWS})")
  elif plan.order == "kv" and plan.rows != ROWS:
    reasons.append(f"rows={plan.rows} per work item (one wgmma tile: {ROWS})")
  return reasons


def _plain(p: Plan) -> bool:
  return p.interpret and not INTERPRETER_RUNS_LAYOUTS


def _group_rows(G: int) -> int:
  """The rows a token's G heads take in the query-major layout: a multiple of 8 (a TMA box
  into an (8, 64)-tiled tile)."""
  return -(-G // 8) * 8


class _Tools:
  """Layouts, loads and products of one kernel (compiled, or in jax 0.10's interpreter)."""

  def __init__(self, p: Plan, staging=None):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    self.p, self.plgpu, self.staging = p, plgpu, staging
    self.plain = _plain(p)
    self.layout = plgpu.Layout.WGMMA

  def iota(self, shape, dim):
    if self.plain:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.layout)

  def any_iota(self):
    """The row lowering's iota maker (None: plain iotas)."""
    if self.plain:
      return None
    return lambda dtype, shape, dim: self.plgpu.broadcasted_iota(
      dtype, shape, dim, layout=self.layout
    )

  def cast(self, x, axis=None):
    """``x`` in the WGMMA layout (``axis``: its vector along that axis of a tile)."""
    if self.plain:
      return x
    return self.plgpu.layout_cast(x, self.layout if axis is None else self.layout.reduce(axis))

  def vector(self, ref, axis: int):
    """A ``[64]`` float32 / int32 vector of shared memory laid out along ``axis`` of a tile
    (1: one value per row; 0: one per column)."""
    if self.plain:
      return ref[...]
    load = self.plgpu.load
    if "idx" in inspect.signature(load).parameters:
      return load(ref, (), layout=self.layout.reduce(axis))
    return load(ref, layout=self.layout.reduce(axis))

  def mm(self, shape, a, b_ref, *, trans_b=False, a_ref=None, trans_a=False, acc=None):
    """``a @ b`` float32 (``acc + a @ b`` with ``acc``) by wgmma: ``a`` registers (or
    ``a_ref`` shared memory, ``trans_a``: its transpose), ``b_ref`` shared memory
    (``trans_b``: its transpose). In interpret mode a register lhs is staged through shared
    memory; in jax 0.10's interpreter transposed operands are register dots."""
    plgpu = self.plgpu
    if self.plain and (trans_a or trans_b):
      lhs = a if a_ref is None else a_ref[...]
      dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
      out = lax.dot_general(lhs, b_ref[...], dims, preferred_element_type=jnp.float32)
      return out if acc is None else acc + out

    def issue(acc_ref):
      if a_ref is not None:
        lhs = a_ref.transpose((1, 0)) if trans_a else a_ref
      elif self.p.interpret:
        self.staging[...] = a
        lhs = self.staging
      else:
        lhs = a
      plgpu.wgmma(acc_ref, lhs, b_ref.transpose((1, 0)) if trans_b else b_ref)

    if acc is not None and not self.p.interpret:
      return pl.run_state(issue)(plgpu.ACC.init(acc))

    def fresh(acc_ref):
      issue(acc_ref)
      return acc_ref[...]

    out = pl.run_scoped(fresh, plgpu.ACC(shape, jnp.float32))
    return out if acc is None else acc + out

  def store(self, pairs):
    """Copies each ``(shared memory, global memory)`` out and waits for the copies."""
    plgpu = self.plgpu
    plgpu.commit_smem()
    for smem, ref in pairs:
      plgpu.copy_smem_to_gmem(smem, ref)
    plgpu.wait_smem_to_gmem(0)


def _named(name: str, body):
  """``body`` named ``name`` (Mosaic GPU names its kernel after its body function)."""
  body.__name__ = body.__qualname__ = name
  return body


def _transforms(dtype):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  swizzle = 128
  return (
    plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
    plgpu.SwizzleTransform(swizzle),
  )


def _interpret(p: Plan):
  if not p.interpret:
    return None
  import jax.experimental.pallas.mosaic_gpu as plgpu

  params = getattr(plgpu, "InterpretGPUParams", None)
  if params is None:
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
  return params()


def _padded_keys(x, p: Plan):
  """``[B, S, K, X]`` with zero keys up to ``Sp`` (a TMA box never reads past the array)."""
  return x if p.S == p.Sp else jnp.pad(x, ((0, 0), (0, p.Sp - p.S), (0, 0), (0, 0)))


def _init_state(tools: _Tools, nz, Hv: int, stats: bool):
  st = nz.init((ROWS, 1), (ROWS, Hv), stats)
  return {
    key: tools.cast(jnp.reshape(x, (ROWS,)), 1) if x.shape[-1] == 1 else tools.cast(x)
    for key, x in st.items()
  }


# ---------------------------------------------------------------------------
# Query-token-major forward and dq.


def _query_fwd_kernel(p: Plan, out_keys, refs, scratch):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  nz = p.nz
  it = iter(refs)
  q_ref, k_ref, v_ref, idx_ref, cnt_ref = (next(it) for _ in range(5))
  counts_ref = next(it) if p.needs_counts else None
  o_ref = next(it)
  row_refs = [next(it) for _ in out_keys]
  q_smem, k_smem, v_smem, rows_smem, q_bar, k_bars, v_bars = scratch[:7]
  tools = _Tools(p, scratch[7] if p.interpret else None)
  t, kh, b = lax.axis_index("tokens"), lax.axis_index("heads"), lax.axis_index("batch")
  Gp, bs = _group_rows(p.G), p.block_size
  count = cnt_ref[b, t, kh]
  head_rows = q_smem if Gp == ROWS else q_smem.at[pl.ds(0, Gp)]
  plgpu.copy_gmem_to_smem(q_ref.at[b, t, kh], head_rows, q_bar.at[0])

  def fetch(s):
    j, slot = idx_ref[b, t, kh, s], lax.rem(s, STAGES)
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * bs, bs), kh], k_smem.at[slot], k_bars.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bs, bs), kh], v_smem.at[slot], v_bars.at[slot])

  pl.when(count > 0)(lambda: fetch(jnp.int32(0)))
  counts = None
  if p.needs_counts:
    counts = tools.cast(jnp.full((ROWS,), counts_ref[b, t, kh], jnp.float32), 1)
  row = on_rows(nz.row_inputs, ROWS)(None, counts)
  plgpu.barrier_wait(q_bar.at[0])
  kcol = tools.iota((ROWS, bs), 1)

  def step(masked, s, st):
    pl.when(s + 1 < count)(lambda: fetch(s + 1))
    slot, j = lax.rem(s, STAGES), idx_ref[b, t, kh, s]
    plgpu.barrier_wait(k_bars.at[slot])
    plgpu.barrier_wait(v_bars.at[slot])
    z = tools.mm((ROWS, bs), None, k_smem.at[slot], a_ref=q_smem, trans_b=True) * p.scale
    allowed = tiles.allowed(p, j, t, kcol) if masked else None
    v_slot = v_smem.at[slot]
    pv = lambda w: tools.mm((ROWS, p.Hv), w.astype(v_slot.dtype), v_slot)
    visit = lambda st, z, allowed, row, pv_: nz.visit(
      st, z, allowed, pv_, row, p.with_stats, j == 0
    )
    return on_rows(visit, ROWS, pv=pv, width=p.Hv, iota=tools.any_iota())(st, z, allowed, row)

  st = _init_state(tools, nz, p.Hv, p.with_stats)
  last = jnp.maximum(count - 1, 0)
  st = lax.fori_loop(0, last, functools.partial(step, False), st)
  st = lax.fori_loop(last, count, functools.partial(step, True), st)  # the last block: masked
  out, res, srow = on_rows(lambda st, row: nz.finish(st, row, p.with_stats), ROWS)(st, row)
  values = dict(res, **(srow or {}))
  q_smem[...] = out.astype(q_smem.dtype)  # the output takes the query tile's place
  for r, key in enumerate(out_keys):
    rows_smem.at[r][...] = jnp.broadcast_to(values[key], (ROWS,)).astype(jnp.float32)
  pairs = [(head_rows, o_ref.at[b, t, kh])]
  pairs += [(rows_smem.at[r], ref.at[b, t, kh]) for r, ref in enumerate(row_refs)]
  tools.store(pairs)


def _query_scratch(p: Plan, dtype, nrows: int, tiles_in: int = 1):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  tr = _transforms(dtype)
  bs = p.block_size
  scratch = [plgpu.SMEM((ROWS, p.H), dtype, transforms=tr) for _ in range(tiles_in)]
  scratch += [
    plgpu.SMEM((STAGES, bs, p.H), dtype, transforms=tr),
    plgpu.SMEM((STAGES, bs, p.Hv), dtype, transforms=tr),
    plgpu.SMEM((max(1, nrows), ROWS), jnp.float32),
    plgpu.Barrier(num_barriers=tiles_in + nrows),
    plgpu.Barrier(num_barriers=STAGES),
    plgpu.Barrier(num_barriers=STAGES),
  ]
  if p.interpret:
    scratch.append(plgpu.SMEM((ROWS, bs), dtype, transforms=tr))
  return scratch


def query_forward(p: Plan, q, k, v, blocks, counts):
  """The query-major forward: ``(out [B, T, N, Hv], residual rows, statistics rows)``, rows
  ``{name: [B, T, N, 1]}`` float32; ``counts`` ``[B, T, K]`` (or None)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, T, K, G = p.B, p.T, p.K, p.G
  Gp = _group_rows(G)
  state, res_keys, stat_keys = tiles.state_layout(p.nz, G, p.Hv, p.with_stats)
  del state
  out_keys = res_keys + stat_keys
  qg = _grouped(q, p, Gp)
  args = [qg, _padded_keys(k, p), _padded_keys(v, p), blocks.idx, blocks.count]
  if p.needs_counts:
    args.append(counts)
  rows = jax.ShapeDtypeStruct((B, T, K, ROWS), jnp.float32)  # whole vectors: TMA copies
  scratch = _query_scratch(p, q.dtype, len(out_keys))
  scratch = scratch[:4] + [plgpu.Barrier(num_barriers=1)] + scratch[5:]
  outs = plgpu.kernel(
    _named(
      f"attnjax_selected_gpu_fwd_{p.normalizer}",
      lambda *refs: _query_fwd_kernel(
        p, out_keys, refs[: len(args) + 1 + len(out_keys)], refs[len(args) + 1 + len(out_keys) :]
      ),
    ),
    out_type=[jax.ShapeDtypeStruct((B, T, K, Gp, p.Hv), q.dtype)] + [rows] * len(out_keys),
    scratch_types=scratch,
    grid=(B, K, T),  # tokens on CUDA's x axis (2^31 - 1 blocks; y, z: 65535)
    grid_names=("batch", "heads", "tokens"),
    interpret=_interpret(p),
  )(*args)
  ungroup = lambda x: jnp.reshape(x[:, :, :, :G], (B, T, p.N) + x.shape[4:])
  out = ungroup(outs[0])
  vals = {key: ungroup(x)[..., None] for key, x in zip(out_keys, outs[1:])}
  return out, {key: vals[key] for key in res_keys}, {key: vals[key] for key in stat_keys}


def _grouped(x, p: Plan, Gp: int):
  """``[B, T, N, X] -> [B, T, K, Gp, X]``, each group's heads padded with zero rows to ``Gp``."""
  xg = jnp.reshape(x, (p.B, p.T, p.K, p.G, x.shape[-1]))
  return xg if Gp == p.G else jnp.pad(xg, ((0, 0), (0, 0), (0, 0), (0, Gp - p.G), (0, 0)))


def _row_args(rows, res_keys, has_dot: bool, has_g: bool):
  """``(res, row_dot, g)`` of the row inputs ``[row_dot?, g?, *residuals]``."""
  i = int(has_dot)
  res = dict(zip(res_keys, rows[i + int(has_g) :]))
  return res, (rows[0] if has_dot else None), (rows[i] if has_g else None)


def _query_dq_kernel(p: Plan, res_keys, has_dot, has_g, nrows, refs, scratch):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  nz = p.nz
  q_ref, k_ref, v_ref, do_ref, rows_ref, idx_ref, cnt_ref, dq_ref = refs
  q_smem, do_smem, k_smem, v_smem, rows_smem, in_bars, k_bars, v_bars = scratch[:8]
  tools = _Tools(p, scratch[8] if p.interpret else None)
  t, kh, b = lax.axis_index("tokens"), lax.axis_index("heads"), lax.axis_index("batch")
  Gp, bs = _group_rows(p.G), p.block_size
  count = cnt_ref[b, t, kh]
  head = lambda ref: ref if Gp == ROWS else ref.at[pl.ds(0, Gp)]
  plgpu.copy_gmem_to_smem(q_ref.at[b, t, kh], head(q_smem), in_bars.at[0])
  plgpu.copy_gmem_to_smem(do_ref.at[b, t, kh], head(do_smem), in_bars.at[1])
  for r in range(nrows):
    plgpu.copy_gmem_to_smem(rows_ref.at[r, b, t, kh], rows_smem.at[r], in_bars.at[2 + r])

  def fetch(s):
    j, slot = idx_ref[b, t, kh, s], lax.rem(s, STAGES)
    plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * bs, bs), kh], k_smem.at[slot], k_bars.at[slot])
    plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bs, bs), kh], v_smem.at[slot], v_bars.at[slot])

  pl.when(count > 0)(lambda: fetch(jnp.int32(0)))
  for r in range(2 + nrows):
    plgpu.barrier_wait(in_bars.at[r])
  rows = [tools.vector(rows_smem.at[r], 1) for r in range(nrows)]
  res, row_dot, g = _row_args(rows, res_keys, has_dot, has_g)
  kcol = tools.iota((ROWS, bs), 1)
  rule = on_rows(nz.tile_backward, ROWS, iota=tools.any_iota())

  def step(masked, s, dq):
    pl.when(s + 1 < count)(lambda: fetch(s + 1))
    slot, j = lax.rem(s, STAGES), idx_ref[b, t, kh, s]
    plgpu.barrier_wait(k_bars.at[slot])
    plgpu.barrier_wait(v_bars.at[slot])
    k_slot = k_smem.at[slot]
    z = tools.mm((ROWS, bs), None, k_slot, a_ref=q_smem, trans_b=True) * p.scale
    dp = tools.mm((ROWS, bs), None, v_smem.at[slot], a_ref=do_smem, trans_b=True)
    allowed = tiles.allowed(p, j, t, kcol) if masked else None
    _, dz = rule(z, allowed, dp, res, row_dot, g)
    return tools.mm((ROWS, p.H), dz.astype(k_slot.dtype), k_slot, acc=dq)

  dq = tools.cast(jnp.zeros((ROWS, p.H), jnp.float32))
  last = jnp.maximum(count - 1, 0)
  dq = lax.fori_loop(0, last, functools.partial(step, False), dq)
  dq = lax.fori_loop(last, count, functools.partial(step, True), dq)
  q_smem[...] = (dq * p.scale).astype(q_smem.dtype)
  tools.store([(head(q_smem), dq_ref.at[b, t, kh])])


def query_dq(p: Plan, q, k, v, do, rows, res_keys, has_dot, has_g, blocks):
  """The query-major dq kernel: ``dq [B, T, N, H]``; ``rows`` the row inputs ``[B, T, N, 1]``
  (``[row_dot?, g?, *residuals]``)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, T, K, G = p.B, p.T, p.K, p.G
  Gp = _group_rows(G)
  nrows = len(rows)
  # whole 64-row vectors per (token, key/value head): a TMA copy moves a multiple of 128 bytes
  grouped_rows = [_grouped(r, p, ROWS)[..., 0] for r in rows]
  rows_in = jnp.stack(grouped_rows) if rows else jnp.zeros((1, B, T, K, ROWS), jnp.float32)
  scratch = _query_scratch(p, q.dtype, nrows, tiles_in=2)
  dq = plgpu.kernel(
    _named(
      f"attnjax_selected_gpu_dq_{p.normalizer}",
      lambda *refs: _query_dq_kernel(p, res_keys, has_dot, has_g, nrows, refs[:8], refs[8:]),
    ),
    out_type=jax.ShapeDtypeStruct((B, T, K, Gp, p.H), q.dtype),
    scratch_types=scratch,
    grid=(B, K, T),  # tokens on CUDA's x axis (2^31 - 1 blocks; y, z: 65535)
    grid_names=("batch", "heads", "tokens"),
    interpret=_interpret(p),
  )(
    _grouped(q, p, Gp),
    _padded_keys(k, p),
    _padded_keys(v, p),
    _grouped(do.astype(q.dtype), p, Gp),
    rows_in,
    blocks.idx,
    blocks.count,
  )
  return jnp.reshape(dq[:, :, :, :G], (B, T, p.N, p.H))


# ---------------------------------------------------------------------------
# Key-block-major forward (parts) and backward (dk, dv, dq parts).


def _item_range(work, p: Plan):
  """int32 ``[B, K, nb]``: each block's first work item and its number of items."""
  w = jnp.arange(p.W, dtype=jnp.int32)
  first = jnp.where(work.first > 0, w, p.W)
  start = jnp.full((p.B, p.K, p.nb), p.W, jnp.int32)
  b = jnp.arange(p.B)[:, None, None]
  kh = jnp.arange(p.K)[None, :, None]
  start = start.at[b, kh, work.block].min(first)
  count = (
    jnp.zeros((p.B, p.K, p.nb), jnp.int32)
    .at[b, kh, work.block]
    .add((work.live > 0).astype(jnp.int32))
  )
  return start, count


def _kv_fwd_kernel(p: Plan, refs, scratch):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  nz = p.part_normalizer
  q_ref, tok_ref, k_ref, v_ref, start_ref, items_ref, o_ref, lse_ref = refs
  (q_smem, tok_smem, k_smem, v_smem, o_smem, lse_smem, kv_bar, q_bars, tok_bars) = scratch[:9]
  tools = _Tools(p, scratch[9] if p.interpret else None)
  j, kh, b = lax.axis_index("blocks"), lax.axis_index("heads"), lax.axis_index("batch")
  bs = p.block_size
  start, items = start_ref[b, kh, j], items_ref[b, kh, j]
  plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * bs, bs), kh], k_smem, kv_bar.at[0])
  plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bs, bs), kh], v_smem, kv_bar.at[1])

  def fetch(u):
    slot, rows = lax.rem(u, STAGES), pl.ds((start + u) * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, kh, rows], q_smem.at[slot], q_bars.at[slot])
    plgpu.copy_gmem_to_smem(tok_ref.at[b, kh, rows], tok_smem.at[slot], tok_bars.at[slot])

  pl.when(items > 0)(lambda: fetch(jnp.int32(0)))
  plgpu.barrier_wait(kv_bar.at[0])
  plgpu.barrier_wait(kv_bar.at[1])
  kcol = tools.iota((ROWS, bs), 1)
  row = nz.row_inputs(None, None)

  def step(u, carry):
    pl.when(u + 1 < items)(lambda: fetch(u + 1))
    slot = lax.rem(u, STAGES)
    plgpu.barrier_wait(q_bars.at[slot])
    plgpu.barrier_wait(tok_bars.at[slot])
    tok = lax.broadcast_in_dim(tools.vector(tok_smem.at[slot], 1), (ROWS, bs), (0,))
    z = tools.mm((ROWS, bs), None, k_smem, a_ref=q_smem.at[slot], trans_b=True) * p.scale
    allowed = tiles.allowed(p, j, tok, kcol)
    pv = lambda w: tools.mm((ROWS, p.Hv), w.astype(v_smem.dtype), v_smem)

    def part(z, allowed, pv_):
      st = nz.init((ROWS, 1), (ROWS, p.Hv), False)
      st = nz.visit(st, z, allowed, pv_, row, False, False)
      out, res, _ = nz.finish(st, row, False)
      return out, res["log_norm"]

    out, lse = on_rows(part, ROWS, pv=pv, width=p.Hv, iota=tools.any_iota())(z, allowed)
    o_smem[...] = out
    lse_smem[...] = jnp.broadcast_to(lse, (ROWS,))
    rows = pl.ds((start + u) * ROWS, ROWS)
    tools.store([(o_smem, o_ref.at[b, kh, rows]), (lse_smem, lse_ref.at[b, kh, rows])])
    return carry

  lax.fori_loop(0, items, step, None)


def kv_forward(p: Plan, qrows, tok, k, v, work):
  """The key-block-major forward: ``(out parts [B, K, W * rows, Hv], log-normaliser parts
  [B, K, W * rows, 1])`` float32 (the merge_part's), items without a token not written."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, K, R = p.B, p.K, p.W * p.rows
  tr = _transforms(qrows.dtype)
  bs = p.block_size
  scratch = [
    plgpu.SMEM((STAGES, ROWS, p.H), qrows.dtype, transforms=tr),
    plgpu.SMEM((STAGES, ROWS), jnp.int32),
    plgpu.SMEM((bs, p.H), qrows.dtype, transforms=tr),
    plgpu.SMEM((bs, p.Hv), qrows.dtype, transforms=tr),
    plgpu.SMEM((ROWS, p.Hv), jnp.float32),
    plgpu.SMEM((ROWS,), jnp.float32),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=STAGES),
    plgpu.Barrier(num_barriers=STAGES),
  ]
  if p.interpret:
    scratch.append(plgpu.SMEM((ROWS, bs), qrows.dtype, transforms=tr))
  start, items = _item_range(work, p)
  out, lse = plgpu.kernel(
    _named("attnjax_selected_gpu_fwd_parts", lambda *refs: _kv_fwd_kernel(p, refs[:8], refs[8:])),
    out_type=[
      jax.ShapeDtypeStruct((B, K, R, p.Hv), jnp.float32),
      jax.ShapeDtypeStruct((B, K, R), jnp.float32),
    ],
    scratch_types=scratch,
    grid=(B, K, p.nb),  # key blocks on CUDA's x axis
    grid_names=("batch", "heads", "blocks"),
    interpret=_interpret(p),
  )(qrows, tok, _padded_keys(k, p), _padded_keys(v, p), start, items)
  return out, lse[..., None]


def _kv_bwd_kernel(p: Plan, res_keys, has_dot, has_g, with_dq, nrows, refs, scratch):
  import jax.experimental.pallas.mosaic_gpu as plgpu

  nz = p.nz
  q_ref, do_ref, rows_ref, tok_ref, k_ref, v_ref, start_ref, items_ref = refs[:8]
  dk_ref, dv_ref = refs[8:10]
  dq_ref = refs[10] if with_dq else None
  (k_smem, v_smem, q_smem, do_smem, rows_smem, tok_smem, ds_smem, dq_smem) = scratch[:8]
  kv_bar, q_bars, do_bars, rows_bars, tok_bars = scratch[8:13]
  tools = _Tools(p, scratch[13] if p.interpret else None)
  j, kh, b = lax.axis_index("blocks"), lax.axis_index("heads"), lax.axis_index("batch")
  bs = p.block_size
  start, items = start_ref[b, kh, j], items_ref[b, kh, j]
  plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(j * bs, bs), kh], k_smem, kv_bar.at[0])
  plgpu.copy_gmem_to_smem(v_ref.at[b, pl.ds(j * bs, bs), kh], v_smem, kv_bar.at[1])

  def fetch(u):
    slot, rows = lax.rem(u, STAGES), pl.ds((start + u) * ROWS, ROWS)
    plgpu.copy_gmem_to_smem(q_ref.at[b, kh, rows], q_smem.at[slot], q_bars.at[slot])
    plgpu.copy_gmem_to_smem(do_ref.at[b, kh, rows], do_smem.at[slot], do_bars.at[slot])
    plgpu.copy_gmem_to_smem(tok_ref.at[b, kh, rows], tok_smem.at[slot], tok_bars.at[slot])
    for r in range(nrows):
      plgpu.copy_gmem_to_smem(
        rows_ref.at[r, b, kh, rows], rows_smem.at[slot, r], rows_bars.at[slot * nrows + r]
      )

  pl.when(items > 0)(lambda: fetch(jnp.int32(0)))
  plgpu.barrier_wait(kv_bar.at[0])
  plgpu.barrier_wait(kv_bar.at[1])
  kpos = j * bs + tools.iota((bs, ROWS), 0)  # tiles are [keys, rows]
  rule = on_rows(nz.tile_backward, ROWS, transposed=True)

  def step(u, carry):
    dk, dv = carry
    pl.when(u + 1 < items)(lambda: fetch(u + 1))
    slot = lax.rem(u, STAGES)
    for bar in (q_bars, do_bars, tok_bars):
      plgpu.barrier_wait(bar.at[slot])
    for r in range(nrows):
      plgpu.barrier_wait(rows_bars.at[slot * nrows + r])
    q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
    tok = lax.broadcast_in_dim(tools.vector(tok_smem.at[slot], 0), (bs, ROWS), (1,))
    rows = [tools.vector(rows_smem.at[slot, r], 0) for r in range(nrows)]
    res, row_dot, g = _row_args(rows, res_keys, has_dot, has_g)
    zt = tools.mm((bs, ROWS), None, q_slot, a_ref=k_smem, trans_b=True) * p.scale
    dpt = tools.mm((bs, ROWS), None, do_slot, a_ref=v_smem, trans_b=True)
    allowed = (kpos <= tok) & (kpos < p.S)
    wt, dzt = rule(zt, allowed, dpt, res, row_dot, g)
    dst = dzt.astype(q_slot.dtype)
    dv = tools.mm((bs, p.Hv), wt.astype(do_slot.dtype), do_slot, acc=dv)
    dk = tools.mm((bs, p.H), dst, q_slot, acc=dk)
    if with_dq:  # dq part = dS K, dS^T staged in shared memory (a transposed lhs)
      ds_smem[...] = dst
      plgpu.commit_smem()
      dq = tools.mm((ROWS, p.H), None, k_smem, a_ref=ds_smem, trans_a=True)
      dq_smem[...] = dq * p.scale
      tools.store([(dq_smem, dq_ref.at[b, kh, pl.ds((start + u) * ROWS, ROWS)])])
    return dk, dv

  zeros = tools.cast(jnp.zeros((bs, p.H), jnp.float32))
  dk, dv = lax.fori_loop(0, items, step, (zeros, zeros))
  k_smem[...] = (dk * p.scale).astype(k_smem.dtype)  # dk, dv take the K and V tiles' places
  v_smem[...] = dv.astype(v_smem.dtype)
  tools.store(
    [(k_smem, dk_ref.at[b, pl.ds(j * bs, bs), kh]), (v_smem, dv_ref.at[b, pl.ds(j * bs, bs), kh])]
  )


def kv_backward(p: Plan, qrows, dorows, rows, res_keys, has_dot, has_g, tok, k, v, work, with_dq):
  """The key-block-major backward: ``(dk [B, S, K, H], dv [B, S, K, Hv], dq parts [B, K,
  W * rows, H] float32 or None)``; ``qrows``, ``dorows`` and the row inputs ``rows`` (each
  ``[B, K, W * rows, 1]``) in the items' rows."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  B, K, R = p.B, p.K, p.W * p.rows
  dtype = qrows.dtype
  tr = _transforms(dtype)
  bs = p.block_size
  nrows = len(rows)
  scratch = [
    plgpu.SMEM((bs, p.H), dtype, transforms=tr),
    plgpu.SMEM((bs, p.Hv), dtype, transforms=tr),
    plgpu.SMEM((STAGES, ROWS, p.H), dtype, transforms=tr),
    plgpu.SMEM((STAGES, ROWS, p.Hv), dtype, transforms=tr),
    plgpu.SMEM((STAGES, max(1, nrows), ROWS), jnp.float32),
    plgpu.SMEM((STAGES, ROWS), jnp.int32),
    plgpu.SMEM((bs, ROWS), dtype, transforms=tr),
    plgpu.SMEM((ROWS, p.H), jnp.float32),
    plgpu.Barrier(num_barriers=2),
    plgpu.Barrier(num_barriers=STAGES),
    plgpu.Barrier(num_barriers=STAGES),
    plgpu.Barrier(num_barriers=STAGES * max(1, nrows)),
    plgpu.Barrier(num_barriers=STAGES),
  ]
  if p.interpret:
    scratch.append(plgpu.SMEM((bs, ROWS), dtype, transforms=tr))
  start, items = _item_range(work, p)
  rows_in = jnp.stack([r[..., 0] for r in rows]) if rows else jnp.zeros((1, B, K, R), jnp.float32)
  kv_out = jax.ShapeDtypeStruct((B, p.Sp, K, p.H), dtype)
  out_type = [kv_out, kv_out] + (
    [jax.ShapeDtypeStruct((B, K, R, p.H), jnp.float32)] if with_dq else []
  )
  outs = plgpu.kernel(
    _named(
      f"attnjax_selected_gpu_dkdv_{p.normalizer}",
      lambda *refs: _kv_bwd_kernel(
        p, res_keys, has_dot, has_g, with_dq, nrows, refs[: 10 + with_dq], refs[10 + with_dq :]
      ),
    ),
    out_type=out_type,
    scratch_types=scratch,
    grid=(B, K, p.nb),  # key blocks on CUDA's x axis
    grid_names=("batch", "heads", "blocks"),
    interpret=_interpret(p),
  )(qrows, dorows.astype(dtype), rows_in, tok, _padded_keys(k, p), _padded_keys(v, p), start, items)
  return outs[0][:, : p.S], outs[1][:, : p.S], (outs[2] if with_dq else None)
