"""The reusable training loop: config, optimizer, pure steps, run directories, sweeps.

    from attnjax.train import load_config, train
    cfg = load_config("experiments/configs/shakespeare.py:preset=cpu,attn=cosine", ["opt.lr=3e-3"])
    cfg.run_dir = "runs/demo/cosine"
    summary = train(cfg)
"""

from attnjax.train.config import apply_overrides
from attnjax.train.config import base_config
from attnjax.train.config import load_config
from attnjax.train.config import parse_arg
from attnjax.train.config import split_argv
from attnjax.train.config import validate
from attnjax.train.loop import Trainer
from attnjax.train.loop import init_distributed
from attnjax.train.loop import train
from attnjax.train.optim import make_optimizer
from attnjax.train.optim import schedule
from attnjax.train.pretrained import train_or_load
from attnjax.train.rundir import RunDir
from attnjax.train.step import make_eval_step
from attnjax.train.step import make_train_step
from attnjax.train.variants import VARIANTS

__all__ = [
    "RunDir", "Trainer", "VARIANTS", "apply_overrides", "base_config", "init_distributed",
    "load_config", "make_eval_step", "make_optimizer", "make_train_step", "parse_arg", "schedule",
    "split_argv", "train", "train_or_load", "validate",
]
