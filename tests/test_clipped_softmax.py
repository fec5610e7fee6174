"""Clipped softmax (Bondarenko et al. 2023) against a naive jnp definition, on every engine.

``clip((zeta - gamma) softmax(z) + gamma, 0, 1)``: value, gradient and forward mode through
the reference, the block-wise engine (several tiles per row, so its pre-passes over the key
blocks matter), the sparse, compressed and block-select families; softmax at zeta = 1,
gamma = 0; the paper's gamma = -alpha / T; O(T) memory at T = 16k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import normalizers
from attnjax.kernels import blockwise
from helpers import reduction_tolerance

B, T, N, K, H = 2, 37, 4, 2, 8


def _inputs(seed=0, scale=2.0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (B, T, N, H)) * scale
  k = jax.random.normal(keys[1], (B, T, K, H)) * scale
  v = jax.random.normal(keys[2], (B, T, K, H))
  ct = jax.random.normal(keys[3], (B, T, N, H))
  return q, k, v, ct


def naive(q, k, v, allowed, *, zeta=1.0, gamma=-0.025, alpha=None):
  """The definition, materialised: softmax over the allowed keys, stretched, clipped."""
  kr, vr = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  z = jnp.einsum("btnh,bsnh->bnts", q, kr) * H**-0.5
  z = jnp.where(allowed, z, -jnp.inf)
  p = jax.nn.softmax(z, axis=-1)
  if alpha is not None:
    gamma = -alpha / jnp.maximum(jnp.sum(jnp.broadcast_to(allowed, z.shape), -1, keepdims=True), 1)
  w = jnp.where(allowed, jnp.clip((zeta - gamma) * p + gamma, 0.0, 1.0), 0.0)
  return jnp.einsum("bnts,bsnh->btnh", w, vr)


CAUSAL = jnp.tril(jnp.ones((T, T), bool))[None, None]


def _check(fn, reference, q, k, v, ct):
  tol = reduction_tolerance(jnp.float32, T, depth=4, scale=float(jnp.max(jnp.abs(v))) * 4)
  np.testing.assert_allclose(fn(q, k, v), reference(q, k, v), atol=tol, rtol=0)
  g = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(lambda *a: jnp.sum(reference(*a) * ct), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=tol * 4 * float(jnp.max(jnp.abs(b)) + 1), rtol=0)


@pytest.mark.parametrize(
  "engine",
  [
    "reference",
    "blockwise_8x8",
    pytest.param("blockwise_16x8_noncausal", marks=pytest.mark.slow),
    pytest.param("sparse", marks=pytest.mark.slow),
    pytest.param("block_select", marks=pytest.mark.slow),
  ],
)
def test_equals_the_naive_definition_in_value_and_gradient(engine):
  q, k, v, ct = _inputs()
  causal = engine != "blockwise_16x8_noncausal"
  allowed = CAUSAL if causal else jnp.ones((1, 1, T, T), bool)

  def reference(q, k, v):
    return naive(q, k, v, allowed)

  if engine == "reference":
    fn = lambda q, k, v: attnjax.dot_product_attention(
      q, k, v, is_causal=causal, normalizer="clipped_softmax", implementation="reference"
    )
  elif engine.startswith("blockwise"):
    bq, bk = (8, 8) if engine == "blockwise_8x8" else (16, 8)
    fn = lambda q, k, v: blockwise.attention(
      q, k, v, is_causal=causal, normalizer="clipped_softmax", block_q=bq, block_k=bk
    )
  elif engine == "sparse":
    pattern = attnjax.patterns.sliding_window(9)
    i, j = np.meshgrid(np.arange(T), np.arange(T), indexing="ij")
    allowed = jnp.asarray((j <= i) & (j >= i - 9))[None, None]

    def reference(q, k, v):
      return naive(q, k, v, allowed)

    fn = lambda q, k, v: attnjax.sparse_attention(
      q, k, v, pattern=pattern, block_size=8, normalizer="clipped_softmax"
    )
  else:
    ref = lambda q, k, v: attnjax.block_select_attention(
      q, k, v, block_size=8, top_k=2, normalizer="clipped_softmax", implementation="reference"
    )
    # The selection is the family's; its reference is checked against the naive definition
    # through the dense reference elsewhere: here the gathered engine against it.
    reference = ref
    fn = lambda q, k, v: attnjax.block_select_attention(
      q, k, v, block_size=8, top_k=2, normalizer="clipped_softmax", implementation="gathered"
    )
  _check(fn, reference, q, k, v, ct)


def test_padding_mask_gqa_and_the_alpha_parametrisation():
  q, k, v, ct = _inputs(1)
  keep = jnp.arange(T)[None, :] < jnp.array([[T], [T - 9]])  # [B, S]: the second row padded
  mask = keep[:, None, None, :]
  with normalizers.registered(normalizers.ClippedSoftmax("clipped_a4", alpha=4.0)):
    for impl in ("reference", "blockwise"):
      fn = lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, mask=mask, normalizer="clipped_a4", implementation=impl
      )
      _check(fn, lambda q, k, v: naive(q, k, v, mask, alpha=4.0), q, k, v, ct)


@pytest.mark.slow
def test_forward_mode_equals_the_reference():
  q, k, v, _ = _inputs(2)
  tangents = _inputs(3)[:3]

  def run(impl):
    return jax.jvp(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, normalizer="clipped_softmax", implementation=impl
      ),
      (q, k, v),
      tangents,
    )

  (o1, t1), (o2, t2) = run("reference"), run("blockwise")
  np.testing.assert_allclose(o1, o2, atol=1e-5, rtol=0)
  np.testing.assert_allclose(t1, t2, atol=1e-4 * float(jnp.max(jnp.abs(t1))), rtol=0)


def test_zeta_1_gamma_0_is_softmax():
  q, k, v, ct = _inputs(4)
  with normalizers.registered(normalizers.ClippedSoftmax("clipped_plain", zeta=1.0, gamma=0.0)):
    for impl in ("reference", "blockwise"):
      run = lambda nz, q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, normalizer=nz, implementation=impl
      )
      # Equal to float32 rounding: e / sum(e) against exp(z - lse).
      _check(lambda *a: run("clipped_plain", *a), lambda *a: run("softmax", *a), q, k, v, ct)


def test_the_gradient_is_zero_where_the_clip_is_active():
  # One row, three keys: the first far below the others, so its stretched weight clips to 0.
  z = jnp.array([[[[-8.0, 2.0, 2.5]]]])
  nz = normalizers.get("clipped_softmax")

  def w_of(z):
    return nz.weights(z, jnp.ones_like(z, bool))[0]

  w = w_of(z)
  assert float(w[0, 0, 0, 0]) == 0.0 and 0 < float(w[0, 0, 0, 1]) < 1
  jac = jax.jacobian(w_of)(z)[0, 0, 0, :, 0, 0, 0, :]  # d w_j / d z_k
  np.testing.assert_array_equal(jac[0], 0.0)  # the clipped weight moves with no logit


def test_statistics_of_the_fused_pass_equal_the_reference():
  q, k, v, _ = _inputs(5)
  out = {
    impl: attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer="clipped_softmax", implementation=impl, return_stats=True
    )[1]
    for impl in ("reference", "blockwise")
  }
  for field in ("sink_mass", "entropy", "max_logit", "logsumexp", "row_sum"):
    np.testing.assert_allclose(
      getattr(out["blockwise"], field), getattr(out["reference"], field), atol=2e-5, rtol=0
    )
  assert float(jnp.max(out["reference"].row_sum)) <= 1.0 + 1e-6  # rows sum to at most zeta


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(gamma=0.1), ValueError, r"gamma=0.1 must be <= 0"),
    (dict(zeta=0.9, gamma=-0.1), ValueError, r"zeta=0.9 must be >= 1"),
    (dict(gamma=-0.1, alpha=2.0), ValueError, "exactly one"),
    (dict(), ValueError, "exactly one"),
    (dict(alpha=-1.0), ValueError, r"alpha=-1.0 must be >= 0"),
    (dict(gamma="low"), TypeError, "gamma must be a number"),
  ],
)
def test_bad_bounds_name_the_value(kwargs, error, match):
  with pytest.raises(error, match=match):
    normalizers.ClippedSoftmax("bad", **kwargs)


def test_kernels_without_the_row_passes_refuse_it_by_name():
  q, k, v, _ = _inputs()
  for impl in sorted(
    set(("pallas_tpu", "mosaic_gpu")) - set(attnjax._src.options.ROW_PASS_KERNELS)
  ):
    with pytest.raises(ValueError, match="log-normaliser before its first tile"):
      attnjax.dot_product_attention(q, k, v, normalizer="clipped_softmax", implementation=impl)
  # Auto-dispatch takes the block-wise engine.
  out = attnjax.dot_product_attention(q, k, v, is_causal=True, normalizer="clipped_softmax")
  np.testing.assert_allclose(out, naive(q, k, v, CAUSAL), atol=1e-5, rtol=0)


def test_blockwise_at_16k_never_builds_t_by_s():
  # Forward and backward of the block-wise engine at T = 16k: its temporaries stay a few
  # [B, T, N, H] arrays (a [T, S] float32 matrix would be 1 GiB; the pre-passes keep rows).
  T16 = 16384
  x = jax.ShapeDtypeStruct((1, T16, 2, 64), jnp.float32)

  def loss(q, k, v):
    out = attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer="clipped_softmax", implementation="blockwise"
    )
    return jnp.sum(out)

  m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
  if m is None:
    pytest.skip("no memory analysis on this backend")
  one = T16 * 2 * 64 * 4
  assert m.temp_size_in_bytes < 16 * one, (m.temp_size_in_bytes, one)
  assert m.temp_size_in_bytes < T16 * T16 * 4 / 16  # [T, S] float32: 1 GiB


@pytest.mark.parametrize(
  "kernel", ["pallas_gpu", pytest.param("pallas_tpu", marks=pytest.mark.slow)]
)
def test_the_pallas_kernels_in_interpret_mode(kernel):
  # Several key blocks per row, so the in-kernel pre-pass (GPU) or the pass kernels (TPU) and
  # the backward's tile row term matter; GQA; forward mode through the kernel's twin.
  from attnjax.kernels import pallas_gpu, pallas_tpu

  if kernel == "pallas_gpu":
    Tk, Hk, scale = 70, 16, 2.0
    blocks = pallas_gpu.BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)
    attention = pallas_gpu.attention
  else:
    Tk, Hk, scale = 200, 128, 1.5
    blocks = pallas_tpu.BlockSizes(block_q=128, block_k=128, block_q_bwd=128, block_k_bwd=128)
    attention = pallas_tpu.attention
  keys = jax.random.split(jax.random.key(6), 4)
  q = jax.random.normal(keys[0], (1, Tk, 4, Hk)) * scale
  k = jax.random.normal(keys[1], (1, Tk, 2, Hk)) * scale
  v = jax.random.normal(keys[2], (1, Tk, 2, Hk))
  ct = jax.random.normal(keys[3], (1, Tk, 4, Hk))

  def fn(q, k, v):
    return attention(
      q, k, v, is_causal=True, normalizer="clipped_softmax", block_sizes=blocks, interpret=True
    )

  def reference(q, k, v):
    return attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer="clipped_softmax", implementation="reference"
    )

  tol = reduction_tolerance(jnp.float32, Tk, depth=4, scale=4.0)
  np.testing.assert_allclose(fn(q, k, v), reference(q, k, v), atol=tol, rtol=0)
  g = jax.grad(lambda *a: jnp.sum(fn(*a) * ct), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(lambda *a: jnp.sum(reference(*a) * ct), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=tol * float(jnp.max(jnp.abs(b)) + 1), rtol=0)
  _, t = jax.jvp(fn, (q, k, v), (q, k, v))
  _, t_ref = jax.jvp(reference, (q, k, v), (q, k, v))
  np.testing.assert_allclose(t, t_ref, atol=tol * float(jnp.max(jnp.abs(t_ref)) + 1), rtol=0)
