"""The logits seam (``attnjax._logits``) against independent formulas and ``jax.grad``."""

from __future__ import annotations

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src import logits as _logits


def _rng(seed=0):
  return np.random.default_rng(seed)


@pytest.mark.parametrize("cap", [0.5, 3.0, 30.0])
def test_softcap_value_and_derivative(cap):
  s = _rng().normal(scale=4.0, size=(3, 17)).astype(np.float32)
  z = np.asarray(_logits.softcap(jnp.asarray(s), cap))
  # c * tanh(s / c) through exponentials (no tanh): c * (1 - e^{-2x}) / (1 + e^{-2x}).
  e = np.exp(-2.0 * s.astype(np.float64) / cap)
  np.testing.assert_allclose(z, cap * (1.0 - e) / (1.0 + e), rtol=2e-6, atol=2e-6)
  assert np.all(np.abs(z) <= cap)
  dz = _rng(1).normal(size=s.shape).astype(np.float32)
  want = jax.grad(lambda x: jnp.sum(_logits.softcap(x, cap) * dz))(jnp.asarray(s))
  # d/ds c tanh(s / c) = sech^2(s / c) = 4 e^{-2x} / (1 + e^{-2x})^2.
  np.testing.assert_allclose(np.asarray(want), dz * 4.0 * e / (1.0 + e) ** 2, rtol=1e-5, atol=1e-6)
  from_s = _logits.softcap_grad(jnp.asarray(dz), cap, s=jnp.asarray(s))
  from_capped = _logits.softcap_grad(jnp.asarray(dz), cap, capped=jnp.asarray(z))
  np.testing.assert_allclose(np.asarray(from_s), np.asarray(want), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(from_capped), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_no_softcap_is_identity():
  s = jnp.asarray(_rng().normal(size=(4, 5)), jnp.float32)
  dz = jnp.asarray(_rng(2).normal(size=(4, 5)), jnp.float32)
  assert _logits.softcap(s, None) is s
  assert _logits.softcap_grad(dz, None, s=s) is dz


def test_bias_is_added_after_the_softcap():
  cap = 2.0
  s = jnp.asarray([[-9.0, 0.5, 9.0]], jnp.float32)
  bias = jnp.asarray([[0.0, -100.0, 5.0]], jnp.float32)
  z, capped = _logits.capped_logits(s, cap, bias)
  want_capped = cap * np.tanh(np.asarray(s) / cap)
  np.testing.assert_allclose(np.asarray(capped), want_capped, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(z), want_capped + np.asarray(bias), rtol=1e-6)
  # A large negative bias is not squashed into [-cap, cap].
  assert float(z[0, 1]) < -90.0 and float(z[0, 2]) > cap
  z0, c0 = _logits.capped_logits(s, cap)
  np.testing.assert_array_equal(np.asarray(z0), np.asarray(c0))


@pytest.mark.parametrize("similarity", ["dot", "neg_sq_euclidean"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_scores_against_loops(similarity, cap):
  B, T, S, K, G, H = 2, 3, 4, 2, 3, 5
  rng = _rng(3)
  q = rng.normal(size=(B, T, K * G, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  scale = 0.7
  got = np.asarray(
    _logits.scores(
      _logits.group_queries(jnp.asarray(q), K),
      jnp.asarray(k),
      scale=scale,
      similarity=similarity,
      cap=cap,
    )
  )
  assert got.shape == (B, K, G, T, S)
  for b in range(B):
    for n in range(K * G):
      for i in range(T):
        for j in range(S):
          qi, kj = q[b, i, n].astype(np.float64), k[b, j, n // G].astype(np.float64)
          x = scale * qi @ kj if similarity == "dot" else -scale * np.sum((qi - kj) ** 2)
          if cap is not None:
            x = cap * np.tanh(x / cap)
          np.testing.assert_allclose(got[b, n // G, n % G, i, j], x, rtol=1e-5, atol=1e-5)


def test_scores_gradient_matches_finite_differences():
  rng = _rng(4)
  q = jnp.asarray(rng.normal(size=(1, 2, 2, 3)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 3, 1, 3)), jnp.float32)
  f = lambda q, k: jnp.sum(
    jnp.sin(
      _logits.scores(
        _logits.group_queries(q, 1), k, scale=0.5, similarity="neg_sq_euclidean", cap=2.0
      )
    )
  )
  jax.test_util.check_grads(f, (q, k), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_index_grid_layouts():
  b, n, i, j = _logits.index_grid(2, (3,), jnp.arange(4), jnp.asarray([7, 9]))
  shape = (2, 3, 4, 2)
  grids = np.meshgrid(np.arange(2), np.arange(3), np.arange(4), np.asarray([7, 9]), indexing="ij")
  for got, want in zip((b, n, i, j), grids):
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(got), shape), want)
  # Grouped heads: query head k * G + g.
  b, n, i, j = _logits.index_grid(1, (2, 3), 5 + jnp.arange(2), jnp.arange(4))
  assert n.shape == (1, 2, 3, 1, 1) and i.shape == (1, 1, 1, 2, 1) and j.shape == (1, 1, 1, 1, 4)
  np.testing.assert_array_equal(np.asarray(n)[0, :, :, 0, 0], [[0, 1, 2], [3, 4, 5]])
  np.testing.assert_array_equal(np.asarray(i)[0, 0, 0, :, 0], [5, 6])
