"""The dense family over a sequence sharded across devices: ring, all-gather, all-to-all.

:func:`~attnjax.parallel.attention` takes a validated dense call whose options name a
``context_axis`` (inside ``jax.shard_map``, every array holding this
device's shard of the tokens) and returns this device's shard of the output.
The single-device path is passed in (``run_local``: the op's per-device computation, which
:func:`attnjax._op.run` hands to the op's context strategy), so that this module sits beside
the families, not above them, and a call never returns into the family module it left.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from attnjax._src import options, validators
from attnjax._src.attention_stats import AttentionStats
from attnjax._src.kernels.blockwise import kernel as blockwise_kernel
from attnjax._src.kernels.blockwise import ring
from attnjax._src.kernels.blockwise.ring import shard_positions
from attnjax._src.parallel.tokens import unzigzag as natural_order
from attnjax._src.parallel.tokens import zigzag as zigzag_order

Array = jnp.ndarray
# run_local(inputs, opts, implementation) -> result: the single-device computation.
RunLocal = Callable[[options.DenseInputs, options.DenseOptions, Optional[str]], object]


def _check_shards(inputs: options.DenseInputs, opts: options.DenseOptions, P: int) -> None:
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  if T != S:
    raise ValueError(
      f"context_axis={opts.context_axis!r}: queries and keys must be sharded "
      f"alike (the same local length), got q {tuple(inputs.q.shape)} and k "
      f"{tuple(inputs.k.shape)}"
    )
  if opts.context_layout == "zigzag" and T % 2:
    raise ValueError(
      f"context_layout='zigzag' needs an even local length (two chunks per "
      f"shard), got q {tuple(inputs.q.shape)} on each of {P} shards"
    )
  if inputs.bias is not None or inputs.mask is not None:
    raise ValueError(
      f"context_axis={opts.context_axis!r} takes no bias or mask array (their "
      f"key columns live on other shards); express the rule as a mask_mod / "
      f"score_mod, which see global positions"
    )
  if opts.block_layout is not None:
    raise ValueError(
      "block_layout describes one device's whole call; with context_axis pass "
      "the mask_mod alone (its blocks are found per shard at run time)"
    )


# ---------------------------------------------------------------------------
# Modifiers that see global positions (all-gather) or global heads (all-to-all).


def _at_positions(b, n, i, j, positions, *args, user, is_causal, window):
  """``mask_mod`` of local query rows: the structure and ``user`` at ``positions[i]``."""
  return _structure(b, n, positions[i], j, *args, user=user, is_causal=is_causal, window=window)


def _structure(b, n, i, j, *args, user, is_causal, window):
  """``mask_mod`` of global positions ``i``, ``j``: causal / window and ``user``."""
  out = jnp.ones(jnp.broadcast_shapes(jnp.shape(i), jnp.shape(j)), bool)
  if is_causal:
    out = jnp.logical_and(out, j <= i)
  if window is not None:
    out = jnp.logical_and(out, jnp.logical_and(j >= i - window[0], j <= i + window[1]))
  if user is not None:
    out = jnp.logical_and(out, user(b, n, i, j, *args))
  return out


def _score_at_positions(z, b, n, i, j, positions, *args, user):
  return user(z, b, n, positions[i], j, *args)


def _mask_of_heads(b, n, i, j, first, *args, user):
  return user(b, n + first, i, j, *args)


def _score_of_heads(z, b, n, i, j, first, *args, user):
  return user(z, b, n + first, i, j, *args)


# ---------------------------------------------------------------------------
# Strategies.


def _all_gather(inputs, opts, implementation, run_local, P: int):
  """Keys/values gathered; the local queries run the single-device path at global positions.

  With ``return_stats`` the block-wise kernel runs the local rows at their global
  positions and takes the statistics' means and maximum over the rows of every device
  (``attnjax.kernels.blockwise.kernel.run_gathered``), as the ring does.
  """
  axis, layout = opts.context_axis, opts.context_layout
  if opts.return_stats and implementation not in (None, "blockwise"):
    raise ValueError(
      f"return_stats=True with context_strategy='all_gather' runs the block-wise "
      f"kernel (its statistics are over the rows of every device); "
      f"implementation={implementation!r} cannot (use None or 'blockwise')"
    )
  T = inputs.q.shape[1]

  def gather(x):
    if x is None:
      return None
    x = jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return natural_order(x, P, 1) if layout == "zigzag" else x

  positions = shard_positions(jax.lax.axis_index(axis), P, T, layout)
  structure = opts.is_causal or opts.window is not None
  if opts.return_stats:  # the kernel gives the modifiers global positions itself
    mask_mod = opts.mask_mod
    if structure:
      mask_mod = functools.partial(
        _structure, user=opts.mask_mod, is_causal=opts.is_causal, window=opts.window
      )
    local_inputs = dataclasses.replace(
      inputs, k=gather(inputs.k), v=gather(inputs.v), kv_segment_ids=gather(inputs.kv_segment_ids)
    )
    local_opts = dataclasses.replace(opts.local(), is_causal=False, window=None, mask_mod=mask_mod)
    return blockwise_kernel.run_gathered(
      local_inputs, local_opts, q_positions=positions, stats_axis=axis
    )
  mask_mod, mask_args = opts.mask_mod, tuple(inputs.mask_mod_args)
  if structure or mask_mod is not None:
    mask_mod = functools.partial(
      _at_positions, user=opts.mask_mod, is_causal=opts.is_causal, window=opts.window
    )
    mask_args = (positions,) + mask_args
  score_mod, score_args = opts.score_mod, tuple(inputs.score_mod_args)
  if score_mod is not None:
    score_mod = functools.partial(_score_at_positions, user=opts.score_mod)
    score_args = (positions,) + score_args
  local_inputs = dataclasses.replace(
    inputs,
    k=gather(inputs.k),
    v=gather(inputs.v),
    kv_segment_ids=gather(inputs.kv_segment_ids),
    score_mod_args=score_args,
    mask_mod_args=mask_args,
  )
  local_opts = dataclasses.replace(
    opts.local(), is_causal=False, window=None, mask_mod=mask_mod, score_mod=score_mod
  )
  return run_local(local_inputs, local_opts, implementation)


def _all_to_all(inputs, opts, implementation, run_local, P: int):
  """Ulysses: heads <-> sequence, the single-device path on the whole sequence, and back."""
  axis, layout = opts.context_axis, opts.context_layout
  q, k, v = inputs.q, inputs.k, inputs.v
  N, K = q.shape[2], k.shape[2]
  if N % P:
    raise ValueError(
      f"context_strategy='all_to_all' splits the query heads over the axis: "
      f"N={N} heads (q {tuple(q.shape)}) are not divisible by the axis size {P}; "
      f"use context_strategy='ring'"
    )
  per = N // P  # query heads per device
  G = N // K
  d = jax.lax.axis_index(axis)

  def to_sequence(x):  # [B, T/P, X, ...] -> [B, T, X/P, ...] in natural order
    x = jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)
    return natural_order(x, P, 1) if layout == "zigzag" else x

  def gather(x):
    if x is None:
      return None
    x = jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return natural_order(x, P, 1) if layout == "zigzag" else x

  if K % P == 0:  # each device's query heads read K / P whole kv heads
    k_full, v_full = to_sequence(k), to_sequence(v)
  elif G % per == 0:  # each device's query heads share one kv head: gather, then keep it
    head = d * per // G
    k_full = jax.lax.dynamic_slice_in_dim(gather(k), head, 1, axis=2)
    v_full = jax.lax.dynamic_slice_in_dim(gather(v), head, 1, axis=2)
  else:
    raise ValueError(
      f"context_strategy='all_to_all' with N={N} query heads over K={K} key/value "
      f"heads on {P} devices: neither K nor N / K / (N / {P}) divides evenly, so "
      f"a device's query heads do not map to whole key/value heads; use "
      f"context_strategy='ring'"
    )
  sink = inputs.sink_logits
  if sink is not None:
    sink = jax.lax.dynamic_slice_in_dim(sink, d * per, per, axis=1)
  # A normaliser's per-head parameters follow their heads ([1, N|1, 1, 1]).
  params = tuple(
    x if x.shape[1] == 1 else jax.lax.dynamic_slice_in_dim(x, d * per, per, axis=1)
    for x in inputs.normalizer_params
  )
  first = (d * per).astype(jnp.int32)
  mask_mod, mask_args = opts.mask_mod, tuple(inputs.mask_mod_args)
  if mask_mod is not None:
    mask_mod = functools.partial(_mask_of_heads, user=opts.mask_mod)
    mask_args = (first,) + mask_args
  score_mod, score_args = opts.score_mod, tuple(inputs.score_mod_args)
  if score_mod is not None:
    score_mod = functools.partial(_score_of_heads, user=opts.score_mod)
    score_args = (first,) + score_args
  local_inputs = dataclasses.replace(
    inputs,
    q=to_sequence(q),
    k=k_full,
    v=v_full,
    sink_logits=sink,
    normalizer_params=params,
    q_segment_ids=gather(inputs.q_segment_ids),
    kv_segment_ids=gather(inputs.kv_segment_ids),
    score_mod_args=score_args,
    mask_mod_args=mask_args,
  )
  local_opts = dataclasses.replace(opts.local(), mask_mod=mask_mod, score_mod=score_mod)
  result = run_local(local_inputs, local_opts, implementation)
  out, stats = result if opts.return_stats else (result, None)

  def to_heads(x, seq_axis, head_axis):  # [.., T, .., X/P ..] -> [.., T/P, .., X ..]
    x = zigzag_order(x, P, seq_axis) if layout == "zigzag" else x
    return jax.lax.all_to_all(x, axis, split_axis=seq_axis, concat_axis=head_axis, tiled=True)

  out = to_heads(out, 1, 2)
  if stats is None:
    return out
  # [B, N / P] per device -> [B, N] on every device: each in its place, one sum over the axis.
  fields = ("sink_mass", "entropy", "max_logit", "row_sum")
  placed = [
    jax.lax.dynamic_update_slice_in_dim(
      jnp.zeros(x.shape[:1] + (N,) + x.shape[2:], x.dtype), x, d * per, axis=1
    )
    for x in (getattr(stats, f) for f in fields)
  ]
  whole = dict(zip(fields, jax.lax.psum(placed, axis)))
  return out, AttentionStats(logsumexp=to_heads(stats.logsumexp, 2, 1), **whole)


def choose_strategy(implementation: Optional[str], local_heads: int, axis_size: int) -> str:
  """The strategy of ``context_strategy=None``: the ring for the block-wise engine or
  auto-dispatch (the ring runs the block-wise kernel on each pair of shards), else, for a named
  engine the ring cannot run, all-to-all where the axis divides the device's query heads, else
  all-gather."""
  if implementation in (None, "blockwise"):
    return "ring"
  return "all_to_all" if local_heads % axis_size == 0 else "all_gather"


def attention(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  implementation: Optional[str],
  run_local: RunLocal,
):
  """This device's shard of a dense call whose sequence is sharded over ``opts.context_axis``.

  Args:
    inputs: the call's arrays, each this device's shard along time (q ``[B, T/P, N, H]``,
      k / v ``[B, T/P, K, H]``, segment ids ``[B, T/P]``); sink logits, ``score_mod_args``
      and ``mask_mod_args`` whole on every device.
    opts: validated options with ``context_axis`` set; ``context_strategy`` None is chosen
      here (:func:`choose_strategy`).
    implementation: the single-device implementation (``"ring"`` runs the block-wise
      kernel: None or ``"blockwise"``; the others run any).
    run_local: ``(inputs, opts, implementation) -> result``, the single-device path on
      this device's share of the work (the dense op's computation that
      :func:`attnjax._op.run` hands to its context strategy).

  Returns:
    As the single-device call, for this device's rows.
  """
  axis = validators.check_mesh_axis("context_axis", opts.context_axis, "the function")
  P = jax.lax.axis_size(axis)
  _check_shards(inputs, opts, P)
  if opts.context_strategy is None:
    strategy = choose_strategy(implementation, inputs.q.shape[2], P)
    opts = dataclasses.replace(opts, context_strategy=strategy)
  if opts.context_strategy == "ring":
    if implementation not in (None, "blockwise"):
      raise ValueError(
        f"context_strategy='ring' runs the block-wise kernel on each pair of "
        f"shards; implementation={implementation!r} cannot (use None or "
        f"'blockwise', or context_strategy='all_to_all' for another kernel)"
      )
    return ring.attention(inputs, opts.local(), axis_name=axis, layout=opts.context_layout)
  if opts.context_strategy == "all_gather":
    return _all_gather(inputs, opts, implementation, run_local, P)
  return _all_to_all(inputs, opts, implementation, run_local, P)
