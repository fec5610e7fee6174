"""Model-FLOPs utilisation (MFU): a run's model FLOPs per second over its devices' peak.

:func:`utilisation` divides ``flops_per_token x tokens_per_s`` (the model's FLOPs,
:func:`attnjax.train.flops_per_token`: recomputation and padding do not count) by the
devices' dense bfloat16 peak from :data:`PEAK_BF16_FLOPS`, by device kind; on a CPU or
an unknown kind the MFU is None. Every run's ``summary.json`` and
``experiments/device_check.py`` use this one computation.

Guide: :doc:`/guides/training`, section "Summary and throughput".
"""

from attnjax._src.train.mfu import PEAK_BF16_FLOPS, peak_flops, utilisation

__all__ = ["PEAK_BF16_FLOPS", "peak_flops", "utilisation"]
