"""Selected-block attention (NSA's selected branch) through the Pallas kernels, with its custom VJP.

:func:`pallas_tpu` and :func:`mosaic_gpu`: each query token attends, per key/value head, the
key blocks it selected (causal within them), the maths of
:func:`attnjax._src.kernels.selected.twin.gathered`. Both plan the call
(:mod:`attnjax._src.kernels.selected.plan`), run the loop order the group size calls for, and
differentiate through the hand-written backward; forward mode and second order take the
gathered twin's. :func:`unsupported` names what a platform's kernels refuse.
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from attnjax._src import trust
from attnjax._src.kernels import autodiff, on_target
from attnjax._src.kernels.selected import gpu, tpu, twin
from attnjax._src.kernels.selected.plan import (
  Plan,
  canonical_blocks,
  check_inputs,
  gather_rows,
  make_plan,
  merge_parts,
  row_counts,
  sum_parts,
  work_list,
)

Array = jnp.ndarray
PLATFORMS = {"tpu": tpu, "cuda": gpu}
#: The kernels' names in the kernel-trust rule (``attnjax/_src/trust.py``: their verdicts of
#: ``python -m attnjax.check --kernel <name>``), per platform.
TRUST_NAMES = {"tpu": "selected_pallas_tpu", "cuda": "selected_mosaic_gpu"}


def plan_call(
  platform: str,
  q,
  k,
  v,
  block_idx,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  interpret: bool = False,
  return_lse: bool = False,
  order: Optional[str] = None,
  rows: Optional[int] = None,
) -> Plan:
  """The checked :class:`~attnjax._src.kernels.selected.plan.Plan` of a call on ``platform``
  (``"tpu"`` or ``"cuda"``); ``order`` and ``rows`` override the plan's loop order and the
  ``"kv"`` order's rows per work item."""
  check_inputs(q, k, v, block_idx, block_size=block_size, scale=scale, normalizer=normalizer)
  kernels = PLATFORMS[platform]
  return make_plan(
    q,
    k,
    v,
    block_idx,
    block_size=block_size,
    scale=scale,
    normalizer=normalizer,
    return_lse=return_lse,
    interpret=interpret,
    order=order,
    rows=kernels.ROWS if rows is None else rows,
    align=kernels.ALIGN,
  )


def case_class(platform: str, q, k, v, block_idx, **kw) -> str:
  """The case class a call's verdicts name (:func:`attnjax._src.trust.case_class`): its
  normaliser, ``"selected_<loop order>"`` and q's dtype, e.g. ``"softmax selected_kv
  bfloat16"`` (``python -m attnjax.check --kernel selected_...`` checks each)."""
  p = plan_call(platform, q, k, v, block_idx, **kw)
  return trust.case_class(p.normalizer, f"selected_{p.order}", q.dtype)


def unsupported(platform: str, q, k, v, block_idx, **kw) -> list[str]:
  """Reasons ``platform``'s kernels cannot run a call ([] = they can); the call's own errors
  (shapes, dtypes, options) raise instead."""
  plan = plan_call(platform, q, k, v, block_idx, **kw)
  return refusals(plan, PLATFORMS[platform], q.dtype)


def refusals(p: Plan, kernels, dtype) -> list[str]:
  """What ``kernels`` (a platform's module) refuse of the planned call: its own
  ``unsupported`` reasons, and a normaliser with row pre-passes, which no selected-block
  kernel runs."""
  reasons = list(kernels.unsupported(p, dtype))
  if p.nz.row_passes:
    reasons.append(
      f"normalizer={p.normalizer!r}, which needs each row's log-normaliser before its first "
      "block and its backward row term summed over the blocks (the selected-block kernels "
      "run neither pre-pass; 'blockwise' and 'reference' do)"
    )
  return reasons


def _forward(kernels, p: Plan, q, k, v, block_idx):
  """``((out, lse), residuals)``: the forward of the planned call (XLA glue and kernels)."""
  blocks = canonical_blocks(block_idx, p)
  counts = row_counts(blocks, p) if p.needs_counts else None
  if p.order == "query":
    out, res, srow = kernels.query_forward(p, q, k, v, blocks, counts)
    lse = (res["log_norm"] if p.nz.softmax_like else srow["lse"]) if p.return_lse else None
  else:
    work = work_list(blocks, p)
    out_parts, lse_parts = kernels.kv_forward(p, gather_rows(q, work, p), work.token, k, v, work)
    out, res = merge_parts(out_parts, lse_parts, work, blocks, p)
    out = out.astype(q.dtype)
    lse = res["log_norm"] if p.return_lse else None
  if lse is not None:
    lse = lse[..., 0]
  return (out, lse), (blocks, out, res)


def _backward(kernels, p: Plan, q, k, v, blocks, out, res, d_out, d_lse):
  """``(dq, dk, dv)`` of the planned call."""
  nz = p.nz
  d_out = d_out.astype(q.dtype)
  has_dot = nz.reads_row_dot
  rows = []
  if has_dot:
    rows.append(jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1, keepdims=True))
  has_g = d_lse is not None
  if has_g:
    has_key = jnp.repeat(blocks.count > 0, p.G, axis=2)[..., None]
    rows.append(jnp.where(has_key, d_lse.astype(jnp.float32)[..., None], 0.0))
  res_keys = tuple(sorted(res))
  rows += [res[key].astype(jnp.float32) for key in res_keys]
  work = work_list(blocks, p)
  grow = lambda x: gather_rows(x, work, p)
  with_dq = p.order == "kv"
  dk, dv, dq_parts = kernels.kv_backward(
    p,
    grow(q),
    grow(d_out),
    [grow(r) for r in rows],
    res_keys,
    has_dot,
    has_g,
    work.token,
    k,
    v,
    work,
    with_dq,
  )
  if with_dq:
    dq = sum_parts(dq_parts, work, blocks, p).astype(q.dtype)
  else:
    dq = kernels.query_dq(p, q, k, v, d_out, rows, res_keys, has_dot, has_g, blocks)
  return dq, dk, dv


def _run(platform: str, q, k, v, block_idx, **kw):
  p = plan_call(platform, q, k, v, block_idx, **kw)
  kernels = PLATFORMS[platform]
  reasons = refusals(p, kernels, q.dtype)
  if reasons:
    raise ValueError(
      f"selected-block attention on {platform} does not support " + "; ".join(reasons)
    )
  B, T, N = q.shape[:3]
  if 0 in (B, T, N, p.S, p.n, p.H, p.Hv):
    out = jnp.zeros((B, T, N, p.Hv), q.dtype)
    return (out, jnp.zeros((B, T, N), jnp.float32)) if p.return_lse else out
  mosaic = platform == "tpu" and not p.interpret
  # The interpreters of Mosaic GPU kernels carry an ordered effect the custom-VJP machinery
  # cannot hold: there the backward is the twin's (tests call the backward kernels directly).
  own_backward = not (platform == "cuda" and p.interpret)

  def step(fn, args, name, out_like=None):
    if platform != "tpu":
      return fn(on_target.Shard(0, 0), *args)
    return on_target.call(fn, args, mosaic=mosaic, name=name, out_like=out_like)

  def fwd_step(shard, q, k, v, block_idx):
    del shard
    return _forward(kernels, p, q, k, v, block_idx)

  def bwd_step(shard, q, k, v, blocks, out, res, d_out, d_lse):
    del shard
    return _backward(kernels, p, q, k, v, blocks, out, res, d_out, d_lse)

  def smooth(q, k, v, block_idx):
    out, lse = twin.gathered(p, q, k, v, block_idx)
    return out, (lse if p.return_lse else None)

  @autodiff.custom_vjp
  def core(q, k, v, block_idx):
    return fwd(q, k, v, block_idx)[0]

  def fwd(q, k, v, block_idx):
    outs, (blocks, out, res) = step(
      fwd_step, (q, k, v, block_idx), f"selected_{platform}_fwd_{p.normalizer}"
    )
    return outs, (q, k, v, block_idx, blocks, out, res)

  def bwd(saved, cts):
    q, k, v, block_idx, blocks, out, res = saved
    d_out, d_lse = cts
    if not own_backward:
      _, vjp = jax.vjp(lambda q, k, v: smooth(q, k, v, block_idx), q, k, v)
      return vjp((d_out, d_lse)) + (None,)
    like = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    dq, dk, dv = step(
      bwd_step,
      (q, k, v, blocks, out, res, d_out, d_lse),
      f"selected_{platform}_bwd_{p.normalizer}",
      out_like=(like(q), like(k), like(v)),
    )
    return dq, dk, dv, None

  core.defvjp(fwd, bwd, twin=smooth)
  out, lse = core(q, k, v, block_idx)
  return (out, lse) if p.return_lse else out


def pallas_tpu(
  q,
  k,
  v,
  block_idx,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  interpret: bool = False,
  return_lse: bool = False,
  order: Optional[str] = None,
  rows: Optional[int] = None,
):
  """Selected-block attention by the Pallas TPU kernels.

  Each query token ``t`` attends, per key/value head ``kh``, the keys ``s <= t`` of the key
  blocks ``block_idx[b, t, kh, :]`` (block ``j``: keys ``[j * block_size, (j + 1) *
  block_size)``; ``-1``, out-of-range indices and repeats select nothing); the ``G = N / K``
  query heads of a group share them. Logits ``scale * <q, k>`` in float32, then the
  normaliser over those keys; a row with no key gives 0.

  Args:
    q: ``[B, T, N, H]`` (float32 or bfloat16).
    k: ``[B, S, K, H]``.
    v: ``[B, S, K, Hv]``.
    block_idx: int ``[B, T, K, n]``; no gradient.
    block_size: keys per selection block (a multiple of 8, of 16 in bfloat16).
    scale: multiplies ``<q, k>``.
    normalizer: a name of :data:`attnjax.normalizers.NORMALIZERS`.
    interpret: run the kernels in Pallas interpret mode (any backend).
    return_lse: also return the log-normaliser ``[B, T, N]`` float32 (softmax-like
      normalisers: theirs, null columns included; the others: the logsumexp of the
      attended logits; 0 on a row with no key), with its gradient.
    order: ``"query"`` or ``"kv"`` (None: :func:`~attnjax._src.kernels.selected.plan.loop_order`).
    rows: ``"kv"``: rows per work item (None: 256).

  Returns:
    ``out [B, T, N, Hv]`` in ``q``'s dtype, or ``(out, lse)``.
  """
  return _run(
    "tpu",
    q,
    k,
    v,
    block_idx,
    block_size=block_size,
    scale=scale,
    normalizer=normalizer,
    interpret=interpret,
    return_lse=return_lse,
    order=order,
    rows=rows,
  )


def mosaic_gpu(
  q,
  k,
  v,
  block_idx,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  interpret: bool = False,
  return_lse: bool = False,
  order: Optional[str] = None,
  rows: Optional[int] = None,
):
  """Selected-block attention by the Mosaic GPU kernels (Hopper, sm_90); the call of
  :func:`pallas_tpu` (bfloat16 or float16; ``interpret=True`` runs jax's Mosaic GPU
  interpreter on the CPU, whose gradients take the gathered twin's backward)."""
  return _run(
    "cuda",
    q,
    k,
    v,
    block_idx,
    block_size=block_size,
    scale=scale,
    normalizer=normalizer,
    interpret=interpret,
    return_lse=return_lse,
    order=order,
    rows=rows,
  )


IMPLEMENTATIONS = {"pallas_tpu": pallas_tpu, "mosaic_gpu": mosaic_gpu}


def selected_attention(q, k, v, block_idx, *, implementation: str = "pallas_tpu", **kw):
  """The agreed call of the selected branch: ``implementation`` ``"pallas_tpu"`` or
  ``"mosaic_gpu"`` (:data:`IMPLEMENTATIONS`), then the keywords of :func:`pallas_tpu`."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
      f"implementation={implementation!r} is not one of: "
      + ", ".join(repr(n) for n in IMPLEMENTATIONS)
    )
  return IMPLEMENTATIONS[implementation](q, k, v, block_idx, **kw)
