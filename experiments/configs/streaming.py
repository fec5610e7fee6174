"""python experiments/streaming.py --config experiments/configs/streaming.py:preset=cpu

Window caches with and without sink tokens (StreamingLLM, Xiao et al. 2024): train a softmax model at length T (64 on cpu),
then evaluate held-out sequences of 4T tokens token by token through a
rolling cache of T keys: the last T keys (0 sinks), or the first 4 tokens plus
the last T - 4 keys (4 sinks), keys rotated by their cache position as
StreamingLLM does; and, for reference, the full causal forward over all 4T
tokens. Arguments after ``:``: ``preset``, ``attn`` (the trained variant,
default dense), ``lr``; ``--config.sweep.num_sinks`` lists the sink counts.
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
      "length_factor": 4,  # evaluate at 4 x data.seq_len
      "num_sinks": "0,4",
      "eval_batch": 8,
    }
  )
  return c
