"""Run directory files, written so that an interrupted run never leaves a truncated file.

Implementation behind the public module :mod:`attnjax.train.rundir`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Iterable, Optional

from attnjax._src.stats.jsonable import to_jsonable


# The writer before ``attnjax.stats.to_jsonable`` wrote +-Inf as +-1e308.
OLD_INF = 1e308


def finite_or_none(value: Any) -> Optional[float]:
  """A number read from a run file as a float, or None where it stands for "missing".

  Missing is None (JSON null, today's NaN and +-Inf), NaN, +-Inf, and any
  magnitude of at least 1e308 (how older files wrote +-Inf).

  Args:
    value: a number or None.

  Returns:
    ``float(value)``, or None.
  """
  if value is None:
    return None
  value = float(value)
  return value if math.isfinite(value) and abs(value) < OLD_INF else None


def dumps(record: dict) -> str:
  """One strict JSON line (``attnjax.stats.to_jsonable``: NaN and +-Inf become null).

  Args:
    record: a dict of JSON-able values, arrays or NamedTuples.

  Returns:
    The line, without its newline.
  """
  return json.dumps(to_jsonable(record), allow_nan=False, sort_keys=False)


def write_atomic(path: str, text: str) -> None:
  """Writes ``text`` to ``path`` through a temporary file and ``os.replace``.

  A reader (or a killed writer) never sees a partly written file.

  Args:
    path: the file (its folder is created).
    text: the contents.
  """
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def write_json(path: str, obj: Any) -> None:
  """Writes ``obj`` as strict JSON (NaN and +-Inf become null), atomically.

  Args:
    path: the file.
    obj: JSON-able values, arrays or NamedTuples.
  """
  write_atomic(path, json.dumps(to_jsonable(obj), indent=1, allow_nan=False) + "\n")


def read_json(path: str) -> Optional[dict]:
  """The JSON of ``path``, or None when there is no such file.

  Args:
    path: the file.

  Returns:
    The parsed value, or None.
  """
  if not os.path.isfile(path):
    return None
  with open(path) as f:
    return json.load(f)


def read_jsonl(path: str) -> list[dict]:
  """All complete lines of a JSONL file (a final line cut mid-write is skipped).

  Args:
    path: the file (none: no records).

  Returns:
    The records in order, up to the first incomplete or unparsable line.
  """
  if not os.path.isfile(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      if not line.endswith("\n"):
        break
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        break
  return out


def truncate_jsonl(path: str, keep_step_below: int) -> None:
  """Atomically rewrites ``path`` keeping only complete lines with ``step < keep_step_below``.

  A resumed run drops the records it will write again.

  Args:
    path: the JSONL file (nothing happens if it does not exist).
    keep_step_below: the first step to drop.
  """
  if not os.path.exists(path):
    return
  kept = [r for r in read_jsonl(path) if r.get("step", -1) < keep_step_below]
  write_atomic(path, "".join(dumps(r) + "\n" for r in kept))


class JsonlWriter:
  """Appends records as lines; each ``write`` is flushed and fsynced before it returns.

  A context manager (closes on exit).

  Args:
    path: the JSONL file, opened for appending (its folder is created).
  """

  def __init__(self, path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    self.path = path
    self._f = open(path, "a")

  def write(self, records: Iterable[dict]) -> None:
    """Appends ``records``, one strict JSON line each (:func:`.dumps`)."""
    text = "".join(dumps(r) + "\n" for r in records)
    if text:
      self._f.write(text)
      self._f.flush()
      os.fsync(self._f.fileno())

  def close(self) -> None:
    """Closes the file."""
    self._f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class RunDir:
  """Paths of one run directory (nothing is created until a run writes).

  Args:
    root: the run directory, e.g. ``runs/compare/dense``.
  """

  def __init__(self, root: str):
    self.root = root

  def path(self, *parts: str) -> str:
    """``root/parts...``."""
    return os.path.join(self.root, *parts)

  @property
  def config(self) -> str:
    """The resolved config, ``config.json``."""
    return self.path("config.json")

  @property
  def metrics(self) -> str:
    """Every logged step, ``metrics.jsonl``."""
    return self.path("metrics.jsonl")

  @property
  def probes(self) -> str:
    """The probe's statistics at each probe step, ``probes.jsonl``."""
    return self.path("probes.jsonl")

  @property
  def summary(self) -> str:
    """How the run ended, ``summary.json``."""
    return self.path("summary.json")

  @property
  def checkpoints(self) -> str:
    """The orbax checkpoints' folder (absolute, as orbax requires)."""
    return os.path.abspath(self.path("checkpoints"))

  @property
  def plots(self) -> str:
    """The run's PNG plots' folder."""
    return self.path("plots")

  def read_summary(self) -> Optional[dict]:
    """The summary as a dict, or None when the run has written none."""
    return read_json(self.summary)

  def is_done(self) -> bool:
    """True when the run ended (finished or diverged); a stopped or killed run is not done."""
    s = self.read_summary()
    return bool(s) and s.get("status") in ("finished", "diverged")


def resolve_root(path: str, *, what: str = "ATTNJAX_RUN_DIR") -> str:
  """The existing folder a run root ``path`` names, as an absolute path.

  A relative path is read from the directory the user launched from: ``$PWD``, which a
  Jupyter kernel inherits from the shell that started Jupyter while its working directory is
  the notebook's folder; then from the working directory.

  Args:
    path: the root as given (e.g. ``runs/compare``).
    what: how messages name it.

  Raises:
    FileNotFoundError: ``"not found: PATH"``, with the places tried.
  """
  path = os.path.expanduser(os.fspath(path))
  if os.path.isabs(path):
    tried = [path]
  else:
    launched = os.environ.get("PWD")
    bases = [b for b in (launched, os.getcwd()) if b and os.path.isabs(b)]
    tried = list(dict.fromkeys(os.path.join(b, path) for b in bases))
  for candidate in tried:
    if os.path.isdir(candidate):
      return os.path.abspath(candidate)
  raise FileNotFoundError(
    f"{what}={path!r}: not found: {' or '.join(tried)}"
    + (" (a relative path is read from the directory you launched from)" if len(tried) > 1 else "")
  )
