"""The recomputing chunk scan (attnjax.kernels.recurrent.chunks): gradients of a scan, memory of chunk states only."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.kernels.recurrent import chunks
from helpers import assert_close, rand_qkv


def _toy_block(xs, s):
  a, b = xs  # [B, C, D] each
  out = jnp.tanh(a * s[:, None] + b)
  return out, s * 0.9 + jnp.sum(out * b, axis=1)


def test_chunk_scan_gradients_equal_plain_scan():
  key = jax.random.split(jax.random.key(0), 3)
  a = jax.random.normal(key[0], (5, 2, 4, 3))
  b = jax.random.normal(key[1], (5, 2, 4, 3))
  s0 = jax.random.normal(key[2], (2, 3))

  def plain(s0, a, b):
    final, outs = jax.lax.scan(lambda s, x: _toy_block(x, s)[::-1], s0, (a, b))
    return jnp.sum(outs**2) + jnp.sum(jnp.sin(final))

  def ours(s0, a, b):
    outs, final = chunks.chunk_scan(_toy_block, s0, (a, b))
    return jnp.sum(outs**2) + jnp.sum(jnp.sin(final))

  assert_close(ours(s0, a, b), plain(s0, a, b), rtol=1e-6)
  for got, want in zip(
    jax.grad(ours, argnums=(0, 1, 2))(s0, a, b), jax.grad(plain, argnums=(0, 1, 2))(s0, a, b)
  ):
    assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_to_from_chunks_round_trip():
  x = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3)
  c = chunks.to_chunks(x, 3)
  assert c.shape == (3, 2, 3, 3)
  np.testing.assert_array_equal(c[-1, :, 1:], 0.0)  # padding
  np.testing.assert_array_equal(chunks.from_chunks(c, 7), x)


def _residual_bytes(fn, *args) -> int:
  _, pull = jax.vjp(fn, *args)
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(pull))


@pytest.mark.parametrize("family", ["gla", "delta"])
def test_chunked_backward_keeps_only_chunk_states(family):
  """The chunked forms' VJP residuals stay within a few inputs' worth (O(T)); autodiff of
  the reference scan keeps a [H, Hv] state per token (O(T H Hv))."""
  B, T, N, H, C = 1, 256, 2, 32, 32
  q, k, v = rand_qkv(B=B, T=T, N=N, K=N, H=H, seed=1)
  if family == "gla":
    g = -0.1 * jax.random.uniform(jax.random.key(2), (B, T, N, H))
    fn = functools.partial(attnjax.gated_linear_attention, log_decay=g, chunk_size=C)
  else:
    beta = jnp.full((B, T, N), 0.5)
    fn = functools.partial(attnjax.delta_rule_attention, beta=beta, chunk_size=C)
  inputs = 3 * q.size * 4
  ours = _residual_bytes(fn, q, k, v)
  with_autodiff = _residual_bytes(lambda q, k, v: fn(q, k, v, implementation="reference"), q, k, v)
  # Kept: chunk states (T / C * N * H * H floats = one [T, N, H] input when C = H) and
  # float32 copies of the chunked inputs (and decays): about 1.7 inputs' worth for both,
  # against ~15-23 for the scan.
  assert ours <= 2 * inputs, (ours, inputs)
  assert with_autodiff >= 5 * ours, (with_autodiff, ours)
