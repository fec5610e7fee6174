"""The reusable training loop: config, optimizer, pure steps, run directories, sweeps.

Implementation behind the public module :mod:`attnjax.train`.
"""

from attnjax._src.train.config import apply_overrides
from attnjax._src.train.config import base_config
from attnjax._src.train.config import load_config
from attnjax._src.train.config import parse_arg
from attnjax._src.train.config import split_argv
from attnjax._src.train.config import validate
from attnjax._src.train.loop import Trainer
from attnjax._src.train.loop import init_distributed
from attnjax._src.train.loop import train
from attnjax._src.train.model import build_model, count_params, flops_per_token, model_config
from attnjax._src.train.optim import make_optimizer
from attnjax._src.train.optim import schedule
from attnjax._src.train.pretrained import train_or_load
from attnjax._src.train.rundir import RunDir
from attnjax._src.train.seeds import SeedGroup, stacked_step, train_seeds
from attnjax._src.train.step import make_eval_step
from attnjax._src.train.step import make_train_step
from attnjax._src.train.variants import VARIANTS

__all__ = [
  "RunDir",
  "SeedGroup",
  "Trainer",
  "VARIANTS",
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
