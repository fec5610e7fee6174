"""Context parallelism: attention over a sequence sharded across devices.

Called inside ``jax.shard_map`` with the token axis of every input sharded
over one mesh axis (``context_axis=`` of the attention functions), each call
returns its shard of the output, equal to the unsharded call.

Dense family (:func:`dense`, ``context_strategy=``):

- ``"ring"`` (default): keys/values travel around the ring, the normaliser's
  online state stays (:mod:`attnjax.kernels.blockwise.ring`); O(T / P) memory.
- ``"all_gather"``: keys/values (and their segment ids) are gathered, the
  queries stay sharded and run the single-device path at their global
  positions.
- ``"all_to_all"`` (Ulysses, Jacobs et al. 2023): heads <-> sequence, any
  single-device implementation on the whole sequence for ``N / P`` heads,
  then back.

Layouts of the sequence (``context_layout=``): ``"contiguous"`` (shard ``p``
holds tokens ``p * T / P ..``) or ``"zigzag"`` (shard ``p`` holds chunks
``p`` and ``2P - 1 - p`` of ``2P``; under a causal mask every device does the
same work). :func:`zigzag` / :func:`unzigzag` reorder a token axis between
the natural order and the order whose contiguous shards are the zigzag ones.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnjax.kernels.blockwise.ring import LAYOUTS, shard_positions

Array = jnp.ndarray

STRATEGIES = ("ring", "all_gather", "all_to_all")


def _check_axis(x, axis_size: int, axis: int, name: str) -> int:
  if isinstance(axis_size, bool) or not isinstance(axis_size, int) or axis_size < 1:
    raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")
  ndim = jnp.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"{name}: axis={axis} is out of range for an array of shape {jnp.shape(x)}")
  length = jnp.shape(x)[axis]
  if length % (2 * axis_size):
    raise ValueError(f"{name}: the token axis ({axis}) of shape {jnp.shape(x)} has length "
                     f"{length}, not a multiple of 2 * axis_size = {2 * axis_size}")
  return axis % ndim


def zigzag(x: Array, axis_size: int, axis: int = 1) -> Array:
  """Reorders token axis ``axis`` so that contiguous shard ``p`` of ``axis_size`` holds
  chunks ``p`` and ``2 * axis_size - 1 - p`` of the natural order (``2 * axis_size``
  chunks): the load-balanced causal layout (``context_layout="zigzag"``).

  Args:
    x: an array whose axis ``axis`` is the sequence (length a multiple of ``2 * axis_size``).
    axis_size: the number of devices of the context axis.
    axis: the token axis.

  Returns:
    ``x`` reordered; :func:`unzigzag` undoes it.
  """
  axis = _check_axis(x, axis_size, axis, "zigzag")
  P = axis_size
  chunks = jnp.split(x, 2 * P, axis=axis)
  return jnp.concatenate([c for p in range(P) for c in (chunks[p], chunks[2 * P - 1 - p])],
                         axis=axis)


def unzigzag(x: Array, axis_size: int, axis: int = 1) -> Array:
  """The natural order of a token axis that :func:`zigzag` reordered (same arguments)."""
  axis = _check_axis(x, axis_size, axis, "unzigzag")
  P = axis_size
  chunks = jnp.split(x, 2 * P, axis=axis)  # shard p holds chunks 2p (natural p), 2p+1 (2P-1-p)
  natural = [None] * (2 * P)
  for p in range(P):
    natural[p], natural[2 * P - 1 - p] = chunks[2 * p], chunks[2 * p + 1]
  return jnp.concatenate(natural, axis=axis)


__all__ = ["LAYOUTS", "STRATEGIES", "shard_positions", "unzigzag", "zigzag"]
