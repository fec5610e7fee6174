"""The import graph of attnjax: layers import only downwards, no cycles, no flax on import.

Layers (docs/guides/architecture.md): the functions layer (every module under
``attnjax/`` outside ``nn``, ``models``, ``train`` and ``data``, ``attnjax.stats``
included) imports no flax, no training libraries, no ``attnjax.nn`` /
``attnjax.train`` / ``attnjax.data`` and no ``experiments``; ``attnjax.data``
imports no flax, ``attnjax.nn``, ``attnjax.train`` or ``experiments``;
``attnjax.nn`` imports no ``attnjax.models``, ``attnjax.train`` or ``experiments``;
``attnjax.models`` imports no ``attnjax.train`` or ``experiments``;
``attnjax.train`` imports no ``experiments``. The graph is read with ``ast``
from every ``import`` / ``from ... import`` statement, at module level and
inside functions alike, so a deferred import cannot hide an upward edge. Each of
``nn``, ``models``, ``train`` and ``data`` is a layer twice over: its implementation
(``attnjax._src.nn``) and its public module (``attnjax.nn``) keep the same rule.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import subprocess
import sys
import textwrap

from attnjax._src import op as _op  # importing attnjax registers every family's op

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _both(*names: str) -> tuple[str, ...]:
  """Each package as implemented (``attnjax._src.x``) and as published (``attnjax.x``)."""
  return tuple(f"attnjax{infix}.{n}" for n in names for infix in ("._src", ""))


LAYERS = (  # (layer, module prefix, forbidden import prefixes); first match wins
  *[("nn", p, (*_both("models", "train"), "experiments")) for p in _both("nn")],
  *[("models", p, (*_both("train"), "experiments")) for p in _both("models")],
  *[("train", p, ("experiments",)) for p in _both("train")],
  *[("data", p, ("flax", *_both("nn", "models", "train"), "experiments")) for p in _both("data")],
  (
    "functions",
    "attnjax",
    (
      "flax",
      "optax",
      "orbax",
      "ml_collections",
      *_both("nn", "models", "train", "data"),
      "experiments",
    ),
  ),
)


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
  parts = list(path.relative_to(root).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def is_package(root: pathlib.Path, name: str) -> bool:
  return (root.joinpath(*name.split(".")) / "__init__.py").is_file()


def is_module(root: pathlib.Path, name: str) -> bool:
  return is_package(root, name) or root.joinpath(*name.split(".")).with_suffix(".py").is_file()


def package_of(root: pathlib.Path, path: pathlib.Path) -> str:
  """The package a relative import in ``path`` starts from (the module itself for ``__init__``)."""
  name = module_name(root, path)
  return name if path.name == "__init__.py" else name.rpartition(".")[0]


def from_source(package: str, node: ast.ImportFrom) -> str:
  """The absolute module of ``from ... import``, relative imports resolved against ``package``."""
  if not node.level:
    return node.module
  base = package.split(".")[: len(package.split(".")) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: pathlib.Path, path: pathlib.Path) -> set[str]:
  """Every module ``path`` imports (``from p import m`` gives ``p.m`` when that is a module)."""
  package = package_of(root, path)
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      source = from_source(package, node)
      for alias in node.names:
        sub = f"{source}.{alias.name}"
        found.add(sub if is_module(root, sub) else source)
  return found


def import_graph(root: pathlib.Path, package: str = "attnjax") -> dict[str, set[str]]:
  """``{module: modules it imports}`` for every module of ``package`` under ``root``."""
  return {
    module_name(root, p): imports_of(root, p) for p in sorted(root.joinpath(package).rglob("*.py"))
  }


def layer_of(module: str) -> tuple[str, tuple[str, ...]]:
  for layer, prefix, forbidden in LAYERS:
    if module == prefix or module.startswith(prefix + "."):
      return layer, forbidden
  raise AssertionError(f"{module} is in no layer")


def under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
  out = []
  for module, imported in sorted(graph.items()):
    layer, forbidden = layer_of(module)
    for target in sorted(imported):
      if any(under(target, f) for f in forbidden):
        out.append(f"{module} ({layer} layer) imports {target}")
  return out


def cycles(graph: dict[str, set[str]], package: str = "attnjax") -> list[list[str]]:
  """Strongly connected components with more than one module (or a self import), sorted."""
  nodes = sorted(graph)
  edges = {m: sorted(t for t in graph[m] if t in graph) for m in nodes}
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):  # Tarjan; the graph is small, recursion is fine
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1 or v in edges[v]:
        out.append(sorted(component))

  for v in nodes:
    if v not in index:
      visit(v)
  return sorted(out)


@functools.cache
def repo_graph() -> dict[str, set[str]]:
  """The repository's import graph, built once per process by the first test that reads it
  (not at collection: every pytest process collects this file, ~1 s of parsing)."""
  return import_graph(ROOT)


def test_the_graph_sees_module_and_function_level_imports():
  assert "attnjax._src.stats.sinks" in repo_graph() and "attnjax._src.nn.statistics" in repo_graph()
  assert "attnjax._src.stats.capture" in repo_graph()["attnjax._src.nn.statistics"]
  assert "flax" in repo_graph()["attnjax._src.nn.attention"]
  assert (
    "attnjax._src.train.metrics" in repo_graph()["attnjax._src.train.report"]
  )  # a function-level import


def test_checker_finds_upward_imports_and_cycles(tmp_path):
  pkg = tmp_path / "attnjax"
  (pkg / "nn").mkdir(parents=True)
  files = {
    "__init__.py": "",
    "a.py": "from attnjax import b\n",
    "b.py": "def f():\n  from attnjax.nn import layer\n  import flax\n",
    "c.py": "from . import a\n",
    "nn/__init__.py": "",
    "nn/layer.py": "from attnjax import c\n",
  }
  for name, text in files.items():
    (pkg / name).write_text(text)
  graph = import_graph(tmp_path)
  assert graph["attnjax.c"] == {"attnjax.a"}
  assert layer_violations(graph) == [
    "attnjax.b (functions layer) imports attnjax.nn.layer",
    "attnjax.b (functions layer) imports flax",
  ]
  assert cycles(graph) == [["attnjax.a", "attnjax.b", "attnjax.c", "attnjax.nn.layer"]]


def test_layers_import_only_downwards():
  assert layer_violations(repo_graph()) == []


def test_no_import_cycles():
  assert cycles(repo_graph()) == []


def reaches(graph: dict[str, set[str]], a: str, b: str) -> bool:
  """Whether module ``a`` imports ``b``, directly or through other attnjax modules."""
  seen, todo = set(), [a]
  while todo:
    m = todo.pop()
    for t in graph.get(m, ()):
      if t == b:
        return True
      if t not in seen:
        seen.add(t)
        todo.append(t)
  return False


def test_reaches():
  assert reaches({"a": {"b"}, "b": {"c"}, "c": set()}, "a", "c")
  assert not reaches({"a": {"b"}, "b": set(), "c": {"a"}}, "a", "c")


def test_layouts_sit_below_kernels_and_patterns():
  """Rules (masks, patterns) and layouts below kernels; kernels below dispatch."""
  for kernel in (
    "attnjax._src.kernels.blockwise",
    "attnjax._src.ops.sparse.attention",
    "attnjax._src.patterns",
    "attnjax._src.ops.dense.attention",
  ):
    assert not reaches(repo_graph(), "attnjax._src.layout", kernel), kernel
  assert not reaches(repo_graph(), "attnjax._src.patterns", "attnjax._src.kernels.blockwise")
  assert not reaches(
    repo_graph(), "attnjax._src.kernels.blockwise", "attnjax._src.ops.dense.attention"
  )
  assert not reaches(repo_graph(), "attnjax._src.normalizers", "attnjax._src.kernels.blockwise")


# Each registered op's modules (attnjax._src.ops.<op name>.*), and the module the recurrent
# families share.
FAMILIES = tuple(
  sorted(
    module_name(ROOT, p)
    for name in _op.OPS
    for p in ROOT.joinpath("attnjax", "_src", "ops", name).rglob("*.py")
  )
) + ("attnjax._src.ops.recurrence",)
VOCABULARY = (
  *(
    f"attnjax._src.{name}"
    for name in (
      "normalizers",
      "masks",
      "patterns",
      "layout",
      "mods",
      "feature_maps",
      "attention_stats",
      "options",
      "validators",
      "deprecation",
      "lowering",
      "target",
      "sharding",
      "numerics",
      "config",
      "trust",
    )
  ),
  "attnjax._version",
)


def engine_violations(graph: dict[str, set[str]]) -> list[str]:
  """Families import kernels, kernels never import families (nor does the shared vocabulary
  import either), directly or through other modules."""
  out = []
  kernels = sorted(m for m in graph if under(m, "attnjax._src.kernels"))
  for module in kernels:
    out += [f"{module} (kernel) reaches {f}" for f in FAMILIES if reaches(graph, module, f)]
  for module in VOCABULARY:
    out += [
      f"{module} (vocabulary) reaches {t}"
      for t in FAMILIES + tuple(kernels)
      if reaches(graph, module, t)
    ]
  return out


def test_engine_rule_finds_a_kernel_importing_a_family():
  sparse = "attnjax._src.ops.sparse.attention"
  graph = {
    "attnjax._src.kernels.x": {"attnjax._src.options"},
    "attnjax._src.options": {sparse},
    sparse: {"attnjax._src.kernels.x"},
  }
  assert engine_violations(graph) == [
    f"attnjax._src.kernels.x (kernel) reaches {sparse}",
    f"attnjax._src.options (vocabulary) reaches {sparse}",
    "attnjax._src.options (vocabulary) reaches attnjax._src.kernels.x",
  ]


def test_families_import_kernels_and_kernels_never_import_families():
  assert any(under(m, "attnjax._src.kernels") for m in repo_graph())
  assert "attnjax._src.kernels.blockwise.kernel" in repo_graph()["attnjax._src.ops.dense.attention"]
  assert engine_violations(repo_graph()) == []


def public_module_imports(graph: dict[str, set[str]]) -> list[str]:
  """``"module imports public"`` for each module under ``attnjax._src`` that imports a public
  module of attnjax (anything outside ``attnjax._src`` but the private ``attnjax._version``)."""
  out = []
  for module, imported in sorted(graph.items()):
    if not under(module, "attnjax._src"):
      continue
    for target in sorted(imported):
      public = under(target, "attnjax") and not under(target, "attnjax._src")
      if public and target != "attnjax._version":
        out.append(f"{module} imports {target}")
  return out


def test_the_public_module_check_sees_a_deferred_import(tmp_path):
  pkg = tmp_path / "attnjax"
  (pkg / "_src").mkdir(parents=True)
  files = {
    "__init__.py": "from attnjax._src import a\n",
    "_version.py": "",
    "stats.py": "from attnjax._src.a import f\n",
    "_src/__init__.py": "",
    "_src/a.py": "from attnjax import _version\ndef f():\n  import attnjax\n  from attnjax import stats\n",
  }
  for name, text in files.items():
    (pkg / name).write_text(text)
  assert public_module_imports(import_graph(tmp_path)) == [
    "attnjax._src.a imports attnjax",
    "attnjax._src.a imports attnjax.stats",
  ]


def test_no_module_of_the_implementation_imports_a_public_module():
  """The public modules re-export attnjax/_src; nothing under it reads them back (the
  implementation's config is ``attnjax._src.config``, its dense function
  ``attnjax._src.ops.dense.attention``)."""
  assert public_module_imports(repo_graph()) == []


def test_import_attnjax_loads_no_flax():
  code = textwrap.dedent("""
      import sys
      import attnjax
      import attnjax.stats, attnjax._src.stats.capture
      attnjax.stats.sink_rate
      assert "flax" not in sys.modules, "import attnjax loaded flax"
      assert "attnjax.nn" not in sys.modules and "attnjax._src.nn" not in sys.modules
      assert attnjax.nn.Attention.__name__ == "Attention"  # loads on first access
      assert "flax" in sys.modules
      import attnjax.nn.statistics
      assert attnjax.nn.statistics.layer_stats is attnjax.nn.layer_stats
      """)
  subprocess.run(
    [sys.executable, "-c", code],
    check=True,
    cwd=ROOT,
    env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
  )
