"""The package's metadata is readable without its dependencies.

pip builds an editable or regular install in an isolated environment holding only the build
backend, so the version that ``pyproject.toml`` names must be readable without importing
attnjax (whose ``__init__`` imports jax). setuptools reads an ``attr:`` statically when the
named module assigns a literal; this test holds the module to that.
"""

from __future__ import annotations

import ast
import pathlib
import tomllib

import attnjax

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_version_is_a_literal_in_a_module_that_imports_nothing():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  module, _, name = attr.rpartition(".")
  path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
  tree = ast.parse(path.read_text())
  assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], (
    f"{path.name} imports: the build backend would need attnjax's dependencies"
  )
  values = [
    n.value.value
    for n in tree.body
    if isinstance(n, ast.Assign)
    and [t.id for t in n.targets if isinstance(t, ast.Name)] == [name]
    and isinstance(n.value, ast.Constant)
  ]
  assert values == [attnjax.__version__]
