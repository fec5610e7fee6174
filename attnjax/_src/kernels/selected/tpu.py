"""Selected-block attention as Pallas TPU (Mosaic) kernels: forward and backward, both loop orders.

Query-token-major (``"query"``): the grid ``(token, key/value head, slot)`` of a launch walks
each token's selected blocks (scalar-prefetched, sorted: the padding slots repeat the last
block, so Pallas copies nothing for them), the G query heads of the group as the tile's rows
and the normaliser's online state in VMEM; its dq kernel walks the same grid. Key-block-major
(``"kv"``): the grid ``(work item,)`` of a launch (one batch row and key/value head) over the
inverted index, one key block and the rows of the tokens that selected it per item; the
forward writes each (token, block) part, the backward accumulates dk and dv over a block's
items in VMEM and writes dq parts. Launches are a ``lax.map``: their tables fit in SMEM.
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from attnjax._src.kernels.selected import tiles
from attnjax._src.kernels.selected.plan import Plan, heads_first, needs_mask

Array = jnp.ndarray

# Rows (token, head pairs) per "kv" work item, and their alignment (a bf16 vreg's sublanes).
ROWS = 256
ALIGN = 16
DTYPES = (jnp.float32, jnp.bfloat16)
# int32 entries of a launch's scalar-prefetch tables (block lists, work items): SMEM holds
# 1 MiB on a v5e (a 4 MiB table failed to compile: "would exceed memory"); a quarter of it.
SMEM_TABLE_ENTRIES = 65536


def dot(a: Array, b: Array, trans_a: bool = False, trans_b: bool = False) -> Array:
  """``a @ b`` accumulated in float32; float32 operands at full precision (the MXU's passes),
  others in their dtype."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def unsupported(plan: Plan, dtype) -> list[str]:
  """Reasons the TPU kernels cannot run a call ([] = they can)."""
  reasons = []
  if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES]:
    reasons.append(f"dtype {jnp.dtype(dtype).name} (the TPU kernels take float32 or bfloat16)")
  sub = 8 if jnp.dtype(dtype) == jnp.float32 else 16
  if plan.block_size % sub:
    reasons.append(
      f"block_size={plan.block_size} (a key block is a tile's sublanes: a multiple of {sub} "
      f"for {jnp.dtype(dtype).name})"
    )
  if plan.order == "kv" and 4 * plan.W + 2 > SMEM_TABLE_ENTRIES:
    reasons.append(
      f"order='kv' with {plan.W} work items per (batch row, key/value head): their tables "
      f"exceed {SMEM_TABLE_ENTRIES} SMEM entries (use order='query' or more rows per item)"
    )
  return reasons


def _params(plan: Plan, dims: int):
  if plan.interpret:
    return None
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * (dims - 1) + ("arbitrary",))


def _chunks(fn, count: int):
  """``fn(c)`` for ``c < count`` stacked on a leading axis: one kernel traced once, launched
  per chunk (``lax.map``) so that each launch's scalar-prefetch tables fit in SMEM."""
  if count == 1:
    return jax.tree.map(lambda x: x[None], fn(jnp.int32(0)))
  return jax.lax.map(fn, jnp.arange(count, dtype=jnp.int32))


# ---------------------------------------------------------------------------
# Query-token-major forward and dq: per launch one batch row and `Tc` tokens.


def token_chunk(p: Plan) -> int:
  """Tokens per query-major launch: its block tables (``Tc * K * (n + 1)`` int32) take at most
  :data:`SMEM_TABLE_ENTRIES`."""
  return max(1, min(p.T, SMEM_TABLE_ENTRIES // (p.K * (p.n + 1))))


def _query_specs(p: Plan):
  """BlockSpecs of the query-major grid ``(token, key/value head, slot)`` of one launch:
  makers of ``(per token [G, X] of a whole-call input, key block [bs, X], per token [G, X] of
  the launch's output)``; scalar prefetch: ``at = (batch row, first token)``, the launch's
  block table and its counts."""
  G, n, K, T = p.G, p.n, p.K, p.T

  def token(X):
    return pl.BlockSpec(
      (None, None, None, G, X),
      lambda t, kh, s, at, ir, cr: (at[0], jnp.minimum(at[1] + t, T - 1), kh, 0, 0),
    )

  def block(X):
    return pl.BlockSpec(
      (None, None, p.block_size, X),
      lambda t, kh, s, at, ir, cr: (at[0], kh, ir[(t * K + kh) * n + s], 0),
    )

  def out(X):
    return pl.BlockSpec((None, None, G, X), lambda t, kh, s, at, ir, cr: (t, kh, 0, 0))

  return token, block, out


def _query_launches(p: Plan, blocks, launch):
  """Runs ``launch(at, idx, count)`` (one batch row, ``Tc`` tokens; tables flat) over the
  call and returns its outputs ``[Tc, K, G, X]`` as ``[B, T, N, X]``."""
  Tc = token_chunk(p)
  C = -(-p.T // Tc)
  pad = ((0, 0), (0, C * Tc - p.T), (0, 0))
  idx = jnp.pad(blocks.idx, pad + ((0, 0),))
  count = jnp.pad(blocks.count, pad)  # padding tokens: no slot

  def one(c):
    b, t0 = c // C, (c % C) * Tc
    at = jnp.stack([b, t0]).astype(jnp.int32)
    idx_c = jax.lax.dynamic_slice(idx, (b, t0, 0, 0), (1, Tc, p.K, p.n))
    count_c = jax.lax.dynamic_slice(count, (b, t0, 0), (1, Tc, p.K))
    return launch(at, idx_c.reshape(-1), count_c.reshape(-1))

  outs = _chunks(one, p.B * C)
  return jax.tree.map(lambda x: jnp.reshape(x, (p.B, C * Tc, p.N, x.shape[-1]))[:, : p.T], outs)


def _query_fwd_kernel(p: Plan, state, res_keys, stat_keys, at_ref, idx_ref, cnt_ref, *refs):
  nz = p.nz
  it = iter(refs)
  q_ref, k_ref, v_ref = next(it), next(it), next(it)
  counts_ref = next(it) if p.needs_counts else None
  o_ref = next(it)
  res_refs = {key: next(it) for key in res_keys}
  stat_refs = {key: next(it) for key in stat_keys}
  st_refs = {key: next(it) for key, _ in state}
  tl, kh, s = (pl.program_id(a) for a in range(3))
  t = at_ref[1] + tl
  f = tl * p.K + kh
  j = idx_ref[f * p.n + s]
  live = s < cnt_ref[f]
  G = p.G

  def row_inputs():
    return nz.row_inputs(None, counts_ref[...] if p.needs_counts else None)

  @pl.when(s == 0)
  def _():
    for key, val in nz.init((G, 1), (G, p.Hv), p.with_stats).items():
      st_refs[key][...] = val

  def visit(masked: bool):
    st = {key: ref[...] for key, ref in st_refs.items()}
    z = dot(q_ref[...], k_ref[...], trans_b=True) * p.scale
    allowed = None
    if masked:
      allowed = tiles.allowed(p, j, t, jax.lax.broadcasted_iota(jnp.int32, z.shape, 1))
    v = v_ref[...]
    pv = lambda w: dot(w.astype(v.dtype), v)
    st = nz.visit(st, z, allowed, pv, row_inputs(), p.with_stats, j == 0)
    for key, ref in st_refs.items():
      ref[...] = st[key]

  masked = needs_mask(p, j, t)
  pl.when(live & masked)(lambda: visit(True))
  pl.when(live & jnp.logical_not(masked))(lambda: visit(False))

  @pl.when(s == p.n - 1)
  def _():
    st = {key: ref[...] for key, ref in st_refs.items()}
    out, res, srow = nz.finish(st, row_inputs(), p.with_stats)
    o_ref[...] = out.astype(o_ref.dtype)
    for key in res_keys:
      res_refs[key][...] = jnp.broadcast_to(res[key], (G, 1)).astype(jnp.float32)
    for key in stat_keys:
      stat_refs[key][...] = jnp.broadcast_to(srow[key], (G, 1)).astype(jnp.float32)


def query_forward(p: Plan, q, k, v, blocks, counts):
  """The query-major forward: ``(out [B, T, N, Hv], residual rows, statistics rows)``, rows
  ``{name: [B, T, N, 1]}`` float32; ``counts`` ``[B, T, K]`` (or None)."""
  B, T, K, G = p.B, p.T, p.K, p.G
  state, res_keys, stat_keys = tiles.state_layout(p.nz, G, p.Hv, p.with_stats)
  token, block, out = _query_specs(p)
  Tc = token_chunk(p)
  args = [jnp.reshape(q, (B, T, K, G, p.H)), heads_first(k, p.Sp), heads_first(v, p.Sp)]
  in_specs = [token(p.H), block(p.H), block(p.Hv)]
  if p.needs_counts:
    args.append(jnp.broadcast_to(counts[..., None, None], (B, T, K, G, 1)))
    in_specs.append(token(1))
  rows = jax.ShapeDtypeStruct((Tc, K, G, 1), jnp.float32)
  n_rows = len(res_keys) + len(stat_keys)

  def launch(at, idx, count):
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(Tc, K, p.n),
      in_specs=in_specs,
      out_specs=[out(p.Hv)] + [out(1)] * n_rows,
      scratch_shapes=[pltpu.VMEM(shape, jnp.float32) for _, shape in state],
    )
    return pl.pallas_call(
      functools.partial(_query_fwd_kernel, p, state, res_keys, stat_keys),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((Tc, K, G, p.Hv), q.dtype)] + [rows] * n_rows,
      compiler_params=_params(p, 3),
      interpret=p.interpret,
      name=f"attnjax_selected_tpu_fwd_{p.normalizer}",
    )(at, idx, count, *args)

  outs = _query_launches(p, blocks, launch)
  res = dict(zip(res_keys, outs[1 : 1 + len(res_keys)]))
  srow = dict(zip(stat_keys, outs[1 + len(res_keys) :]))
  return outs[0], res, srow


def _row_args(rows, res_keys, has_dot: bool, has_g: bool):
  """``(res, row_dot, g)`` of the row inputs ``[row_dot?, g?, *residuals]``."""
  i = int(has_dot)
  res = dict(zip(res_keys, rows[i + int(has_g) :]))
  return res, (rows[0] if has_dot else None), (rows[i] if has_g else None)


def _query_dq_kernel(p: Plan, res_keys, has_dot, has_g, at_ref, idx_ref, cnt_ref, *refs):
  nz = p.nz
  it = iter(refs)
  q_ref, k_ref, v_ref, do_ref = next(it), next(it), next(it), next(it)
  row_refs = [next(it) for _ in range(int(has_dot) + int(has_g) + len(res_keys))]
  dq_ref, acc_ref = next(it), next(it)
  tl, kh, s = (pl.program_id(a) for a in range(3))
  t = at_ref[1] + tl
  f = tl * p.K + kh
  j = idx_ref[f * p.n + s]
  live = s < cnt_ref[f]

  @pl.when(s == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def visit(masked: bool):
    k = k_ref[...]
    z = dot(q_ref[...], k, trans_b=True) * p.scale
    allowed = None
    if masked:
      allowed = tiles.allowed(p, j, t, jax.lax.broadcasted_iota(jnp.int32, z.shape, 1))
    dp = dot(do_ref[...], v_ref[...], trans_b=True)
    res, row_dot, g = _row_args([r[...] for r in row_refs], res_keys, has_dot, has_g)
    _, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
    acc_ref[...] += dot(dz.astype(k.dtype), k)

  masked = needs_mask(p, j, t)
  pl.when(live & masked)(lambda: visit(True))
  pl.when(live & jnp.logical_not(masked))(lambda: visit(False))

  @pl.when(s == p.n - 1)
  def _():
    dq_ref[...] = (acc_ref[...] * p.scale).astype(dq_ref.dtype)


def query_dq(p: Plan, q, k, v, do, rows, res_keys, has_dot, has_g, blocks):
  """The query-major dq kernel: ``dq [B, T, N, H]``; ``rows`` the row inputs ``[B, T, N, 1]``
  (``[row_dot?, g?, *residuals]``)."""
  B, T, K, G = p.B, p.T, p.K, p.G
  token, block, out = _query_specs(p)
  Tc = token_chunk(p)
  grouped = lambda x: jnp.reshape(x, (B, T, K, G, x.shape[-1]))
  args = [grouped(q), heads_first(k, p.Sp), heads_first(v, p.Sp), grouped(do.astype(q.dtype))]
  args += [grouped(r) for r in rows]
  in_specs = [token(p.H), block(p.H), block(p.Hv), token(p.Hv)] + [token(1)] * len(rows)

  def launch(at, idx, count):
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(Tc, K, p.n),
      in_specs=in_specs,
      out_specs=out(p.H),
      scratch_shapes=[pltpu.VMEM((G, p.H), jnp.float32)],
    )
    return pl.pallas_call(
      functools.partial(_query_dq_kernel, p, res_keys, has_dot, has_g),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((Tc, K, G, p.H), q.dtype),
      compiler_params=_params(p, 3),
      interpret=p.interpret,
      name=f"attnjax_selected_tpu_dq_{p.normalizer}",
    )(at, idx, count, *args)

  return _query_launches(p, blocks, launch)


# ---------------------------------------------------------------------------
# Key-block-major forward (parts) and backward (dk, dv, dq parts): per launch one (batch row,
# key/value head) and its W work items.


def _item_specs(p: Plan):
  """BlockSpecs of the key-block-major grid ``(w,)`` of one launch: makers of ``(item rows
  [rows, X] of a whole-call input, key block [bs, X] of one, item rows of the launch's output,
  key block of the launch's output)``; scalar prefetch: ``at = (batch row, key/value head)``
  and the launch's item tables, each item's block first."""
  R, bs = p.rows, p.block_size

  def item(X):
    return pl.BlockSpec((None, None, R, X), lambda w, at, blk, *_: (at[0], at[1], w, 0))

  def block(X):
    return pl.BlockSpec((None, None, bs, X), lambda w, at, blk, *_: (at[0], at[1], blk[w], 0))

  def item_out(X):
    return pl.BlockSpec((R, X), lambda w, at, blk, *_: (w, 0))

  def block_out(X):
    return pl.BlockSpec((bs, X), lambda w, at, blk, *_: (blk[w], 0))

  return item, block, item_out, block_out


def _kv_launches(p: Plan, work, tables, launch):
  """Runs ``launch(at, *item tables)`` per (batch row, key/value head) and returns its
  outputs stacked ``[B, K, ...]``."""

  def one(c):
    b, kh = c // p.K, c % p.K
    at = jnp.stack([b, kh]).astype(jnp.int32)
    return launch(at, *(getattr(work, name)[b, kh] for name in tables))

  outs = _chunks(one, p.B * p.K)
  return jax.tree.map(lambda x: jnp.reshape(x, (p.B, p.K) + x.shape[1:]), outs)


def _kv_fwd_kernel(
  p: Plan, at_ref, blk_ref, live_ref, q_ref, tok_ref, k_ref, v_ref, o_ref, lse_ref
):
  nz = p.part_normalizer
  w = pl.program_id(0)
  j = blk_ref[w]
  R = p.rows

  @pl.when(live_ref[w] > 0)
  def _():
    z = dot(q_ref[...], k_ref[...], trans_b=True) * p.scale
    allowed = tiles.allowed(p, j, tok_ref[...], jax.lax.broadcasted_iota(jnp.int32, z.shape, 1))
    v = v_ref[...]
    row = nz.row_inputs(None, None)
    st = nz.init((R, 1), (R, p.Hv), False)
    st = nz.visit(st, z, allowed, lambda wt: dot(wt.astype(v.dtype), v), row, False, False)
    out, res, _ = nz.finish(st, row, False)
    o_ref[...] = out
    lse_ref[...] = jnp.broadcast_to(res["log_norm"], (R, 1))

  @pl.when(live_ref[w] == 0)
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)
    lse_ref[...] = jnp.zeros_like(lse_ref)


def kv_forward(p: Plan, qrows, tok, k, v, work):
  """The key-block-major forward: each item's rows against its block, ``(out parts [B, K,
  W * rows, Hv], log-normaliser parts [B, K, W * rows, 1])`` float32 (the merge_part's)."""
  item, block, item_out, _ = _item_specs(p)
  args = (qrows, tok[..., None], heads_first(k, p.Sp), heads_first(v, p.Sp))
  R = p.W * p.rows

  def launch(at, blk, live):
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(p.W,),
      in_specs=[item(p.H), item(1), block(p.H), block(p.Hv)],
      out_specs=[item_out(p.Hv), item_out(1)],
    )
    return pl.pallas_call(
      functools.partial(_kv_fwd_kernel, p),
      grid_spec=grid_spec,
      out_shape=[
        jax.ShapeDtypeStruct((R, p.Hv), jnp.float32),
        jax.ShapeDtypeStruct((R, 1), jnp.float32),
      ],
      compiler_params=_params(p, 1),
      interpret=p.interpret,
      name="attnjax_selected_tpu_fwd_parts",
    )(at, blk, live, *args)

  return _kv_launches(p, work, ("block", "live"), launch)


def _kv_bwd_kernel(p: Plan, res_keys, has_dot, has_g, with_dq, *refs):
  nz = p.nz
  it = iter(refs)
  _, blk_ref, first_ref, last_ref, live_ref = (next(it) for _ in range(5))
  q_ref, do_ref, tok_ref, k_ref, v_ref = (next(it) for _ in range(5))
  row_refs = [next(it) for _ in range(int(has_dot) + int(has_g) + len(res_keys))]
  dk_ref, dv_ref = next(it), next(it)
  dq_ref = next(it) if with_dq else None
  dk_acc, dv_acc = next(it), next(it)
  w = pl.program_id(0)
  j = blk_ref[w]

  @pl.when(first_ref[w] > 0)
  def _():
    dk_acc[...] = jnp.zeros_like(dk_acc)
    dv_acc[...] = jnp.zeros_like(dv_acc)

  @pl.when(live_ref[w] > 0)
  def _():
    q, do, k = q_ref[...], do_ref[...], k_ref[...]
    z = dot(q, k, trans_b=True) * p.scale
    allowed = tiles.allowed(p, j, tok_ref[...], jax.lax.broadcasted_iota(jnp.int32, z.shape, 1))
    dp = dot(do, v_ref[...], trans_b=True)
    res, row_dot, g = _row_args([r[...] for r in row_refs], res_keys, has_dot, has_g)
    wt, dz = nz.tile_backward(z, allowed, dp, res, row_dot, g)
    ds = dz.astype(q.dtype)
    dv_acc[...] += dot(wt.astype(do.dtype), do, trans_a=True)
    dk_acc[...] += dot(ds, q, trans_a=True)
    if with_dq:
      dq_ref[...] = dot(ds, k) * p.scale

  if with_dq:

    @pl.when(live_ref[w] == 0)
    def _():
      dq_ref[...] = jnp.zeros_like(dq_ref)

  @pl.when(last_ref[w] > 0)
  def _():
    dk_ref[...] = (dk_acc[...] * p.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def kv_backward(p: Plan, qrows, dorows, rows, res_keys, has_dot, has_g, tok, k, v, work, with_dq):
  """The key-block-major backward: ``(dk [B, S, K, H], dv [B, S, K, Hv], dq parts [B, K,
  W * rows, H] float32 or None)``; ``qrows``, ``dorows`` and the row inputs ``rows`` (each
  ``[B, K, W * rows, 1]``) in the items' rows."""
  item, block, item_out, block_out = _item_specs(p)
  R = p.W * p.rows
  args = (qrows, dorows.astype(qrows.dtype), tok[..., None], heads_first(k, p.Sp))
  args += (heads_first(v, p.Sp), *rows)
  out_shape = [
    jax.ShapeDtypeStruct((p.Sp, p.H), k.dtype),
    jax.ShapeDtypeStruct((p.Sp, p.Hv), v.dtype),
  ] + ([jax.ShapeDtypeStruct((R, p.H), jnp.float32)] if with_dq else [])

  def launch(at, blk, first, last, live):
    grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=5,
      grid=(p.W,),
      in_specs=[item(p.H), item(p.Hv), item(1), block(p.H), block(p.Hv)] + [item(1)] * len(rows),
      out_specs=[block_out(p.H), block_out(p.Hv)] + ([item_out(p.H)] if with_dq else []),
      scratch_shapes=[
        pltpu.VMEM((p.block_size, p.H), jnp.float32),
        pltpu.VMEM((p.block_size, p.Hv), jnp.float32),
      ],
    )
    return pl.pallas_call(
      functools.partial(_kv_bwd_kernel, p, res_keys, has_dot, has_g, with_dq),
      grid_spec=grid_spec,
      out_shape=out_shape,
      compiler_params=_params(p, 1),
      interpret=p.interpret,
      name=f"attnjax_selected_tpu_dkdv_{p.normalizer}",
    )(at, blk, first, last, live, *args)

  outs = _kv_launches(p, work, ("block", "first", "last", "live"), launch)
  dk = jnp.moveaxis(outs[0][:, :, : p.S], 1, 2)
  dv = jnp.moveaxis(outs[1][:, :, : p.S], 1, 2)
  return dk, dv, (outs[2] if with_dq else None)
