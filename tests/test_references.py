"""Every reference to a name of attnjax in the docstrings, guides and README resolves.

Sphinx's ``-W`` build checks the roles of the pages it renders, but not a dotted name inside
double backticks (``attnjax.nn.layer_stats``), nor a docstring of ``attnjax/_src`` that no
page renders, nor a guide's inline code. This test reads, with ``ast`` and regular
expressions, every docstring under ``attnjax/`` and ``experiments/`` (double backticks and
``:func:`` / ``:class:`` / ``:mod:`` / ``:data:`` / ``:meth:`` / ``:attr:`` roles) and every
page of ``docs/`` (its guides and API pages) and the README (inline code and ``{func}``-style
roles), and resolves each name that starts with ``attnjax``: the longest prefix that is a
module is imported and the rest read as attributes. A relative role (``:func:`.run```,
``:data:`VIEWS```) must name a public object (or, in a method's docstring, a member of its
class), as Sphinx resolves it, in a docstring the API reference renders; elsewhere it may
also name an attribute of the docstring's own module. Names of other projects
(``jax.nn.dot_product_attention``) are not checked.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re
import sys
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

DOTTED = re.compile(r"attnjax(?:\.[A-Za-z_]\w*)*(?![\w/])")
ROLE = re.compile(r":(?:py:)?(?:func|class|mod|data|meth|attr|obj|exc):`([^`]+)`")
MYST_ROLE = re.compile(r"\{(?:py:)?(?:func|class|mod|data|meth|attr|obj|exc)\}`([^`]+)`")
DOUBLE = re.compile(r"``([^`]+)``")
SINGLE = re.compile(r"`([^`\n]+)`")


def role_target(text: str) -> str:
  """The object a role names: ``title <target>`` gives the target; ``~`` and ``!`` go."""
  if m := re.search(r"<([^>]+)>$", text):
    text = m.group(1)
  return text.strip().lstrip("~!")


@functools.lru_cache(maxsize=None)
def resolves(dotted: str) -> bool:
  """Whether ``dotted`` imports: its longest module prefix, then attributes."""
  parts = dotted.split(".")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # an old name that warns still resolves
    for n in range(len(parts), 0, -1):
      try:
        obj = importlib.import_module(".".join(parts[:n]))
      except ModuleNotFoundError:
        continue
      try:
        for part in parts[n:]:
          obj = getattr(obj, part)
      except (AttributeError, ImportError):  # ImportError: a removed name (deprecation)
        return False
      return True
  return False


def public_modules(root: pathlib.Path = ROOT) -> tuple:
  names = ["attnjax"]
  for path in sorted((root / "attnjax").rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if "_src" in parts or any(p.startswith("_") and p != "__init__" for p in parts):
      continue
    names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return tuple(dict.fromkeys(names))


PUBLIC_MODULES = public_modules()


@functools.lru_cache(maxsize=None)
def exported() -> tuple:
  """The objects the public modules offer."""
  out = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for name in PUBLIC_MODULES:
      module = importlib.import_module(name)
      out += [getattr(module, n) for n in getattr(module, "__all__", [])]
  return tuple(out)


@functools.lru_cache(maxsize=None)
def rendered() -> frozenset:
  """Qualified names of the docstrings the API reference renders: the public modules', and
  those of the functions and classes (with their members) the public modules offer."""
  out = set(PUBLIC_MODULES)
  for obj in exported():
    obj = getattr(obj, "__wrapped__", obj)  # jax.jit and functools wrappers
    if isinstance(obj, type) or callable(obj):
      qual = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
      out.add(qual)
      if isinstance(obj, type):
        out.update(f"{qual}.{member}" for member in vars(obj))
  return frozenset(out)


def resolves_relative(name: str, module: str) -> bool:
  """A relative role's target: an attribute path of a public module; in a docstring the API
  reference renders (``module`` is ``"public:<class>"``) also of the class it is in; elsewhere
  also of ``module``, of its package (a sibling module) or of a class it defines (a method
  named in a class's docstrings)."""
  name = name.lstrip(".")
  if any(resolves(f"{m}.{name}") for m in PUBLIC_MODULES):
    return True
  if module.startswith("public:"):
    owner = module.partition(":")[2]
    return bool(owner) and resolves(f"{owner}.{name}")
  if resolves(f"{module}.{name}") or resolves(f"{module.rpartition('.')[0]}.{name}"):
    return True  # an attribute of the module, or a sibling module
  try:
    loaded = importlib.import_module(module)
  except ModuleNotFoundError:
    return False
  classes = [v for v in vars(loaded).values() if isinstance(v, type)]
  return any(resolves(f"{c.__module__}.{c.__qualname__}.{name}") for c in classes)


def checked_name(text: str) -> str | None:
  """The dotted name of attnjax at the start of ``text`` (a code span), if any."""
  m = DOTTED.match(text.strip())
  return m.group(0) if m else None


def docstrings(path: pathlib.Path):
  """``(line, text, owner)`` of each docstring (module, class, function) of a Python file;
  ``owner`` is the qualified name below the module (``""`` for the module's own)."""

  def visit(node, prefix):
    body = getattr(node, "body", [])
    if (
      body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
    ):
      yield body[0].lineno, body[0].value.value, prefix
    for child in body:
      if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        yield from visit(child, f"{prefix}.{child.name}" if prefix else child.name)

  yield from visit(ast.parse(path.read_text()), "")


def module_of(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def python_references(path: pathlib.Path) -> list[tuple[str, str, str]]:
  """``(where, name, module)`` of each reference in a file's docstrings. ``module`` is, for a
  relative role, where it resolves: the file's module, or ``"public"`` in a docstring the API
  reference renders (:func:`rendered`); empty for an absolute name."""
  out = []
  module = module_of(path)
  for line, doc, owner in docstrings(path):
    where = f"{path.relative_to(ROOT)}:{line}"
    scope = module
    if f"{module}.{owner}".rstrip(".") in rendered():  # the class a method's roles may name
      first = owner.split(".")[0]
      scope = f"public:{module}.{first}" if first[:1].isupper() else "public:"
    for target in map(role_target, ROLE.findall(doc)):
      if DOTTED.fullmatch(target):
        out.append((where, target, ""))
      elif re.fullmatch(r"\.?[A-Za-z_][\w.]*", target) and (
        target.startswith(".") or "." not in target
      ):
        out.append((where, target, scope))  # relative: .name, or a bare name
      # else another project's name (jax.Array, numpy.ndarray): not checked
    for span in DOUBLE.findall(doc):
      if name := checked_name(span):
        out.append((where, name, ""))
  return out


def page_references(path: pathlib.Path) -> list[tuple[str, str, str]]:
  """``(where, name, "")`` of each reference to attnjax in a markdown page."""
  out = []
  for n, line in enumerate(path.read_text().splitlines(), 1):
    where = f"{path.relative_to(ROOT)}:{n}"
    for target in map(role_target, MYST_ROLE.findall(line) + ROLE.findall(line)):
      if DOTTED.fullmatch(target):
        out.append((where, target, ""))
    rest = ROLE.sub("", MYST_ROLE.sub("", line))  # the roles' targets are read above
    for span in DOUBLE.findall(rest) + SINGLE.findall(DOUBLE.sub("", rest)):
      if name := checked_name(span):
        out.append((where, name, ""))
  return out


def all_references() -> list[tuple[str, str, str]]:
  refs = []
  for source in ("attnjax", "experiments"):
    for path in sorted((ROOT / source).rglob("*.py")):
      refs += python_references(path)
  pages = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts
  )
  for path in pages:
    refs += page_references(path)
  return refs


def unresolved(refs) -> list[str]:
  bad = []
  for where, name, module in refs:
    ok = resolves_relative(name, module) if module else resolves(name)
    if not ok:
      bad.append(f"{where}: {name}")
  return bad


def test_the_reader_finds_each_form(tmp_path, monkeypatch):
  src = tmp_path / "attnjax" / "m.py"
  src.parent.mkdir()
  src.write_text(
    '"""See ``attnjax.nn.layer_stats(model, tokens)``, :func:`~attnjax.masks.causal_mask`,\n'
    ':class:`the options <attnjax.options.DenseOptions>`, :func:`.sink_rate`, :class:`jax.Array`,\n'
    '``attnjax.kernels.pallas_gpu.kernel`` and ``attnjax/_src/op.py``."""\n'
  )
  page = tmp_path / "guide.md"
  page.write_text("Use {func}`attnjax.train.probe.run_probe` or `attnjax.nn.probe.probe()`.\n")
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  refs = python_references(src) + page_references(page)
  names = [name for _, name, _ in refs]
  assert names == [
    "attnjax.masks.causal_mask",
    "attnjax.options.DenseOptions",
    ".sink_rate",
    "attnjax.nn.layer_stats",
    "attnjax.kernels.pallas_gpu.kernel",
    "attnjax.train.probe.run_probe",
    "attnjax.nn.probe.probe",
  ]
  assert unresolved(refs) == [
    "attnjax/m.py:1: attnjax.kernels.pallas_gpu.kernel",
    "guide.md:1: attnjax.train.probe.run_probe",
    "guide.md:1: attnjax.nn.probe.probe",
  ]


@pytest.mark.parametrize("source", ["docstrings", "pages"])
def test_every_reference_resolves(source):
  refs = [r for r in all_references() if (".md:" in r[0]) == (source == "pages")]
  assert len(refs) > 100, len(refs)
  bad = unresolved(refs)
  assert not bad, f"{len(bad)} references that do not resolve:\n" + "\n".join(bad)
