"""The backward pass of :mod:`attnjax.kernels.pallas_gpu` (FlashAttention-2, blocks recomputed).

1. Preprocessing (row terms, in XLA: one fused elementwise pass): ``D_i = <dO_i, O_i>``,
   the logsumexp cotangent ``g_i`` (zero on rows with no key) and, with
   ``sink_logits``, the null logit's cotangent from :meth:`Normalizer.null_grad`.
2. The dq kernel: one program per (batch, query head, query block) walks the key
   blocks its rows attend (the forward's bounds), recomputes each tile's logits,
   takes ``(w, dz)`` from :meth:`Normalizer.tile_backward` and adds ``ds K``.
3. The dk/dv kernel: one program per (batch, key/value head, key block) walks the
   ``G`` query heads of its group and the query blocks that may attend the block
   (the inverse relation), adding ``w^T dO`` to dv and ``ds^T Q`` to dk, so GQA
   gradients are summed in registers, never through repeated K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from attnjax import _logits, _lowering
from attnjax.kernels.pallas_gpu.plan import (heads_first, GridPlan, compiler_params, dot, full_kv_blocks,
                                      full_q_blocks, kv_block_bounds, logits, q_block_bounds,
                                      segments_meet, tile_allowed, visit_loop)

Array = jnp.ndarray


def _input_refs(c: GridPlan, res_keys, has_g, refs):
  """The backward kernels' input refs, in call order; the iterator is left at the outputs."""
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref, rd_ref = next(it), next(it), next(it), next(it), next(it)
  g_ref = next(it) if has_g else None
  res_refs = {key: next(it) for key in res_keys}
  qseg_ref = next(it) if c.has_segments else None
  kseg_ref = next(it) if c.has_segments else None
  return q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref, it


def _dq_kernel(c: GridPlan, res_keys, has_g, *refs):
  nz = c.nz
  (q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref,
   it) = _input_refs(c, res_keys, has_g, refs)
  dq_ref = next(it)

  bq, bk = c.bq_bwd, c.bk_bwd
  i = pl.program_id(2)
  q0 = i * bq
  q_last = jnp.minimum(q0 + bq, c.T) - 1
  qpos = q0 + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
  q, do = q_ref[...], do_ref[...]
  row_dot = rd_ref[...]
  g = g_ref[...] if has_g else None
  res = {key: r[...] for key, r in res_refs.items()}
  q_seg = qseg_ref[...] if c.has_segments else None
  lo, hi = kv_block_bounds(c, q0, q_last, bk)

  def step(j, dq, k_seg, masked):
    k = k_ref[pl.ds(j * bk, bk), :]
    v = v_ref[pl.ds(j * bk, bk), :]
    z, s = logits(c, q, k)
    kpos = j * bk + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    allowed = None
    if masked:
      allowed = tile_allowed(c, qpos, kpos, None if q_seg is None else q_seg[:, None],
                             None if k_seg is None else k_seg[None, :])
    dp = dot(do, v, trans_b=True)
    _, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
    ds = _logits.softcap_grad(dz, c.opts.softcap, s=s)
    return dq + dot(ds.astype(k.dtype), k)

  dq = visit_loop(c, lo, hi, jnp.zeros((bq, c.Hp), jnp.float32), step, q_seg, kseg_ref, bk,
                  full_kv_blocks(c, q0, q_last, bk))
  dq_ref[...] = (dq * c.opts.scale).astype(dq_ref.dtype)


def _dkdv_kernel(c: GridPlan, res_keys, has_g, *refs):
  nz = c.nz
  (q_ref, k_ref, v_ref, do_ref, rd_ref, g_ref, res_refs, qseg_ref, kseg_ref,
   it) = _input_refs(c, res_keys, has_g, refs)
  dk_ref, dv_ref = next(it), next(it)

  bq, bk = c.bq_bwd, c.bk_bwd
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
      row_dot = rd_ref[rows, :]
      g = g_ref[rows, :] if has_g else None
      res = {key: r[rows, :] for key, r in res_refs.items()}
      z, s = logits(c, q, k)
      qpos = i * bq + jax.lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
      allowed = None
      if masked:
        allowed = tile_allowed(c, qpos, kpos, None if q_seg is None else q_seg[:, None],
                               None if k_seg is None else k_seg[None, :])
      dp = dot(do, v, trans_b=True)
      w, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
      dv = dv + dot(w.astype(do.dtype), do, trans_a=True)
      ds = _logits.softcap_grad(dz, c.opts.softcap, s=s)
      dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
      return dk, dv

    def body(masked):
      def one(i, carry):
        if not c.has_segments:
          return step(i, carry, None, masked)
        q_seg = qseg_ref[pl.ds(i * bq, bq)]
        return jax.lax.cond(segments_meet(q_seg, k_seg), lambda: step(i, carry, q_seg, masked),
                            lambda: carry)
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
  nz = c.nz
  G, K = c.G, c.K
  qh, kh, vh, q_seg_p, kv_seg_p = heads_first(c, q, k, v, q_seg, kv_seg)
  do = jnp.transpose(d_out, (0, 2, 1, 3))
  do = jnp.pad(do, ((0, 0), (0, 0), (0, c.Tp - c.T), (0, c.Hvp - c.Hv))).astype(q.dtype)
  # Preprocessing: the row terms (padded rows have dO = 0, so they add nothing).
  row_dot = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  g = None
  if d_lse is not None:
    g = jnp.pad(d_lse.astype(jnp.float32), ((0, 0), (0, 0), (0, c.Tp - c.T)))[..., None]
    g = jnp.where(res["has_key"] > 0, g, 0.0)
  res_keys = tuple(key for key in sorted(res) if key != "has_key")
  rows_in = [row_dot] + ([g] if g is not None else []) + [res[key] for key in res_keys]

  dsink = None
  if c.has_sink:
    floor = jnp.reshape(sink.astype(jnp.float32), (1, c.N, 1, 1))
    rs = {key: res[key] for key in res_keys}
    term = nz.null_grad(floor, rs, row_dot, g)[:, :, :c.T, 0]
    dsink = jnp.sum(term, axis=(0, 2)).astype(sink.dtype)

  bq, bk = c.bq_bwd, c.bk_bwd
  seg_args, seg_specs_q, seg_specs_k = [], [], []
  if c.has_segments:
    seg_args = [q_seg_p, kv_seg_p]

  # dq: one program per (b, n, query block).
  row_spec = pl.BlockSpec((None, None, bq, 1), lambda b, n, i: (b, n, i, 0))
  in_specs = [pl.BlockSpec((None, None, bq, c.Hp), lambda b, n, i: (b, n, i, 0)),
              pl.BlockSpec((None, None, c.Sp, c.Hp), lambda b, n, i: (b, n // G, 0, 0)),
              pl.BlockSpec((None, None, c.Sp, c.Hvp), lambda b, n, i: (b, n // G, 0, 0)),
              pl.BlockSpec((None, None, bq, c.Hvp), lambda b, n, i: (b, n, i, 0))]
  in_specs += [row_spec] * len(rows_in)
  if c.has_segments:
    seg_specs_q = [pl.BlockSpec((None, bq), lambda b, n, i: (b, i)),
                   pl.BlockSpec((None, c.Sp), lambda b, n, i: (b, 0))]
  with _lowering.gpu_lowering_target(not c.interpret):
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, c, res_keys, g is not None), grid=(c.B, c.N, c.Tp // bq),
        in_specs=in_specs + seg_specs_q,
        out_specs=pl.BlockSpec((None, None, bq, c.Hp), lambda b, n, i: (b, n, i, 0)),
        out_shape=jax.ShapeDtypeStruct((c.B, c.N, c.Tp, c.Hp), q.dtype),
        interpret=c.interpret, compiler_params=compiler_params(c, backward=True),
        name=f"attnjax_dq_{c.opts.normalizer}")(qh, kh, vh, do, *rows_in, *seg_args)

  # dk, dv: one program per (b, kv head, key block); the G query heads of the group are rows
  # g * Tp .. of the [B, K, G * Tp, .] views (free reshapes).
  def grouped(x):
    return jnp.reshape(x, (c.B, K, G * c.Tp, x.shape[-1]))

  rows_g = [grouped(x) for x in rows_in]
  all_rows = pl.BlockSpec((None, None, G * c.Tp, 1), lambda b, h, j: (b, h, 0, 0))
  in_specs = [pl.BlockSpec((None, None, G * c.Tp, c.Hp), lambda b, h, j: (b, h, 0, 0)),
              pl.BlockSpec((None, None, bk, c.Hp), lambda b, h, j: (b, h, j, 0)),
              pl.BlockSpec((None, None, bk, c.Hvp), lambda b, h, j: (b, h, j, 0)),
              pl.BlockSpec((None, None, G * c.Tp, c.Hvp), lambda b, h, j: (b, h, 0, 0))]
  in_specs += [all_rows] * len(rows_g)
  if c.has_segments:
    seg_specs_k = [pl.BlockSpec((None, c.Tp), lambda b, h, j: (b, 0)),
                   pl.BlockSpec((None, bk), lambda b, h, j: (b, j))]
  with _lowering.gpu_lowering_target(not c.interpret):
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, c, res_keys, g is not None), grid=(c.B, K, c.Sp // bk),
        in_specs=in_specs + seg_specs_k,
        out_specs=[pl.BlockSpec((None, None, bk, c.Hp), lambda b, h, j: (b, h, j, 0)),
                   pl.BlockSpec((None, None, bk, c.Hvp), lambda b, h, j: (b, h, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((c.B, K, c.Sp, c.Hp), k.dtype),
                   jax.ShapeDtypeStruct((c.B, K, c.Sp, c.Hvp), v.dtype)],
        interpret=c.interpret, compiler_params=compiler_params(c, backward=True),
        name=f"attnjax_dkdv_{c.opts.normalizer}")(
            grouped(qh), kh, vh, grouped(do), *rows_g, *seg_args)

  dq = jnp.transpose(dq[:, :, :c.T, :c.H], (0, 2, 1, 3)).astype(q.dtype)
  dk = jnp.transpose(dk[:, :, :c.S, :c.H], (0, 2, 1, 3)).astype(k.dtype)
  dv = jnp.transpose(dv[:, :, :c.S, :c.Hv], (0, 2, 1, 3)).astype(v.dtype)
  if dsink is not None:
    dsink = jnp.reshape(dsink, sink.shape)
  return dq, dk, dv, dsink, None, None
