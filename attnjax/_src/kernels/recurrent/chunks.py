"""Chunk scans for the stateful linear engines, with a backward that recomputes each chunk.

:func:`chunk_scan` runs a block function over chunks of ``C`` tokens (:func:`to_chunks`,
:func:`from_chunks`) in a ``lax.scan`` carrying the ``[H, Hv]`` state. Its custom VJP keeps
only the chunks' inputs and the state entering each chunk, and its backward walks the
chunks in reverse, recomputing each: O(T) memory, one extra chunk forward per chunk.
Guide: docs/guides/kernels.md, section "Recurrent chunk kernels".
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

from attnjax._src.kernels import autodiff

Array = jnp.ndarray


def to_chunks(x: Array, chunk: int) -> Array:
  """``[B, T, ...] -> [n, B, C, ...]``, padding time with zeros up to ``n * C``."""
  B, T = x.shape[:2]
  n = -(-T // chunk)
  if n * chunk != T:
    x = jnp.pad(x, ((0, 0), (0, n * chunk - T)) + ((0, 0),) * (x.ndim - 2))
  return jnp.swapaxes(jnp.reshape(x, (B, n, chunk) + x.shape[2:]), 0, 1)


def from_chunks(y: Array, T: int) -> Array:
  """``[n, B, C, ...] -> [B, T, ...]``, dropping padded rows."""
  n, B, C = y.shape[:3]
  return jnp.reshape(jnp.swapaxes(y, 0, 1), (B, n * C) + y.shape[3:])[:, :T]


def chunk_scan(block: Callable, state: Array, xs: tuple) -> tuple[Array, Array]:
  """``lax.scan`` of ``(out_c, state) = block(x_c, state)`` over chunks; returns ``(outs, final)``.

  Args:
    block: ``(x, state) -> (out, new_state)`` on one chunk; a pure function of
      its arguments (static options bound with ``functools.partial``). Every
      leaf of ``x`` must be a float array (pass masks as 0/1 floats): the
      backward differentiates ``block`` with respect to all of them.
    state: the state before the first chunk.
    xs: a tuple of arrays ``[n, ...]`` (leading axis: chunks).

  Returns:
    ``(outs [n, ...], final state)``, with a backward that stores only the
    ``n`` incoming states and recomputes each chunk (module docstring).
  """
  return _chunk_scan(block, state, xs)


@functools.partial(autodiff.custom_vjp, nondiff_argnums=(0,))
def _chunk_scan(block, state, xs):
  def step(s, x):
    out, s = block(x, s)
    return s, out

  final, outs = jax.lax.scan(step, state, xs)
  return outs, final


def _chunk_scan_fwd(block, state, xs):
  def step(s, x):
    out, s_next = block(x, s)
    return s_next, (out, s)

  final, (outs, incoming) = jax.lax.scan(step, state, xs)
  return (outs, final), (incoming, xs)


def _chunk_scan_bwd(block, residuals, cotangents):
  incoming, xs = residuals
  d_outs, d_final = cotangents

  def step(d_state, inputs):
    x, s, d_out = inputs
    _, pull = jax.vjp(block, x, s)
    d_x, d_prev = pull((d_out, d_state))
    return d_prev, d_x

  d_state0, d_xs = jax.lax.scan(step, d_final, (xs, incoming, d_outs), reverse=True)
  return d_state0, d_xs


_chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)
