"""The block-wise dense path equals the reference in value, statistics and gradient.

Small shapes with small blocks, so every case has several query and key blocks,
ragged edge blocks, diagonal (masked) and interior (unmasked) blocks.
"""

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax._src import layout
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.kernels.blockwise import tiles
from engine_base import DenseEngineTests
from helpers import assert_close

FIELDS = ("sink_mass", "entropy", "max_logit", "logsumexp", "row_sum")


def _arrays(B, T, S, N, K, H, dtype=jnp.float32, seed=0):
  # numpy draws: no per-shape compilation of jax.random.
  rng = np.random.default_rng(seed)
  q, k, v = (
    rng.standard_normal(shape, np.float32) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H))
  )
  keys = jax.random.split(jax.random.key(seed), 3)
  return jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), keys


def _segments(B, L, cuts):
  ids = np.zeros((B, L), np.int32)
  for b in range(B):
    for c in cuts[b % len(cuts)]:
      ids[b, c:] += 1
  return jnp.asarray(ids)


def _loss_and_stats(fn, q, k, v, extra, kwargs):
  """Scalar loss touching the output and the logsumexp statistic, plus (out, stats) as aux."""

  def loss(q, k, v, extra):
    out, stats = fn(q, k, v, return_stats=True, **extra, **kwargs)
    out32 = out.astype(jnp.float32)
    value = jnp.sum(out32 * jnp.cos(out32)) + jnp.sum(jnp.sin(stats.logsumexp))
    return value, (out, stats)

  # One jit around value and gradient: one compilation per case.
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (_, aux), grads = step(q, k, v, extra)
  return aux, grads


def _reference(q, k, v, **kw):
  return attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)


def _blockwise(block_q, block_k):
  def fn(q, k, v, **kw):
    return blockwise.attention(q, k, v, block_q=block_q, block_k=block_k, **kw)

  return fn


def _compare(q, k, v, extra, kwargs, *, block_q=16, block_k=16, tol=2e-5):
  (out_r, st_r), g_r = _loss_and_stats(_reference, q, k, v, extra, kwargs)
  (out_b, st_b), g_b = _loss_and_stats(_blockwise(block_q, block_k), q, k, v, extra, kwargs)
  assert out_b.dtype == q.dtype and out_b.shape == out_r.shape
  assert_close(out_b, out_r, "output", rtol=tol, atol=tol, scaled=True)
  for f in FIELDS:
    assert_close(getattr(st_b, f), getattr(st_r, f), f"stats.{f}", rtol=tol, atol=tol, scaled=True)
  names = ("dq", "dk", "dv")
  for name, a, b in zip(names, g_b[:3], g_r[:3]):
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert_close(a, b, name, rtol=tol, atol=tol, scaled=True)
  for name in g_r[3]:
    assert_close(g_b[3][name], g_r[3][name], f"d{name}", rtol=tol, atol=tol, scaled=True)


B, N, H = 2, 4, 8


class TestBlockwise(DenseEngineTests):
  """Causal, packed segments, window, a mask_mod with a score_mod, modifiers with arguments;
  GQA and MHA; float32 and bfloat16; every normaliser once (the normaliser seam). Blocks of
  16, so the 40 x 72 calls have ragged, diagonal and interior blocks; every unmasked
  full-size key block goes through the loop (no unrolled visits)."""

  name = "blockwise"
  structures = ("causal", "segments", "window", "mask_mod", "mod_args")
  every_normaliser = True
  # softpick's gradient divides by sum |e^z - 1|, which amplifies float32 rounding
  tolerance = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}

  @pytest.fixture(autouse=True)
  def _loop_visits(self, monkeypatch):
    monkeypatch.setattr(blockwise, "MAX_UNROLLED_FULL_VISITS", 0)

  def run(self, inputs, opts):
    return blockwise.run(inputs, opts, block_q=16, block_k=16)


# What the engine test base does not build: dense masks and biases, T > S with rows that see
# no key, another similarity, and the rolled query loop.
CASES = {
  # id: (T, S, K, kwargs, extra-builder)
  "softmax-causal-gqa-ragged": (37, 37, 2, dict(is_causal=True), None),
  "sink_logits-causal-segments": (40, 40, 2, dict(is_causal=True), "sink+segments"),
  "sigmoid-window-mask": (35, 35, 4, dict(window=(6, 3), normalizer="sigmoid"), "mask"),
  "sigmoid-T<S-bias-softcap": (20, 45, 2, dict(normalizer="sigmoid", softcap=2.0), "bias_key"),
  "softmax-bias-full-causal": (29, 29, 2, dict(is_causal=True), "bias_full"),
  "softmax-T>S-causal-window-empty-rows": (45, 20, 2, dict(is_causal=True, window=(3, 0)), None),
  "softmax-neg_sq_euclidean-causal": (
    33,
    33,
    2,
    dict(is_causal=True, similarity="neg_sq_euclidean"),
    None,
  ),
  "sigmoid-segments-window": (36, 36, 2, dict(window=(7, 1), normalizer="sigmoid"), "segments"),
}
# Unrolled: the cases the base does not cover; rolled: GQA and ragged, segments with a window
# and sinks, T < S with a bias. Every case both ways under -m slow.
UNROLLED_DEFAULT = (
  "sigmoid-window-mask",
  "sigmoid-T<S-bias-softcap",
  "softmax-bias-full-causal",
  "softmax-T>S-causal-window-empty-rows",
  "softmax-neg_sq_euclidean-causal",
)
ROLLED_DEFAULT = (
  "softmax-causal-gqa-ragged",
  "sigmoid-segments-window",
  "sigmoid-T<S-bias-softcap",
  "sink_logits-causal-segments",
)


def _extra(kind, keys, T, S):
  if kind is None:
    return {}
  out = {}
  if "sink" in kind:
    out["sink_logits"] = jnp.linspace(-1.0, 1.5, N)
  if "segments" in kind:
    seg = _segments(B, T, [[9, 25], [17]])
    out["segment_ids"] = seg if T == S else (seg, _segments(B, S, [[9, 25], [17]]))
  if kind == "mask":
    out["mask"] = jax.random.bernoulli(keys[0], 0.7, (B, 1, T, S))
  if kind == "bias_full":
    out["bias"] = jax.random.normal(keys[1], (B, N, T, S))
  if kind == "bias_key":
    out["bias"] = jax.random.normal(keys[1], (1, N, 1, S))
  return out


@pytest.mark.parametrize(
  "case,q_loop",
  [
    pytest.param(
      case,
      q_loop,
      id=f"{case}-{q_loop}",
      marks=[]
      if case in (ROLLED_DEFAULT if q_loop == "rolled" else UNROLLED_DEFAULT)
      else [pytest.mark.slow],
    )
    for q_loop in ("unrolled", "rolled")
    for case in CASES
  ],
)
def test_special_cases_match_reference(case, q_loop, monkeypatch):
  # Loop over every unmasked full-size key block, so both the fori_loop and the unrolled
  # (masked, ragged) visits are exercised; "rolled" runs the full-size query blocks in the
  # lax.scan over a traced block index (a ragged last block stays unrolled).
  monkeypatch.setattr(blockwise, "MAX_UNROLLED_FULL_VISITS", 0)
  monkeypatch.setattr(blockwise, "MAX_UNROLLED_Q_BLOCKS", 0 if q_loop == "rolled" else 10**6)
  T, S, K, kwargs, kind = CASES[case]
  q, k, v, keys = _arrays(B, T, S, N, K, H)
  extra = _extra(kind, keys, T, S)
  for name in ("segment_ids", "mask"):  # not differentiable: pass them as options
    if name in extra:
      kwargs = dict(kwargs, **{name: extra.pop(name)})
  _compare(q, k, v, extra, kwargs)


def test_one_key_value_head_for_eight_query_heads():
  # the base runs 4 query heads on 2 key/value heads and 2 on 2; here MQA
  q, k, v, _ = _arrays(1, 40, 40, 8, 1, 8)
  _compare(q, k, v, {}, dict(is_causal=True))


def test_empty_rows_are_zero_with_finite_gradients():
  T = 24
  q, k, v, _ = _arrays(1, T, T, 2, 2, 8)
  mask = jnp.ones((1, 1, T, T), bool).at[:, :, 5:9, :].set(False)
  fn = _blockwise(8, 8)
  for nz in ("softmax", "sigmoid", "softpick", "none", "relu"):

    def loss(q, k, v, nz=nz):
      out, stats = fn(q, k, v, mask=mask, normalizer=nz, is_causal=True, return_stats=True)
      return jnp.sum(stats.logsumexp) + jnp.sum(out**2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert np.all(np.asarray(out[:, 5:9]) == 0.0), nz
    for g in grads:
      assert np.all(np.isfinite(np.asarray(g))), nz


def test_qk_norm_and_cosine_gradients_through_gains():
  q, k, v, keys = _arrays(1, 40, 40, 4, 2, 8)
  gain = 1.0 + 0.1 * jax.random.normal(keys[0], (8,))
  temp = jnp.full((4,), jnp.log(10.0)) + 0.1 * jnp.arange(4.0)

  def qk_loss(impl):
    return lambda g, q: jnp.sum(
      attnjax.qk_norm_attention(
        q, k, v, norm="rms", q_gain=g, k_gain=g, is_causal=True, implementation=impl
      )
      ** 2
    )

  def cos_loss(impl):
    return lambda t, q: jnp.sum(
      attnjax.cosine_attention(q, k, v, temperature=t, window=(9, 0), implementation=impl) ** 2
    )

  for make, param in ((qk_loss, gain), (cos_loss, temp)):
    ref = jax.jit(jax.grad(make("reference"), argnums=(0, 1)))(param, q)
    blk = jax.jit(jax.grad(make("blockwise"), argnums=(0, 1)))(param, q)
    for a, b in zip(blk, ref):
      assert_close(a, b, make.__name__, rtol=2e-5, atol=2e-5, scaled=True)


def test_custom_layout_and_mask_fn_equal_the_masked_reference():
  """The interface the block-sparse path uses: its own layout and mask callback."""
  T, bq, bk = 48, 16, 8
  q, k, v, _ = _arrays(1, T, T, 4, 2, 8)
  # Each query block sees key block 0 (partly: even keys only) and its own diagonal blocks.
  visits = [
    [(0, True)] + [(j, True) for j in range(2 * i, 2 * i + 2) if j != 0] for i in range(T // bq)
  ]
  lay = layout.BlockLayout.from_visits(T, T, bq, bk, visits)

  def mask_fn(qp, kp):
    block_ok = (kp[None, :] // bk == 0) | (kp[None, :] // 16 == qp[:, None] // 16)
    return ((kp[None, :] % 2 == 0) | (kp[None, :] >= bk)) & block_ok

  dense_mask = mask_fn(jnp.arange(T), jnp.arange(T))[None, None]
  inputs, opts = dense.prepare(q, k, v, return_stats=True)
  out, stats = blockwise.run_layout(
    inputs, opts, layout=lay, mask_fn=lambda qp, kp: mask_fn(qp, kp)[None, None]
  )
  ref_out, ref_stats = _reference(q, k, v, mask=dense_mask, return_stats=True)
  assert_close(out, ref_out, "output", rtol=2e-5, atol=2e-5, scaled=True)
  for f in FIELDS:
    assert_close(getattr(stats, f), getattr(ref_stats, f), f, rtol=2e-5, atol=2e-5, scaled=True)
  idx, flag = lay.as_arrays()
  assert idx.shape == (3, 3) and idx[0, 2] == -1 and lay.num_pairs == 8


def _count_dots(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args)
  count = 0

  def walk(jp):
    nonlocal count
    for eqn in jp.eqns:
      if eqn.primitive.name == "dot_general":
        count += 1
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return count


def test_masked_blocks_are_not_computed(monkeypatch):
  monkeypatch.setattr(blockwise, "MAX_UNROLLED_FULL_VISITS", 10**6)  # every visit unrolled
  q, k, v, _ = _arrays(1, 128, 128, 2, 2, 8)
  full = _count_dots(lambda q, k, v: _blockwise(32, 32)(q, k, v), q, k, v)
  causal = _count_dots(lambda q, k, v: _blockwise(32, 32)(q, k, v, is_causal=True), q, k, v)
  window = _count_dots(lambda q, k, v: _blockwise(32, 32)(q, k, v, window=(8, 0)), q, k, v)
  assert (full, causal, window) == (2 * 16, 2 * 10, 2 * 7)


def test_rolled_query_loop_program_does_not_grow_with_length():
  # Above MAX_UNROLLED_Q_BLOCKS full query blocks the blocks run in one lax.scan: the
  # program (here: its matmuls, forward and backward) is the same for 16 and 32 blocks.
  def dots(T):
    q, k, v, _ = _arrays(1, T, T, 2, 2, 8)
    loss = lambda q, k, v: jnp.sum(_blockwise(16, 16)(q, k, v, is_causal=True))
    return _count_dots(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)

  assert blockwise.MAX_UNROLLED_Q_BLOCKS < 16
  assert dots(16 * 16) == dots(32 * 16)
  assert dots(16 * 16 + 5) == dots(32 * 16 + 5)  # plus the unrolled ragged block's


@pytest.mark.parametrize("order", ["fwd_over_rev", "rev_over_fwd"])
def test_rolled_query_loop_second_order(order, monkeypatch):
  # Hessian-vector products through the rolled kernel in both orders (reverse over forward
  # transposes the forward's loops: their trip counts must be static).
  monkeypatch.setattr(blockwise, "MAX_UNROLLED_Q_BLOCKS", 0)
  q, k, v, _ = _arrays(1, 37, 37, 4, 2, 8)
  tq = _arrays(1, 37, 37, 4, 2, 8, seed=1)[0]
  kw = dict(is_causal=True, window=(9, 0))

  def hvp(f):
    loss = lambda q: jnp.sum(jnp.sin(f(q, k, v, **kw)))
    if order == "fwd_over_rev":
      return jax.jvp(jax.grad(loss), (q,), (tq,))[1]
    return jax.grad(lambda q: jax.jvp(loss, (q,), (tq,))[1])(q)

  assert_close(
    jax.jit(lambda: hvp(_blockwise(8, 8)))(),
    hvp(_reference),
    order,
    rtol=1e-4,
    atol=1e-4,
    scaled=True,
  )


def test_no_full_size_intermediate_in_forward_and_backward():
  T = 256
  q, k, v, _ = _arrays(1, T, T, 2, 2, 8)
  grad = jax.grad(
    lambda q, k, v: jnp.sum(_blockwise(64, 64)(q, k, v, is_causal=True)), argnums=(0, 1, 2)
  )
  jaxpr = jax.make_jaxpr(grad)(q, k, v)
  biggest = 0

  def walk(jp):
    nonlocal biggest
    for eqn in jp.eqns:
      for var in eqn.outvars:
        biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  assert biggest <= 2 * 64 * 64 < 2 * T * T


def test_layout_validation():
  q, k, v, _ = _arrays(1, 8, 8, 2, 2, 4)
  inputs, opts = dense.prepare(q, k, v)
  with pytest.raises(ValueError, match="T=8, S=8"):
    blockwise.run_layout(inputs, opts, layout=layout.structural_layout(16, 8, 4, 4))
  with pytest.raises(ValueError, match="block_q"):
    blockwise.attention(q, k, v, block_q=0)


H200 = 141 * 10**9


def test_gpu_tiles_fit_the_device_budget_and_cpu_tiles_stay():
  # The CPU's tiles do not depend on the call's rows; a TPU, and a GPU call whose rows are not
  # known (a ring step), keep 128 x 128.
  assert blockwise.default_block_sizes(4096, 4096, "cpu", rows=64, is_causal=True) == (512, 256)
  assert blockwise.default_block_sizes(4096, 4096, "cuda") == (128, 128)
  assert blockwise.default_block_sizes(4096, 4096, "gpu") == (128, 128)  # an alias of cuda
  assert blockwise.default_block_sizes(4096, 4096, "tpu", rows=64) == (128, 128)
  # 16,384 tokens, 16 heads on an H200: 36 visits at T=16384 instead of
  # 8,256 with 128 x 128 tiles, 10 instead of 528 at T=4096 (B=4).
  assert tiles.gpu_block_sizes(16384, 16384, 16, H200, is_causal=True) == (2048, 2048)
  assert tiles.gpu_block_sizes(4096, 4096, 64, H200, is_causal=True) == (1024, 1024)
  assert tiles.gpu_block_sizes(65536, 65536, 16, H200, is_causal=True) == (2048, 2048)  # O(1)
  assert tiles.gpu_block_sizes(16384, 16384, 16, 80 * 10**9) == (2048, 1024)
  budget = H200 * tiles.GPU_TILE_FRACTION
  for rows in (1, 3, 16, 64, 4096):
    for T in (100, 1024, 4096, 65536):
      for causal in (False, True):
        bq, bk = tiles.gpu_block_sizes(T, T, rows, H200, is_causal=causal)
        assert (bq, bk) == (128, 128) or rows * bq * bk * 4 <= budget, (rows, T, causal)
        if causal:  # at least 4 blocks a side: diagonal blocks compute <= 1.25x their pairs
          assert bq <= max(128, T // 4) and bk <= max(128, T // 4)
  # A narrow window narrows GPU tiles too.
  assert blockwise.default_block_sizes(16384, 16384, "cuda", rows=16, window=(256, 0)) == (128, 128)


def test_the_old_keyword_backend_still_names_the_platform(monkeypatch):
  from attnjax._src import deprecation

  monkeypatch.setattr(deprecation, "_warned", set())
  with pytest.warns(DeprecationWarning, match=r"backend=\.\.\.\) is deprecated; use .*platform="):
    assert blockwise.default_block_sizes(4096, 4096, backend="cpu") == (512, 256)
  with pytest.raises(TypeError, match="platform="):
    blockwise.default_block_sizes(4096, 4096, "cpu", backend="cpu")


def test_gpu_memory_from_the_kind():
  # A known family's smallest model (the same on the device and in a deviceless compile), else
  # the size the kind names.
  assert tiles.gpu_memory_bytes("NVIDIA H100 80GB HBM3") == 80 * 10**9
  assert tiles.gpu_memory_bytes("NVIDIA A100-SXM4-80GB") == 40 * 10**9
  assert tiles.gpu_memory_bytes("NVIDIA H200") == H200
  assert tiles.gpu_memory_bytes("NVIDIA GH200 480GB") == 96 * 10**9  # 480: with the CPU's
  assert tiles.gpu_memory_bytes("Tesla V100-SXM2-32GB") == 32 * 10**9


def test_tiles_follow_the_ambient_mesh_device():
  # A deviceless compile names its target by the mesh (attnjax.targets); blockwise plans as the
  # device would, whatever this host is.
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    assert tiles.target_platform() == "cuda"
    assert blockwise.default_block_sizes(16384, 16384, rows=16, is_causal=True) == (2048, 2048)
  assert tiles.target_platform() == jax.default_backend()


def test_auto_dispatch_choice():
  backend = jax.default_backend()
  short = dense.prepare(*_arrays(1, 64, 64, 2, 2, 8)[:3], is_causal=True)
  long = dense.prepare(*_arrays(1, dense.BLOCKWISE_MIN_LENGTH_CPU, 8, 2, 2, 8)[:3])
  if backend == "cpu":
    assert dense.select_implementation(*short) == "reference"
    assert dense.select_implementation(*long) == "blockwise"
    stats = dense.prepare(
      *_arrays(1, 2048, 16, 2, 2, 8)[:3], normalizer="softpick", return_stats=True
    )
    assert dense.select_implementation(*stats) == "blockwise"  # no option is dropped
  elif backend == "gpu":
    q, k, v, _ = _arrays(1, 64, 64, 2, 2, 8, dtype=jnp.bfloat16)
    assert dense.select_implementation(*dense.prepare(q, k, v, is_causal=True)) == "cudnn"
    assert (
      dense.select_implementation(*dense.prepare(q, k, v, normalizer="sigmoid")) == "pallas_gpu"
    )


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN needs a GPU")
def test_gpu_auto_dispatch_matches_reference():
  q, k, v, _ = _arrays(2, 256, 256, 8, 2, 64, dtype=jnp.bfloat16)
  out = attnjax.dot_product_attention(q, k, v, is_causal=True)
  ref = _reference(q, k, v, is_causal=True)
  assert_close(out, ref, "cudnn output", rtol=2e-2, atol=2e-2, scaled=True)
