"""python experiments/logit_drift.py --config experiments/configs/logit_drift.py:preset=cpu

Output-logit drift (Wortsman et al. 2023, sec. 3.1.2): dense softmax at a high learning rate with and without z-loss (1e-4) and
independent weight decay (1e-4). Without either, mean log Z of the output
logits drifts (strongly negative late in training at scale). Arguments after
``:``: ``preset`` (cpu, gpu, tpu), ``lr`` (default 3e-2 on cpu, 1e-2 on gpu/tpu).
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0)
  c = apply_preset(base_config(), a.preset)
  c.variant = "dense"
  c.opt.lr = a.lr or (3e-2 if a.preset == "cpu" else 1e-2)
  if a.preset == "cpu":
    c.train.update(dict(steps=400, eval_every=200, probe_every=200, checkpoint_every=200))
  # name: (z_loss, weight_decay)
  c.sweep = ml_collections.ConfigDict(
    {"arms": "plain:0:0,zloss:1e-4:0,wd:0:1e-4,zloss+wd:1e-4:1e-4"}
  )
  return c
