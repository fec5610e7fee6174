"""The reusable training loop: config, optimizer, pure steps, run directories, sweeps.

from attnjax.train import load_config, train
cfg = load_config("experiments/configs/shakespeare.py:preset=cpu,attn=cosine", ["opt.lr=3e-3"])
cfg.run_dir = "runs/demo/cosine"
summary = train(cfg)
"""

from attnjax._src.train import (
  VARIANTS,
  RunDir,
  SeedGroup,
  Trainer,
  apply_overrides,
  base_config,
  build_model,
  count_params,
  flops_per_token,
  init_distributed,
  load_config,
  make_eval_step,
  make_optimizer,
  make_train_step,
  model_config,
  parse_arg,
  schedule,
  split_argv,
  stacked_step,
  train,
  train_or_load,
  train_seeds,
  validate,
)

__all__ = [
  "VARIANTS",
  "RunDir",
  "SeedGroup",
  "Trainer",
  "apply_overrides",
  "base_config",
  "build_model",
  "count_params",
  "flops_per_token",
  "init_distributed",
  "load_config",
  "make_eval_step",
  "make_optimizer",
  "make_train_step",
  "model_config",
  "parse_arg",
  "schedule",
  "split_argv",
  "stacked_step",
  "train",
  "train_or_load",
  "train_seeds",
  "validate",
]
