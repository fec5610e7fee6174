"""The Pallas TPU kernel (``implementation="pallas_tpu"``) in interpret mode against the reference.

Interpret mode runs the Mosaic kernel bodies (forward, count pass, dq, dk/dv)
as jax operations on the CPU, so these checks cover the kernels' logic (block
tables, run-time skips, the online normalisers, the FA2 backward), not Mosaic's
compilation (``tests/test_targets.py`` compiles them for v5e / v6e) or speed.
The lengths (T=200, S=328) are not multiples of the blocks (forward 128 x 128,
backward 128 x 256), and most calls use GQA (4 query heads on 2 key/value
heads). The value / gradient cases come from the engine test base
(``tests/engine_base.py``): softmax and sigmoid over {causal, window, segments,
bidirectional, mask_mod, modifiers with arguments} by default (the gradients of q, k,
v, sink logits and score_mod arguments), the cross product of every normaliser,
structure, GQA / MHA and dtype under ``slow``.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax._src import mods
from attnjax._src.kernels import pallas_tpu
from attnjax._src.kernels.pallas_tpu import kernel as tpu_kernel
from attnjax._src.kernels.pallas_tpu import plan
from attnjax._src.kernels.pallas_tpu.plan import FULL, MASKED, SKIP
from engine_base import DenseEngineTests, alibi_per_head
from helpers import rand_qkv, run_kernel

BLOCKS = pallas_tpu.BlockSizes(block_q=128, block_k=128, block_q_bwd=128, block_k_bwd=256)
T, S = 200, 328


class TestPallasTpu(DenseEngineTests):
  """Causal, window, packed segments, bidirectional, a mask_mod with a score_mod, and
  modifiers with arguments (their gradients checked); GQA and MHA; float32 and bfloat16."""

  name = "pallas_tpu"
  T, S = T, S
  structures = ("causal", "segments", "window", "bidirectional", "mask_mod", "mod_args")
  segment_cuts = (90, 150)

  def run(self, inputs, opts):
    return run_kernel(pallas_tpu, inputs, opts, interpret=True, block_sizes=BLOCKS)


def test_block_tables_skip_blocks_and_drop_masks():
  # Causal, T = S = 1024, 128 x 128 blocks: 36 of the 64 block pairs are visited (the lower
  # triangle), the 8 diagonal ones masked, the 28 below it without an element mask; each query
  # block's grid row has 8 steps, the padding steps SKIP and fetching the last visited block.
  q, k, v = rand_qkv(B=1, T=1024, S=1024, N=2, K=1, H=8)
  inputs, opts = dense.prepare(q, k, v, is_causal=True)
  c = tpu_kernel.make_plan(inputs, opts, BLOCKS, True)
  t = tpu_kernel.tables_of(c, inputs, opts, 128, 128)
  assert t.kv_count.tolist() == list(range(1, 9)) and t.kv_index.shape == (8, 8)
  assert int(np.sum(t.kinds == MASKED)) == 8 and int(np.sum(t.kinds == FULL)) == 28
  kind, fetch = plan.visit_tables(
    plan.run_time_kinds(t.kinds, None), t.kv_index, t.kv_count, transpose=False
  )
  kind, fetch = np.asarray(kind), np.asarray(fetch)
  assert kind[0].tolist() == [MASKED] + [SKIP] * 7 and fetch[0].tolist() == [0] * 8
  assert kind[3].tolist() == [FULL] * 3 + [MASKED] + [SKIP] * 4
  # The dk/dv tables are the transpose: key block 2 is visited by query blocks 2..7.
  assert t.q_index[2][: t.q_count[2]].tolist() == [2, 3, 4, 5, 6, 7]
  # A window (256, 0): rows visit at most 3 key blocks; a chunked mask_mod keeps its chunks only.
  inputs, opts = dense.prepare(q, k, v, window=(256, 0))
  c = tpu_kernel.make_plan(inputs, opts, BLOCKS, True)
  assert tpu_kernel.tables_of(c, inputs, opts, 128, 128).kv_count.max() == 3
  inputs, opts = dense.prepare(q, k, v, mask_mod=mods.chunked_mask(256))
  c = tpu_kernel.make_plan(inputs, opts, BLOCKS, True)
  t = tpu_kernel.tables_of(c, inputs, opts, 128, 128)
  assert t.kv_count.tolist() == [1, 2] * 4 and int(np.sum(t.kinds == FULL)) == 4


def test_segments_skip_blocks_at_run_time():
  # Four packed documents of 256 tokens: a query block never meets another document's keys, so
  # every block pair across documents is SKIP at run time (no copy: fetch repeats), and pairs
  # inside one document (one id on both sides) run without an element mask.
  q, k, v = rand_qkv(B=1, T=1024, S=1024, N=2, K=1, H=8)
  ids = jnp.repeat(jnp.arange(4), 256)[None]
  inputs, opts = dense.prepare(q, k, v, segment_ids=ids)
  c = tpu_kernel.make_plan(inputs, opts, BLOCKS, True)
  t = tpu_kernel.tables_of(c, inputs, opts, 128, 128)
  kinds = np.asarray(plan.run_time_table(c, t, ids, ids, 128, 128))
  assert int(np.sum(kinds != SKIP)) == 16 and int(np.sum(kinds == FULL)) == 16
  kind, fetch = plan.visit_tables(jnp.asarray(kinds), t.kv_index, t.kv_count, transpose=False)
  kind, fetch = np.asarray(kind), np.asarray(fetch)
  assert kind[2].tolist() == [SKIP, SKIP, FULL, FULL] + [SKIP] * 4
  assert fetch[2].tolist() == [2, 2, 2, 3, 3, 3, 3, 3]
  out = run_kernel(pallas_tpu, inputs, opts, interpret=True, block_sizes=BLOCKS)
  np.testing.assert_allclose(out, dense.reference(inputs, opts), atol=2e-5, rtol=2e-5)


def test_pallas_tpu_lists_what_it_cannot_do():
  q, k, v = rand_qkv(T=8)
  assert pallas_tpu.unsupported(*dense.prepare(q, k, v, is_causal=True)) == []
  reasons = pallas_tpu.unsupported(
    *dense.prepare(
      q,
      k,
      v,
      bias=jnp.zeros((1, 1, 8, 8)),
      mask=jnp.ones((1, 1, 8, 8), bool),
      similarity="neg_sq_euclidean",
    )
  )
  assert len(reasons) == 3 and "bias" in reasons[0] and "mask" in reasons[1], reasons
  # Modifier arguments are SMEM tables read by scalar index: ALiBi's slopes[n] runs in the
  # kernel; T5's table[bucket(i - j), n] (a gather) and document ids doc[b, i] do not.
  slopes = jnp.asarray(mods.alibi_slopes(q.shape[2]))
  assert (
    pallas_tpu.unsupported(*dense.prepare(q, k, v, score_mod=mods.alibi, score_mod_args=(slopes,)))
    == []
  )
  t5 = mods.t5_relative_bias(num_buckets=8, max_distance=16)
  reasons = pallas_tpu.unsupported(
    *dense.prepare(q, k, v, score_mod=t5, score_mod_args=(jnp.zeros((8, q.shape[2])),))
  )
  assert len(reasons) == 1 and "scalar index" in reasons[0], reasons
  reasons = pallas_tpu.unsupported(
    *dense.prepare(
      q, k, v, mask_mod=mods.document_mask, mask_mod_args=(jnp.zeros((1, 8), jnp.int32),)
    )
  )
  assert len(reasons) == 1 and "mask_mod" in reasons[0], reasons
  inputs, opts = dense.prepare(q, k, v)
  assert any(
    "dtypes" in r
    for r in pallas_tpu.unsupported(dataclasses.replace(inputs, v=v.astype(jnp.bfloat16)), opts)
  )
  assert any(
    "dtypes" in r
    for r in pallas_tpu.unsupported(
      *dense.prepare(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16))
    )
  )
  with pytest.raises(ValueError, match="pallas_tpu' does not support bias"):
    attnjax.dot_product_attention(
      q, k, v, bias=jnp.zeros((1, 1, 8, 8)), implementation="pallas_tpu"
    )
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_tpu.BlockSizes(block_q=96)
  with pytest.raises(ValueError, match="runs on a TPU only"):
    attnjax.dot_product_attention(q, k, v, implementation="pallas_tpu")


def test_modifiers_reading_batch_and_head_inside_shard_map():
  # Under a (data 2, tensor 2) mesh the kernel runs per shard; a modifier reading b and n sees
  # the whole call's indices (per_shard passes the shard's offsets), as the unsharded reference
  # does, in the forward and in the backward kernels (the offsets are an input of the kernel's
  # custom VJP, so its backward, traced after the shard_map's body, reads them too).
  auto = jax.sharding.AxisType.Auto  # (interpret-mode Pallas refuses explicitly sharded refs)
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(auto, auto))
  q, k, v = rand_qkv(B=2, T=T, S=T, N=4, K=2, H=16)
  args = (jnp.asarray(mods.alibi_slopes(4)), jnp.arange(8, dtype=jnp.float32).reshape(2, 4))
  kw = dict(is_causal=True, score_mod=alibi_per_head, score_mod_args=args)

  def loss(impl, q, k, v):
    inputs, opts = dense.prepare(q, k, v, **kw)
    if impl == "reference":
      out = dense.reference(inputs, opts)
    else:  # the engine runner runs it per shard (attnjax._src.sharding.per_shard)
      out = run_kernel(pallas_tpu, inputs, opts, interpret=True, block_sizes=BLOCKS)
    return jnp.sum(out * jnp.cos(out)), out

  if len(jax.devices()) < 4:
    pytest.skip("needs 4 devices (the suite's CPU backend has 8)")
  grad = lambda impl: jax.jit(
    jax.value_and_grad(functools.partial(loss, impl), (0, 1, 2), has_aux=True)
  )(q, k, v)
  want = grad("reference")
  with jax.set_mesh(mesh):
    got = grad("pallas_tpu")
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


@pytest.mark.usefixtures("all_kernels")
def test_tpu_dispatch_takes_splash_then_pallas_tpu_then_blockwise():
  def choice(T_, **kw):
    q, k, v = rand_qkv(T=T_, N=4, K=2)
    return dense.dispatch_table(*dense.prepare(q, k, v, **kw))["tpu"]

  assert choice(256, is_causal=True) == "splash"
  assert choice(200, is_causal=True) == "pallas_tpu"  # splash needs multiples of 128
  assert choice(256, normalizer="sigmoid", return_stats=True) == "pallas_tpu"
  assert choice(256, normalizer="softpick", mask_mod=mods.sliding_window_mask(64)) == "pallas_tpu"
  assert choice(256, normalizer="relu", bias=jnp.zeros((1, 1, 256, 256))) == "blockwise"


def test_pallas_tpu_rows_without_keys_and_the_entry_point():
  # Rows 105.. of a causal window (5, 0) over 100 keys see no key: zero rows, zero gradients.
  q, k, v = rand_qkv(B=1, T=170, S=100, N=2, K=1, H=8)
  kw = dict(is_causal=True, window=(5, 0), normalizer="sigmoid")

  def loss(fn, q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out * jnp.cos(out)), out

  tpu = lambda q, k, v: pallas_tpu.attention(q, k, v, interpret=True, block_sizes=BLOCKS, **kw)
  ref = lambda q, k, v: attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
  grad = lambda fn: jax.value_and_grad(lambda *a: loss(fn, *a), (0, 1, 2), has_aux=True)(q, k, v)
  (_, got), g_got = grad(tpu)
  (_, want), g_want = grad(ref)
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  for name, a, b in zip("qkv", g_got, g_want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
  assert not np.any(np.asarray(got[:, 105:]))


def test_a_mask_mod_layout_built_for_other_blocks_on_a_short_call():
  # T = 12 < the 128-row tile: a block_layout from from_mask_mod (its blocks clamped to 12) is
  # the same single block; the kernel uses it (auto-dispatch traces this TPU branch on any host).
  q, k, v = rand_qkv(B=1, T=12, S=12, N=2, K=1, H=8)
  mod = mods.sliding_window_mask(3)
  lay = attnjax.layout.from_mask_mod(mod, 12, 12, 128, 128)
  inputs, opts = dense.prepare(q, k, v, mask_mod=mod, block_layout=lay, normalizer="sigmoid")
  out = run_kernel(pallas_tpu, inputs, opts, interpret=True)
  np.testing.assert_allclose(out, dense.reference(inputs, opts), atol=2e-5, rtol=2e-5)
