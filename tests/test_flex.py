"""score_mod / mask_mod on every dense path: values and gradients equal the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax._src import layout, mods, patterns
from attnjax._src.ops.sparse import attention as sparse
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.kernels import jax_nn
from helpers import assert_close, rand_qkv

# Short calls of the sparse family run its block plans here, as auto-dispatch does from
# sparse.BLOCKWISE_MIN_LENGTH tokens on (the plans are what these tests check).
pytestmark = pytest.mark.usefixtures("sparse_block_plans")


def _alibi_table(z, b, n, i, j, slopes, table):
  """ALiBi plus a learned [T, S] table: two score_mod_args, both with gradients."""
  del b
  return z - slopes[n] * jnp.abs(i - j).astype(jnp.float32) + table[i, j]


def _doc_mask(b, n, i, j, ids):
  del n
  return ids[b, i] == ids[b, j]


def _late_rows(b, n, i, j):
  """Rows 0..2 see nothing (empty rows); others a causal window of 9 keys."""
  del b, n
  return (i >= 3) & (j <= i) & (j >= i - 9)


def _value_and_grads(fn, q, k, v, args):
  """Output and gradients of a fixed projection of it wrt q, k, v and the score_mod args."""
  w = jax.random.normal(jax.random.key(9), fn(q, k, v, args).shape, jnp.float32)
  loss = lambda q, k, v, args: jnp.sum(fn(q, k, v, args).astype(jnp.float32) * w)
  return fn(q, k, v, args), jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, args)


def _blockwise(bq=8, bk=8, **kw):
  return lambda q, k, v, args: blockwise.attention(
    q, k, v, block_q=bq, block_k=bk, score_mod_args=args, **kw
  )


def _reference(**kw):
  return lambda q, k, v, args: attnjax.dot_product_attention(
    q, k, v, implementation="reference", score_mod_args=args, **kw
  )


CASES = [
  ("softmax_causal_gqa", dict(normalizer="softmax", is_causal=True), 24, 24),
  ("softmax_one_T_ne_S", dict(normalizer="softmax_one"), 24, 20),
  ("sigmoid_window", dict(normalizer="sigmoid", window=(6, 2)), 24, 24),
  ("softpick_softcap_bias", dict(normalizer="softpick", softcap=3.0), 16, 24),
  ("relu_sink_none", dict(normalizer="relu"), 20, 20),
  ("softmax_sink_segments_stats", dict(normalizer="softmax", return_stats=True), 24, 24),
]


@pytest.mark.parametrize("name,kw,T,S", CASES, ids=[c[0] for c in CASES])
def test_score_and_mask_mod_blockwise_match_reference(name, kw, T, S):
  q, k, v = rand_qkv(2, T, S, 4, 2, 8, seed=1)
  args = (
    jnp.asarray(mods.alibi_slopes(4)),
    0.1 * jnp.asarray(np.random.default_rng(2).standard_normal((T, S), np.float32)),
  )
  kw = dict(kw, score_mod=_alibi_table, mask_mod=_late_rows if T == S else None)
  if "bias" in name:
    kw["bias"] = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, T, S)), jnp.float32)
  if "sink" in name and kw["normalizer"] == "softmax":
    kw["sink_logits"] = jnp.linspace(-1.0, 1.0, 4)
  if "segments" in name:
    kw["segment_ids"] = (jnp.arange(T)[None, :] >= 10).astype(jnp.int32) * jnp.ones(
      (2, 1), jnp.int32
    )
  stats = kw.get("return_stats", False)
  pick = (lambda f: lambda *a: f(*a)[0]) if stats else (lambda f: f)
  got = _value_and_grads(pick(_blockwise(**kw)), q, k, v, args)
  want = _value_and_grads(pick(_reference(**kw)), q, k, v, args)
  assert_close(got, want, name, rtol=2e-4, atol=2e-4)
  if stats:  # the logsumexp carries a gradient through the modifier too
    lse = lambda f: lambda q, k, v, args: f(q, k, v, args)[1].logsumexp
    assert_close(
      _value_and_grads(lse(_blockwise(**kw)), q, k, v, args),
      _value_and_grads(lse(_reference(**kw)), q, k, v, args),
      "lse",
      rtol=2e-4,
      atol=2e-4,
    )


def test_mask_mod_with_traced_args_skips_at_run_time_and_matches():
  # Document ids as mask_mod_args are traced inside the jitted call: the blocks
  # are classified per call; a row block whose document ends early is skipped.
  T = 32
  q, k, v = rand_qkv(2, T, T, 4, 2, 8, seed=4)
  ids = jnp.stack([jnp.arange(T) // 8, jnp.where(jnp.arange(T) < 20, 0, 1)]).astype(jnp.int32)
  seg_ref = attnjax.dot_product_attention(
    q, k, v, segment_ids=ids, is_causal=True, implementation="reference"
  )
  f = lambda q, k, v, args: blockwise.attention(
    q, k, v, block_q=8, block_k=8, is_causal=True, mask_mod=_doc_mask, mask_mod_args=(ids,)
  )
  r = lambda q, k, v, args: attnjax.dot_product_attention(
    q, k, v, is_causal=True, mask_mod=_doc_mask, mask_mod_args=(ids,), implementation="reference"
  )
  assert_close(f(q, k, v, ()), seg_ref, "vs segment_ids", rtol=1e-5, atol=1e-5)
  assert_close(
    _value_and_grads(f, q, k, v, ()),
    _value_and_grads(r, q, k, v, ()),
    "grads",
    rtol=1e-4,
    atol=1e-4,
  )


def test_document_mask_blocks_from_id_ranges(monkeypatch):
  # mods.document_mask carries a block rule from the ids' ranges (O(T)), used with traced ids.
  calls = []
  rule = mods.document_mask.block_table
  monkeypatch.setattr(
    mods.document_mask, "block_table", lambda *a: calls.append(1) or rule(*a), raising=True
  )
  T = 32
  q, k, v = rand_qkv(2, T, T, 2, 2, 8, seed=5)
  ids = jnp.stack([jnp.arange(T) // 8, jnp.arange(T) // 20]).astype(jnp.int32)
  got = blockwise.attention(
    q,
    k,
    v,
    block_q=8,
    block_k=8,  # jitted: ids traced
    mask_mod=mods.document_mask,
    mask_mod_args=(ids,),
  )
  want = attnjax.dot_product_attention(q, k, v, segment_ids=ids, implementation="reference")
  assert_close(got, want, "document", rtol=1e-5, atol=1e-5)
  assert calls


def test_bf16_and_gqa_with_modifiers():
  q, k, v = rand_qkv(1, 16, 16, 4, 1, 8, seed=6, dtype=jnp.bfloat16)
  kw = dict(score_mod=mods.alibi, mask_mod=mods.causal_mask)
  args = (jnp.asarray(mods.alibi_slopes(4)),)
  got = _value_and_grads(_blockwise(**kw), q, k, v, args)
  want = _value_and_grads(_reference(**kw), q, k, v, args)
  assert got[0].dtype == jnp.bfloat16
  assert_close(got, want, "bf16", rtol=3e-2, atol=3e-2)


# Slow: a whole-sequence window is block-sparse like the gathered keys; the sinks' columns
# ride the chunks as the global columns do (~10 s each).
SPARSE_CASES = [
  pytest.param("whole_sequence_window", patterns.sliding_window(5), 24, marks=pytest.mark.slow),
  ("fixed_gathered_keys", patterns.fixed(8, 2), 24),
  ("banded_chunks", patterns.sliding_window(6, 1), 40),
  pytest.param("sinks_chunks_columns", patterns.sinks_window(3, 5), 40, marks=pytest.mark.slow),
  ("global_rows_chunks", patterns.global_window(2, (4, 4)), 40),
]


@pytest.mark.parametrize(
  "name,pattern,T",
  SPARSE_CASES,
  ids=[
    "whole_sequence_window",
    "fixed_gathered_keys",
    "banded_chunks",
    "sinks_chunks_columns",
    "global_rows_chunks",
  ],
)
def test_sparse_paths_with_modifiers_match_reference(name, pattern, T, monkeypatch):
  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", 2)  # T=40 with blocks of 4 takes the chunk path
  q, k, v = rand_qkv(2, T, T, 4, 2, 8, seed=7)
  ids = (jnp.arange(T)[None, :] // 13 * jnp.ones((2, 1), jnp.int32)).astype(jnp.int32)
  args = (
    jnp.asarray(mods.alibi_slopes(4)),
    0.1 * jnp.asarray(np.random.default_rng(8).standard_normal((T, T), np.float32)),
  )
  kw = dict(
    pattern=pattern, block_size=4, score_mod=_alibi_table, mask_mod=_doc_mask, mask_mod_args=(ids,)
  )
  f = lambda q, k, v, args: sparse.sparse_attention(q, k, v, score_mod_args=args, **kw)
  r = lambda q, k, v, args: sparse.sparse_attention(
    q, k, v, score_mod_args=args, implementation="reference", **kw
  )
  assert_close(
    _value_and_grads(f, q, k, v, args),
    _value_and_grads(r, q, k, v, args),
    name,
    rtol=2e-4,
    atol=2e-4,
  )


def test_qk_norm_and_cosine_take_modifiers():
  q, k, v = rand_qkv(1, 12, 12, 2, 2, 8, seed=2)
  slopes = jnp.asarray(mods.alibi_slopes(2))
  for fn, extra in (
    (attnjax.qk_norm_attention, {}),
    (attnjax.cosine_attention, dict(temperature=jnp.full((2,), 2.0))),
  ):
    got = fn(
      q, k, v, score_mod=mods.alibi, score_mod_args=(slopes,), mask_mod=mods.causal_mask, **extra
    )
    plain = fn(q, k, v, is_causal=True, **extra)
    assert np.abs(np.asarray(got - plain)).max() > 1e-3  # the modifier changed something
    want = fn(
      q,
      k,
      v,
      score_mod=mods.alibi,
      score_mod_args=(slopes,),
      is_causal=True,
      implementation="blockwise",
      **extra,
    )
    assert_close(got, want, fn.__name__, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Validation.


def test_closing_over_a_traced_array_raises():
  q, k, v = rand_qkv(1, 8, 8, 2, 2, 4)

  @jax.jit
  def bad(q, slopes):
    return attnjax.dot_product_attention(q, k, v, score_mod=lambda z, b, n, i, j: z + slopes[n])

  with pytest.raises(ValueError, match="closes over a traced array.*score_mod_args"):
    bad(q, jnp.ones(2))

  @jax.jit
  def bad_global(q, slopes):
    def mod(z, b, n, i, j, scale=slopes):  # hidden in a default, seen in the jaxpr
      return z * scale[n]

    return attnjax.dot_product_attention(q, k, v, score_mod=mod)

  with pytest.raises(ValueError, match="closes over a traced array"):
    bad_global(q, jnp.ones(2))


def test_modifier_validation():
  q, k, v = rand_qkv(1, 8, 8, 2, 2, 4)
  with pytest.raises(ValueError, match="score_mod_args were given"):
    attnjax.dot_product_attention(q, k, v, score_mod_args=(jnp.ones(2),))
  with pytest.raises(TypeError, match="score_mod must be a callable"):
    attnjax.dot_product_attention(q, k, v, score_mod=3)
  with pytest.raises(TypeError, match="mask_mod must return booleans"):
    attnjax.dot_product_attention(
      q, k, v, mask_mod=lambda b, n, i, j: i - j, implementation="reference"
    )
  with pytest.raises(ValueError, match="block_layout .* needs its mask_mod"):
    attnjax.dot_product_attention(
      q, k, v, block_layout=layout.from_mask_mod(mods.causal_mask, 8, 8, 4, 4)
    )
  with pytest.raises(ValueError, match="implementation='xla' does not support score_mod"):
    attnjax.dot_product_attention(q, k, v, score_mod=mods.SoftCap(5.0), implementation="xla")
  inputs, opts = dense.prepare(q, k, v, mask_mod=mods.causal_mask)
  assert "mask_mod" in jax_nn.unsupported(inputs, opts)
  assert opts.score_mod is None and opts.mask_mod is mods.causal_mask


# ---------------------------------------------------------------------------
# Layouts of mask modifiers.


@pytest.mark.parametrize(
  "name,mod,pattern",
  [
    ("causal", mods.causal_mask, patterns.causal()),
    ("window", mods.sliding_window_mask(5, 2), patterns.sliding_window(5, 2)),
    ("bigbird", None, patterns.bigbird(4, 1, 1, 1, seed=0)),
  ],
  ids=["causal", "window", "bigbird"],
)
def test_from_mask_mod_equals_the_rule_layout(name, mod, pattern):
  T = 40
  mod = mods.pattern_mask(pattern, T, T) if mod is None else mod
  got = layout.from_mask_mod(mod, T, T, 8, 8)
  want = layout.rule_layout(pattern, T, T, 8)
  np.testing.assert_array_equal(layout.kept_blocks(got), layout.kept_blocks(want))
  np.testing.assert_array_equal(layout.full_blocks(got), layout.full_blocks(want))


def test_from_mask_mod_per_head_and_batch_and_reuse():
  ids = np.repeat(np.arange(4), 8)[None, :]  # four documents of 8 in a row of 32

  def mod(b, n, i, j, ids):
    return jnp.logical_and(ids[b, i] == ids[b, j], n == 0) | jnp.logical_and(n == 1, j <= i)

  lay = layout.from_mask_mod(mod, 32, 32, 8, 8, jnp.asarray(ids), heads=2)
  kept = layout.kept_blocks(lay)
  np.testing.assert_array_equal(kept, np.tril(np.ones((4, 4), bool)))  # union over heads
  assert not layout.full_blocks(lay).any()  # no block is full for both heads
  q, k, v = rand_qkv(1, 32, 32, 2, 2, 4, seed=3)
  kw = dict(mask_mod=mod, mask_mod_args=(jnp.asarray(ids),))
  got = attnjax.dot_product_attention(q, k, v, implementation="blockwise", block_layout=lay, **kw)
  want = attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
  assert_close(got, want, "layout reuse", rtol=1e-5, atol=1e-5)


def test_mask_mod_blocks_are_skipped_and_full_blocks_unmasked(monkeypatch):
  # A window as a mask_mod visits the same blocks as window=, and never
  # evaluates the modifier on a full block.
  calls = []
  real = blockwise.run_layout
  monkeypatch.setattr(
    blockwise, "run_layout", lambda *a, **kw: calls.append(kw["layout"]) or real(*a, **kw)
  )
  q, k, v = rand_qkv(1, 64, 64, 2, 2, 4)
  got = blockwise._attention(q, k, v, block_q=8, block_k=8, mask_mod=mods.sliding_window_mask(8))
  want = blockwise._attention(q, k, v, block_q=8, block_k=8, window=(8, 0))
  assert_close(got, want, "window", rtol=1e-5, atol=1e-5)
  assert calls[0].num_pairs == calls[1].num_pairs < 64
  np.testing.assert_array_equal(layout.full_blocks(calls[0]), layout.full_blocks(calls[1]))


def test_layout_intersect_checks_geometry():
  a = layout.structural_layout(16, 16, 8, 8, is_causal=True)
  b = layout.from_mask_mod(mods.sliding_window_mask(3), 16, 16, 4, 4)
  with pytest.raises(ValueError, match="different geometry"):
    layout.intersect(a, b)
  both = layout.intersect(a, layout.from_mask_mod(mods.sliding_window_mask(3), 16, 16, 8, 8))
  assert both.num_pairs == 3


def test_modifier_factories_are_hashable_and_equal_by_value():
  assert mods.sliding_window_mask(4) == mods.sliding_window_mask(4)
  assert hash(mods.t5_relative_bias(32, 64)) == hash(mods.t5_relative_bias(32, 64))
  q, k, v = rand_qkv(1, 8, 8, 2, 2, 4)

  class Unhashable:
    def __eq__(self, other):
      return self is other

    def __call__(self, b, n, i, j):
      return j <= i

  with pytest.raises(TypeError, match="mask_mod must be hashable"):
    dense.prepare(q, k, v, mask_mod=Unhashable())


# ---------------------------------------------------------------------------
# nn: alibi, relative_bias, score_mod, mask_mod fields.


def _layer(seed=0, **fields):
  from flax import nnx
  from attnjax import nn

  cfg = nn.AttentionConfig("dense", num_heads=4, **fields)
  return nn.Attention(cfg, 16, rngs=nnx.Rngs(seed))


def test_nn_alibi_turns_rope_off_and_changes_the_output():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 16)), jnp.float32)
  with_rope = _layer(alibi=True)(x)
  without = _layer(alibi=True, rope_theta=None)(x)
  assert_close(with_rope, without, "rope ignored under alibi", rtol=1e-6, atol=1e-6)
  plain = _layer(rope_theta=None)(x)
  assert np.abs(np.asarray(plain - without)).max() > 1e-4


def test_nn_relative_bias_owns_a_learned_table_and_mask_mod():
  from flax import nnx

  x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 12, 16)), jnp.float32)
  layer = _layer(relative_bias=True, relative_buckets=8, relative_max_distance=16)
  assert layer.relative_bias_table[...].shape == (8, 4)
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
  assert np.abs(np.asarray(grads.relative_bias_table[...])).max() > 0
  # mask_mod=causal on a non-causal layer equals the causal layer.
  a = _layer(is_causal=False, mask_mod=mods.causal_mask)(x)
  b = _layer(is_causal=True)(x)
  assert_close(a, b, "mask_mod causal", rtol=1e-5, atol=1e-5)
  c = _layer(score_mod=mods.SoftCap(0.5))(x)
  assert np.abs(np.asarray(c - b)).max() > 1e-4
  from attnjax._src.train import variants

  assert variants.attention_kwargs("alibi") == {"family": "dense", "alibi": True}


# ---------------------------------------------------------------------------
# Forward-mode autodiff through the block-wise and sparse kernels.


def _fwd_cases():
  slopes = jnp.asarray(mods.alibi_slopes(4))
  blockwise_fn = lambda q, k, v, s: blockwise.attention(
    q,
    k,
    v,
    block_q=8,
    block_k=8,
    is_causal=True,
    score_mod=mods.alibi,
    score_mod_args=(s,),
    mask_mod=mods.sliding_window_mask(9),
    normalizer="softmax_one",
  )
  sparse_fn = lambda q, k, v, s: sparse.sparse_attention(
    q,
    k,
    v,
    pattern=patterns.sliding_window(9),
    block_size=8,
    score_mod=mods.alibi,
    score_mod_args=(s,),
    normalizer="softmax_one",
  )
  reference = lambda q, k, v, s: attnjax.dot_product_attention(
    q,
    k,
    v,
    is_causal=True,
    score_mod=mods.alibi,
    score_mod_args=(s,),
    mask_mod=mods.sliding_window_mask(9),
    normalizer="softmax_one",
    implementation="reference",
  )
  return slopes, {"blockwise": blockwise_fn, "sparse": sparse_fn}, reference


@pytest.mark.parametrize("path", ["blockwise", "sparse"])
def test_jvp_and_linearize_match_the_reference(path):
  q, k, v = rand_qkv(1, 32, 32, 4, 2, 8, seed=12)
  tq, tk, tv = rand_qkv(1, 32, 32, 4, 2, 8, seed=13)
  slopes, fns, reference = _fwd_cases()
  primals, tangents = (q, k, v, slopes), (tq, tk, tv, jnp.ones_like(slopes))
  want = jax.jvp(reference, primals, tangents)
  got = jax.jit(lambda p, t: jax.jvp(fns[path], p, t))(primals, tangents)
  assert_close(got, want, "jvp", rtol=1e-4, atol=1e-4)
  _, lin = jax.linearize(fns[path], *primals)
  assert_close(lin(*tangents), want[1], "linearize", rtol=1e-4, atol=1e-4)
  # Reverse mode still runs the hand-written backward (its gradient equals the reference's).
  loss = lambda f: lambda *p: jnp.sum(jnp.sin(f(*p)))
  assert_close(
    jax.grad(loss(fns[path]), argnums=(0, 1, 2, 3))(*primals),
    jax.grad(loss(reference), argnums=(0, 1, 2, 3))(*primals),
    "grad",
    rtol=1e-4,
    atol=1e-4,
  )


def test_reverse_mode_saves_no_probability_tiles():
  # The linearised program keeps O(T) residuals: no [.., T, S]-sized tile per visit.
  q, k, v = rand_qkv(1, 64, 64, 2, 2, 8, seed=1)
  f = lambda q: jnp.sum(
    blockwise.attention(q, k, v, block_q=8, block_k=8, score_mod=mods.SoftCap(5.0))
  )
  _, f_vjp = jax.vjp(f, q)
  sizes = [np.size(x) for x in jax.tree.leaves(f_vjp)]
  # In all, a few q/k/v-sized arrays (64 * 2 * 8 each) and per-row terms: a saved 8 x 8
  # probability tile per visited block (36 visits * 2 heads * 64) would add 4608.
  assert sum(sizes) <= 8 * 64 * 2 * 8, sizes  # today 6 * 1024 + 128


def test_a_mask_mod_that_branches_on_traced_indices_gets_a_clear_error():
  q, k, v = rand_qkv(1, 16, 16, 2, 2, 8, seed=1)

  def bad(b, n, i, j):
    return j <= i and i > 2  # Python `and` on traced indices

  with pytest.raises(TypeError, match="mask_mod failed on a trial call"):
    attnjax.dot_product_attention(q, k, v, mask_mod=bad)


@pytest.mark.parametrize("path", ["blockwise", pytest.param("sparse", marks=pytest.mark.slow)])
def test_hessian_vector_products_both_orders(path):  # sparse: slow; its jvp runs by default
  q, k, v = rand_qkv(1, 24, 24, 4, 2, 8, seed=14)
  tq = rand_qkv(1, 24, 24, 4, 2, 8, seed=15)[0]
  slopes, fns, reference = _fwd_cases()

  def loss(f):
    return lambda q, s: jnp.sum(jnp.sin(f(q, k, v, s)))

  def fwd_over_rev(f):
    return jax.jvp(jax.grad(loss(f), argnums=(0, 1)), (q, slopes), (tq, jnp.ones_like(slopes)))[1]

  def rev_over_fwd(f):
    g = lambda q, s: jax.jvp(loss(f), (q, s), (tq, jnp.ones_like(slopes)))[1]
    return jax.grad(g, argnums=(0, 1))(q, slopes)

  assert_close(
    jax.jit(lambda: fwd_over_rev(fns[path]))(),
    jax.jit(lambda: fwd_over_rev(reference))(),
    "jvp of grad",
    rtol=2e-4,
    atol=2e-4,
  )
  assert_close(
    jax.jit(lambda: rev_over_fwd(fns[path]))(),
    jax.jit(lambda: rev_over_fwd(reference))(),
    "grad of jvp",
    rtol=2e-4,
    atol=2e-4,
  )


def test_vmap_of_grad_and_grad_of_vmap():
  q, k, v = rand_qkv(1, 16, 16, 2, 2, 8, seed=16)
  f = lambda q: blockwise.attention(
    q, k, v, block_q=8, block_k=8, is_causal=True, score_mod=mods.SoftCap(2.0)
  )
  r = lambda q: attnjax.dot_product_attention(
    q, k, v, is_causal=True, implementation="reference", score_mod=mods.SoftCap(2.0)
  )
  qs = jnp.stack([q, 2.0 * q])
  loss = lambda f: lambda q: jnp.sum(jnp.sin(f(q)))
  assert_close(
    jax.vmap(jax.grad(loss(f)))(qs),
    jax.vmap(jax.grad(loss(r)))(qs),
    "vmap(grad)",
    rtol=1e-4,
    atol=1e-4,
  )
  both = lambda f: lambda qs: jnp.sum(jnp.sin(jax.vmap(f)(qs)))
  assert_close(jax.grad(both(f))(qs), jax.grad(both(r))(qs), "grad(vmap)", rtol=1e-4, atol=1e-4)
  assert_close(
    jax.vmap(lambda q, t: jax.jvp(f, (q,), (t,))[1])(qs, qs),
    jax.vmap(lambda q, t: jax.jvp(r, (q,), (t,))[1])(qs, qs),
    "vmap(jvp)",
    rtol=1e-4,
    atol=1e-4,
  )


def test_in_call_layout_evaluates_batch_and_heads_only_when_read():
  assert blockwise.index_use(mods.causal_mask, ()) == (False, False)
  assert blockwise.index_use(mods.prefix_lm_mask, (jnp.zeros(2, jnp.int32),)) == (True, False)
  assert blockwise.index_use(lambda b, n, i, j: n == i, ()) == (False, True)


def test_run_time_mask_mod_table_joins_segment_ids():
  # Both classified at run time: a block is skipped if either skips it, unmasked if both allow it.
  T = 32
  q, k, v = rand_qkv(2, T, T, 2, 2, 8, seed=8)
  seg = jnp.stack([jnp.arange(T) // 16, jnp.arange(T) // 12]).astype(jnp.int32)
  ids = jnp.stack([jnp.arange(T) // 8, jnp.arange(T) // 24]).astype(jnp.int32)
  kw = dict(segment_ids=seg, is_causal=True, mask_mod=_doc_mask, mask_mod_args=(ids,))
  f = lambda q, k, v, a: blockwise.attention(q, k, v, block_q=8, block_k=8, **kw)
  r = lambda q, k, v, a: attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
  assert_close(
    _value_and_grads(f, q, k, v, ()),
    _value_and_grads(r, q, k, v, ()),
    "joined",
    rtol=1e-4,
    atol=1e-4,
  )
