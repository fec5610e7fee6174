"""attnjax.dot_product_attention as a drop-in for jax.nn.dot_product_attention.

Every keyword of jax.nn's function keeps its name, position and meaning; calls
spelled for jax.nn give jax.nn's result (softmax), ragged lengths, windows and
the logsumexp residual included. Documented differences: a row with no
allowed key is zero (jax.nn: the mean of the values, except past
``query_seq_lengths``), and the residual carries a gradient.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from tests.helpers import assert_close, rand_qkv, run_kernel

B, T, N, K, H = 2, 8, 4, 2, 8


def _inputs():
  q, k, v = rand_qkv(B=B, T=T, N=N, K=K, H=H)
  rng = np.random.default_rng(1)
  bias = jnp.asarray(rng.standard_normal((B, N, T, T), np.float32))
  mask = jnp.asarray(rng.random((B, 1, T, T)) < 0.8).at[..., 0].set(True)
  return q, k, v, bias, mask


LENGTHS = dict(
  query_seq_lengths=jnp.array([5, 8], jnp.int32), key_value_seq_lengths=jnp.array([3, 7], jnp.int32)
)


def test_signature_starts_with_jax_nn_s():
  ours = inspect.signature(attnjax.dot_product_attention).parameters
  theirs = inspect.signature(jax.nn.dot_product_attention).parameters
  assert list(ours)[:5] == list(theirs)[:5] == ["query", "key", "value", "bias", "mask"]
  for name, p in theirs.items():
    assert name in ours, name
    assert (ours[name].kind, ours[name].default) == (p.kind, p.default), name


# (id, keywords of both calls); the arrays come from _inputs().
CASES = [
  ("bias_mask_scale", dict(bias=True, mask=True, scale=0.3)),
  ("causal_lengths", dict(is_causal=True, **LENGTHS)),
  ("query_lengths", dict(query_seq_lengths=LENGTHS["query_seq_lengths"])),
  ("kv_lengths_mask", dict(mask=True, key_value_seq_lengths=LENGTHS["key_value_seq_lengths"])),
  ("window_int", dict(local_window_size=2)),
  ("window_pair_causal", dict(local_window_size=(3, 1), is_causal=True)),
  ("residual", dict(return_residual=True, bias=True, is_causal=True, **LENGTHS)),
]


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_keyword_call_equals_jax_nn(kw):
  q, k, v, bias, mask = _inputs()
  kw = dict(kw, **{n: a for n, a in (("bias", bias), ("mask", mask)) if kw.get(n)})
  got = attnjax.dot_product_attention(query=q, key=k, value=v, **kw)
  want = jax.nn.dot_product_attention(query=q, key=k, value=v, **kw)
  assert_close(got, want, "attnjax vs jax.nn", rtol=1e-5, atol=1e-5)
  if kw.get("return_residual"):
    assert got[1].shape == (B, T, N) and got[1].dtype == want[1].dtype


def test_positional_bias_and_mask():
  q, k, v, bias, mask = _inputs()
  got = attnjax.dot_product_attention(q, k, v, bias, mask)
  assert_close(got, attnjax.dot_product_attention(q, k, v, bias=bias, mask=mask), "positional")
  assert_close(got, jax.nn.dot_product_attention(q, k, v, bias, mask), "jax.nn", atol=1e-5)


def test_lengths_with_segment_ids_and_gradients():
  """With segment_ids given the lengths become a mask; gradients equal jax.nn's."""
  q, k, v, _, _ = _inputs()
  seg = jnp.asarray(np.repeat([[0, 0, 0, 1, 1, 1, 1, 1]], B, 0), jnp.int32)
  same = seg[:, None, :, None] == seg[:, None, None, :]
  lengths = dict(
    query_seq_lengths=jnp.array([5, 8], jnp.int32),
    key_value_seq_lengths=jnp.array([6, 7], jnp.int32),
  )  # no row left without keys

  def loss(fn, **kw):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, is_causal=True, **lengths, **kw)))

  got = jax.grad(loss(attnjax.dot_product_attention, segment_ids=seg), (0, 1, 2))(q, k, v)
  want = jax.grad(loss(jax.nn.dot_product_attention, mask=same), (0, 1, 2))(q, k, v)
  assert_close(got, want, "grads", rtol=1e-4, atol=1e-5)


def test_residual_of_softmax_one_and_refusals():
  q, k, v, _, _ = _inputs()
  _, r = attnjax.dot_product_attention(q, k, v, normalizer="softmax_one", return_residual=True)
  z = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, N // K, H), k) * H**-0.5
  z = jnp.moveaxis(z.reshape(B, N, T, T), 1, 3)  # [B, T, S, N]
  want = jnp.logaddexp(jax.nn.logsumexp(z, axis=2), 0.0)  # the null column's e^0
  assert_close(r, want, "softmax_one residual", atol=1e-5)
  with pytest.raises(ValueError, match="normalizer='sigmoid' does not have"):
    attnjax.dot_product_attention(q, k, v, normalizer="sigmoid", return_residual=True)
  with pytest.raises(ValueError, match="pass one"):
    attnjax.dot_product_attention(q, k, v, return_residual=True, return_stats=True)
  with pytest.raises(ValueError, match="implementation='xla' is not"):
    attnjax.dot_product_attention(q, k, v, return_residual=True, implementation="xla")


def test_local_window_size_and_window():
  q, k, v, _, _ = _inputs()
  assert_close(
    attnjax.dot_product_attention(q, k, v, local_window_size=2),
    attnjax.dot_product_attention(q, k, v, window=(2, 2)),
    "int means (w, w)",
  )
  attnjax.dot_product_attention(q, k, v, local_window_size=(2, 0), window=(2, 0))
  with pytest.raises(ValueError, match=r"local_window_size=2 .* and window=\(2, 0\) differ"):
    attnjax.dot_product_attention(q, k, v, local_window_size=2, window=(2, 0))
  with pytest.raises(ValueError, match=r"query_seq_lengths must have shape \[B\] = \(2,\)"):
    attnjax.dot_product_attention(q, k, v, query_seq_lengths=jnp.array([3], jnp.int32))


def test_row_without_keys_is_zero():
  """jax.nn gives a row with no allowed key the mean of all values; attnjax gives zeros."""
  q, k, v, _, _ = _inputs()
  lengths = jnp.array([0, 8], jnp.int32)
  got, r = attnjax.dot_product_attention(
    q, k, v, key_value_seq_lengths=lengths, return_residual=True
  )
  want, r_jax = jax.nn.dot_product_attention(
    q, k, v, key_value_seq_lengths=lengths, return_residual=True
  )
  assert not np.any(np.asarray(got[0]))
  assert_close(got[1], want[1], "rows with keys", atol=1e-5)
  assert_close(
    want[0],
    jnp.broadcast_to(jnp.repeat(v[0].mean(0), N // K, 0), (T, N, H)),
    "jax.nn's empty rows",
    atol=1e-5,
  )
  assert_close(r, r_jax, "residual, empty rows included")


@pytest.mark.parametrize("engine", ["reference", "blockwise", "pallas_gpu", "pallas_tpu"])
def test_the_residual_comes_from_each_engines_own_row_counts(engine):
  """The residual is the engine's logsumexp statistic, jax.nn's masked logit exactly on the
  rows the engine counted no key for (padded queries, and real rows whose window holds only
  padded keys), with no mask rebuilt; elsewhere it is the reference's logsumexp."""
  from attnjax._src import jax_nn_compat as _jax_nn_compat
  from attnjax._src.ops.dense import attention as dense
  from attnjax._src.kernels import pallas_gpu, pallas_tpu

  q, k, v = rand_qkv(B=2, T=24, N=4, K=2, H=8)
  q_len, kv_len = np.array([20, 24]), np.array([3, 24])
  keywords = _jax_nn_compat.ragged(
    q,
    k,
    jnp.asarray(q_len),
    jnp.asarray(kv_len),
    dict(attnjax.options.DEFAULTS, is_causal=True, window=(1, 0)),
  )
  inputs, opts = dense.prepare(q, k, v, **keywords)
  run = {
    "reference": dense.reference,
    "blockwise": dense.ENGINES["blockwise"].compute,
    "pallas_gpu": lambda i, o: run_kernel(pallas_gpu, i, o, interpret=True),
    "pallas_tpu": lambda i, o: run_kernel(pallas_tpu, i, o, interpret=True),
  }[engine]
  _, stats = run(inputs, _jax_nn_compat.residual_options(opts))
  residual = np.asarray(_jax_nn_compat.residual(inputs, stats))  # [B, T, N]
  i, j = np.arange(24)[:, None], np.arange(24)[None, :]
  allowed = (
    ((j <= i) & (j >= i - 1))[None] & (i < q_len[:, None, None]) & (j < kv_len[:, None, None])
  )
  has_key = np.broadcast_to(allowed.any(-1)[:, :, None], residual.shape)
  assert 0 < has_key.sum() < has_key.size and not has_key[0, 10:].any()
  np.testing.assert_array_equal(residual[~has_key], np.float32(_jax_nn_compat.JAX_NN_MASKED_LOGIT))
  want = np.swapaxes(
    np.asarray(
      dense.reference(*dense.prepare(q, k, v, **dict(keywords, return_stats=True)))[1].logsumexp
    ),
    1,
    2,
  )
  np.testing.assert_allclose(residual[has_key], want[has_key], rtol=1e-5, atol=1e-5)
