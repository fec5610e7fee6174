"""Model-FLOPs utilisation (MFU): a run's model FLOPs per second over its devices' peak.

    from attnjax.train import mfu
    mfu.utilisation(flops_per_token, tokens_per_s, jax.devices())
    # {"mfu": 0.25, "model_flops_per_s": 2.47e14, "peak_flops_per_s": 9.89e14,
    #  "device_kind": "NVIDIA H200"}

Model FLOPs per token are :func:`attnjax.train.flops_per_token` (``6 N``
plus causal attention: what the model needs, not what a kernel happens to
compute, so recomputation and padding do not count). The peak is the device's
dense bfloat16 matmul rate from its data sheet, by ``jax.Device.device_kind``;
on a CPU or a device kind not in :data:`PEAK_BF16_FLOPS` the MFU is None and
only the FLOP/s achieved are reported. Every run's ``summary.json`` and
``experiments/device_check.py`` (section 6) use this one computation.
"""

from attnjax._src.train.mfu import PEAK_BF16_FLOPS, peak_flops, utilisation

__all__ = ["PEAK_BF16_FLOPS", "peak_flops", "utilisation"]
