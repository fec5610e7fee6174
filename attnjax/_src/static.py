"""Static options as the Python values ``jax.jit`` hashes, for every public attention function.

:func:`canonical` turns numeric scalars (numpy, jax, 0-d arrays) into Python ``float`` /
``int`` / ``bool`` and sequences into tuples, so ``scale=jnp.float32(0.5)`` means
``scale=0.5``; a flag takes ``True`` or ``False`` only, and a traced static option is a
``TypeError`` naming it. :func:`jit` is ``jax.jit`` with this in front;
:func:`canonicalized` puts it in front of a function not jitted at its entry; a failed call
is explained by :func:`diagnose` (a misspelled keyword, an argument of the wrong type).
Guide: docs/guides/architecture.md, section "Shared vocabulary".
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from typing import Any, Callable, Iterable, Optional

import jax
import numpy as np


def canonical(name: str, value: Any) -> Any:
  """``value`` of the static option ``name`` as a hashable Python value.

  numpy / jax scalars and 0-d arrays become Python scalars (``.item()``), arrays of higher
  rank and lists become tuples (their elements canonicalised the same way), tuples keep their
  type with canonical elements; anything else (None, strings, callables, patterns, layouts)
  is returned as is.

  Raises:
    TypeError: ``value`` is (or holds) a traced array: static options must be concrete.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} is a static option (it shapes the program) and must be a concrete Python or "
      f"numpy value, got a traced array {value.aval}; pass it outside jax.jit / grad / vmap "
      f"or close over a concrete value"
    )
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    array = np.asarray(value)
    value = array.item() if array.ndim == 0 else array.tolist()
  if isinstance(value, list):
    value = tuple(value)
  if type(value) is tuple:  # a NamedTuple option keeps its own type
    return tuple(canonical(name, item) for item in value)
  return value


def check_flag(name: str, value: Any) -> bool:
  """``value`` of the flag ``name`` (a canonical value): True or False, nothing else."""
  if not isinstance(value, bool):
    raise TypeError(
      f"{name} is a flag and must be True or False, got {type(value).__name__} {value!r}"
    )
  return value


def flags_of(fn: Callable[..., Any], names: Iterable[str]) -> frozenset[str]:
  """The flags among ``fn``'s parameters ``names``: those annotated ``bool``."""
  params = inspect.signature(fn).parameters
  return frozenset(
    name for name in names if name in params and params[name].annotation in (bool, "bool")
  )


# Values that are canonical as they are (canonical returns them unchanged).
_PLAIN = (type(None), bool, int, float, str)


def canonical_keywords(
  kwargs: dict[str, Any], static: frozenset[str], flags: frozenset[str]
) -> dict[str, Any]:
  """``kwargs`` with each static option canonical and each flag checked."""
  out = dict(kwargs)
  for name in static.intersection(kwargs):
    value = kwargs[name]
    if type(value) not in _PLAIN:
      value = out[name] = canonical(name, value)
    if name in flags and type(value) is not bool:
      check_flag(name, value)  # raises
  return out


def _array_like(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def _expected(annotation: Any) -> str:
  """A parameter's annotation as the type a message names (``feature_maps.FeatureMap`` -> "a
  FeatureMap"; ``Optional[Array]`` -> "an array or None")."""
  text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
  text = re.sub(r"\b(?:\w+\.)+(\w+)", r"\1", text or "")
  optional = re.fullmatch(r"Optional\[(.*)\]", text)
  text = optional.group(1) if optional else text
  if text in ("", "Any", "Array", "jnp.ndarray", "ndarray"):
    text = "an array (or a pytree of arrays)" if text in ("", "Any") else "an array"
  else:
    text = f"a {text}"
  return text + (" or None" if optional else "")


def diagnose(
  name: str,
  fn: Callable[..., Any],
  static: frozenset[str],
  keywords: Iterable[str],
  args: tuple,
  kwargs: dict,
) -> Optional[str]:
  """Why a call of the public function ``name`` (``fn``'s signature, plus ``keywords`` where
  ``fn`` takes ``**kwargs``) cannot be traced, or None: an unknown keyword (with the closest
  known one: jax's own message names only a path such as ``kwargs['normaliser']``), or a
  non-static argument holding a value no array can be made of (a string where a
  ``FeatureMap`` belongs), named with the type its annotation expects."""
  signature = inspect.signature(fn)
  params = signature.parameters
  takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
  known = [n for n, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
  known += [n for n in keywords if n not in known]
  for key in kwargs:
    if key not in known and (not takes_kwargs or keywords):
      close = difflib.get_close_matches(key, known, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else f"; it takes {', '.join(known)}"
      return f"{name}() got an unexpected keyword argument {key!r}{hint}"
  try:
    bound = signature.bind_partial(*args, **kwargs)
  except TypeError as e:
    return f"{name}(): {e}"
  for key, value in bound.arguments.items():
    if key in static or params[key].kind in (params[key].VAR_KEYWORD, params[key].VAR_POSITIONAL):
      continue
    leaves = jax.tree_util.tree_leaves(value)
    bad = next((x for x in leaves if not _array_like(x)), None)
    if bad is not None:
      return (
        f"{name}(): {key} expects {_expected(params[key].annotation)}, got "
        f"{type(value).__name__} {value!r:.80}"
      )
  return None


def canonicalized(
  fn: Callable[..., Any],
  static_argnames: Iterable[str],
  flags: Iterable[str] | None = None,
  *,
  keywords: Iterable[str] = (),
  name: Optional[str] = None,
) -> Callable[..., Any]:
  """``fn`` with its keyword arguments ``static_argnames`` canonicalised first.

  ``flags``: the flags among them (default: those annotated ``bool`` in ``fn``'s signature).
  The wrapper keeps ``fn``'s name, docstring and signature, and forwards ``lower``,
  ``trace`` and ``eval_shape`` when ``fn`` is jitted. A call that fails with a ``TypeError``
  is diagnosed (:func:`diagnose`) after the fact, at no cost to calls that succeed: a
  misspelled keyword is named with the closest one, an argument of the wrong type with the
  type expected. ``keywords``: the names a ``**kwargs`` of ``fn`` takes; ``name``: the public
  name in messages (default: ``fn``'s without a leading underscore).
  """
  static = frozenset(static_argnames)
  flags = flags_of(inspect.unwrap(fn), static) if flags is None else frozenset(flags)
  keywords = tuple(keywords)
  public = name or inspect.unwrap(fn).__name__.lstrip("_")

  @functools.wraps(fn)
  def call(*args, **kwargs):
    try:
      return fn(*args, **canonical_keywords(kwargs, static, flags))
    except TypeError as e:
      try:
        problem = diagnose(public, inspect.unwrap(fn), static, keywords, args, kwargs)
      except Exception:  # the diagnosis must never hide the error it explains
        problem = None
      if problem is None:
        raise
      raise TypeError(problem) from e

  for method in ("lower", "trace", "eval_shape"):
    if hasattr(fn, method):
      setattr(call, method, _forward(getattr(fn, method), static, flags))
  return call


def _forward(method: Callable[..., Any], static: frozenset[str], flags: frozenset[str]):
  @functools.wraps(method)
  def call(*args, **kwargs):
    return method(*args, **canonical_keywords(kwargs, static, flags))

  return call


def jit(
  fn: Callable[..., Any],
  static_argnames: Iterable[str],
  flags: Iterable[str] | None = None,
  *,
  keywords: Iterable[str] = (),
  name: Optional[str] = None,
) -> Callable[..., Any]:
  """``jax.jit(fn, static_argnames=...)`` whose static options are canonicalised first
  (:func:`canonical`) and whose failed calls are diagnosed (:func:`canonicalized`);
  ``flags``: the flags among them (default: the static parameters ``fn`` annotates
  ``bool``)."""
  static_argnames = tuple(static_argnames)
  jitted = jax.jit(fn, static_argnames=static_argnames)
  flags = flags_of(fn, static_argnames) if flags is None else flags
  return canonicalized(jitted, static_argnames, flags, keywords=keywords, name=name)
