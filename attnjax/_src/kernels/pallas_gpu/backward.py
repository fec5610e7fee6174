"""The backward pass of :mod:`attnjax.kernels.pallas_gpu` (FlashAttention-2, blocks recomputed).

Row terms in XLA (``D_i``, the logsumexp and null-logit cotangents), then a dq kernel over
the forward's key blocks and a dk/dv kernel over the ``G`` query heads and query blocks
that attend each key block (GQA summed in registers). Where ``<dO_i, O_i>`` is too
coarse (:func:`row_terms_from_tiles`) the dq kernel first sums ``D_i`` from its tiles.
Guide: docs/guides/kernels.md, section "Pallas Triton".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnjax._src import logits as logits_lib, lowering
from attnjax._src.kernels.pallas_gpu.plan import (
  heads_first,
  GridPlan,
  compiler_params,
  dot,
  full_kv_blocks,
  full_q_blocks,
  kv_block_bounds,
  logits,
  q_block_bounds,
  segments_meet,
  tile_allowed,
  visit_loop,
)

Array = jnp.ndarray


def needs_row_terms(c: GridPlan) -> bool:
  """Whether the backward reads ``D_i``: the normaliser's :meth:`~Normalizer.tile_backward`
  does (its declared :attr:`~Normalizer.reads_row_dot`: softmax's family and softpick do;
  sigmoid, relu and none do not), or a learned null column's cotangent
  (:meth:`~Normalizer.null_grad`). Without it no pass reads ``dO`` and ``O`` for it, and
  neither kernel loads a row of it."""
  return c.has_sink or c.nz.reads_row_dot


def row_terms_from_tiles(c: GridPlan, dtype) -> bool:
  """Whether ``D_i`` is summed from the recomputed tiles, ``sum_j w_ij dp_ij`` in float32,
  instead of ``<dO_i, O_i>``: the normaliser's rule, :meth:`~Normalizer.row_dot_from_tiles`
  (softpick in bfloat16 / float16). Their ``D_i`` costs the dq kernel a second walk over its
  blocks (two more tile products each)."""
  return c.nz.row_dot_from_tiles(dtype) or not c.nz.row_dot_of_output


def _input_refs(c: GridPlan, res_keys, has_g, has_rd, refs):
  """The backward kernels' input refs, in call order; the iterator is left at the outputs."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref = next(it), next(it), next(it), next(it)
  rd_ref = next(it) if has_rd else None
  g_ref = next(it) if has_g else None
  res_refs = {key: next(it) for key in res_keys}
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  return q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref, it


def _dq_kernel(c: GridPlan, res_keys, has_g, source, *refs):
  nz = c.nz
  from_tiles = source == "tiles"
  (q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref, it) = _input_refs(
    c, res_keys, has_g, source == "output", refs
  )
  sink_ref = next(it) if from_tiles and c.has_sink else None
  dq_ref = next(it)

  bq, bk = c.bq_bwd, c.bk_bwd
  i = pl.program_id(2)
  q0 = i * bq
  q_last = jnp.minimum(q0 + bq, c.T) - 1
  qpos = q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  q, do = q_ref[...], do_ref[...]
  g = g_ref[...] if has_g else None
  res = {key: r[...] for key, r in res_refs.items()}
  q_seg = qseg_ref[...] if c.has_segments else None
  lo, hi = kv_block_bounds(c, q0, q_last, bk)
  full = full_kv_blocks(c, q0, q_last, bk)

  def tile(j, k_seg, masked, keys_only=False):
    """Key block ``j``'s keys, logits ``(z, s)``, element mask and ``dp = dO V^T`` (the mask
    alone with ``keys_only``)."""
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    allowed = None
    if masked:
      allowed = tile_allowed(
        c,
        qpos,
        kpos,
        None if q_seg is None else q_seg[:, None],
        None if k_seg is None else k_seg[None, :],
      )
    if keys_only:
      return allowed
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    z, s = logits(c, q, k)
    return k, z, s, allowed, dot(do, v, trans_b=True)

  if from_tiles and not nz.row_dot_of_output:  # the normaliser's own row term, tile by tile

    def term(j, total, k_seg, masked):
      _, z, _, allowed, dp = tile(j, k_seg, masked)
      return total + nz.row_dot_tile(z, allowed, dp, res)

    row_dot = visit_loop(
      c, lo, hi, jnp.zeros((bq, 1), jnp.float32), term, q_seg, kseg_ref, bk, full
    )
    next(it)[...] = row_dot
  elif from_tiles:
    row_dot = _row_terms(c, tile, sink_ref, (lo, hi, full), q_seg, kseg_ref)
    next(it)[...] = row_dot
  else:
    row_dot = None if rd_ref is None else rd_ref[...]

  def step(j, dq, k_seg, masked):
    k, z, s, allowed, dp = tile(j, k_seg, masked)
    _, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
    ds = logits_lib.softcap_grad(dz, c.opts.softcap, s=s)
    return dq + dot(ds.astype(k.dtype), k)

  dq = visit_loop(c, lo, hi, jnp.zeros((bq, c.Hp), jnp.float32), step, q_seg, kseg_ref, bk, full)
  dq_ref[...] = (dq * c.opts.scale).astype(dq_ref.dtype)


def _row_terms(c: GridPlan, tile, sink_ref, bounds, q_seg, kseg_ref):
  """``D_i = sum_j w_ij dp_ij`` of a query block in float32 (:func:`row_terms_from_tiles`).

  The forward's own online pass (:meth:`Normalizer.visit` / :meth:`~Normalizer.finish`) with
  ``dp`` for ``V`` and float32 weights: the row's output against ``dO`` without the rounding
  of the forward's ``P V`` product or of its stored output. A normaliser's weights computed
  there are as precise as its forward makes them, which the backward's recomputed ``w`` (a
  difference of two terms as large as ``e^z / sum |e^z - 1|`` for softpick) need not be.
  """
  nz, bq, bk = c.nz, c.bq_bwd, c.bk_bwd
  lo, hi, full = bounds
  counts = None
  if nz.needs_counts:  # mask-only pre-pass, as the forward's

    def count(j, total, k_seg, masked):
      allowed = tile(j, k_seg, masked, keys_only=True)
      if allowed is None:
        return total + float(bk)
      return total + jnp.sum(allowed.astype(jnp.float32), axis=-1, keepdims=True)

    counts = visit_loop(
      c, lo, hi, jnp.zeros((bq, 1), jnp.float32), count, q_seg, kseg_ref, bk, full
    )
  sink = None
  if c.has_sink:
    sink = jnp.broadcast_to(sink_ref[...].astype(jnp.float32), (bq, 1))
  row = nz.row_inputs(sink, counts)

  def visit(j, st, k_seg, masked):
    _, z, _, allowed, dp = tile(j, k_seg, masked)
    pv = lambda w: jnp.sum(w * dp, axis=-1, keepdims=True)
    return nz.visit(st, z, allowed, pv, row, False, j == 0)

  st = visit_loop(c, lo, hi, nz.init((bq, 1), (bq, 1), False), visit, q_seg, kseg_ref, bk, full)
  return nz.finish(st, row, False)[0]


def _dkdv_kernel(c: GridPlan, res_keys, has_g, has_rd, *refs):
  nz = c.nz
  (q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref, it) = _input_refs(
    c, res_keys, has_g, has_rd, refs
  )
  dk_ref, dv_ref = next(it), next(it)

  bq, bk = c.bq_dkdv, c.bk_dkdv
  j = pl.program_id(2)
  k0 = j * bk
  k_last = jnp.minimum(k0 + bk, c.S) - 1
  kpos = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  k, v = k_ref[...], v_ref[...]
  k_seg = kseg_ref[...] if c.has_segments else None
  lo, hi = q_block_bounds(c, k0, k_last, bq)
  a, b = full_q_blocks(c, k0, k_last, bq)
  a = jnp.clip(a, lo, hi)
  b = jnp.clip(b, a, hi)  # [lo, a) and [b, hi) masked, [a, b) all allowed

  def head(gi, carry):
    base = gi * c.Tp  # the rows of query head g of this group

    def step(i, carry, q_seg, masked):
      dk, dv = carry
      rows = pl.ds(base + i * bq, bq)
      q = q_ref[rows, :]
      do = do_ref[rows, :]
      row_dot = None if rd_ref is None else rd_ref[rows, :]
      g = g_ref[rows, :] if has_g else None
      res = {key: r[rows, :] for key, r in res_refs.items()}
      z, s = logits(c, q, k)
      qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
      allowed = None
      if masked:
        allowed = tile_allowed(
          c,
          qpos,
          kpos,
          None if q_seg is None else q_seg[:, None],
          None if k_seg is None else k_seg[None, :],
        )
      dp = dot(do, v, trans_b=True)
      w, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
      dv = dv + dot(w.astype(do.dtype), do, trans_a=True)
      ds = logits_lib.softcap_grad(dz, c.opts.softcap, s=s)
      dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
      return dk, dv

    def body(masked):
      def one(i, carry):
        if not c.has_segments:
          return step(i, carry, None, masked)
        q_seg = qseg_ref[pl.ds(i * bq, bq)]
        return jax.lax.cond(
          segments_meet(q_seg, k_seg), lambda: step(i, carry, q_seg, masked), lambda: carry
        )

      return one

    if not c.needs_mask:
      return jax.lax.fori_loop(lo, hi, body(False), carry)
    carry = jax.lax.fori_loop(lo, a, body(True), carry)
    carry = jax.lax.fori_loop(a, b, body(False), carry)
    return jax.lax.fori_loop(b, hi, body(True), carry)

  init = (jnp.zeros((bk, c.Hp), jnp.float32), jnp.zeros((bk, c.Hvp), jnp.float32))
  dk, dv = jax.lax.fori_loop(0, c.G, head, init)
  dk_ref[...] = (dk * c.opts.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def backward(c: GridPlan, q, k, v, sink, q_seg, kv_seg, out, res, d_out, d_lse):
  """Cotangents ``(dq, dk, dv, dsink, None, None)`` of :func:`attnjax.kernels.pallas_gpu.attention`'s core.

  ``out`` is the forward's padded ``[B, N, Tp, Hvp]`` output, ``res`` its residual
  rows ``[B, N, Tp, 1]``; ``d_out`` is ``[B, T, N, Hv]`` and ``d_lse`` the
  logsumexp statistic's cotangent ``[B, N, T]`` or None.
  """
  qh, kh, vh, q_seg_p, kv_seg_p = heads_first(c, q, k, v, q_seg, kv_seg)
  do = jnp.transpose(d_out, (0, 2, 1, 3))
  do = jnp.pad(do, ((0, 0), (0, 0), (0, c.Tp - c.T), (0, c.Hvp - c.Hv))).astype(q.dtype)
  # Where D_i comes from: <dO_i, O_i> ("output"), the dq kernel's tiles ("tiles"), or nowhere.
  source = None
  if needs_row_terms(c):
    source = "tiles" if row_terms_from_tiles(c, q.dtype) else "output"
  # Preprocessing: the row terms (padded rows have dO = 0, so they add nothing).
  row_dot = None
  if source == "output":
    row_dot = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  g = None
  if d_lse is not None:
    g = jnp.pad(d_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, c.Tp - c.T)))[..., None]
    g = jnp.where(res["has_key"] > 0, g, 0.0)
  res_keys = tuple(key for key in sorted(res) if key != "has_key")
  rows = ([g] if g is not None else []) + [res[key] for key in res_keys]
  seg_args = [q_seg_p, kv_seg_p] if c.has_segments else []

  dq, row_dot = _dq_call(
    c, res_keys, g is not None, (qh, kh, vh, do), (source, row_dot), rows, seg_args, sink
  )
  rows = rows if row_dot is None else [row_dot] + rows
  dk, dv = _dkdv_call(
    c, res_keys, (g is not None, row_dot is not None), (qh, kh, vh, do), rows, seg_args
  )

  dsink = None
  if c.has_sink:
    floor = jnp.reshape(sink.astype(jnp.float32), (1, c.N, 1, 1))
    rs = {key: res[key] for key in res_keys}
    term = c.nz.null_grad(floor, rs, row_dot, g)[:, :, : c.T, 0]
    dsink = jnp.reshape(jnp.sum(term, axis=(0, 2)).astype(sink.dtype), sink.shape)
  dq = jnp.transpose(dq[:, :, : c.T, : c.H], (0, 2, 1, 3)).astype(q.dtype)
  dk = jnp.transpose(dk[:, :, : c.S, : c.H], (0, 2, 1, 3)).astype(k.dtype)
  dv = jnp.transpose(dv[:, :, : c.S, : c.Hv], (0, 2, 1, 3)).astype(v.dtype)
  return dq, dk, dv, dsink, None, None


def _dq_call(c: GridPlan, res_keys, has_g, arrays, rows_d, rows, seg_args, sink):
  """The dq kernel, one program per (b, n, query block): ``(dq [B, N, Tp, Hp], D rows or
  None)``; ``rows_d = (source, D rows)``: with source ``"tiles"`` the kernel sums ``D`` from
  its tiles (:func:`row_terms_from_tiles`), with ``"output"`` it reads the given rows, with
  None the backward reads none."""
  G, bq = c.G, c.bq_bwd
  qh = arrays[0]
  source, row_dot = rows_d
  from_tiles = source == "tiles"
  row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i: (b, n, i, 0))
  rows_in = rows if row_dot is None else [row_dot] + rows
  in_specs = [
    pl.BlockSpec((None, None, bq, c.Hp), lambda b, n, i: (b, n, i, 0)),
    pl.BlockSpec((None, None, c.Sp, c.Hp), lambda b, n, i: (b, n // G, 0, 0)),
    pl.BlockSpec((None, None, c.Sp, c.Hvp), lambda b, n, i: (b, n // G, 0, 0)),
    pl.BlockSpec((None, None, bq, c.Hvp), lambda b, n, i: (b, n, i, 0)),
  ]
  in_specs += [row_spec] * len(rows_in)
  if c.has_segments:
    in_specs += [
      pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
      pl.BlockSpec((None, c.Sp), lambda b, n, i: (b, 0)),
    ]
  extra = []
  if from_tiles and c.has_sink:
    extra = [jnp.reshape(sink.astype(jnp.float32), (c.N, 1, 1))]
    in_specs.append(pl.BlockSpec((None, 1, 1), lambda b, n, i: (n, 0, 0)))
  out_specs = [pl.BlockSpec((None, None, bq, c.Hp), lambda b, n, i: (b, n, i, 0))]
  out_shape = [jax.ShapeDtypeStruct((c.B, c.N, c.Tp, c.Hp), qh.dtype)]
  if from_tiles:
    out_specs.append(row_spec)
    out_shape.append(jax.ShapeDtypeStruct((c.B, c.N, c.Tp, 1), jnp.float32))
  with lowering.gpu_lowering_target(not c.interpret):
    outs = pl.pallas_call(
      functools.partial(_dq_kernel, c, res_keys, has_g, source),
      grid=(c.B, c.N, c.Tp // bq),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      interpret=c.interpret,
      compiler_params=compiler_params(c, backward=True),
      name=f"attnjax_dq_{c.opts.normalizer}",
    )(*arrays, *rows_in, *seg_args, *extra)
  return outs[0], (outs[1] if from_tiles else row_dot)


def _dkdv_call(c: GridPlan, res_keys, has_rows, arrays, rows_in, seg_args):
  """The dk/dv kernel, one program per (b, kv head, key block): ``(dk, dv)`` padded;
  ``has_rows = (has_g, has_rd)``: ``rows_in`` starts with the ``D`` rows, the ``g`` rows.

  The G query heads of a group are rows ``g * Tp ..`` of the ``[B, K, G * Tp, .]`` views
  (free reshapes).
  """
  G, K, bk = c.G, c.K, c.bk_dkdv
  qh, kh, vh, do = arrays

  def grouped(x):
    return jnp.reshape(x, (c.B, K, G * c.Tp, x.shape[-1]))

  rows_g = [grouped(x) for x in rows_in]
  all_rows = pl.BlockSpec((None, None, G * c.Tp, 1), lambda b, h, j: (b, h, 0, 0))
  in_specs = [
    pl.BlockSpec((None, None, G * c.Tp, c.Hp), lambda b, h, j: (b, h, 0, 0)),
    pl.BlockSpec((None, None, bk, c.Hp), lambda b, h, j: (b, h, j, 0)),
    pl.BlockSpec((None, None, bk, c.Hvp), lambda b, h, j: (b, h, j, 0)),
    pl.BlockSpec((None, None, G * c.Tp, c.Hvp), lambda b, h, j: (b, h, 0, 0)),
  ]
  in_specs += [all_rows] * len(rows_g)
  if c.has_segments:
    in_specs += [
      pl.BlockSpec((None, c.Tp), lambda b, h, j: (b, 0)),
      pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
    ]
  with lowering.gpu_lowering_target(not c.interpret):
    return pl.pallas_call(
      functools.partial(_dkdv_kernel, c, res_keys, *has_rows),
      grid=(c.B, K, c.Sp // bk),
      in_specs=in_specs,
      out_specs=[
        pl.BlockSpec((None, None, bk, c.Hp), lambda b, h, j: (b, h, j, 0)),
        pl.BlockSpec((None, None, bk, c.Hvp), lambda b, h, j: (b, h, j, 0)),
      ],
      out_shape=[
        jax.ShapeDtypeStruct((c.B, K, c.Sp, c.Hp), kh.dtype),
        jax.ShapeDtypeStruct((c.B, K, c.Sp, c.Hvp), vh.dtype),
      ],
      interpret=c.interpret,
      compiler_params=compiler_params(c, backward=True),
      name=f"attnjax_dkdv_{c.opts.normalizer}",
    )(grouped(qh), kh, vh, grouped(do), *rows_g, *seg_args)
