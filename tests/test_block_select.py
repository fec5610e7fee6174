"""attnjax.block_select_attention: content-selected block-sparse attention (MoBA)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.block_select import attention as block_select
from attnjax._src import normalizers
from tests.helpers import assert_close, rand_qkv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def brute_selection(q, k, block_size, top_k, is_causal, query_pool=None):
  """numpy: per (batch, kv head, query block) the set of kept key blocks (own block included)."""
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  B, T, N, H = q.shape
  K = k.shape[2]
  nb = -(-T // block_size)
  spans = [(b * block_size, min(T, (b + 1) * block_size)) for b in range(nb)]
  kept = np.zeros((B, K, nb, nb), bool)
  for b in range(B):
    for h in range(K):
      kbar = [k[b, s:e, h].mean(0) for s, e in spans]
      for i, (s, e) in enumerate(spans):
        heads = q[b, s:e, h * (N // K) : (h + 1) * (N // K)]  # [rows, G, H]
        pool = query_pool or ("first" if is_causal else "mean")
        qbar = heads.mean(0) if pool == "mean" else heads[0]
        cands = [j for j in range(nb) if (j < i if is_causal else j != i)]
        scores = {j: float(np.sum(qbar @ kbar[j])) for j in cands}
        best = sorted(cands, key=lambda j: (-scores[j], j))[:top_k]
        kept[b, h, i, best + [i]] = True
  return kept


def brute_mask(kept, T, block_size, N):
  blk = np.arange(T) // block_size
  m = kept[:, :, blk][:, :, :, blk]  # [B, K, T, T]
  return np.repeat(m, N // kept.shape[1], axis=1)


def loss_fn(impl, **kw):
  """sum(out * ct) (+ a logsumexp term with stats): value and grads w.r.t. q, k, v."""

  def loss(q, k, v):
    res = attnjax.block_select_attention(q, k, v, implementation=impl, **kw)
    out, stats = res if kw.get("return_stats") else (res, None)
    ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
    total = jnp.sum(out.astype(jnp.float32) * ct)
    if stats is not None:
      total = total + 0.1 * jnp.sum(stats.logsumexp)
    return total, res

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def compare(q, k, v, *, tol=2e-5, **kw):
  (_, res_r), g_r = loss_fn("reference", **kw)(q, k, v)
  (_, res_g), g_g = loss_fn("gathered", **kw)(q, k, v)
  assert_close(res_g, res_r, "value", rtol=tol, atol=tol)
  assert_close(g_g, g_r, "grads", rtol=tol, atol=tol)
  for g in g_g:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  return res_g


def test_selection_matches_brute_force():
  q, k, _ = rand_qkv(2, 45, N=4, K=2, H=8, seed=1)
  for causal, pool in ((True, "first"), (False, "mean"), (False, "first")):
    sel = np.asarray(
      block_select.select_blocks(q, k, block_size=8, top_k=2, is_causal=causal, query_pool=pool)
    )
    assert sel.shape == (2, 2, 6, 2)
    kept = brute_selection(q, k, 8, 2, causal, pool)
    got = np.zeros_like(kept)
    for b, h, i in np.ndindex(*sel.shape[:3]):
      got[b, h, i, [j for j in sel[b, h, i] if j >= 0] + [i]] = True
    np.testing.assert_array_equal(got, kept, err_msg=f"causal={causal} pool={pool}")
    valid = np.where(sel >= 0, sel, 10**6)
    assert np.all(np.diff(valid, axis=-1) >= 0)  # ascending, -1 at the end
  # Causal: block 0 has no candidate, block 1 only block 0.
  sel = np.asarray(block_select.select_blocks(q, k, block_size=8, top_k=2))
  assert np.all(sel[:, :, 0] == -1) and np.all(sel[:, :, 1] == [0, -1])


def test_selection_picks_the_block_built_to_win():
  # Every query points along e0; key block 3 alone does too: it wins for every later block.
  B, T, N, H, bs = 1, 64, 2, 4, 8
  q = jnp.zeros((B, T, N, H)).at[..., 0].set(1.0)
  k = jax.random.normal(jax.random.key(0), (B, T, N, H)) * 0.1
  k = k.at[:, 24:32, :, 0].set(5.0)
  sel = np.asarray(block_select.select_blocks(q, k, block_size=bs, top_k=1))
  assert np.all(sel[0, :, 4:, 0] == 3)
  # Flip it: block 3 scores lowest and is never picked once there are others.
  sel = np.asarray(
    block_select.select_blocks(q, k.at[:, 24:32, :, 0].set(-5.0), block_size=bs, top_k=1)
  )
  assert not np.any(sel[0, :, 5:, 0] == 3)
  # The winner's values reach the output: v = 1 in block 3 only, and the rows of block 6
  # (whose own block has v = 0) put weight on it.
  v = jnp.zeros((B, T, N, H)).at[:, 24:32].set(1.0)
  out = attnjax.block_select_attention(q, k, v, block_size=bs, top_k=1)
  assert np.all(np.asarray(out[0, 48:56]) > 0.5)


def test_reference_is_dense_with_the_selection_mask():
  q, k, v = rand_qkv(2, 37, N=4, K=2, H=8, seed=2)
  for causal in (True, False):
    out = attnjax.block_select_attention(
      q, k, v, block_size=8, top_k=2, is_causal=causal, implementation="reference"
    )
    mask = brute_mask(brute_selection(q, k, 8, 2, causal), 37, 8, 4)
    want = attnjax.dot_product_attention(q, k, v, mask=jnp.asarray(mask), is_causal=causal)
    assert_close(out, want, f"causal={causal}")


def test_top_k_limits():
  q, k, v = rand_qkv(1, 40, N=2, K=2, H=8, seed=3)
  # Enough slots for every earlier block: plain causal attention.
  out = attnjax.block_select_attention(q, k, v, block_size=8, top_k=10)
  assert_close(out, attnjax.dot_product_attention(q, k, v, is_causal=True), "top_k >= blocks")
  # top_k=0: each block sees only itself (block-diagonal, causal inside).
  out = attnjax.block_select_attention(q, k, v, block_size=8, top_k=0)
  blk = np.arange(40) // 8
  mask = jnp.asarray(blk[:, None] == blk[None, :])[None, None]
  assert_close(out, attnjax.dot_product_attention(q, k, v, mask=mask, is_causal=True), "top_k=0")


@pytest.mark.parametrize(
  "T,N,K,causal", [(45, 4, 2, True), (40, 2, 2, False)], ids=["causal_gqa_T45", "bidir_T40"]
)
def test_gathered_matches_reference_with_stats(T, N, K, causal):
  q, k, v = rand_qkv(2, T, N=N, K=K, H=8, seed=4)
  out, stats = compare(q, k, v, block_size=8, top_k=2, is_causal=causal, return_stats=True)
  assert out.shape == (2, T, N, 8) and stats.logsumexp.shape == (2, N, T)


@pytest.mark.slow  # ~11 s; gathered == reference per normaliser is also in the slow cross product
def test_every_normalizer_and_options():
  # Every normaliser's forward (values and stats) in one compiled program; gradients for
  # two (the slow cross product has every normaliser's gradients).
  q, k, v = rand_qkv(1, 24, N=4, K=2, H=8, seed=5)

  @jax.jit
  def both(q, k, v):
    run = lambda impl, name: attnjax.block_select_attention(
      q, k, v, block_size=8, top_k=1, normalizer=name, implementation=impl, return_stats=True
    )
    return {
      name: (run("gathered", name), run("reference", name)) for name in normalizers.NORMALIZERS
    }

  for name, (got, want) in both(q, k, v).items():
    assert_close(got, want, name, rtol=5e-5, atol=5e-5)
  compare(q, k, v, tol=5e-5, block_size=8, top_k=1, normalizer="softpick")
  compare(
    q,
    k,
    v,
    block_size=8,
    top_k=1,
    sink_logits=jnp.array([0.5, -1.0, 0.0, 2.0]),
    softcap=3.0,
    query_pool="first",
  )
  compare(
    q,
    k,
    v,
    tol=5e-5,
    block_size=8,
    top_k=1,
    similarity="neg_sq_euclidean",
    scale=0.1,
    normalizer="sigmoid",
  )


def test_gathered_online_path_bidirectional_ragged():
  # Without statistics the gathered path runs the normaliser's online form; here with a partial
  # last block that other blocks select (bidirectional: its padded keys must not count) and a
  # counting normaliser (relu divides by the attended keys), with GQA.
  q, k, v = rand_qkv(2, 29, N=4, K=2, H=8, seed=12)
  compare(q, k, v, tol=5e-5, block_size=8, top_k=2, is_causal=False, normalizer="relu")


def test_bfloat16():
  q, k, v = rand_qkv(1, 36, N=4, K=2, H=8, seed=6, dtype=jnp.bfloat16)
  out = compare(q, k, v, tol=2e-2, block_size=8, top_k=2)
  assert out.dtype == jnp.bfloat16


def test_rows_with_nothing_allowed_are_zero():
  # Padded queries (segment -1) match no key segment: zero rows, finite gradients.
  B, T = 2, 30
  q, k, v = rand_qkv(B, T, N=2, K=1, H=8, seed=7)
  q_seg = jnp.asarray(np.where(np.arange(T) < 22, np.arange(T) // 11, -1)[None].repeat(B, 0))
  kv_seg = jnp.asarray((np.arange(T) // 11)[None].repeat(B, 0))
  out = compare(q, k, v, block_size=8, top_k=1, segment_ids=(q_seg, kv_seg))
  np.testing.assert_array_equal(np.asarray(out[:, 22:]), 0.0)
  assert np.all(np.abs(np.asarray(out[:, :22])) > 0)


@pytest.mark.parametrize("implementation", ["reference", "gathered"])
def test_causal_selection_is_strictly_causal(implementation):
  # Changing q, k or v after position t leaves every output up to t unchanged (GQA, t inside a
  # block); the default query pool when causal is "first", and "mean" is refused.
  q, k, v = rand_qkv(1, 32, N=4, K=2, H=8, seed=8)
  kw = dict(block_size=4, top_k=1, implementation=implementation)
  base = attnjax.block_select_attention(q, k, v, **kw)
  for t in (5, 13, 22):
    noise = jax.random.normal(jax.random.key(t), q[:, t + 1 :].shape) * 5
    for which in range(3):
      args = [q, k, v]
      args[which] = args[which].at[:, t + 1 :].set(noise[..., : args[which].shape[2], :])
      out = attnjax.block_select_attention(*args, **kw)
      np.testing.assert_array_equal(np.asarray(out[:, : t + 1]), np.asarray(base[:, : t + 1]))
  with pytest.raises(ValueError, match="query_pool='mean' with is_causal=True"):
    attnjax.block_select_attention(q, k, v, query_pool="mean", **kw)


def test_return_selection():
  q, k, v = rand_qkv(1, 20, N=2, K=1, H=8, seed=10)
  out, stats, sel = attnjax.block_select_attention(
    q, k, v, block_size=4, top_k=3, return_stats=True, return_selection=True
  )
  assert isinstance(stats, attnjax.AttentionStats)
  np.testing.assert_array_equal(sel, block_select.select_blocks(q, k, block_size=4, top_k=3))
  out2, sel2 = attnjax.block_select_attention(q, k, v, block_size=4, top_k=3, return_selection=True)
  assert_close(out2, out, "out")
  assert sel2.shape == (1, 1, 5, 3) and sel2.dtype == jnp.int32


@pytest.mark.parametrize(
  "kw,err,match",
  [
    (dict(block_size=0, top_k=1), ValueError, "block_size"),
    (dict(block_size=4, top_k=-1), ValueError, "top_k"),
    (dict(block_size=4, top_k=1, query_pool="max"), ValueError, "query_pool"),
    (dict(block_size=4, top_k=1, implementation="dense"), ValueError, "implementation"),
    (dict(block_size=4, top_k=1, normalizer="x"), ValueError, "normalizer"),
  ],
)
def test_validation(kw, err, match):
  q, k, v = rand_qkv(1, 8, N=2, K=1, H=4)
  with pytest.raises(err, match=match):
    attnjax.block_select_attention(q, k, v, **kw)


@pytest.mark.parametrize(
  "T,block_size",
  [(7, 4), pytest.param(70, 16, marks=pytest.mark.slow)],
  ids=["T7_block4", "T70_block16"],
)
def test_partial_last_block_gradients_of_every_normalizer(T, block_size):
  """A length that is not a multiple of the block (the issue's random-test finds, GQA 4/2):
  softpick's key gradient was NaN in every entry on the gathered engine (448 of 448 at T=7),
  from 1 - e^-|z| differentiated at the zero logits of the padded query rows."""
  q, k, v = rand_qkv(1, T, N=4, K=2, H=8, seed=3)

  @jax.jit
  def value_and_grads(q, k, v):
    found = {}
    for name in normalizers.NORMALIZERS:
      for impl in ("gathered", "reference"):

        def loss(q, k, v, name=name, impl=impl):
          out = attnjax.block_select_attention(
            q, k, v, block_size=block_size, top_k=1, normalizer=name, implementation=impl
          )
          return jnp.sum(jnp.sin(out))

        found[name, impl] = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return found

  found = value_and_grads(q, k, v)
  for name in normalizers.NORMALIZERS:
    got, want = found[name, "gathered"], found[name, "reference"]
    for leaf in jax.tree.leaves(got):
      assert bool(jnp.all(jnp.isfinite(leaf))), name
    assert_close(got, want, name, rtol=5e-5, atol=5e-5)


def test_self_attention_only():
  q, _, _ = rand_qkv(1, 8, N=2, K=1, H=4)
  _, k, v = rand_qkv(1, 12, N=2, K=1, H=4)
  with pytest.raises(ValueError, match="same length"):
    attnjax.block_select_attention(q, k, v, block_size=4, top_k=1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
@pytest.mark.parametrize("normalizer", normalizers.NORMALIZERS)
def test_cross_product(normalizer, causal, dtype):
  q, k, v = rand_qkv(2, 50, N=4, K=2, H=8, seed=11, dtype=dtype)
  tol = 5e-5 if dtype == jnp.float32 else 3e-2
  compare(
    q,
    k,
    v,
    tol=tol,
    block_size=8,
    top_k=3,
    is_causal=causal,
    normalizer=normalizer,
    return_stats=True,
  )


# ---------------------------------------------------------------------------
# The nn family.


def _lm(*layers, vocab=32, d_model=32):
  from flax import nnx

  cfg = attnjax.nn.ModelConfig(
    vocab_size=vocab, d_model=d_model, num_layers=len(layers), layer_attention=tuple(layers)
  )
  return attnjax.nn.TransformerLM(cfg, rngs=nnx.Rngs(0))


def test_nn_layer_is_the_function():
  from flax import nnx

  config = attnjax.nn.AttentionConfig(
    family="block_select", num_heads=4, num_kv_heads=2, block_size=4, top_k=1, rope_theta=None
  )
  layer = attnjax.nn.Attention(config, 16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(0), (2, 14, 16))
  q, k, v = layer._project(x)
  want = attnjax.block_select_attention(q, k, v, block_size=4, top_k=1, query_pool="first")
  got = layer(x)
  assert_close(got, layer.o_proj(jnp.reshape(want, (2, 14, -1))), "layer", rtol=1e-5, atol=1e-5)


DECODE_LAYERS = {
  "gqa_rope_block3_top2": dict(num_heads=4, num_kv_heads=2, block_size=3, top_k=2),
  "softmax_one_norope_block4": dict(
    num_heads=2, block_size=4, top_k=1, normalizer="softmax_one", rope_theta=None
  ),
}


@pytest.mark.parametrize(
  "name",
  ["gqa_rope_block3_top2", pytest.param("softmax_one_norope_block4", marks=pytest.mark.slow)],
)
def test_nn_prefill_and_decode_equal_full_forward(name):
  # T = 15 ends in a partial block; prefill 6 ends mid-block, so the block's first query
  # comes from the cache; uneven chunks cross block borders.
  from flax import nnx

  layers = (attnjax.nn.AttentionConfig(family="block_select", **DECODE_LAYERS[name]),)
  model = _lm(*layers)
  tokens = jax.random.randint(jax.random.key(1), (2, 15), 0, 32)

  @nnx.jit
  def run(model, tokens):
    full = model(tokens)
    cache = model.init_cache(2, 15)
    first, cache = model.decode(tokens[:, :6], cache)

    def step(cache, token):
      logits, cache = model.decode(token[:, None], cache)
      return cache, logits[:, 0]

    cache, rest = jax.lax.scan(step, cache, jnp.transpose(tokens[:, 6:]))
    stepwise = jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)
    chunk_cache, outs, start = model.init_cache(2, 15), [], 0
    for size in (5, 10):
      logits, chunk_cache = model.decode(tokens[:, start : start + size], chunk_cache)
      outs.append(logits)
      start += size
    return full, stepwise, jnp.concatenate(outs, axis=1), cache

  full, stepwise, chunked, cache = run(model, tokens)
  np.testing.assert_allclose(stepwise, full, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-5)
  assert isinstance(cache[0], attnjax.nn.specs.BlockSelectCache)
  assert int(cache[0].kv.index) == 15


def test_nn_options_are_checked():
  A = attnjax.nn.AttentionConfig
  with pytest.raises(ValueError, match="top_k"):
    A(family="block_select", top_k=-1)
  with pytest.raises(ValueError, match="query_pool"):
    A(family="block_select", query_pool="max")
  with pytest.raises(ValueError, match="alibi"):
    A(family="block_select", alibi=True)
  with pytest.raises(ValueError, match="cache_policy"):
    A(family="block_select", cache_policy="int8")
  model = _lm(A(family="block_select", num_heads=2, query_pool="mean", block_size=4))
  with pytest.raises(ValueError, match="query_pool='mean' with is_causal=True"):
    model(jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(ValueError, match="query_pool='first'"):
    model.init_cache(1, 8)


def _variant_model_config():
  from attnjax._src.train import config as config_lib
  from attnjax._src.train.model import model_config

  cfg = config_lib.load_config(
    os.path.join(REPO, "experiments", "configs", "compare.py") + ":preset=cpu",
    ["variant=block_select"],
  )
  return model_config(cfg, 32)


def test_experiment_variant():
  mc = _variant_model_config()
  assert mc.attention.family == "block_select"
  assert (mc.attention.spec.block_size, mc.attention.spec.top_k) == (8, 2)


@pytest.mark.slow
def test_experiment_variant_trains_a_step():
  import optax
  from flax import nnx

  model = attnjax.nn.TransformerLM(_variant_model_config(), rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (1, 33), 0, 32)

  @nnx.jit
  def step(model, tokens):
    def loss(model):
      logits = model(tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return nnx.value_and_grad(loss)(model)

  value, grads = step(model, tokens)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
