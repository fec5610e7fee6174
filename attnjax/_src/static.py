"""Static options as the Python values ``jax.jit`` hashes, for every public attention function.

:func:`canonical` turns numeric scalars (numpy, jax, 0-d arrays) into Python ``float`` /
``int`` / ``bool`` and sequences into tuples, so ``scale=jnp.float32(0.5)`` means
``scale=0.5``; a flag takes ``True`` or ``False`` only, and a traced static option is a
``TypeError`` naming it. :func:`jit` is ``jax.jit`` with this in front;
:func:`canonicalized` puts it in front of a function not jitted at its entry.
Guide: docs/guides/architecture.md, section "Shared vocabulary".
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable

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


def canonicalized(
  fn: Callable[..., Any], static_argnames: Iterable[str], flags: Iterable[str] | None = None
) -> Callable[..., Any]:
  """``fn`` with its keyword arguments ``static_argnames`` canonicalised first.

  ``flags``: the flags among them (default: those annotated ``bool`` in ``fn``'s signature).
  The wrapper keeps ``fn``'s name, docstring and signature, and forwards ``lower``,
  ``trace`` and ``eval_shape`` when ``fn`` is jitted.
  """
  static = frozenset(static_argnames)
  flags = flags_of(inspect.unwrap(fn), static) if flags is None else frozenset(flags)

  @functools.wraps(fn)
  def call(*args, **kwargs):
    return fn(*args, **canonical_keywords(kwargs, static, flags))

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
  fn: Callable[..., Any], static_argnames: Iterable[str], flags: Iterable[str] | None = None
) -> Callable[..., Any]:
  """``jax.jit(fn, static_argnames=...)`` whose static options are canonicalised first
  (:func:`canonical`); ``flags``: the flags among them (default: the static parameters
  ``fn`` annotates ``bool``)."""
  static_argnames = tuple(static_argnames)
  jitted = jax.jit(fn, static_argnames=static_argnames)
  flags = flags_of(fn, static_argnames) if flags is None else flags
  return canonicalized(jitted, static_argnames, flags)
