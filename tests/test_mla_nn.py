"""The ``mla`` layer: decode over the latent cache equals the full forward, per cache policy.

Decoding runs the absorbed form over a cache of latents and rope keys; the full forward
the expanded form. Prefill + one-token steps and uneven chunks equal the full forward for
the lossless policies, quantised latents stay within their rounding, the evicting ones
match the window layers they stand for. Also: the errors for a k/v bias slot and
cross-attention, and ``nn.layer_stats`` on an MLA model (its probe reads what it did).
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax import nn
from attnjax._src.train import rundir, variants
from attnjax._src.train.config import load_config
from attnjax._src.train.loop import train
from attnjax._src.train.model import model_config

B, T, V, D = 2, 12, 32, 32
N, R, D_N, D_R, D_V = 4, 16, 8, 4, 6


def _mla(**options):
  dims = dict(kv_lora_rank=R, qk_nope_head_dim=D_N, qk_rope_head_dim=D_R, v_head_dim=D_V)
  return nn.AttentionConfig(family="mla", num_heads=N, **dict(dims, **options))


def _model(*layers, seed=0):
  cfg = nn.ModelConfig(vocab_size=V, d_model=D, num_layers=len(layers), layer_attention=layers)
  return nn.TransformerLM(cfg, rngs=nnx.Rngs(seed))


def _tokens(seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


@nnx.jit(static_argnames=("prefill", "chunks"))
def _full_and_decoded(model, tokens, *, prefill, chunks):
  """Full forward; prefill + one-token steps (a scan); decoding in uneven chunks."""
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


def test_lossless_latent_caches_equal_the_full_forward():
  # A low-rank query with biases, YaRN's logit scale and sink logits over a full cache; h2o
  # and sinks_window with budgets of the whole sequence (they evict nothing); Kimi's MLA
  # without RoPE (odd rope part).
  yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
  model = _model(
    _mla(
      q_lora_rank=12,
      qkv_bias=True,
      sink_logits=True,
      rope_scaling=dict(yarn, mscale=1.0, mscale_all_dim=1.0),
    ),
    _mla(cache_policy="h2o", cache_budget=T, cache_recent=3, output_gate="headwise"),
    _mla(cache_policy="sinks_window", cache_budget=T),
    _mla(rope_theta=None, qk_rope_head_dim=3),
  )
  full, stepwise, chunked, cache = _full_and_decoded(model, _tokens(), prefill=5, chunks=(3, 9))
  scale = float(jnp.max(jnp.abs(full)))
  np.testing.assert_allclose(stepwise, full, rtol=0, atol=1e-5 * scale)
  np.testing.assert_allclose(chunked, full, rtol=0, atol=1e-5 * scale)
  # Only latents are cached: one head of the rope key and of the latent, whatever N.
  for layer, d_r in zip(cache, (D_R, D_R, D_R, 3)):
    assert layer.k.shape == (B, T, 1, d_r) and layer.v.shape == (B, T, 1, R)
  assert isinstance(cache[1], nn.H2OCache) and int(cache[1].index) == T
  # Every slot received attention from the N heads sharing it; rows sum to one.
  scores = np.asarray(cache[1].scores)
  assert scores.shape == (B, T, 1) and np.all(scores > 0)
  np.testing.assert_allclose(scores.sum(axis=(1, 2)), T * N, rtol=1e-4)


@nnx.jit
def _layer_paths(layer, x):
  """One layer: full forward; prefill of 5 + one-token steps; chunks of 3 and 9."""
  cache = layer.init_cache(B, T)
  first, cache = layer.decode(x[:, :5], cache)

  def step(cache, x_t):
    y, cache = layer.decode(x_t[:, None], cache)
    return cache, y[:, 0]

  cache, rest = jax.lax.scan(step, cache, jnp.transpose(x[:, 5:], (1, 0, 2)))
  stepwise = jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)
  a, chunk_cache = layer.decode(x[:, :3], layer.init_cache(B, T))
  b, _ = layer.decode(x[:, 3:], chunk_cache)
  return layer(x), stepwise, jnp.concatenate([a, b], axis=1), cache


@pytest.mark.parametrize("policy,tol", [("int8", 0.01), ("fp8", 0.06)])
def test_quantised_latent_caches_are_close_and_small(policy, tol):
  # Relative L2 error of the layer output: int8 rounds each latent entry by at most
  # max|c| / 254 (< 0.4%), e4m3 by at most 6.25% of it; errors of that size stay below
  # 1% and 6% after the attention's averaging.
  layer = nn.Attention(_mla(cache_policy=policy), D, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (B, T, D))
  full, stepwise, chunked, cache = _layer_paths(layer, x)
  err = float(jnp.linalg.norm(stepwise - full) / jnp.linalg.norm(full))
  assert 0 < err < tol, err
  # New tokens are quantised before they attend: the split into calls does not matter.
  np.testing.assert_allclose(chunked, stepwise, rtol=1e-5, atol=1e-5)
  stored = jnp.int8 if policy == "int8" else jnp.float8_e4m3fn
  assert isinstance(cache, nn.QuantizedKVCache) and cache.k.dtype == cache.v.dtype == stored
  assert cache.k.shape == (B, T, 1, D_R) and cache.v.shape == (B, T, 1, R)
  assert cache.k_scale.shape == cache.v_scale.shape == (B, T, 1)
  plain = nn.Attention(_mla(), D, rngs=nnx.Rngs(0)).init_cache(B, T)
  # (R + d_r) bytes + two float32 scales per token instead of 4 (R + d_r), plus positions.
  ratio = nn.cache_bytes(cache) / nn.cache_bytes(plain)
  assert ratio < 0.45, ratio


@nnx.jit
def _steps(layer, x):
  cache = layer.init_cache(x.shape[0], x.shape[1])

  def step(cache, x_t):
    y, cache = layer.decode(x_t[:, None], cache)
    return cache, y[:, 0]

  _, ys = jax.lax.scan(step, cache, jnp.transpose(x, (1, 0, 2)))
  return jnp.transpose(ys, (1, 0, 2))


def _same_params(config, other_config):
  a = nn.Attention(config, D, rngs=nnx.Rngs(0))
  b = nn.Attention(other_config, D, rngs=nnx.Rngs(0))
  nnx.update(b, nnx.state(a, nnx.Param))
  return a, b


def test_evicting_latent_caches_match_the_window_layers():
  x = jax.random.normal(jax.random.key(2), (B, T, D))
  # sinks_window keeps 2 sink latents + the 4 latest: StreamingLLM's window + sinks layer.
  a, b = _same_params(
    _mla(cache_policy="sinks_window", cache_budget=6, cache_recent=4), _mla(window=4, num_sinks=2)
  )
  np.testing.assert_allclose(_steps(a, x), _steps(b, x), rtol=1e-5, atol=1e-5)
  # h2o whose recent window is its whole budget keeps the last latents: a plain window.
  a, b = _same_params(_mla(cache_policy="h2o", cache_budget=5, cache_recent=5), _mla(window=5))
  np.testing.assert_allclose(_steps(a, x), _steps(b, x), rtol=1e-5, atol=1e-5)
  # And the window layer's own decode is its full forward.
  np.testing.assert_allclose(_steps(b, x), b(x), rtol=1e-5, atol=1e-5)


def test_cache_bytes_for_counts_the_latent_only():
  cfg = nn.ModelConfig(vocab_size=V, d_model=D, num_layers=2, attention=_mla())
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  for policy in ("full", "int8", "h2o", "sinks_window"):
    budget = 6 if policy in ("h2o", "sinks_window") else None
    want = nn.cache_bytes_for(cfg, policy, T, batch=B, budget=budget)
    att = _mla(cache_policy=policy, cache_budget=budget)
    one = _model(att, att)
    assert nn.cache_bytes(one.init_cache(B, T)) == want, policy
  # 4 bytes x (R + d_r) per token and layer, plus the slots' positions, the index and each
  # sequence's rope positions and segment ids.
  meta = 4 * T + 4 + 2 * 4 * B * T
  assert nn.cache_bytes(model.init_cache(B, T)) == 2 * (B * T * 4 * (R + D_R) + meta)


def test_kv_bias_and_cross_attention_are_refused_by_name():
  with pytest.raises(ValueError, match="kv_bias=True: family='mla' rebuilds keys and values"):
    _mla(kv_bias=True)
  layer = nn.Attention(_mla(), D, rngs=nnx.Rngs(0))
  x = jnp.ones((B, T, D))
  memory = jnp.ones((B, 5, D))
  with pytest.raises(ValueError, match="inputs_kv: family='mla' cannot cross-attend"):
    layer(x, inputs_kv=memory)
  with pytest.raises(ValueError, match="kv_length=5: family='mla' cannot cross-attend"):
    layer.init_cache(B, T, kv_length=5)
  with pytest.raises(ValueError, match="inputs_kv: family='mla' cannot cross-attend"):
    layer.decode(x[:, :1], layer.init_cache(B, T), inputs_kv=memory)


def test_layer_stats_of_an_mla_model_read_what_the_layers_did():
  yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}
  att = _mla(output_gate="headwise", rope_scaling=dict(yarn, mscale_all_dim=0.707))
  model = _model(att, _mla(q_lora_rank=12, sink_logits=True))
  tokens = _tokens()
  out = nn.layer_stats(model, tokens)
  for name in (
    "sink_rate/per_layer",
    "f_attn/per_layer",
    "max_logit",
    "qk/mean_cos",
    "sink_geometry/key_norm_ratio",
    "value_drain/per_layer",
    "gate/per_layer",
    "null_mass/per_layer",
  ):
    assert out[name].shape == (2,), name
  assert out["value_drain/per_head"].shape == (2, N)  # a value per head: c W_UV
  for name, value in out.items():
    if not name.startswith("gate/per_"):
      assert np.all(np.isfinite(np.asarray(value))), name
  assert float(out["null_mass/per_layer"][1]) > 0 and float(out["null_mass/per_layer"][0]) == 0
  # The probe's q and k are what the heads compared: softmax(scale <q, k>) over the causal
  # pairs is the layer's weights, with the YaRN logit scale (not (d_n + d_r) ** -0.5).
  capture = nn.layer_stats(model, tokens, view="capture")
  assert capture.q.shape == (2, B, T, N, D_N + D_R) and capture.k.shape == (2, B, T, N, D_N + D_R)
  assert capture.v.shape == (2, B, T, N, D_V)
  scale = att.spec.softmax_scale(att)
  assert scale != pytest.approx((D_N + D_R) ** -0.5)
  z = scale * jnp.einsum("btnh,bsnh->bnts", capture.q[0], capture.k[0])
  z = jnp.where(jnp.tril(jnp.ones((T, T), bool)), z, -jnp.inf)
  np.testing.assert_allclose(capture.weights[0], jax.nn.softmax(z, axis=-1), atol=1e-5)
  np.testing.assert_allclose(capture.weights[0].sum(-1), 1.0, rtol=1e-5)
  # The sown view and the streaming view (O(T)) run on the latent layers too.
  sown = nn.layer_stats(model, tokens, view="sown")
  assert sown["layers"][1]["sink_mass"].shape == (B, N)
  streaming = nn.layer_stats(model, tokens, view="streaming")
  assert streaming["layers"][0]["value_drain"].shape == (1, N)  # per value head


# ---------------------------------------------------------------------------
# Training: the experiments' mla arm, and the training mesh.

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = [  # the cpu preset, a few steps on small batches
  "train.steps=4",
  "train.log_every=1",
  "train.eval_every=4",
  "train.eval_batches=1",
  "train.probe_every=4",
  "train.probe_batch=4",
  "train.probe_len=16",
  "train.checkpoint_every=4",
  "train.microbatches=1",
  "train.progress=false",
  "train.plots=false",
  "data.batch_size=8",
  "data.seq_len=32",
]


@pytest.mark.slow  # ~10 s: a compare run; test_seeds runs the main job at a tiny size
def test_compare_runs_an_mla_arm_at_the_cpu_preset(tmp_path):
  spec = importlib.util.spec_from_file_location("compare", ROOT / "experiments" / "compare.py")
  compare = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(compare)
  argv = ["--config", str(ROOT / "experiments/configs/compare.py") + ":preset=cpu"]
  # One seed and no high-learning-rate arms: the mla arm alone.
  arms = ["sweep.variants=mla", "sweep.seeds=0", "sweep.high_lr_variants=", "sweep.sink_free="]
  argv += [f"--config.{x}" for x in TINY + arms + ["train.num_devices=1"]]
  compare.main(argv + ["--out", str(tmp_path)])
  summary = json.loads((tmp_path / "mla" / "lr=0.05" / "seed=0" / "summary.json").read_text())
  assert summary["status"] == "finished" and np.isfinite(summary["val_loss"])
  assert "| mla/lr=0.05 | 0.05 |" in (tmp_path / "report.md").read_text()
  # An arm is sized from its model (here d_model 64 and 4 heads of 16).
  config = json.loads((tmp_path / "mla" / "lr=0.05" / "seed=0" / "config.json").read_text())
  assert config["variant"] == "mla"
  kw = variants.attention_kwargs("mla", d_model=64, num_heads=4)
  assert kw == dict(
    family="mla", kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16
  )
  # The sinks experiment's one-head setting sizes it too (H = 64).
  sinks = load_config(
    str(ROOT / "experiments/configs/sinks.py") + ":preset=cpu_sinks", ["variant=mla"]
  )
  attention = model_config(sinks, 64).attention
  assert (attention.family, attention.num_heads, attention.spec.kv_lora_rank) == ("mla", 1, 32)
  assert attention.head_dim_for(64) == 64 and attention.spec.v_head_dim == 64


def _mesh_losses(run_dir, mesh):
  cfg = load_config(
    str(ROOT / "experiments/configs/compare.py") + ":preset=cpu",
    TINY
    + ["variant=mla", "data.name=bigram_backcopy", "train.probe_every=1000", "train.probe_batch=8"]
    + ["train.eval_every=1000", "train.checkpoint_every=0"],
  )
  cfg.run_dir = str(run_dir)
  cfg.mesh.update(**mesh)
  assert train(cfg)["status"] == "finished"
  metrics = rundir.read_jsonl(rundir.RunDir(str(run_dir)).metrics)
  return [r["loss"] for r in metrics if "loss" in r]


@pytest.mark.slow  # ~50 s on 2 loaded cores: two training runs on 8 host devices
def test_an_mla_model_trains_under_the_training_mesh(tmp_path):
  # fsdp, tensor (MLA's heads: q_b / kv_b / o projections) and context (the layer's
  # attention sequence-sharded) at once: the same losses as plain data parallelism.
  plain = _mesh_losses(tmp_path / "data", dict(data=8))
  sharded = _mesh_losses(tmp_path / "mesh", dict(data=1, fsdp=2, tensor=2, context=2))
  assert len(plain) == len(sharded) == 4 and np.all(np.isfinite(plain))
  np.testing.assert_allclose(sharded, plain, rtol=1e-5)
