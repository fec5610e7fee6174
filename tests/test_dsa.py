"""dsa_attention and indexer_loss: the indexer and its top-k against brute force, the engines
against each other, the dense limit, tie-breaking, masks before the top-k, the KL loss's
gradients (the indexer's only) and bad input."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax.dsa import dsa_attention, index_scores, indexer_loss, select_keys
from helpers import assert_close, outputs_and_grads, reduction_tolerance

B, T, N, K, H, NI, HI = 2, 24, 4, 2, 8, 3, 4


@functools.cache
def _inputs(T=T):
  rng = np.random.default_rng(0)
  draw = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  return (
    draw(B, T, N, H),
    draw(B, T, K, H),
    draw(B, T, K, H),
    draw(B, T, NI, HI),
    draw(B, T, HI),
    draw(B, T, NI),
  )


def brute_selection(iq, ik, iw, top_k, segment_ids=None):
  """Per query, the indexer's scores in float64 loops and its top-k allowed keys, ascending."""
  iq, ik, iw = (np.asarray(x, np.float64) for x in (iq, ik, iw))
  Bq, Tq, NIq, _ = iq.shape
  out = {}
  for b in range(Bq):
    for t in range(Tq):
      allowed = [
        s for s in range(t + 1) if segment_ids is None or segment_ids[b, s] == segment_ids[b, t]
      ]
      score = {
        s: sum(iw[b, t, h] * max(0.0, iq[b, t, h] @ ik[b, s]) for h in range(NIq)) for s in allowed
      }
      ranked = sorted(allowed, key=lambda s: (-score[s], s))  # ties: the lowest key first
      out[b, t] = sorted(ranked[:top_k])
  return out


def test_indexer_scores_and_selection_match_brute_force():
  _, _, _, iq, ik, iw = _inputs()
  seg = np.repeat([[0, 1, 2]], [9, 8, 7], axis=1).repeat(B, axis=0)
  want_scores = np.einsum(
    "bth,bths->bts",
    np.asarray(iw),
    np.maximum(
      np.einsum("bthd,bsd->bths", np.asarray(iq, np.float64), np.asarray(ik, np.float64)), 0.0
    ),
  )
  np.testing.assert_allclose(index_scores(iq, ik, iw), want_scores, rtol=1e-5, atol=1e-5)
  for segments in (None, jnp.asarray(seg)):
    got = select_keys(iq, ik, iw, top_k=5, segment_ids=segments, block_q=8)
    want = brute_selection(iq, ik, iw, 5, None if segments is None else seg)
    for (b, t), keys in want.items():
      row = [int(s) for s in np.asarray(got[b, t]) if s >= 0]
      assert row == keys, (b, t, row, keys)
      assert all(s == -1 for s in np.asarray(got[b, t])[len(keys) :])


def test_selection_scores_only_the_keys_each_segment_can_see():
  # T = 24 in blocks of 3 rows: eight blocks in four segments of two, whose rows see at most
  # 6, 12, 18 and 24 keys; the indexer's dot products take exactly those key prefixes.
  _, _, _, iq, ik, iw = _inputs()
  text = str(jax.make_jaxpr(lambda *a: select_keys(*a, top_k=5, block_q=3))(iq, ik, iw))
  widths = {int(w) for w in re.findall(rf"f32\[{B},(\d+),{HI}\]", text)} - {T}
  assert widths == {6, 12, 18}, widths


def test_ties_go_to_the_lowest_key_whatever_the_length():
  # Zero head weights: every score is 0, so each query keeps its first top_k keys, at any T
  # (torch.topk's choice among equal scores changes with the row's length).
  for T_ in (20, 50, 300):
    iq = jnp.ones((1, T_, 2, 4))
    ik = jnp.ones((1, T_, 4))
    iw = jnp.zeros((1, T_, 2))
    got = np.asarray(select_keys(iq, ik, iw, top_k=4))
    for t in (3, 10, T_ - 1):
      want = list(range(min(t + 1, 4))) + [-1] * (4 - min(t + 1, 4))
      assert list(got[0, t]) == want, (T_, t)


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_top_k_of_every_key_is_dense_causal_attention(impl):
  q, k, v, iq, ik, iw = _inputs()
  dense = lambda q, k, v: attnjax.dot_product_attention(
    q, k, v, is_causal=True, implementation="reference"
  )
  for top_k in (T, 10 * T):  # top_k > S is clamped to S
    fn = lambda q, k, v: dsa_attention(q, k, v, iq, ik, iw, top_k=top_k, implementation=impl)
    tol = reduction_tolerance(jnp.float32, T * H, depth=6)
    assert_close(
      outputs_and_grads(fn, q, k, v),
      outputs_and_grads(dense, q, k, v),
      impl,
      rtol=tol,
      atol=tol,
      scaled=True,
    )


@pytest.mark.parametrize(
  "normalizer",
  # clipped softmax: row pre-passes (its log-normaliser, its backward row term over the keys)
  ["softmax", "clipped_softmax", pytest.param("sigmoid", marks=pytest.mark.slow)],
)
def test_blockwise_equals_reference(normalizer):
  q, k, v, iq, ik, iw = _inputs()
  seg = jnp.asarray(np.repeat([[0, 1]], [15, 9], axis=1).repeat(B, axis=0))

  def fn(impl, q, k, v):
    return dsa_attention(
      q,
      k,
      v,
      iq,
      ik,
      iw,
      top_k=6,
      normalizer=normalizer,
      segment_ids=seg,
      implementation=impl,
      return_stats=True,
    )

  want = outputs_and_grads(functools.partial(fn, "reference"), q, k, v)
  got = outputs_and_grads(functools.partial(fn, "blockwise"), q, k, v)
  tol = reduction_tolerance(jnp.float32, T * H, depth=6)
  assert_close(got, want, normalizer, rtol=tol, atol=tol, scaled=True)


def test_masks_come_before_the_top_k():
  # Each query attends only causal keys of its own segment, even where later or other-segment
  # keys score higher; a one-key row (the segment's first token) attends itself only.
  q, k, v, iq, ik, iw = _inputs()
  seg = jnp.asarray(np.repeat([[0, 1]], [10, 14], axis=1).repeat(B, axis=0))
  out = dsa_attention(q, k, v, iq, ik, iw, top_k=3, segment_ids=seg, implementation="blockwise")
  first = attnjax.dot_product_attention(q[:, 10:11], k[:, 10:11], v[:, 10:11])
  np.testing.assert_allclose(out[:, 10:11], first, rtol=1e-5, atol=1e-5)
  # Gradients reach only keys the selection allowed: none flows to a later key.
  g = jax.grad(lambda k: jnp.sum(dsa_attention(q, k, v, iq, ik, iw, top_k=3)[:, :5]))(k)
  assert not np.any(np.asarray(g)[:, 5:])


def test_indexer_loss_trains_the_indexer_only():
  q, k, _, iq, ik, iw = _inputs()
  for top_k in (None, 5):
    grads = jax.grad(lambda *a: indexer_loss(*a, top_k=top_k, block_q=8), argnums=(0, 1, 2, 3, 4))(
      q, k, iq, ik, iw
    )
    assert not np.any(np.asarray(grads[0])) and not np.any(np.asarray(grads[1])), top_k
    assert all(np.any(np.asarray(g)) for g in grads[2:]), top_k


@pytest.mark.parametrize("top_k", [None, 5])
def test_indexer_loss_definition(top_k):
  # mean_t KL(p_t || softmax(I_t)) over the allowed (and, sparse stage, selected) keys, p_t the
  # softmax attention summed over heads and L1-normalised; written with numpy loops.
  q, k, _, iq, ik, iw = _inputs()
  qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
  scores = np.asarray(index_scores(iq, ik, iw), np.float64)
  sel = brute_selection(iq, ik, iw, top_k or T)
  total, rows = 0.0, 0
  for b in range(B):
    for t in range(T):
      keys = sel[b, t]
      p = np.zeros(len(keys))
      for n in range(N):
        z = np.asarray([qn[b, t, n] @ kn[b, s, n // (N // K)] * H**-0.5 for s in keys])
        e = np.exp(z - z.max())
        p += e / e.sum()
      p /= p.sum()
      i = scores[b, t, keys]
      log_q = i - i.max() - np.log(np.exp(i - i.max()).sum())
      total += float(np.sum(p * (np.log(p) - log_q)))
      rows += 1
  got = indexer_loss(q, k, iq, ik, iw, top_k=top_k, block_q=7)
  np.testing.assert_allclose(got, total / rows, rtol=2e-5)


def test_blockwise_never_forms_a_T_by_S_array():
  Tl = 8192  # traced only; its [rows, NI, S] indexer tiles hold at most INDEX_TILE_BYTES
  q = jnp.zeros((1, Tl, 1, 4))
  iq, ik, iw = jnp.zeros((1, Tl, 2, 4)), jnp.zeros((1, Tl, 4)), jnp.zeros((1, Tl, 2))
  loss = lambda q, k, v: jnp.sum(
    dsa_attention(q, k, v, iq, ik, iw, top_k=16, implementation="blockwise")
  )
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q)
  from test_nsa import _sizes

  largest = max(_sizes(jaxpr.jaxpr, []))
  assert largest[0] <= Tl * Tl // 4, largest


def test_bad_input():
  q, k, v, iq, ik, iw = _inputs()
  with pytest.raises(ValueError, match=r"index_weights must be \[B, T, NI\].*got \(2, 24, 2\)"):
    dsa_attention(q, k, v, iq, ik, iw[..., :2])
  with pytest.raises(ValueError, match="top_k must be a positive int, got top_k=0"):
    dsa_attention(q, k, v, iq, ik, iw, top_k=0)
  with pytest.raises(ValueError, match=r"index_k must be \[B, S, HI\]"):
    dsa_attention(q, k, v, iq, ik[..., :2], iw)
  with pytest.raises(ValueError, match="same length"):
    dsa_attention(q[:, :8], k, v, iq[:, :8], ik, iw[:, :8])
  with pytest.raises(ValueError, match="segment_ids"):
    dsa_attention(q, k, v, iq, ik, iw, segment_ids=jnp.zeros((B, 5), jnp.int32))
  with pytest.raises(ValueError, match=r"index_weights must be \[B, T, NI\]"):
    indexer_loss(q, k, iq, ik, iw[..., :1])
