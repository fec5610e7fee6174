"""When auto-dispatch may take attnjax's own Pallas kernels: checked on the device, or opted in.

The kernels jax ships and tests on hardware (cuDNN through ``jax.nn``, splash)
and attnjax's plain-JAX engines (block-wise, reference) are always taken where
they cover a call. attnjax's Pallas kernels (``pallas_gpu``, ``mosaic_gpu``,
``pallas_tpu``) are checked here only by interpret mode and deviceless
compiles, which cannot see a race or a device's numerics; auto-dispatch takes
one on a kind of device only when (:func:`allows`):

- ``attnjax.config.kernels == "all"`` (or ``ATTNJAX_KERNELS=all``): the user
  opted in; or
- the setting is ``"checked"`` (the default), the run is a single process, and
  ``python -m attnjax.check`` has passed for that kernel on that kind of device
  with this attnjax and jax version: its verdict is a JSON file in
  :func:`cache_dir` (``verdicts/<device kind>.json``: the versions, the device
  kind, and per kernel whether every check passed).

A multi-process run (``jax.process_count() > 1``) decides from the
configuration only: each host has its own cache directory, and every process
must take the same choice (one kernel on one host and another elsewhere would
be two programs), so there the kernels run only with ``kernels="all"``.
Otherwise auto-dispatch takes the next engine of its list, and one line on the
``"attnjax"`` logger per process names the kernel skipped and the command that
enables it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import re
from typing import NamedTuple, Optional

import jax

from attnjax import _target
from attnjax._config import config
from attnjax._version import __version__

ENV_CACHE_DIR = "ATTNJAX_CACHE_DIR"
# The command that checks each kernel on the local device and records its verdict.
CHECK_COMMANDS = {"pallas_gpu": "python -m attnjax.check",
                  "mosaic_gpu": "python -m attnjax.check --kernel mosaic_gpu",
                  "pallas_tpu": "python -m attnjax.check --platform tpu"}

logger = logging.getLogger("attnjax")
_logged: list = []  # the one line this process logged (tests reset it)


def cache_dir() -> pathlib.Path:
  """``$ATTNJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnjax``, else ``~/.cache/attnjax``."""
  path = os.environ.get(ENV_CACHE_DIR)
  if path:
    return pathlib.Path(path).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attnjax"


def verdict_path(device_kind: str) -> pathlib.Path:
  """The verdict file of a kind of device (``jax.Device.device_kind``)."""
  name = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind).strip("_") or "device"
  return cache_dir() / "verdicts" / f"{name}.json"


def versions() -> dict[str, str]:
  """The versions a verdict holds for: a verdict of another attnjax or jax does not count."""
  return {"attnjax": __version__, "jax": jax.__version__}


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None
  return data if isinstance(data, dict) else None


def read_verdict(device_kind: str) -> Optional[dict]:
  """The verdict of ``device_kind`` for this attnjax and jax version, or None (read once per
  process and file; :func:`write_verdict` refreshes it)."""
  data = _load(str(verdict_path(device_kind)))
  if data is None or data.get("device_kind") != device_kind:
    return None
  if any(data.get(key) != value for key, value in versions().items()):
    return None
  return data


def write_verdict(device_kind: str, kernels: dict[str, dict]) -> pathlib.Path:
  """Records the checks of ``kernels`` (``{name: {"passed": bool, ...}}``) on ``device_kind``.

  Kernels checked earlier on the same kind with the same versions keep their entries; a
  kernel checked again takes its new one. Dispatch reads verdicts when a function is traced,
  so this clears jax's caches (as a change of ``attnjax.config.kernels`` does). Returns the
  file written.
  """
  path = verdict_path(device_kind)
  known = (read_verdict(device_kind) or {}).get("kernels", {})
  data = dict(versions(), device_kind=device_kind, kernels={**known, **kernels})
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
  os.replace(tmp, path)
  _load.cache_clear()
  jax.clear_caches()
  return path


def checked(kernel: str, device_kind: str) -> bool:
  """Whether ``python -m attnjax.check`` passed for ``kernel`` on ``device_kind``."""
  entry = (read_verdict(device_kind) or {}).get("kernels", {}).get(kernel)
  return isinstance(entry, dict) and entry.get("passed") is True


class Decision(NamedTuple):
  """Whether auto-dispatch may take a kernel, and what to tell the user when it may not
  (None: nothing to tell: the user chose ``"trusted"``, or no device of the kind is known)."""

  allowed: bool
  note: Optional[str] = None


def allows(kernel: str, platform: str) -> Decision:
  """May auto-dispatch take attnjax's ``kernel`` in the branch of ``platform``?"""
  setting = config.kernels
  if setting == "all":
    return Decision(True)
  if setting == "trusted":
    return Decision(False)
  kind = _target.device_kind(platform)
  if kind is None:  # e.g. exporting for a GPU from a CPU host: nothing here can check it
    return Decision(False)
  command = CHECK_COMMANDS.get(kernel, "python -m attnjax.check")
  processes = jax.process_count()
  if processes > 1:
    return Decision(False, (
        f"{kernel} is not used on {kind}: a run of {processes} processes reads no verdict of "
        f"`{command}` (each host has its own), so that every process chooses alike; set "
        f"ATTNJAX_KERNELS=all on every process once it has passed on this kind of device"))
  if checked(kernel, kind):
    return Decision(True)
  return Decision(False, (
      f"{kernel} is not used on {kind}: it has not passed `{command}` on this kind of device "
      f"(attnjax {__version__}, jax {jax.__version__}; verdicts in {cache_dir()}); run it "
      f"here to check the kernel and let auto-dispatch take it, or set ATTNJAX_KERNELS=all "
      f"(attnjax.config.kernels = 'all') to use it unchecked"))


def note_skipped(notes: list[str], chosen: str) -> None:
  """Logs, once per process, why auto-dispatch skipped attnjax's kernels and ran ``chosen``."""
  if not notes or _logged:
    return
  _logged.append(chosen)
  logger.warning("attnjax: %s; auto-dispatch runs %r instead.", "; ".join(notes), chosen)
