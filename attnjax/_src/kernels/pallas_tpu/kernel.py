"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser: ``implementation="pallas_tpu"``.

FlashAttention-2 on the grid ``(batch, query head, query block, visit)``, the last axis
walking only the key blocks the query block visits (:mod:`attnjax._src.kernels.pallas_tpu.plan`);
the normaliser's online state lives in VMEM scratch, and ``score_mod`` / ``mask_mod`` run
on each tile with their arguments in SMEM. Backward: :mod:`attnjax._src.kernels.pallas_tpu.backward`;
forward mode takes the block-wise twin's tangent. Entry points: :func:`compute`,
:func:`unsupported`, :func:`generation` and :func:`block_sizes_for` (tiles per TPU);
``interpret=True`` runs on any backend.
Guide: docs/guides/kernels.md, section "Pallas Mosaic TPU".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnjax._src import normalizers, op, sharding, layout, options
from attnjax._src.attention_stats import stats_from_padded_rows
from attnjax._src.kernels import kernel_vjp
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.kernels.pallas_tpu import backward
from attnjax._src.kernels.pallas_tpu.plan import (
  FULL,
  LANES,
  MASKED,
  MAX_ARG_SIZE,
  SKIP,
  ScalarTable,
  TpuPlan,
  Tables,
  dot,
  global_indices,
  heads_first,
  logits,
  mod_inputs,
  mod_kinds,
  round_up,
  run_time_table,
  score_mod,
  smem_dtype,
  static_tables,
  take_mods,
  tile_allowed,
  visit_tables,
)

Array = jnp.ndarray

# The custom-call target of a Mosaic kernel in compiled HLO.
MOSAIC_CALL_TARGET = "tpu_custom_call"
DTYPES = (jnp.float32, jnp.bfloat16)
KNOWN_OPTIONS = options.KERNEL_OPTIONS + ("score_mod", "mask_mod", "block_layout")
KNOWN_INPUTS = ("q", "k", "v", "sink_logits", "q_segment_ids", "kv_segment_ids")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (multiples of 128: whole lanes of a vector register).

  Attributes:
    block_q: query rows per forward (and count-pass) tile.
    block_k: keys per forward tile.
    block_q_bwd: query rows per backward tile (dq and dk/dv kernels).
    block_k_bwd: keys per backward tile.
  """

  block_q: int = 512
  block_k: int = 512
  block_q_bwd: int = 256
  block_k_bwd: int = 512

  def __post_init__(self):
    for f in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
      b = getattr(self, f)
      if isinstance(b, bool) or not isinstance(b, int) or b < LANES or b % LANES:
        raise ValueError(f"BlockSizes.{f} must be a positive multiple of {LANES}, got {b!r}")


DEFAULT_BLOCK_SIZES = BlockSizes()

# Block sizes per TPU generation: ``(generation, head dim up to, sizes)``, the first row that
# covers the call. Each row compiles for its chip (tests/test_targets.py: deviceless compiles
# of every normaliser forward + backward on v5e and v6e). The VMEM a step holds is about
# 2 x (q, k, v, dO blocks) double-buffered + the [block_q, block_k] float32 logits and their
# exponentials + the float32 accumulators: under 12 MiB for every row (v5e's default scoped
# VMEM limit is 16 MiB, v6e's 32 MiB). v5e's MXU is 128 x 128, v6e's 256 x 256: v6e takes
# longer key tiles. Untuned for speed (no TPU was lent where they were chosen):
# ``experiments/device_check.py --platform tpu`` measures them.
BLOCK_SIZE_TABLE: tuple[tuple[str, int, BlockSizes], ...] = (
  ("v5e", 128, BlockSizes(512, 512, 256, 512)),
  ("v5e", 256, BlockSizes(256, 512, 256, 256)),
  ("v6e", 128, BlockSizes(512, 1024, 512, 512)),
  ("v6e", 256, BlockSizes(512, 512, 256, 512)),
)
# Device kinds of TPU generations (the ambient mesh's device kind, or this host's TPU).
_GENERATION_BY_KIND = (("v6", "v6e"), ("v5 lite", "v5e"), ("v5e", "v5e"))


def generation() -> Optional[str]:
  """``"v5e"`` / ``"v6e"`` for the TPU a program is traced for (ambient mesh or local), or None."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  kind = getattr(device, "device_kind", None) if device is not None else None
  if kind is None:
    try:
      tpus = jax.devices("tpu")
      kind = tpus[0].device_kind if tpus else None
    except RuntimeError:
      kind = None
  if kind is None:
    return None
  for name, gen in _GENERATION_BY_KIND:
    if name in kind.lower():
      return gen
  return None


def block_sizes_for(head_dim: int, gen: Optional[str] = None) -> BlockSizes:
  """The :data:`BLOCK_SIZE_TABLE` row for a head dim (the larger of q's and v's) and a TPU
  generation (None or another chip: the v5e rows, which fit every chip's VMEM from v5e on)."""
  gen = gen if gen in ("v5e", "v6e") else "v5e"
  for row_gen, max_head, sizes in BLOCK_SIZE_TABLE:
    if row_gen == gen and head_dim <= max_head:
      return sizes
  # Longer heads: the smallest tiles of the generation (VMEM grows with the head dim).
  return BlockSizes(256, 256, 128, 256)


def unsupported(inputs, opts, *, interpret: bool = False) -> list[str]:
  """Reasons ``pallas_tpu`` cannot honour a call ([] = supported); lists unknown options too
  (the same in interpret mode)."""
  del interpret
  reasons = options.array_refusals(
    "pallas_tpu", inputs, opts, "is_causal, window, segment_ids and argument-free mask_mod"
  )
  for name, fn, args, score in (
    ("score_mod", opts.score_mod, inputs.score_mod_args, True),
    ("mask_mod", opts.mask_mod, inputs.mask_mod_args, False),
  ):
    why = None if fn is None else _not_in_kernel(fn, args, score)
    if why:
      reasons.append(f"this {name} (the kernel cannot evaluate it: {why})")
  reasons += options.unknown_options(
    opts,
    inputs,
    KNOWN_OPTIONS,
    KNOWN_INPUTS + ("bias", "mask", "score_mod_args", "mask_mod_args"),
    "pallas_tpu",
  )
  dtypes = {inputs.q.dtype, inputs.k.dtype, inputs.v.dtype}
  if len(dtypes) != 1 or inputs.q.dtype not in DTYPES:
    reasons.append(
      f"dtypes {sorted(str(d) for d in dtypes)} (pallas_tpu takes float32 or "
      "bfloat16 for q, k and v)"
    )
  return reasons


def _not_in_kernel(fn, args, score: bool) -> Optional[str]:
  """Why a modifier cannot run in the kernel body, or None: its arguments must be small
  1-D / 2-D tables (held in SMEM) that it reads by scalar index (``slopes[n]``), which one
  trace on a tile's index shapes finds out."""
  for a in args:
    if jnp.ndim(a) not in (1, 2) or jnp.size(a) > MAX_ARG_SIZE:
      return (
        f"an argument of shape {tuple(jnp.shape(a))}: the kernel keeps 1-D or 2-D "
        f"tables of at most {MAX_ARG_SIZE} elements"
      )
  tables = [
    ScalarTable(
      jnp.shape(a),
      smem_dtype(jnp.result_type(a)),
      lambda idx, a=a: jnp.zeros((), smem_dtype(jnp.result_type(a))),
    )
    for a in args
  ]
  index = jax.ShapeDtypeStruct((), jnp.int32)
  rows, cols = jax.ShapeDtypeStruct((8, 1), jnp.int32), jax.ShapeDtypeStruct((1, LANES), jnp.int32)
  lead = (jax.ShapeDtypeStruct((8, LANES), jnp.float32),) if score else ()
  try:
    jax.eval_shape(lambda *x: fn(*x, *tables), *lead, index, index, rows, cols)
  except Exception as e:  # any failure to trace means "not in the kernel"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  return None


def make_plan(inputs, opts, block_sizes: BlockSizes, interpret: bool) -> TpuPlan:
  B, T, N, H = inputs.q.shape
  _, S, K, Hv = inputs.v.shape
  fit = lambda b, L: min(b, round_up(L, LANES))
  bq, bq_bwd = fit(block_sizes.block_q, T), fit(block_sizes.block_q_bwd, T)
  bk, bk_bwd = fit(block_sizes.block_k, S), fit(block_sizes.block_k_bwd, S)
  return TpuPlan(
    opts=opts,
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=Hv,
    Tp=round_up(T, math.lcm(bq, bq_bwd)),
    Sp=round_up(S, math.lcm(bk, bk_bwd)),
    bq=bq,
    bk=bk,
    bq_bwd=bq_bwd,
    bk_bwd=bk_bwd,
    has_sink=inputs.sink_logits is not None,
    has_segments=inputs.q_segment_ids is not None,
    mask_in_kernel=opts.mask_mod is not None,
    score_in_kernel=opts.score_mod is not None,
    interpret=interpret,
    num_score_args=len(inputs.score_mod_args) if opts.score_mod is not None else 0,
    num_mask_args=len(inputs.mask_mod_args) if opts.mask_mod is not None else 0,
    mod_table=opts.mask_mod is not None and bool(inputs.mask_mod_args),
  )


def tables_of(c: TpuPlan, inputs, opts, bq: int, bk: int) -> Tables:
  """Static tables of one block geometry, a ``mask_mod``'s layout included (with arguments:
  its ``block_layout`` when built for this geometry, else its blocks are found per call)."""
  extra = None
  if opts.mask_mod is not None:
    given = None if opts.block_layout is None else _same_blocks(opts.block_layout, c, bq, bk)
    if given is not None:
      extra = given
    elif not c.mod_table:
      used_b, used_n = blockwise.index_use(opts.mask_mod, ())
      extra = _same_blocks(
        layout.from_mask_mod(
          opts.mask_mod,
          c.T,
          c.S,
          bq,
          bk,
          batch=c.B if used_b else None,
          heads=c.N if used_n else None,
        ),
        c,
        bq,
        bk,
      )
  tables = static_tables(c, bq, bk, extra)
  if opts.mask_mod is not None and extra is None and not c.mod_table:
    # No layout of the modifier's blocks: every visited block evaluates it.
    kinds = np.where(tables.kinds == SKIP, SKIP, MASKED).astype(np.int8)
    tables = dataclasses.replace(tables, kinds=kinds)
  return tables


def _same_blocks(lay: layout.BlockLayout, c: TpuPlan, bq: int, bk: int):
  """``lay`` in the kernel's block geometry ``(bq, bk)``, or None if its blocks differ.

  A layout's block is clamped to the length (``from_mask_mod`` with ``bq > T``
  builds ``block_q = T``); with one block on that axis either way the blocks are
  the same.
  """
  if (lay.q_len, lay.kv_len) != (c.T, c.S):
    return None
  same_q = lay.block_q == bq or (lay.num_q_blocks == 1 and -(-c.T // bq) == 1)
  same_k = lay.block_k == bk or (lay.num_kv_blocks == 1 and -(-c.S // bk) == 1)
  if not (same_q and same_k):
    return None
  return layout.BlockLayout(c.T, c.S, bq, bk, lay.kv_blocks, lay.needs_mask)


def compiler_params(dims: int, interpret: bool, sequential: bool = False):
  """Mosaic's grid semantics: the last axis (visits) carries state; with ``sequential`` every
  axis does (a kernel accumulating over the whole grid: score_mod arguments' gradients)."""
  if interpret:
    return None
  parallel = "arbitrary" if sequential else "parallel"
  return pltpu.CompilerParams(dimension_semantics=(parallel,) * (dims - 1) + ("arbitrary",))


# ---------------------------------------------------------------------------
# The count pass and the forward kernel.


def _state_layout(c: TpuPlan, bq: int):
  """``(state keys with shapes, residual keys, statistics keys)`` of the normaliser's online
  state for ``bq`` rows (from its ``init`` / ``finish``, evaluated abstractly)."""
  nz = c.nz
  rows = (bq, 1)
  cnt = jnp.ones(rows, jnp.float32) if c.needs_counts else None
  sink = jnp.zeros(rows, jnp.float32) if c.has_sink else None
  terms = (jnp.zeros(rows, jnp.float32),) * 2 if nz.needs_lse else None

  def run():
    st = nz.init(rows, (bq, c.Hv), c.with_stats)
    return st, nz.finish(st, nz.row_inputs(sink, cnt, terms), c.with_stats)

  st, (_, res, srow) = jax.eval_shape(run)
  state = tuple((key, st[key].shape) for key in sorted(st))
  return state, tuple(sorted(res)), (tuple(sorted(srow)) if srow is not None else ())


def _positions(c: TpuPlan, i, j, bq: int, bk: int):
  qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  return qpos, kpos


def _segments(qseg_ref, kseg_ref):
  if qseg_ref is None:
    return None, None
  return qseg_ref[...][:, :1], kseg_ref[...][:1, :]


def _count_kernel(c: TpuPlan, kind_ref, fetch_ref, *refs):
  it = iter(refs)
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  off_ref, _, mask_args = take_mods(c, it)
  cnt_ref = next(it)
  b, n, i, s = (pl.program_id(a) for a in range(4))
  kind, j = kind_ref[i, s], fetch_ref[i, s]
  gb, gn = global_indices(c, b, n, off_ref)

  @pl.when(s == 0)
  def _():
    cnt_ref[...] = jnp.zeros_like(cnt_ref)

  @pl.when(kind == FULL)
  def _():
    cnt_ref[...] += float(c.bk)

  @pl.when(kind == MASKED)
  def _():
    qpos, kpos = _positions(c, i, j, c.bq, c.bk)
    q_seg, k_seg = _segments(qseg_ref, kseg_ref)
    allowed = tile_allowed(c, qpos, kpos, q_seg, k_seg, gb, gn, mask_args)
    cnt_ref[...] += jnp.sum(allowed.astype(jnp.float32), axis=1, keepdims=True)


def _terms_kernel(c: TpuPlan, width, kind_ref, fetch_ref, *refs):
  """The logits-only pass of a ``needs_lse`` normaliser: each row's softmax max and log-sum
  over its visits (``normalizers.softmax_terms_*``), accumulated in the output rows."""
  it = iter(refs)
  q_ref, k_ref = next(it), next(it)
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  off_ref, score_args, mask_args = take_mods(c, it)
  m_ref, l_ref = next(it), next(it)
  b, n, i, s = (pl.program_id(a) for a in range(4))
  kind, j = kind_ref[i, s], fetch_ref[i, s]
  gb, gn = global_indices(c, b, n, off_ref)

  @pl.when(s == 0)
  def _():
    m0, l0 = normalizers.softmax_terms_init((c.bq, 1))
    m_ref[...], l_ref[...] = m0, l0

  def visit(masked: bool):
    qpos, kpos = _positions(c, i, j, c.bq, c.bk)
    z, _ = logits(c, q_ref[...], k_ref[...])
    z = score_mod(c, z, qpos, kpos, gb, gn, score_args)
    allowed = None
    if masked:
      q_seg, k_seg = _segments(qseg_ref, kseg_ref)
      allowed = tile_allowed(c, qpos, kpos, q_seg, k_seg, gb, gn, mask_args)
    m, l = normalizers.softmax_terms_visit((m_ref[...], l_ref[...]), z, allowed)
    m_ref[...], l_ref[...] = m, l

  pl.when(kind == FULL)(lambda: visit(False))
  pl.when(kind == MASKED)(lambda: visit(True))

  @pl.when(s == width - 1)
  def _():
    m, log_sum = normalizers.softmax_terms_finish((m_ref[...], l_ref[...]))
    m_ref[...], l_ref[...] = m, log_sum


def softmax_terms(c: TpuPlan, kind, fetch, qh, kh, q_seg, kv_seg, mods) -> tuple[Array, Array]:
  """Each row's ``(max, log_sum)`` ``[B, N, Tp, 1]`` float32 (the logits-only pass)."""
  nq, width = kind.shape
  G = c.G
  args = [qh, kh]
  in_specs = [
    pl.BlockSpec((None, None, c.bq, c.H), lambda b, n, i, s, kr, fr: (b, n, i, 0)),
    pl.BlockSpec(
      (None, None, c.bk, c.H), lambda b, n, i, s, kr, fr: (b, jax.lax.div(n, G), fr[i, s], 0)
    ),
  ]
  if c.has_segments:
    args += [q_seg, kv_seg]
    in_specs += _seg_specs(
      c, c.bq, c.bk, lambda b, n, i, s, kr, fr: i, lambda b, n, i, s, kr, fr: fr[i, s]
    )
  args += mods[0]
  in_specs += mods[1]
  row = pl.BlockSpec((None, None, c.bq, 1), lambda b, n, i, s, kr, fr: (b, n, i, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2, grid=(c.B, c.N, nq, width), in_specs=in_specs, out_specs=[row, row]
  )
  rows = jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32)
  m, log_sum = pl.pallas_call(
    functools.partial(_terms_kernel, c, width),
    grid_spec=grid_spec,
    out_shape=[rows, rows],
    compiler_params=compiler_params(4, c.interpret),
    interpret=c.interpret,
    name="attnjax_tpu_softmax_terms",
  )(kind, fetch, *args)
  return m, log_sum


def _fwd_kernel(c: TpuPlan, state, res_keys, stat_keys, width, kind_ref, fetch_ref, *refs):
  nz = c.nz
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  sink_ref = next(it) if c.has_sink else None
  cnt_ref = next(it) if c.needs_counts else None
  terms_refs = (next(it), next(it)) if nz.needs_lse else None
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  off_ref, score_args, mask_args = take_mods(c, it)
  o_ref = next(it)
  res_refs = {key: next(it) for key in res_keys}
  stat_refs = {key: next(it) for key in stat_keys}
  st_refs = {key: next(it) for key, _ in state}

  b, n, i, s = (pl.program_id(a) for a in range(4))
  kind, j = kind_ref[i, s], fetch_ref[i, s]
  gb, gn = global_indices(c, b, n, off_ref)
  bq, bk = c.bq, c.bk

  def row_inputs():
    sink = None
    if c.has_sink:
      sink = jnp.full((bq, 1), sink_ref[n], jnp.float32)
    terms = None if terms_refs is None else tuple(r[...] for r in terms_refs)
    return nz.row_inputs(sink, cnt_ref[...] if c.needs_counts else None, terms)

  @pl.when(s == 0)
  def _():
    for key, val in nz.init((bq, 1), (bq, c.Hv), c.with_stats).items():
      st_refs[key][...] = val

  def visit(masked: bool):
    st = {key: ref[...] for key, ref in st_refs.items()}
    qpos, kpos = _positions(c, i, j, bq, bk)
    z, _ = logits(c, q_ref[...], k_ref[...])
    z = score_mod(c, z, qpos, kpos, gb, gn, score_args)
    allowed = None
    if masked:
      q_seg, k_seg = _segments(qseg_ref, kseg_ref)
      allowed = tile_allowed(c, qpos, kpos, q_seg, k_seg, gb, gn, mask_args)
    v = v_ref[...]
    st = nz.visit(
      st, z, allowed, lambda w: dot(w.astype(v.dtype), v), row_inputs(), c.with_stats, j == 0
    )
    for key, ref in st_refs.items():
      ref[...] = st[key]

  pl.when(kind == FULL)(lambda: visit(False))
  pl.when(kind == MASKED)(lambda: visit(True))

  @pl.when(s == width - 1)
  def _():
    st = {key: ref[...] for key, ref in st_refs.items()}
    out, res, srow = nz.finish(st, row_inputs(), c.with_stats)
    o_ref[...] = out.astype(o_ref.dtype)
    for key in res_keys:
      res_refs[key][...] = jnp.broadcast_to(res[key], (bq, 1)).astype(jnp.float32)
    for key in stat_keys:
      stat_refs[key][...] = jnp.broadcast_to(srow[key], (bq, 1)).astype(jnp.float32)


def _seg_specs(c: TpuPlan, bq: int, bk: int, q_block, k_block):
  """BlockSpecs of the segment-id layouts: ``q_block(grid ids) -> query block``, likewise keys."""
  return [
    pl.BlockSpec((None, bq, LANES), lambda *a: (a[0], q_block(*a), 0)),
    pl.BlockSpec((None, 8, bk), lambda *a: (a[0], 0, k_block(*a))),
  ]


def counts(c: TpuPlan, kind, fetch, q_seg, kv_seg, mods) -> Array:
  """Allowed keys per row ``[B, N, Tp, 1]`` float32 (the mask-only pass)."""
  nq, width = kind.shape
  args, in_specs = [], []
  if c.has_segments:
    args += [q_seg, kv_seg]
    in_specs += _seg_specs(
      c, c.bq, c.bk, lambda b, n, i, s, kr, fr: i, lambda b, n, i, s, kr, fr: fr[i, s]
    )
  args += mods[0]
  in_specs += mods[1]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(c.B, c.N, nq, width),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, None, c.bq, 1), lambda b, n, i, s, kr, fr: (b, n, i, 0)),
  )
  return pl.pallas_call(
    functools.partial(_count_kernel, c),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32),
    compiler_params=compiler_params(4, c.interpret),
    interpret=c.interpret,
    name="attnjax_tpu_counts",
  )(kind, fetch, *args)


def forward(
  c: TpuPlan,
  tables: Tables,
  q,
  k,
  v,
  sink,
  q_seg,
  kv_seg,
  score_args=(),
  mask_args=(),
  offsets=None,
):
  """Runs the forward kernels: ``(out [B, N, Tp, Hv], residual rows, statistics rows)``;
  ``offsets``: the first batch row and query head of these arrays in the whole call."""
  state, res_keys, stat_keys = _state_layout(c, c.bq)
  qh, kh, vh, q_seg, kv_seg = heads_first(c, q, k, v, q_seg, kv_seg)
  kinds = run_time_table(
    c,
    tables,
    q_seg[:, :, 0] if c.has_segments else None,
    kv_seg[:, 0, :] if c.has_segments else None,
    c.bq,
    c.bk,
    mod_kinds(c, c.opts, mask_args, c.bq, c.bk, offsets),
  )
  kind, fetch = visit_tables(kinds, tables.kv_index, tables.kv_count, transpose=False)
  nq, width = kind.shape
  G = c.G
  mods = mod_inputs(c, score_args, mask_args, offsets)
  cnt = counts(c, kind, fetch, q_seg, kv_seg, mods) if c.needs_counts else None
  terms = None
  if c.nz.needs_lse:
    terms = softmax_terms(c, kind, fetch, qh, kh, q_seg, kv_seg, mods)

  in_specs = [
    pl.BlockSpec((None, None, c.bq, c.H), lambda b, n, i, s, kr, fr: (b, n, i, 0)),
    pl.BlockSpec(
      (None, None, c.bk, c.H), lambda b, n, i, s, kr, fr: (b, jax.lax.div(n, G), fr[i, s], 0)
    ),
    pl.BlockSpec(
      (None, None, c.bk, c.Hv), lambda b, n, i, s, kr, fr: (b, jax.lax.div(n, G), fr[i, s], 0)
    ),
  ]
  args = [qh, kh, vh]
  row_spec = pl.BlockSpec((None, None, c.bq, 1), lambda b, n, i, s, kr, fr: (b, n, i, 0))
  if c.has_sink:
    args.append(jnp.reshape(sink.astype(jnp.float32), (c.N,)))
    in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
  if c.needs_counts:
    args.append(cnt)
    in_specs.append(row_spec)
  if terms is not None:
    args += list(terms)
    in_specs += [row_spec, row_spec]
  if c.has_segments:
    args += [q_seg, kv_seg]
    in_specs += _seg_specs(
      c, c.bq, c.bk, lambda b, n, i, s, kr, fr: i, lambda b, n, i, s, kr, fr: fr[i, s]
    )
  args += mods[0]
  in_specs += mods[1]
  rows = jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((c.B, c.N, c.Tp, c.Hv), q.dtype)] + [rows] * (
    len(res_keys) + len(stat_keys)
  )
  out_specs = [pl.BlockSpec((None, None, c.bq, c.Hv), lambda b, n, i, s, kr, fr: (b, n, i, 0))] + [
    row_spec
  ] * (len(res_keys) + len(stat_keys))
  scratch = [pltpu.VMEM(shape, jnp.float32) for _, shape in state]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(c.B, c.N, nq, width),
    in_specs=in_specs,
    out_specs=out_specs,
    scratch_shapes=scratch,
  )
  outs = pl.pallas_call(
    functools.partial(_fwd_kernel, c, state, res_keys, stat_keys, width),
    grid_spec=grid_spec,
    out_shape=out_shape,
    compiler_params=compiler_params(4, c.interpret),
    interpret=c.interpret,
    name=f"attnjax_tpu_fwd_{c.opts.normalizer}",
  )(kind, fetch, *args)
  out = outs[0]
  res = dict(zip(res_keys, outs[1 : 1 + len(res_keys)]))
  srow = dict(zip(stat_keys, outs[1 + len(res_keys) :]))
  return out, res, srow


# ---------------------------------------------------------------------------
# The kernel with its custom VJP.


def compute(
  inputs,
  opts,
  *,
  block_sizes: Optional[BlockSizes] = None,
  interpret: bool = False,
  shard_offsets=None,
):
  """Pallas TPU attention of a validated dense call (see the module docstring).

  The call is one :func:`unsupported` accepts (checked once, by :func:`attnjax._src.op.run_engine`).
  The forward and the backward are each traced when the program is lowered, for the TPU it
  is compiled for (``attnjax._src.kernels.on_target.call``): tiles and Mosaic's lowering
  follow the target, whatever the host.

  Args:
    inputs: :class:`attnjax.options.DenseInputs` (see :func:`unsupported`).
    opts: :class:`attnjax.options.DenseOptions`.
    block_sizes: tiles (:class:`BlockSizes`); None: the :data:`BLOCK_SIZE_TABLE` row of the
      TPU generation the kernels are compiled for (``generation``).
    interpret: run the kernels in Pallas interpret mode (any backend).
    shard_offsets: where this call's batch rows and heads start in a call split by
      :func:`attnjax._src.sharding.per_shard` (an :class:`attnjax._src.sharding.ShardOffsets`;
      None: 0, 0): a modifier reading the batch or head index sees the whole call's.

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)``.
  """
  mask_args = tuple(inputs.mask_mod_args) if opts.mask_mod is not None else ()
  # A mask_mod reading the batch or head index of a shard of the call: its blocks are found
  # per call from the shard's rows and heads (a static layout would be the first shard's).
  where = tuple(sharding.ShardOffsets() if shard_offsets is None else shard_offsets)
  shifted = _shifted_indices(opts.mask_mod, mask_args, where)

  def plan(q, k, v, sink, q_seg, kv_seg, score_args, mask_args):
    """The plan of the call in these arrays, for the target being lowered for."""
    part = kernel_vjp.dense_inputs(q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    sizes = block_sizes
    if sizes is None:
      sizes = block_sizes_for(max(q.shape[-1], v.shape[-1]), generation())
    c = make_plan(part, opts, sizes, interpret)
    if shifted:
      c = dataclasses.replace(c, mod_table=True)
    return c, part

  def fwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args):
    c, part = plan(q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    tables = tables_of(c, part, opts, c.bq, c.bk)
    out, res, srow = forward(
      c,
      tables,
      q,
      k,
      v,
      sink,
      q_seg,
      kv_seg,
      score_args,
      mask_args,
      (shard.batch_offset, shard.head_offset),
    )
    stats = stats_from_padded_rows(srow, c.T, opts.empty_row_logsumexp) if c.with_stats else None
    if c.with_stats:
      res = dict(res, has_key=srow["has_key"])
    # Saved without the block padding (the blocks are the target's): the output heads-first
    # [B, N, T, Hv] and the rows [B, N, T] (a [.., Tp, 1] array takes whole 128-lane tiles).
    out = out[:, :, : c.T]
    res = {key: val[:, :, : c.T, 0] for key, val in res.items()}
    return (jnp.transpose(out, (0, 2, 1, 3)), stats), (out, res)

  def bwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args, saved, d_out, d_lse):
    c, part = plan(q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    out, res = saved
    tables = tables_of(c, part, opts, c.bq_bwd, c.bk_bwd)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, c.Tp - c.T)) + ((0, 0),) * (x.ndim - 3))
    res = {key: pad(val)[..., None] for key, val in res.items()}
    dq, dk, dv, dsink, _, _, dscore, _ = backward.backward(
      c,
      tables,
      q,
      k,
      v,
      sink,
      q_seg,
      kv_seg,
      pad(out),
      res,
      d_out,
      d_lse,
      score_args,
      mask_args,
      (shard.batch_offset, shard.head_offset),
    )
    return dq, dk, dv, dsink, [d for d in dscore if d.dtype != jax.dtypes.float0]

  steps = kernel_vjp.Steps(
    f"pallas_tpu_{opts.normalizer}", fwd_step, bwd_step, on_target=True, mosaic=not interpret
  )
  return kernel_vjp.differentiable(inputs, opts, steps, shard_offsets=where)


def _shifted_indices(mask_mod, mask_args, offsets) -> bool:
  """Whether ``mask_mod`` reads a batch or head index that starts elsewhere than 0 here (a
  traced shard offset: inside ``shard_map``)."""
  if mask_mod is None:
    return False
  used_b, used_n = blockwise.index_use(mask_mod, mask_args)
  moved = [not (isinstance(o, int) and o == 0) for o in offsets]
  return (used_b and moved[0]) or (used_n and moved[1])


# The engine as dispatch sees it (:class:`attnjax._src.op.Engine`): the dense op lists it.
ENGINE = op.platform_kernel(
  "pallas_tpu", compute, unsupported, platform="tpu", where="runs on a TPU only (a Mosaic kernel)"
)
run = op.deprecated_run(ENGINE, "attnjax.kernels.pallas_tpu")
attention = options.engine_entry(
  op.dense_runner(ENGINE), "pallas_tpu", ("block_sizes", "interpret")
)
attention.__doc__ = """The Pallas TPU kernel called like :func:`attnjax.dot_product_attention`.

``attention(q, k, v, *, <dense options>, block_sizes=None, interpret=False)``:
every keyword of :func:`attnjax.dot_product_attention` but ``implementation``
(``bias`` and ``mask`` arrays and modifiers with arguments are refused, see
:func:`unsupported`), the kernel's :class:`BlockSizes`, and ``interpret=True``
to run it in Pallas interpret mode on any backend. Over several devices the
kernel runs on each device's batch rows and heads, as in
:func:`attnjax.dot_product_attention`.
"""
