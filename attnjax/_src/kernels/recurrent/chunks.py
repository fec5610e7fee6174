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
small constant; time is one extra chunk forward per chunk. Both forms compute
their state-independent terms (decays, the delta rule's triangular solve)
inside the scan, one chunk at a time: batched over chunks (``vmap`` /
``lax.map``) the same terms ran slower on XLA's CPU backend (GLA's per-channel
chunk 3.7 ms against 1.2 ms per chunk at C=64, N=8, H=64) and, at
``chunk_size=32``, crashed jaxlib 0.10.2 (a segfault in its "ynn" fusion,
jax-ml/jax#40412).
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
