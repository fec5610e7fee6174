"""Weights-only normalisers: SSMax (Nakanishi 2025) written as its weights, run everywhere.

Registered publicly and used by name, it equals a naive jnp definition in value, gradient and
forward mode on the reference and block-wise engines (the latter in O(T) memory: two passes
over the key blocks, derivatives by autodiff), takes learned per-head parameters that train,
and the Pallas kernels and the ring refuse it by name.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import normalizers, options
from attnjax.kernels import blockwise
from helpers import assert_close, rand_qkv, reduction_tolerance


class SSMax(normalizers.WeightsOnly):
  """Scalable-Softmax (Nakanishi 2025): softmax of ``s log(n) z``, ``n`` the row's keys."""

  name = "test_ssmax"
  source = "Nakanishi 2025"
  row_quantities = ("count", "logsumexp")
  params = (normalizers.Param("s", init=0.43),)

  def logits(self, z, row):
    return row["s"] * jnp.log(row["count"]) * z

  def weights(self, z, allowed, row):
    return jnp.exp(z - row["logsumexp"])


class ClippedSoftmax(normalizers.WeightsOnly):
  """Bondarenko et al. 2023's clipped softmax, learned bounds (the built-in is the online form): the
  row logsumexp makes it weights-only."""

  name = "clipped_softmax_test"
  row_quantities = ("logsumexp",)
  params = (normalizers.Param("zeta", 1.0, per_head=False), normalizers.Param("gamma", -0.03))

  def weights(self, z, allowed, row):
    p = jnp.exp(z - row["logsumexp"])
    return jnp.clip((row["zeta"] - row["gamma"]) * p + row["gamma"], 0.0, 1.0)


SSMAX, CLIPPED = SSMax(), ClippedSoftmax()


@pytest.fixture(scope="module", autouse=True)
def registered():
  for nz in (SSMAX, CLIPPED):
    normalizers.register(nz)
  yield
  for nz in (SSMAX, CLIPPED):
    normalizers.unregister(nz.name)


def naive_ssmax(q, k, v, s, allowed, scale):
  """SSMax written out in jnp: ``allowed`` ``[B|1, 1, T, S]``, ``s`` ``[N]``."""
  G = q.shape[2] // k.shape[2]
  kk, vv = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
  z = jnp.einsum("btnh,bsnh->bnts", q, kk) * scale
  allowed = jnp.broadcast_to(allowed, z.shape)
  n = jnp.maximum(jnp.sum(allowed, axis=-1, keepdims=True), 1)
  z = jnp.where(allowed, s[None, :, None, None] * jnp.log(n) * z, -jnp.inf)
  w = jnp.exp(z - jax.scipy.special.logsumexp(z, axis=-1, keepdims=True))
  w = jnp.where(allowed, w, 0.0)
  return jnp.einsum("bnts,bsnh->btnh", w, vv)


B, T, N, K, H = 2, 21, 4, 2, 8
STRUCTURE = dict(is_causal=True, window=(9, 0))


def _inputs():
  q, k, v = rand_qkv(B, T, N=N, K=K, H=H)
  s = jnp.asarray([0.3, 0.5, 0.7, 0.9], jnp.float32)
  lengths = np.array([T, 15])  # padded keys in the second row
  pad = np.arange(T)[None, None, None, :] < lengths[:, None, None, None]
  causal = np.tril(np.ones((T, T), bool)) & ~np.tril(np.ones((T, T), bool), -10)
  return (q, k, v, s), jnp.asarray(pad), jnp.asarray(pad & causal[None, None])


def _call(impl):
  def f(q, k, v, s, mask):
    kw = dict(STRUCTURE, mask=mask, normalizer="test_ssmax", normalizer_params={"s": s})
    if impl == "blockwise":  # blocks of 8: partial blocks, skipped blocks, masked tiles
      return blockwise.attention(q, k, v, block_q=8, block_k=8, **kw)
    return attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)

  return f


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_ssmax_equals_the_naive_definition_in_value_gradient_and_forward_mode(impl):
  args, pad, allowed = _inputs()
  tol = reduction_tolerance(jnp.float32, T * H, depth=8)
  fn = _call(impl)
  naive = lambda q, k, v, s, mask: naive_ssmax(q, k, v, s, allowed, H**-0.5)
  # The naive definition compiled too: run eagerly, every op would compile a program of its own.
  got, want = fn(*args, pad), jax.jit(naive)(*args, pad)
  assert_close(got, want, f"value {impl}", rtol=tol, atol=tol, scaled=True)

  def loss(f):
    return lambda *a: jnp.sum(jnp.sin(f(*a, pad)))

  grads = jax.jit(jax.grad(loss(fn), argnums=(0, 1, 2, 3)))(*args)
  assert_close(
    grads,
    jax.jit(jax.grad(loss(naive), argnums=(0, 1, 2, 3)))(*args),
    f"grad {impl}",
    rtol=tol,
    atol=tol,
    scaled=True,
  )
  tangents = tuple(jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(x.shape) for x in args)
  jvp_of = lambda f: jax.jit(lambda a, t: jax.jvp(lambda *x: f(*x, pad), a, t)[1])
  jvp, jvp_want = jvp_of(fn)(args, tangents), jvp_of(naive)(args, tangents)
  assert_close(jvp, jvp_want, f"jvp {impl}", rtol=tol, atol=tol, scaled=True)


def test_statistics_of_the_two_engines_agree():
  args, pad, _ = _inputs()
  tol = reduction_tolerance(jnp.float32, T * H, depth=8)

  def _stats(impl, q, k, v, s, mask):
    kw = dict(
      STRUCTURE, mask=mask, normalizer="test_ssmax", normalizer_params={"s": s}, return_stats=True
    )
    if impl == "blockwise":
      return blockwise.attention(q, k, v, block_q=8, block_k=8, **kw)
    return attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)

  ref = jax.jit(lambda *a: _stats("reference", *a, pad))(*args)
  got = jax.jit(lambda *a: _stats("blockwise", *a, pad))(*args)
  assert_close(got, ref, "stats", rtol=tol, atol=tol, scaled=True)
  stats = ref[1]
  assert np.allclose(stats.row_sum, 1.0, atol=1e-5)  # a softmax of rewritten logits
  lse_grad = lambda impl: jax.grad(lambda q: jnp.sum(_stats(impl, q, *args[1:], pad)[1].logsumexp))
  assert_close(
    lse_grad("blockwise")(args[0]),
    lse_grad("reference")(args[0]),
    "d logsumexp",
    rtol=tol,
    atol=tol,
    scaled=True,
  )


@pytest.mark.slow  # ~10 s: sparse / compressed / block_select run the same two forms
def test_the_other_dense_families_run_it():
  q, k, v = rand_qkv(1, 40, N=4, K=2, H=8)
  tol = reduction_tolerance(jnp.float32, 40 * 8, depth=8)
  calls = {
    "sparse": lambda impl: attnjax.sparse_attention(
      q,
      k,
      v,
      pattern=attnjax.patterns.bigbird(8, 1, 1, 1, seed=0),
      block_size=8,
      normalizer="test_ssmax",
      implementation=impl,
    ),
    "compressed": lambda impl: attnjax.compressed_attention(
      q,
      k,
      v,
      stride=4,
      is_causal=True,
      window=4,
      block_size=8,
      normalizer="test_ssmax",
      implementation=impl,
    ),
    "block_select": lambda impl: attnjax.block_select_attention(
      q,
      k,
      v,
      block_size=8,
      top_k=1,
      normalizer="clipped_softmax_test",
      normalizer_params={"zeta": jnp.asarray(1.01), "gamma": jnp.full((4,), -0.02)},
      implementation=impl,
    ),
  }
  for family, call in calls.items():
    fast = "gathered" if family == "block_select" else "blockwise"
    np.testing.assert_allclose(call(fast), call("reference"), rtol=tol, atol=tol, err_msg=family)


def test_blockwise_keeps_O_T_memory_at_16k_tokens():
  """Neither the forward nor the gradient builds [T, S]: XLA's temporaries at T=16384 are a few
  megabytes (one [T, S] float32 per head would be 1 GiB); the gradient's were 418 MiB while a
  rematerialised visit sat inside its branch (residuals stacked per visit)."""
  T16 = 16384
  x = jax.ShapeDtypeStruct((1, T16, 2, 16), jnp.float32)

  def attend(q, k, v):
    return attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer="test_ssmax", implementation="blockwise"
    )

  loss = lambda q, k, v: jnp.sum(attend(q, k, v))
  for fn, bound in ((attend, 32), (jax.grad(loss, argnums=(0, 1, 2)), 96)):
    m = jax.jit(fn).lower(x, x, x).compile().memory_analysis()
    if m is None:
      pytest.skip("no memory analysis on this backend")
    assert m.temp_size_in_bytes < bound * 2**20, m.temp_size_in_bytes


def test_platform_kernels_and_the_ring_refuse_it_by_name():
  from attnjax.kernels import mosaic_gpu, pallas_gpu, pallas_tpu
  from attnjax._src.kernels.blockwise import ring

  q, k, v = rand_qkv(1, 64, N=2, K=2, H=16)
  inputs, opts = options.validate(q, k, v, is_causal=True, normalizer="test_ssmax")
  for kernel in (pallas_gpu, pallas_tpu, mosaic_gpu):
    reasons = " ".join(kernel.unsupported(inputs, opts, interpret=True))
    assert "'test_ssmax', a weights-only normaliser" in reasons and "tile interface" in reasons
  with pytest.raises(ValueError, match="xla' does not support normalizer='test_ssmax'"):
    attnjax.dot_product_attention(q, k, v, normalizer="test_ssmax", implementation="xla")
  with pytest.raises(ValueError, match="ring.*weights-only.*all_gather"):
    ring.attention(inputs, opts, axis_name="x")


def test_normalizer_params_are_checked():
  q, k, v = rand_qkv(1, 8, N=4, K=2, H=8)
  with pytest.raises(
    ValueError, match=r"\['t'\] are not parameters of normalizer='test_ssmax'.*'s'"
  ):
    attnjax.dot_product_attention(q, k, v, normalizer="test_ssmax", normalizer_params={"t": 1.0})
  with pytest.raises(ValueError, match=r"must have shape \(4,\).*got \(3,\)"):
    attnjax.dot_product_attention(
      q, k, v, normalizer="test_ssmax", normalizer_params={"s": jnp.ones(3)}
    )
  with pytest.raises(ValueError, match="declares no parameters|not parameters of normalizer="):
    attnjax.dot_product_attention(q, k, v, normalizer_params={"s": jnp.ones(4)})
  # Left out, a parameter takes its init.
  default = attnjax.dot_product_attention(q, k, v, normalizer="test_ssmax")
  given = attnjax.dot_product_attention(
    q, k, v, normalizer="test_ssmax", normalizer_params={"s": jnp.full((4,), 0.43)}
  )
  np.testing.assert_array_equal(default, given)


def test_learned_s_trains_in_a_model_and_moves():
  import optax
  from flax import nnx

  from attnjax import nn

  cfg = nn.ModelConfig(
    vocab_size=32,
    d_model=32,
    num_layers=1,
    attention=nn.AttentionConfig(num_heads=4, normalizer="test_ssmax"),
  )
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  s = model.blocks[0].attention.normalizer_params["s"]
  np.testing.assert_array_equal(s[...], np.full(4, 0.43, np.float32))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (8, 16)))

  def loss_fn(model):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  first = float(step(model, opt))
  for _ in range(9):
    last = float(step(model, opt))
  assert last < first
  moved = np.abs(np.asarray(model.blocks[0].attention.normalizer_params["s"][...]) - 0.43)
  assert np.all(moved > 1e-3), moved


def test_from_pretrained_initialises_the_parameters_with_a_warning():
  from attnjax import models

  path = os.path.join(os.path.dirname(__file__), "fixtures", "pretrained", "llama")
  with pytest.warns(UserWarning, match=r"initial values:.*normalizer_params/s"):
    model = models.from_pretrained(path, attention={"normalizer": "test_ssmax"})
  assert model.config.attention.normalizer == "test_ssmax"
  logits = model(jnp.asarray([[1, 5, 9, 3]]))
  assert np.all(np.isfinite(np.asarray(logits)))


def test_a_registered_normalizer_is_a_variant_once_imported(tmp_path):
  from attnjax._src.train import config as config_lib, variants

  plugin = tmp_path / "imported_ssmax.py"
  plugin.write_text(
    "from attnjax import normalizers\n"
    "class Imported(normalizers.WeightsOnly):\n"
    "  name = 'imported_ssmax'\n"
    "  def weights(self, z, allowed, row):\n"
    "    return z\n"
    "normalizers.register(Imported())\n"
  )
  cfg = config_lib.base_config()
  cfg.variant = "imported_ssmax"
  with pytest.raises(ValueError, match="variant='imported_ssmax' is not one of.*imports="):
    config_lib.validate(cfg)
  cfg.imports = str(plugin)
  try:
    config_lib.validate(cfg)
    assert variants.attention_kwargs("imported_ssmax") == {
      "family": "dense",
      "normalizer": "imported_ssmax",
    }
    assert "imported_ssmax" in variants.names()
  finally:
    normalizers.unregister("imported_ssmax")
  cfg.imports = "no_such_module_anywhere"
  with pytest.raises(ValueError, match="'no_such_module_anywhere' does not import"):
    config_lib.validate(cfg)


@pytest.mark.slow  # ~10 s: a compare run of 4 steps
def test_the_compare_cli_takes_it_by_name(tmp_path, monkeypatch):
  """A registered normaliser is a variant; the config's imports register it in every process."""
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  plugin = tmp_path / "my_ssmax.py"
  plugin.write_text(
    "import jax.numpy as jnp\n"
    "from attnjax import normalizers\n\n"
    "class PluginSSMax(normalizers.WeightsOnly):\n"
    "  name = 'plugin_ssmax'\n"
    "  row_quantities = ('count', 'logsumexp')\n"
    "  params = (normalizers.Param('s', init=0.5),)\n\n"
    "  def logits(self, z, row):\n"
    "    return row['s'] * jnp.log(row['count']) * z\n\n"
    "  def weights(self, z, allowed, row):\n"
    "    return jnp.exp(z - row['logsumexp'])\n\n"
    "normalizers.register(PluginSSMax())\n"
  )
  spec = importlib.util.spec_from_file_location(
    "compare_cli", os.path.join(root, "experiments", "compare.py")
  )
  compare = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(compare)
  monkeypatch.chdir(tmp_path)
  tiny = [
    "--config.sweep.variants=plugin_ssmax",
    f"--config.imports={plugin}",
    "--config.data.name=bigram_backcopy",
    "--config.data.seq_len=16",
    "--config.data.batch_size=8",
    "--config.data.bb_vocab_size=16",
    "--config.model.d_model=16",
    "--config.model.num_layers=1",
    "--config.model.num_heads=2",
    "--config.model.mlp_ratio=2",
    "--config.train.steps=4",
    "--config.train.log_every=2",
    "--config.train.eval_every=4",
    "--config.train.eval_batches=1",
    "--config.train.probe_every=4",
    "--config.train.probe_batch=4",
    "--config.train.probe_len=16",
    "--config.train.checkpoint_every=0",
    "--config.train.num_devices=1",
    "--config.train.microbatches=1",
    "--config.train.progress=false",
    "--config.train.plots=false",
  ]
  try:
    markdown = compare.main(
      [
        "--config",
        os.path.join(root, "experiments/configs/compare.py:preset=cpu"),
        *tiny,
        "--out",
        str(tmp_path / "runs"),
      ]
    )
  finally:
    if "plugin_ssmax" in normalizers.REGISTRY:
      normalizers.unregister("plugin_ssmax")
  assert "plugin_ssmax" in markdown
  summary = (tmp_path / "runs" / "plugin_ssmax" / "summary.json").read_text()
  assert '"finished"' in summary, summary
