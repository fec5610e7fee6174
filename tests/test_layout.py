"""Block layouts (``attnjax.layout``).

Layouts are static structure: which (query block, key block) pairs a kernel
computes, which of them need an element mask, and how segment ids classify
blocks at run time. That layouts sit below kernels in the import graph is
checked in ``test_imports.py``.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src import layout, patterns


def test_structural_layout_skips_blocks():
  causal = layout.structural_layout(4096, 4096, 512, 512, is_causal=True)
  assert causal.num_pairs == 36  # of 64: the upper triangle is never computed
  assert sum(nm for row in causal.needs_mask for nm in row) == 8  # only diagonal blocks masked
  window = layout.structural_layout(16384, 16384, 512, 512, window=(256, 0))
  assert window.num_pairs == 32 + 31  # each query block: its diagonal block and the previous
  assert layout.structural_layout(100, 100, 32, 32).num_pairs == 16  # no structure: all
  # T > S with a window: the last query blocks reach no key at all.
  empty = layout.structural_layout(64, 16, 16, 16, is_causal=True, window=(3, 0))
  assert [len(empty.visits(i)) for i in range(4)] == [1, 1, 0, 0]


def test_segment_block_relations():
  lay = layout.structural_layout(12, 12, 4, 4)
  ids = jnp.asarray([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
  rel = np.asarray(layout.segment_block_relations(ids, ids, lay))
  S, F, M = layout.SKIP, layout.FULL, layout.MASKED
  np.testing.assert_array_equal(rel, [[F, M, S], [M, M, M], [S, M, F]])


def test_block_layout_validation():
  with pytest.raises(ValueError, match="visits a key block twice"):
    layout.BlockLayout.from_visits(8, 8, 4, 4, [[(0, False), (0, True)], []])
  with pytest.raises(ValueError, match="one row per query block"):
    layout.BlockLayout.from_visits(8, 8, 4, 4, [[(0, False)]])
  with pytest.raises(ValueError, match=r"\[0, 2\)"):
    layout.BlockLayout.from_visits(8, 8, 4, 4, [[(2, False)], []])
  with pytest.raises(ValueError, match="q_len must be a positive int"):
    layout.BlockLayout(0, 8, 4, 4, (), ())


def test_rule_layout_of_a_pattern_is_the_pattern_layout():
  pattern = patterns.sliding_window(5) | patterns.sinks_window(2, 3)
  lay = layout.rule_layout(pattern, 40, 40, 8)
  assert lay == pattern.layout(40, block_size=8)
  mask = np.asarray(pattern.mask(40))[0, 0]
  blocks = mask.reshape(5, 8, 5, 8)
  np.testing.assert_array_equal(layout.kept_blocks(lay), blocks.any(axis=(1, 3)))
  np.testing.assert_array_equal(layout.full_blocks(lay), blocks.all(axis=(1, 3)))
  assert layout.density(lay) == blocks.any(axis=(1, 3)).mean()


def test_key_block_candidates():
  got = layout.key_block_candidates([(-3, 2), (9, 11), (30, 50)], 33, 4)
  want = np.zeros(9, bool)
  want[[0, 2, 7, 8]] = True
  np.testing.assert_array_equal(got, want)
