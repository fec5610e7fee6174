"""One config mechanism: big_vision-style Python configs, ``:arg`` presets, ``--config.x=y`` overrides.

A config file defines ``get_config(arg: str) -> ml_collections.ConfigDict``;
its docstring starts with the command that runs it. On the command line::

    python experiments/train.py --config experiments/configs/shakespeare.py:preset=cpu,attn=cosine         --config.opt.lr=3e-3 --config.train.steps=100

Every key an override names must already exist in the config (the config is
locked), every value is parsed to the type of the value it replaces, and
:func:`~attnjax.train.validate` checks shapes and choices, all before anything is compiled,
with messages that name the key.
"""

from attnjax._src.train.config import (
  DTYPES,
  PRESETS,
  apply_overrides,
  apply_preset,
  as_list,
  base_config,
  load_config,
  parse_arg,
  split_argv,
  validate,
)

__all__ = [
  "DTYPES",
  "PRESETS",
  "apply_overrides",
  "apply_preset",
  "as_list",
  "base_config",
  "load_config",
  "parse_arg",
  "split_argv",
  "validate",
]
