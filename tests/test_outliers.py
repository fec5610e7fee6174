"""Outlier statistics (attnjax.stats.outlier_statistics, attnjax.nn.outlier_stats) and W8A8
fake quantisation, against naive numpy on the bert fixture."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax._src import models, nn, stats

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained", "bert")


@pytest.fixture(scope="module")
def bert():
  model = models.from_pretrained(FIXTURE, dtype="float32")
  with np.load(os.path.join(FIXTURE, "expected.npz")) as z:
    e = {k: z[k] for k in z.files}
  return model, e


def _naive(x, tokens, mask, delimiters, top_k):
  """numpy: per layer, max |x|, its place, token kurtosis, top-k shares."""
  x = np.asarray(x, np.float64)
  L, B, T, D = x.shape
  out = {k: [] for k in ("max", "token", "dim", "kurt", "delim", "first")}
  for layer in x:
    mag = np.abs(layer) * mask[:, :, None]
    flat = mag.reshape(-1)
    i = int(np.argmax(flat))
    out["max"].append(flat[i])
    out["token"].append((i // D) % T)
    out["dim"].append(i % D)
    kurts = []
    for b in range(B):
      for t in range(T):
        if not mask[b, t]:
          continue
        v = layer[b, t] - layer[b, t].mean()
        kurts.append((v**4).mean() / (v**2).mean() ** 2)
    out["kurt"].append(np.mean(kurts))
    top = np.argsort(-flat, kind="stable")[:top_k] // D
    out["delim"].append(np.mean(np.isin(tokens.reshape(-1)[top], delimiters)))
    out["first"].append(np.mean(top % T == 0))
  return out


def test_outlier_stats_equal_a_naive_numpy_computation(bert):
  model, e = bert
  tokens, mask = e["padded_tokens"], e["attention_mask"]
  targets = np.where(np.arange(tokens.shape[1]) % 3 == 0, tokens, -1)
  delimiters = (int(tokens[0, 3]), int(tokens[1, 7]))
  got = nn.outlier_stats(
    model,
    tokens,
    targets=targets,
    attention_mask=mask,
    token_type_ids=e["token_type_ids"],
    delimiter_ids=delimiters,
    top_k=40,
  )
  sown = nn.layer_stats(
    model,
    jnp.asarray(tokens),
    view="sown",
    hidden=True,
    attention_mask=jnp.asarray(mask),
    token_type_ids=jnp.asarray(e["token_type_ids"]),
  )
  for name in ("attn_out", "mlp_out", "hidden"):
    x = np.stack([np.asarray(layer[name]) for layer in sown["layers"]])
    want = _naive(x, tokens, mask, delimiters, 40)
    st = got[name]
    np.testing.assert_allclose(st.max_inf_norm, want["max"], rtol=1e-6)
    np.testing.assert_array_equal(st.max_token, want["token"])
    np.testing.assert_array_equal(st.max_dim, want["dim"])
    np.testing.assert_allclose(st.kurtosis, want["kurt"], rtol=1e-4)
    np.testing.assert_allclose(st.delimiter_share, want["delim"], atol=1e-6)
    np.testing.assert_allclose(st.first_token_share, want["first"], atol=1e-6)
  # The float loss: the mean cross-entropy at the scored targets.
  logits = np.asarray(sown["logits"], np.float64)
  logp = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  scored = targets >= 0
  nll = -np.take_along_axis(logp, np.maximum(targets, 0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(got["loss"], nll[scored].mean(), rtol=1e-5)
  assert np.isfinite(got["loss_w8a8"]) and got["loss_w8a8"] != got["loss"]


def test_fake_quantize_grid_and_error():
  x = jax.random.normal(jax.random.key(0), (64, 48)) * 3.0
  for symmetric in (True, False):
    q = stats.fake_quantize(x, bits=8, symmetric=symmetric)
    s = float(stats.quantization_step(x, bits=8, symmetric=symmetric))
    err = np.abs(np.asarray(q - x))
    assert err.max() <= s / 2 * (1 + 1e-5)
    levels = np.unique(np.round(np.asarray(q) / s, 3))
    assert len(levels) <= 256
  assert float(jnp.max(jnp.abs(stats.fake_quantize(x, bits=8)))) == pytest.approx(
    float(jnp.max(jnp.abs(x))), rel=1e-6
  )
  with pytest.raises(ValueError, match="bits must be an int in"):
    stats.fake_quantize(x, bits=1)


def test_w8a8_changes_the_output_projection_as_its_steps_predict(bert):
  # The output projection alone: logits = h W^T. With rounding errors dh (step s_h) and dW
  # (step s_w), uniform and independent, each logit moves by sum_d (dh_d W_vd + h_d dW_vd)
  # (+ dh dW): variance sum_d W_vd^2 s_h^2 / 12 + h_d^2 s_w^2 / 12; at most
  # s_h / 2 sum |W_v| + s_w / 2 sum |h| + D s_h s_w / 4.
  model, e = bert
  h = model.head_norm(
    jax.nn.gelu(model.head_dense(model.features(jnp.asarray(e["tokens"]))), approximate=False)
  )
  W = model.embed.embedding[...]
  exact = jnp.einsum("btd,vd->btv", h, W)
  hq, Wq = stats.fake_quantize(h, symmetric=False), stats.fake_quantize(W, symmetric=True)
  change = np.asarray(jnp.einsum("btd,vd->btv", hq, Wq) - exact)
  s_h = float(stats.quantization_step(h, symmetric=False))
  s_w = float(stats.quantization_step(W, symmetric=True))
  hn, Wn = np.asarray(h, np.float64), np.asarray(W, np.float64)
  D = hn.shape[-1]
  bound = (
    s_h / 2 * np.abs(Wn).sum(-1)[None, None, :]
    + s_w / 2 * np.abs(hn).sum(-1)[..., None]
    + D * s_h * s_w / 4
  )
  assert np.all(np.abs(change) <= bound * (1 + 1e-4))
  predicted = np.sqrt(
    (Wn**2).sum(-1)[None, None, :] * s_h**2 / 12 + (hn**2).sum(-1)[..., None] * s_w**2 / 12
  )
  ratio = np.sqrt(np.mean(change**2)) / np.sqrt(np.mean(predicted**2))
  assert 0.7 < ratio < 1.3, ratio
  # The model under W8A8 moves its logits by about as much as that layer alone predicts,
  # times the layers it passes through (not 0, not orders of magnitude more).
  got = nn.outlier_stats(model, e["tokens"], targets=e["tokens"], bits=8)
  assert 0 < float(got["logits_change"]) < 50 * float(bound.max())


def test_outlier_errors_name_the_value():
  cfg = nn.EncoderConfig(
    vocab_size=32,
    d_model=16,
    num_layers=1,
    attention=nn.AttentionConfig(num_heads=2, is_causal=False),
  )
  model = nn.EncoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 6), jnp.int32)
  with pytest.raises(ValueError, match="targets"):
    nn.outlier_stats(model, tokens)
  with pytest.raises(ValueError, match="top_k must be"):
    nn.outlier_stats(model, tokens, targets=tokens, top_k=0)
  with pytest.raises(ValueError, match=r"tokens must be int \[B, T\]"):
    stats.outlier_statistics(jnp.ones((1, 2, 6, 4)), jnp.zeros((2, 5), jnp.int32))
