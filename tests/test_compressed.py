"""compressed_attention: memory-compressed attention (pooled keys) with an optional raw window.

The reference is checked against compressed keys and a mask built here with
plain numpy loops from the definition; the blockwise path against the
reference, in value and gradient.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import attnjax
from attnjax._src.ops.compressed import attention as compressed
from helpers import assert_close, outputs_and_grads, rand_qkv


def qkv(B, T, N, K, H, seed=0, dtype=jnp.float32):
  return rand_qkv(B, T, T, N, K, H, seed=seed, dtype=dtype)


def brute(q, k, v, *, stride, pool="mean", is_causal, window, **kw):
  """Compressed keys by loops, the [compressed ; raw] mask by loops, dense reference attention."""
  k, v = np.asarray(k, np.float64), np.asarray(v, np.float64)
  T, S = q.shape[1], k.shape[1]
  C = -(-S // stride)
  reduce = np.mean if pool == "mean" else np.max
  k_c = np.stack([reduce(k[:, c * stride : (c + 1) * stride], axis=1) for c in range(C)], axis=1)
  v_c = np.stack([reduce(v[:, c * stride : (c + 1) * stride], axis=1) for c in range(C)], axis=1)
  mask = np.zeros((T, C + S), bool)
  left, right = (window, 0) if isinstance(window, int) else (window or (0, 0))
  for i in range(T):
    for c in range(C):
      end = (c + 1) * stride - 1  # a partial last block ends where a whole one would
      mask[i, c] = end <= i if is_causal else True
    for j in range(S):
      if window is not None:
        mask[i, C + j] = i - left <= j <= (i if is_causal else i + right)
  keys = jnp.asarray(np.concatenate([k_c, k], axis=1), jnp.float32)
  values = jnp.asarray(np.concatenate([v_c, v], axis=1), jnp.float32)
  return attnjax.dot_product_attention(
    q, keys, values, mask=jnp.asarray(mask), implementation="reference", **kw
  )


@pytest.mark.parametrize(
  "is_causal,window,pool",
  [(True, None, "mean"), (True, 3, "max"), (False, None, "max"), (False, (2, 1), "mean")],
)
def test_reference_matches_brute_force(is_causal, window, pool):
  q, k, v = qkv(2, 13, 4, 2, 8, seed=1)  # T=13 is not a multiple of stride=4; GQA
  got = compressed.compressed_attention(
    q, k, v, stride=4, pool=pool, is_causal=is_causal, window=window, implementation="reference"
  )
  want = brute(q, k, v, stride=4, pool=pool, is_causal=is_causal, window=window)
  assert_close(got, want, "reference", rtol=1e-5, atol=1e-5)


def check_paths(q, k, v, tol=3e-5, **kw):
  fast = lambda q, k, v: attnjax.compressed_attention(q, k, v, block_size=8, **kw)
  ref = lambda q, k, v: attnjax.compressed_attention(q, k, v, implementation="reference", **kw)
  got, want = outputs_and_grads(fast, q, k, v), outputs_and_grads(ref, q, k, v)
  assert_close(got, want, str(kw), rtol=tol, atol=tol)
  # Evaluated without differentiation (causal self-attention: the grouped-query primal).
  assert_close(
    jax.jit(fast)(q, k, v), jax.jit(ref)(q, k, v), f"forward only {kw}", rtol=tol, atol=tol
  )
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in got[1])
  return got


# Causal calls evaluate the grouped-query path (with a window: mergeable normalisers only) and
# differentiate the one-call path; the others take the one-call path both ways.
@pytest.mark.parametrize(
  "T,normalizer,is_causal,window,pool",
  [
    (24, "softmax_one", True, 5, "max"),  # grouped queries + window, merged
    (24, "sigmoid", True, None, "mean"),  # grouped; rows i < 3 see nothing
    (23, "softmax_one", False, None, "max"),
    (23, "softpick", True, 6, "max"),
    (23, "relu", False, (3, 2), "mean"),
    (24, "none", True, 4, "mean"),  # not mergeable: one call
    (23, "softmax", True, 5, "mean"),
  ],
)
def test_blockwise_matches_reference(T, normalizer, is_causal, window, pool):
  q, k, v = qkv(1, T, 4, 2, 8, seed=2)
  check_paths(
    q, k, v, stride=4, pool=pool, is_causal=is_causal, window=window, normalizer=normalizer
  )


def test_grouped_path_sink_logits_and_chunks(monkeypatch):
  # Sink logits counted once across the merged parts; the window part in banded chunks.
  from attnjax._src.ops.sparse import attention as sparse

  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", 1)
  q, k, v = qkv(2, 40, 4, 1, 8, seed=7)
  check_paths(
    q, k, v, stride=5, is_causal=True, window=6, sink_logits=jnp.linspace(-1.0, 1.0, 4), softcap=4.0
  )


def test_forward_mode_and_second_order():
  # The causal path is a custom_jvp (grouped primal, one-call tangent): jax.jvp and both
  # orders of Hessian-vector products equal the reference's. T=24: three key blocks of 8 and
  # six query groups of 4 (the grouped path needs T == S and a window); each side is one jitted
  # program (eager, the fast side's second order took ~10 s of compiles per order at T=40).
  q, k, v = qkv(1, 24, 4, 2, 8, seed=8)
  kw = dict(stride=4, is_causal=True, window=6, block_size=8)
  fast = lambda q: attnjax.compressed_attention(q, k, v, **kw)
  ref = lambda q: attnjax.compressed_attention(q, k, v, implementation="reference", **kw)
  ct = jax.random.normal(jax.random.key(2), q.shape)
  for name, f in (
    ("jvp", lambda a: jax.jvp(a, (q,), (k.repeat(2, axis=2),))[1]),
    ("fwd-over-rev", lambda a: jax.jvp(jax.grad(lambda x: jnp.sum(a(x) ** 2)), (q,), (ct,))[1]),
    ("rev-over-fwd", lambda a: jax.grad(lambda x: jnp.vdot(jax.jvp(a, (x,), (ct,))[1], ct))(q)),
  ):
    np.testing.assert_allclose(
      jax.jit(lambda: f(fast))(), jax.jit(lambda: f(ref))(), rtol=1e-4, atol=1e-4, err_msg=name
    )


@pytest.mark.parametrize("T", [11, 12])
def test_empty_rows_are_zero(T):
  q, k, v = qkv(1, T, 2, 1, 8, seed=3)
  (out, grads) = check_paths(q, k, v, stride=4, is_causal=True)
  assert float(jnp.abs(out[:, :3]).max()) == 0.0
  assert float(jnp.abs(out[:, 3:]).min()) > 0.0


def test_options_and_stats():
  # Stats (with the logsumexp gradient), sink logits, softcap, scale and segment ids: block 2
  # (keys 8..11) straddles the boundary at 10 and is seen by nobody.
  q, k, v = qkv(2, 19, 4, 2, 8, seed=4)
  seg = jnp.array([[0] * 10 + [1] * 9, [0] * 19])
  check_paths(
    q,
    k,
    v,
    stride=4,
    is_causal=True,
    window=4,
    segment_ids=seg,
    sink_logits=jnp.linspace(-1.0, 1.0, 4),
    softcap=5.0,
    scale=0.3,
    return_stats=True,
  )
  seg_c = compressed.block_segments(seg, 4)
  np.testing.assert_array_equal(seg_c[0], [0, 0, compressed.STRADDLING_SEGMENT, 1, 1])


def test_given_compressed_kv_receive_gradients():
  q, k, v = qkv(1, 14, 2, 2, 8, seed=5)
  k_c = compressed.pool_keys(k, 3, "max") * 0.5
  v_c = compressed.pool_keys(v, 3, "mean") + 0.1
  kw = dict(stride=3, is_causal=True, window=3)
  fast = lambda q, k, v, kc, vc: attnjax.compressed_attention(
    q, k, v, pool=(kc, vc), block_size=8, **kw
  )
  ref = lambda q, k, v, kc, vc: attnjax.compressed_attention(
    q, k, v, pool=(kc, vc), implementation="reference", **kw
  )
  got, want = (outputs_and_grads(f, q, k, v, k_c, v_c) for f in (fast, ref))
  assert_close(got, want, "given k_c, v_c", rtol=3e-5, atol=3e-5)
  assert float(jnp.abs(got[1][3]).max()) > 0 and float(jnp.abs(got[1][4]).max()) > 0


def test_bf16():
  q, k, v = qkv(1, 20, 4, 2, 8, seed=6, dtype=jnp.bfloat16)
  out = attnjax.compressed_attention(q, k, v, stride=4, is_causal=True, window=4, block_size=8)
  assert out.dtype == jnp.bfloat16
  ref = attnjax.compressed_attention(
    *(x.astype(jnp.float32) for x in (q, k, v)),
    stride=4,
    is_causal=True,
    window=4,
    implementation="reference",
  )
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=3e-2, atol=3e-2)
  # Gradients too: bf16 inputs through the fast path against the fp32 reference.
  ct = jax.random.normal(jax.random.key(1), out.shape)

  def grads(impl, dtype):
    def loss(q, k, v):
      o = attnjax.compressed_attention(
        q, k, v, stride=4, is_causal=True, window=4, block_size=8, implementation=impl
      )
      return jnp.sum(o.astype(jnp.float32) * ct)

    return jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))

  for got, want in zip(grads(None, jnp.bfloat16), grads("reference", jnp.float32)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=5e-2, atol=5e-2)


def test_validation():
  q, k, v = qkv(1, 8, 2, 1, 4)
  with pytest.raises(ValueError, match="stride must be a positive int, got stride=0"):
    attnjax.compressed_attention(q, k, v, stride=0)
  with pytest.raises(TypeError, match="window must be an int"):
    attnjax.compressed_attention(q, k, v, stride=2, window=2.5)
  with pytest.raises(ValueError, match="pool must be one of"):
    attnjax.compressed_attention(q, k, v, stride=2, pool="median")
  with pytest.raises(ValueError, match=r"k_c must have shape \(1, 4, 1, 4\)"):
    attnjax.compressed_attention(q, k, v, stride=2, pool=(k[:, :3], v[:, :4]))
  with pytest.raises(ValueError, match="implementation='dense' is not one of"):
    attnjax.compressed_attention(q, k, v, stride=2, implementation="dense")
  with pytest.raises(ValueError, match="normalizer"):
    attnjax.compressed_attention(q, k, v, stride=2, normalizer="softmax2")


def test_layout_cost_follows_compression():
  # T=4096, stride 4, window 64 (keys i-64..i), blocks of 64: the kept pairs are near
  # T * (T / (2 * 4) + 65), well under a third of causal attention's T^2 / 2.
  from attnjax._src.layout import rule_layout

  T, bs = 4096, 64
  C = T // 4
  rule = compressed.CompressedRule(T, T, 4, True, (64, 0), C)
  pairs = rule_layout(rule, T, C + T, bs).num_pairs * bs * bs
  assert pairs < 0.33 * T * T / 2


def test_fwd_bwd_temporaries_stay_a_few_arrays():
  # Differentiated, the grouped path hands over to one block-wise call for both parts (rolled
  # at 16 query blocks): XLA's temporaries for fwd+bwd at T=2048 are ~7x one [B, T, N, H]
  # array (differentiating the grouped path itself: 21x).
  T = 2048
  x = jax.ShapeDtypeStruct((1, T, 8, 64), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(attnjax.compressed_attention(q, k, v, stride=4, is_causal=True, window=64))

  m = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().memory_analysis()
  if m is None:
    pytest.skip("no memory analysis on this backend")
  assert m.temp_size_in_bytes < 12 * T * 8 * 64 * 4, m.temp_size_in_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
  "normalizer,stride",
  [("softmax", 1), ("softmax_one", 3), ("sigmoid", 5), ("softpick", 3), ("relu", 1), ("none", 5)],
)
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("stats", [False, True])
def test_blockwise_matches_reference_broad(normalizer, stride, is_causal, window, stats):
  q, k, v = qkv(2, 21, 4, 1, 8, seed=stride)
  check_paths(
    q,
    k,
    v,
    stride=stride,
    is_causal=is_causal,
    window=window,
    normalizer=normalizer,
    return_stats=stats,
  )


# ---------------------------------------------------------------------------
# nn family "compressed".


def _layer(**kw):
  from flax import nnx
  from attnjax import nn

  return nn.Attention(
    nn.AttentionConfig(family="compressed", block_size=4, **kw), 16, rngs=nnx.Rngs(0)
  )


def test_nn_decode_equals_full_forward():
  from flax import nnx

  layer = _layer(stride=3, window=4, num_kv_heads=2)
  x = jax.random.normal(jax.random.key(1), (2, 13, 16))

  @nnx.jit
  def full_and_steps(layer, x):
    cache = layer.init_cache(x.shape[0], 16)  # capacity past the sequence: empty slots ignored

    def step(cache, x_t):
      y, cache = layer.decode(x_t[:, None], cache)
      return cache, y[:, 0]

    _, ys = jax.lax.scan(step, cache, jnp.transpose(x, (1, 0, 2)))
    return layer(x), jnp.transpose(ys, (1, 0, 2))

  full, steps = full_and_steps(layer, x)
  np.testing.assert_allclose(full, steps, rtol=2e-5, atol=2e-5)
  assert float(jnp.abs(full).mean()) > 0


def test_nn_conv_is_mean_pooling_at_init_and_learns():
  from flax import nnx
  from attnjax._src.nn import compressed_spec

  layer = _layer(stride=4)
  k = jax.random.normal(jax.random.key(2), (1, 10, 4, layer.head_dim))
  got = compressed_spec.strided_conv(k[:, :8], layer.compress_k[...], 4)
  assert_close(got, compressed.pool_keys(k[:, :8], 4, "mean"), "init", rtol=1e-5, atol=1e-6)
  x = jax.random.normal(jax.random.key(3), (2, 12, 16))
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert float(jnp.abs(grads.compress_k[...]).max()) > 0
  assert float(jnp.abs(grads.compress_v[...]).max()) > 0


def test_nn_weights_and_linformer():
  from flax import nnx
  from attnjax import nn

  layer = _layer(stride=4, window=2)
  x = jax.random.normal(jax.random.key(4), (2, 12, 16))
  _, inter = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(layer, x)
  w = inter["weights"][0]
  assert w.shape == (2, 4, 12, 3 + 12)  # [compressed ; raw] slots
  np.testing.assert_allclose(jnp.sum(w[:, :, 3:], -1), 1.0, rtol=1e-5)
  assert isinstance(inter["attention_stats"][0], attnjax.AttentionStats)
  enc = _layer(projection="linformer", length=5, max_len=16, is_causal=False)
  assert enc(x).shape == x.shape
  with pytest.raises(ValueError, match="projection='linformer' is non-causal only"):
    nn.AttentionConfig(family="compressed", projection="linformer")
  with pytest.raises(ValueError, match="longer than max_len=8"):
    _layer(projection="linformer", length=4, max_len=8, is_causal=False)(x)
  with pytest.raises(ValueError, match="projection"):
    nn.AttentionConfig(family="compressed", projection="pool")


@pytest.mark.parametrize("name", ["compressed", "dilated"])
def test_experiment_variants_build_and_round_trip(name):
  from flax import nnx
  from attnjax import nn
  from attnjax._src.train import variants

  cfg = nn.AttentionConfig(**variants.attention_kwargs(name))
  assert nn.AttentionConfig.from_dict(cfg.to_dict()) == cfg
  layer = nn.Attention(cfg, 32, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (1, 64, 32))
  assert bool(jnp.all(jnp.isfinite(layer(x))))
