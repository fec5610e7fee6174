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
  BUILTIN,
  CHECK_SHAPE,
  INTERPRET_SHAPE,
  KERNEL,
  KERNELS,
  MOSAIC_SIZES,
  PLATFORM_KERNELS,
  ROW_FLOOR,
  SPEED_SIZES,
  STRUCTURES,
  TOLERANCE,
  Report,
  case_program,
  check_cases,
  check_cudnn_and_blockwise,
  check_dispatch,
  check_kernel,
  compile_all,
  kernels_to_check,
  main,
  mosaic_table,
  mosaic_targets,
  parser,
  qkv,
  row_error,
  run_checks,
  speed_shape,
  speed_table,
  targets,
  write,
)

__all__ = [
  "BUILTIN",
  "CHECK_SHAPE",
  "INTERPRET_SHAPE",
  "KERNEL",
  "KERNELS",
  "MOSAIC_SIZES",
  "PLATFORM_KERNELS",
  "ROW_FLOOR",
  "SPEED_SIZES",
  "STRUCTURES",
  "TOLERANCE",
  "Report",
  "case_program",
  "check_cases",
  "check_cudnn_and_blockwise",
  "check_dispatch",
  "check_kernel",
  "compile_all",
  "kernels_to_check",
  "main",
  "mosaic_table",
  "mosaic_targets",
  "parser",
  "qkv",
  "row_error",
  "run_checks",
  "speed_shape",
  "speed_table",
  "targets",
  "write",
]

if __name__ == "__main__":
  import sys

  from attnjax._src.check import main

  sys.exit(main())
