"""The selected-block attention kernels (NSA's selected branch) against a materialised reference.

``attnjax._src.kernels.selected`` runs, per key/value head, each query token over the key
blocks it selected (causal within them) as Pallas TPU and Mosaic GPU kernels, in two loop
orders: query-token-major (NSA) and key-block-major over an inverted index (FSA). Interpret
mode runs the kernel bodies on the CPU: values, the log-normaliser and the gradients of
q, k, v against :func:`reference` below (a ``[T, S]`` mask from the block ids, written from
the definition), with selections that hold -1, out-of-range ids, repeats, blocks that start
after their token and rows with no key at all. The Mosaic GPU backward kernels are called
directly (their interpreter's kernels cannot sit in a custom VJP). The plan's block lists and
inverted index are checked on their own; the deviceless compiles for a TPU v5e and an H200
are under the ``targets`` marker. The cross products are ``slow``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from attnjax._src import normalizers, targets
from attnjax._src.kernels import selected
from attnjax._src.kernels.selected import attention, gpu, plan, tpu, twin
from helpers import reduction_tolerance

NORMS = normalizers.NORMALIZERS
MERGEABLE = tuple(n for n in NORMS if normalizers.REGISTRY[n].mergeable)
# Normalisers with row pre-passes (clipped softmax): every selected-block kernel refuses them
# (test_kernels_refuse_normalisers_with_row_passes).
ROW_PASSES = tuple(n for n in NORMS if normalizers.REGISTRY[n].row_passes)


def reference(q, k, v, block_idx, *, block_size, scale, normalizer):
  """``(out [B, T, N, Hv], lse [B, T, N])`` in float32 from the definition: key ``s`` is allowed
  to query ``t`` (head ``n``, key/value head ``n // G``) when ``s <= t`` and ``s // block_size``
  is one of ``block_idx[b, t, n // G]``; the normaliser's weights over the allowed keys."""
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  ids = np.asarray(block_idx)
  chosen = (np.arange(S) // block_size)[None, None, None, :, None] == ids[:, :, :, None, :]
  allowed = chosen.any(-1) & (
    np.arange(S)[None, None, None, :] <= np.arange(T)[None, :, None, None]
  )
  allowed = jnp.asarray(np.repeat(allowed, G, axis=2))  # [B, T, N, S]
  up = lambda x: jnp.repeat(x.astype(jnp.float32), G, axis=2)
  z = jnp.einsum("btnh,bsnh->btns", q.astype(jnp.float32), up(k)) * scale
  w, log_norm = normalizers.get(normalizer).weights(z, allowed)
  out = jnp.einsum("btns,bsnh->btnh", jnp.where(allowed, w, 0.0), up(v))
  return out, jnp.where(jnp.any(allowed, -1), log_norm[..., 0], 0.0)


def inputs(B=2, T=40, S=50, N=4, K=2, H=16, block_size=8, n=3, dtype=jnp.float32, seed=0):
  """``(q, k, v, block_idx)``: ids drawn from ``[-1, nb]`` (``nb`` is out of range), so rows
  repeat blocks and select blocks past their token; token 5 of batch row 0 selects none."""
  rng = np.random.default_rng(seed)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), dtype)
  nb = -(-S // block_size)
  ids = rng.integers(-1, nb + 1, (B, T, K, n)).astype(np.int32)
  ids[0, min(5, T - 1)] = -1
  return draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, H), jnp.asarray(ids)


def _loss(fn, cts):
  ct, cl = cts

  def loss(q, k, v):
    out, lse = fn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * ct) + jnp.sum(jnp.sin(lse) * cl), (out, lse)

  return loss


def _cotangents(q, Hv, seed=1):
  rng = np.random.default_rng(seed)
  B, T, N, _ = q.shape
  return (
    jnp.asarray(rng.standard_normal((B, T, N, Hv)), jnp.float32),
    jnp.asarray(rng.standard_normal((B, T, N)), jnp.float32),
  )


def _tolerance(dtype, x, block_size, n, depth):
  """Of the compared values' scale: a row sums over at most ``n * block_size`` keys."""
  scale = max(1.0, float(np.max(np.abs(np.asarray(x, np.float32)))))
  return reduction_tolerance(dtype, n * block_size, depth=depth, scale=scale)


def check_against_reference(kernel, q, k, v, ids, *, block_size, normalizer, dtype, **kw):
  """Values, lse and the gradients of q, k, v of ``kernel`` (``selected.pallas_tpu``-like)
  against :func:`reference` on the same (rounded) inputs, the reference in float32."""
  scale = q.shape[-1] ** -0.5
  cts = _cotangents(q, v.shape[-1])
  fast = lambda q, k, v: kernel(
    q, k, v, ids, block_size=block_size, scale=scale, normalizer=normalizer, return_lse=True, **kw
  )
  slow = lambda q, k, v: reference(
    q, k, v, ids, block_size=block_size, scale=scale, normalizer=normalizer
  )
  grad = lambda f: jax.jit(jax.value_and_grad(_loss(f, cts), (0, 1, 2), has_aux=True))
  (_, (out, lse)), grads = grad(fast)(q, k, v)
  up = lambda x: x.astype(jnp.float32)
  (_, (want_out, want_lse)), want_grads = grad(slow)(up(q), up(k), up(v))
  n = ids.shape[-1]
  for name, got, want, depth in (
    ("out", out, want_out, 2),
    ("lse", lse, want_lse, 1),
    *((f"d{x}", g, w, 3) for x, g, w in zip("qkv", grads, want_grads)),
  ):
    tol = _tolerance(dtype, want, block_size, n, depth)
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    assert err <= tol, f"{normalizer} {kw} {name}: max error {err:.3g} > {tol:.3g}"


# ---------------------------------------------------------------------------
# The plan: block lists, the inverted index, the loop order.


def test_block_lists_are_sorted_distinct_and_reachable():
  q, k, v, ids = inputs()
  p = attention.plan_call("tpu", q, k, v, ids, block_size=8, scale=0.25, order="kv", rows=16)
  blocks = plan.canonical_blocks(ids, p)
  idx, count = np.asarray(blocks.idx), np.asarray(blocks.count)
  raw = np.asarray(ids)
  for b, t, kh in itertools.product(range(p.B), range(p.T), range(p.K)):
    want = sorted({j for j in raw[b, t, kh] if 0 <= j < p.nb and j * p.block_size <= t})
    c = count[b, t, kh]
    assert idx[b, t, kh, :c].tolist() == want, (b, t, kh)
    assert set(idx[b, t, kh, c:].tolist()) <= {want[-1] if want else 0}  # no new fetch
  assert count[0, 5].tolist() == [0, 0]
  counts = np.asarray(plan.row_counts(blocks, p))
  t = np.arange(p.T)[None, :, None, None]
  s = np.asarray(blocks.idx)[..., None] * 8 + np.arange(8)
  live = np.asarray(plan.slot_valid(blocks))[..., None] & (s <= t[..., None]) & (s < p.S)
  np.testing.assert_array_equal(counts, live.sum((-1, -2)))


def test_the_inverted_index_lists_each_pair_once():
  q, k, v, ids = inputs()
  p = attention.plan_call("tpu", q, k, v, ids, block_size=8, scale=0.25, order="kv", rows=16)
  assert (p.tokens, p.rows) == (8, 16)  # G = 2 heads of 8 tokens per item
  blocks = plan.canonical_blocks(ids, p)
  work = jax.tree.map(np.asarray, plan.work_list(blocks, p))
  valid = np.asarray(plan.slot_valid(blocks))
  idx = np.asarray(blocks.idx)
  for b, kh in itertools.product(range(p.B), range(p.K)):
    blk, first, last, live = (getattr(work, f)[b, kh] for f in ("block", "first", "last", "live"))
    token = work.token[b, kh].reshape(p.W, p.rows)
    assert np.all(np.diff(blk) >= 0) and set(blk.tolist()) == set(range(p.nb))
    np.testing.assert_array_equal(first, np.r_[1, blk[1:] != blk[:-1]])
    np.testing.assert_array_equal(last, np.r_[blk[1:] != blk[:-1], 1])
    # each item's rows: its live tokens' G heads, then padding (-1)
    for w in range(p.W):
      want = np.repeat(token[w, : live[w] * p.G : p.G], p.G)
      np.testing.assert_array_equal(token[w, : live[w] * p.G], want)
      assert np.all(token[w, live[w] * p.G :] == -1)
    # every real (token, slot) pair is at its row, in an item of its block, once
    seen = []
    for t, s in zip(*np.nonzero(valid[b, :, kh])):
      row = work.pos[b, t, kh, s]
      assert token.reshape(-1)[row] == t and blk[row // p.rows] == idx[b, t, kh, s]
      seen.append(row)
    assert len(set(seen)) == len(seen) == int(np.sum(live)) == int(valid[b, :, kh].sum())
  assert p.W >= int(np.max(np.sum(work.live > 0, axis=-1)))


def test_loop_order_follows_the_group_size():
  assert plan.loop_order(plan.QUERY_MAJOR_MIN_GROUP, "softmax") == "query"
  assert plan.loop_order(plan.QUERY_MAJOR_MIN_GROUP - 1, "softmax") == "kv"
  assert plan.loop_order(1, "softmax_one") == "kv"
  assert plan.loop_order(1, "sigmoid") == "query"  # parts of a sigmoid row do not merge
  q, k, v, ids = inputs(N=32, K=2)
  assert attention.plan_call("tpu", q, k, v, ids, block_size=8, scale=1.0).order == "query"
  q, k, v, ids = inputs()
  assert attention.plan_call("cuda", q, k, v, ids, block_size=8, scale=1.0).order == "kv"
  with pytest.raises(ValueError, match="normalizer='relu' does not merge"):
    attention.plan_call("tpu", q, k, v, ids, block_size=8, scale=1.0, normalizer="relu", order="kv")


def test_bad_input_names_the_argument():
  q, k, v, ids = inputs()
  call = lambda *a, **kw: selected.pallas_tpu(*a, **{"block_size": 8, "scale": 0.5, **kw})
  with pytest.raises(ValueError, match=r"block_idx must be \[B, T, K, n\] = \[2, 40, 2, n\]"):
    call(q, k, v, ids[:, :30])
  with pytest.raises(TypeError, match="block_idx must be an integer array"):
    call(q, k, v, ids.astype(jnp.float32))
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    call(q, k, v, ids, block_size=0)
  with pytest.raises(ValueError, match="query heads N=4 must be a multiple of key/value heads K=3"):
    call(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), ids[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="normalizer='soft' is not one of"):
    call(q, k, v, ids, normalizer="soft")
  with pytest.raises(ValueError, match="order='rows' is not one of"):
    call(q, k, v, ids, order="rows")
  with pytest.raises(ValueError, match="block_size=12 .* a multiple of 8"):
    call(q, k, v, ids, block_size=12)
  with pytest.raises(ValueError, match="dtype float32 .* bfloat16 or float16"):
    selected.mosaic_gpu(q, k, v, ids, block_size=64, scale=0.5, interpret=True)
  assert selected.unsupported("tpu", q, k, v, ids, block_size=8, scale=0.5) == []


def test_empty_calls_give_zeros():
  q, k, v, ids = inputs(T=4, S=8, block_size=8)
  out, lse = selected.pallas_tpu(
    q[:, :0], k, v, ids[:, :0], block_size=8, scale=0.5, return_lse=True, interpret=True
  )
  assert out.shape == (2, 0, 4, 16) and lse.shape == (2, 0, 4)
  out = selected.selected_attention(
    q, k, v, ids[..., :0], block_size=8, scale=0.5, interpret=True, implementation="pallas_tpu"
  )
  np.testing.assert_array_equal(out, 0.0)
  with pytest.raises(ValueError, match="implementation='splash' is not one of"):
    selected.selected_attention(q, k, v, ids, block_size=8, scale=0.5, implementation="splash")


def test_the_gathered_twin_equals_the_reference():
  # The kernels' forward mode and second order go through it; python -m attnjax.check
  # compares the kernels with it.
  q, k, v, ids = inputs()
  for normalizer in ("softmax", "softpick"):
    check_against_reference(
      lambda q, k, v, ids, **kw: twin.gathered(
        attention.plan_call("tpu", q, k, v, ids, **{**kw, "return_lse": True}), q, k, v, ids
      ),
      q,
      k,
      v,
      ids,
      block_size=8,
      normalizer=normalizer,
      dtype=jnp.float32,
    )


def test_the_reference_of_part_a_agrees():
  """The selected branch's reference of the nsa op (``kernels/selected_reference.py``, written
  beside these kernels) is the same function as this file's."""
  other = pytest.importorskip("attnjax._src.kernels.selected_reference")
  q, k, v, ids = inputs()
  for normalizer in NORMS:
    want = reference(q, k, v, ids, block_size=8, scale=0.25, normalizer=normalizer)
    got = other.selected_attention(
      q, k, v, ids, block_size=8, scale=0.25, normalizer=normalizer, return_lse=True
    )
    for a, b in zip(got, want):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("normalizer", ROW_PASSES)
def test_kernels_refuse_normalisers_with_row_passes(platform, normalizer):
  """A normaliser whose log-normaliser comes before its first key and whose backward row term
  sums over every key (clipped softmax) is refused by name: the kernels run neither pass, and
  NSA / DSA take the block-wise engine for it."""
  q, k, v, ids = inputs()
  kw = dict(block_size=8, scale=0.25, normalizer=normalizer, interpret=True)
  reasons = selected.unsupported(platform, q, k, v, ids, **kw)
  assert any(f"normalizer={normalizer!r}" in r for r in reasons), reasons
  call = selected.pallas_tpu if platform == "tpu" else selected.mosaic_gpu
  with pytest.raises(ValueError, match=f"normalizer={normalizer!r}"):
    call(q, k, v, ids, **kw)


# ---------------------------------------------------------------------------
# Pallas TPU kernels in interpret mode.

TPU_CASES = [("query", "softmax"), ("kv", "softmax")]
SLOW_TPU_CASES = [("query", n) for n in NORMS if n not in ("softmax",) + ROW_PASSES] + [
  ("kv", "softmax_one")
]


def _tpu_case(order, normalizer, monkeypatch):
  if order == "query":
    # launches of 8 tokens (tables of 8 x K x (n + 1) entries): 10 of them, one lax.map
    monkeypatch.setattr(tpu, "SMEM_TABLE_ENTRIES", 64)
    q, k, v, ids = inputs()
  else:  # one launch (B = K = 1): four query heads, items of 4 tokens
    q, k, v, ids = inputs(B=1, K=1)
  check_against_reference(
    selected.pallas_tpu,
    q,
    k,
    v,
    ids,
    block_size=8,
    normalizer=normalizer,
    dtype=jnp.float32,
    interpret=True,
    order=order,
    rows=16,
  )


@pytest.mark.parametrize("order,normalizer", TPU_CASES)
def test_pallas_tpu_interpret(order, normalizer, monkeypatch):
  _tpu_case(order, normalizer, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("order,normalizer", SLOW_TPU_CASES)
def test_pallas_tpu_interpret_every_normaliser(order, normalizer, monkeypatch):
  _tpu_case(order, normalizer, monkeypatch)


@pytest.mark.slow
def test_pallas_tpu_bfloat16_and_forward_mode():
  q, k, v, ids = inputs(B=1, N=8, K=1, H=32, block_size=16, S=48, dtype=jnp.bfloat16)
  kw = dict(block_size=16, normalizer="sigmoid", dtype=jnp.bfloat16, interpret=True)
  check_against_reference(selected.pallas_tpu, q, k, v, ids, **kw, order="query")
  # forward mode takes the gathered twin's tangent
  f = lambda q: selected.pallas_tpu(q, k, v, ids, block_size=16, scale=0.2, interpret=True)
  g = lambda q: reference(q, k, v, ids, block_size=16, scale=0.2, normalizer="softmax")[0]
  t = 0.5 * q
  got = jax.jit(lambda q, t: jax.jvp(f, (q,), (t,)))(q, t)
  up = lambda x: x.astype(jnp.float32)
  want = jax.jvp(g, (up(q),), (up(t),))
  for a, b in zip(got, want):
    tol = _tolerance(jnp.bfloat16, b, 16, ids.shape[-1], 2)
    assert float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b)))) <= tol


# ---------------------------------------------------------------------------
# Mosaic GPU kernels in jax's Mosaic GPU interpreter (64-key blocks: one wgmma tile).


def _gpu_inputs(order, seed=0):
  # a query-major program per (token, kv head): few tokens; 8 heads in a group for it
  N, K = (8, 1) if order == "query" else (4, 2)
  return inputs(B=1, T=12, S=70, N=N, K=K, H=64, block_size=64, n=2, dtype=jnp.bfloat16, seed=seed)


def check_gpu_kernels(order, normalizer):
  """The forward and the backward kernels, called directly (forward with residuals, then the
  backward), against the reference's VJP of the output and the lse."""
  q, k, v, ids = _gpu_inputs(order)
  scale = 0.125
  p = attention.plan_call(
    "cuda",
    q,
    k,
    v,
    ids,
    block_size=64,
    scale=scale,
    normalizer=normalizer,
    interpret=True,
    return_lse=True,
    order=order,
  )
  ct, cl = _cotangents(q, 64)
  ct = ct.astype(jnp.bfloat16)

  def kernels(q, k, v):
    (out, lse), (blocks, o, res) = attention._forward(gpu, p, q, k, v, ids)
    return out, lse, attention._backward(gpu, p, q, k, v, blocks, o, res, ct, cl)

  out, lse, grads = jax.jit(kernels)(q, k, v)
  up = lambda x: x.astype(jnp.float32)
  ref = lambda q, k, v: reference(q, k, v, ids, block_size=64, scale=scale, normalizer=normalizer)
  (want_out, want_lse), vjp = jax.vjp(ref, up(q), up(k), up(v))
  want_grads = vjp((up(ct), cl))
  for name, got, want, depth in (
    ("out", out, want_out, 2),
    ("lse", lse, want_lse, 1),
    *((f"d{x}", g, w, 3) for x, g, w in zip("qkv", grads, want_grads)),
  ):
    tol = _tolerance(jnp.bfloat16, want, 64, ids.shape[-1], depth)
    err = float(np.max(np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))))
    assert err <= tol, f"{order} {normalizer} {name}: max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("order,normalizer", [("kv", "softmax")])
def test_mosaic_gpu_interpret(order, normalizer):
  check_gpu_kernels(order, normalizer)


@pytest.mark.slow
@pytest.mark.parametrize(
  "order,normalizer", [("query", n) for n in NORMS if n not in ROW_PASSES] + [("kv", "softmax_one")]
)
def test_mosaic_gpu_interpret_every_normaliser(order, normalizer):
  check_gpu_kernels(order, normalizer)


@pytest.mark.slow
def test_mosaic_gpu_gradients_take_the_twin_in_interpret_mode():
  q, k, v, ids = _gpu_inputs("query")
  kw = dict(block_size=64, normalizer="softmax", dtype=jnp.bfloat16)
  check_against_reference(selected.mosaic_gpu, q, k, v, ids, **kw, interpret=True)


# ---------------------------------------------------------------------------
# Deviceless compiles for a TPU v5e and an H200.

needs_tpu = pytest.mark.targets("tpu")
needs_cuda = pytest.mark.targets("cuda")


def compile_for(
  devices, kernel, order, N, K, *, T=512, H=128, n=8, normalizer="softmax", grad=True
):
  mesh = targets.mesh(devices)
  rep = NamedSharding(mesh, P())
  q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16, sharding=rep)
  kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16, sharding=rep)
  ids = jax.ShapeDtypeStruct((1, T, K, n), jnp.int32, sharding=rep)

  def call(q, k, v, ids):
    return kernel(
      q,
      k,
      v,
      ids,
      block_size=64,
      scale=H**-0.5,
      normalizer=normalizer,
      order=order,
      return_lse=True,
    )

  def loss(q, k, v, ids):
    out, lse = call(q, k, v, ids)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse)

  fn = jax.value_and_grad(loss, (0, 1, 2)) if grad else call
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(q, kv, kv, ids).compile().as_text()


# Both loop orders by default; a non-softmax normaliser in the query order under -m slow.
TPU_COMPILES = [
  ("query", 16, 1, "softmax"),
  ("kv", 4, 2, "softmax"),
  pytest.param("query", 4, 2, "sigmoid", marks=pytest.mark.slow),
]


@needs_tpu
@pytest.mark.usefixtures("target_compiles")
@pytest.mark.parametrize("order,N,K,normalizer", TPU_COMPILES)
def test_pallas_tpu_compiles_for_v5e(order, N, K, normalizer):
  text = compile_for(
    targets.tpu_devices("v5e", "2x2")[:1], selected.pallas_tpu, order, N, K, normalizer=normalizer
  )
  names = (
    ["fwd_parts", f"dkdv_{normalizer}"]
    if order == "kv"
    else [f"fwd_{normalizer}", f"dq_{normalizer}", f"dkdv_{normalizer}"]
  )
  for name in names:
    assert f"attnjax_selected_tpu_{name}" in text, name


@needs_tpu
@pytest.mark.slow
@pytest.mark.usefixtures("target_compiles")
def test_pallas_tpu_long_calls_fit_smem():
  # 65536 tokens x 16 slots: one launch's tables would take 4 MiB of v5e's 1 MiB of SMEM
  # ("would exceed memory"); launches of token_chunk tokens fit
  compile_for(
    targets.tpu_devices("v5e", "2x2")[:1],
    selected.pallas_tpu,
    "query",
    16,
    1,
    T=65536,
    n=16,
    grad=False,
  )


@needs_cuda
@pytest.mark.usefixtures("target_compiles")
@pytest.mark.parametrize(
  "order,N,K,normalizer", [("query", 16, 1, "softmax"), ("kv", 4, 2, "softmax")]
)
def test_mosaic_gpu_compiles_for_h200(order, N, K, normalizer):
  text = compile_for(
    targets.gpu_devices("h200", 1), selected.mosaic_gpu, order, N, K, normalizer=normalizer
  )
  kernels = 2 if order == "kv" else 3  # forward (parts), (dq,) dk/dv
  assert text.count('custom_call_target="mosaic_gpu') >= kernels


# ---------------------------------------------------------------------------
# The kernel-trust rule and python -m attnjax.check.


def test_the_device_check_checks_the_selected_kernels(monkeypatch, tmp_path):
  from attnjax._src import check, trust

  assert check.kernels_to_check("tpu", "selected_pallas_tpu", False) == ("selected_pallas_tpu",)
  assert check.kernels_to_check("gpu", "selected_mosaic_gpu", False) == ("selected_mosaic_gpu",)
  assert "selected_pallas_tpu" not in check.kernels_to_check("tpu", "all", False)
  assert trust.source_files("selected_pallas_tpu") == trust.source_files("selected_mosaic_gpu")
  assert any(p.name == "gpu.py" for p in trust.source_files("selected_pallas_tpu"))
  assert "--kernel selected_pallas_tpu" in trust.check_command("selected_pallas_tpu", "tpu")
  q, k, v, ids = inputs()
  assert selected.case_class("tpu", q, k, v, ids, block_size=8, scale=1.0) == (
    "softmax selected_kv float32"
  )
  # one case in interpret mode (the key-block-major order, whose merge a wrong part spoils);
  # a kernel off by 1% fails it
  monkeypatch.setattr(check, "selected_cases", lambda impl: [("softmax", "kv", "float32")])
  out = str(tmp_path / "report.md")
  argv = ["--interpret", "--platform", "tpu", "--kernel", "selected_pallas_tpu", "--out", out]
  assert check.main(argv) == 0
  entry = trust.read_verdicts("cpu")["selected_pallas_tpu"]
  assert entry["passed"] and entry["cases"] == {"softmax selected_kv float32": True}
  assert entry["digest"] == trust.digest_of("selected_pallas_tpu")
  real = selected.pallas_tpu

  def off(*a, **kw):  # the check always asks for the lse
    out, lse = real(*a, **kw)
    return out * 1.01, lse

  monkeypatch.setattr(attention, "pallas_tpu", off)
  assert check.main(argv) == 1
  assert trust.read_verdicts("cpu")["selected_pallas_tpu"]["cases"] == {
    "softmax selected_kv float32": False
  }
