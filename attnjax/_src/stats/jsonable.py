"""The one JSON sanitiser of attnjax: metric trees to strict JSON.

:func:`.to_jsonable` is used by the metrics (``attnjax.stats``), the probe and
the run-directory writer (``attnjax.train.rundir``), so every file attnjax
writes follows one rule: NaN and +-Inf become ``null`` (JSON has neither), and
``json.dumps(..., allow_nan=False)`` always succeeds. Readers treat ``null`` as
"not defined / not finite".
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Flattens nested dicts and NamedTuples into ``{"a/b": leaf}``; None leaves are dropped.

  Args:
    tree: nested mappings, NamedTuples and leaves (arrays, numbers, ...).
    prefix: prepended to every key (``"prefix/a/b"``).

  Returns:
    A flat dict from ``/``-joined paths to leaves.
  """
  out: dict[str, Any] = {}

  def visit(node, path):
    if node is None:
      return
    if isinstance(node, tuple) and hasattr(node, "_asdict"):
      node = node._asdict()
    if isinstance(node, Mapping):
      for key, value in node.items():
        visit(value, f"{path}/{key}" if path else str(key))
    else:
      out[path] = node

  visit(tree, prefix)
  return out


def _finite_or_none(value: float) -> Any:
  return value if math.isfinite(value) else None


def _clean_floats(values: Any) -> Any:
  """Nested lists of Python floats from ``ndarray.tolist()`` with non-finite entries as None."""
  if isinstance(values, list):
    return [_clean_floats(v) for v in values]
  return _finite_or_none(values)


def to_jsonable(tree: Any) -> Any:
  """Converts arrays, NamedTuples and dicts to JSON-ready Python values.

  Arrays (NumPy or JAX, any float dtype including bfloat16) become (nested)
  lists of floats/ints/bools, NamedTuples and mappings become dicts with
  string keys, tuples become lists; non-finite floats (NaN, +-Inf) become
  None, so ``json.dumps`` succeeds with ``allow_nan=False``. Strings, bools,
  ints and None pass through.

  Args:
    tree: arrays, NamedTuples, mappings, sequences and scalars, nested.

  Returns:
    The same structure in plain Python values.

  Raises:
    TypeError: for a value of any other type (naming the type and dtype).
  """
  if tree is None or isinstance(tree, (str, bool)):
    return tree
  if isinstance(tree, tuple) and hasattr(tree, "_asdict"):
    return {k: to_jsonable(v) for k, v in tree._asdict().items()}
  if isinstance(tree, Mapping):
    return {str(k): to_jsonable(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [to_jsonable(v) for v in tree]
  if isinstance(tree, (int, np.integer)):
    return int(tree)
  if isinstance(tree, (float, np.floating)):
    return _finite_or_none(float(tree))
  if not hasattr(tree, "dtype"):
    raise TypeError(f"to_jsonable cannot convert {type(tree).__name__}")
  arr = np.asarray(tree)
  if arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.integer):
    return arr.tolist()
  if np.issubdtype(arr.dtype, np.floating) or arr.dtype.name == "bfloat16":
    return _clean_floats(arr.astype(np.float64).tolist())
  raise TypeError(f"to_jsonable cannot convert {type(tree).__name__} of dtype {arr.dtype}")
