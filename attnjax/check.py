"""``python -m attnjax.check``: attnjax's Pallas kernels checked on this device, and their verdict.

Each run checks ``pallas_gpu``, ``mosaic_gpu`` or ``pallas_tpu`` (``--kernel``,
``--platform``) against the fp32 reference in value and gradient, times them, and
writes the verdict that lets auto-dispatch take them on this kind of device (``--ship``:
into the package, to commit); ``--out`` also writes a markdown report. Without the
platform's device it exits with status 2; ``--interpret`` checks on the CPU instead.

Guide: :doc:`/guides/targets`, section "What ``python -m attnjax.check`` checks";
verdicts and dispatch: :doc:`/guides/kernels`.
"""

from attnjax._src.check import (
  CHECK_SHAPE,
  INTERPRET_SHAPE,
  KERNELS,
  MOSAIC_SIZES,
  ROW_FLOOR,
  Report,
  SPEED_SIZES,
  STRUCTURES,
  TOLERANCE,
  check_kernel,
  command,
  row_error,
)

__all__ = [
  "CHECK_SHAPE",
  "INTERPRET_SHAPE",
  "KERNELS",
  "MOSAIC_SIZES",
  "ROW_FLOOR",
  "Report",
  "SPEED_SIZES",
  "STRUCTURES",
  "TOLERANCE",
  "check_kernel",
  "command",
  "row_error",
]

if __name__ == "__main__":
  import sys

  from attnjax._src.check import main

  sys.exit(main())
