"""Deprecated public names: each warns once per process, naming its replacement."""

from __future__ import annotations

import warnings

_WARNED: set[str] = set()


def warn_once(old: str, new: str, *, stacklevel: int = 3) -> None:
  """Emits one ``DeprecationWarning`` per process for the deprecated name ``old``.

  Args:
    old: the deprecated name, dotted (``"attnjax.nn.collect_stats"``).
    new: the call that replaces it, as the message shows it.
    stacklevel: points the warning at the caller of the deprecated function.
  """
  if old in _WARNED:
    return
  _WARNED.add(old)
  warnings.warn(f"{old} is deprecated; use {new}, which returns the same", DeprecationWarning,
                stacklevel=stacklevel)
