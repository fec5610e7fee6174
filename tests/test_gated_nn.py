"""attnjax.nn gated and delta-rule families: retnet, mamba2_decay, gla, deltanet, gated_deltanet."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax import nn
from attnjax._src.nn import gated_spec


D, B, T = 32, 2, 11

# Every family with GQA (N=4, K=2) and a chunk that does not divide T; the delta
# families with the short convolution, one gated family with it too.
CASES = {
  "retnet": dict(family="retnet"),
  "mamba2_decay": dict(family="mamba2_decay"),
  "gla": dict(family="gla", short_conv=3),
  "deltanet": dict(family="deltanet", short_conv=4),
  "gated_deltanet": dict(family="gated_deltanet", short_conv=4),
  # Kimi Linear's layer: per-channel decay, low-rank sigmoid output gate.
  "kda": dict(family="kda", short_conv=4, output_gate_activation="sigmoid", output_gate_rank=4),
}


def _layer(options, **common):
  common = dict(dict(num_heads=4, num_kv_heads=2, rope_theta=100.0), **common)
  cfg = nn.AttentionConfig(chunk_size=4, **options, **common)
  return nn.Attention(cfg, D, rngs=nnx.Rngs(0))


def _x(seed=1, length=T):
  return jax.random.normal(jax.random.key(seed), (B, length, D))


def test_every_family_is_registered():
  assert set(gated_spec.GATED_FAMILIES) <= set(nn.specs.FAMILY_SPECS)
  assert set(CASES) == set(gated_spec.GATED_FAMILIES)


# kda in -m slow: its delta rule runs in test_delta_rule and test_hybrids' Kimi layers.
@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=[pytest.mark.slow] if n == "kda" else []) for n in sorted(CASES)]
)
def test_forward_shapes_and_finite_gradients_reach_every_parameter(name):
  layer = _layer(CASES[name])
  x = _x()
  assert nnx.jit(lambda m: m(x))(layer).shape == (B, T, D)

  def loss(m):
    return jnp.mean(m(x) ** 2)

  # Compiled: run eagerly, every op would compile a program of its own.
  grads = nnx.state(nnx.jit(nnx.grad(loss))(layer), nnx.Param)
  flat = dict(jax.tree_util.tree_leaves_with_path(grads))
  assert flat
  for path, g in flat.items():
    assert np.all(np.isfinite(g)), path
  # The family's own projections are trained: their gradients are not all zero.
  own = {
    "retnet": ("g_proj",),
    "mamba2_decay": ("dt_proj", "dt_bias", "A_log"),
    "gla": ("gk_down", "gk_up", "q_conv"),
    "deltanet": ("beta_proj", "k_conv"),
    "kda": ("f_down", "f_up", "dt_bias", "A_log", "g_down", "g_up"),
    "gated_deltanet": ("beta_proj", "dt_proj", "A_log", "v_conv"),
  }[name]
  for param in own:
    found = [g for path, g in flat.items() if param in jax.tree_util.keystr(path)]
    assert found and any(float(jnp.max(jnp.abs(g))) > 0 for g in found), param


# deltanet in -m slow: gated_deltanet runs the same delta-rule prefill and steps, gated.
@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=[pytest.mark.slow] if n in ("deltanet", "kda") else [])
    for n in sorted(CASES)
  ],
)
def test_prefill_then_steps_equals_the_full_forward_with_packed_documents(name):
  layer = _layer(CASES[name])
  x = _x()
  seg = jnp.asarray([[0] * 6 + [1] * 5, [0] * 3 + [1] * 8], jnp.int32)
  # Compiled, as a model runs them: run eagerly, every op would compile a program of its own.
  forward = nnx.jit(lambda layer, x, seg: layer(x, segment_ids=seg))
  decode = nnx.jit(lambda layer, x, cache, seg: layer.decode(x, cache, segment_ids=seg))
  full = forward(layer, x, seg)
  cache = layer.init_cache(B, T)
  assert isinstance(cache, nn.GatedCache)
  outs = []
  # Prefill 5 tokens, then one token at a time; row 0 changes document between calls.
  for start, stop in [(0, 5)] + [(t, t + 1) for t in range(5, T)]:
    y, cache = decode(layer, x[:, start:stop], cache, seg[:, start:stop])
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5, rtol=1e-4)
  assert int(cache.index) == T
  # Without segment ids the cache continues one document: equals the unpacked forward.
  cache = layer.init_cache(B, T)
  y1, cache = decode(layer, x[:, :7], cache, None)
  y2, cache = decode(layer, x[:, 7:], cache, None)
  unpacked = forward(layer, x, None)
  np.testing.assert_allclose(jnp.concatenate([y1, y2], axis=1), unpacked, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_token_of_document_two_is_unaffected_by_document_one(name):
  layer = _layer(CASES[name])
  x = _x()
  split = 5
  seg = jnp.asarray([[0] * split + [1] * (T - split)] * B, jnp.int32)
  pos = jnp.concatenate([jnp.arange(split), jnp.arange(T - split)])
  # Compiled: run eagerly, every op would compile a program of its own.
  run = nnx.jit(lambda layer, x, seg, pos: layer(x, segment_ids=seg, positions=pos))
  packed = run(layer, x, seg, pos)
  other = x.at[:, :split].set(_x(seed=7)[:, :split])
  packed_other = run(layer, other, seg, pos)
  np.testing.assert_allclose(packed[:, split:], packed_other[:, split:], atol=1e-6)
  assert float(jnp.max(jnp.abs(packed[:, :split] - packed_other[:, :split]))) > 1e-3
  alone = run(layer, x[:, split:], None, None)
  np.testing.assert_allclose(packed[:, split:], alone, atol=2e-5, rtol=1e-4)
  # Without the segment ids document one does reach document two (the test can fail).
  joined = run(layer, x, None, pos)
  assert float(jnp.max(jnp.abs(joined[:, split:] - packed[:, split:]))) > 1e-4


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_round_trips_through_json(name):
  options = dict(CASES[name], chunk_size=8, output_norm="layer", implementation="reference")
  if name == "gla":
    options.update(gate_rank=4, gate_normalizer=8.0)
  cfg = nn.AttentionConfig(num_heads=4, **options)
  back = nn.AttentionConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
  assert back == cfg and back.family == name
  model = nn.ModelConfig(d_model=D, num_layers=1, attention=cfg)
  assert nn.ModelConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_implementations_follow_each_function_and_agree():
  x = _x()
  for name, forms in (
    ("gla", ("reference", "quadratic", "chunked")),
    ("gated_deltanet", ("reference", "chunked")),
  ):
    outs = [_layer(CASES[name], implementation=f)(x) for f in forms]
    for out in outs[1:]:
      np.testing.assert_allclose(out, outs[0], atol=2e-5, rtol=1e-4)
  for form in ("recurrent", "quadratic"):  # every recurrent family takes every name
    assert nn.AttentionConfig(family="deltanet", implementation=form).implementation == form
  with pytest.raises(ValueError, match="implementation"):
    nn.AttentionConfig(family="deltanet", implementation="blockwise")


@pytest.mark.parametrize(
  "options,match",
  [
    (dict(family="retnet", is_causal=False), "is_causal=False"),
    (dict(family="deltanet", short_conv=1), "short_conv"),
    (dict(family="gla", gate_normalizer=0.0), "gate_normalizer"),
    (dict(family="mamba2_decay", output_norm="group"), "output_norm"),
  ],
)
def test_bad_options_fail_naming_the_field(options, match):
  with pytest.raises(ValueError, match=match):
    nn.AttentionConfig(**options)


def test_mask_and_cross_attention_are_rejected():
  layer = _layer(CASES["retnet"])
  x = _x()
  with pytest.raises(ValueError, match="mask"):
    layer(x, mask=jnp.ones((B, 1, 1, T), bool))
  with pytest.raises(ValueError, match="cross-attention"):
    layer(x, inputs_kv=x)
  with pytest.raises(TypeError, match="GatedCache"):
    layer.decode(x, _layer(dict(family="linear")).init_cache(B, T))


def test_retnet_decays_are_the_papers():
  np.testing.assert_allclose(
    np.exp(gated_spec.retnet_log_decay(4)),
    [1 - 1 / 32, 1 - 1 / 64, 1 - 1 / 128, 1 - 1 / 256],
    rtol=1e-6,
  )


def test_sown_weights_are_the_decayed_scores_of_compared_qk():
  # GLA with GQA, RoPE and the short convolution: the probe's weights are
  # A[i, j] = scale * sum_h q_ih k_jh exp(c_ih - c_jh) (j <= i, c = cumsum of the
  # log gates) with q, k from compared_qk: what the probe reads is what the layer did.
  from attnjax._src.nn import intermediates

  layer = _layer(CASES["gla"])
  x = _x()
  _, inter = nnx.capture(
    lambda m, x: m(x, sow_weights=True), nnx.Intermediate, method_outputs=nnx.Intermediate
  )(layer, x)
  rec = intermediates.read(inter).model
  N, K, H = 4, 2, layer.head_dim
  q = jnp.reshape(rec["q_proj/__call__"], (B, T, N, H))
  k = jnp.reshape(rec["k_proj/__call__"], (B, T, K, H))
  q, k = layer.compared_qk(q, k)
  q, k = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), N // K, axis=2)
  c = np.cumsum(np.asarray(layer.config.spec.gates(layer, x)["log_decay"], np.float64), axis=1)
  causal = np.tril(np.ones((T, T), bool))[None, None, :, :, None]
  expo = np.where(
    causal, c.transpose(0, 2, 1, 3)[:, :, :, None] - c.transpose(0, 2, 1, 3)[:, :, None], -np.inf
  )
  want = np.einsum("binh,bjnh,bnijh->bnij", q, k, np.exp(expo)) * H**-0.5
  np.testing.assert_allclose(rec["weights"], want, atol=1e-5)
  stats = rec["attention_stats"]
  assert stats.max_logit is None and stats.entropy.shape == (B, N)
  assert np.all(np.isfinite(stats.sink_mass)) and np.all(np.isfinite(stats.row_sum))
  assert layer.allowed_mask(T).shape == (1, 1, T, T)


def test_delta_rule_implied_weights_reproduce_the_output():
  # The delta rule is linear in v: sum_j A[i, j] v_j is the recurrence's output.
  spec = nn.AttentionConfig(family="gated_deltanet", num_heads=4, num_kv_heads=2).spec
  fn = spec.default_function(None)
  keys = jax.random.split(jax.random.key(3), 5)
  q = gated_spec._l2_normalize(jax.random.normal(keys[0], (B, T, 4, 8)))
  k = gated_spec._l2_normalize(jax.random.normal(keys[1], (B, T, 2, 8)))
  v = jax.random.normal(keys[2], (B, T, 2, 8))
  gates = {
    "beta": jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, 4))),
    "log_decay": -jax.nn.softplus(jax.random.normal(keys[4], (B, T, 4))),
  }
  kwargs = dict(segment_ids=None, implementation="chunked", chunk_size=4)
  w = spec.implied_weights(fn, q, k, gates, kwargs)  # [B, N, T, S]
  out = spec.call_function(fn, q, k, v, gates, **kwargs)
  np.testing.assert_allclose(
    jnp.einsum("bnts,bsnh->btnh", w, jnp.repeat(v, 2, axis=2)), out, atol=1e-5
  )
  assert float(jnp.max(jnp.abs(jnp.triu(w, 1)))) == 0.0


def test_short_conv_masks_other_segments_and_continues_from_its_tail():
  x = jax.random.normal(jax.random.key(0), (1, 6, 3))
  w = jax.random.normal(jax.random.key(1), (4, 3))
  seg = jnp.asarray([[0, 0, 0, 1, 1, 1]])
  out, _, _ = gated_spec.short_conv(x, w, jnp.zeros((1, 3, 3)), seg, jnp.zeros((1, 3), int))
  want = np.zeros((6, 3))
  for t in range(6):
    for lag in range(4):
      if t - lag >= 0 and seg[0, t - lag] == seg[0, t]:
        want[t] += np.asarray(w[lag] * x[0, t - lag])
  np.testing.assert_allclose(out[0], want, atol=1e-6)
  a, tail, tail_seg = gated_spec.short_conv(
    x[:, :4], w, jnp.zeros((1, 3, 3)), seg[:, :4], jnp.zeros((1, 3), int)
  )
  b, _, _ = gated_spec.short_conv(x[:, 4:], w, tail, seg[:, 4:], tail_seg)
  np.testing.assert_allclose(jnp.concatenate([a, b], axis=1), out, atol=1e-6)


@pytest.mark.slow  # ~9 s: test_train's packed runs cover the loop
def test_three_packed_training_steps_of_a_gated_variant(tmp_path):
  from attnjax._src.train import config as config_lib
  from attnjax._src.train.loop import train
  from attnjax._src.train.variants import GATED, VARIANTS

  assert set(GATED) <= set(VARIANTS)
  path = tmp_path / "lines.txt"
  path.write_text("".join(f"line {i}: {'to be or not ' * (i % 4)}\n" for i in range(200)))
  c = config_lib.base_config()
  c.run_dir = str(tmp_path / "run")
  c.variant = "gated_deltanet"
  c.data.update(dict(name="text", path=str(path), pack=True, seq_len=16, batch_size=4))
  c.model.update(dict(d_model=16, num_layers=1, num_heads=2, mlp_ratio=2))
  c.train.update(
    dict(
      steps=3,
      log_every=1,
      eval_every=3,
      eval_batches=1,
      probe_every=3,
      probe_batch=4,
      probe_len=16,
      checkpoint_every=0,
      num_devices=1,
      progress=False,
      plots=False,
    )
  )
  c.opt.lr = 1e-2
  summary = train(c)
  assert summary["status"] == "finished" and summary["steps_done"] == 3
  assert np.isfinite(summary["val_loss"])
