"""Sweeps: many runs, resumable, one after another in this process or one process per arm.

An arm whose ``summary.json`` says finished or diverged is skipped; an arm
that was stopped or killed resumes from its last checkpoint; an arm that
diverges or even raises is recorded and the sweep goes on. The seeds of an arm
(:func:`seeded`) train together, stacked (:func:`attnjax.train.train_seeds`).
"""

from attnjax._src.train.sweep import (
  Arm,
  arm,
  config_from_json,
  folders,
  groups,
  parse_lrs,
  parse_seeds,
  run_group_in_process,
  run_group_in_subprocess,
  run_in_process,
  run_in_subprocess,
  run_sweep,
  seeded,
  variant_lr_arms,
)

__all__ = [
  "Arm",
  "arm",
  "config_from_json",
  "folders",
  "groups",
  "parse_lrs",
  "parse_seeds",
  "run_group_in_process",
  "run_group_in_subprocess",
  "run_in_process",
  "run_in_subprocess",
  "run_sweep",
  "seeded",
  "variant_lr_arms",
]
