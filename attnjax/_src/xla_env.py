"""XLA:CPU flags for processes that compile many small programs and run each a few times.

The test suite (``tests/conftest.py``) and CI's ``python -m attnjax.check --interpret`` step
(``.ci/run``) are compile-bound on the CPU. Call :func:`use_fast_cpu_compiles` before jax
starts its backends (the first array or device query); the flags reach subprocesses through
``XLA_FLAGS``. The library itself never sets them: a user's programs keep XLA's defaults.
"""

from __future__ import annotations

import os


def fast_cpu_compile_flags() -> list[str]:
  """The XLA flags that compile small programs faster on this jaxlib, possibly none.

  jaxlib 0.10's XLA:CPU still has the elemental fusion emitter beside the MLIR one
  (``--xla_cpu_use_fusion_emitters=false``): it compiles a block-wise forward and backward in
  about a third of the time. Later jaxlibs dropped the flag (XLA aborts on a flag it does
  not know), and no other flag of theirs measurably shortens the suite's compiles.
  """
  from jaxlib import version  # reads the version only: no backend starts

  if tuple(int(p) for p in version.__version__.split(".")[:2]) >= (0, 11):
    return []
  return ["--xla_cpu_use_fusion_emitters=false"]


def use_fast_cpu_compiles() -> None:
  """Adds :func:`fast_cpu_compile_flags` to ``XLA_FLAGS``, each unless already set."""
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in fast_cpu_compile_flags():
    if flag.split("=")[0] not in flags:
      flags = f"{flags} {flag}".strip()
  os.environ["XLA_FLAGS"] = flags
