"""The recurrent families over a sequence sharded across devices: state passing.

Their state update is affine over a shard, ``S_out = A S_in + B``: each device runs its
chunked pass once with the values widened by ``H`` zero columns from ``[I | 0]`` (giving
``[A | B]``), the ``P`` transitions are summed to every device (one all-reduce), and each
device composes those before it into its entering state and runs its pass again.
Guide: docs/guides/kernels.md, section "Recurrent chunk kernels".
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from attnjax._src.kernels.blockwise.ring import varying

Array = jnp.ndarray
# local(v, initial_state) -> (out, final_state): the family's computation on this shard.
Local = Callable[[Array, Array], tuple]


def every_shard(xs, axis: str):
  """Each device's arrays ``xs`` (a pytree) -> ``[P, ...]`` stacks of every device's, on every
  device: each placed in its row of zeros, one sum over ``axis`` (invariant over it)."""
  P = jax.lax.axis_size(axis)
  p = jax.lax.axis_index(axis)

  def place(x):
    return jax.lax.dynamic_update_index_in_dim(jnp.zeros((P,) + x.shape, x.dtype), x, p, 0)

  return jax.lax.psum(jax.tree.map(place, xs), axis)


def state_passing(
  local: Local,
  v: Array,
  *,
  num_heads: int,
  head_dim: int,
  initial_state: Optional[Array],
  segment_ids: Optional[Array],
  return_state: bool,
  axis: str,
):
  """This device's shard of a causal recurrent call sharded along time over ``axis``.

  Args:
    local: ``(v, initial_state) -> (out, final_state)``: the family's computation on this
      device's tokens (every other argument bound; :func:`attnjax._src.ops.recurrence.context` runs
      the op's engine), with values ``[B, T, K, Hv']`` and a state ``[B, N, H, Hv']`` of
      any width ``Hv'``; ``out`` is returned as it comes (any layout).
    v: this device's values ``[B, T, K, Hv]``.
    num_heads: ``N`` (query heads: one state each).
    head_dim: ``H`` (the key dimension: the state's rows).
    initial_state: ``[B, N, H, Hv]`` before the first token of the whole sequence, or None.
    segment_ids: this device's ``[B, T]`` ids, or None.
    return_state: also return the final state of the whole sequence.
    axis: the ``jax.shard_map`` mesh axis.

  Returns:
    ``local``'s ``out`` from this device's entering state, or ``(out, final state
    [B, N, H, Hv])``.
  """
  B, _, K, Hv = v.shape
  N, H = num_heads, head_dim
  P = jax.lax.axis_size(axis)
  p = jax.lax.axis_index(axis)
  widened = jnp.concatenate([jnp.zeros(v.shape[:3] + (H,), v.dtype), v], axis=-1)
  start = jnp.concatenate(
    [
      jnp.broadcast_to(jnp.eye(H, dtype=jnp.float32), (B, N, H, H)),
      jnp.zeros((B, N, H, Hv), jnp.float32),
    ],
    axis=-1,
  )
  _, transition = local(
    widened, varying(start, axis)
  )  # typed per device, as the scan's carry  # [B, N, H, H + Hv] = [A | B]

  parts = [transition]
  if segment_ids is not None:  # does a segment start at each shard's first token?
    parts += [segment_ids[:, 0], segment_ids[:, -1]]
  parts = every_shard(parts, axis)
  transitions = parts[0]
  state = (
    jnp.zeros((B, N, H, Hv), jnp.float32)
    if initial_state is None
    else initial_state.astype(jnp.float32)
  )
  entering = []
  for s in range(P):
    entering.append(state)
    a, b = transitions[s, ..., :H], transitions[s, ..., H:]
    state = jnp.einsum("bnij,bnjv->bniv", a, state) + b
    if segment_ids is not None and s + 1 < P:
      reset = parts[1][s + 1] != parts[2][s]  # [B]
      state = jnp.where(reset[:, None, None, None], 0.0, state)
  mine = varying(jnp.stack(entering)[p], axis)
  out, _ = local(v, mine)
  return (out, state) if return_state else out
