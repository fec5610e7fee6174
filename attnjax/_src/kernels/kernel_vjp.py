"""The glue every Pallas dense kernel shares: custom VJP, forward mode and target.

A Pallas kernel (``pallas_gpu``, ``pallas_tpu``, ``mosaic_gpu``) declares its steps
(:class:`Steps`: a forward, a backward, optionally a forward without residuals);
:func:`differentiable` makes the dense engine of them: reverse mode runs the kernel's
backward, forward mode and second order the block-wise engine, its twin
(:mod:`attnjax._src.kernels.autodiff`); each step is traced when the program is lowered,
for its target, where the kernel asks (:mod:`attnjax._src.kernels.on_target`); the result
is the dense engines' (the input dtype; ``(out, AttentionStats)`` with statistics).
Guide: docs/guides/forward_mode.md, section "How it works".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import options, sharding
from attnjax._src.attention_stats import AttentionStats
from attnjax._src.kernels import autodiff, blockwise, on_target


@dataclasses.dataclass(frozen=True)
class Steps:
  """A Pallas dense kernel's steps.

  Every step takes ``(shard, q, k, v, sink, q_seg, kv_seg, score_args, mask_args)`` (after
  ``shard``, an :class:`attnjax._src.kernels.on_target.Shard` saying where the arrays start
  in the whole call, the call's arrays: sink logits and segment ids None where absent,
  ``score_args`` / ``mask_args`` the modifiers' argument tuples).

  Attributes:
    name: the kernel's name, in jaxprs and errors (``<name>_fwd``, ``<name>_bwd``).
    forward: ``-> ((out [B, T, N, Hv], stats or None), residuals)``: ``stats`` the tuple of
      :class:`attnjax.AttentionStats` fields where the call asks for statistics,
      ``residuals`` a pytree of arrays for the backward.
    backward: ``(shard, *arrays, residuals, d_out, d_lse) -> (dq, dk, dv, dsink, d_score)``
      with ``d_lse`` the cotangent of the statistics' logsumexp (or None) and ``d_score``
      those of the floating-point ``score_args``, in order; None: the twin's backward
      (a kernel without one of its own, e.g. in interpret mode).
    primal: ``-> (out, stats or None)``, a forward that keeps no residuals, for a call
      nothing differentiates (None: ``forward``'s).
    on_target: trace each step when the program is lowered, for its target
      (:func:`attnjax._src.kernels.on_target.call`).
    mosaic: the steps are Mosaic custom calls (which XLA cannot partition).
  """

  name: str
  forward: Callable[..., Any]
  backward: Optional[Callable[..., Any]]
  primal: Optional[Callable[..., Any]] = None
  on_target: bool = False
  mosaic: bool = False


def dense_inputs(q, k, v, sink, q_seg, kv_seg, score_args=(), mask_args=()):
  """The :class:`attnjax.options.DenseInputs` of a step's arrays."""
  return options.DenseInputs(
    q=q,
    k=k,
    v=v,
    sink_logits=sink,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    score_mod_args=score_args,
    mask_mod_args=mask_args,
  )


def _inexact(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _like(x):
  return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def differentiable(inputs, opts, steps: Steps, *, shard_offsets=None):
  """The dense call ``(inputs, opts)`` computed by ``steps``, differentiable in every mode.

  Args:
    inputs: :class:`attnjax.options.DenseInputs` the kernel supports.
    opts: :class:`attnjax.options.DenseOptions`.
    steps: the kernel's :class:`Steps`.
    shard_offsets: where this call's batch rows and heads start in a call split by
      :func:`attnjax._src.sharding.per_shard` (None: 0, 0): the steps and the twin see the
      whole call's batch and head indices.

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)``.
  """
  q = inputs.q
  score_args = tuple(inputs.score_mod_args) if opts.score_mod is not None else ()
  mask_args = tuple(inputs.mask_mod_args) if opts.mask_mod is not None else ()
  # An argument of the custom VJP (not a closure), so the backward, traced later, has it too.
  offsets = tuple(
    jnp.asarray(o, jnp.int32)
    for o in (sharding.ShardOffsets() if shard_offsets is None else shard_offsets)
  )

  def run(step, args, at, suffix, out_like=None):
    if steps.on_target:
      return on_target.call(
        step,
        args,
        offsets=at,
        mosaic=steps.mosaic,
        name=f"{steps.name}_{suffix}",
        out_like=out_like,
      )
    return step(on_target.Shard(*at), *args)

  def twin(q, k, v, sink, q_seg, kv_seg, score_args, mask_args, at):
    """The same call on the block-wise engine (plain JAX): forward mode and second order; its
    modifiers see the whole call's batch and head indices, as the kernel's do."""
    call = dense_inputs(q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    out = blockwise.run_shard(call, opts, at)
    if not opts.return_stats:
      return out, None
    o, st = out
    return o, tuple(st)

  @autodiff.custom_vjp
  def core(q, k, v, sink, q_seg, kv_seg, score_args, mask_args, at):
    args = (q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    if steps.primal is None:
      return run(steps.forward, args, at, "fwd")[0]
    return run(steps.primal, args, at, "fwd")

  def fwd(q, k, v, sink, q_seg, kv_seg, score_args, mask_args, at):
    args = (q, k, v, sink, q_seg, kv_seg, score_args, mask_args)
    result, residuals = run(steps.forward, args, at, "fwd")
    return result, (args, at, residuals)

  def bwd(saved, cts):
    args, at, residuals = saved
    q, k, v, sink, q_seg, kv_seg, score_args, mask_args = args
    d_out, d_stats = cts
    if steps.backward is None:
      places = [i for i, x in enumerate(score_args) if _inexact(x)]

      def of_floats(q, k, v, sink, floats):
        given = list(score_args)
        for i, x in zip(places, floats):
          given[i] = x
        return twin(q, k, v, sink, q_seg, kv_seg, tuple(given), mask_args, at)

      floats = [score_args[i] for i in places]
      _, pull = jax.vjp(of_floats, q, k, v, sink, floats)
      dq, dk, dv, dsink, d_floats = pull((d_out.astype(q.dtype), d_stats))
    else:
      d_lse = None if d_stats is None else d_stats[3]
      floats = [x for x in score_args if _inexact(x)]
      dq, dk, dv, dsink, d_floats = run(
        steps.backward,
        args + (residuals, d_out, d_lse),
        at,
        "bwd",
        out_like=jax.tree.map(_like, (q, k, v, sink, floats)),
      )
    d_floats = iter(d_floats)
    d_score = tuple(
      next(d_floats) if _inexact(x) else np.zeros(jnp.shape(x), jax.dtypes.float0)
      for x in score_args
    )
    return dq, dk, dv, dsink, None, None, d_score, None, None

  core.defvjp(fwd, bwd, twin=twin)
  out, stats = core(
    q,
    inputs.k,
    inputs.v,
    inputs.sink_logits,
    inputs.q_segment_ids,
    inputs.kv_segment_ids,
    score_args,
    mask_args,
    offsets,
  )
  out = out.astype(q.dtype)
  return (out, AttentionStats(*stats)) if opts.return_stats else out
