"""What both platforms' selected-block kernels compute on one tile: logits, the causal mask and the
normaliser's state layout.

A tile is some rows (a token's G query heads, or a work item's (token, head) pairs) against
one key block; a row at token ``t`` attends key ``s`` of the block when ``s <= t`` and
``s < S``. :func:`state_layout` gives the normaliser's online state for ``R`` rows (its own
``init`` / ``finish``, evaluated abstractly).
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def allowed(plan, j, token, kcol) -> Array:
  """bool: key ``j * block_size + kcol`` allowed for rows at ``token`` (``[R, 1]``, or a
  scalar; -1 for a padding row); ``kcol`` the ``[1, bs]`` (or ``[R, bs]``) key offsets."""
  key = j * plan.block_size + kcol
  return (key <= token) & (key < plan.S)


def state_layout(nz, R: int, Hv: int, stats: bool):
  """``(state keys with shapes, residual keys, statistics keys)`` of ``nz``'s online state for
  ``R`` rows (sorted; from its ``init`` / ``finish`` evaluated abstractly)."""
  rows = (R, 1)

  def run():
    st = nz.init(rows, (R, Hv), stats)
    counts = jnp.ones(rows, jnp.float32) if (nz.needs_counts or stats) else None
    return st, nz.finish(st, nz.row_inputs(None, counts), stats)

  st, (_, res, srow) = jax.eval_shape(run)
  state = tuple((key, st[key].shape) for key in sorted(st))
  return state, tuple(sorted(res)), (tuple(sorted(srow)) if srow is not None else ())
