"""A Pallas GPU (Triton) flash-attention kernel for every normaliser: ``implementation="pallas_gpu"``.

The forward is FlashAttention-2: one program per (batch, query head, query block) walks
the key blocks its rows may attend (skipped blocks never visited, interior blocks
unmasked), keeping the normaliser's online state (:meth:`Normalizer.init` /
:meth:`~Normalizer.visit` / :meth:`~Normalizer.finish`; no branch on a normaliser's
name). Backward: :mod:`attnjax._src.kernels.pallas_gpu.backward`; forward mode takes the
block-wise twin's tangent. Entry points: :func:`compute`, :func:`unsupported` (bias and
mask arrays, ``neg_sq_euclidean``, unknown options); ``interpret=True`` runs on any backend.
Guide: docs/guides/kernels.md, section "Pallas Triton".
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnjax._src import lowering, normalizers, op, target, options
from attnjax._src.kernels import kernel_vjp
from attnjax._src.kernels.pallas_gpu import backward
from attnjax._src.kernels.pallas_gpu.plan import (
  heads_first,
  GridPlan,
  compiler_params,
  dot,
  kv_block_bounds,
  full_kv_blocks,
  logits,
  make_plan,
  tile_allowed,
  visit_loop,
)
from attnjax._src.attention_stats import stats_from_padded_rows

Array = jnp.ndarray

# The custom-call target of a Pallas Triton kernel in lowered StableHLO.
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
# DenseOptions fields this kernel honours; any other field set away from its default is
# reported by unsupported() (a new option must be taught here before dispatch picks this path).
KNOWN_OPTIONS = options.KERNEL_OPTIONS
# DenseInputs fields this kernel honours (bias and mask arrays are refused).
KNOWN_INPUTS = ("q", "k", "v", "sink_logits", "q_segment_ids", "kv_segment_ids")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes and Triton launch parameters (powers of two, at least 16).

  The defaults are the usual FlashAttention-2 Triton choices for Hopper-class
  GPUs (H100/H200: 128-row query tiles against 64-key tiles forward, 64 x 64
  backward, 4 warps for head dim <= 64 and 8 above, 2-3 pipeline stages). They
  are not tuned: no GPU was available where this kernel was written, and
  ``experiments/device_check.py`` is the place to measure them.

  Attributes:
    block_q: query rows per forward program.
    block_k: keys per forward tile.
    block_q_bwd: query rows per dq program (and per dk/dv loop step, unless ``block_q_dkdv``).
    block_k_bwd: keys per dq loop step (and per dk/dv program, unless ``block_k_dkdv``).
    block_q_dkdv: query rows per dk/dv loop step (None: ``block_q_bwd``).
    block_k_dkdv: keys per dk/dv program (None: ``block_k_bwd``).
    num_warps: warps per program (None: 4 if the head dim is <= 64, else 8).
    num_stages: software-pipelining stages of the forward kernel.
    num_stages_bwd: the same for the backward kernels.
  """

  block_q: int = 128
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64
  num_warps: Optional[int] = None
  num_stages: int = 3
  num_stages_bwd: int = 2
  block_q_dkdv: Optional[int] = None
  block_k_dkdv: Optional[int] = None

  def __post_init__(self):
    for f in ("block_q", "block_k", "block_q_bwd", "block_k_bwd", "block_q_dkdv", "block_k_dkdv"):
      b = getattr(self, f)
      if b is None and f.endswith("_dkdv"):
        continue
      if isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1):
        raise ValueError(f"BlockSizes.{f} must be a power of two >= 16, got {b!r}")


DEFAULT_BLOCK_SIZES = BlockSizes()
# The backward of the Triton tutorial's fused attention for sm_80 (4 warps): each kernel's
# programs hold 128 rows (dq) or 128 keys (dk/dv), whose float32 accumulators stay in
# registers for the whole walk, and step over 32 keys / rows, whose recomputed tiles are
# transient; at head dims <= 64 the accumulators of a 128-key dk/dv program (dk and dv) are
# 128 registers a thread. Speed unmeasured here (no GPU was lent).
AMPERE_SMALL_HEADS = BlockSizes(block_q_bwd=128, block_k_bwd=32, block_q_dkdv=32, block_k_dkdv=128)

# Block sizes per target: ``(compute capability major, head dim up to, input element bytes)``,
# rows in order, the first that covers the call. Each row compiles for its targets' limits
# (checked by tests/test_targets.py with deviceless compiles for an A100, H100 and H200, every
# normaliser forward + backward with statistics): the tiles, times the pipeline stages, must
# fit the shared memory per block (sm_80: 163 KiB; sm_90: 227 KiB). Head dims are padded to
# powers of two. ``major=None`` (the target is unknown while tracing) takes the sm_80 rows,
# which fit every GPU from the A100 on. Untuned for speed: no GPU was lent where they were
# chosen; ``experiments/device_check.py`` measures them.
BLOCK_SIZE_TABLE: tuple[tuple[int, int, int, BlockSizes], ...] = (
  # major, head dim <=, bytes, sizes
  (9, 128, 2, DEFAULT_BLOCK_SIZES),
  (9, 256, 2, BlockSizes(block_q=128, block_k=64, num_stages=2)),
  (9, 128, 4, DEFAULT_BLOCK_SIZES),
  (
    9,
    256,
    4,
    BlockSizes(
      block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_stages=2, num_stages_bwd=1
    ),
  ),
  (8, 64, 2, AMPERE_SMALL_HEADS),
  (8, 128, 2, DEFAULT_BLOCK_SIZES),
  (8, 256, 2, BlockSizes(block_q=64, block_k=64, num_stages=2)),
  (8, 64, 4, DEFAULT_BLOCK_SIZES),
  (8, 128, 4, BlockSizes(block_q=64, block_k=64, num_stages=2)),
  (
    8,
    256,
    4,
    BlockSizes(
      block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_stages=2, num_stages_bwd=1
    ),
  ),
)


def block_sizes_for(head_dim: int, dtype, major: Optional[int] = None) -> BlockSizes:
  """The :data:`BLOCK_SIZE_TABLE` row for a call: head dim (the larger of q's and v's), the
  inputs' dtype, and the target's compute capability major (None: unknown, the sm_80 rows).

  Generations after Hopper take the sm_90 rows (their shared memory is as large).
  """
  major = 8 if major is None or major < 9 else 9
  nbytes = jnp.dtype(dtype).itemsize
  for row_major, max_head, row_bytes, sizes in BLOCK_SIZE_TABLE:
    if row_major == major and head_dim <= max_head and nbytes <= row_bytes:
      return sizes
  raise ValueError(
    f"pallas_gpu has no block sizes for head dim {head_dim} "
    f"(the table stops at {max(r[1] for r in BLOCK_SIZE_TABLE)})"
  )


def unsupported(inputs, opts, *, interpret: bool = False) -> list[str]:
  """Reasons ``pallas_gpu`` cannot honour a call ([] = supported); lists unknown options too
  (the same in interpret mode)."""
  del interpret
  reasons = options.array_refusals("pallas_gpu", inputs, opts, "is_causal, window and segment_ids")
  reasons += options.unknown_options(
    opts, inputs, KNOWN_OPTIONS, KNOWN_INPUTS + ("bias", "mask"), "pallas_gpu"
  )
  head_dim = max(inputs.q.shape[-1], inputs.v.shape[-1])
  max_head = max(row[1] for row in BLOCK_SIZE_TABLE)
  if head_dim > max_head:
    reasons.append(f"head dim {head_dim} (pallas_gpu's block sizes go up to {max_head})")
  dtypes = {inputs.q.dtype, inputs.k.dtype, inputs.v.dtype}
  if len(dtypes) != 1 or inputs.q.dtype not in DTYPES:
    reasons.append(
      f"dtypes {sorted(str(d) for d in dtypes)} (pallas_gpu takes one of "
      "float32, bfloat16, float16 for q, k and v)"
    )
  return reasons


# ---------------------------------------------------------------------------
# Forward kernel.


def _row_keys(c: GridPlan):
  """Names of the residual rows and statistics rows the normaliser's ``finish`` returns."""
  nz = c.nz
  rows = (8, 1)
  cnt = jnp.ones(rows, jnp.float32) if c.needs_counts else None
  sink = jnp.zeros(rows, jnp.float32) if c.has_sink else None
  terms = (jnp.zeros(rows, jnp.float32),) * 2 if nz.needs_lse else None

  def run():
    row = nz.row_inputs(sink, cnt, terms)
    return nz.finish(nz.init(rows, (8, 4), c.with_stats), row, c.with_stats)

  _, res, srow = jax.eval_shape(run)
  return tuple(sorted(res)), (tuple(sorted(srow)) if srow is not None else ())


def _fwd_kernel(c: GridPlan, res_keys, stat_keys, *refs):
  nz = c.nz
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  sink_ref = next(it) if c.has_sink else None
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  o_ref = next(it)
  res_refs = {key: next(it) for key in res_keys}
  stat_refs = {key: next(it) for key in stat_keys}

  bq, bk = c.bq, c.bk
  i = pl.program_id(2)
  q0 = i * bq
  q_last = jnp.minimum(q0 + bq, c.T) - 1
  qpos = q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  q = q_ref[...]
  q_seg = qseg_ref[...][:, None] if c.has_segments else None
  q_seg_blk = qseg_ref[...] if c.has_segments else None
  lo, hi = kv_block_bounds(c, q0, q_last, bk)

  full = full_kv_blocks(c, q0, q_last, bk)

  def allowed_of(j, k_seg, masked):
    if not masked:
      return None
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    return tile_allowed(c, qpos, kpos, q_seg, None if k_seg is None else k_seg[None, :])

  counts = None
  if c.needs_counts:  # mask-only pre-pass: allowed keys per row

    def count(j, total, k_seg, masked):
      allowed = allowed_of(j, k_seg, masked)
      if allowed is None:
        return total + float(bk)
      return total + jnp.sum(allowed.astype(jnp.float32), axis=-1, keepdims=True)

    counts = visit_loop(
      c, lo, hi, jnp.zeros((bq, 1), jnp.float32), count, q_seg_blk, kseg_ref, bk, full
    )
  terms = None
  if nz.needs_lse:  # logits-only pre-pass: the rows' softmax max and log-sum

    def lse_step(j, st, k_seg, masked):
      z, _ = logits(c, q, k_ref[pl.ds(j * bk, bk), :])
      return normalizers.softmax_terms_visit(st, z, allowed_of(j, k_seg, masked))

    terms = normalizers.softmax_terms_finish(
      visit_loop(
        c, lo, hi, normalizers.softmax_terms_init((bq, 1)), lse_step, q_seg_blk, kseg_ref, bk, full
      )
    )
  sink = None
  if c.has_sink:
    sink = jnp.broadcast_to(sink_ref[...].astype(jnp.float32), (bq, 1))
  row = nz.row_inputs(sink, counts, terms)

  def step(j, st, k_seg, masked):
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    z, _ = logits(c, q, k)
    allowed = allowed_of(j, k_seg, masked)

    def pv(w):
      return dot(w.astype(v.dtype), v)

    return nz.visit(st, z, allowed, pv, row, c.with_stats, j == 0)

  st = visit_loop(
    c, lo, hi, nz.init((bq, 1), (bq, c.Hvp), c.with_stats), step, q_seg_blk, kseg_ref, bk, full
  )
  out, res, srow = nz.finish(st, row, c.with_stats)
  o_ref[...] = out.astype(o_ref.dtype)
  for key in res_keys:
    res_refs[key][...] = jnp.broadcast_to(res[key], (bq, 1)).astype(jnp.float32)
  for key in stat_keys:
    stat_refs[key][...] = jnp.broadcast_to(srow[key], (bq, 1)).astype(jnp.float32)


def forward(c: GridPlan, q, k, v, sink, q_seg, kv_seg):
  """Runs the forward kernel: ``(out [B, N, Tp, Hvp], residual rows, statistics rows)``."""
  res_keys, stat_keys = _row_keys(c)
  qh, kh, vh, q_seg, kv_seg = heads_first(c, q, k, v, q_seg, kv_seg)
  G, bq = c.G, c.bq
  grid = (c.B, c.N, c.Tp // bq)
  row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i: (b, n, i, 0))
  in_specs = [
    pl.BlockSpec((None, None, bq, c.Hp), lambda b, n, i: (b, n, i, 0)),
    pl.BlockSpec((None, None, c.Sp, c.Hp), lambda b, n, i: (b, n // G, 0, 0)),
    pl.BlockSpec((None, None, c.Sp, c.Hvp), lambda b, n, i: (b, n // G, 0, 0)),
  ]
  args = [qh, kh, vh]
  if c.has_sink:
    args.append(jnp.reshape(sink.astype(jnp.float32), (c.N, 1, 1)))
    in_specs.append(pl.BlockSpec((None, 1, 1), lambda b, n, i: (n, 0, 0)))
  if c.has_segments:
    args += [q_seg, kv_seg]
    in_specs += [
      pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
      pl.BlockSpec((None, c.Sp), lambda b, n, i: (b, 0)),
    ]
  rows = jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32)
  out_shape = [jax.ShapeDtypeStruct((c.B, c.N, c.Tp, c.Hvp), q.dtype)] + [rows] * (
    len(res_keys) + len(stat_keys)
  )
  out_specs = [pl.BlockSpec((None, None, bq, c.Hvp), lambda b, n, i: (b, n, i, 0))] + [row_spec] * (
    len(res_keys) + len(stat_keys)
  )
  with lowering.gpu_lowering_target(not c.interpret):
    outs = pl.pallas_call(
      functools.partial(_fwd_kernel, c, res_keys, stat_keys),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=c.interpret,
      compiler_params=compiler_params(c),
      name=f"attnjax_fwd_{c.opts.normalizer}",
    )(*args)
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
  """Pallas GPU attention of a validated dense call (see the module docstring).

  The call is one :func:`unsupported` accepts (checked once, by :func:`attnjax._src.op.run_engine`).

  Args:
    inputs: :class:`attnjax.options.DenseInputs` (no bias or mask array).
    opts: :class:`attnjax.options.DenseOptions`.
    block_sizes: tiles and launch parameters (:class:`BlockSizes`); None: the
      :data:`BLOCK_SIZE_TABLE` row of the target being traced for
      (:func:`attnjax._src.target.cuda_major`: the ambient mesh's device kind, or
      this host's GPU).
    interpret: run the kernels in Pallas interpret mode (any backend).
    shard_offsets: a shard's place in a call split by :func:`attnjax._src.sharding.per_shard`;
      unused (this kernel takes no modifiers, so it reads no batch or head index).

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)``.
  """
  del shard_offsets
  if block_sizes is None:
    block_sizes = block_sizes_for(
      max(inputs.q.shape[-1], inputs.v.shape[-1]), inputs.q.dtype, target.cuda_major()
    )
  c = make_plan(inputs, opts, block_sizes, interpret)

  def fwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args):
    del shard, score_args, mask_args  # no modifiers
    out, res, srow = forward(c, q, k, v, sink, q_seg, kv_seg)
    stats = stats_from_padded_rows(srow, c.T, opts.empty_row_logsumexp) if c.with_stats else None
    if c.with_stats:
      res = dict(res, has_key=srow["has_key"])
    o = jnp.transpose(out[:, :, : c.T, : c.Hv], (0, 2, 1, 3))
    return (o, stats), (out, res)

  def bwd_step(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args, saved, d_out, d_lse):
    del shard, score_args, mask_args
    out, res = saved
    dq, dk, dv, dsink, _, _ = backward.backward(
      c, q, k, v, sink, q_seg, kv_seg, out, res, d_out, d_lse
    )
    return dq, dk, dv, dsink, []

  steps = kernel_vjp.Steps(f"pallas_gpu_{opts.normalizer}", fwd_step, bwd_step)
  return kernel_vjp.differentiable(inputs, opts, steps)


# The engine as dispatch sees it (:class:`attnjax._src.op.Engine`): the dense op lists it.
ENGINE = op.platform_kernel(
  "pallas_gpu",
  compute,
  unsupported,
  platform="cuda",
  where="runs on a CUDA GPU only (a Triton kernel)",
)
run = op.deprecated_run(ENGINE, "attnjax.kernels.pallas_gpu")
attention = options.engine_entry(
  op.dense_runner(ENGINE), "pallas_gpu", ("block_sizes", "interpret")
)
attention.__doc__ = """The Pallas GPU kernel called like :func:`attnjax.dot_product_attention`.

``attention(q, k, v, *, <dense options>, block_sizes=None, interpret=False)``:
every keyword of :func:`attnjax.dot_product_attention` but ``implementation``
(``bias`` and ``mask`` arrays are refused, see :func:`unsupported`), the
kernel's :class:`BlockSizes`, and ``interpret=True`` to run it in Pallas
interpret mode on any backend.
"""
