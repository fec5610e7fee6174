"""patterns.dilated_window (Longformer's dilated sliding window) and its residue-column fast path.

The mask is checked against a brute-force rule written from the definition;
the fast path (a sliding window on the ``dilation`` residue columns) against
dense reference attention with the pattern's mask, in value and gradient.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import attnjax
from attnjax._src import patterns
from attnjax._src.ops.sparse import attention as sparse
from attnjax._src.ops.sparse.attention import sparse_attention
from helpers import assert_close, outputs_and_grads, rand_qkv

# Short calls of the sparse family run its block plans here, as auto-dispatch does from
# sparse.BLOCKWISE_MIN_LENGTH tokens on (the plans are what these tests check).
pytestmark = pytest.mark.usefixtures("sparse_block_plans")


def qkv(B, T, N, K, H, seed=0, dtype=jnp.float32):
  return rand_qkv(B, T, T, N, K, H, seed=seed, dtype=dtype)


def dense_with_mask(q, k, v, pattern, **kw):
  mask = pattern.mask(q.shape[1], k.shape[1])
  return attnjax.dot_product_attention(q, k, v, mask=mask, implementation="reference", **kw)


@pytest.mark.parametrize("window,dilation", [(3, 2), (4, 3), (1, 5), (5, 1)])
def test_mask_matches_brute_force(window, dilation):
  T = 17
  rule = lambda i, j: any(j == i - dilation * m for m in range(window))
  want = np.array([[rule(i, j) for j in range(T)] for i in range(T)])
  got = np.asarray(patterns.dilated_window(window, dilation).mask(T))[0, 0]
  np.testing.assert_array_equal(got, want)
  assert patterns.dilated_window(window, dilation).is_causal
  assert patterns.dilated_window(window, dilation) & patterns.causal() == (
    patterns.dilated_window(window, dilation)
  )


def test_layout_covers_the_mask():
  p = patterns.dilated_window(3, 4)
  mask = np.asarray(p.mask(30))[0, 0]
  kept = p.block_mask(30, 4)
  for a in range(kept.shape[0]):
    for b in range(kept.shape[1]):
      assert kept[a, b] == mask[4 * a : 4 * a + 4, 4 * b : 4 * b + 4].any()


def test_validation():
  with pytest.raises(
    ValueError, match="dilated_window: window must be a positive int, got window=0"
  ):
    patterns.dilated_window(0, 2)
  with pytest.raises(TypeError, match="dilation must be a positive int"):
    patterns.dilated_window(3, 1.5)


def spy(monkeypatch):
  calls = []
  original = sparse._dilated_columns

  def wrapped(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(sparse, "_dilated_columns", wrapped)
  return calls


@pytest.mark.parametrize(
  "T,window,dilation,normalizer,chunk_blocks",
  [
    (23, 3, 4, "softmax", 16),  # T not a multiple of the dilation; short columns
    (70, 4, 2, "softmax_one", 2),  # columns of 35 > 2 * 2 * 4: the banded-chunk path
    (29, 5, 3, "sigmoid", 16),  # a normaliser that counts the kept keys
  ],
  ids=["T23_w3_d4", "chunked_softmax_one", "sigmoid"],
)
def test_fast_path_matches_reference(T, window, dilation, normalizer, chunk_blocks, monkeypatch):
  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", chunk_blocks)
  calls = spy(monkeypatch)
  q, k, v = qkv(2, T, 4, 2, 8, seed=T)  # GQA: 4 query heads over 2 key heads
  p = patterns.dilated_window(window, dilation)
  f = lambda q, k, v: sparse_attention(q, k, v, pattern=p, block_size=4, normalizer=normalizer)
  ref = lambda q, k, v: dense_with_mask(q, k, v, p, normalizer=normalizer)
  assert_close(
    outputs_and_grads(f, q, k, v), outputs_and_grads(ref, q, k, v), "dilated", rtol=3e-5, atol=3e-5
  )
  assert calls, "the residue-column path was not taken"


def test_fast_path_options(monkeypatch):
  # Segment ids travel with their positions; sink logits, softcap and scale pass through.
  calls = spy(monkeypatch)
  q, k, v = qkv(2, 21, 4, 4, 8, seed=5)
  seg = jnp.array([[0] * 9 + [1] * 12, [0] * 21])
  kw = dict(segment_ids=seg, sink_logits=jnp.linspace(-1.0, 1.0, 4), softcap=4.0, scale=0.4)
  p = patterns.dilated_window(4, 2)
  f = lambda q, k, v: sparse_attention(q, k, v, pattern=p, block_size=4, **kw)
  ref = lambda q, k, v: dense_with_mask(q, k, v, p, **kw)
  assert_close(outputs_and_grads(f, q, k, v), outputs_and_grads(ref, q, k, v), "options")
  assert calls


def test_stats_take_the_block_sparse_path():
  q, k, v = qkv(1, 19, 2, 1, 8, seed=6)
  p = patterns.dilated_window(3, 3)
  out, stats = sparse_attention(q, k, v, pattern=p, block_size=4, return_stats=True)
  ref, ref_stats = dense_with_mask(q, k, v, p, return_stats=True)
  assert_close(out, ref, "out")
  assert_close(stats.logsumexp, ref_stats.logsumexp, "logsumexp")


def test_bf16(monkeypatch):
  calls = spy(monkeypatch)
  q, k, v = qkv(1, 26, 4, 2, 8, seed=7, dtype=jnp.bfloat16)
  p = patterns.dilated_window(3, 4)
  out = sparse_attention(q, k, v, pattern=p, block_size=4)
  assert out.dtype == jnp.bfloat16
  ref = dense_with_mask(*(x.astype(jnp.float32) for x in (q, k, v)), p)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=3e-2, atol=3e-2)
  assert calls
  ct = jax.random.normal(jax.random.key(1), out.shape)
  grads = [
    jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * ct), argnums=(0, 1, 2))(
      *(x.astype(dt) for x in (q, k, v))
    )
    for f, dt in (
      (lambda q, k, v: sparse_attention(q, k, v, pattern=p, block_size=4), jnp.bfloat16),
      (lambda q, k, v: dense_with_mask(q, k, v, p), jnp.float32),
    )
  ]
  for got, want in zip(*grads):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=5e-2, atol=5e-2)


def test_column_layout_cost_follows_kept_keys():
  # At T=4096, window 128, dilation 4 each column is a window of 128 keys: the pairs computed
  # per query stay near the window, not the span of 4 * 127 positions.
  p = patterns.sliding_window(127)
  chunk_plan = patterns.band_chunk_plan(p, sparse.CHUNK_BLOCKS * 128, 128)
  pairs_per_query = chunk_plan.layout.num_pairs * 128 * 128 / (sparse.CHUNK_BLOCKS * 128)
  assert pairs_per_query <= 2 * 128 + 128
  span = patterns.dilated_window(128, 4).layout(4096, block_size=128).num_pairs * 128 * 128 / 4096
  assert span > 4 * 127  # the pattern's own layout covers the span


def test_nn_sparse_family_decode_equals_forward():
  # family="sparse" with pattern=("dilated_window", ...): the forward (residue columns, T=12
  # with dilation 2) equals decoding token by token (the pattern as a mask over the cache).
  import jax
  from flax import nnx
  from attnjax._src import nn

  cfg = nn.AttentionConfig(
    family="sparse",
    block_size=4,
    num_kv_heads=2,
    pattern=("dilated_window", (("window", 3), ("dilation", 2))),
  )
  layer = nn.Attention(cfg, 16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 12, 16))

  @nnx.jit
  def full_and_steps(layer, x):
    cache = layer.init_cache(x.shape[0], x.shape[1])

    def step(cache, x_t):
      y, cache = layer.decode(x_t[:, None], cache)
      return cache, y[:, 0]

    _, ys = jax.lax.scan(step, cache, jnp.transpose(x, (1, 0, 2)))
    return layer(x), jnp.transpose(ys, (1, 0, 2))

  full, steps = full_and_steps(layer, x)
  np.testing.assert_allclose(full, steps, rtol=2e-5, atol=2e-5)
