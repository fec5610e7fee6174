"""python experiments/sinks.py --config experiments/configs/sinks.py:preset=cpu

Attention sinks over training for each variant (EXPERIMENTS.md, experiment 3),
on Shakespeare and on the synthetic bigram-backcopy task (Guo et al. 2024),
which makes sinks appear in 1-3 layer models. Sink statistics (Sink_1^0.3,
F-Attn, M-Act, ...) are probed on fixed held-out length-64 sequences every
``train.probe_every`` steps. Arguments after ``:``: ``preset`` (cpu, gpu,
tpu), ``lr``. Arms: ``--config.sweep.variants`` x ``--config.sweep.datasets``.
With preset=cpu: 11 variants x 2 datasets, about 10-15 CPU-minutes; presets gpu
and tpu add the gated and delta-rule families (``attnjax.train.variants.GATED``).
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import GATED


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0)
  c = apply_preset(base_config(), a.preset)
  c.opt.lr = a.lr or (1e-2 if a.preset == "cpu" else 1e-3)
  c.data.bb_vocab_size = 64
  c.data.bb_num_triggers = 3
  if a.preset == "cpu":
    c.train.update(dict(probe_every=40, eval_every=120, checkpoint_every=120))
  variants = ("dense,softmax_one,sink_logits,sigmoid,softpick,linear,linear_unnorm,"
              "qk_layernorm,cosine,gated,window")
  if a.preset != "cpu":
    variants = ",".join((variants,) + GATED)
  c.sweep = ml_collections.ConfigDict({
      "variants": variants,
      "datasets": "shakespeare,bigram_backcopy",
  })
  return c
