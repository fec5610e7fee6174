"""attnjax.nn.flax_attention_fn inside flax's own attention layers (nnx and linen).

Each layer type is built once; every normaliser runs through the adapter with
a causal and a padding mask and equals attnjax's reference on the layer's own
projections. Softmax through the adapter equals flax's default attention_fn.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

import attnjax
from attnjax.nn import flax_attention_fn
from tests.helpers import assert_close

B, T, D, N = 2, 8, 16, 4
LENGTHS = np.array([8, 5])


def _x():
  return jnp.asarray(np.random.default_rng(0).standard_normal((B, T, D), np.float32))


def _keep():
  return jnp.asarray(np.arange(T)[None, :] < LENGTHS[:, None])  # [B, T]


def _reference(q, k, v, normalizer):
  """attnjax's reference on projected q, k, v: causal, padded queries and keys masked."""
  keep = _keep()
  pad = jnp.logical_and(keep[:, None, :, None], keep[:, None, None, :])
  return attnjax.dot_product_attention(
    q, k, v, mask=pad, is_causal=True, normalizer=normalizer, implementation="reference"
  )


@functools.cache
def _nnx_layer():
  return nnx.MultiHeadAttention(num_heads=N, in_features=D, decode=False, rngs=nnx.Rngs(0))


@functools.cache
def _linen_layer():
  module = linen.MultiHeadDotProductAttention(num_heads=N)
  return module, module.init(jax.random.key(0), _x())


def _linen_projections(params, x, q_or_k_or_v):
  p = params["params"][q_or_k_or_v]
  return jnp.einsum("btd,dnh->btnh", x, p["kernel"]) + p["bias"][None, None]


@pytest.mark.parametrize("normalizer", attnjax.normalizers.NORMALIZERS)
def test_nnx_multi_head_attention(normalizer):
  layer, x = _nnx_layer(), _x()
  keep = _keep()
  layer.attention_fn = flax_attention_fn(normalizer=normalizer)
  try:
    got = layer(x, mask=nnx.make_attention_mask(keep, keep), is_causal=True)
  finally:
    layer.attention_fn = nnx.dot_product_attention
  o = _reference(layer.query(x), layer.key(x), layer.value(x), normalizer)
  assert_close(got, layer.out(o), f"nnx {normalizer}", atol=1e-5)


@pytest.mark.parametrize("normalizer", attnjax.normalizers.NORMALIZERS)
def test_linen_multi_head_dot_product_attention(normalizer):
  module, params = _linen_layer()
  x, keep = _x(), _keep()
  mask = linen.combine_masks(linen.make_causal_mask(keep), linen.make_attention_mask(keep, keep))
  got = module.clone(attention_fn=flax_attention_fn(normalizer=normalizer)).apply(
    params, x, mask=mask
  )
  q, k, v = (_linen_projections(params, x, n) for n in ("query", "key", "value"))
  o = _reference(q, k, v, normalizer)
  out = params["params"]["out"]
  want = jnp.einsum("btnh,nhd->btd", o, out["kernel"]) + out["bias"][None, None]
  assert_close(got, want, f"linen {normalizer}", atol=1e-5)


def test_softmax_equals_flax_default():
  """Keys padded (every query keeps key 0): the adapter's softmax is flax's own attention."""
  x, keep = _x(), _keep()
  key_pad = nnx.make_attention_mask(jnp.ones((B, T), bool), keep)
  layer = _nnx_layer()
  want = layer(x, mask=key_pad, is_causal=True)
  layer.attention_fn = flax_attention_fn()
  try:
    got = layer(x, mask=key_pad, is_causal=True)
  finally:
    layer.attention_fn = nnx.dot_product_attention
  assert_close(got, want, "nnx default", atol=1e-5)
  module, params = _linen_layer()
  mask = linen.combine_masks(linen.make_causal_mask(keep), key_pad)
  want = module.apply(params, x, mask=mask)
  got = module.clone(attention_fn=flax_attention_fn()).apply(params, x, mask=mask)
  assert_close(got, want, "linen default", atol=1e-5)


def test_dropout_stats_and_bad_options():
  x = _x()
  layer = nnx.MultiHeadAttention(
    num_heads=N,
    in_features=D,
    decode=False,
    dropout_rate=0.1,
    attention_fn=flax_attention_fn(),
    rngs=nnx.Rngs(0),
  )
  with pytest.raises(ValueError, match="no dropout on attention weights"):
    layer(x, deterministic=False)
  layer(x, deterministic=True)
  layer = _nnx_layer()
  layer.attention_fn = flax_attention_fn(is_causal=True)
  try:
    _, inter = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(layer, x)
  finally:
    layer.attention_fn = nnx.dot_product_attention
  stats = inter["attention_stats"][-1]
  assert isinstance(stats, attnjax.AttentionStats) and stats.entropy.shape == (B, N)
  module, params = _linen_layer()
  _, state = module.clone(attention_fn=flax_attention_fn(is_causal=True)).apply(
    params, x, sow_weights=True, mutable=["intermediates"]
  )
  stats = state["intermediates"]["attention_stats"][-1]
  assert isinstance(stats, attnjax.AttentionStats) and stats.entropy.shape == (B, N)
  with pytest.raises(TypeError, match=r"got \['mask'\]"):
    flax_attention_fn(mask=None)
