"""Tests of attnjax.nn: configs, the Attention layer of every family, the LM, decoding, stats."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnjax
from attnjax._src import nn

D = 16
V = 11
B = 2


def _x(T=8, dtype=jnp.float32, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32).astype(dtype)


def _tokens(T=12, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


# Every family/option a layer can take, with readable ids.
LAYER_CONFIGS = {
  "dense_gqa": nn.AttentionConfig(num_heads=4, num_kv_heads=2),
  "mqa_norope_euclidean": nn.AttentionConfig(
    num_heads=4, num_kv_heads=1, rope_theta=None, similarity="neg_sq_euclidean"
  ),
  "softmax_one": nn.AttentionConfig(normalizer="softmax_one"),
  "sigmoid_softcap": nn.AttentionConfig(normalizer="sigmoid", softcap=5.0),
  "softpick": nn.AttentionConfig(normalizer="softpick"),
  "sink_logits": nn.AttentionConfig(sink_logits=True, num_kv_heads=2),
  "qk_rms_before": nn.AttentionConfig(family="qk_norm", num_kv_heads=2),
  "qk_layer_after": nn.AttentionConfig(
    family="qk_norm", qk_norm="layer", qk_norm_placement="after_rope"
  ),
  "qk_l2_nogain": nn.AttentionConfig(family="qk_norm", qk_norm="l2", qk_norm_gain=False, scale=4.0),
  "cosine_swin": nn.AttentionConfig(family="cosine", num_kv_heads=2),
  "cosine_scale_gate_headwise": nn.AttentionConfig(
    family="cosine", cosine_convention="scale", output_gate="headwise"
  ),
  "cosine_ngpt": nn.AttentionConfig(family="cosine", cosine_convention="ngpt"),
  "window_kv_bias": nn.AttentionConfig(window=3, num_kv_heads=2, kv_bias=True),
  "sinks_window": nn.AttentionConfig(window=2, num_sinks=2, num_kv_heads=2),
  "gate_elementwise": nn.AttentionConfig(output_gate="elementwise"),
  "linear_elu_gqa": nn.AttentionConfig(family="linear", num_kv_heads=2, chunk_size=4),
  "linear_favor_gate": nn.AttentionConfig(
    family="linear", feature_map="favor_plus", num_features=8, output_gate="elementwise"
  ),
  "linear_relu_output_rms": nn.AttentionConfig(
    family="linear", feature_map="squared_relu", linear_normalize="output_rms", rope_theta=None
  ),
  "sparse_strided": nn.AttentionConfig(
    family="sparse", pattern=("strided", (("stride", 3),)), block_size=4, num_kv_heads=2
  ),
  "sparse_sinks_window_sink_logits": nn.AttentionConfig(
    family="sparse",
    pattern=("sinks_window", (("num_sinks", 1), ("window", 3))),
    block_size=4,
    sink_logits=True,
  ),
  "everything": nn.AttentionConfig(
    family="qk_norm",
    num_kv_heads=2,
    sink_logits=True,
    kv_bias=True,
    output_gate="elementwise",
    window=3,
    num_sinks=1,
    softcap=10.0,
  ),
}


def _layer(cfg, dtype=jnp.float32, seed=0):
  return nn.Attention(cfg, D, rngs=nnx.Rngs(seed), dtype=dtype)


# ---------------------------------------------------------------------------
# Configs.

BAD_CONFIGS = [
  ("family", dict(family="flash")),
  ("num_kv_heads", dict(num_heads=4, num_kv_heads=3)),
  ("normalizer", dict(normalizer="softmax2")),
  ("sink_logits", dict(sink_logits=True, normalizer="sigmoid")),
  ("sink_logits", dict(family="linear", sink_logits=True)),
  ("kv_bias", dict(family="linear", kv_bias=True)),
  ("window", dict(family="linear", window=4)),
  ("qk_norm", dict(family="dense", qk_norm="l2")),
  ("similarity", dict(family="cosine", similarity="neg_sq_euclidean")),
  ("temperature_init", dict(family="qk_norm", temperature_init=2.0)),
  ("feature_map", dict(family="dense", feature_map="relu")),
  ("num_sinks", dict(num_sinks=2)),
  ("output_gate", dict(output_gate="channel")),
  ("window", dict(window=-1)),
  ("window", dict(window=True)),
  ("pattern", dict(family="sparse")),
  ("head_dim", dict(head_dim=5)),
  ("streaming_rope", dict(streaming_rope="absolute")),
  ("feature_map", dict(family="linear", feature_map="softmax")),
  ("linear_normalize", dict(family="linear", linear_normalize="rms")),
  ("kv_bias", dict(family="sparse", pattern=("causal", ()), kv_bias=True)),
  ("pattern", dict(family="sparse", pattern=("strided", (("strid", 4),)))),
  ("pattern", dict(family="sparse", pattern=("nonexistent", ()))),
]


@pytest.mark.parametrize(
  "field,kwargs", BAD_CONFIGS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONFIGS)]
)
def test_bad_attention_config_names_the_field(field, kwargs):
  with pytest.raises((ValueError, TypeError), match=field):
    nn.AttentionConfig(**kwargs)


@pytest.mark.parametrize(
  "field,kwargs",
  [
    ("d_model", dict(d_model=30)),
    ("mlp", dict(mlp="relu")),
    ("layer_attention", dict(num_layers=2, layer_attention=(nn.AttentionConfig(),))),
    ("dtype", dict(dtype="float64")),
  ],
  ids=["d_model", "mlp", "layer_attention", "dtype"],
)
def test_bad_model_config_names_the_field(field, kwargs):
  with pytest.raises((ValueError, TypeError), match=field):
    nn.ModelConfig(**kwargs)


def test_configs_round_trip_through_json():
  cfg = nn.ModelConfig(
    vocab_size=V,
    d_model=D,
    num_layers=3,
    mlp="swiglu",
    layer_attention=(
      LAYER_CONFIGS["everything"],
      LAYER_CONFIGS["cosine_ngpt"],
      nn.AttentionConfig(family="sparse", pattern=("strided", (("stride", 4),))),
    ),
  )
  back = nn.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
  assert back == cfg and hash(back) == hash(cfg)


# ---------------------------------------------------------------------------
# The layer, per family and option.


@nnx.jit
def _loss_and_grad(layer, x):
  return nnx.value_and_grad(lambda m: jnp.sum(m(x) ** 2))(layer)


# Without jit, each layer runs op by op; one per family keeps the test quick.
EAGER = (
  "dense_gqa",
  "qk_layer_after",
  "cosine_ngpt",
  "linear_favor_gate",
  "sparse_strided",
  "everything",
)


@pytest.mark.parametrize("name", list(LAYER_CONFIGS))
def test_layer_forward_grad_and_jit(name):
  cfg = LAYER_CONFIGS[name]
  layer = _layer(cfg)
  x = _x()
  loss, grads = _loss_and_grad(layer, x)
  assert bool(jnp.isfinite(loss))
  leaves = jax.tree.leaves(grads)
  assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  # Every learned quantity of the layer receives a gradient.
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves), name
  if name in EAGER:
    eager = layer(x)
    assert eager.shape == x.shape and eager.dtype == jnp.float32
    np.testing.assert_allclose(loss, jnp.sum(eager**2), rtol=1e-5)


def test_layer_bfloat16_keeps_dtype_and_values():
  layer = _layer(LAYER_CONFIGS["everything"], dtype=jnp.bfloat16)
  x = _x(dtype=jnp.bfloat16)
  y = layer(x)
  assert y.dtype == jnp.bfloat16
  want = _layer(LAYER_CONFIGS["everything"])(x.astype(jnp.float32))  # same seed, float32
  np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("gate", ["elementwise", "headwise"])
def test_saturated_gate_equals_ungated(gate):
  gated = _layer(nn.AttentionConfig(output_gate=gate, num_kv_heads=2))
  plain = _layer(nn.AttentionConfig(num_kv_heads=2), seed=1)
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    getattr(plain, name).kernel[...] = getattr(gated, name).kernel[...]
  gated.gate_proj.kernel[...] = jnp.zeros_like(gated.gate_proj.kernel[...])
  gated.gate_proj.bias[...] = jnp.full_like(gated.gate_proj.bias[...], 50.0)  # sigmoid = 1
  x = _x()
  np.testing.assert_allclose(gated(x), plain(x), rtol=1e-6, atol=1e-6)
  # and a closed gate shuts the layer
  gated.gate_proj.bias[...] = jnp.full_like(gated.gate_proj.bias[...], -50.0)
  np.testing.assert_allclose(gated(x), 0.0, atol=1e-12)


def test_random_features_are_state_not_params():
  layer = _layer(LAYER_CONFIGS["linear_favor_gate"])
  assert "feature_projection" not in nnx.state(layer, nnx.Param)
  projection = nnx.state(layer, nn.FeatureProjection)["feature_projection"]
  assert projection.get_value().shape == (8, 4)
  before = np.asarray(projection.get_value())
  layer.redraw_features(jax.random.key(7))
  assert not np.allclose(layer.feature_projection[...], before)
  with pytest.raises(ValueError, match="random feature map"):
    _layer(LAYER_CONFIGS["dense_gqa"]).redraw_features(jax.random.key(0))


def test_very_negative_sink_logits_equal_softmax():
  sinked = _layer(nn.AttentionConfig(sink_logits=True, num_kv_heads=2))
  plain = _layer(nn.AttentionConfig(num_kv_heads=2))  # same seed: same projections
  x = _x()
  assert not np.allclose(sinked(x), plain(x), atol=1e-4)  # sink at 0 takes mass
  sinked.sink_logits[...] = jnp.full((4,), -1e9)
  np.testing.assert_allclose(sinked(x), plain(x), rtol=1e-6, atol=1e-6)


def test_weights_sown_are_the_weights_used():
  layer = _layer(LAYER_CONFIGS["window_kv_bias"])
  x = _x()
  (y, inter) = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(layer, x)
  w = inter["weights"][0]  # [B, N, T, S + 1]: the bias slot is the last column
  T = x.shape[1]
  assert w.shape == (B, 4, T, T + 1)
  np.testing.assert_allclose(jnp.sum(w, -1), 1.0, rtol=1e-5)
  future = np.triu(np.ones((1, 1, T, T), bool), 1)
  assert float(jnp.max(jnp.abs(w[..., :T] * future))) == 0.0
  assert float(jnp.min(w[..., T])) > 0.0  # every query sees the bias slot
  stats = inter["attention_stats"][0]
  np.testing.assert_allclose(stats.sink_mass, jnp.mean(w[:, :, 1:, 0], -1), rtol=1e-5)


# ---------------------------------------------------------------------------
# The language model.


def _model(attention=None, *, layer_attention=None, num_layers=2, seed=0, vocab_size=V, **kw):
  cfg = nn.ModelConfig(
    vocab_size=vocab_size,
    d_model=D,
    num_layers=num_layers,
    attention=attention or nn.AttentionConfig(num_kv_heads=2),
    layer_attention=layer_attention,
    **kw,
  )
  return nn.TransformerLM(cfg, rngs=nnx.Rngs(seed))


MIXED = (
  LAYER_CONFIGS["everything"],
  LAYER_CONFIGS["cosine_swin"],
  LAYER_CONFIGS["window_kv_bias"],
  LAYER_CONFIGS["linear_favor_gate"],
  LAYER_CONFIGS["sparse_strided"],
)
# One layer of each kind of computation (dense kernel, linear, block-sparse), for slower checks.
MIXED3 = (
  LAYER_CONFIGS["everything"],
  LAYER_CONFIGS["linear_favor_gate"],
  LAYER_CONFIGS["sparse_strided"],
)


def test_model_logits_log_z_and_split_merge_round_trip():
  model = _model(
    layer_attention=MIXED3, num_layers=3, mlp="swiglu", norm="layer", tie_embeddings=False
  )
  tokens = _tokens()
  forward = nnx.jit(lambda m, t: m(t, return_log_z=True))
  logits, log_z = forward(model, tokens)
  assert logits.shape == (B, 12, V) and logits.dtype == jnp.float32
  np.testing.assert_allclose(log_z, jax.nn.logsumexp(logits, -1), rtol=1e-6)
  graphdef, state = nnx.split(model)
  clone = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
  np.testing.assert_array_equal(forward(clone, tokens)[0], logits)
  assert jax.tree.structure(nnx.state(clone)) == jax.tree.structure(state)


def test_bfloat16_model_returns_float32_logits():
  model = _model(dtype="bfloat16")
  logits = nnx.jit(lambda m, t: m(t))(model, _tokens())
  assert logits.dtype == jnp.float32
  want = nnx.jit(lambda m, t: m(t))(_model(), _tokens())  # same seed, float32
  np.testing.assert_allclose(logits, want, rtol=5e-2, atol=5e-2)


def test_model_is_causal_by_gradient():
  model = _model(layer_attention=MIXED, num_layers=5)
  tokens = _tokens(T=10)
  h0 = model.embed(tokens)

  @jax.jit
  def jacobian(h):
    def logits_per_position(h):
      for block in model.blocks:
        h = block(h)
      return jnp.sum(model._logits(h, False), axis=(0, 2))  # [T]

    return jax.jacrev(logits_per_position)(h)  # [T_out, B, T_in, D]

  dep = np.asarray(jnp.sum(jnp.abs(jacobian(h0)), axis=(1, 3)))  # [T_out, T_in]
  T = tokens.shape[1]
  future = np.triu(np.ones((T, T), bool), 1)
  assert float(np.max(dep[future])) == 0.0
  assert bool(np.all(dep[~future] > 0))


def test_remat_gives_the_same_loss_and_grads():
  tokens = _tokens()

  def loss(m):
    return jnp.mean(m(tokens) ** 2)

  plain, remat = _model(), _model(remat=True)
  l1, g1 = nnx.jit(nnx.value_and_grad(loss))(plain)
  l2, g2 = nnx.jit(nnx.value_and_grad(loss))(remat)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_init_sharding_names_and_param_count():
  model = _model(attention=nn.AttentionConfig(num_heads=4), tie_embeddings=False)
  specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  P = jax.sharding.PartitionSpec
  assert specs["embed"]["embedding"].get_value() == P("vocab", "embed")
  assert specs["head"]["kernel"].get_value() == P("embed", "vocab")
  attn = specs["blocks"][0]["attention"]
  assert attn["q_proj"]["kernel"].get_value() == P("embed", "heads")
  assert attn["o_proj"]["kernel"].get_value() == P("heads", "embed")
  assert specs["blocks"][0]["mlp"]["up"]["kernel"].get_value() == P("embed", "mlp")
  F = 4 * D
  per_block = 4 * D * D + 2 * D * F + 2 * D  # attention, GELU MLP, two RMSNorm scales
  assert model.num_params() == 2 * V * D + 2 * per_block + D
  assert model.num_params(exclude_embeddings=True) == V * D + 2 * per_block + D


def test_state_shards_over_a_data_model_mesh():
  P = jax.sharding.PartitionSpec
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
  model = _model(
    layer_attention=(LAYER_CONFIGS["everything"], LAYER_CONFIGS["linear_favor_gate"]), vocab_size=12
  )  # the vocabulary is split over "model"
  tokens = jax.random.randint(jax.random.key(2), (4, 8), 0, 12)
  forward = jax.jit(lambda graphdef, state, t: nnx.merge(graphdef, state)(t), static_argnums=0)
  graphdef, state = nnx.split(model)
  expected = forward(graphdef, state, tokens)
  sharded = jax.device_put(state, nn.state_shardings(model, mesh))
  kernel = sharded["blocks"][0]["attention"]["q_proj"]["kernel"].get_value()
  assert kernel.sharding.spec == P(None, "model")
  data_sharded = jax.device_put(tokens, jax.sharding.NamedSharding(mesh, P("data")))
  logits = forward(graphdef, sharded, data_sharded)
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_wortsman_init_std():
  model = _model(attention=nn.AttentionConfig(num_heads=4), mlp_dim=256)
  up = model.blocks[0].mlp.up.kernel[...]  # fan_in = D
  down = model.blocks[0].mlp.down.kernel[...]  # fan_in = 256
  np.testing.assert_allclose(jnp.std(up), D**-0.5, rtol=0.1)
  np.testing.assert_allclose(jnp.std(down), 256**-0.5, rtol=0.1)
  assert float(jnp.max(jnp.abs(down))) <= 2 * 256**-0.5 / 0.87  # truncated at 2 sigma


def test_intermediates_hold_stats_of_every_layer():
  model = _model(layer_attention=MIXED3, num_layers=3, remat=True)  # capture sees through remat
  tokens = _tokens()
  forward = nnx.jit(lambda m, t: m(t))
  logits, inter = nnx.capture(forward, nnx.Intermediate)(model, tokens)
  for i in range(3):
    stats = inter["blocks"][i]["attention"]["attention_stats"][0]
    assert isinstance(stats, attnjax.AttentionStats)
    assert stats.entropy.shape == (B, 4) and bool(jnp.all(jnp.isfinite(stats.entropy)))
    assert inter["blocks"][i]["hidden_max_abs"][0].shape == (B,)
  assert "gate_mean" in inter["blocks"][0]["attention"]
  assert "gate_mean" in inter["blocks"][1]["attention"]
  assert inter["log_z"][0].shape == (B, 12)
  # Outside nnx.capture nothing is sown and no state is left behind.
  assert not nnx.state(model, nnx.Intermediate)

  stats = nn.layer_stats(model, tokens, view="sown", weights=True, hidden=True)
  np.testing.assert_allclose(stats["logits"], logits, rtol=1e-5, atol=1e-5)
  assert len(stats["layers"]) == 3
  for i, layer in enumerate(stats["layers"]):
    keys = [
      "entropy",
      "sink_mass",
      "row_sum",
      "q_rms",
      "k_rms",
      "hidden_max_abs",
      "hidden_median_abs",
      "weights",
      "hidden",
    ]
    if MIXED3[i].family != "linear":  # linear attention has no logits
      keys += ["max_logit", "logsumexp"]
    for key in keys:
      assert key in layer and bool(jnp.all(jnp.isfinite(layer[key]))), (i, key)
  h = stats["layers"][1]["hidden"]
  np.testing.assert_allclose(
    stats["layers"][1]["hidden_max_abs"], jnp.max(jnp.abs(h), axis=(1, 2)), rtol=1e-6
  )


# ---------------------------------------------------------------------------
# Decoding.

# Pairs of layers per model, so each compiled model checks two variants.
DECODE_MODELS = {
  "dense_gqa+qk_norm_before": (LAYER_CONFIGS["dense_gqa"], LAYER_CONFIGS["qk_rms_before"]),
  "qk_norm_after+cosine_gqa": (
    nn.AttentionConfig(family="qk_norm", qk_norm_placement="after_rope", num_kv_heads=2),
    LAYER_CONFIGS["cosine_swin"],
  ),
  "window_gqa+sinks_window_absolute": (
    nn.AttentionConfig(window=3, num_kv_heads=2),
    nn.AttentionConfig(window=2, num_sinks=2, num_kv_heads=2, streaming_rope="absolute"),
  ),
  "linear_elu_gqa+linear_favor_exact": (
    LAYER_CONFIGS["linear_elu_gqa"],
    nn.AttentionConfig(
      family="linear",
      feature_map="favor_plus",
      num_features=8,
      stabilize_features=False,
      num_kv_heads=1,
    ),
  ),
  # BigBird's random blocks depend on the length: the cache passes max_len = T.
  "sparse_strided+sparse_bigbird": (
    LAYER_CONFIGS["sparse_strided"],
    nn.AttentionConfig(
      family="sparse",
      block_size=4,
      sink_logits=True,
      pattern=(
        "bigbird",
        (("block", 4), ("num_global", 1), ("window_blocks", 1), ("num_random", 1), ("seed", 0)),
      ),
    ),
  ),
  "everything_absolute+cosine_ngpt": (
    LAYER_CONFIGS["everything"].replace(streaming_rope="absolute"),
    LAYER_CONFIGS["cosine_ngpt"],
  ),
  "sinks_window_norope+kv_bias_gate_sinks": (
    nn.AttentionConfig(window=3, num_sinks=1, num_kv_heads=1, rope_theta=None),
    nn.AttentionConfig(kv_bias=True, output_gate="headwise", sink_logits=True, num_kv_heads=2),
  ),
}


@nnx.jit(static_argnames=("prefill", "chunks"))
def _full_and_decoded(model, tokens, *, prefill, chunks):
  """Full forward; prefill + one-token steps (a scan); and decoding in uneven chunks."""
  B, T = tokens.shape
  full = model(tokens)
  cache = model.init_cache(B, T)
  first, cache = model.decode(tokens[:, :prefill], cache)

  def step(cache, token):
    logits, cache = model.decode(token[:, None], cache)
    return cache, logits[:, 0]

  cache, rest = jax.lax.scan(step, cache, jnp.transpose(tokens[:, prefill:]))
  stepwise = jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)
  chunk_cache, outs, start = model.init_cache(B, T), [], 0
  for size in chunks:
    logits, chunk_cache = model.decode(tokens[:, start : start + size], chunk_cache)
    outs.append(logits)
    start += size
  return full, stepwise, jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("name", list(DECODE_MODELS))
def test_prefill_and_decode_equal_full_forward(name):
  model = _model(layer_attention=DECODE_MODELS[name])
  tokens = _tokens(T=12)
  full, stepwise, chunked, cache = _full_and_decoded(model, tokens, prefill=5, chunks=(3, 9))
  np.testing.assert_allclose(stepwise, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-5)
  assert int(cache[0].index) == 12
  # The rolling caches hold only their window (and sinks), with the latest positions.
  if name.startswith("window"):
    assert cache[0].k.shape[1] == 3
    np.testing.assert_array_equal(np.sort(np.asarray(cache[0].positions)), [9, 10, 11])
    assert cache[1].k.shape[1] == 4
    np.testing.assert_array_equal(np.sort(np.asarray(cache[1].positions)), [0, 1, 10, 11])


def _np_rope(x, positions, theta):
  half = x.shape[-1] // 2
  freqs = theta ** (-np.arange(half) * 2.0 / x.shape[-1])
  ang = np.asarray(positions, np.float64)[:, None] * freqs[None]  # [T, half]
  cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _streaming_reference(layer, x, num_sinks, window):
  """StreamingLLM by hand (numpy): query p sees the sinks and its window, renumbered 0..n-1."""
  theta = layer.config.rope_theta
  q, k, v = (np.asarray(a, np.float64) for a in layer._project(x))
  Bx, T, N, H = q.shape
  G = N // k.shape[2]
  k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
  out = np.zeros_like(q)
  for p in range(T):
    kept = [j for j in range(p + 1) if j < num_sinks or j >= p - window]
    qp = _np_rope(q[:, p : p + 1], [len(kept) - 1], theta)
    kp = _np_rope(k[:, kept], np.arange(len(kept)), theta)
    z = np.einsum("bqnh,bknh->bnqk", qp, kp) / np.sqrt(H)
    w = np.exp(z - z.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out[:, p] = np.einsum("bnqk,bknh->bqnh", w, v[:, kept])[:, 0]
  return np.asarray(layer.o_proj(jnp.asarray(out.reshape(Bx, T, N * H), jnp.float32)))


@nnx.jit
def _layer_full_and_steps(layer, x):
  cache = layer.init_cache(x.shape[0], x.shape[1])

  def step(cache, x_t):
    y, cache = layer.decode(x_t[:, None], cache)
    return cache, y[:, 0]

  _, ys = jax.lax.scan(step, cache, jnp.transpose(x, (1, 0, 2)))
  return layer(x), jnp.transpose(ys, (1, 0, 2))


def test_streaming_llm_cache_rotates_keys_by_cache_position():
  layer = _layer(nn.AttentionConfig(window=3, num_sinks=2, num_kv_heads=2))
  x = _x(T=12)
  expected = _streaming_reference(layer, x, num_sinks=2, window=3)
  full, stepwise = _layer_full_and_steps(layer, x)
  np.testing.assert_allclose(stepwise, expected, rtol=1e-5, atol=1e-5)
  # Before anything is evicted (p <= sinks + window) it is the full forward; after, not.
  np.testing.assert_allclose(full[:, :6], expected[:, :6], rtol=1e-5, atol=1e-5)
  assert not np.allclose(full[:, 6:], expected[:, 6:], atol=1e-4)


def test_generate_greedy_is_the_full_forward_argmax():
  # A window large enough that the StreamingLLM cache evicts nothing in 8 tokens.
  model = _model(
    layer_attention=(nn.AttentionConfig(window=6, num_sinks=2), LAYER_CONFIGS["dense_gqa"])
  )
  prompt = _tokens(T=3)
  out = nn.generate(model, prompt, 5)
  assert out.shape == (B, 8) and out.dtype == jnp.int32
  np.testing.assert_array_equal(out[:, :3], prompt)
  # Teacher forcing on the generated sequence: each new token is the argmax after its prefix.
  logits = nnx.jit(lambda m, t: m(t))(model, out)
  np.testing.assert_array_equal(out[:, 3:], jnp.argmax(logits[:, 2:-1], -1))
  sampled = nn.generate(model, prompt, 5, temperature=1.0, top_k=4, rng=jax.random.key(3))
  again = nn.generate(model, prompt, 5, temperature=1.0, top_k=4, rng=jax.random.key(3))
  np.testing.assert_array_equal(sampled, again)
  assert int(sampled.min()) >= 0 and int(sampled.max()) < V
  with pytest.raises(ValueError, match="rng"):
    nn.generate(model, prompt, 2, temperature=1.0)


def test_token_ids_outside_the_vocabulary_raise_and_checkify_finds_them_under_jit():
  from jax.experimental import checkify

  cfg = nn.ModelConfig(
    vocab_size=32, d_model=16, num_layers=1, attention=nn.AttentionConfig(num_heads=2)
  )
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  for bad in ([[1, 40, 3]], [[1, -2, 3]]):
    with pytest.raises(ValueError, match=r"ids outside \[0, vocab_size=32\).*at \[0, 1\]"):
      model(jnp.asarray(bad))
  graphdef, state = nnx.split(model)
  run = jax.jit(
    checkify.checkify(lambda s, t: nnx.merge(graphdef, s)(t), errors=checkify.index_checks)
  )
  error, _ = run(state, jnp.asarray([[1, 40, 3]]))
  assert "index 40 is out of bounds for axis 0 with size 32" in str(error.get())
  error, logits = run(state, jnp.asarray([[1, 2, 3]]))
  assert error.get() is None and bool(jnp.all(jnp.isfinite(logits)))
