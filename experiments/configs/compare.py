"""python experiments/compare.py --config experiments/configs/compare.py:preset=cpu

Every attention variant at one learning rate on Shakespeare (character level):
the README's main job. With ``preset=cpu`` (2 layers, d=64, T=64, batch 32 as
4 accumulated microbatches of 8, 240 steps) the 9 arms take a few minutes on a
2-core CPU, compilation included. Arguments after ``:``: ``preset`` (cpu, gpu, tpu), ``lr``, ``data``
(shakespeare or bigram_backcopy). The arms are ``--config.sweep.variants``
(comma-separated names from ``attnjax.train.variants.VARIANTS``); presets gpu and
tpu add the gated and delta-rule families (``variants.GATED``: retnet, mamba2,
gla, deltanet, gated_deltanet) and multi-head latent attention (``variants.LATENT``:
mla), which the cpu preset runs only when named there (``dense,mla``).
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import COMPARE, GATED, LATENT


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0, data="shakespeare")
  c = apply_preset(base_config(), a.preset)
  c.data.name = a.data
  c.opt.lr = a.lr or (1e-2 if a.preset == "cpu" else 1e-3)
  variants = COMPARE if a.preset == "cpu" else COMPARE + GATED + LATENT
  c.sweep = ml_collections.ConfigDict({"variants": ",".join(variants)})
  return c
