"""python experiments/lr_sweep.py --config experiments/configs/lr_sweep.py:preset=cpu

Variants x peak learning rates on Shakespeare (Wortsman et al. 2023, sec. 2.2 and
3.1): LR sensitivity, max stable LR, loss vs LR and max attention logit vs step.
Arguments after ``:``: ``preset`` (cpu, gpu, tpu) and ``grid``: ``wortsman``
(3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0; 8 LRs x 4 variants, about
15-25 CPU-minutes with preset=cpu) or ``short`` (1e-3, 1e-2, 1e-1, 1.0). The
arms are ``--config.sweep.variants`` x ``--config.sweep.lrs`` (comma-separated), each at
every seed of ``--config.sweep.seeds`` (one, 0, by default; ``0,1,2`` gives every number a
spread, the seeds of an arm trained stacked); presets gpu and tpu add the gated and
delta-rule families (``attnjax.train.variants.GATED``).
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import GATED

GRIDS = {"wortsman": "3e-4,1e-3,3e-3,1e-2,3e-2,1e-1,3e-1,1.0", "short": "1e-3,1e-2,1e-1,1.0"}


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", grid="wortsman")
  if a.grid not in GRIDS:
    raise ValueError(f"grid={a.grid!r} is not one of: {', '.join(GRIDS)}")
  c = apply_preset(base_config(), a.preset)
  c.data.name = "shakespeare"
  c.opt.weight_decay = 1e-4
  if a.preset == "cpu":
    c.train.update(dict(steps=200, eval_every=100, probe_every=200, checkpoint_every=100))
  variants = ("dense", "qk_layernorm", "qk_rmsnorm", "cosine")
  if a.preset != "cpu":
    variants += GATED
  c.sweep = ml_collections.ConfigDict(
    {"variants": ",".join(variants), "lrs": GRIDS[a.grid], "seeds": "0"}
  )
  return c
