"""Sphinx configuration of the attnjax documentation site.

Build (from the repository root)::

  pip install -e '.[docs]' && sphinx-build -W -j auto -b html docs docs/_build/html

Nothing is fetched at build time (no intersphinx): references to jax, numpy, flax, optax,
the standard library and typing are listed in ``nitpick_ignore_regex``, so that ``-W`` fails on
any broken reference to an attnjax name. The notebooks are committed without outputs and
executed here, those out of date in parallel before the pages are read (jupyter-cache, whose
cache myst-nb reads: ``docs/_build/.jupyter_cache``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
ROOT = DOCS.parent
# The repository's package, whether or not it is installed (an editable install points here).
sys.path.insert(0, str(ROOT))
# The notebooks' kernels and autodoc's imports run on the CPU whatever plugins are installed.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The notebooks train tiny models for a few steps and compile many small programs once each,
# as the test suite does: XLA's optimisation passes cost their kernels (which inherit this)
# more than they save (notebook 03: 47 s with them, 28 s without). No notebook times anything.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import attnjax  # noqa: E402

project = "attnjax"
author = "the attnjax authors"
copyright = "the attnjax authors"  # noqa: A001 (Sphinx's name)
release = attnjax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "**/.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
# Pretrained models: their API page is built where the package exists; elsewhere it is left
# out, and so is the warning about the API index's entry for it (the only excluded page).
suppress_warnings: list[str] = []
if importlib.util.find_spec("attnjax.models") is None:
  exclude_patterns.append("api/attnjax.models.*")
  suppress_warnings.append("toc.excluded")
templates_path = ["_templates"]

# MyST: ::: fences, $math$, definition lists, heading anchors for links within a page.
myst_enable_extensions = ["colon_fence", "dollarmath", "deflist", "substitution"]
myst_heading_anchors = 3

# Notebooks: executed when their source changed (cache), errors fail the build.
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

# API reference: autosummary writes one page per public name under api/_generated.
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
napoleon_preprocess_types = False

# Every broken reference to our names is an error under -W; other projects' names are not
# resolved here (no network): they are listed below.
nitpicky = True
_EXTERNAL = (
    r"jax|jaxlib|jnp|np|numpy|flax|nnx|linen|optax|orbax|ml_collections|chex|matplotlib|plt"
    r"|typing|typing_extensions|collections|builtins|types|enum|dataclasses|functools|os"
    r"|pathlib|abc|argparse|subprocess|concurrent|json|io|contextlib|math|re|numbers"
)
nitpick_ignore_regex = [
    (r"py:.*", rf"({_EXTERNAL})(\..*)?"),
    # Private names (a base class or an annotation naming one) have no page by design.
    (r"py:.*", r"(.*\.)?_[A-Za-z]\w*(\..*)?"),
    # Builtins and typing names as annotations show them (``int``, ``Optional``, ``Array``...).
    (r"py:.*", r"(int|float|bool|str|bytes|complex|object|tuple|list|dict|set|frozenset|type"
               r"|None|NoneType|Ellipsis|callable|Exception|ValueError|TypeError|RuntimeError"
               r"|Any|Optional|Union|Callable|Sequence|Mapping|Iterable|Iterator|Literal|Tuple"
               r"|List|Dict|Set|Hashable|NamedTuple|Protocol|ClassVar|Self|Array|ArrayLike"
               r"|DTypeLike|Shape|PRNGKey|KeyArray|PyTree|ndarray|Mesh|NamedSharding"
               r"|PartitionSpec|Sharding|Device|ConfigDict|FieldReference|Module|Rngs|Variable"
               r"|Param|Intermediate|State|GraphDef|GradientTransformation|Path|PathLike"
               r"|Generator|Number|np\.ndarray|array_like|optional|callable)"),
]

html_theme = "sphinx_book_theme"
html_title = f"attnjax {release}"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "home_page_in_toc": True,
}
html_static_path: list[str] = []


def _no_type_docstrings(app, what, name, obj, options, lines) -> None:
  """A constant has no docstring of its own: drop the one its type lends it (``dict``'s...)."""
  import inspect

  doc = getattr(type(obj), "__doc__", None)
  if what in ("data", "attribute") and isinstance(doc, str) and lines:
    if [line.rstrip() for line in lines if line.strip()][:3] == [
        line.rstrip() for line in inspect.cleandoc(doc).splitlines() if line.strip()][:3]:
      lines.clear()


def _fresh_stubs(app) -> None:
  """Autosummary's generated pages start anew (a stale page of a removed name would fail)."""
  import shutil

  shutil.rmtree(DOCS / "api" / "_generated", ignore_errors=True)


def _execute_stale_notebooks(app):
  """Execute the notebooks whose cached outputs are stale, as many at a time as there are CPUs.

  myst-nb's cache mode executes a stale notebook while it reads the page, one after another
  (Sphinx's parallel reading puts the notebooks into one worker's chunk); here they run
  beforehand through jupyter-cache's parallel executor, into the same cache, in the notebook's
  folder as myst-nb does. myst-nb then finds them up to date; a notebook that failed here is
  executed again by myst-nb, which reports the error and fails the build.
  """
  if app.config.nb_execution_mode != "cache":
    return
  import nbformat
  from jupyter_cache import get_cache
  from jupyter_cache.executors import load_executor

  cache = get_cache(app.config.nb_execution_cache_path)
  stale = []
  for path in sorted((DOCS / "notebooks").glob("*.ipynb")):
    try:
      cache.match_cache_notebook(nbformat.read(path, as_version=4))
    except KeyError:
      stale.append(str(path.absolute()))
  if len(stale) < 2:  # nothing to overlap: myst-nb executes it
    return
  for path in stale:
    cache.add_nb_to_project(path)
  logger = logging.getLogger("attnjax.docs")
  logger.info("executing %d notebooks in parallel", len(stale))
  load_executor("local-parallel", cache, logger=logger).run_and_cache(
    filter_uris=stale, timeout=app.config.nb_execution_timeout
  )


def setup(app):
  app.connect("builder-inited", _execute_stale_notebooks, priority=50)
  app.connect("builder-inited", _fresh_stubs, priority=100)
  # Before napoleon (priority 500) rewrites the lines it compares with the type's docstring.
  app.connect("autodoc-process-docstring", _no_type_docstrings, priority=100)
