"""python experiments/compare.py --config experiments/configs/compare.py:preset=cpu

<<<<<<< HEAD
The README's main job: attention variants side by side on sinks and stability, 3 seeds per
arm. With ``preset=cpu`` it runs the setting where a sink forms on a CPU (experiments/RESULTS.md
section 1): bigram-backcopy with 8 triggers of 64 tokens (Guo et al. 2024), one
attention-only layer with one head (untied embeddings, RoPE), 1000 steps of batch 16 at
T = 64. Arms: ``sweep.variants`` at ``opt.lr`` (0.05, where dense softmax forms a sink and
the sink-free variants ``attnjax.train.variants.SINK_FREE`` are measured against it) and
``sweep.high_lr_variants`` (dense, qk_layernorm) also at each of ``sweep.high_lrs`` (0.3,
where dense's attention logits blow up and QK-LayerNorm's stay bounded); each arm at every
seed of ``sweep.seeds``, the seeds of an arm trained stacked (one vmapped step). About 5
minutes on a quiet 2-core CPU (RESULTS.md). Arguments after ``:``: ``preset`` (cpu, gpu,
tpu), ``lr``, ``data`` (bigram_backcopy or shakespeare). Presets gpu and tpu train the
8-layer model on Shakespeare with the gated and delta-rule families too (``variants.GATED``),
and multi-head latent attention (``variants.LATENT``: mla), which the cpu preset runs only when
named there (``dense,mla``).
=======
Every attention variant at one learning rate on Shakespeare (character level):
the README's main job. With ``preset=cpu`` (2 layers, d=64, T=64, batch 32 as
4 accumulated microbatches of 8, 240 steps) the 9 arms take a few minutes on a
2-core CPU, compilation included. Arguments after ``:``: ``preset`` (cpu, gpu, tpu), ``lr``, ``data``
(shakespeare or bigram_backcopy). The arms are ``--config.sweep.variants``
(comma-separated names from ``attnjax.train.variants.VARIANTS``); presets gpu and
tpu add the gated and delta-rule families (``variants.GATED``: retnet, mamba2,
gla, deltanet, gated_deltanet) and multi-head latent attention (``variants.LATENT``:
mla), which the cpu preset runs only when named there (``dense,mla``).
>>>>>>> i58a-nsa-dsa
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import COMPARE, GATED, LATENT

CPU_VARIANTS = ("dense", "qk_layernorm", "softmax_one", "sink_logits", "gated", "sigmoid")


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0, data="")
  c = apply_preset(base_config(), a.preset)
  if a.preset == "cpu":
    c.model.update(
      dict(d_model=64, num_layers=1, num_heads=1, mlp="none", tie_embeddings=False, rope=True)
    )
    c.data.update(
      dict(name="bigram_backcopy", seq_len=64, batch_size=16, bb_vocab_size=64, bb_num_triggers=8)
    )
    c.opt.lr = a.lr or 5e-2
    # One checkpoint, at the end, and no per-run plots (the report draws every arm with its
    # seeds' spread): the job's 6-minute budget goes to training.
    c.train.update(
      dict(
        steps=1000,
        probe_every=100,
        eval_every=500,
        checkpoint_every=1000,
        microbatches=2,
        plots=False,
      )
    )
    variants, high_lrs = CPU_VARIANTS, "0.3"
  else:
    c.data.name = "shakespeare"
    c.opt.lr = a.lr or 1e-3
    variants, high_lrs = COMPARE + GATED + LATENT, "1e-2"
  if a.data:
    c.data.name = a.data
  c.sweep = ml_collections.ConfigDict(
    {
      "variants": ",".join(variants),
      "high_lrs": high_lrs,
      "high_lr_variants": "dense,qk_layernorm",
      "seeds": "0,1,2",
      # The report's targets: the reference arm, the variant held against it at the high
      # learning rates, and the variants that should form at most half of its sink.
      "reference": "dense",
      "stable": "qk_layernorm",
      "sink_free": "softmax_one,sink_logits,gated,sigmoid,softpick",
    }
  )
  return c
