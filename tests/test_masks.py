"""Mask builders against brute-force loops."""

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src import masks


def brute(T, S, rule):
  return np.array([[rule(i, j) for j in range(S)] for i in range(T)], bool)[None, None]


@pytest.mark.parametrize("T,S,offset", [(5, 5, 0), (4, 7, 0), (4, 7, 3), (7, 4, 0)])
def test_causal_mask(T, S, offset):
  np.testing.assert_array_equal(
    masks.causal_mask(T, S, offset=offset), brute(T, S, lambda i, j: j <= i + offset)
  )


@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (10, 10)])
def test_window_mask(left, right):
  np.testing.assert_array_equal(
    masks.window_mask(6, 8, left, right), brute(6, 8, lambda i, j: i - left <= j <= i + right)
  )


def test_segment_and_padding_masks():
  seg = jnp.array([[0, 0, 1, 1, 1], [2, 2, 2, 2, 3]])
  m = masks.segment_mask(seg)
  for b in range(2):
    np.testing.assert_array_equal(m[b, 0], np.asarray(seg[b])[:, None] == np.asarray(seg[b])[None])
  p = masks.padding_mask(jnp.array([2, 3]), jnp.array([4, 1]), 3, 5)
  assert p.shape == (2, 1, 3, 5)
  np.testing.assert_array_equal(p[0, 0], brute(3, 5, lambda i, j: i < 2 and j < 4)[0, 0])
  np.testing.assert_array_equal(p[1, 0], brute(3, 5, lambda i, j: i < 3 and j < 1)[0, 0])


def test_combine_masks_and_make_attention_mask():
  seg = jnp.array([[0, 0, 0, 1, 1, 1]])
  explicit = jnp.ones((6, 6), bool).at[:, 1].set(False)
  full = masks.make_attention_mask(
    6, 6, mask=explicit, is_causal=True, window=(1, 0), q_segment_ids=seg, kv_segment_ids=seg
  )
  ref = brute(6, 6, lambda i, j: j != 1 and i - 1 <= j <= i and (i < 3) == (j < 3))
  np.testing.assert_array_equal(full, ref)
  assert masks.make_attention_mask(3, 3) is None
  assert masks.combine_masks(None, None) is None
  with pytest.raises(TypeError, match="boolean"):
    masks.combine_masks(jnp.ones((2, 2)))


def test_mask_errors():
  with pytest.raises(ValueError, match="non-negative"):
    masks.window_mask(4, 4, -1)
  with pytest.raises(ValueError, match=r"\[B, T\] and \[B, S\]"):
    masks.segment_mask(jnp.zeros((2, 3), int), jnp.zeros((3, 3), int))
  with pytest.raises(ValueError, match="lengths must be"):
    masks.padding_mask(jnp.zeros((2, 1), int), None, 3, 3)
