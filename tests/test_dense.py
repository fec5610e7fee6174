"""Dense attention: parity with jax.nn, normaliser formulas, stats, properties, errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import attnjax
from attnjax._src import target as _target
from attnjax._src.ops.dense import attention as dense
from helpers import assert_close, rand_qkv, reduction_tolerance


def reordered(length: int) -> dict:
  """``assert_close`` tolerances for two float32 attention results whose sums ran in another
  order: logits (``H`` terms), the normaliser's row sum and the weighted values (``S`` terms),
  relative to each array's scale."""
  return dict(rtol=0, atol=reduction_tolerance(jnp.float32, length, depth=3), scaled=True)


def loss_of(fn):
  """Scalar loss with a fixed random cotangent, for gradient comparisons."""

  def loss(q, k, v, *extra):
    out = fn(q, k, v, *extra)
    ct = jax.random.normal(jax.random.key(42), out.shape, jnp.float32)
    return jnp.sum(out.astype(jnp.float32) * ct)

  return loss


# ---------------------------------------------------------------------------
# Parity with jax.nn.dot_product_attention.

PARITY_CASES = {
  "plain": dict(),
  "causal": dict(is_causal=True),
  "scale": dict(scale=0.37),
  "window": dict(window=(3, 2)),
  "causal_window": dict(is_causal=True, window=(4, 0)),
  "mask": dict(mask="random"),
  "bias": dict(bias="random"),
  "causal_mask_bias": dict(is_causal=True, mask="random", bias="random"),
}


def _materialise(opts, B, N, T, S):
  opts = dict(opts)
  if opts.get("mask") == "random":
    m = jax.random.bernoulli(jax.random.key(7), 0.7, (B, 1, T, S))
    opts["mask"] = m.at[..., 0].set(True)  # jax.nn averages empty rows; keep every row non-empty
  if opts.get("bias") == "random":
    opts["bias"] = jax.random.normal(jax.random.key(8), (1, N, T, S))
  return opts


@pytest.mark.parametrize("K", [1, 2, 8], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("case", list(PARITY_CASES), ids=str)
def test_parity_with_jax_nn_fp32(case, K):
  B, T, N, H = 2, 11, 8, 16
  q, k, v = rand_qkv(B=B, T=T, N=N, K=K, H=H)
  opts = _materialise(PARITY_CASES[case], B, N, T, T)
  ours = functools.partial(attnjax.dot_product_attention, implementation="reference")
  theirs = jax.nn.dot_product_attention
  theirs_kw = dict(opts)
  if "window" in theirs_kw:
    theirs_kw["local_window_size"] = theirs_kw.pop("window")
  out = ours(q, k, v, **opts)
  ref = theirs(q, k, v, **theirs_kw)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  g_ours = jax.grad(loss_of(lambda q, k, v: ours(q, k, v, **opts)), argnums=(0, 1, 2))(q, k, v)
  g_ref = jax.grad(loss_of(lambda q, k, v: theirs(q, k, v, **theirs_kw)), argnums=(0, 1, 2))(
    q, k, v
  )
  for a, b in zip(g_ours, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_bias_gradient_matches_jax_nn():
  q, k, v = rand_qkv(T=9)
  bias = jax.random.normal(jax.random.key(3), (2, 8, 9, 9))
  g1 = jax.grad(lambda b: jnp.sum(attnjax.dot_product_attention(q, k, v, bias=b) ** 2))(bias)
  g2 = jax.grad(lambda b: jnp.sum(jax.nn.dot_product_attention(q, k, v, bias=b) ** 2))(bias)
  np.testing.assert_allclose(g1, g2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("K", [1, 2, 8], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_parity_with_jax_nn_bf16(is_causal, K):
  # bf16 inputs: we keep logits and weights in float32 and round once at the end; jax.nn
  # rounds the weights to bf16 before the value matmul, so agreement is to bf16 precision.
  q, k, v = rand_qkv(T=16, K=K, dtype=jnp.bfloat16)
  out = attnjax.dot_product_attention(q, k, v, is_causal=is_causal)
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2, rtol=2e-2)
  exact = attnjax.dot_product_attention(
    *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=is_causal
  )
  np.testing.assert_allclose(out.astype(np.float32), exact, atol=1e-2, rtol=1e-2)


def test_xla_implementation_matches_reference():
  q, k, v = rand_qkv(T=10)
  mask = jax.random.bernoulli(jax.random.key(1), 0.5, (2, 1, 10, 10))
  seg = jnp.array([[0] * 4 + [1] * 6, [0] * 10])
  for kw in (
    dict(is_causal=True),
    dict(mask=mask),
    dict(segment_ids=seg, is_causal=True),
    dict(window=(2, 1)),
  ):
    a = attnjax.dot_product_attention(q, k, v, implementation="xla", **kw)
    b = attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
  "kw,word",
  [
    (dict(normalizer="sigmoid"), "normalizer='sigmoid'"),
    (dict(softcap=5.0), "softcap"),
    (dict(sink_logits=jnp.zeros(8)), "sink_logits"),
    (dict(similarity="neg_sq_euclidean"), "similarity"),
    (dict(return_stats=True), "return_stats"),
  ],
  ids=["sigmoid", "softcap", "sinks", "euclid", "stats"],
)
def test_xla_refuses_options_it_cannot_honour(kw, word):
  q, k, v = rand_qkv(T=4)
  with pytest.raises(ValueError, match=word):
    attnjax.dot_product_attention(q, k, v, implementation="xla", **kw)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the CPU refusal")
def test_cudnn_refuses_to_run_on_the_cpu():
  q, k, v = rand_qkv(T=4, dtype=jnp.bfloat16)
  if _target.cudnn_version() is None:  # jax cannot even trace its cuDNN call here
    match = "cuDNN library"
  else:  # traced (and compiled for a GPU in tests/test_targets.py), but not lowered for the CPU
    match = r"implementation='cudnn' runs on a CUDA GPU only.*lowered for 'cpu'"
  with pytest.raises(ValueError, match=match):
    attnjax.dot_product_attention(q, k, v, implementation="cudnn")


# ---------------------------------------------------------------------------
# Normalisers against their formulas, written out independently in numpy.


def _np_logits(q, k, scale):
  B, T, N, H = q.shape
  K = k.shape[2]
  kk = np.repeat(np.asarray(k, np.float64), N // K, axis=2)
  return np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), kk) * scale


def _np_out(w, v, N):
  vv = np.repeat(np.asarray(v, np.float64), N // v.shape[2], axis=2)
  return np.einsum("bnts,bsnh->btnh", w, vv)


def _np_weights(z, allowed, normalizer, sink=None):
  z = np.where(allowed, z, -np.inf)
  e = np.where(allowed, np.exp(z), 0.0)
  if normalizer == "softmax":
    extra = 0.0 if sink is None else np.exp(sink)[None, :, None, None]
    return e / (e.sum(-1, keepdims=True) + extra)
  if normalizer == "softmax_one":
    return e / (1.0 + e.sum(-1, keepdims=True))
  if normalizer == "sigmoid":
    n = allowed.sum(-1, keepdims=True)
    return np.where(allowed, 1.0 / (1.0 + np.exp(-(z - np.log(n)))), 0.0)
  if normalizer == "softpick":
    num = np.where(allowed, np.maximum(e - 1.0, 0.0), 0.0)
    den = np.where(allowed, np.abs(e - 1.0), 0.0).sum(-1, keepdims=True) + 1e-6
    return num / den
  if normalizer == "none":
    return np.where(allowed, z, 0.0)
  if normalizer == "relu":  # Wortsman et al. 2023: relu(z) / n, n = allowed keys of the row
    n = np.maximum(allowed.sum(-1, keepdims=True), 1)
    return np.where(allowed, np.maximum(z, 0.0), 0.0) / n
  if normalizer == "clipped_softmax":  # Bondarenko et al. 2023: zeta = 1, gamma = -0.025
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.where(allowed, np.clip(1.025 * p - 0.025, 0.0, 1.0), 0.0)
  raise AssertionError(normalizer)


@pytest.mark.parametrize("normalizer", attnjax.normalizers.NORMALIZERS)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_normalizer_matches_formula(normalizer, is_causal):
  q, k, v = rand_qkv(B=1, T=7, N=4, K=2, H=8, seed=3)
  out = attnjax.dot_product_attention(q, k, v, is_causal=is_causal, normalizer=normalizer)
  allowed = np.tril(np.ones((7, 7), bool)) if is_causal else np.ones((7, 7), bool)
  allowed = np.broadcast_to(allowed, (1, 4, 7, 7))
  w = _np_weights(_np_logits(q, k, 8**-0.5), allowed, normalizer)
  np.testing.assert_allclose(out, _np_out(w, v, 4), atol=1e-5, rtol=1e-5)


def test_sink_logits_match_formula():
  q, k, v = rand_qkv(B=1, T=6, N=4, K=4, H=8, seed=4)
  sink = jnp.array([-2.0, 0.0, 1.0, 5.0])
  out = attnjax.dot_product_attention(q, k, v, sink_logits=sink, is_causal=True)
  allowed = np.broadcast_to(np.tril(np.ones((6, 6), bool)), (1, 4, 6, 6))
  w = _np_weights(_np_logits(q, k, 8**-0.5), allowed, "softmax", sink=np.asarray(sink))
  np.testing.assert_allclose(out, _np_out(w, v, 4), atol=1e-5, rtol=1e-5)


def test_softmax_one_is_softmax_with_a_zero_logit_and_zero_value():
  q, k, v = rand_qkv(B=2, T=5, N=4, K=4, H=8, seed=5)
  out = attnjax.dot_product_attention(q, k, v, normalizer="softmax_one")
  # Append a key whose logit is exactly 0 (zero key) and whose value is zero.
  k0 = jnp.concatenate([k, jnp.zeros_like(k[:, :1])], axis=1)
  v0 = jnp.concatenate([v, jnp.zeros_like(v[:, :1])], axis=1)
  ref = attnjax.dot_product_attention(q, k0, v0)
  np.testing.assert_allclose(out, ref, atol=1e-6, rtol=1e-6)
  # And sink logits of 0 are softmax_one.
  sink0 = attnjax.dot_product_attention(q, k, v, sink_logits=jnp.zeros(4))
  assert_close(out, sink0, "sink logits of 0", **reordered(8))


def test_very_negative_sink_logits_reduce_to_softmax():
  q, k, v = rand_qkv(T=6)
  a = attnjax.dot_product_attention(q, k, v, sink_logits=jnp.full((8,), -1e4), is_causal=True)
  b = attnjax.dot_product_attention(q, k, v, is_causal=True)
  assert_close(a, b, "sink logits of -1e4", **reordered(16))


def test_softcap_matches_formula():
  q, k, v = rand_qkv(B=1, T=5, N=2, K=2, H=8, seed=6)
  q = q * 6.0  # large logits so the cap matters
  out = attnjax.dot_product_attention(q, k, v, softcap=3.0)
  z = _np_logits(q, k, 8**-0.5)
  w = _np_weights(3.0 * np.tanh(z / 3.0), np.ones_like(z, bool), "softmax")
  np.testing.assert_allclose(out, _np_out(w, v, 2), atol=1e-5, rtol=1e-5)
  _, stats = attnjax.dot_product_attention(q, k, v, softcap=3.0, return_stats=True)
  assert float(stats.max_logit.max()) <= 3.0


def test_neg_sq_euclidean_matches_formula():
  q, k, v = rand_qkv(B=1, T=5, N=2, K=1, H=4, seed=7)
  out = attnjax.dot_product_attention(q, k, v, similarity="neg_sq_euclidean", scale=0.5)
  qq = np.asarray(q, np.float64)[0, :, :, None, :]  # [T, N, 1, H]
  kk = np.asarray(k, np.float64)[0, None, :, 0, :][:, None]  # [1, 1, S, H]
  z = -0.5 * ((qq - kk) ** 2).sum(-1)  # [T, N, S]
  z = np.transpose(z, (1, 0, 2))[None]
  w = _np_weights(z, np.ones_like(z, bool), "softmax")
  np.testing.assert_allclose(out, _np_out(w, v, 2), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------
# Gradients against finite differences.


def test_sink_logit_gradient_matches_finite_differences():
  q, k, v = rand_qkv(B=1, T=4, N=2, K=2, H=4)
  f = lambda s: attnjax.dot_product_attention(q, k, v, sink_logits=s, is_causal=True)
  check_grads(f, (jnp.array([0.3, -0.5]),), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


def test_softcap_gradient_matches_finite_differences():
  q, k, v = rand_qkv(B=1, T=4, N=2, K=2, H=4)
  f = lambda q, k: attnjax.dot_product_attention(4.0 * q, k, v, softcap=2.0)
  check_grads(f, (q, k), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("normalizer", ["softmax", "softmax_one"])
def test_logsumexp_has_a_true_gradient(normalizer):
  q, k, v = rand_qkv(B=1, T=4, N=2, K=2, H=4)
  lse = lambda q, k: (
    attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer=normalizer, return_stats=True
    )[1].logsumexp
  )
  check_grads(lse, (q, k), order=1, modes=["rev"], eps=1e-3, atol=1e-2, rtol=1e-2)
  g = jax.grad(lambda q: jnp.sum(lse(q, k)))(q)
  assert float(jnp.abs(g).max()) > 1e-3


def test_all_normalizers_have_finite_gradients():
  q, k, v = rand_qkv(T=8)
  mask = jnp.zeros((2, 1, 8, 8), bool).at[:, :, 1:, :].set(True)  # row 0 has no key
  for n in attnjax.normalizers.NORMALIZERS:
    g = jax.grad(
      loss_of(
        lambda q, k, v: attnjax.dot_product_attention(
          q, k, v, mask=mask, normalizer=n, is_causal=True
        )
      ),
      argnums=(0, 1, 2),
    )(q, k, v)
    assert all(bool(jnp.isfinite(x).all()) for x in g), n


# ---------------------------------------------------------------------------
# Worked examples.


def test_worked_example():
  # Logits (1, 2) / sqrt(2): softmax weights 1 / (1 + e^(1/sqrt 2)) and its complement.
  q = jnp.array([1.0, 2.0]).reshape(1, 1, 1, 2)
  k = jnp.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
  v = jnp.eye(2).reshape(1, 2, 1, 2)  # one-hot values: the output is the weights
  out, stats = attnjax.dot_product_attention(q, k, v, return_stats=True)
  w0 = 1.0 / (1.0 + np.exp(1.0 / np.sqrt(2.0)))
  np.testing.assert_allclose(out[0, 0, 0], [w0, 1.0 - w0], rtol=1e-6)
  np.testing.assert_allclose(out[0, 0, 0], [0.330, 0.670], atol=5e-4)
  np.testing.assert_allclose(stats.max_logit[0, 0], np.sqrt(2.0), rtol=1e-6)
  np.testing.assert_allclose(
    stats.logsumexp[0, 0, 0], np.log(np.exp(1 / np.sqrt(2.0)) + np.exp(np.sqrt(2.0))), rtol=1e-6
  )


def test_zero_query_gives_uniform_weights():
  q = jnp.zeros((1, 1, 1, 4))
  k = jax.random.normal(jax.random.key(0), (1, 5, 1, 4))
  v = jnp.eye(5).reshape(1, 5, 1, 5)  # one-hot values: the output is the weights
  out = attnjax.dot_product_attention(q, k, v)
  np.testing.assert_allclose(out[0, 0, 0], np.full(5, 0.2), atol=1e-6)


# ---------------------------------------------------------------------------
# Properties.


def test_row_sums_of_softmax_and_softmax_one():
  # softmax rows sum to one; softmax_one's to sum(e^z) / (1 + sum(e^z)) over the allowed keys.
  q, k, _ = rand_qkv(T=9)
  ones = jnp.ones((2, 9, 2, 1))
  kw = dict(is_causal=True, window=(3, 0))
  out = attnjax.dot_product_attention(q, k, ones, normalizer="softmax", **kw)
  np.testing.assert_allclose(out, 1.0, atol=1e-6)
  out = attnjax.dot_product_attention(q, k, ones, normalizer="softmax_one", **kw)
  qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 4, axis=2)
  z = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(q.shape[-1])
  i, j = np.arange(9)[:, None], np.arange(9)[None, :]
  e = np.where((j <= i) & (j >= i - 3), np.exp(z), 0.0).sum(-1)
  np.testing.assert_allclose(out[..., 0], np.transpose(e / (1.0 + e), (0, 2, 1)), rtol=1e-5)


def test_causality_by_gradient():
  q, k, v = rand_qkv(T=8)
  t = 4

  def out_t(k, v):
    return jnp.sum(attnjax.dot_product_attention(q, k, v, is_causal=True)[:, t])

  gk, gv = jax.grad(out_t, argnums=(0, 1))(k, v)
  assert float(jnp.abs(gk[:, t + 1 :]).max()) == 0.0
  assert float(jnp.abs(gv[:, t + 1 :]).max()) == 0.0
  assert float(jnp.abs(gk[:, : t + 1]).max()) > 0.0


@pytest.mark.parametrize("normalizer", attnjax.normalizers.NORMALIZERS)
def test_fully_masked_rows_are_zero_and_finite(normalizer):
  q, k, v = rand_qkv(T=6)
  mask = jnp.ones((2, 1, 6, 6), bool).at[:, :, 2, :].set(False)
  out, stats = attnjax.dot_product_attention(
    q, k, v, mask=mask, normalizer=normalizer, return_stats=True
  )
  assert float(jnp.abs(out[:, 2]).max()) == 0.0
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(stats))
  g = jax.grad(
    loss_of(
      lambda q, k, v: attnjax.dot_product_attention(q, k, v, mask=mask, normalizer=normalizer)
    ),
    argnums=(0, 1, 2),
  )(q, k, v)
  assert all(bool(jnp.isfinite(x).all()) for x in g)
  assert float(jnp.abs(g[0][:, 2]).max()) == 0.0


def test_jit_and_no_jit_agree():
  q, k, v = rand_qkv(T=7)
  kw = dict(is_causal=True, normalizer="softpick", softcap=4.0, window=(3, 0), return_stats=True)
  a_out, a_stats = attnjax.dot_product_attention(q, k, v, **kw)
  with jax.disable_jit():
    b_out, b_stats = dense._dot_product_attention(q, k, v, **kw)
  assert_close((a_out, a_stats), (b_out, b_stats), "jit against op by op", **reordered(16))


def test_segment_ids_block_cross_segment_attention():
  q, k, v = rand_qkv(B=1, T=8)
  seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]])
  out = attnjax.dot_product_attention(q, k, v, segment_ids=seg, is_causal=True)
  first = attnjax.dot_product_attention(q[:, :3], k[:, :3], v[:, :3], is_causal=True)
  second = attnjax.dot_product_attention(q[:, 3:], k[:, 3:], v[:, 3:], is_causal=True)
  assert_close(out, jnp.concatenate([first, second], axis=1), "packed", **reordered(16))


def test_t_different_from_s():
  q, k, v = rand_qkv(T=5, S=9)
  out = attnjax.dot_product_attention(q, k, v, is_causal=True)
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  assert out.shape == (2, 5, 8, 16)
  assert_close(out, ref, "against jax.nn", **reordered(16))


# ---------------------------------------------------------------------------
# Statistics against an independent numpy computation.


def test_stats_match_numpy():
  q, k, v = rand_qkv(B=1, T=6, N=2, K=2, H=8, seed=9)
  out, s = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True)
  z = _np_logits(q, k, 8**-0.5)
  allowed = np.broadcast_to(np.tril(np.ones((6, 6), bool)), z.shape)
  w = _np_weights(z, allowed, "softmax")
  ent = -np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0).sum(-1).mean(-1)
  np.testing.assert_allclose(s.entropy, ent, atol=1e-5)
  np.testing.assert_allclose(s.sink_mass, w[..., 1:, 0].mean(-1), atol=1e-6)
  np.testing.assert_allclose(s.max_logit, np.where(allowed, z, -np.inf).max((-1, -2)), atol=1e-5)
  lse = np.log(np.where(allowed, np.exp(z), 0).sum(-1))
  np.testing.assert_allclose(s.logsumexp, lse, atol=1e-5)
  np.testing.assert_allclose(s.row_sum, 1.0, atol=1e-6)


def test_stats_row_normalise_unnormalised_weights():
  q, k, v = rand_qkv(B=1, T=6, N=2, K=2, H=8, seed=10)
  _, s = attnjax.dot_product_attention(
    q, k, v, is_causal=True, normalizer="sigmoid", return_stats=True
  )
  z = _np_logits(q, k, 8**-0.5)
  allowed = np.broadcast_to(np.tril(np.ones((6, 6), bool)), z.shape)
  w = _np_weights(z, allowed, "sigmoid")
  p = w / w.sum(-1, keepdims=True)
  np.testing.assert_allclose(s.sink_mass, p[..., 1:, 0].mean(-1), atol=1e-6)
  np.testing.assert_allclose(s.row_sum, w.sum(-1).mean(-1), atol=1e-5)
  _, s1 = attnjax.dot_product_attention(q, k, v, normalizer="softmax_one", return_stats=True)
  assert float(s1.row_sum.max()) < 1.0


# ---------------------------------------------------------------------------
# Bad inputs.


def _call(**kw):
  q, k, v = rand_qkv(T=4)
  args = dict(q=q, k=k, v=v)
  args.update({n: kw.pop(n) for n in ("q", "k", "v") if n in kw})
  return attnjax.dot_product_attention(args["q"], args["k"], args["v"], **kw)


@pytest.mark.parametrize(
  "kw,exc,pattern",
  [
    (dict(q=jnp.zeros((2, 4, 8))), ValueError, r"q must have rank 4.*\(2, 4, 8\)"),
    (
      dict(k=jnp.zeros((2, 4, 3, 16)), v=jnp.zeros((2, 4, 3, 16))),
      ValueError,
      r"N=8.*multiple of.*K=3",
    ),
    (dict(k=jnp.zeros((2, 5, 2, 16))), ValueError, r"k and v must agree.*\(2, 5, 2, 16\)"),
    (dict(k=jnp.zeros((2, 4, 2, 8)), v=jnp.zeros((2, 4, 2, 8))), ValueError, r"head dims differ"),
    (dict(k=jnp.zeros((3, 4, 2, 16)), v=jnp.zeros((3, 4, 2, 16))), ValueError, r"batch sizes"),
    (dict(normalizer="softmax2"), ValueError, r"normalizer='softmax2'.*softpick"),
    (dict(implementation="flash"), ValueError, r"implementation='flash'"),
    (dict(window=(-1, 0)), ValueError, r"non-negative"),
    (dict(window=3.0), TypeError, r"window must be an int w .* or a tuple \(left, right\)"),
    (dict(mask=jnp.ones((2, 8, 4, 5), bool)), ValueError, r"mask of shape \(2, 8, 4, 5\)"),
    (dict(mask=jnp.ones((4, 4))), TypeError, r"mask must be boolean"),
    (dict(bias=jnp.ones((3, 4, 4))), ValueError, r"bias of shape \(3, 4, 4\)"),
    (dict(sink_logits=jnp.zeros(3)), ValueError, r"sink_logits must have shape \[N\]"),
    (dict(sink_logits=jnp.zeros(8), normalizer="sigmoid"), ValueError, r"sink_logits.*sigmoid"),
    (dict(softcap=-1.0), ValueError, r"softcap must be positive"),
    (dict(segment_ids=jnp.zeros((2, 5), int)), ValueError, r"segment_ids must have shape"),
    (dict(q=jnp.zeros((2, 4, 8, 16), jnp.int32)), TypeError, r"q must be a floating"),
  ],
  ids=[
    "q_rank",
    "heads",
    "kv_mismatch",
    "head_dim",
    "batch",
    "normalizer",
    "impl",
    "neg_window",
    "window_type",
    "mask_shape",
    "mask_dtype",
    "bias_shape",
    "sink_shape",
    "sink_combo",
    "softcap",
    "segments",
    "int_q",
  ],
)
def test_bad_inputs_raise_clear_errors(kw, exc, pattern):
  with pytest.raises(exc, match=pattern):
    _call(**kw)
