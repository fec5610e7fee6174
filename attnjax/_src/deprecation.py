"""Deprecated public names: each old name keeps working and warns once per process.

A rename keeps the old name as an alias that behaves identically and emits one
``DeprecationWarning`` naming the new name, the first time the old name is used
(:func:`warn_renamed`). Keyword arguments of a function (:func:`renamed_keywords`),
fields of a frozen dataclass (:func:`renamed_fields`) and a public module's old names
(:func:`old_names`) have helpers here. A function replaced by another call warns with
:func:`warn_once`. An old name that collides with another concept is not kept: reading
it raises :class:`RemovedError`, which names the new spelling.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings
from typing import Any, Callable, Mapping, Union

# The old names warned about in this process (a test may clear it).
_warned: set[str] = set()


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns once per process that ``old`` is deprecated and ``new`` means the same.

  Args:
    old: the old name as the user wrote it, e.g. ``"qk_norm_attention(q_scale=...)"``.
    new: its replacement, written the same way.
    stacklevel: as in :func:`warnings.warn`, counted from the caller of this function.
  """
  _warn(old, f"{old} is deprecated; use {new} (the same meaning)", stacklevel + 1)


def warn_once(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Warns once per process that the function ``old`` is deprecated in favour of ``new``.

  Args:
    old: the deprecated name, dotted (``"attnjax.nn.collect_stats"``).
    new: the call that replaces it, as the message shows it.
    stacklevel: as in :func:`warnings.warn`, counted from this function: 3 points at the
      caller of the deprecated function.
  """
  _warn(old, f"{old} is deprecated; use {new}, which returns the same", stacklevel)


def _warn(old: str, message: str, stacklevel: int) -> None:
  """One ``DeprecationWarning`` per process and ``old`` (``stacklevel`` counted from the
  caller of this function)."""
  if old in _warned:
    return
  _warned.add(old)
  warnings.warn(message, DeprecationWarning, stacklevel=stacklevel + 1)


def renamed_in(
  where: str, kwargs: dict[str, Any], renames: Mapping[str, str], *, stacklevel: int = 3
) -> dict[str, Any]:
  """``kwargs`` with each old keyword of ``renames`` (``{old: new}``) given its new name.

  ``where`` names the callee in messages; ``stacklevel``: 1 is this function, 3 the
  user's call of a wrapper that calls it.

  Raises:
    TypeError: an old keyword and its new one are both given.
  """
  if not renames.keys() & kwargs.keys():
    return kwargs
  out = dict(kwargs)
  for old, new in renames.items():
    if old not in out:
      continue
    if new in out:
      raise TypeError(
        f"{where}: {old}= and {new}= are the same option ({old} is its old name); give {new}= only"
      )
    warn_renamed(f"{where}({old}=...)", f"{where}({new}=...)", stacklevel=stacklevel)
    out[new] = out.pop(old)
  return out


def renamed_keywords(
  fn: Callable[..., Any], where: str, renames: Mapping[str, str]
) -> Callable[..., Any]:
  """``fn`` also taking the old keyword names of ``renames`` (``{old: new}``).

  The wrapper keeps ``fn``'s name, docstring and signature (the new names) and
  forwards ``lower``, ``trace`` and ``eval_shape`` when ``fn`` has them.
  """

  def wrap(method):
    @functools.wraps(method)
    def call(*args, **kwargs):
      return method(*args, **renamed_in(where, kwargs, renames))

    return call

  out = wrap(fn)
  for method in ("lower", "trace", "eval_shape"):
    if hasattr(fn, method):
      setattr(out, method, wrap(getattr(fn, method)))
  return out


def renamed_fields(**renames: str) -> Callable[[type], type]:
  """Class decorator: a frozen dataclass also takes (and reads) its fields' old names.

  ``@renamed_fields(old="new")`` above ``@dataclasses.dataclass``: the constructor
  and a ``replace`` method accept ``old=``, and reading ``obj.old`` reads
  ``obj.new``, each warning once. ``cls.renamed_fields`` holds ``{old: new}``.
  """

  def decorate(cls: type) -> type:
    init = cls.__init__
    where = cls.__name__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
      init(self, *args, **renamed_in(where, kwargs, renames))

    cls.__init__ = __init__
    if hasattr(cls, "replace"):
      replace = cls.replace

      @functools.wraps(replace)
      def replace_renamed(self, **changes):
        return replace(self, **renamed_in(f"{where}.replace", changes, renames))

      cls.replace = replace_renamed
    for old, new in renames.items():
      setattr(cls, old, property(_reader(where, old, new), doc=f"Deprecated name of ``{new}``."))
    cls.renamed_fields = {**getattr(cls, "renamed_fields", {}), **renames}
    return cls

  return decorate


def _reader(where: str, old: str, new: str) -> Callable[[Any], Any]:
  def read(self):
    warn_renamed(f"{where}.{old}", f"{where}.{new}", stacklevel=2)
    return getattr(self, new)

  return read


class RemovedError(ImportError):
  """A public name that went because its spelling means another concept; the message names
  the new spelling.

  An ``ImportError``, so that ``from module import old`` shows the message as well (Python
  replaces an ``AttributeError`` raised there by a message of its own).
  """


@dataclasses.dataclass(frozen=True)
class Renamed:
  """An old name that still works and warns once: ``new`` as the user writes it, and where the
  object lives (``"attnjax._src.module:name"``, or a module ``"attnjax._src.module"``)."""

  new: str
  source: str


@dataclasses.dataclass(frozen=True)
class Deprecated:
  """An old name whose object warns by itself when called (``"attnjax._src.module:name"``)."""

  source: str


@dataclasses.dataclass(frozen=True)
class Removed:
  """An old name that raises :class:`RemovedError`: ``why`` it went, and its ``new`` spelling."""

  new: str
  why: str


OldName = Union[Renamed, Deprecated, Removed]


def _load(source: str) -> Any:
  module, _, name = source.partition(":")
  loaded = importlib.import_module(module)
  return getattr(loaded, name) if name else loaded


def old_names(module: str, names: Mapping[str, OldName]) -> Callable[[str], Any]:
  """The ``__getattr__`` (PEP 562) of the public module ``module`` for its old ``names``.

  A :class:`Renamed` name warns once (:func:`warn_renamed`) and gives the object it names; a
  :class:`Deprecated` one gives its object, which warns when called; a :class:`Removed` one
  raises :class:`RemovedError` naming the new spelling. Any other name is an
  ``AttributeError``, as for a module without ``__getattr__``.
  """

  def __getattr__(name: str) -> Any:
    entry = names.get(name)
    if isinstance(entry, Removed):
      raise RemovedError(f"{module}.{name} was removed: {entry.why}; use {entry.new}")
    if isinstance(entry, Renamed):
      warn_renamed(f"{module}.{name}", entry.new, stacklevel=2)
      return _load(entry.source)
    if isinstance(entry, Deprecated):
      return _load(entry.source)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")

  __getattr__.old_names = dict(names)
  return __getattr__
