"""python experiments/kv_cache.py --config experiments/configs/kv_cache.py:preset=cpu

Compressed KV caches: train a softmax model on Shakespeare
(64 tokens, 240 steps on cpu), then decode held-out sequences of ``data.seq_len``
tokens one token at a time through each cache policy of
:mod:`attnjax.nn.kv_policies` (full, int8, fp8, and h2o and sinks_window at
each budget) and report held-out perplexity against cache bytes, plus the bytes
each policy would need for the ``gpu`` preset model at ``sweep.gpu_len`` tokens.
Arguments after ``:``: ``preset``, ``attn`` (the trained variant, default
dense), ``lr``; ``--config.sweep.policies`` and ``--config.sweep.budgets``
(fractions of the evaluated length) choose the arms.
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", attn="dense", lr=0.0)
  c = apply_preset(base_config(), a.preset)
  c.variant = a.attn
  c.opt.lr = a.lr or (1e-2 if a.preset == "cpu" else 1e-3)
  c.sweep = ml_collections.ConfigDict(
    {
      "policies": "full,int8,fp8,h2o,sinks_window",
      "budgets": "0.25,0.5",  # h2o / sinks_window slots, as fractions of the evaluated length
      "eval_batch": 32,  # held-out sequences of data.seq_len tokens
      "gpu_len": 4096,  # the length of the gpu-preset cache bytes column
    }
  )
  return c
