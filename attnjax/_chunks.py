"""Chunk scans for the stateful linear forms, with a backward that recomputes each chunk.

The chunked forms of :mod:`attnjax.gated_linear` and :mod:`attnjax.delta_rule`
run a block function over chunks of ``C`` tokens with a ``lax.scan`` carrying
the ``[H, Hv]`` state. Differentiated by plain autodiff, that scan would keep
every chunk's intermediates (decay tensors, the triangular solve's operands)
for the backward: memory that grows with ``T * C * H`` per head, several times
the inputs'. :func:`chunk_scan` instead has a custom VJP whose forward keeps
the chunks' inputs and the state entering each chunk (``T / C`` states of
``H * Hv``: the size of one ``[T, H]`` input when ``Hv = C``) and whose
backward walks the chunks in reverse, recomputing each chunk from its stored
state and pulling the state's cotangent back through it. Memory is O(T) with a
small constant; time is one extra chunk forward per chunk. The delta rule
computes its state-independent terms (the triangular solves) outside the scan,
16 chunks at a time (:func:`map_chunks`), so the scan recomputes only the
matmuls that touch the state.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

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


# Chunks whose state-independent terms are computed together (map_chunks): enough to give the
# matmuls a batch, few enough that their transient [C, C, ...] intermediates stay small.
MAP_BATCH = 16


def map_chunks(fn: Callable, xs: tuple):
  """``fn(*x_c)`` for every chunk ``c`` (leading axis of each ``xs``), ``MAP_BATCH`` chunks at a time.

  A ``vmap`` over all chunks would hold every chunk's intermediates at once
  (at T=16384 the per-channel decays alone take ~0.5 GiB); ``lax.map`` with a
  batch keeps that to ``MAP_BATCH`` chunks, in the forward and in the
  backward of a checkpointed ``fn``.
  """
  n = xs[0].shape[0]
  return jax.lax.map(lambda x: fn(*x), xs, batch_size=min(MAP_BATCH, n))


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
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
