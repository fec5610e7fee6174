"""The examples in the public modules' docstrings run, as doctests.

Every ``>>>`` example of the modules in ``MODULES`` runs here, in this process (compiled
functions are shared with the rest of the suite), with ``ELLIPSIS`` and
``NORMALIZE_WHITESPACE``. The examples print shapes, booleans or rounded values, never
float digits a machine may change.

A literal ``::`` block in a docstring of ``attnjax/`` does not run: each one left is listed
in ``NOT_RUN`` with the reason (a checkpoint directory, several devices, a shell command, a
directory layout). A new one fails here until it is a doctest or listed with its reason.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import io
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each module whose docstrings hold examples, as the modules holding its docstrings: a public
# module's own docstring, and the implementation (under attnjax/_src) with its functions'.
MODULES = {
  "attnjax": ("attnjax",),
  "attnjax.compressed": ("attnjax.compressed", "attnjax._src.ops.compressed.attention"),
  "attnjax.mods": ("attnjax.mods", "attnjax._src.mods"),
  "attnjax.patterns": ("attnjax.patterns", "attnjax._src.patterns"),
  "attnjax.nn": ("attnjax.nn",),
  "attnjax.nn.kv_policies": ("attnjax.nn.kv_policies", "attnjax._src.nn.kv_policies"),
  "attnjax.nn.statistics": ("attnjax.nn.statistics", "attnjax._src.nn.statistics"),
  "attnjax.train.config": ("attnjax.train.config", "attnjax._src.train.config"),
  "attnjax.train.report": ("attnjax.train.report", "attnjax._src.train.report"),
  **{
    f"attnjax._src.nn.{name}": (f"attnjax._src.nn.{name}",)
    for name in ("config", "decode", "flax_interop", "transformer")
  },
}

# "file:docstring owner" -> why its literal block is not a doctest.
NOT_RUN = {
  "attnjax/_src/models/loader.py:from_pretrained": "needs a downloaded checkpoint directory",
  "attnjax/train/config.py:<module>": "a shell command",
  "attnjax/_src/train/pretrained.py:<module>": "a fragment of an experiment's main()",
}


def literal_blocks() -> list[str]:
  """``file:owner`` of every docstring of ``attnjax/`` that has a ``::`` literal block."""
  found = []
  for path in sorted((ROOT / "attnjax").rglob("*.py")):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        doc = ast.get_docstring(node, clean=False) or ""
        if any(line.rstrip().endswith("::") for line in doc.splitlines()):
          found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}")
  return found


def test_every_literal_block_left_says_why_it_does_not_run():
  blocks = literal_blocks()
  unlisted = [b for b in blocks if b not in NOT_RUN]
  assert not unlisted, f"make these examples doctests (>>>) or list them in NOT_RUN: {unlisted}"
  stale = [b for b in NOT_RUN if b not in blocks]
  assert not stale, f"NOT_RUN lists blocks that are gone: {stale}"


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
  tests = [
    t
    for module in MODULES[name]
    for t in doctest.DocTestFinder().find(importlib.import_module(module), module)
    if t.examples
  ]
  assert tests, f"{name} has no docstring example"
  out = io.StringIO()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  for test in tests:
    runner.run(test, out=out.write)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, out.getvalue()


# Module docstrings say what the module is in a few lines; the design essays live in
# docs/guides/.
MAX_MODULE_DOCSTRING_LINES = 12


def module_docstring_lines() -> dict[str, int]:
  """Lines of each ``attnjax/`` module's docstring, by path from the repository root."""
  counts = {}
  for path in sorted((ROOT / "attnjax").rglob("*.py")):
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    counts[str(path.relative_to(ROOT))] = len(doc.splitlines())
  return counts


def test_module_docstrings_are_at_most_12_lines():
  counts = module_docstring_lines()
  assert len(counts) > 100, len(counts)
  long = {p: n for p, n in counts.items() if n > MAX_MODULE_DOCSTRING_LINES}
  assert not long, (
    f"cut these module docstrings to {MAX_MODULE_DOCSTRING_LINES} lines; "
    f"the rest belongs in docs/guides/: {long}"
  )
