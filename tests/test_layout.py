"""Block layouts (``attnjax.layout``) and the import graph of the functions layer.

Layouts are static structure: which (query block, key block) pairs a kernel
computes, which of them need an element mask, and how segment ids classify
blocks at run time. The import-graph test holds the functions layer to a DAG:
rules (masks, patterns) and layouts below kernels, kernels below dispatch.
"""

import ast
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from attnjax import layout, patterns


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


# ---------------------------------------------------------------------------
# The import graph of the functions layer.

ROOT = pathlib.Path(__file__).resolve().parents[1] / "attnjax"
# Layers above the functions layer: their own imports are checked by their own tests.
ABOVE = ("nn", "train", "data")


def _module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT.parent).with_suffix("")
  parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
  return ".".join(parts)


def _attnjax_imports(path: pathlib.Path, modules) -> set:
  """``attnjax.*`` modules a file imports, at module level and inside functions.

  ``from attnjax import dense`` imports the submodule ``attnjax.dense``;
  ``from attnjax import name`` of a non-module (and ``import attnjax``) imports
  the package itself, whose ``__init__`` imports every function module.
  """
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.split(".")[0] == "attnjax")
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split(".")[0] != "attnjax":
        continue
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in modules else node.module)
  return found


def import_graph() -> dict:
  """``{module: set of attnjax modules it imports}`` over the functions layer."""
  files = [p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] not in ABOVE]
  nodes = {_module_name(p): p for p in files}
  every = {_module_name(p) for p in ROOT.rglob("*.py")}
  return {name: {m for m in _attnjax_imports(path, every) if m in nodes and m != name}
          for name, path in nodes.items()}


def find_cycle(graph: dict):
  """A list of modules forming a cycle, or None."""
  state = {}
  stack = []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for m in sorted(graph[n]):
      if state.get(m) == "open":
        return stack[stack.index(m):] + [m]
      if m not in state:
        cycle = visit(m)
        if cycle:
          return cycle
    state[n] = "done"
    stack.pop()
    return None

  for n in sorted(graph):
    if n not in state:
      cycle = visit(n)
      if cycle:
        return cycle
  return None


def test_find_cycle_finds_one():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_functions_layer_has_no_import_cycle():
  graph = import_graph()
  assert {"attnjax.dense", "attnjax.blockwise", "attnjax.layout", "attnjax.patterns"} <= set(graph)
  # The package's __init__ imports everything; a submodule importing the package back is a cycle.
  assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_layouts_sit_below_kernels_and_patterns():
  graph = import_graph()

  def reaches(a, b, seen=()):
    return b in graph[a] or any(reaches(m, b, seen + (a,)) for m in graph[a] if m not in seen)

  assert not any(reaches("attnjax.layout", m) for m in
                 ("attnjax.blockwise", "attnjax.sparse", "attnjax.patterns", "attnjax.dense"))
  assert not reaches("attnjax.patterns", "attnjax.blockwise")
  assert not reaches("attnjax.blockwise", "attnjax.dense")
