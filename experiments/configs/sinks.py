"""python experiments/sinks.py --config experiments/configs/sinks.py:preset=cpu_sinks

Attention sinks over training for each variant (Gu et al. 2024).
Sink statistics (Sink_1^eps, F-Attn, M-Act, value-state drain, ...) are
probed on fixed held-out length-64 sequences every ``train.probe_every``
steps. Arguments after ``:``: ``preset`` (cpu, cpu_sinks, cpu_long, gpu, tpu), ``lr``.
Arms: ``--config.sweep.variants`` x ``--config.sweep.datasets``, plus, for
dense softmax, the learning rates ``sweep.dense_lrs``; every arm at each seed of
``sweep.seeds`` (one, 0, by default; ``0,1,2`` gives every number a spread), dense also at
``sweep.dense_seeds``. The seeds of an arm train stacked.

- ``cpu_sinks``: the setting in which dense softmax forms a sink on a 2-core
  CPU (found by measurement, experiments/RESULTS.md): bigram-backcopy with 8
  trigger tokens of 64 (Guo et al. 2024), one attention-only layer with one
  head (``model.mlp = "none"``, untied embeddings, RoPE), LR 3e-2, 2000 steps.
  Arms: 14 variants (the gated-linear and delta-rule families as GLA and
  DeltaNet; NSA and DSA, whose branches get a table of their own) at seed 0, dense also at
  seeds 1 and 2 (stacked with seed 0), dense at LRs 1e-2 and 1e-1: 18 runs; the first 16
  took 21 minutes on 2 heavily loaded cores (RESULTS.md, before dense's seeds were
  stacked; less on quiet ones).
- ``cpu_long``: long context on a CPU: T = 16384 tokens sharded over
  ``mesh.context=8`` (8 host devices: ``XLA_FLAGS=--xla_force_host_platform_device_count=8``),
  each layer's attention sequence-sharded (the ring for dense and sink logits,
  state passing for GLA); one attention-only layer with 2 heads at width 32,
  one sequence per step, 20 steps. The sink statistics come from the probes
  (length-2048 sequences) only: ``train.step_stats`` is off, since a recurrent
  family's statistics need its implied T x T weights (2 GiB per [B, T, N, T]
  array at this length; the step ran out of the CPU's 24 GiB).
  Arms: dense, sink_logits, gla: about 2 minutes each on 2 cores.
- ``cpu``: the fast default (the tests use it): 11 variants x Shakespeare and
  bigram-backcopy at the cpu model size (2 layers, 4 heads, MLPs), 240 steps,
  about 5 minutes; no sink forms at this size (RESULTS.md).
- ``gpu``/``tpu``: the cpu variant list plus ``attnjax.train.variants.GATED`` and
  ``LATENT`` (mla); a cpu preset runs mla when named: ``--config.sweep.variants=dense,mla``.
"""

import ml_collections

from attnjax.train.config import apply_preset, base_config, parse_arg
from attnjax.train.variants import GATED, LATENT

CPU_LONG_VARIANTS = "dense,sink_logits,gla"
CPU_SINKS_VARIANTS = (
  "dense,softmax_one,sink_logits,sigmoid,softpick,gated,qk_layernorm,window,"
  "linear,relu,gla,deltanet,nsa,dsa"
)


def _cpu_sinks(c: ml_collections.ConfigDict, lr: float) -> ml_collections.ConfigDict:
  """The sink-forming CPU setting (see the module docstring and RESULTS.md)."""
  c.model.update(
    dict(d_model=64, num_layers=1, num_heads=1, mlp="none", tie_embeddings=False, rope=True)
  )
  c.data.update(
    dict(name="bigram_backcopy", seq_len=64, batch_size=32, bb_vocab_size=64, bb_num_triggers=8)
  )
  c.opt.lr = lr or 3e-2
  c.train.update(
    dict(steps=2000, probe_every=100, eval_every=500, checkpoint_every=500, microbatches=4)
  )
  c.sweep = ml_collections.ConfigDict(
    {
      "setting": "cpu_sinks",
      "variants": CPU_SINKS_VARIANTS,
      "datasets": "bigram_backcopy",
      "seeds": "0",
      "dense_seeds": "1,2",
      "dense_lrs": "0.01,0.1",
      "attention_maps": True,
    }
  )
  return c


def _cpu_long(c: ml_collections.ConfigDict, lr: float) -> ml_collections.ConfigDict:
  """T = 16384 over 8 host devices (context parallelism); see the module docstring."""
  c.model.update(
    dict(d_model=32, num_layers=1, num_heads=2, mlp="none", tie_embeddings=False, rope=True)
  )
  c.data.update(
    dict(name="bigram_backcopy", seq_len=16384, batch_size=1, bb_vocab_size=64, bb_num_triggers=8)
  )
  c.mesh.update(dict(data=1, fsdp=1, tensor=1, context=8))
  c.opt.lr = lr or 3e-2
  c.train.update(
    dict(
      steps=20,
      log_every=5,
      probe_every=10,
      probe_batch=1,
      probe_len=2048,
      eval_every=20,
      eval_batches=1,
      checkpoint_every=10,
      microbatches=1,
      step_stats=False,
    )
  )
  c.sweep = ml_collections.ConfigDict(
    {
      "setting": "cpu_long",
      "variants": CPU_LONG_VARIANTS,
      "datasets": "bigram_backcopy",
      "seeds": "0",
      "dense_seeds": "",
      "dense_lrs": "",
      "attention_maps": False,
    }
  )
  return c


def get_config(arg=None):
  a = parse_arg(arg, preset="cpu", lr=0.0)
  if a.preset == "cpu_sinks":
    return _cpu_sinks(apply_preset(base_config(), "cpu"), a.lr)
  if a.preset == "cpu_long":
    return _cpu_long(apply_preset(base_config(), "cpu"), a.lr)
  c = apply_preset(base_config(), a.preset)
  c.opt.lr = a.lr or (1e-2 if a.preset == "cpu" else 1e-3)
  c.data.bb_vocab_size = 64
  c.data.bb_num_triggers = 3
  if a.preset == "cpu":
    c.train.update(dict(probe_every=40, eval_every=120, checkpoint_every=120))
  variants = (
    "dense,softmax_one,sink_logits,sigmoid,softpick,linear,linear_unnorm,"
    "qk_layernorm,cosine,gated,window"
  )
  if a.preset != "cpu":
    variants = ",".join((variants,) + GATED + LATENT)
  c.sweep = ml_collections.ConfigDict(
    {
      "setting": a.preset,
      "variants": variants,
      "datasets": "shakespeare,bigram_backcopy",
      "seeds": "0",
      "dense_seeds": "",
      "dense_lrs": "",
      "attention_maps": False,
    }
  )
  return c
