"""The backward pass of :mod:`attnjax.kernels.pallas_tpu` (FlashAttention-2, tiles recomputed).

Row terms in XLA, then a dq kernel over the forward's visits (grid ``(batch, query head,
query block, visit)``) and a dk/dv kernel over the transposed tables (grid ``(batch,
key/value head, key block, G x visit)``), accumulating in VMEM: GQA never repeats K/V.
Guide: docs/guides/kernels.md, section "Pallas Mosaic TPU".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnjax._src import logits as logits_lib
from attnjax._src.kernels.pallas_tpu.plan import (
  FULL,
  LANES,
  MASKED,
  TpuPlan,
  Tables,
  dot,
  global_indices,
  heads_first,
  logits,
  mod_inputs,
  mod_kinds,
  run_time_table,
  score_mod,
  score_mod_vjp,
  tables_of_refs,
  take_mods,
  tile_allowed,
  visit_tables,
)

Array = jnp.ndarray


def _tile_grads(
  c: TpuPlan,
  q,
  k,
  v,
  do,
  rows,
  qpos,
  kpos,
  b,
  n,
  masked,
  q_seg,
  k_seg,
  res_keys,
  has_g,
  mods,
  darg_refs=None,
):
  """``(w, ds)`` of one tile: its weights and the cotangent of the scaled dots ``q k^T scale``;
  with ``darg_refs``, the cotangents of the ``score_mod`` arguments it read are added there."""
  nz = c.nz
  off_ref, score_refs, mask_args = mods
  b, n = global_indices(c, b, n, off_ref)
  row_dot = rows[0]
  g = rows[1] if has_g else None
  res = dict(zip(res_keys, rows[1 + has_g :]))
  z_pre, s = logits(c, q, k)
  pull = None
  if c.score_in_kernel and darg_refs is not None:
    z, pull = score_mod_vjp(c, z_pre, qpos, kpos, b, n, score_refs)
  elif c.score_in_kernel:
    z, mod_vjp = jax.vjp(
      lambda zz: score_mod(c, zz, qpos, kpos, b, n, tables_of_refs(score_refs)), z_pre
    )
    pull = lambda dz: (mod_vjp(dz)[0], [])
  else:
    z = z_pre
  allowed = tile_allowed(c, qpos, kpos, q_seg, k_seg, b, n, mask_args) if masked else None
  dp = dot(do, v, trans_b=True)
  w, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
  if pull is not None:
    dz, dargs = pull(dz)
    for a, idx, d in dargs:
      darg_refs[a][idx] += d
  return w, logits_lib.softcap_grad(dz, c.opts.softcap, s=s)


def _segments(qseg_ref, kseg_ref):
  if qseg_ref is None:
    return None, None
  return qseg_ref[...][:, :1], kseg_ref[...][:1, :]


def _dq_kernel(c: TpuPlan, res_keys, has_g, width, darg_ids, kind_ref, fetch_ref, *refs):
  n_rows = 1 + has_g + len(res_keys)
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref = next(it), next(it), next(it), next(it)
  row_refs = [next(it) for _ in range(n_rows)]
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  mods = take_mods(c, it, score_tables=False)
  dq_ref = next(it)
  darg_refs = {a: next(it) for a in darg_ids}
  acc_ref = next(it)

  b, n, i, s = (pl.program_id(a) for a in range(4))
  kind, j = kind_ref[i, s], fetch_ref[i, s]
  bq, bk = c.bq_bwd, c.bk_bwd

  @pl.when(s == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  if darg_refs:  # accumulated over the whole (sequential) grid

    @pl.when((b == 0) & (n == 0) & (i == 0) & (s == 0))
    def _():
      for ref in darg_refs.values():
        _zero_smem(ref)

  def visit(masked: bool):
    qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    k = k_ref[...]
    q_seg, k_seg = _segments(qseg_ref, kseg_ref)
    _, ds = _tile_grads(
      c,
      q_ref[...],
      k,
      v_ref[...],
      do_ref[...],
      [r[...] for r in row_refs],
      qpos,
      kpos,
      b,
      n,
      masked,
      q_seg,
      k_seg,
      res_keys,
      has_g,
      mods,
      darg_refs or None,
    )
    acc_ref[...] += dot(ds.astype(k.dtype), k)

  pl.when(kind == FULL)(lambda: visit(False))
  pl.when(kind == MASKED)(lambda: visit(True))

  @pl.when(s == width - 1)
  def _():
    dq_ref[...] = (acc_ref[...] * c.opts.scale).astype(dq_ref.dtype)


def _row_dot_kernel(c: TpuPlan, res_keys, width, kind_ref, fetch_ref, *refs):
  """A normaliser's backward row term summed over the dq grid's visits
  (:meth:`~attnjax.normalizers.Normalizer.row_dot_tile`, where not ``row_dot_of_output``)."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref = next(it), next(it), next(it), next(it)
  res_refs = [next(it) for _ in res_keys]
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  off_ref, score_args, mask_args = take_mods(c, it)
  rd_ref = next(it)
  b, n, i, s = (pl.program_id(a) for a in range(4))
  kind, j = kind_ref[i, s], fetch_ref[i, s]
  gb, gn = global_indices(c, b, n, off_ref)
  bq, bk = c.bq_bwd, c.bk_bwd

  @pl.when(s == 0)
  def _():
    rd_ref[...] = jnp.zeros_like(rd_ref)

  def visit(masked: bool):
    qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    z, _ = logits(c, q_ref[...], k_ref[...])
    z = score_mod(c, z, qpos, kpos, gb, gn, score_args)
    allowed = None
    if masked:
      q_seg, k_seg = _segments(qseg_ref, kseg_ref)
      allowed = tile_allowed(c, qpos, kpos, q_seg, k_seg, gb, gn, mask_args)
    dp = dot(do_ref[...], v_ref[...], trans_b=True)
    res = {key: r[...] for key, r in zip(res_keys, res_refs)}
    rd_ref[...] += c.nz.row_dot_tile(z, allowed, dp, res)

  pl.when(kind == FULL)(lambda: visit(False))
  pl.when(kind == MASKED)(lambda: visit(True))


def _row_dot_call(c: TpuPlan, tables: Tables, kinds, arrays, res_rows, seg_args, mods, res_keys):
  """``[B, N, Tp, 1]`` row terms from the tiles (grid ``(b, n, query block, visit)``, as dq)."""
  bq, bk = c.bq_bwd, c.bk_bwd
  kind, fetch = visit_tables(kinds, tables.kv_index, tables.kv_count, transpose=False)
  nq, width = kind.shape
  at_q = lambda b, n, i, s, kr, fr: (b, n, i, 0)
  at_k = lambda b, n, i, s, kr, fr: (b, jax.lax.div(n, c.G), fr[i, s], 0)
  in_specs = [
    pl.BlockSpec((None, None, bq, c.H), at_q),
    pl.BlockSpec((None, None, bk, c.H), at_k),
    pl.BlockSpec((None, None, bk, c.Hv), at_k),
    pl.BlockSpec((None, None, bq, c.Hv), at_q),
  ]
  in_specs += [pl.BlockSpec((None, None, bq, 1), at_q)] * len(res_rows)
  if c.has_segments:
    in_specs += [
      pl.BlockSpec((None, bq, LANES), lambda b, n, i, s, kr, fr: (b, i, 0)),
      pl.BlockSpec((None, 8, bk), lambda b, n, i, s, kr, fr: (b, 0, fr[i, s])),
    ]
  in_specs += mods[1]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(c.B, c.N, nq, width),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, None, bq, 1), at_q),
  )
  return pl.pallas_call(
    functools.partial(_row_dot_kernel, c, res_keys, width),
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32),
    compiler_params=_params(c),
    interpret=c.interpret,
    name=f"attnjax_tpu_row_dot_{c.opts.normalizer}",
  )(kind, fetch, *arrays, *res_rows, *seg_args, *mods[0])


def _dkdv_kernel(c: TpuPlan, res_keys, has_g, width, kind_ref, fetch_ref, *refs):
  n_rows = 1 + has_g + len(res_keys)
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref = next(it), next(it), next(it), next(it)
  row_refs = [next(it) for _ in range(n_rows)]
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  mods = take_mods(c, it, score_tables=False)
  dk_ref, dv_ref = next(it), next(it)
  dk_acc, dv_acc = next(it), next(it)

  b, h, j, t = (pl.program_id(a) for a in range(4))
  g, s = jax.lax.div(t, width), jax.lax.rem(t, width)  # non-negative: no sign logic
  n = h * c.G + g
  kind, i = kind_ref[j, s], fetch_ref[j, s]
  bq, bk = c.bq_bwd, c.bk_bwd

  @pl.when(t == 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  def visit(masked: bool):
    qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    q, do = q_ref[...], do_ref[...]
    q_seg, k_seg = _segments(qseg_ref, kseg_ref)
    w, ds = _tile_grads(
      c,
      q,
      k_ref[...],
      v_ref[...],
      do,
      [r[...] for r in row_refs],
      qpos,
      kpos,
      b,
      n,
      masked,
      q_seg,
      k_seg,
      res_keys,
      has_g,
      mods,
    )
    dv_acc[...] += dot(w.astype(do.dtype), do, trans_a=True)
    dk_acc[...] += dot(ds.astype(q.dtype), q, trans_a=True)

  pl.when(kind == FULL)(lambda: visit(False))
  pl.when(kind == MASKED)(lambda: visit(True))

  @pl.when(t == c.G * width - 1)
  def _():
    dk_ref[...] = (dk_acc[...] * c.opts.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _zero_smem(ref):
  """Zeros an SMEM table element by element (SMEM holds scalars)."""
  if len(ref.shape) == 1:
    for a in range(ref.shape[0]):
      ref[a] = jnp.zeros((), ref.dtype)
  else:
    for a in range(ref.shape[0]):
      for b in range(ref.shape[1]):
        ref[a, b] = jnp.zeros((), ref.dtype)


def _params(c: TpuPlan, sequential: bool = False):
  if c.interpret:
    return None
  parallel = "arbitrary" if sequential else "parallel"
  return pltpu.CompilerParams(dimension_semantics=(parallel, parallel, parallel, "arbitrary"))


def _row_operands(c: TpuPlan, q, out, res, d_out, d_lse):
  """``(do, rows_in, res_keys, g)``: the padded heads-first ``do`` and the per-row inputs of
  both kernels (``row_dot``, the logsumexp cotangent ``g`` if any, the residual rows)."""
  do = jnp.transpose(d_out, (0, 2, 1, 3))
  do = jnp.pad(do, ((0, 0), (0, 0), (0, c.Tp - c.T), (0, 0))).astype(q.dtype)
  row_dot = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  g = None
  if d_lse is not None:
    g = jnp.pad(d_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, c.Tp - c.T)))[..., None]
    g = jnp.where(res["has_key"] > 0, g, 0.0)
  res_keys = tuple(key for key in sorted(res) if key != "has_key")
  rows_in = [row_dot] + ([g] if g is not None else []) + [res[key] for key in res_keys]
  return do, rows_in, res_keys, g


def _sink_cotangent(c: TpuPlan, sink, res, res_keys, row_dot, g):
  """The sink logits' cotangent ``[N]`` (in ``sink``'s dtype), or None without sinks."""
  if not c.has_sink:
    return None
  floor = jnp.reshape(sink.astype(jnp.float32), (1, c.N, 1, 1))
  term = c.nz.null_grad(floor, {key: res[key] for key in res_keys}, row_dot, g)[:, :, : c.T, 0]
  return jnp.reshape(jnp.sum(term, axis=(0, 2)).astype(sink.dtype), sink.shape)


def _dq_call(
  c: TpuPlan,
  tables: Tables,
  kinds,
  operands,
  n_rows: int,
  mod_specs,
  res_keys,
  has_g: bool,
  score_args,
  darg_ids,
):
  """The dq kernel on grid ``(b, n, query block, visit)``: ``(dq [B, N, Tp, H], *dargs)``.

  ``operands``: ``qh, kh, vh, do``, the ``n_rows`` row inputs, segment ids, modifier tables.
  """
  bq, bk = c.bq_bwd, c.bk_bwd
  kind, fetch = visit_tables(kinds, tables.kv_index, tables.kv_count, transpose=False)
  nq, width = kind.shape
  at_q = lambda b, n, i, s, kr, fr: (b, n, i, 0)
  at_k = lambda b, n, i, s, kr, fr: (b, jax.lax.div(n, c.G), fr[i, s], 0)
  in_specs = [
    pl.BlockSpec((None, None, bq, c.H), at_q),
    pl.BlockSpec((None, None, bk, c.H), at_k),
    pl.BlockSpec((None, None, bk, c.Hv), at_k),
    pl.BlockSpec((None, None, bq, c.Hv), at_q),
  ]
  in_specs += [pl.BlockSpec((None, None, bq, 1), at_q)] * n_rows
  if c.has_segments:
    in_specs += [
      pl.BlockSpec((None, bq, LANES), lambda b, n, i, s, kr, fr: (b, i, 0)),
      pl.BlockSpec((None, 8, bk), lambda b, n, i, s, kr, fr: (b, 0, fr[i, s])),
    ]
  in_specs += mod_specs
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(c.B, c.N, nq, width),
    in_specs=in_specs,
    out_specs=[pl.BlockSpec((None, None, bq, c.H), at_q)]
    + [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(darg_ids),
    scratch_shapes=[pltpu.VMEM((bq, c.H), jnp.float32)],
  )
  return pl.pallas_call(
    functools.partial(_dq_kernel, c, res_keys, has_g, width, darg_ids),
    grid_spec=grid_spec,
    out_shape=[jax.ShapeDtypeStruct((c.B, c.N, c.Tp, c.H), operands[0].dtype)]
    + [jax.ShapeDtypeStruct(jnp.shape(score_args[a]), jnp.float32) for a in darg_ids],
    compiler_params=_params(c, sequential=bool(darg_ids)),
    interpret=c.interpret,
    name=f"attnjax_tpu_dq_{c.opts.normalizer}",
  )(kind, fetch, *operands)


def _dkdv_call(
  c: TpuPlan,
  tables: Tables,
  kinds,
  operands,
  n_rows: int,
  mod_specs,
  res_keys,
  has_g: bool,
  k_dtype,
  v_dtype,
):
  """The dk, dv kernel on grid ``(b, kv head, key block, G x visit)`` (step ``t`` reads query
  head ``h * G + t // W``): ``(dk [B, K, Sp, H], dv [B, K, Sp, Hv])``."""
  bq, bk, G = c.bq_bwd, c.bk_bwd, c.G
  kind_t, fetch_t = visit_tables(kinds, tables.q_index, tables.q_count, transpose=True)
  nk, width_t = kind_t.shape
  at_qt = lambda b, h, j, t, kr, fr: (
    b,
    h * G + jax.lax.div(t, width_t),
    fr[j, jax.lax.rem(t, width_t)],
    0,
  )
  at_kt = lambda b, h, j, t, kr, fr: (b, h, j, 0)
  in_specs = [
    pl.BlockSpec((None, None, bq, c.H), at_qt),
    pl.BlockSpec((None, None, bk, c.H), at_kt),
    pl.BlockSpec((None, None, bk, c.Hv), at_kt),
    pl.BlockSpec((None, None, bq, c.Hv), at_qt),
  ]
  in_specs += [pl.BlockSpec((None, None, bq, 1), at_qt)] * n_rows
  if c.has_segments:
    in_specs += [
      pl.BlockSpec(
        (None, bq, LANES), lambda b, h, j, t, kr, fr: (b, fr[j, jax.lax.rem(t, width_t)], 0)
      ),
      pl.BlockSpec((None, 8, bk), lambda b, h, j, t, kr, fr: (b, 0, j)),
    ]
  in_specs += mod_specs
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(c.B, c.K, nk, G * width_t),
    in_specs=in_specs,
    out_specs=[
      pl.BlockSpec((None, None, bk, c.H), at_kt),
      pl.BlockSpec((None, None, bk, c.Hv), at_kt),
    ],
    scratch_shapes=[pltpu.VMEM((bk, c.H), jnp.float32), pltpu.VMEM((bk, c.Hv), jnp.float32)],
  )
  return pl.pallas_call(
    functools.partial(_dkdv_kernel, c, res_keys, has_g, width_t),
    grid_spec=grid_spec,
    out_shape=[
      jax.ShapeDtypeStruct((c.B, c.K, c.Sp, c.H), k_dtype),
      jax.ShapeDtypeStruct((c.B, c.K, c.Sp, c.Hv), v_dtype),
    ],
    compiler_params=_params(c),
    interpret=c.interpret,
    name=f"attnjax_tpu_dkdv_{c.opts.normalizer}",
  )(kind_t, fetch_t, *operands)


def _score_arg_cotangents(score_args, darg_ids, dargs) -> tuple:
  """One cotangent per ``score_mod`` argument: the kernel's sums for float tables, float0
  zeros for integer tables (they have no gradient)."""
  got = dict(zip(darg_ids, dargs))
  return tuple(
    got[a].astype(jnp.result_type(x)) if a in got else np.zeros(jnp.shape(x), jax.dtypes.float0)
    for a, x in enumerate(score_args)
  )


def backward(
  c: TpuPlan,
  tables: Tables,
  q,
  k,
  v,
  sink,
  q_seg,
  kv_seg,
  out,
  res,
  d_out,
  d_lse,
  score_args=(),
  mask_args=(),
  offsets=None,
):
  """Cotangents ``(dq, dk, dv, dsink, None, None, dscore_args, None)`` of the kernel's core.

  ``out`` is the forward's padded ``[B, N, Tp, Hv]`` output, ``res`` its residual rows
  ``[B, N, Tp, 1]``; ``d_out`` is ``[B, T, N, Hv]`` and ``d_lse`` the logsumexp statistic's
  cotangent ``[B, N, T]`` or None; ``offsets``: the first batch row and query head of these
  arrays in the whole call (see :func:`~attnjax._src.kernels.pallas_tpu.plan.mod_inputs`).
  """
  qh, kh, vh, q_seg_p, kv_seg_p = heads_first(c, q, k, v, q_seg, kv_seg)
  do, rows_in, res_keys, g = _row_operands(c, q, out, res, d_out, d_lse)
  dsink = _sink_cotangent(c, sink, res, res_keys, rows_in[0], g)
  bq, bk = c.bq_bwd, c.bk_bwd
  kinds = run_time_table(
    c,
    tables,
    q_seg_p[:, :, 0] if c.has_segments else None,
    kv_seg_p[:, 0, :] if c.has_segments else None,
    bq,
    bk,
    mod_kinds(c, c.opts, mask_args, bq, bk, offsets),
  )
  seg_args = [q_seg_p, kv_seg_p] if c.has_segments else []
  mod_args, mod_specs = mod_inputs(c, score_args, mask_args, offsets)
  if not c.nz.row_dot_of_output:  # the row term from the tiles, not <dO_i, O_i>
    res_rows = rows_in[1 + (g is not None) :]
    rows_in[0] = _row_dot_call(
      c, tables, kinds, (qh, kh, vh, do), res_rows, seg_args, (mod_args, mod_specs), res_keys
    )
  # score_mod arguments with gradients: float tables, accumulated in SMEM over the dq grid.
  darg_ids = tuple(
    a for a, x in enumerate(score_args) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
  )
  operands = (qh, kh, vh, do, *rows_in, *seg_args, *mod_args)
  dq, *dargs = _dq_call(
    c,
    tables,
    kinds,
    operands,
    len(rows_in),
    mod_specs,
    res_keys,
    g is not None,
    score_args,
    darg_ids,
  )
  dk, dv = _dkdv_call(
    c, tables, kinds, operands, len(rows_in), mod_specs, res_keys, g is not None, k.dtype, v.dtype
  )
  dq = jnp.transpose(dq[:, :, : c.T], (0, 2, 1, 3)).astype(q.dtype)
  dk = jnp.transpose(dk[:, :, : c.S], (0, 2, 1, 3)).astype(k.dtype)
  dv = jnp.transpose(dv[:, :, : c.S], (0, 2, 1, 3)).astype(v.dtype)
  return (dq, dk, dv, dsink, None, None, _score_arg_cotangents(score_args, darg_ids, dargs), None)
