"""The nn families ``nsa`` and ``dsa``: decode equals the full forward (across compression
boundaries), their parameters learn from what they should, what they sow."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from attnjax import nn

D, T = 16, 13
# l=4 at stride 2: compressed blocks complete at tokens 3, 5, 7, ...; 3 of 4 selection blocks.
NSA = dict(block_length=4, stride=2, selection_block=4, num_selected=3, num_local=1, window=3)
DSA = dict(top_k=5, index_heads=2, index_head_dim=4)


@functools.cache
def _x():
  return jax.random.normal(jax.random.key(1), (2, T, D))


def _layer(family, **options):
  config = nn.AttentionConfig(family=family, num_heads=4, num_kv_heads=2, **options)
  return nn.Attention(config, D, rngs=nnx.Rngs(0))


CASES = {
  "nsa_mlp": ("nsa", NSA),
  "nsa_mean": ("nsa", dict(NSA, compression="mean", normalizer="softmax_one")),
  "dsa": ("dsa", DSA),
  "dsa_warmup": ("dsa", dict(DSA, warmup=True)),
}


@pytest.mark.parametrize(
  "name",
  [
    pytest.param(n, marks=() if n in ("nsa_mlp", "dsa") else pytest.mark.slow)
    for n in sorted(CASES)
  ],
)
def test_decode_equals_the_full_forward(name):
  family, options = CASES[name]
  layer = _layer(family, **options, implementation="reference")
  x = _x()
  # Compiled, as a model runs them: run eagerly, every op would compile a program of its own.
  full = nnx.jit(lambda layer, x: layer(x))(layer, x)
  # Token by token, then a prefill of 5 and the rest in one call.
  step = nnx.jit(lambda layer, x, cache: layer.decode(x, cache))
  cache = layer.init_cache(2, T)
  outs = []
  for t in range(T):
    out, cache = step(layer, x[:, t : t + 1], cache)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)
  cache = layer.init_cache(2, T + 3)
  a, cache = step(layer, x[:, :5], cache)
  b, cache = step(layer, x[:, 5:], cache)
  np.testing.assert_allclose(jnp.concatenate([a, b], 1), full, rtol=2e-5, atol=2e-5)
  if family == "nsa":  # compressed entries were appended as their blocks completed
    C = (T - 4) // 2 + 1
    written = np.asarray(jnp.any(cache.k_compressed != 0, axis=(0, 2, 3)))
    assert written[:C].all() and not written[C:].any()


@pytest.mark.slow  # the engines are held equal in tests/test_nsa.py and tests/test_dsa.py
def test_blockwise_layer_equals_reference_layer():
  x = _x()
  for family, options in (("nsa", NSA), ("dsa", DSA)):
    ref = _layer(family, **options, implementation="reference")(x)
    got = _layer(family, **options)(x)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def _grads(layer, loss):
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  return nnx.to_flat_state(jax.grad(lambda p: loss(nnx.merge(graphdef, p, rest)))(params))


@pytest.mark.slow  # ~10 s of compiles; the function's gradients are tested in test_nsa.py
def test_nsa_gates_and_compressor_learn():
  layer = _layer("nsa", **NSA)
  grads = dict(_grads(layer, lambda m: jnp.sum(m(_x()) ** 2)))
  for name in ("nsa_gate", "compress_k_w1", "compress_v_w1", "compress_k_position"):
    leaves = [g for path, g in grads.items() if path[0] == name]
    assert leaves and all(np.any(np.asarray(g[...])) for g in leaves), name


def test_dsa_indexer_learns_from_its_kl_loss_only():
  x = _x()
  layer = _layer("dsa", **DSA)
  index = ("index_q_proj", "index_k_proj", "index_w_proj")
  # The KL loss reaches the indexer only: one optimizer step on it leaves the rest unchanged.
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  kl = lambda p: nnx.merge(graphdef, p, rest).config.spec.indexer_loss(
    nnx.merge(graphdef, p, rest), x
  )
  opt = optax.adam(1e-2)
  grads = jax.grad(kl)(params)
  updates, _ = opt.update(grads, opt.init(params))
  new = optax.apply_updates(params, updates)
  before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(new))
  for path, value in before.items():
    moved = np.any(np.asarray(after[path][...]) != np.asarray(value[...]))
    assert moved == (path[0] in index), path
  # In training the layer adds that gradient: a loss on its output gives the indexer
  # indexer_loss_weight * dKL (nothing else reaches it), the other parameters their own.
  weight = 0.5
  layer = _layer("dsa", **dict(DSA, indexer_loss_weight=weight))
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  out_grads = dict(
    nnx.to_flat_state(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x)))(params))
  )
  kl_grads = dict(nnx.to_flat_state(jax.grad(kl)(params)))
  for path, g in out_grads.items():
    if path[0] in index:
      np.testing.assert_allclose(g[...], weight * kl_grads[path][...], rtol=1e-5, atol=1e-7)
    else:
      assert np.any(np.asarray(g[...])), path
  off = _layer("dsa", **dict(DSA, indexer_loss_weight=0.0))
  graphdef, params, rest = nnx.split(off, nnx.Param, ...)
  g = dict(nnx.to_flat_state(jax.grad(lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x)))(params)))
  assert all(not np.any(np.asarray(g[p][...])) for p in g if p[0] in index)


@pytest.mark.slow  # ~8 s
def test_what_the_layers_sow():
  x = _x()
  for family, options in (("nsa", NSA), ("dsa", DSA)):
    layer = _layer(family, **options)
    _, inter = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(layer, x)
    sown = {
      k: v[-1] if isinstance(v, tuple) and not hasattr(v, "_fields") else v
      for k, v in nnx.to_pure_dict(inter).items()
    }
    w = np.asarray(sown["weights"])
    assert w.shape == (2, 4, T, T)
    assert np.all(w >= -1e-6) and np.all(np.triu(w[0, 0], 1) == 0)  # causal, non-negative
    stats = sown["attention_stats"]
    assert stats.sink_mass.shape == (2, 4) and np.all(np.isfinite(stats.entropy))
    if family == "nsa":
      for name in ("nsa_sink_mass", "nsa_entropy", "nsa_max_logit", "nsa_gate_mean"):
        assert sown[name].shape == (2, 4, 3), name
      # Softmax rows, each branch's mass times its gate (< 1 each).
      assert np.all(w.sum(-1) > 0) and np.all(w.sum(-1) < 3)
    else:
      assert np.isfinite(float(sown["indexer_loss"]))
