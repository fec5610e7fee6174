"""Decode-cache policies (attnjax.nn.kv_policies): full, int8, fp8, h2o, sinks_window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax._src import nn
from attnjax._src.nn import kv_policies


B, T, V, D = 2, 12, 32, 32


def _tokens(T=T, seed=1):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


def _model(*layers, seed=0):
  cfg = nn.ModelConfig(vocab_size=V, d_model=D, num_layers=len(layers), layer_attention=layers)
  return nn.TransformerLM(cfg, rngs=nnx.Rngs(seed))


@nnx.jit(static_argnames=("prefill", "chunks"))
def _full_and_decoded(model, tokens, *, prefill, chunks):
  """Full forward; prefill + one-token steps (a scan); decoding in uneven chunks."""
  Bx, Tx = tokens.shape
  full = model(tokens)
  cache = model.init_cache(Bx, Tx)
  first, cache = model.decode(tokens[:, :prefill], cache)

  def step(cache, token):
    logits, cache = model.decode(token[:, None], cache)
    return cache, logits[:, 0]

  cache, rest = jax.lax.scan(step, cache, jnp.transpose(tokens[:, prefill:]))
  stepwise = jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)
  chunk_cache, outs, start = model.init_cache(Bx, Tx), [], 0
  for size in chunks:
    logits, chunk_cache = model.decode(tokens[:, start : start + size], chunk_cache)
    outs.append(logits)
    start += size
  return full, stepwise, jnp.concatenate(outs, axis=1), cache


def test_lossless_policies_equal_the_full_forward():
  # GQA; budgets of the whole sequence evict nothing; h2o with a k/v bias slot and
  # sink logits (their weights are no slot's), sinks_window with StreamingLLM rotation.
  model = _model(
    nn.AttentionConfig(
      family="qk_norm",
      num_kv_heads=2,
      cache_policy="h2o",
      cache_budget=T,
      cache_recent=3,
      kv_bias=True,
      sink_logits=True,
    ),
    nn.AttentionConfig(num_kv_heads=1, cache_policy="sinks_window", cache_budget=T),
  )
  full, stepwise, chunked, cache = _full_and_decoded(model, _tokens(), prefill=5, chunks=(3, 9))
  np.testing.assert_allclose(stepwise, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-5)
  assert isinstance(cache[0], nn.H2OCache) and isinstance(cache[1], nn.KVCache)
  assert int(cache[0].index) == T
  np.testing.assert_array_equal(
    np.sort(np.asarray(cache[0].positions), axis=1),
    np.broadcast_to(np.arange(T)[None, :, None], (B, T, 2)),
  )
  # Every slot has received attention; sums over queries and the 4/2 heads of a group.
  scores = np.asarray(cache[0].scores)
  assert scores.shape == (B, T, 2) and np.all(scores > 0)
  assert np.all(scores.sum(axis=(1, 2)) <= T * 4 + 1e-3)  # rows sum to <= 1 (null mass)


@nnx.jit
def _layer_paths(layer, x):
  """One layer: full forward; prefill of 5 + one-token steps; chunks of 3 and 9."""
  Bx, Tx, _ = x.shape
  cache = layer.init_cache(Bx, Tx)
  first, cache = layer.decode(x[:, :5], cache)

  def step(cache, x_t):
    y, cache = layer.decode(x_t[:, None], cache)
    return cache, y[:, 0]

  cache, rest = jax.lax.scan(step, cache, jnp.transpose(x[:, 5:], (1, 0, 2)))
  stepwise = jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)
  a, chunk_cache = layer.decode(x[:, :3], layer.init_cache(Bx, Tx))
  b, _ = layer.decode(x[:, 3:], chunk_cache)
  return layer(x), stepwise, jnp.concatenate([a, b], axis=1), cache


@pytest.mark.parametrize("policy,tol", [("int8", 0.01), ("fp8", 0.06)])
def test_quantised_caches_are_close_and_small(policy, tol):
  # Tolerance: relative L2 error of the layer output, 1% for int8 (per entry at
  # most s/2 = max|x|/254), 6% for e4m3 (3 mantissa bits: at most 6.25% per entry).
  layer = nn.Attention(nn.AttentionConfig(num_kv_heads=2, cache_policy=policy), D, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(3), (B, T, D))
  full, stepwise, chunked, cache = _layer_paths(layer, x)
  err = float(jnp.linalg.norm(stepwise - full) / jnp.linalg.norm(full))
  assert 0 < err < tol, err
  # New tokens are quantised before they attend: the split into calls does not matter.
  np.testing.assert_allclose(chunked, stepwise, rtol=1e-5, atol=1e-5)
  stored = jnp.int8 if policy == "int8" else jnp.float8_e4m3fn
  assert isinstance(cache, nn.QuantizedKVCache) and cache.k.dtype == stored
  assert cache.v.dtype == stored and cache.k_scale.dtype == jnp.float32
  plain = nn.Attention(nn.AttentionConfig(num_kv_heads=2), D, rngs=nnx.Rngs(0))
  ratio = nn.cache_bytes(cache) / nn.cache_bytes(plain.init_cache(B, T))
  # Head dim 8: (8 + 4) bytes per key instead of 32, plus positions.
  assert ratio < 0.45, ratio


def test_h2o_keep_orders_recent_then_scores_then_empty():
  scores = jnp.asarray([[5.0, 1.0, 3.0, 0.5, 9.0, 2.0]])[..., None]  # [1, S, 1]
  positions = jnp.asarray([[0, 1, 2, 3, 4, -1]])[..., None]
  keep = kv_policies.h2o_keep(scores, positions, end=5, budget=3, recent=1)
  # Position 4 is recent; then the best scores 5 (slot 0) and 3 (slot 2).
  np.testing.assert_array_equal(np.asarray(keep)[0, :, 0], [0, 2, 4])
  keep = kv_policies.h2o_keep(scores, positions, end=5, budget=5, recent=2)
  np.testing.assert_array_equal(np.asarray(keep)[0, :, 0], [0, 1, 2, 3, 4])  # empty slot last


def test_rope_takes_positions_per_head_as_h2o_slots_hold():
  x = jax.random.normal(jax.random.key(0), (B, 5, 3, 8))
  positions = jax.random.randint(jax.random.key(1), (B, 5, 3), 0, 50)
  rotated = nn.apply_rope(x, positions, 10_000.0)
  for n in range(3):
    np.testing.assert_allclose(
      rotated[:, :, n : n + 1],
      nn.apply_rope(x[:, :, n : n + 1], positions[:, :, n], 10_000.0),
      rtol=1e-6,
      atol=1e-6,
    )
  with pytest.raises(ValueError, match=r"\[B, T, N\] with T=5, N=3"):
    nn.apply_rope(x, positions[:, :, :2], 10_000.0)


def test_h2o_evicts_the_lowest_accumulated_score():
  budget = 4
  layer = nn.Attention(
    nn.AttentionConfig(
      num_heads=4, num_kv_heads=2, cache_policy="h2o", cache_budget=budget, cache_recent=1
    ),
    D,
    rngs=nnx.Rngs(0),
  )
  layer.q_proj.kernel[...] = jnp.zeros_like(layer.q_proj.kernel[...])  # uniform weights
  x = jax.random.normal(jax.random.key(0), (B, 1, D))
  # A full cache of positions 0..3 in shuffled slots, with constructed scores per
  # (sequence, kv head); the lowest differs by head.
  by_position = np.asarray(
    [
      [[4.0, 1.0], [0.5, 3.0], [2.0, 0.2], [6.0, 5.0]],
      [[0.1, 9.0], [3.0, 8.0], [2.0, 7.0], [1.0, 6.0]],
    ]
  )  # [B, pos, K]
  slot_positions = np.broadcast_to(np.asarray([2, 0, 3, 1])[None, :, None], (B, 4, 2))
  scores = np.take_along_axis(by_position, slot_positions, axis=1)
  empty = layer.init_cache(B, budget + 1)
  kv = jax.random.normal(jax.random.key(1), (2, B, budget, 2, D // 4))
  cache = empty._replace(
    k=kv[0],
    v=kv[1],
    scores=jnp.asarray(scores, jnp.float32),
    positions=jnp.asarray(slot_positions, jnp.int32),
    rope_positions=jnp.asarray(slot_positions, jnp.int32),
    index=jnp.asarray(budget, jnp.int32),
  )
  _, cache = nnx.jit(lambda m, x, c: m.decode(x, c))(layer, x, cache)
  kept = {
    (b, k): sorted(np.asarray(cache.positions)[b, :, k].tolist())
    for b in range(B)
    for k in range(2)
  }
  # The recent window (1) holds only the new token 4; of positions 0..3, the one
  # with the lowest score is evicted.
  assert kept == {
    (0, 0): [0, 2, 3, 4],
    (0, 1): [0, 1, 3, 4],
    (1, 0): [1, 2, 3, 4],
    (1, 1): [0, 1, 2, 4],
  }, kept
  # Uniform weights over 5 keys, 2 query heads per kv head: each kept slot gained 0.4.
  got = {
    (b, k, int(p)): float(s)
    for b in range(B)
    for k in range(2)
    for p, s in zip(np.asarray(cache.positions)[b, :, k], np.asarray(cache.scores)[b, :, k])
  }
  for (b, k, p), s in got.items():
    expected = 0.4 + (by_position[b, p, k] if p < 4 else 0.0)
    assert abs(s - expected) < 1e-5, (b, k, p, s, expected)


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


def test_evicting_policies_match_the_window_caches():
  x = jax.random.normal(jax.random.key(2), (B, T, D))
  # sinks_window policy = today's StreamingLLM layer (window + num_sinks) in one-token steps.
  a, b = _same_params(
    nn.AttentionConfig(num_kv_heads=2, cache_policy="sinks_window", cache_budget=6, cache_recent=4),
    nn.AttentionConfig(num_kv_heads=2, window=4, num_sinks=2),
  )
  np.testing.assert_allclose(_steps(a, x), _steps(b, x), rtol=1e-5, atol=1e-5)
  # h2o with a recent window of the whole budget keeps the last tokens: a plain window.
  a, b = _same_params(
    nn.AttentionConfig(num_kv_heads=2, cache_policy="h2o", cache_budget=5, cache_recent=5),
    nn.AttentionConfig(num_kv_heads=2, window=5),
  )
  np.testing.assert_allclose(_steps(a, x), _steps(b, x), rtol=1e-5, atol=1e-5)


def test_generate_runs_evicting_caches_under_jit():
  model = _model(nn.AttentionConfig(num_kv_heads=2, cache_policy="h2o", cache_budget=4))
  out = nn.generate(model, _tokens(T=3), 6)
  assert out.shape == (B, 9) and int(out.min()) >= 0 and int(out.max()) < V


def test_cache_bytes_for_equals_the_bytes_held():
  cfg = nn.ModelConfig(
    vocab_size=V,
    d_model=D,
    num_layers=2,
    layer_attention=(nn.AttentionConfig(num_kv_heads=2, window=3), nn.AttentionConfig()),
  )
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  for policy, budget in (
    ("full", None),
    ("int8", None),
    ("fp8", None),
    ("h2o", 5),
    ("sinks_window", 5),
  ):
    layers = tuple(
      c.replace(
        cache_policy=policy, cache_budget=budget, window=c.window if budget is None else None
      )
      for c in cfg.layer_attention
    )
    held = nn.cache_bytes(
      jax.eval_shape(
        lambda: nn.TransformerLM(cfg.replace(layer_attention=layers), rngs=nnx.Rngs(0)).init_cache(
          3, 16
        )
      )
    )
    if budget is None:
      assert nn.cache_bytes_for(cfg, policy, 16, 3) == held, policy
    else:
      assert nn.cache_bytes_for(cfg.replace(layer_attention=layers), None, 16, 3) == held
  assert nn.cache_bytes(model.init_cache(3, 16)) == nn.cache_bytes_for(cfg, None, 16, 3)
  with pytest.raises(ValueError, match="cache_policy='h2o' cannot be combined with window"):
    nn.cache_bytes_for(cfg, "h2o", 16, budget=4)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(cache_policy="lru"), ValueError, "cache_policy='lru' is not one of"),
    (dict(cache_policy="h2o"), ValueError, "cache_budget=None"),
    (dict(cache_policy="h2o", cache_budget=0), ValueError, "cache_budget must be a positive int"),
    (
      dict(cache_policy="sinks_window", cache_budget=2.5),
      TypeError,
      "cache_budget must be a positive int",
    ),
    (
      dict(cache_policy="h2o", cache_budget=2, cache_recent=3),
      ValueError,
      "cache_budget=2 is too small for the recent window cache_recent=3",
    ),
    (dict(cache_policy="h2o", cache_budget=4, cache_recent=0), ValueError, "cache_recent must be"),
    (dict(cache_policy="int8", cache_budget=4), ValueError, "cache_budget=4: cache_policy='int8'"),
    (
      dict(cache_policy="h2o", cache_budget=4, window=8),
      ValueError,
      "cache_policy='h2o' cannot be combined with window=8",
    ),
    (
      dict(
        family="sparse",
        pattern=("strided", (("stride", 4),)),
        cache_policy="sinks_window",
        cache_budget=4,
      ),
      ValueError,
      "cache_policy='sinks_window': family='sparse'",
    ),
  ],
)
def test_bad_policies_and_budgets_name_the_argument(kwargs, error, match):
  with pytest.raises(error, match=match):
    nn.AttentionConfig(**kwargs)


def test_budget_above_max_len_and_fp8_support_raise(monkeypatch):
  layer = nn.Attention(nn.AttentionConfig(cache_policy="h2o", cache_budget=8), D, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="cache_budget=8 exceeds max_len=6"):
    layer.init_cache(1, 6)
  with pytest.raises(TypeError, match="cache must be a H2OCache"):
    layer.decode(
      jnp.zeros((1, 1, D)), nn.Attention(nn.AttentionConfig(), D, rngs=nnx.Rngs(0)).init_cache(1, 8)
    )
  fp8 = nn.Attention(nn.AttentionConfig(cache_policy="fp8"), D, rngs=nnx.Rngs(0))
  monkeypatch.setattr(kv_policies, "fp8_supported", lambda: False)
  with pytest.raises(ValueError, match="cache_policy='fp8': float8_e4m3fn is unsupported"):
    fp8.init_cache(1, 4)


def test_configs_with_policies_round_trip_through_dicts():
  cfg = nn.AttentionConfig(
    cache_policy="sinks_window", cache_budget=8, cache_recent=6, streaming_rope="absolute"
  )
  assert nn.AttentionConfig.from_dict(cfg.to_dict()) == cfg
  old = {k: v for k, v in nn.AttentionConfig().to_dict().items() if not k.startswith("cache_")}
  assert nn.AttentionConfig.from_dict(old).cache_policy == "full"


def test_kv_cache_experiment_writes_its_table(tmp_path):
  """The evaluation of experiments/kv_cache.py on an untrained tiny model (training is train())."""
  import importlib.util
  import json
  import pathlib

  from attnjax._src.train import cli
  from attnjax._src.train.model import build_model

  root = pathlib.Path(__file__).resolve().parents[1]
  spec = importlib.util.spec_from_file_location(
    "kv_cache_experiment", root / "experiments" / "kv_cache.py"
  )
  experiment = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(experiment)
  tiny = [
    "data.seq_len=16",
    "model.d_model=16",
    "model.num_layers=1",
    "model.num_heads=2",
    "sweep.policies=full,int8,h2o",
    "sweep.budgets=0.5",
  ]
  config = str(root / "experiments" / "configs" / "kv_cache.py") + ":preset=cpu"
  cfg, _ = cli.parse("doc", config, [f"--config.{o}" for o in tiny], sweep=False)
  model = build_model(cfg, V, seed=0)
  tokens = np.asarray(jax.random.randint(jax.random.key(0), (2, 17), 0, V))
  markdown = experiment.evaluate(cfg, model, V, tokens[:, :-1], tokens[:, 1:], str(tmp_path))
  results = json.loads((tmp_path / "results.json").read_text())
  assert set(results) == {"full forward (no cache)", "full", "int8", "h2o 8/16"}
  assert results["full"]["ppl_vs_full_cache"] == 1.0
  assert abs(results["full forward (no cache)"]["ppl_vs_full_cache"] - 1) < 1e-4
  assert abs(results["int8"]["ppl_vs_full_cache"] - 1) < 0.01
  assert results["int8"]["cache_bytes"] < results["full"]["cache_bytes"]
  assert results["h2o 8/16"]["gpu_budget"] == 2048
  assert results["h2o 8/16"]["gpu_bytes_vs_full"] < 0.6
  assert "| int8 |" in markdown and "| h2o 8/16 |" in markdown
  assert (tmp_path / "plots" / "perplexity_vs_bytes.png").exists()
