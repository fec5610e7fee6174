"""Sparse patterns and sparse attention.

Masks are checked against brute-force masks written here with plain Python
loops straight from each paper's definition; layouts against the masks; the
block-sparse path against dense reference attention with the pattern's mask,
in value and gradient.
"""

import numpy as np
import pytest

import jax.numpy as jnp

import attnjax
from attnjax._src import patterns
from attnjax._src.ops.sparse.attention import sparse_attention
from helpers import assert_close, outputs_and_grads, rand_qkv

# Short calls of the sparse family run its block plans here, as auto-dispatch does from
# sparse.BLOCKWISE_MIN_LENGTH tokens on (the plans are what these tests check).
pytestmark = pytest.mark.usefixtures("sparse_block_plans")


# ---------------------------------------------------------------------------
# Brute-force masks, one (i, j) at a time.


def brute(rule, T, S):
  return np.array([[bool(rule(i, j)) for j in range(S)] for i in range(T)])


def brute_strided(l):
  # Child et al. A(1): t = max(0, i - l) .. i ; A(2): (i - j) mod l == 0 ; causal.
  return lambda i, j: j <= i and (max(0, i - l) <= j or (i - j) % l == 0)


def brute_fixed(l, c):
  # Child et al. A(1): floor(j / l) == floor(i / l) ; A(2): j mod l in {l - c, ..., l - 1}.
  return lambda i, j: j <= i and (j // l == i // l or j % l >= l - c)


def brute_global_window(g, left, right):
  return lambda i, j: i < g or j < g or (i - left <= j <= i + right)


def brute_sinks(s, w):
  return lambda i, j: j <= i and (j < s or i - j <= w)


def brute_bigbird(block, g, wb, table):
  del g, wb  # the table holds every part; its structure is checked separately
  return lambda i, j: table[i // block, j // block]


CASES = [
  ("causal", patterns.causal(), lambda i, j: j <= i),
  ("window3", patterns.sliding_window(3), lambda i, j: i - 3 <= j <= i),
  ("window2_1", patterns.sliding_window(2, 1), lambda i, j: i - 2 <= j <= i + 1),
  ("window0", patterns.sliding_window(0), lambda i, j: i == j),
  ("strided4", patterns.strided(4), brute_strided(4)),
  ("strided3", patterns.strided(3), brute_strided(3)),
  ("fixed4_1", patterns.fixed(4, 1), brute_fixed(4, 1)),
  ("fixed5_2", patterns.fixed(5, 2), brute_fixed(5, 2)),
  ("fixed3_3", patterns.fixed(3, 3), brute_fixed(3, 3)),
  ("global2_w2", patterns.global_window(2, (2, 2)), brute_global_window(2, 2, 2)),
  ("global1_w3_0", patterns.global_window(1, (3, 0)), brute_global_window(1, 3, 0)),
  ("sinks2_w3", patterns.sinks_window(2, 3), brute_sinks(2, 3)),
  ("sinks0_w1", patterns.sinks_window(0, 1), brute_sinks(0, 1)),
  (
    "union",
    patterns.sliding_window(1) | patterns.fixed(4, 1),
    lambda i, j: (i - 1 <= j <= i) or brute_fixed(4, 1)(i, j),
  ),
  (
    "longformer_causal",
    patterns.global_window(2, 2) & patterns.causal(),  # int w: (w, 0)
    lambda i, j: j <= i and brute_global_window(2, 2, 0)(i, j),
  ),
  (
    "union3",
    patterns.union(patterns.sinks_window(1, 2), patterns.strided(5), patterns.sliding_window(0, 1)),
    lambda i, j: brute_sinks(1, 2)(i, j) or brute_strided(5)(i, j) or i <= j <= i + 1,
  ),
]
IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("T,S", [(13, 13), (9, 14)], ids=["T13", "T9_S14"])
@pytest.mark.parametrize("name,pattern,rule", CASES, ids=IDS)
def test_mask_matches_brute_force(name, pattern, rule, T, S):
  got = np.asarray(pattern.mask(T, S))
  assert got.shape == (1, 1, T, S) and got.dtype == bool
  np.testing.assert_array_equal(got[0, 0], brute(rule, T, S))


def brute_bigbird_table(nq, nk, g, wb, num_random, seed):
  table = np.zeros((nq, nk), bool)
  for a in range(nq):
    for b in range(nk):
      table[a, b] = a < g or b < g or abs(a - b) <= wb
  return table


@pytest.mark.parametrize("T,S", [(30, 30), (27, 21)], ids=["T30", "T27_S21"])
def test_bigbird_mask_structure(T, S):
  block, g, wb, r = 3, 1, 1, 2
  p = patterns.bigbird(block, g, wb, r, seed=7)
  nq, nk = -(-T // block), -(-S // block)
  table = p.table(T, S)
  fixed_part = brute_bigbird_table(nq, nk, g, wb, r, 7)
  # Global and window blocks are all present; each non-global row has exactly
  # min(r, free) extra random blocks.
  assert np.all(table[fixed_part])
  extra = np.logical_and(table, np.logical_not(fixed_part)).sum(axis=1)
  free = np.logical_not(fixed_part).sum(axis=1)
  np.testing.assert_array_equal(extra[g:], np.minimum(r, free[g:]))
  np.testing.assert_array_equal(extra[:g], 0)
  np.testing.assert_array_equal(
    np.asarray(p.mask(T, S))[0, 0], brute(brute_bigbird(block, g, wb, table), T, S)
  )


def test_bigbird_seed_reproducible():
  make = lambda seed: np.asarray(patterns.bigbird(2, 1, 1, 2, seed=seed).mask(64))
  np.testing.assert_array_equal(make(3), make(3))
  assert not np.array_equal(make(3), make(4))
  assert patterns.bigbird(2, 1, 1, 2, 3) == patterns.bigbird(2, 1, 1, 2, 3)
  assert hash(patterns.bigbird(2, 1, 1, 2, 3)) == hash(patterns.bigbird(2, 1, 1, 2, 3))


# ---------------------------------------------------------------------------
# Layouts.


LAYOUT_PATTERNS = [(name, p) for name, p, _ in CASES] + [
  ("bigbird", patterns.bigbird(3, 1, 1, 2, seed=0)),
  ("bigbird_causal", patterns.bigbird(4, 1, 0, 1, seed=1) & patterns.causal()),
]


@pytest.mark.parametrize("block_size", [1, 5], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("name,pattern", LAYOUT_PATTERNS, ids=[n for n, _ in LAYOUT_PATTERNS])
def test_layout_covers_exactly_the_mask(name, pattern, block_size):
  T, S = 23, 21
  mask = np.asarray(pattern.mask(T, S))[0, 0]
  layout = pattern.layout(T, S, block_size=block_size)
  kv_blocks, needs_mask = layout.as_arrays()
  num_visits = (kv_blocks >= 0).sum(axis=1)
  nq, nk = -(-T // block_size), -(-S // block_size)
  padded = np.zeros((nq * block_size, nk * block_size), bool)
  padded[:T, :S] = mask
  blocks = padded.reshape(nq, block_size, nk, block_size)
  any_kept = blocks.any(axis=(1, 3))
  inside = np.zeros_like(padded)
  inside[:T, :S] = True
  all_kept = np.logical_and(
    blocks.all(axis=(1, 3)), inside.reshape(nq, block_size, nk, block_size).all(axis=(1, 3))
  )
  # Every kept element lies in a listed block, and no listed block is empty.
  np.testing.assert_array_equal(patterns.kept_blocks(layout), any_kept)
  np.testing.assert_array_equal(attnjax.patterns.full_blocks(layout), all_kept)
  assert layout.num_pairs == any_kept.sum()
  for qb in range(nq):
    n = num_visits[qb]
    row = kv_blocks[qb]
    assert np.all(np.diff(row[:n]) > 0) and np.all(row[n:] == -1)
    assert not needs_mask[qb, n:].any()
  np.testing.assert_array_equal(pattern.block_mask(T, block_size, S), any_kept)


def test_window_layout_is_banded():
  layout = patterns.sliding_window(256).layout(4096, block_size=128)
  assert max(len(layout.visits(i)) for i in range(layout.num_q_blocks)) == 3
  assert layout.num_pairs == 1 + 2 + 3 * 30
  assert attnjax.patterns.density(layout) == 93 / 1024


# ---------------------------------------------------------------------------
# Validation.


@pytest.mark.parametrize(
  "make,match",
  [
    (lambda: patterns.strided(0), "strided: stride must be a positive int, got stride=0"),
    (lambda: patterns.strided(2.5), "stride must be a positive int"),
    (lambda: patterns.fixed(4, 5), "summary=5, stride=4"),
    (lambda: patterns.fixed(4, 0), "summary must be a positive int"),
    (lambda: patterns.sliding_window(-1), "left must be an int >= 0, got left=-1"),
    (lambda: patterns.sliding_window(2, -3), "right must be an int >= 0"),
    (lambda: patterns.global_window(-1, 2), "num_global must be an int >= 0"),
    (lambda: patterns.global_window(1, (2,)), "window must be an int or a"),
    (lambda: patterns.bigbird(0, 1, 1, 1, 0), "bigbird: block must be a positive int"),
    (lambda: patterns.bigbird(4, 1, 1, -2, 0), "num_random must be an int >= 0"),
    (lambda: patterns.sinks_window(4, -1), "sinks_window: window must be an int >= 0"),
    (lambda: patterns.causal() | 3, "takes Pattern objects"),
    (lambda: patterns.causal().layout(16, block_size=0), "block_size must be a positive int"),
    (lambda: patterns.bigbird(32, 1, 1, 1, 0).mask(16), "block=32 is longer than the sequence"),
  ],
  ids=[
    "stride0",
    "stride_float",
    "summary_gt_stride",
    "summary0",
    "left_neg",
    "right_neg",
    "global_neg",
    "window_tuple",
    "block0",
    "random_neg",
    "sinks_window0",
    "union_type",
    "layout_block0",
    "bigbird_block_gt_T",
  ],
)
def test_pattern_validation(make, match):
  with pytest.raises((ValueError, TypeError), match=match):
    make()


def qkv(B, T, S, N, K, H, seed=0):
  return rand_qkv(B=B, T=T, S=S, N=N, K=K, H=H, seed=seed)


def test_sparse_attention_validation():
  q, k, v = qkv(1, 8, 8, 2, 1, 4)
  with pytest.raises(TypeError, match="pattern must be an attnjax.patterns.Pattern"):
    sparse_attention(q, k, v, pattern="causal", block_size=4)
  with pytest.raises(ValueError, match="block_size must be a positive int, got block_size=0"):
    sparse_attention(q, k, v, pattern=patterns.causal(), block_size=0)
  with pytest.raises(ValueError, match="implementation='dense' is not one of"):
    sparse_attention(q, k, v, pattern=patterns.causal(), block_size=4, implementation="dense")
  with pytest.raises(ValueError, match=r"bias of shape \(8, 7\) is not broadcastable"):
    sparse_attention(q, k, v, pattern=patterns.causal(), block_size=4, bias=jnp.zeros((8, 7)))
  with pytest.raises(ValueError, match="N=2 must be a multiple of key/value heads K=3"):
    sparse_attention(q, *qkv(1, 8, 8, 2, 3, 4)[1:], pattern=patterns.causal(), block_size=4)


# ---------------------------------------------------------------------------
# Attention: block-sparse against the dense reference with the pattern's mask.


def dense_with_mask(q, k, v, pattern, **kw):
  mask = pattern.mask(q.shape[1], k.shape[1])
  return attnjax.dot_product_attention(q, k, v, mask=mask, implementation="reference", **kw)


def test_reference_is_dense_with_pattern_mask():
  q, k, v = qkv(1, 12, 12, 2, 2, 4)
  p = patterns.fixed(4, 1)
  np.testing.assert_allclose(
    sparse_attention(q, k, v, pattern=p, implementation="reference"),
    dense_with_mask(q, k, v, p),
    rtol=1e-6,
    atol=1e-6,
  )


ATTN_PATTERNS = [
  ("causal", patterns.causal()),
  ("window5", patterns.sliding_window(5)),
  ("window3_2", patterns.sliding_window(3, 2)),
  ("strided4", patterns.strided(4)),
  ("fixed4_2", patterns.fixed(4, 2)),
  ("global_window", patterns.global_window(2, (3, 3))),
  ("bigbird", patterns.bigbird(4, 1, 1, 1, seed=0)),
  ("sinks_window", patterns.sinks_window(1, 4)),
  ("union", patterns.sliding_window(2) | patterns.fixed(8, 1)),
]


@pytest.mark.parametrize("name,pattern", ATTN_PATTERNS, ids=[n for n, _ in ATTN_PATTERNS])
def test_block_sparse_matches_reference(name, pattern):
  # T=22 is not a multiple of block_size=8; GQA with N=4 query heads over K=2.
  q, k, v = qkv(1, 22, 22, 4, 2, 8)
  sparse = lambda q, k, v: sparse_attention(
    q, k, v, pattern=pattern, block_size=8, implementation="blockwise"
  )
  ref = lambda q, k, v: dense_with_mask(q, k, v, pattern)
  assert_close(outputs_and_grads(sparse, q, k, v), outputs_and_grads(ref, q, k, v))


@pytest.mark.parametrize("normalizer", ["softmax_one", "sigmoid", "softpick", "none", "relu"])
def test_block_sparse_normalizers(normalizer):
  q, k, v = qkv(1, 11, 11, 2, 1, 8, seed=1)
  p = patterns.sinks_window(2, 4)
  sparse = lambda q, k, v: sparse_attention(q, k, v, pattern=p, block_size=4, normalizer=normalizer)
  ref = lambda q, k, v: dense_with_mask(q, k, v, p, normalizer=normalizer)
  assert_close(outputs_and_grads(sparse, q, k, v), outputs_and_grads(ref, q, k, v))


@pytest.mark.parametrize(
  "name,pattern",
  [
    ("longformer_causal_segments", patterns.global_window(1, (4, 0)) & patterns.causal()),
    ("fixed_extra_keys", patterns.fixed(4, 1)),
  ],
  ids=["longformer_causal_segments", "fixed_extra_keys"],
)
def test_block_sparse_options_and_stats(name, pattern):
  # Stats (with the logsumexp gradient), sink logits, softcap, scale, segment
  # ids and a bias; fixed also runs its gathered summary keys through them.
  q, k, v = qkv(2, 13, 13, 4, 2, 8, seed=2)
  seg = jnp.array([[0] * 6 + [1] * 7, [0] * 13])
  bias = 0.1 * jnp.sin(jnp.arange(13 * 13, dtype=jnp.float32)).reshape(13, 13)
  kw = dict(
    sink_logits=jnp.linspace(-1.0, 1.0, 4),
    softcap=5.0,
    scale=0.3,
    segment_ids=seg,
    bias=bias,
    return_stats=True,
  )
  sparse = lambda q, k, v: sparse_attention(q, k, v, pattern=pattern, block_size=4, **kw)
  ref = lambda q, k, v: dense_with_mask(q, k, v, pattern, **kw)
  assert_close(outputs_and_grads(sparse, q, k, v), outputs_and_grads(ref, q, k, v))


def test_block_sparse_empty_rows_are_zero():
  # Keys shorter than queries: later queries of a window have no key at all.
  q, k, v = qkv(1, 16, 6, 2, 2, 4)
  out = sparse_attention(q, k, v, pattern=patterns.sliding_window(2), block_size=4)
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[:, 9:], 0.0)
  np.testing.assert_allclose(
    out, dense_with_mask(q, k, v, patterns.sliding_window(2)), rtol=2e-5, atol=2e-5
  )


def test_bf16_output_dtype():
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(1, 16, 16, 2, 2, 8))
  out = sparse_attention(q, k, v, pattern=patterns.sliding_window(4), block_size=8)
  assert out.dtype == jnp.bfloat16
  ref = dense_with_mask(q, k, v, patterns.sliding_window(4))
  np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), atol=2e-2)


PLAN_PATTERNS = [
  ("fixed4_1", patterns.fixed(4, 1)),
  ("fixed5_2", patterns.fixed(5, 2)),
  ("fixed3_3", patterns.fixed(3, 3)),
  ("window3", patterns.sliding_window(3)),
]


@pytest.mark.parametrize("name,pattern", PLAN_PATTERNS, ids=[n for n, _ in PLAN_PATTERNS])
def test_plan_slots_count_each_pair_once(name, pattern):
  T, S, block_size = 23, 21, 4
  plan = pattern.plan(T, S, block_size=block_size)
  E = plan.extra_keys.size
  slots = np.asarray(plan.rule.allowed(jnp.arange(T), jnp.arange(S + E), (T, S + E)))
  counts = slots[:, :S].astype(int)
  for e, pos in enumerate(plan.extra_keys):
    counts[:, pos] += slots[:, S + e]
  np.testing.assert_array_equal(counts, np.asarray(pattern.mask(T, S))[0, 0].astype(int))
  # The slot layout lists exactly the non-empty slot blocks.
  nq, nk = -(-T // block_size), -(-(S + E) // block_size)
  padded = np.zeros((nq * block_size, nk * block_size), bool)
  padded[:T, : S + E] = slots
  np.testing.assert_array_equal(
    patterns.kept_blocks(plan.layout),
    padded.reshape(nq, block_size, nk, block_size).any(axis=(1, 3)),
  )


def test_fixed_plan_is_sparse():
  # Own block plus the gathered summary keys: ~8% of the blocks at T=4096, not half.
  layout = patterns.fixed(64, 8).plan(4096, block_size=64).layout
  assert layout.num_pairs == 344
  assert patterns.fixed(64, 8).layout(4096, block_size=64).num_pairs == 64 * 65 // 2


@pytest.mark.parametrize(
  "S,window", [(30, (5, 0)), (27, (3, 2))], ids=["causal_window", "S27_window3_2"]
)
def test_banded_chunks_match_reference(S, window, monkeypatch):
  # Chunks of 2 blocks of 4 (the default is 16 blocks): T=30 runs as 4 chunks
  # under lax.map, with a partial last chunk and keys cut at both ends.
  from attnjax._src.ops.sparse import attention as sparse

  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", 2)
  q, k, v = qkv(1, 30, S, 4, 2, 4, seed=3)
  seg = (
    (jnp.arange(30)[None, :] >= 13).astype(jnp.int32),
    (jnp.arange(S)[None, :] >= 13).astype(jnp.int32),
  )
  p = patterns.sliding_window(*window)
  f = lambda q, k, v: sparse_attention(
    q, k, v, pattern=p, block_size=4, segment_ids=seg, normalizer="softmax_one"
  )
  ref = lambda q, k, v: dense_with_mask(q, k, v, p, segment_ids=seg, normalizer="softmax_one")
  assert_close(outputs_and_grads(f, q, k, v), outputs_and_grads(ref, q, k, v))


def test_intersection_with_causal_keeps_causal_patterns_as_they_are():
  # `& causal()` is a no-op on causal patterns and must not hide their fast paths.
  for p in (
    patterns.strided(4),
    patterns.fixed(4, 1),
    patterns.sinks_window(2, 3),
    patterns.sliding_window(3),
    patterns.causal(),
  ):
    assert p & patterns.causal() == p
  both = patterns.sliding_window(3, 2) & patterns.causal()
  assert isinstance(both, patterns.PatternIntersection)
  np.testing.assert_array_equal(both.mask(12), patterns.sliding_window(3).mask(12))


BAND_PARTS_CASES = [
  ("sinks6_w5", patterns.sinks_window(6, 5), brute_sinks(6, 5)),
  ("sinks0_w3", patterns.sinks_window(0, 3), brute_sinks(0, 3)),
  ("global5_w3_1", patterns.global_window(5, (3, 1)), brute_global_window(5, 3, 1)),
  ("global2_w3", patterns.global_window(2, (3, 3)), brute_global_window(2, 3, 3)),
  ("global2_w3_int", patterns.global_window(2, 3), brute_global_window(2, 3, 0)),
  ("window3_2", patterns.sliding_window(3, 2), lambda i, j: i - 3 <= j <= i + 2),
  (
    "longformer_causal",
    patterns.global_window(2, 3) & patterns.causal(),
    lambda i, j: j <= i and brute_global_window(2, 3, 3)(i, j),
  ),
  (
    "window3_2_causal",
    patterns.sliding_window(3, 2) & patterns.causal(),
    lambda i, j: i - 3 <= j <= i,
  ),
]


@pytest.mark.parametrize(
  "name,pattern,rule", BAND_PARTS_CASES, ids=[c[0] for c in BAND_PARTS_CASES]
)
def test_band_parts_decompose_the_rule(name, pattern, rule):
  # allowed = band, or a global column the rule allows, or a global row the rule allows.
  parts = pattern.band_parts()
  left, right = parts.band
  T = S = 23
  got = brute(
    lambda i, j: (
      (i - left <= j <= i + right) or ((j in parts.columns or i in parts.rows) and rule(i, j))
    ),
    T,
    S,
  )
  np.testing.assert_array_equal(got, brute(rule, T, S))


# The default run keeps one case per kind (sinks, globals with T != S, asymmetric globals,
# causal Longformer) and one non-mergeable normaliser; the other two are slow (~14 s each).
@pytest.mark.parametrize(
  "name,pattern,S,normalizer",
  [
    pytest.param("sinks6_w5", patterns.sinks_window(6, 5), 37, "softmax", marks=pytest.mark.slow),
    pytest.param(
      "sinks9_w3_sigmoid", patterns.sinks_window(9, 3), 37, "sigmoid", marks=pytest.mark.slow
    ),
    ("sinks4_w6_relu", patterns.sinks_window(4, 6), 37, "relu"),
    ("global5_w3_1", patterns.global_window(5, (3, 1)), 37, "softmax_one"),
    ("global2_w3_S30", patterns.global_window(2, (3, 3)), 30, "softmax"),
    ("longformer_causal", patterns.global_window(3, 6) & patterns.causal(), 37, "softmax"),
  ],
  ids=[
    "sinks6_w5",
    "sinks9_w3_sigmoid",
    "sinks4_w6_relu",
    "global5_w3_1",
    "global2_w3_S30",
    "longformer_causal",
  ],
)
def test_banded_chunks_with_columns_and_rows_match_reference(
  name, pattern, S, normalizer, monkeypatch
):
  # StreamingLLM sinks and Longformer globals run chunk by chunk: the global
  # columns as gathered key slots of every chunk (more columns than a block
  # here), the global rows on their own. Segments, sink logits and softcap ride along.
  from attnjax._src.ops.sparse import attention as sparse

  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", 2)
  calls = []
  banded = sparse.banded_chunks
  monkeypatch.setattr(sparse, "banded_chunks", lambda *a: calls.append(1) or banded(*a))
  T = 37
  q, k, v = qkv(2, T, S, 4, 2, 4, seed=5)
  seg = (
    jnp.stack([jnp.arange(T) >= 13, jnp.arange(T) >= 20]).astype(jnp.int32),
    jnp.stack([jnp.arange(S) >= 13, jnp.arange(S) >= 20]).astype(jnp.int32),
  )
  kw = dict(segment_ids=seg, softcap=4.0, normalizer=normalizer)
  if normalizer == "softmax":
    kw["sink_logits"] = jnp.linspace(-1.0, 1.0, 4)
  f = lambda q, k, v: sparse_attention(q, k, v, pattern=pattern, block_size=4, **kw)
  ref = lambda q, k, v: dense_with_mask(q, k, v, pattern, **kw)
  assert_close(outputs_and_grads(f, q, k, v), outputs_and_grads(ref, q, k, v))
  assert calls, "the banded chunk path was not taken"


@pytest.mark.parametrize(
  "normalizer,sink,chunk_blocks",
  [
    ("softmax_one", False, 2),
    ("softmax", True, 16),
    pytest.param("sigmoid", False, 16, marks=pytest.mark.slow),  # relu covers block-dense
    ("relu", False, 16),
  ],
  ids=["softmax_one_chunked", "sink_logits", "sigmoid_block_dense", "relu_block_dense"],
)
def test_strided_paths_match_reference(normalizer, sink, chunk_blocks, monkeypatch):
  # Softmax family: local window + transposed columns merged by logsumexp (the
  # local part chunked when chunks are small); other normalisers: block-dense.
  from attnjax._src.ops.sparse import attention as sparse

  monkeypatch.setattr(sparse, "CHUNK_BLOCKS", chunk_blocks)
  monkeypatch.setattr(sparse, "STRIDED_TWO_PASS_MIN_LENGTH", 1)  # the merged factors at T=30
  calls = []
  two_pass = sparse._strided_two_pass
  monkeypatch.setattr(sparse, "_strided_two_pass", lambda *a: calls.append(1) or two_pass(*a))
  q, k, v = qkv(1, 30, 30, 4, 2, 4, seed=4)
  kw = dict(normalizer=normalizer)
  if sink:
    kw["sink_logits"] = jnp.linspace(-1.0, 1.0, 4)
  p = patterns.strided(3)
  f = lambda q, k, v: sparse_attention(q, k, v, pattern=p, block_size=4, **kw)
  ref = lambda q, k, v: dense_with_mask(q, k, v, p, **kw)
  assert_close(outputs_and_grads(f, q, k, v), outputs_and_grads(ref, q, k, v))
  assert bool(calls) == (normalizer in ("softmax", "softmax_one")), calls
