"""Run-level metrics over a training run or a learning-rate sweep (host NumPy; no compiling).

LR sensitivity and the max stable LR of a sweep (Wortsman et al. 2023), the
spike score of a loss series (OLMo 2) and the divergence rule of the train
loop. They take small host tables (one number per step or per run), so the
loop, the report and notebooks call them without compiling; ``is_diverged``
also works on JAX arrays inside ``jax.jit``. Attention- and model-level
metrics are in :mod:`attnjax.stats`.
"""

from attnjax._src.train.metrics import (
  is_diverged,
  loss_spike_score,
  lr_sensitivity,
  max_stable_lr,
  spike_score,
)

__all__ = ["is_diverged", "loss_spike_score", "lr_sensitivity", "max_stable_lr", "spike_score"]
