"""No private name crosses a package directory: a module's ``_x`` is for its own package.

Every module under ``attnjax/`` and ``experiments/`` (``tests/`` are exempt) is
read with ``ast``. A module may use an underscore name (``_x``; dunders such as
``__version__`` are public, and so are the NamedTuple methods ``_replace``,
``_asdict``, ``_make``, ``_fields``, ``_field_defaults``) only when the name
belongs to a module of its own package directory. It is a violation to:

- import one from elsewhere: ``from attnjax.train.plots import _save`` in
  ``experiments/``, ``from attnjax import _checks`` in ``attnjax/_src/nn/``, or a
  path through one (``import jax._src.mesh``, ``from attnjax.stats.inputs
  import shape``); relative imports are resolved first;
- read one as an attribute of a name bound by an import (a module, a class,
  a function), or of a variable assigned straight from calling one:
  ``plots._save(...)``, ``Trainer._manager``, ``trainer = Trainer(cfg)`` then
  ``trainer._manager()``, ``getattr(plots, "_save")``.

Where a name belongs: to the directory of the module that defines it (the
package's own directory for a package ``__init__``); a private *module*
(``attnjax._checks``, ``attnjax._lowering``) belongs to its package and every
package below it, as in Python's convention (so ``attnjax.nn`` may import
``attnjax._checks``, ``experiments/`` may not). The allowed list is empty: a name
another package needs is made public (a proper name and a docstring) or moved.

Private names of other projects (``jax._src``) are not ours to rename, but each use
is a dependence on internals that may change in any jax release: every one must be
listed in :data:`JAX_INTERNALS` with the reason jax's public API does not serve,
and each listed use must still exist (each is reached through one shim).
"""

from __future__ import annotations

import ast
import pathlib
import re

from test_imports import ROOT, from_source, is_module, is_package, module_name, package_of

SOURCES = ("attnjax", "experiments")
# Public API of every NamedTuple despite the underscore (it avoids clashing with field names).
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_make", "_fields", "_field_defaults"})
ATTRIBUTE_FUNCTIONS = ("getattr", "hasattr", "setattr", "delattr")
ALLOWED: frozenset[str] = frozenset()  # "path:line: name" entries; empty by design
# "path: dotted name" of each use of another project's private names, and why.
JAX_INTERNALS: dict[str, str] = {
  "experiments/kernel_report.py: jax.experimental.mosaic.gpu.core._launch": (
    "the kernel report's shared-memory and thread counts: jax's Mosaic GPU core computes them "
    "while lowering and has no public query (the report prints '?' where it is missing)"
  ),
  "experiments/kernel_report.py: jax.experimental.mosaic.gpu.core._lower_as_gpu_kernel": (
    "the kernel report: which kernel a launch belongs to (its kernel_name), for the same reason"
  ),
  "experiments/kernel_report.py: tokamax._src.ops.attention.pallas_mosaic_gpu_kernel_sm90": (
    "the kernel report compiles tokamax's sm90 forward kernel itself (tokamax's public op "
    "picks a kernel by the local GPU, which a deviceless compile has not)"
  ),
  "experiments/kernel_report.py: tokamax._src.ops.attention.pallas_mosaic_gpu_vjp_kernel_sm90": (
    "the kernel report compiles tokamax's sm90 backward kernels, for the same reason"
  ),
  "experiments/kernel_report.py: tokamax._src.ops.attention.pallas_mosaic_gpu_vjp_common": (
    "the backward kernels' Config, for the same reason"
  ),
  "attnjax/_src/lowering.py: jax._src.config": (
    "device_context on jax 0.10.2: host_eval runs eager work on this host inside a trace "
    "under jax.set_mesh, and jax has no public way out of the concrete mesh"
  ),
  "attnjax/_src/lowering.py: jax._src.mesh": (
    "device_context on jax 0.12 and empty_concrete_mesh on both, for the same reason"
  ),
  "attnjax/_src/target.py: jax._src.cudnn.fused_attention_stablehlo": (
    "check_cudnn_version: whether jax can trace its cuDNN attention on this host; jax has "
    "no public query for it"
  ),
  "attnjax/_src/kernels/mosaic_gpu/plan.py: "
  "jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams": (
    "the Mosaic GPU interpreter's parameters on jax 0.10.2 (jax 0.12 exports them from "
    "jax.experimental.pallas.mosaic_gpu, which the shim takes first)"
  ),
  "attnjax/_src/kernels/selected/gpu.py: "
  "jax._src.pallas.mosaic_gpu.interpret.params.InterpretGPUParams": (
    "the selected-block kernels' interpreter parameters on jax 0.10.2, for the same reason "
    "(their package keeps its own shim)"
  ),
}


def is_private(name: str) -> bool:
  dunder = name.startswith("__") and name.endswith("__")
  return name.startswith("_") and not dunder and name not in NAMEDTUPLE_API


def home(root: pathlib.Path, dotted: str) -> str:
  """The directory (relative to ``root``) owning the names defined in or on ``dotted``.

  That of the longest prefix of ``dotted`` that is a module of ours (a package
  owns its own directory, a module file its parent's); ``external:<top>`` for
  a name from outside the repository.
  """
  parts = dotted.split(".")
  for n in range(len(parts), 0, -1):
    name = ".".join(parts[:n])
    if is_module(root, name):
      folder = parts[:n] if is_package(root, name) else parts[: n - 1]
      return "/".join(folder) or "."
  return f"external:{parts[0]}"


class Finder(ast.NodeVisitor):
  """Collects the private names one module takes from other package directories."""

  def __init__(self, root: pathlib.Path, path: pathlib.Path):
    self.root, self.path = root, path
    self.here = path.parent.relative_to(root).as_posix()
    self.package = package_of(root, path)
    self.bound: dict[str, str] = {}  # local name -> the dotted path it stands for
    self.found: list[str] = []
    self.internals: set[str] = set()  # "path: dotted" uses of another project's private names

  def where(self) -> str:
    return self.path.relative_to(self.root).as_posix()

  def external_private(self, dotted: str) -> bool:
    """Whether ``dotted`` is another project's and passes through a private name."""
    return home(self.root, dotted).startswith("external:") and any(
      is_private(part) for part in dotted.split(".")
    )

  def check(self, node: ast.AST, owner: str, name: str) -> None:
    """Records ``name`` (read from ``owner``, a dotted path) unless it is public or ours."""
    if not is_private(name):
      return
    owner_home = home(self.root, owner)
    if owner_home.startswith("external:"):
      self.internals.add(f"{self.where()}: {owner}.{name}")  # not ours: JAX_INTERNALS
      return
    if is_module(self.root, f"{owner}.{name}"):  # a private module is its package tree's
      if self.here == owner_home or self.here.startswith(owner_home + "/"):
        return
    elif owner_home == self.here:
      return
    self.found.append(f"{self.where()}:{node.lineno}: {name} (from {owner})")

  def check_path(self, node: ast.AST, dotted: str) -> None:
    """Each private component of a module path, owned by the path before it."""
    parts = dotted.split(".")
    for i in range(1, len(parts)):
      self.check(node, ".".join(parts[:i]), parts[i])

  def visit_Import(self, node: ast.Import) -> None:
    for alias in node.names:
      if self.external_private(alias.name):
        self.internals.add(f"{self.where()}: {alias.name}")
      else:
        self.check_path(node, alias.name)
      if alias.asname:
        self.bound[alias.asname] = alias.name
      else:
        top = alias.name.split(".")[0]
        self.bound[top] = top

  def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
    source = from_source(self.package, node)
    external = self.external_private(source)
    if not external:
      self.check_path(node, source)
    for alias in node.names:
      if alias.name == "*":
        continue
      if external:
        self.internals.add(f"{self.where()}: {source}.{alias.name}")
      else:
        self.check(node, source, alias.name)
      self.bound[alias.asname or alias.name] = f"{source}.{alias.name}"

  def dotted(self, node: ast.AST) -> str | None:
    """The dotted path a ``Name`` / ``Attribute`` chain stands for, if it starts at a bound name."""
    if isinstance(node, ast.Name):
      return self.bound.get(node.id)
    if isinstance(node, ast.Attribute):
      base = self.dotted(node.value)
      return None if base is None else f"{base}.{node.attr}"
    return None

  def visit_Attribute(self, node: ast.Attribute) -> None:
    full = self.dotted(node)
    if full is not None and self.external_private(full):
      root = node
      while isinstance(root, ast.Attribute):
        root = root.value
      if not self.external_private(self.bound[root.id]):  # else counted at its import
        self.internals.add(f"{self.where()}: {full}")  # the whole chain, once
      return
    base = self.dotted(node.value)
    if base is not None:
      self.check(node, base, node.attr)
    self.generic_visit(node)

  def visit_Call(self, node: ast.Call) -> None:
    if (
      isinstance(node.func, ast.Name)
      and node.func.id in ATTRIBUTE_FUNCTIONS
      and len(node.args) >= 2
      and isinstance(node.args[1], ast.Constant)
      and isinstance(node.args[1].value, str)
    ):
      base = self.dotted(node.args[0])
      if base is not None:
        self.check(node, base, node.args[1].value)
    self.generic_visit(node)

  def visit_Assign(self, node: ast.Assign) -> None:
    # ``x = Imported(...)``: x is an instance of (or a result from) the import's module.
    if (
      len(node.targets) == 1
      and isinstance(node.targets[0], ast.Name)
      and isinstance(node.value, ast.Call)
    ):
      made_by = self.dotted(node.value.func)
      if made_by is not None:
        self.bound[node.targets[0].id] = made_by
    self.generic_visit(node)


def _finder(root: pathlib.Path, path: pathlib.Path) -> Finder:
  tree = ast.parse(path.read_text(), str(path))
  finder = Finder(root, path)
  # Imports first (a module-level import may follow the function that uses it).
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      finder.visit(node)
  finder.found = []
  finder.visit(tree)
  return finder


def private_uses(root: pathlib.Path, path: pathlib.Path) -> list[str]:
  """``"path:line: name (from owner)"`` for every private name ``path`` takes from elsewhere."""
  return _finder(root, path).found


def internal_uses(root: pathlib.Path, path: pathlib.Path) -> list[str]:
  """``"path: dotted"`` for every private name of another project ``path`` uses, sorted."""
  return sorted(_finder(root, path).internals)


def offenders(root: pathlib.Path) -> list[str]:
  out = []
  for source in SOURCES:
    for path in sorted(root.joinpath(source).rglob("*.py")):
      out.extend(private_uses(root, path))
  return [o for o in out if o not in ALLOWED]


def test_the_finder_sees_each_form_and_allows_its_own_package(tmp_path):
  files = {
    "pkg/__init__.py": "",
    "pkg/_util.py": "def _helper(): ...\ndef public(): ...\n",
    "pkg/same.py": (
      "from pkg import _util\nfrom pkg._util import _helper\n"
      "from . import _util as u\nu._helper()\n"
    ),
    "pkg/sub/__init__.py": "from pkg import __version__\n",
    "pkg/sub/own.py": "from pkg.sub import _mine\nfrom . import _mine as m\n",
    "app/__init__.py": "",
    "app/main.py": "from pkg import _util\nfrom pkg._util import _helper\n",
    "pkg/sub/other.py": (
      "import pkg._util\n"
      "from pkg import _util\n"
      "from .._util import public\n"
      "from pkg.same import Thing\n"
      "import jax\n"
      "def f(cache):\n"
      "  pkg._util.public()\n"
      "  jax._src.mesh\n"
      "  thing = Thing()\n"
      "  thing._private()\n"
      "  getattr(Thing, '_hidden')\n"
      "  cache._private()\n"
      "  return Thing()._replace(x=1)\n"
    ),
  }
  for name, text in files.items():
    tmp_path.joinpath(name).parent.mkdir(parents=True, exist_ok=True)
    tmp_path.joinpath(name).write_text(text)
  assert module_name(tmp_path, tmp_path / "pkg/sub/other.py") == "pkg.sub.other"
  assert home(tmp_path, "pkg.same.Thing") == "pkg"
  assert home(tmp_path, "pkg.sub") == "pkg/sub"
  assert private_uses(tmp_path, tmp_path / "pkg/same.py") == []
  assert private_uses(tmp_path, tmp_path / "pkg/sub/__init__.py") == []
  assert private_uses(tmp_path, tmp_path / "pkg/sub/own.py") == []
  # pkg._util is a private module of pkg: pkg/sub may use it; jax's internals are not checked.
  assert private_uses(tmp_path, tmp_path / "pkg/sub/other.py") == [
    "pkg/sub/other.py:10: _private (from pkg.same.Thing)",
    "pkg/sub/other.py:11: _hidden (from pkg.same.Thing)",
  ]
  assert internal_uses(tmp_path, tmp_path / "pkg/sub/other.py") == [
    "pkg/sub/other.py: jax._src.mesh"
  ]
  assert internal_uses(tmp_path, tmp_path / "pkg/same.py") == []
  assert private_uses(tmp_path, tmp_path / "app/main.py") == [
    "app/main.py:1: _util (from pkg)",
    "app/main.py:2: _util (from pkg)",
    "app/main.py:2: _helper (from pkg._util)",
  ]


def test_no_private_name_is_used_outside_its_package():
  found = offenders(ROOT)
  assert not found, (
    "private names used outside their package directory (make them public "
    "or move them):\n" + "\n".join(found)
  )


def test_each_use_of_jax_internals_is_listed_with_its_reason():
  used = set()
  for source in SOURCES:
    for path in sorted(ROOT.joinpath(source).rglob("*.py")):
      used.update(internal_uses(ROOT, path))
  unlisted = sorted(used - set(JAX_INTERNALS))
  stale = sorted(set(JAX_INTERNALS) - used)
  assert not unlisted, (
    "private names of jax used without an entry in JAX_INTERNALS (use a "
    "public API, or add the entry with the reason):\n" + "\n".join(unlisted)
  )
  assert not stale, "JAX_INTERNALS entries no longer used:\n" + "\n".join(stale)
  assert all(reason.strip() for reason in JAX_INTERNALS.values())


# ---------------------------------------------------------------------------
# The implementation lives under attnjax/_src; the public modules only re-export it.

USER_FACING = ("experiments", "notebooks", "docs", "README.md")


def implementation_statements(path: pathlib.Path) -> list[str]:
  """``path:line`` of each top-level statement of a public module that is not re-export glue.

  Glue: the docstring, imports, ``__all__ = [...]``, and the ``if __name__ == "__main__":``
  block that runs an entry point. The package ``attnjax/__init__.py`` may also define its
  lazy ``__getattr__`` / ``__dir__`` (PEP 562) and their name list; ``_version.py`` holds
  ``__version__``.
  """
  tree = ast.parse(path.read_text())
  out = []
  for i, node in enumerate(tree.body):
    docstring = (
      i == 0
      and isinstance(node, ast.Expr)
      and isinstance(node.value, ast.Constant)
      and isinstance(node.value.value, str)
    )
    names = [t.id for t in getattr(node, "targets", ()) if isinstance(t, ast.Name)]
    glue = (
      docstring
      or isinstance(node, (ast.Import, ast.ImportFrom))
      or names == ["__all__"]
      or (isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'")
    )
    if path.name == "__init__.py" and path.parent.name == "attnjax":
      glue = (
        glue
        or names == ["_LAZY"]
        or (isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__"))
      )
    if path.name == "_version.py":
      glue = glue or names == ["__version__"]
    if not glue:
      out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  return out


def test_the_glue_check_finds_a_definition(tmp_path):
  (tmp_path / "m.py").write_text(
    '"""Doc."""\nfrom a import b\n__all__ = ["b"]\ndef f():\n  pass\nX = 1\n'
  )
  global ROOT
  root, ROOT = ROOT, tmp_path
  try:
    assert implementation_statements(tmp_path / "m.py") == ["m.py:4", "m.py:6"]
  finally:
    ROOT = root


def test_no_module_outside_src_holds_an_implementation():
  public = [
    p
    for p in sorted(ROOT.joinpath("attnjax").rglob("*.py"))
    if "_src" not in p.relative_to(ROOT).parts
  ]
  assert len(public) > 40, len(public)
  found = [s for p in public for s in implementation_statements(p)]
  assert not found, "public modules define code (move it under attnjax/_src):\n" + "\n".join(found)


IMPORTS_SRC = re.compile(r"(from|import)\s+attnjax\._src\b|from attnjax import _[a-z]")


def test_user_facing_code_never_imports_src():
  """Experiments, notebooks, the README and the documentation's code import public modules only
  (prose may name ``attnjax/_src`` files, as the architecture guide does)."""
  found = []
  for source in USER_FACING:
    base = ROOT / source
    files = (
      [base]
      if base.is_file()
      else sorted(
        p
        for p in base.rglob("*")
        if p.suffix in (".py", ".md", ".ipynb")
        and "_build" not in p.parts
        and "_generated" not in p.parts
      )
    )
    for path in files:
      for n, line in enumerate(path.read_text().splitlines(), 1):
        if IMPORTS_SRC.search(line):
          found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
  assert not found, (
    "experiments, notebooks and documentation use only the public modules:\n" + "\n".join(found)
  )
