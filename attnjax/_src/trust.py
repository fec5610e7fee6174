"""When auto-dispatch may take attnjax's own Pallas kernels: checked on the device, or opted in.

jax's kernels (cuDNN, splash) and attnjax's plain-JAX engines are always taken where they
cover a call. ``pallas_gpu``, ``mosaic_gpu`` and ``pallas_tpu`` are taken on a kind of
device only when :func:`allows` says so: ``attnjax.config.auto_kernels == "all"``, or
``"checked"`` (the default) and a current verdict of ``python -m attnjax.check`` (shipped
in :data:`SHIPPED_DIR`, or in :func:`cache_dir` for single-process runs) passed the
call's case class (:func:`call_class`) for the kernel's sources (:func:`source_digest`).
Otherwise one logged line names the kernel skipped, why, and the check to run.
Guide: docs/guides/kernels.md, section "Auto-dispatch".
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pathlib
import re
from typing import Callable, NamedTuple, Optional, Union

import jax
import numpy as np

from attnjax._src import target
from attnjax._src.config import config
from attnjax._version import __version__

ENV_CACHE_DIR = "ATTNJAX_CACHE_DIR"


def check_command(kernel: str, platform: str) -> str:
  """The command that checks ``kernel`` (of ``platform``) on the local device and records its
  verdict."""
  return f"python -m attnjax.check --platform {platform} --kernel {kernel}"


#: Kernels whose sources are a package of another name (``kernels/<package>/``): the
#: selected-block attention kernels of both platforms share ``kernels/selected/``.
KERNEL_PACKAGES = {"selected_mosaic_gpu": "selected", "selected_pallas_tpu": "selected"}
#: The implementation's directory (``attnjax/_src``, the root of the sources a digest covers).
PACKAGE_DIR = pathlib.Path(__file__).resolve().parent
#: The verdicts shipped with the package (``python -m attnjax.check --ship`` writes them).
SHIPPED_DIR = PACKAGE_DIR.parent / "verdicts"
#: The shared modules (relative to the package) whose code every Pallas kernel runs, besides its
#: own package ``kernels/<name>/``: the normalisers' seam, logits and softcap, the statistics,
#: the plan base and the custom-VJP machinery. A change to any of them makes verdicts stale.
SHARED_SOURCES = (
  "normalizers.py",
  "logits.py",
  "attention_stats.py",
  "kernels/_plan.py",
  "kernels/autodiff.py",
  "kernels/kernel_vjp.py",
  "kernels/linear_map.py",
)
#: The structures of a case class (:func:`call_class`): ``python -m attnjax.check`` checks the
#: first three; "full" (no mask) is a class it has no case for.
STRUCTURES = ("causal", "window", "segments", "full")

logger = logging.getLogger("attnjax")
_logged: list = []  # the one line this process logged (tests reset it)


def cache_dir() -> pathlib.Path:
  """``$ATTNJAX_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnjax``, else ``~/.cache/attnjax``."""
  path = os.environ.get(ENV_CACHE_DIR)
  if path:
    return pathlib.Path(path).expanduser()
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "attnjax"


def _file_name(device_kind: str) -> str:
  name = re.sub(r"[^A-Za-z0-9._-]+", "_", device_kind).strip("_") or "device"
  return f"{name}.json"


def verdict_path(device_kind: str, shipped: bool = False) -> pathlib.Path:
  """The verdict file of a kind of device (``jax.Device.device_kind``): the local cache's, or
  with ``shipped`` the package's (:data:`SHIPPED_DIR`)."""
  base = SHIPPED_DIR if shipped else cache_dir() / "verdicts"
  return base / _file_name(device_kind)


def source_files(kernel: str, root: Optional[os.PathLike] = None) -> list[pathlib.Path]:
  """The files :func:`source_digest` covers: ``kernels/<kernel>/*.py`` (its
  :data:`KERNEL_PACKAGES` entry where it has one) and :data:`SHARED_SOURCES`, under ``root``
  (default: this package's directory)."""
  root = pathlib.Path(root) if root is not None else PACKAGE_DIR
  package = root / "kernels" / KERNEL_PACKAGES.get(kernel, kernel)
  if not package.is_dir():
    raise ValueError(f"kernel={kernel!r}: no kernel package {package}")
  return sorted(package.glob("*.py")) + [root / name for name in SHARED_SOURCES]


def digest_of(kernel: str, root: Optional[os.PathLike] = None) -> str:
  """The sha256 (hex) of ``kernel``'s sources under ``root``: each file's path relative to it
  and its bytes (line endings as ``\\n``), in :func:`source_files`'s order."""
  root = pathlib.Path(root) if root is not None else PACKAGE_DIR
  h = hashlib.sha256()
  for path in source_files(kernel, root):
    h.update(path.relative_to(root).as_posix().encode() + b"\0")
    h.update(path.read_bytes().replace(b"\r\n", b"\n") + b"\0")
  return h.hexdigest()


@functools.lru_cache(maxsize=None)
def source_digest(kernel: str) -> str:
  """The digest of the installed ``kernel``'s sources (:func:`digest_of`; once per process)."""
  return digest_of(kernel)


def case_class(normalizer: str, structure: str, dtype) -> str:
  """The name of a case class, e.g. ``"sigmoid causal bfloat16"``."""
  return f"{normalizer} {structure} {np.dtype(dtype).name}"


def call_class(inputs, opts) -> str:
  """The case class of a dense call (``DenseInputs``, ``DenseOptions``): its normaliser, its
  dtype (q's), and its structure: ``"segments"`` with segment ids, else ``"window"`` with a
  window, else ``"causal"``, else ``"full"``."""
  structure = (
    "segments"
    if inputs.q_segment_ids is not None
    else "window"
    if opts.window is not None
    else "causal"
    if opts.is_causal
    else "full"
  )
  return case_class(opts.normalizer, structure, inputs.q.dtype)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Optional[dict]:
  try:
    with open(path) as f:
      data = json.load(f)
  except (OSError, ValueError):
    return None
  return data if isinstance(data, dict) else None


def read_verdicts(device_kind: str, shipped: bool = False) -> dict[str, dict]:
  """``{kernel: entry}`` of the local (or shipped) verdict file of ``device_kind``, whatever
  their versions and digests ({} when there is none); read once per process and file
  (:func:`write_verdict` refreshes it)."""
  data = _load(str(verdict_path(device_kind, shipped)))
  if data is None or data.get("device_kind") != device_kind:
    return {}
  kernels = data.get("kernels")
  return kernels if isinstance(kernels, dict) else {}


def _same_result(a: dict, b: dict) -> bool:
  return all(a.get(key) == b.get(key) for key in ("attnjax", "digest", "passed", "cases"))


def write_verdict(
  device_kind: str, kernels: dict[str, dict], shipped: bool = False
) -> pathlib.Path:
  """Records the checks of ``kernels`` (``{name: {"passed": bool, "cases": {class: bool},
  ...}}``, the check's own results) on ``device_kind``, in the local cache or, with
  ``shipped``, in the package's :data:`SHIPPED_DIR`.

  Each entry gains this attnjax version, the jax version (a list: the same result measured
  with another jax version before is kept, its versions joined) and its kernel's
  :func:`source_digest`. Other kernels keep their entries. Dispatch reads verdicts when a
  function is traced, so this clears jax's caches (as a change of ``attnjax.config.auto_kernels``
  does). Returns the file written.
  """
  path = verdict_path(device_kind, shipped)
  known = dict(read_verdicts(device_kind, shipped))
  for name, entry in kernels.items():
    entry = dict(entry, attnjax=__version__, jax=[jax.__version__], digest=source_digest(name))
    old = known.get(name)
    if isinstance(old, dict) and _same_result(old, entry):
      entry["jax"] = sorted(set(old.get("jax") or []) | {jax.__version__})
    known[name] = entry
  data = dict(device_kind=device_kind, kernels=known)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_suffix(f".{os.getpid()}.tmp")
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
  os.replace(tmp, path)
  _load.cache_clear()
  jax.clear_caches()
  return path


class Verdict(NamedTuple):
  """What the verdicts say of a kernel for a case class: ``status`` is ``"passed"``,
  ``"not checked"``, ``"failed"`` (``case``: the failed case class) or ``"stale"``;
  ``source``: ``"local"`` or ``"shipped"`` (None: no verdict counted)."""

  status: str
  case: Optional[str] = None
  source: Optional[str] = None


def verdict(
  kernel: str, device_kind: str, klass: Optional[str] = None, local: bool = True
) -> Verdict:
  """The verdict of ``kernel`` on ``device_kind`` for calls of case class ``klass`` (None:
  every class), from the local cache (unless ``local`` is False) and the shipped verdicts.

  An entry counts with one of its jax versions; of those, only one with the current
  :func:`source_digest` (else "stale"), a local one first. A class it checked counts as its
  result; a class it did not check passes when every case did.
  """
  sources = (("local", True), ("shipped", False)) if local else (("shipped", False),)
  found = []
  for source, from_cache in sources:
    entry = read_verdicts(device_kind, shipped=not from_cache).get(kernel)
    if isinstance(entry, dict) and jax.__version__ in (entry.get("jax") or ()):
      found.append((source, entry))
  if not found:
    return Verdict("not checked")
  current = [(s, e) for s, e in found if e.get("digest") == source_digest(kernel)]
  if not current:
    return Verdict("stale", source=found[0][0])
  source, entry = current[0]
  cases = entry.get("cases") if isinstance(entry.get("cases"), dict) else {}
  if klass is not None and klass in cases:
    ok = cases[klass] is True
    return Verdict("passed" if ok else "failed", None if ok else klass, source)
  if entry.get("passed") is True:
    return Verdict("passed", source=source)
  failed = [c for c, ok in cases.items() if ok is not True] or list(entry.get("failed") or [])
  return Verdict("failed", failed[0] if failed else "a case", source)


def checked(kernel: str, device_kind: str, klass: Optional[str] = None) -> bool:
  """Whether ``python -m attnjax.check`` passed for ``kernel`` on ``device_kind`` (for calls of
  case class ``klass``; None: every case)."""
  return verdict(kernel, device_kind, klass).status == "passed"


class Decision(NamedTuple):
  """Whether auto-dispatch may take a kernel, and what to tell the user when it may not
  (None: nothing to tell: the user chose ``"jax"``, or no device of the kind is known)."""

  allowed: bool
  note: Optional[str] = None


def allows(
  kernel: str, platform: str, klass: Union[str, Callable[[], str], None] = None
) -> Decision:
  """May auto-dispatch take attnjax's ``kernel`` in the branch of ``platform``, for a call of
  case class ``klass`` (:func:`call_class`, or a function computing it, called only when a
  verdict is read; None: a kernel that passed every case)?"""
  setting = config.auto_kernels
  if setting == "all":
    return Decision(True)
  if setting == "jax":
    return Decision(False)
  kind = target.device_kind(platform)
  if kind is None:  # e.g. exporting for a GPU from a CPU host with no mesh: nothing names it
    return Decision(False)
  processes = jax.process_count()
  klass = klass() if callable(klass) else klass
  found = verdict(kernel, kind, klass, local=processes == 1)
  if found.status == "passed":
    return Decision(True)
  return Decision(False, _note(kernel, platform, kind, klass, found, processes))


def _note(
  kernel: str, platform: str, kind: str, klass: Optional[str], found: Verdict, processes: int
) -> str:
  """The log line of a kernel auto-dispatch skipped: why, and the check that enables it."""
  command = check_command(kernel, platform)
  calls = f" for {klass} calls" if klass else ""
  if found.status == "stale":
    why = (
      f"stale: its sources changed since its {found.source} verdict (digest "
      f"{source_digest(kernel)[:12]})"
    )
  elif found.status == "failed":
    why = f"failed {found.case} in its {found.source} verdict"
  elif processes > 1:
    why = (
      f"not checked: no shipped verdict for jax {jax.__version__}, and a run of "
      f"{processes} processes reads no local one (each host has its own)"
    )
  else:
    why = (
      f"not checked with jax {jax.__version__} (shipped verdicts in {SHIPPED_DIR}, local "
      f"ones in {cache_dir()})"
    )
  return (
    f"{kernel} is not used on {kind}{calls}: {why}; run `{command}` on this kind of "
    f"device to check it and let auto-dispatch take it, or set ATTNJAX_AUTO_KERNELS=all "
    f"(attnjax.config.auto_kernels = 'all') to use it unchecked"
  )


def note_skipped(notes: list[str], chosen: str) -> None:
  """Logs, once per process, why auto-dispatch skipped attnjax's kernels and ran ``chosen``."""
  if not notes or _logged:
    return
  _logged.append(chosen)
  logger.warning("attnjax: %s; auto-dispatch runs %r instead.", "; ".join(notes), chosen)
