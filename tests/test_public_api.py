"""The public API is the reviewed list ``tests/public_api.txt``: no more, no less.

Each public module (every file under ``attnjax/`` outside ``attnjax/_src`` and private
modules) is a section of the file, its names one a line. A module's ``__all__`` is its one
name list: it equals the section, every public name ``dir()`` shows is in it (a package's
imported submodules apart), and ``attnjax.__all__`` is exactly what ``dir(attnjax)`` offers
(the packages loaded on first access included). A section with no names is a module of old
names only, whose ``__getattr__`` comes from ``attnjax/_src/old_names.py``. The plumbing the
public API once carried (static-option tuples, keyword lists, op records, CLI parsers, a
family's helpers) is named here so that it cannot come back unnoticed. Every listed module
is documented (``tests/test_docs_api.py`` reads the same modules).
"""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
import textwrap
import types

import pytest

import attnjax
from attnjax._src import old_names

from test_docs_api import public_modules as documented_modules

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "public_api.txt"

# Plumbing removed from the public modules: never public again.
PLUMBING = {
  "attnjax.dense": [
    "DENSE_STATIC",
    "OP",
    "Engine",
    "ENGINES",
    "PREFERENCES",
    "FALLBACK",
    "prepare",
  ],
  "attnjax.sparse": ["SPARSE_STATIC", "DENSE_KEYWORDS", "OP", "CHUNK_BLOCKS", "block_sparse"],
  "attnjax.linear": ["LINEAR_STATIC", "OP", "finish", "parallel"],
  "attnjax.gated_linear": ["GATED_LINEAR_STATIC", "OP", "SUB_BLOCK", "parallel"],
  "attnjax.delta_rule": ["DELTA_STATIC", "OP", "parallel"],
  "attnjax.compressed": ["DENSE_KEYWORDS", "OP", "ENGINES"],
  "attnjax.block_select": ["DENSE_KEYWORDS", "BLOCK_SELECT_STATIC", "OP", "ENGINES"],
  "attnjax.mla": ["DENSE_KEYWORDS", "OP", "ENGINES", "PREFERENCES", "LatentCall"],
  "attnjax.qk_norm": ["QK_NORM_KEYWORDS", "COSINE_KEYWORDS", "RENAMED_KEYWORDS"],
  "attnjax.cosine": ["COSINE_KEYWORDS"],
  "attnjax.options": ["INTERNAL_OPTIONS", "KERNEL_INPUTS", "array_refusals", "keywords", "static"],
  "attnjax.check": ["parser", "main", "write", "qkv"],
  "attnjax.train.cli": ["csv", "finish"],
}


def listed() -> dict[str, list[str]]:
  """``{module: [names]}`` of tests/public_api.txt, in its order."""
  out: dict[str, list[str]] = {}
  current = None
  for n, line in enumerate(LIST.read_text().splitlines(), 1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    if line.startswith("[") and line.endswith("]"):
      current = line[1:-1]
      assert current not in out, f"public_api.txt:{n}: {current} listed twice"
      out[current] = []
    else:
      assert current, f"public_api.txt:{n}: a name before any [module]"
      assert line not in out[current], f"public_api.txt:{n}: {line} listed twice"
      out[current].append(line)
  return out


def public_module_files() -> list[str]:
  names = []
  for path in sorted((ROOT / "attnjax").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if "_src" in parts or any(p.startswith("_") and p != "__init__" for p in parts):
      continue
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


def offered(module: types.ModuleType) -> set[str]:
  """The public names ``dir(module)`` shows, less a package's submodules."""
  return {
    name
    for name in dir(module)
    if not name.startswith("_")
    and not (
      isinstance(getattr(module, name), types.ModuleType)
      and getattr(module, name).__name__ == f"{module.__name__}.{name}"
      and hasattr(module, "__path__")
      and name not in module.__all__
    )
  }


def test_every_public_module_is_listed():
  assert sorted(listed()) == sorted(public_module_files())


@pytest.mark.parametrize("name", public_module_files())
def test_each_module_offers_exactly_its_reviewed_names(name):
  module = importlib.import_module(name)
  names = listed()[name]
  assert sorted(module.__all__) == sorted(names), (
    f"{name}.__all__ differs from tests/public_api.txt: added "
    f"{sorted(set(module.__all__) - set(names))}, removed {sorted(set(names) - set(module.__all__))}"
  )
  assert offered(module) <= set(module.__all__), sorted(offered(module) - set(module.__all__))
  for n in names:
    getattr(module, n)  # each resolves (a lazy package loads)
  if not names and not hasattr(module, "__path__"):  # a module of old names only
    getattr_ = vars(module).get("__getattr__")
    assert getattr_ is not None and getattr_.old_names, name
    assert getattr_ in vars(old_names).values()


def test_dir_of_attnjax_is_its_all():
  # In a fresh process, before any lazy package loads, and after they all do.
  code = textwrap.dedent("""
      import sys, attnjax
      before = sorted(n for n in dir(attnjax) if not n.startswith("_"))
      assert before == sorted(attnjax.__all__), set(before) ^ set(attnjax.__all__)
      assert "flax" not in sys.modules
      for n in attnjax.__all__:
        getattr(attnjax, n)
      after = sorted(n for n in dir(attnjax) if not n.startswith("_"))
      assert after == before, set(after) ^ set(before)
      """)
  subprocess.run(
    [sys.executable, "-c", code],
    check=True,
    cwd=ROOT,
    env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )
  assert set(attnjax.__all__) >= {"data", "train", "nn", "models", "kernels", "check"}


def test_every_listed_module_with_names_is_documented():
  with_names = {m for m, names in listed().items() if names}
  assert with_names <= set(documented_modules()), with_names - set(documented_modules())


@pytest.mark.parametrize("module", sorted(PLUMBING))
def test_no_plumbing_is_public(module):
  public = importlib.import_module(module)
  assert not set(PLUMBING[module]) & set(public.__all__)
  assert not set(PLUMBING[module]) & set(listed()[module])
