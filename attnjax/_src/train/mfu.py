"""Model-FLOPs utilisation (MFU): a run's model FLOPs per second over its devices' peak.

Implementation behind the public module :mod:`attnjax.train.mfu`.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

# Dense bfloat16 peak FLOP/s per device, by a substring of its device_kind; the first match
# wins (so "H100 PCIe" before "H100", "TPU v5 lite" (v5e) before "TPU v5" (v5p)).
PEAK_BF16_FLOPS = (
  ("H100 PCIe", 756e12),
  ("H100 NVL", 835e12),
  ("H100", 989e12),
  ("H200", 989e12),
  ("H800", 989e12),
  ("A100", 312e12),
  ("TPU v6 lite", 918e12),
  ("TPU v5 lite", 197e12),
  ("TPU v5", 459e12),
  ("TPU v4", 275e12),
)


def peak_flops(device_kind: str) -> Optional[float]:
  """The dense bfloat16 peak FLOP/s of one device of ``device_kind``, or None where unknown.

  Args:
    device_kind: ``jax.Device.device_kind``, e.g. ``"NVIDIA H200"`` or ``"TPU v5 lite"``.

  Returns:
    FLOP/s, or None (a CPU, or a kind :data:`PEAK_BF16_FLOPS` does not list).
  """
  for name, flops in PEAK_BF16_FLOPS:
    if name in device_kind:
      return flops
  return None


def utilisation(
  flops_per_token: float,
  tokens_per_s: float,
  devices: Sequence[Any],
  *,
  peak_flops_per_device: Optional[float] = None,
) -> dict:
  """The MFU of a run of ``tokens_per_s`` on ``devices``.

  Args:
    flops_per_token: model FLOPs of training per token (forward and backward).
    tokens_per_s: the run's training tokens per second (all devices together).
    devices: the devices the run uses (``jax.Device``; their ``device_kind`` is read).
    peak_flops_per_device: overrides the table (e.g. ``device_check.py --peak-tflops``).

  Returns:
    ``{"mfu", "model_flops_per_s", "peak_flops_per_s", "device_kind"}``: ``mfu`` is
    ``model_flops_per_s / peak_flops_per_s``, the peak summed over ``devices``; ``mfu``
    and ``peak_flops_per_s`` are None on an unknown device kind or for mixed kinds, and
    ``mfu`` is None when ``tokens_per_s`` is not a finite number.
  """
  kinds = sorted({d.device_kind for d in devices})
  kind = kinds[0] if len(kinds) == 1 else None
  per_device = peak_flops_per_device
  if per_device is None and kind is not None:
    per_device = peak_flops(kind)
  peak = per_device * len(devices) if per_device else None
  achieved = float(flops_per_token) * float(tokens_per_s)
  finite = math.isfinite(achieved)
  return {
    "mfu": achieved / peak if peak and finite else None,
    "model_flops_per_s": achieved if finite else None,
    "peak_flops_per_s": peak,
    "device_kind": kind if kind else ", ".join(kinds),
  }
