"""Token orders of a sharded sequence: :func:`.zigzag` and :func:`.unzigzag`."""

from __future__ import annotations

import jax.numpy as jnp

from attnjax._src import validators

Array = jnp.ndarray


def _token_axis(x, axis_size: int, axis: int, name: str) -> int:
  validators.check_positive_int("axis_size", axis_size, where=name)
  ndim = jnp.ndim(x)
  if not -ndim <= axis < ndim:
    raise ValueError(f"{name}: axis={axis} is out of range for an array of shape {jnp.shape(x)}")
  length = jnp.shape(x)[axis]
  if length % (2 * axis_size):
    raise ValueError(
      f"{name}: the token axis ({axis}) of shape {jnp.shape(x)} has length "
      f"{length}, not a multiple of 2 * axis_size = {2 * axis_size}"
    )
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
    ``x`` reordered; :func:`.unzigzag` undoes it.

  Raises:
    ValueError: an axis out of range, or a length not a multiple of ``2 * axis_size``.
  """
  axis = _token_axis(x, axis_size, axis, "zigzag")
  P = axis_size
  chunks = jnp.split(x, 2 * P, axis=axis)
  return jnp.concatenate(
    [c for p in range(P) for c in (chunks[p], chunks[2 * P - 1 - p])], axis=axis
  )


def unzigzag(x: Array, axis_size: int, axis: int = 1) -> Array:
  """The natural order of a token axis that :func:`.zigzag` reordered.

  Args:
    x: the reordered array (axis ``axis`` of length a multiple of ``2 * axis_size``).
    axis_size: the number of devices of the context axis.
    axis: the token axis.

  Returns:
    ``x`` in the natural order.

  Raises:
    ValueError: an axis out of range, or a length not a multiple of ``2 * axis_size``.
  """
  axis = _token_axis(x, axis_size, axis, "unzigzag")
  P = axis_size
  chunks = jnp.split(x, 2 * P, axis=axis)  # shard p holds natural chunks p and 2P - 1 - p
  natural = [None] * (2 * P)
  for p in range(P):
    natural[p], natural[2 * P - 1 - p] = chunks[2 * p], chunks[2 * p + 1]
  return jnp.concatenate(natural, axis=axis)
