"""QK-normalised and cosine attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import attnjax
from helpers import rand_qkv as _rand_qkv


def rand_qkv(B=2, T=9, N=8, K=2, H=16, seed=0, dtype=jnp.float32):
  """Large queries and small keys, so normalising them changes the logits a lot."""
  return _rand_qkv(B=B, T=T, N=N, K=K, H=H, seed=seed, dtype=dtype, scales=(3.0, 0.5, 1.0))


def _np_norm(x, norm, eps=1e-6):
  x = np.asarray(x, np.float64)
  if norm == "l2":
    return x / np.sqrt((x**2).sum(-1, keepdims=True) + eps)
  if norm == "rms":
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
  c = x - x.mean(-1, keepdims=True)
  return c / np.sqrt((c**2).mean(-1, keepdims=True) + eps)


@pytest.mark.parametrize("norm", ["l2", "rms", "layer"])
def test_qk_norm_equals_dense_on_normalised_inputs(norm):
  q, k, v = rand_qkv()
  gq = jax.random.uniform(jax.random.key(1), (16,), minval=0.5, maxval=2.0)
  gk = jax.random.uniform(jax.random.key(2), (16,), minval=0.5, maxval=2.0)
  out = attnjax.qk_norm_attention(q, k, v, norm=norm, q_gain=gq, k_gain=gk, is_causal=True)
  qn = jnp.asarray(_np_norm(q, norm) * np.asarray(gq), jnp.float32)
  kn = jnp.asarray(_np_norm(k, norm) * np.asarray(gk), jnp.float32)
  ref = attnjax.dot_product_attention(qn, kn, v, is_causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_qk_norm_bounds_the_logits():
  q, k, v = rand_qkv()
  _, s_raw = attnjax.dot_product_attention(q * 100, k * 100, v, return_stats=True)
  _, s_norm = attnjax.qk_norm_attention(q * 100, k * 100, v, norm="rms", return_stats=True)
  assert float(s_raw.max_logit.max()) > 1e3
  assert float(s_norm.max_logit.max()) <= 16**0.5 + 1e-3  # |q.k| <= H for unit-RMS vectors


def test_qk_norm_gain_gradients_match_finite_differences():
  # float64 inputs: float32 central differences of this loss (~375) are off by up to ~1.6%
  # (rounding of the loss over the step), its float32 gradient by ~1e-7 of float64's; with
  # float64 inputs and a step of 1e-3 they agree to ~3e-5.
  with jax.enable_x64(True):
    q, k, v = (x.astype(jnp.float64) for x in rand_qkv())
    loss = lambda gq: jnp.sum(
      attnjax.qk_norm_attention(q, k, v, norm="rms", q_gain=gq, is_causal=True) ** 2
    )
    gain = 1.0 + 0.1 * jnp.arange(16, dtype=jnp.float64) / 16
    check_grads(loss, (gain,), order=1, modes=("rev",), eps=1e-3, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(jax.grad(loss)(gain)).max()) > 0


def test_cosine_worked_example_and_rescaling():
  # q=(2,1), k=(1,2) have cos = 4 / (sqrt5 sqrt5) = 0.8.
  q = jnp.array([2.0, 1.0]).reshape(1, 1, 1, 2)
  k = jnp.array([[1.0, 2.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
  v = jnp.eye(2).reshape(1, 2, 1, 2)
  _, s = attnjax.cosine_attention(
    q, k, v, temperature=jnp.ones(1), convention="scale", return_stats=True
  )
  np.testing.assert_allclose(s.max_logit[0, 0], 0.8, atol=1e-5)
  base = attnjax.cosine_attention(q, k, v, temperature=jnp.ones(1), convention="scale")
  for cq, ck in ((5.0, 1.0), (1.0, 0.1), (7.0, 3.0)):
    scaled = attnjax.cosine_attention(
      cq * q, ck * k, v, temperature=jnp.ones(1), convention="scale"
    )
    np.testing.assert_allclose(scaled, base, atol=1e-5)
  # Dot-product attention keeps the norms, so rescaling changes it.
  a = attnjax.dot_product_attention(q, k, v)
  b = attnjax.dot_product_attention(5.0 * q, k, v)
  assert float(jnp.abs(a - b).max()) > 1e-2


def test_cosine_invariant_to_per_token_rescaling():
  q, k, v = rand_qkv()
  t = jnp.full((8,), jnp.log(10.0))
  cq = jax.random.uniform(jax.random.key(5), (2, 9, 8, 1), minval=0.1, maxval=10.0)
  ck = jax.random.uniform(jax.random.key(6), (2, 9, 2, 1), minval=0.1, maxval=10.0)
  a = attnjax.cosine_attention(q, k, v, temperature=t, is_causal=True)
  b = attnjax.cosine_attention(q * cq, k * ck, v, temperature=t, is_causal=True)
  np.testing.assert_allclose(a, b, atol=1e-5)


def _np_cos(q, k):
  qn, kn = _np_norm(q, "l2", 1e-6), _np_norm(k, "l2", 1e-6)
  kn = np.repeat(kn, q.shape[2] // k.shape[2], axis=2)
  return np.einsum("btnh,bsnh->bnts", qn, kn)


@pytest.mark.parametrize("convention", ["swin", "scale", "ngpt"])
def test_cosine_conventions(convention):
  q, k, v = rand_qkv(B=1, T=5, N=4, K=2, H=8)
  if convention == "ngpt":
    temp = jax.random.uniform(jax.random.key(3), (4, 8), minval=0.5, maxval=1.5)
  else:
    temp = jnp.array([0.5, 1.0, 3.0, 6.0])  # for swin, 6.0 > log 100 exercises the clamp
  _, s = attnjax.cosine_attention(
    q, k, v, temperature=temp, convention=convention, return_stats=True
  )
  cos = _np_cos(q, k)
  if convention == "swin":
    z = cos * np.exp(np.minimum(np.asarray(temp), np.log(100.0)))[None, :, None, None]
  elif convention == "scale":
    z = cos * np.asarray(temp)[None, :, None, None]
  else:
    qn = _np_norm(q, "l2") * np.asarray(temp)[None, None]
    kn = np.repeat(_np_norm(k, "l2"), 2, axis=2) * np.asarray(temp)[None, None]
    z = np.einsum("btnh,bsnh->bnts", qn, kn) * np.sqrt(8)
  np.testing.assert_allclose(s.max_logit, z.max((-1, -2)), atol=1e-4, rtol=1e-5)


def test_swin_log_scale_is_clamped_at_log_100():
  q, k, v = rand_qkv(B=1, T=4, N=1, K=1, H=8)
  a = attnjax.cosine_attention(q, k, v, temperature=jnp.array([jnp.log(100.0)]))
  b = attnjax.cosine_attention(q, k, v, temperature=jnp.array([10.0]))
  np.testing.assert_allclose(a, b, atol=1e-6)
  g = jax.grad(lambda t: jnp.sum(attnjax.cosine_attention(q, k, v, temperature=t) ** 2))(
    jnp.array([10.0])
  )
  assert float(g[0]) == 0.0  # clamped: no gradient above the cap
  g = jax.grad(lambda t: jnp.sum(attnjax.cosine_attention(q, k, v, temperature=t) ** 2))(
    jnp.array([1.0])
  )
  assert float(abs(g[0])) > 0.0


def test_bf16_inputs_keep_dtype():
  q, k, v = rand_qkv(dtype=jnp.bfloat16)
  up = [x.astype(jnp.float32) for x in (q, k, v)]
  calls = (
    lambda q, k, v: attnjax.qk_norm_attention(q, k, v, norm="layer"),
    lambda q, k, v: attnjax.cosine_attention(q, k, v, temperature=jnp.zeros(8)),
  )
  for call in calls:
    out = call(q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), call(*up), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(
  "fn,kw,pattern",
  [
    ("qk", dict(norm="batch"), r"norm='batch'"),
    ("qk", dict(q_gain=jnp.ones(3)), r"q_gain must have shape \[H\] = \(16,\)"),
    ("cos", dict(temperature=jnp.ones(3)), r"temperature must have shape \[N\]"),
    ("cos", dict(temperature=jnp.ones(8), convention="xyz"), r"convention='xyz'"),
    ("cos", dict(temperature=jnp.ones((3, 3)), convention="ngpt"), r"s_qk"),
  ],
  ids=["norm", "gain_shape", "temp_shape", "convention", "ngpt_shape"],
)
def test_bad_inputs(fn, kw, pattern):
  q, k, v = rand_qkv()
  f = attnjax.qk_norm_attention if fn == "qk" else attnjax.cosine_attention
  with pytest.raises(ValueError, match=pattern):
    f(q, k, v, **kw)
