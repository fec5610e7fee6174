"""attnjax.mods: each modifier equals the same idea written as an explicit bias or mask."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import mods, patterns
from helpers import assert_close, rand_qkv

B, T, N, K, H = 2, 20, 4, 2, 8


def _ref(q, k, v, **kw):
  return attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)


@pytest.fixture(scope="module")
def qkv():
  return rand_qkv(B, T, T, N, K, H, seed=11)


def test_alibi_slopes():
  np.testing.assert_allclose(mods.alibi_slopes(8), 2.0 ** -np.arange(1, 9), rtol=1e-6)
  # Not a power of two: the 4-head slopes, then every other 8-head slope.
  np.testing.assert_allclose(
    mods.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3], rtol=1e-6
  )
  with pytest.raises(ValueError, match="num_heads"):
    mods.alibi_slopes(0)


def test_alibi_equals_explicit_bias(qkv):
  q, k, v = qkv
  slopes = mods.alibi_slopes(N)
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  bias = -slopes[:, None, None] * np.abs(i - j)[None]  # [N, T, S]
  got = _ref(q, k, v, score_mod=mods.alibi, score_mod_args=(jnp.asarray(slopes),), is_causal=True)
  want = _ref(q, k, v, bias=jnp.asarray(bias[None], jnp.float32), is_causal=True)
  assert_close(got, want, "alibi", rtol=1e-5, atol=1e-5)


def test_t5_bucket_values():
  rel = jnp.asarray([-200, -20, -9, -8, -7, -1, 0, 1, 7, 8, 20, 200])
  got = np.asarray(mods.t5_bucket(rel, num_buckets=32, max_distance=128))
  # Exact distances below 8 per direction; later keys offset by 16; log buckets up to 15.
  want = [15, 10, 8, 8, 7, 1, 0, 17, 23, 24, 26, 31]
  np.testing.assert_array_equal(got, want)
  uni = np.asarray(mods.t5_bucket(rel, num_buckets=32, max_distance=128, bidirectional=False))
  assert uni[rel > 0].max() == 0 and uni[0] == 31


def test_t5_relative_bias_equals_explicit_bias(qkv):
  q, k, v = qkv
  mod = mods.t5_relative_bias(num_buckets=8, max_distance=16)
  table = np.random.default_rng(0).standard_normal((8, N)).astype(np.float32)
  rel = np.arange(T)[None, :] - np.arange(T)[:, None]
  buckets = np.asarray(mods.t5_bucket(jnp.asarray(rel), num_buckets=8, max_distance=16))
  bias = np.transpose(table[buckets], (2, 0, 1))[None]  # [1, N, T, S]
  got = _ref(q, k, v, score_mod=mod, score_mod_args=(jnp.asarray(table),))
  assert_close(got, _ref(q, k, v, bias=jnp.asarray(bias)), "t5", rtol=1e-5, atol=1e-5)


def test_softcap_equals_the_softcap_option(qkv):
  q, k, v = qkv
  got = _ref(q, k, v, score_mod=mods.SoftCap(2.0), scale=1.0)
  assert_close(got, _ref(q, k, v, softcap=2.0, scale=1.0), "softcap", rtol=1e-5, atol=1e-5)


def test_position_temperature_equals_scaled_queries(qkv):
  q, k, v = qkv
  mod = mods.PositionTemperature(floor_scale=4.0, attn_scale=0.5)
  factor = mods.position_temperature_factor(jnp.arange(T), 4.0, 0.5)
  assert float(factor[0]) == 1.0 and float(factor[-1]) > 1.5
  got = _ref(q, k, v, score_mod=mod, is_causal=True)
  want = _ref(q * factor[None, :, None, None], k, v, is_causal=True)
  assert_close(got, want, "temperature", rtol=1e-5, atol=1e-5)


def _mask_case(name):
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  ids = np.stack([np.arange(T) // 6, (np.arange(T) >= 11).astype(int)]).astype(np.int32)
  prefix = np.asarray([5, 0], np.int32)
  if name == "causal":
    return dict(mask_mod=mods.causal_mask), j <= i
  if name == "sliding_window":
    return dict(mask_mod=mods.sliding_window_mask(4, 2)), (j >= i - 4) & (j <= i + 2)
  if name == "chunked":
    return dict(mask_mod=mods.chunked_mask(6)), (i // 6 == j // 6) & (j <= i)
  if name == "chunked_bidirectional":
    return dict(mask_mod=mods.chunked_mask(6, causal=False)), i // 6 == j // 6
  if name == "prefix_lm":
    mask = (j <= i)[None] | (j[None] < prefix[:, None, None])
    return dict(mask_mod=mods.prefix_lm_mask, mask_mod_args=(jnp.asarray(prefix),)), mask[:, None]
  if name == "document":
    mask = ids[:, :, None] == ids[:, None, :]
    return dict(mask_mod=mods.document_mask, mask_mod_args=(jnp.asarray(ids),)), mask[:, None]
  if name == "causal_document":
    mask = (ids[:, :, None] == ids[:, None, :]) & (j <= i)[None]
    return (
      dict(mask_mod=mods.causal_document_mask, mask_mod_args=(jnp.asarray(ids),)),
      mask[:, None],
    )
  raise AssertionError(name)


MASKS = [
  "causal",
  "sliding_window",
  "chunked",
  "chunked_bidirectional",
  "prefix_lm",
  "document",
  "causal_document",
]


@pytest.mark.parametrize("name", MASKS)
def test_mask_mods_equal_explicit_masks(name, qkv):
  q, k, v = qkv
  kw, mask = _mask_case(name)
  got = _ref(q, k, v, **kw)
  assert_close(got, _ref(q, k, v, mask=jnp.asarray(mask)), name, rtol=1e-6, atol=1e-6)
  fast = attnjax.dot_product_attention(q, k, v, implementation="blockwise", **kw)
  assert_close(fast, got, name + " blockwise", rtol=1e-5, atol=1e-5)


PATTERNS = [
  ("causal", patterns.causal()),
  ("sliding_window", patterns.sliding_window(3, 1)),
  ("strided", patterns.strided(4)),
  ("fixed", patterns.fixed(5, 2)),
  ("global_window", patterns.global_window(2, (3, 3))),
  ("bigbird", patterns.bigbird(4, 1, 1, 1, seed=3)),
  ("sinks_window", patterns.sinks_window(2, 4)),
  ("union", patterns.sliding_window(2) | patterns.strided(5)),
]


@pytest.mark.parametrize("name,pattern", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_every_pattern_as_a_mask_mod(name, pattern, qkv):
  q, k, v = qkv
  mod = mods.pattern_mask(pattern, T, T)
  got = _ref(q, k, v, mask_mod=mod)
  want = _ref(q, k, v, mask=jnp.asarray(pattern.mask(T, T)))
  assert_close(got, want, name, rtol=1e-6, atol=1e-6)


def test_and_combines_masks(qkv):
  q, k, v = qkv
  both = mods.And((mods.causal_mask, mods.document_mask), (0, 1))
  ids = jnp.asarray(np.stack([np.arange(T) // 7] * B), jnp.int32)
  got = _ref(q, k, v, mask_mod=both, mask_mod_args=(ids,))
  assert_close(
    got,
    _ref(q, k, v, mask_mod=mods.causal_document_mask, mask_mod_args=(ids,)),
    "and",
    rtol=1e-6,
    atol=1e-6,
  )


@pytest.mark.parametrize("name", ["document", "causal_document"])
def test_document_masks_with_block_rules_over_many_blocks(name):
  # T=32 in blocks of 8 with two documents of 16: blocks inside one document are FULL by the
  # id ranges, and only the causal rule can say that those above the diagonal must be skipped
  # and those on it masked (traced ids: the jitted call classifies blocks from the rule).
  from attnjax.kernels import blockwise

  q, k, v = rand_qkv(1, 32, 32, 2, 1, 8, seed=3)
  ids = jnp.asarray(np.arange(32)[None] // 16, jnp.int32)
  fn = mods.document_mask if name == "document" else mods.causal_document_mask
  allowed = ids[:, :, None] == ids[:, None, :]
  if name == "causal_document":
    allowed = allowed & jnp.tril(jnp.ones((32, 32), bool))[None]
  got = blockwise.attention(q, k, v, block_q=8, block_k=8, mask_mod=fn, mask_mod_args=(ids,))
  assert_close(got, _ref(q, k, v, mask=allowed[:, None]), name, rtol=1e-5, atol=1e-5)
