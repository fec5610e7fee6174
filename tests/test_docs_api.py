"""Every public name of attnjax has an entry in the API reference (``docs/api/*.md``).

The reference is written as MyST pages whose ``{eval-rst}`` blocks hold
``.. automodule::`` (one per public module) and ``.. autosummary::`` lists of names
under a ``.. currentmodule::``; Sphinx generates a page per listed name. This test
reads those sources (no build): a public name is covered when some listed entry is
the same object (a re-export such as ``attnjax.stats.sink_rate`` of
``attnjax.stats.sinks.sink_rate`` is documented once, where users import it).

Public names: a module's ``__all__``, or, without one, the classes and functions it
defines whose names have no leading underscore and the constants (``UPPER_CASE`` names)
it assigns at module level. Public modules: :data:`PUBLIC_MODULES`, plus every package
of attnjax that declares ``__all__``. Scalars (numbers, strings) are only covered by an
entry of their own module (two equal numbers may be one object).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import types

import pytest

import attnjax
from attnjax._src import op as _op

ROOT = pathlib.Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"

PUBLIC_MODULES = (
  "attnjax",
  # Families: each registered op's module, and dense's front ends.
  *sorted(f"attnjax.{name}" for name in _op.OPS),
  "attnjax.qk_norm",
  # Shared vocabulary.
  "attnjax.normalizers",
  "attnjax.masks",
  "attnjax.patterns",
  "attnjax.mods",
  "attnjax.layout",
  "attnjax.feature_maps",
  "attnjax.attention_stats",
  "attnjax.options",
  "attnjax.parallel",
  # Engines (each package's entry points).
  "attnjax.kernels",
  "attnjax.kernels.blockwise",
  "attnjax.kernels.pallas_gpu",
  "attnjax.kernels.pallas_tpu",
  "attnjax.kernels.mosaic_gpu",
  "attnjax.kernels.splash",
  "attnjax.kernels.jax_nn",
  # Settings and the device check (``python -m attnjax.check``).
  "attnjax.check",
  # Modules, diagnostics, data, training, targets.
  "attnjax.nn",
  "attnjax.nn.specs",
  "attnjax.nn.kv_policies",
  "attnjax.nn.statistics",
  "attnjax.nn.intermediates",
  "attnjax.stats",
  "attnjax.data",
  "attnjax.train",
  "attnjax.train.config",
  "attnjax.train.launch",
  "attnjax.train.metrics",
  "attnjax.train.mesh",
  "attnjax.train.sweep",
  "attnjax.train.report",
  "attnjax.train.rundir",
  "attnjax.train.variants",
  "attnjax.train.cli",
  "attnjax.train.plots",
  "attnjax.train.mfu",
  "attnjax.targets",
)
# Pretrained checkpoints: documented once the package exists.
OPTIONAL_MODULES = ("attnjax.models", "attnjax.models.architectures")


def public_modules() -> list[str]:
  names = list(PUBLIC_MODULES)
  names += [m for m in OPTIONAL_MODULES if importlib.util.find_spec(m) is not None]
  return names


def constants(module: types.ModuleType) -> list[str]:
  """``UPPER_CASE`` names assigned at the top level of the module's source."""
  tree = ast.parse(pathlib.Path(module.__file__).read_text())
  names = []
  for node in tree.body:
    targets = (
      node.targets
      if isinstance(node, ast.Assign)
      else [node.target]
      if isinstance(node, ast.AnnAssign)
      else []
    )
    for target in targets:
      if isinstance(target, ast.Name) and re.fullmatch(r"[A-Z][A-Z0-9_]*", target.id):
        names.append(target.id)
  return [n for n in dict.fromkeys(names) if hasattr(module, n)]


def public_names(module: types.ModuleType) -> list[str]:
  """``__all__``, else the classes and functions the module defines and its constants."""
  if hasattr(module, "__all__"):
    return list(module.__all__)
  defined = [
    name
    for name, obj in vars(module).items()
    if not name.startswith("_")
    and (inspect.isclass(obj) or callable(obj))
    and not isinstance(obj, types.ModuleType)
    and getattr(obj, "__module__", None) == module.__name__
  ]
  return defined + [n for n in constants(module) if n not in defined]


def rst_blocks(text: str) -> list[str]:
  return re.findall(r"```\{eval-rst\}\n(.*?)\n```", text, flags=re.S)


def documented() -> tuple[set[str], dict[str, str]]:
  """(modules with an ``automodule``, {dotted name: page} of every autosummary entry)."""
  modules: set[str] = set()
  entries: dict[str, str] = {}
  for page in sorted(API.glob("*.md")):
    for block in rst_blocks(page.read_text()):
      current = None
      lines = block.splitlines()
      for i, line in enumerate(lines):
        if m := re.match(r"\.\. automodule:: (\S+)", line):
          modules.add(m.group(1))
        elif m := re.match(r"\.\. currentmodule:: (\S+)", line):
          current = m.group(1)
        elif line.startswith(".. autosummary::"):
          for entry in lines[i + 1 :]:
            if entry and not entry.startswith("   "):
              break
            name = entry.strip()
            if name and not name.startswith(":"):
              assert current, f"{page.name}: autosummary before any currentmodule"
              entries[f"{current}.{name}"] = page.name
  # The page of an optional package not written yet (docs/conf.py leaves it out of the site).
  absent = [m for m in OPTIONAL_MODULES if m not in public_modules()]
  entries = {k: v for k, v in entries.items() if k.rpartition(".")[0] not in absent}
  return modules - set(absent), entries


def resolve(dotted: str):
  module, _, name = dotted.rpartition(".")
  return getattr(importlib.import_module(module), name)


def test_the_reference_lists_names():
  modules, entries = documented()
  assert "attnjax" in modules and "attnjax.dot_product_attention" in entries
  assert len(entries) > 200, len(entries)


def test_every_package_with_all_is_a_public_module():
  missing = []
  for info in pkgutil.walk_packages(attnjax.__path__, "attnjax."):
    if any(part.startswith("_") for part in info.name.split(".")) or not info.ispkg:
      continue
    if (
      hasattr(importlib.import_module(info.name), "__all__")
      and info.name not in PUBLIC_MODULES + OPTIONAL_MODULES
    ):
      missing.append(info.name)
  assert not missing, f"packages with __all__ missing from PUBLIC_MODULES: {missing}"


@pytest.mark.parametrize("module_name", public_modules())
def test_every_public_name_has_a_page(module_name):
  modules, entries = documented()
  assert module_name in modules, f"docs/api has no '.. automodule:: {module_name}'"
  by_id = {}
  for dotted in entries:
    by_id.setdefault(id(resolve(dotted)), []).append(dotted)
  module = importlib.import_module(module_name)
  missing = []
  for name in public_names(module):
    obj = getattr(module, name)
    if isinstance(obj, types.ModuleType):
      if obj.__name__ not in modules:
        missing.append(f"{name} (module {obj.__name__}: no automodule)")
    elif f"{module_name}.{name}" in entries:
      continue
    elif isinstance(obj, (int, float, str, bool, type(None))) or id(obj) not in by_id:
      missing.append(name)
  assert not missing, f"{module_name}: no API entry for {missing}"


def test_every_entry_names_a_public_object():
  _, entries = documented()
  bad = []
  for dotted, page in entries.items():
    try:
      resolve(dotted)
    except (AttributeError, ImportError) as e:
      bad.append(f"{page}: {dotted} ({e})")
  assert not bad, bad


def test_entries_without_a_generated_page_are_documented_on_their_module_page():
  """An autosummary without ``:toctree:`` links to an ``auto*`` entry of the same page."""
  missing = []
  for page in sorted(API.glob("*.md")):
    for block in rst_blocks(page.read_text()):
      if ":toctree:" in block:
        continue
      listed = set(re.findall(r"^   (\w+)$", block, flags=re.M))
      described = set(re.findall(r"^\.\. auto(?:function|class|data):: (\w+)", block, flags=re.M))
      missing += [f"{page.name}: {name}" for name in sorted(listed - described)]
  assert not missing, missing
