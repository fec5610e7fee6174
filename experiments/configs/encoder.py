"""python experiments/compare.py --config experiments/configs/encoder.py:preset=cpu --out runs/encoder

The encoder study of Bondarenko et al. 2023 at CPU scale: BERT-style encoders (post-LN,
LayerNorm, masked LM: 15% of positions, 80% [MASK] / 10% random / 10% kept) on Shakespeare
(characters), one arm per attention variant: vanilla softmax (``dense``), gated attention
(``gated``, Qiu et al.'s sigmoid output gate; the paper's own gate differs) and clipped
softmax (``clipped_softmax``, once its normaliser is registered). The probe records per
layer the outliers of the attention output, MLP output and residual stream, the masked-LM
loss in float and under W8A8 fake quantisation, and the attention mass on [CLS] (the BOS)
and the delimiters. Arguments after ``:``: ``preset`` (cpu, gpu, tpu), ``lr``, ``seed``,
``layers`` (cpu: 4), ``steps``.
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import VARIANTS

ENCODER_STUDY = ("dense", "gated", "clipped_softmax")


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0, seed=0, layers=0, steps=0)
  c = apply_preset(base_config(), a.preset)
  c.seed = a.seed
  c.data.name = "shakespeare"
  c.data.objective = "mlm"
  c.data.mask_rate = 0.15
  c.model.norm = "layer"
  c.model.norm_placement = "post_residual"
  if a.preset == "cpu":
    c.model.update(num_layers=a.layers or 4, d_model=64, num_heads=4)
    c.train.update(steps=a.steps or 600, eval_every=200, probe_every=200, checkpoint_every=200)
  else:
    c.model.num_layers = a.layers or c.model.num_layers
    c.train.steps = a.steps or c.train.steps
  c.opt.lr = a.lr or (3e-3 if a.preset == "cpu" else 5e-4)
  arms = [v for v in ENCODER_STUDY if v in VARIANTS]
  c.sweep = ml_collections.ConfigDict({"variants": ",".join(arms)})
  return c
